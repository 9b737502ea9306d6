"""The MoE router (Megatron core_v0.14's ``TopKRouter``): gate logits, top-k routing, capacity, load-balancing losses."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.tensor_parallel.layers import _param_device  # the layers' parameter device
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.moe.collectives import all_reduce_sum, group_size
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    router_gating_linear,
    save_to_aux_losses_tracker,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TopKRouter"]

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class TopKRouter(MegatronModule):
    """Route each token to its top-k experts (Shazeer et al. 2017; Lepikhin et al. 2020, GShard).

    Parameter ``weight`` [E, H] (created in fp32, initialised with ``config.init_method``, cast to
    ``params_dtype``; attribute ``sequence_parallel`` so its gradient is summed over TP under SP).
    Buffers with ``moe_router_enable_expert_bias``: ``expert_bias`` [E] fp32 (persistent) and
    ``local_tokens_per_expert`` [E] fp32 (non-persistent, the counts after dropping of every forward
    under grad, consumed once per step by ``moe_utils.get_updated_expert_bias``).

    forward(x [s, b, h] or [tokens, h]; tokens local to this rank: s/CP, further /TP under SP)
    -> (probs [tokens, E] (0 off the map), routing_map [tokens, E] bool). Steps: logits in
    ``moe_router_dtype``; input jitter and z-loss (training); top-k by the score function
    (``moe_utils.topk_routing_with_score_function``); capacity dropping, on this rank's tokens only
(under sequence parallelism each SP shard drops on its own, as in Megatron); aux / seq-aux loss attached to
    the probs with ``MoEAuxLossAutoScaler`` (training, under grad); expert-bias counts; one
    ``routing_stats.record_routing`` call (counts before dropping, dropped pairs; no host sync; not in the
    no-grad first pass of activation recompute, whose replay records instead).
    """

    def __init__(self, config: TransformerConfig, model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(config)
        if model_comm_pgs is None:
            model_comm_pgs = ModelCommProcessGroups.use_mpu_process_groups(["tp", "cp", "tp_cp"])
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.layer_number: Optional[int] = None
        self.tp_group = model_comm_pgs.tp
        self.cp_group = model_comm_pgs.cp
        self.tp_cp_group = model_comm_pgs.tp_cp
        self.input_jitter = None
        self.weight = torch.nn.Parameter(torch.empty((config.num_moe_experts, config.hidden_size), dtype=torch.float32))
        self.reset_parameters()
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(config.num_moe_experts, dtype=torch.float32), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, dtype=torch.float32))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

    def reset_parameters(self) -> None:
        """Draw the fp32 gate with ``config.init_method`` (on CPU, then moved), cast to ``params_dtype``."""
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=self.config.params_dtype, device=_param_device(self.config))
        setattr(self.weight, "sequence_parallel", self.config.sequence_parallel)

    def set_layer_number(self, layer_number: int) -> None:
        """The 1-based global layer number the loss tracker and routing stats file under."""
        self.layer_number = layer_number

    # -- helpers -------------------------------------------------------------------------------
    def _maintain_float32_expert_bias(self) -> None:
        # Float16Module casts buffers to bf16/fp16; the bias update needs fp32 (and the token counts
        # must stay exact: bf16 counts stop at 256).
        for buffer in (self.expert_bias, self.local_tokens_per_expert):
            if buffer is not None and buffer.dtype != torch.float32:
                buffer.data = buffer.data.to(torch.float32)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """Coefficient of ``aux_loss_type`` (``moe_aux_loss_coeff``, or its entry when the types are a list); 0 if unused."""
        if isinstance(self.routing_type, str):
            return float(self.config.moe_aux_loss_coeff) if self.routing_type == aux_loss_type else 0.0
        if aux_loss_type in self.routing_type:
            coeff = self.config.moe_aux_loss_coeff
            return float(coeff[self.routing_type.index(aux_loss_type)] if isinstance(coeff, (list, tuple)) else coeff)
        return 0.0

    def is_aux_loss_enabled(self) -> bool:
        """True when aux_loss or seq_aux_loss has a positive coefficient."""
        return any(self.get_aux_loss_coeff(t) > 0 for t in ("aux_loss", "seq_aux_loss"))

    def _tp_cp_size(self) -> int:
        return group_size(self.tp_cp_group)

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """logits [..., E] of x [..., H], in ``moe_router_dtype`` when set, else the input's dtype."""
        router_dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, x.dtype)
        return router_gating_linear(x, self.weight, router_dtype)

    def apply_input_jitter(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply x by U(1-eps, 1+eps) noise (``moe_input_jitter_eps``; Fedus et al. 2021, Switch Transformer).

        As in Megatron core_v0.14 the noise is drawn whenever eps is set (eval too) in the default float
        dtype, so a bf16 input is promoted by it.
        """
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return x
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, device=x.device), torch.tensor(1.0 + eps, device=x.device)).rsample
        return x * self.input_jitter(x.shape)

    def _attach(self, activation: torch.Tensor, coeff: float, loss: torch.Tensor, name: str,
                reduce_group) -> torch.Tensor:
        """Log ``loss / coeff`` under ``name`` and attach ``loss`` to ``activation`` for backward."""
        num_layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
        save_to_aux_losses_tracker(name, loss / coeff, self.layer_number, num_layers, reduce_group=reduce_group)
        if self.config.calculate_per_token_loss:
            return MoEAuxLossAutoScaler.apply(activation, loss * activation.shape[0])
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """ST-MoE z-loss ``mean(logsumexp^2) * coeff / |TP-CP|`` attached to the logits (training, under grad)."""
        if self.config.moe_z_loss_coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        coeff = self.config.moe_z_loss_coeff / self._tp_cp_size()
        z_loss = z_loss_func(logits, coeff)
        if self.config.calculate_per_token_loss:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss * logits.shape[0])
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        num_layers = self.config.num_layers + (getattr(self.config, "mtp_num_layers", None) or 0)
        save_to_aux_losses_tracker("z_loss", z_loss / coeff, self.layer_number, num_layers)
        return logits

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map_for_aux_loss):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert = all_reduce_sum(routing_map_for_aux_loss.sum(dim=0), self.tp_cp_group)
        total_num_tokens = routing_map_for_aux_loss.shape[0] * self._tp_cp_size()
        aux_loss = switch_load_balancing_loss_func(scores_for_aux_loss, tokens_per_expert, total_num_tokens,
                                                   self.topk, self.num_experts, coeff)
        return self._attach(probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group)

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map_for_aux_loss, seq_length, bsz):
        """The aux loss per sequence: the batch folds into the expert axis, the sum over sequences / bsz."""
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        scores = scores_for_aux_loss.reshape(seq_length, -1)
        tokens_per_expert = all_reduce_sum(routing_map_for_aux_loss.reshape(seq_length, -1).sum(dim=0),
                                           self.tp_cp_group)
        total_num_tokens = seq_length * self._tp_cp_size()
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total_num_tokens, self.topk,
                                                   self.num_experts, coeff) / bsz
        return self._attach(probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group)

    # -- forward -------------------------------------------------------------------------------
    def routing(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """logits [s, b, E] (or [tokens, E]) -> (probs [tokens, E], routing_map [tokens, E] bool)."""
        if logits.dim() == 3:
            seq_length, bsz = logits.shape[:2]
        else:
            seq_length, bsz = logits.shape[0], 1
        logits = logits.reshape(-1, self.num_experts)
        logits = self.apply_z_loss(logits)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups, group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor, score_function=self.score_function,
            expert_bias=self.expert_bias,
        )
        tokens_before_dropping = routing_map.sum(dim=0)
        dropped = torch.zeros((), dtype=torch.int64, device=routing_map.device)
        if self.config.moe_expert_capacity_factor is not None:
            routed_map = routing_map
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )
            dropped = torch.logical_and(routed_map, ~routing_map).sum()
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map_for_aux_loss, scores_for_aux_loss = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function)
            probs = self._apply_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss)
            probs = self._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss, seq_length, bsz)
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        # Skip the no-grad first pass of a recomputed training forward (full activation recompute):
        # the recomputation in backward records it, once, as it attaches the losses once.
        if self.layer_number is not None and (torch.is_grad_enabled() or not self.training):
            routing_stats.record_routing(self.layer_number, tokens_before_dropping, dropped)
        return probs, routing_map

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [s, b, h] or [tokens, h] -> (probs [tokens, E], routing_map [tokens, E] bool)."""
        self._maintain_float32_expert_bias()
        x = self.apply_input_jitter(x)
        logits = self.gating(x)
        return self.routing(logits)

    def _load_from_state_dict(self, *args, **kwargs):
        self._maintain_float32_expert_bias()
        return super()._load_from_state_dict(*args, **kwargs)
