"""The MoE layer (Megatron core_v0.14's ``MoELayer``): router -> token dispatch -> experts -> combine (+ shared expert)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.collectives import expert_parallel_size_rank, group_size
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["MoELayer"]

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


class MoELayer(MegatronModule):
    """Mixture-of-experts MLP (Shazeer et al. 2017; Lepikhin et al. 2020; Fedus et al. 2021), a drop-in for ``MLP``.

    Submodules: ``router`` (``TopKRouter``), ``experts`` (``SequentialMLP``, or ``GroupedMLP`` with
    ``moe_grouped_gemm``) holding this rank's ``E_loc = E / EP`` experts, global indices
    ``ep_rank * E_loc + j``, and ``shared_experts`` (``SharedExpertMLP``) when
    ``moe_shared_expert_intermediate_size`` is set. ``token_dispatcher`` (not a module) by
    ``moe_token_dispatcher_type``. Groups from ``model_comm_pgs`` (default: parallel_state's).

    forward(hidden [s, b, h], [s/tp, b, h] under sequence parallelism) -> (output of the same shape, None).

    Raises ValueError in training when the attention TP size is > 1 without sequence parallelism
    (Megatron's rule), and at build for an unknown dispatcher type or an expert-parallel size that is
    not its group's.
    """

    def __init__(self, config: TransformerConfig, layer_number: Optional[int] = None,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None, submodules=None):
        super().__init__(config)
        if model_comm_pgs is None:
            model_comm_pgs = ModelCommProcessGroups.use_mpu_process_groups()
        self.model_comm_pgs = model_comm_pgs
        self.attn_tp_group = model_comm_pgs.tp
        self.ep_size, ep_rank = expert_parallel_size_rank(model_comm_pgs.ep)
        if config.expert_model_parallel_size != self.ep_size:
            raise ValueError(f"TransformerConfig.expert_model_parallel_size={config.expert_model_parallel_size} but "
                             f"the expert-parallel group has {self.ep_size} rank(s): build the model after "
                             "initializing model parallel with the same size")
        self.num_local_experts = divide(config.num_moe_experts, self.ep_size)
        self.local_expert_indices = [ep_rank * self.num_local_experts + j for j in range(self.num_local_experts)]
        self.router = TopKRouter(config, model_comm_pgs)
        experts_class = GroupedMLP if config.moe_grouped_gemm else SequentialMLP
        self.experts = experts_class(self.num_local_experts, config, model_comm_pgs)
        dispatcher_class = _DISPATCHERS.get(config.moe_token_dispatcher_type)
        if dispatcher_class is None:
            raise ValueError(f"moe_token_dispatcher_type must be one of {sorted(_DISPATCHERS)}, "
                             f"got {config.moe_token_dispatcher_type!r}")
        self.token_dispatcher = dispatcher_class(self.num_local_experts, self.local_expert_indices, config,
                                                 model_comm_pgs)
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.shared_experts = SharedExpertMLP(config, model_comm_pgs) if self.use_shared_expert else None
        self.layer_number = None
        if layer_number is not None:
            self.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        """1-based global layer number (for the router's loss tracker and routing stats)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """hidden [s, b, h] -> (output [s, b, h], None)."""
        if self.training and group_size(self.attn_tp_group) > 1 and not self.config.sequence_parallel:
            raise ValueError("During training, performance may degrade if MoE and tensor parallelism "
                             "are enabled without also enabling sequence parallelism.")
        hidden_shape = hidden_states.shape
        probs, routing_map = self.router(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_shape[-1])
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch(tokens, probs, routing_map)
        expert_output, mlp_bias = self.experts(dispatched, tokens_per_expert, permuted_probs)
        output = self.token_dispatcher.combine(expert_output).view(hidden_shape).to(hidden_states.dtype)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output, None
