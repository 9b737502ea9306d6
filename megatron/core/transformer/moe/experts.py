"""MoE experts (Megatron core_v0.14's ``experts.py``): ``SequentialMLP`` (one MLP per local expert) and ``GroupedMLP``.

Both hold this rank's ``E_loc = E / EP`` experts (global indices ``ep_rank * E_loc + j``), split over the
expert-TP group; neither does a collective (the token dispatcher gathers and reduces). Initialisation:
every expert's fc1/fc2 shard is cut from that expert's full fp32 master, and the masters of all E
experts are drawn in global order (those of other ranks' experts are drawn and dropped), so an expert
starts from the same weights at any EP / expert-TP size and in either class (this project's rule that
TP=k starts from the weights of TP=1; Megatron-LM draws expert shards from a per-rank RNG instead).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_activation import bias_activation
from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.tensor_parallel.layers import _expert_tp_size_rank, _param_device  # the expert linears' rules
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.collectives import expert_parallel_size_rank
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SequentialMLP", "GroupedMLP", "grouped_matmul"]


def _draw_master(config: TransformerConfig, init_method, rows: int, cols: int) -> torch.Tensor:
    """One expert linear's full fp32 master [rows, cols], drawn as ColumnParallelLinear/RowParallelLinear do."""
    master = torch.empty(rows, cols, dtype=torch.float32, device=_param_device(config))
    init_method(master)
    return master


def _expert_groups(config: TransformerConfig, model_comm_pgs: Optional[ModelCommProcessGroups]):
    if model_comm_pgs is None:
        model_comm_pgs = ModelCommProcessGroups.use_mpu_process_groups(["ep", "expt_tp"])
    return model_comm_pgs.ep, model_comm_pgs.expt_tp


class SequentialMLP(MegatronModule):
    """This rank's experts as ``local_experts`` (ModuleList of ``MLP(is_expert=True)``, ffn = ``moe_ffn_hidden_size``).

    forward(permuted tokens [N, H] grouped by local expert, tokens_per_expert [E_loc] (list or tensor),
    permuted_probs [N]) -> (output [N, H] partial over expert TP, None). Expert j gets
    ``linear_fc1.weight`` [(2F|F)/ETP, H] and ``linear_fc2.weight`` [H, F/ETP].
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        super().__init__(config)
        self.num_local_experts = num_local_experts
        ep_group, self.tp_group = _expert_groups(config, model_comm_pgs)
        ep_rank = expert_parallel_size_rank(ep_group)[1]
        first = ep_rank * num_local_experts
        ffn = config.moe_ffn_hidden_size
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        experts = []
        for g in range(config.num_moe_experts):
            if first <= g < first + num_local_experts:
                experts.append(MLP(config, is_expert=True, ffn_hidden_size=ffn, tp_group=self.tp_group))
            elif config.perform_initialization:
                # Another rank's expert: consume its masters so later experts draw what EP=1 draws.
                _draw_master(config, config.init_method, fc1_rows, config.hidden_size)
                _draw_master(config, config.output_layer_init_method, config.hidden_size, ffn)
        self.local_experts = torch.nn.ModuleList(experts)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert,
                permuted_probs: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """[N, H] tokens grouped by local expert -> ([N, H], None); probs scale each token after the activation."""
        counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                                   else tokens_per_expert)]
        if self.num_local_experts == 1:
            output, _ = self.local_experts[0](permuted_local_hidden_states, permuted_probs)
            return output, None
        token_chunks = torch.split(permuted_local_hidden_states, counts)
        prob_chunks = torch.split(permuted_probs, counts)
        outputs = [expert(tokens, probs)[0]
                   for expert, tokens, probs in zip(self.local_experts, token_chunks, prob_chunks)]
        return torch.cat(outputs, dim=0), None


_GROUPED_MM_WORKS: Dict[Tuple[str, torch.dtype, int, int, int], bool] = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward refuses the
    stride-0 gradient of e.g. ``out.sum()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` exists and runs forward and backward for this device,
    dtype and weight shape (bf16 on CUDA SM >= 8.0 with 16-byte aligned dims; some CPU builds take bf16/fp32).

    Probed once per (device type, dtype, groups, K, N) on small random operands; any error means no.
    """
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        return False
    groups, k, n = w.shape
    key = (x.device.type, x.dtype, groups, k, n)
    if key not in _GROUPED_MM_WORKS:
        try:
            with torch.enable_grad():
                # Constant operands: the probe must not consume the RNG (dropout masks, resumes).
                a = torch.ones(groups + 1, k, dtype=x.dtype, device=x.device, requires_grad=True)
                b = torch.ones(groups, k, n, dtype=w.dtype, device=w.device, requires_grad=True)
                offs = torch.arange(1, groups + 1, dtype=torch.int32, device=x.device)
                offs[-1] = groups + 1
                fn(a, b, offs=offs).backward(torch.ones(groups + 1, n, dtype=x.dtype, device=x.device))
            _GROUPED_MM_WORKS[key] = True
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            _GROUPED_MM_WORKS[key] = False
    return _GROUPED_MM_WORKS[key]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: List[int],
                   use_grouped_mm: Optional[bool] = None) -> torch.Tensor:
    """Row block i of x [N, K] (``tokens_per_expert[i]`` rows) times w[i] [K, M] -> [N, M].

    One ``torch.nn.functional.grouped_mm`` call where it exists and applies (``_grouped_mm_applies``),
    else a loop of matmuls with the same result (up to the GEMM's summation order).
    ``use_grouped_mm`` forces a path (tests; False: the loop).
    """
    if use_grouped_mm is None:
        use_grouped_mm = _grouped_mm_applies(x, w)
    if use_grouped_mm:
        offs = torch.cumsum(torch.tensor(tokens_per_expert, device=x.device, dtype=torch.int32), dim=0,
                            dtype=torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offs))
    chunks = torch.split(x, tokens_per_expert)
    return torch.cat([chunk @ w[i] for i, chunk in enumerate(chunks)], dim=0)


class GroupedMLP(MegatronModule):
    """All local experts in two grouped GEMMs (``moe_grouped_gemm``; Megatron's local-spec ``GroupedMLP``).

    ``weight1`` [H, E_loc * (2F|F)/ETP] (expert j's fc1 shard transposed, columns ``[gate_r | up_r]`` with
    SwiGLU) and ``weight2`` [E_loc * F/ETP, H] (expert j's fc2 shard transposed), both ``allreduce=False``,
    ``tensor_model_parallel`` with partition dims 1 and 0. Same weights and results as ``SequentialMLP``.
    forward as ``SequentialMLP.forward``.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None):
        super().__init__(config)
        if config.add_bias_linear:
            raise ValueError("GroupedMLP does not support add_bias_linear (bias is not supported for MoE)")
        self.num_local_experts = num_local_experts
        ep_group, self.tp_group = _expert_groups(config, model_comm_pgs)
        tp_size, tp_rank = _expert_tp_size_rank(self.tp_group)  # as the expert linears of SequentialMLP
        ep_rank = expert_parallel_size_rank(ep_group)[1]
        ffn = config.moe_ffn_hidden_size
        glu = config.gated_linear_unit
        self.ffn_per_partition = divide(ffn, tp_size)
        fc1_cols = (2 if glu else 1) * self.ffn_per_partition
        hidden = config.hidden_size
        device = _param_device(config)
        w1 = torch.empty(hidden, num_local_experts * fc1_cols, dtype=config.params_dtype, device=device)
        w2 = torch.empty(num_local_experts * self.ffn_per_partition, hidden, dtype=config.params_dtype, device=device)
        if config.perform_initialization:
            first = ep_rank * num_local_experts
            fc1_rows = 2 * ffn if glu else ffn
            for g in range(config.num_moe_experts):
                m1 = _draw_master(config, config.init_method, fc1_rows, hidden)
                m2 = _draw_master(config, config.output_layer_init_method, hidden, ffn)
                if not first <= g < first + num_local_experts:
                    continue
                j = g - first
                # The expert-TP shard as ColumnParallelLinear cuts it (stride 2 with GLU: [gate_r; up_r]).
                parts = (m1[:ffn], m1[ffn:]) if glu else (m1,)
                shard1 = torch.cat([p.chunk(tp_size, dim=0)[tp_rank] for p in parts], dim=0)
                shard2 = m2.chunk(tp_size, dim=1)[tp_rank]
                w1[:, j * fc1_cols:(j + 1) * fc1_cols] = shard1.t().to(w1.dtype)
                w2[j * self.ffn_per_partition:(j + 1) * self.ffn_per_partition] = shard2.t().to(w2.dtype)
        self.weight1 = torch.nn.Parameter(w1)
        self.weight2 = torch.nn.Parameter(w2)
        for param, dim in ((self.weight1, 1), (self.weight2, 0)):
            setattr(param, "allreduce", False)
            setattr(param, "tensor_model_parallel", True)
            setattr(param, "partition_dim", dim)
            setattr(param, "partition_stride", 1)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert,
                permuted_probs: torch.Tensor) -> Tuple[torch.Tensor, None]:
        """[N, H] tokens grouped by local expert -> ([N, H], None)."""
        counts = [int(c) for c in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                                   else tokens_per_expert)]
        hidden = self.config.hidden_size
        w1 = self.weight1.view(hidden, self.num_local_experts, -1).transpose(0, 1)  # [E_loc, H, (2F|F)/tp]
        w2 = self.weight2.view(self.num_local_experts, -1, hidden)  # [E_loc, F/tp, H]
        use_gmm = None if self.config.moe_grouped_gemm else False
        fc1_output = grouped_matmul(permuted_local_hidden_states, w1, counts, use_gmm)
        intermediate = bias_activation(fc1_output, None, self.config.activation_func, self.config.gated_linear_unit)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(intermediate.dtype)
        return grouped_matmul(intermediate, w2, counts, use_gmm), None
