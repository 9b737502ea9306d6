"""MoE helpers (Megatron core_v0.14's ``moe_utils.py``): routing math, auxiliary losses, capacity, permutation, loss tracker.

Every formula here follows ``megatron/core/transformer/moe/moe_utils.py`` at core_v0.14.0 (spec
``megatron-scale.md`` section 3.4); the code is this project's own.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device

__all__ = [
    "switch_load_balancing_loss_func", "z_loss_func", "get_capacity", "MoEAuxLossAutoScaler", "permute",
    "unpermute", "sort_chunks_by_idxs", "group_limited_topk", "topk_routing_with_score_function",
    "compute_routing_scores_for_aux_loss", "apply_router_token_dropping", "router_gating_linear",
    "save_to_aux_losses_tracker", "clear_aux_losses_tracker", "reduce_aux_losses_tracker_across_ranks",
    "get_moe_layer_wise_logging_tracker", "track_moe_metrics", "get_updated_expert_bias",
]


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------
def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens: int,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float) -> torch.Tensor:
    """Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4), one rank's share.

    probs [tokens, E] (this rank's scores), tokens_per_expert [E] (counts over the whole TP-CP group),
    ``total_num_tokens`` T = tokens of the whole group. Returns the scalar
    ``E * coeff / (topk * T^2) * sum_i (sum_tokens probs_i) * tokens_per_expert_i``; summed over the
    group's ranks this is ``coeff * E * sum_i f_i P_i`` with ``f_i = count_i / (topk T)``, ``P_i = sum p_i / T``.
    """
    aggregated_probs_per_expert = probs.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss (Zoph et al. 2022, ST-MoE, eq. 5): ``mean_tokens(logsumexp(logits)^2) * coeff``; logits [tokens, E]."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None) -> int:
    """Expert capacity ``ceil(num_tokens / num_experts * capacity_factor)`` (at least ``min_capacity``).

    The router passes ``num_tokens = local tokens * topk`` (its own tokens, before dispatch).
    """
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward returns the activation unchanged, backward adds
    ``d aux_loss = main_loss_backward_scale`` so the loss trains the router without joining the main loss.

    The schedule sets the class-level scale once per step with :meth:`set_loss_scale` (Megatron:
    ``grad_scale_func(1) / num_microbatches``); 1.0 until then.
    """

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = torch.tensor(1.0, device=aux_loss.device)
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the backward scale of every auxiliary loss (a scalar tensor, the main loss's scale)."""
        scale = torch.as_tensor(scale)
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None \
                or MoEAuxLossAutoScaler.main_loss_backward_scale.device != scale.device:
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale.copy_(scale)


# ------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------
class _RouterGatingLinear(torch.autograd.Function):
    """``logits = x W^T`` computed in ``router_dtype``; gradients returned in the input/weight dtypes."""

    @staticmethod
    def forward(ctx, inp, weight, router_dtype):
        ctx.save_for_backward(inp, weight)
        ctx.router_dtype = router_dtype
        shape = inp.shape
        out = torch.mm(inp.reshape(-1, shape[-1]).to(router_dtype), weight.to(router_dtype).t())
        return out.view(*shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        dtype = ctx.router_dtype
        g = grad_output.reshape(-1, grad_output.size(-1)).to(dtype)
        x = inp.reshape(-1, inp.size(-1))
        grad_input = torch.mm(g, weight.to(dtype)).to(inp.dtype).view(inp.shape)
        grad_weight = torch.mm(g.t(), x.to(dtype)).to(weight.dtype)
        return grad_input, grad_weight, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype) -> torch.Tensor:
    """Router logits [..., E] = inp [..., H] @ weight [E, H]^T in ``router_dtype`` (fp32/fp64 or the input's)."""
    return _RouterGatingLinear.apply(inp, weight, router_dtype)


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to ``group_topk`` of ``num_groups`` expert groups (DeepSeek-V2/V3 device/node-limited routing).

    A group's score is the sum of its top ``topk // group_topk`` scores; the best ``group_topk`` groups
    stay, the rest are masked to -inf, then top-k. scores [tokens, E] -> (values [tokens, k], indices [tokens, k]).
    """
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    masked_scores = scores.masked_fill(~score_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[torch.Tensor] = None
                                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing probabilities and map from logits [tokens, E].

    softmax (post-softmax): top-k over logits, softmax over the k values; ``use_pre_softmax``: softmax
    over E, then top-k; sigmoid: top-k over ``sigmoid + expert_bias`` (the bias selects only), the
    selected sigmoid scores normalised to sum 1 when topk > 1. ``scaling_factor`` multiplies the probs.
    Returns (probs [tokens, E] zero off the map, routing_map [tokens, E] bool).

    Raises ValueError for an unknown ``score_function``.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits [num_tokens, num_experts], got {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape

    def compute_topk(scores):
        if group_topk:
            return group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = compute_topk(scores)
        else:
            scores, top_indices = compute_topk(logits)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top_indices = compute_topk(scores + expert_bias)
            scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        else:
            scores, top_indices = compute_topk(scores)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"invalid moe_router_score_function {score_function!r}: choose softmax or sigmoid")

    if scaling_factor:
        probs = probs * scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The aux loss's own routing: fresh softmax over E (or normalised sigmoid) and a fresh top-k map,
    with no expert bias, no groups and no dropping. logits [tokens, E] -> (routing_map bool, scores fp32)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"invalid moe_router_score_function {score_function!r}: choose softmax or sigmoid")
    _, top_indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    return routing_map, scores


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs", pad_to_capacity: bool = False
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Enforce the expert capacity ``get_capacity(tokens * topk, E, capacity_factor)`` on this rank's tokens.

    ``probs`` policy keeps each expert's ``cap`` highest-probability tokens, ``position`` the first
    ``cap`` routed tokens (``torch.topk`` over the 0/1 map). With ``pad_to_capacity`` the map becomes
    the capacity mask itself (every expert gets exactly ``cap`` rows; padding rows have prob 0).
    probs/map [tokens, E] -> (probs, map) of the same shape.

    Raises ValueError for an unknown policy or a capacity above the token count (lower the factor).
    """
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        raise ValueError(f"moe_expert_capacity_factor={capacity_factor} gives capacity {capacity} > "
                         f"{num_tokens} local tokens; use a smaller factor")
    if drop_policy == "probs":
        _, capacity_indices = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        _, capacity_indices = torch.topk(routing_map.int(), k=capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"invalid moe_token_drop_policy {drop_policy!r}: choose probs or position")
    capacity_mask = torch.zeros_like(routing_map).scatter(0, capacity_indices, True)
    final_map = capacity_mask if pad_to_capacity else torch.logical_and(routing_map, capacity_mask)
    return routing_probs * final_map, final_map


# ------------------------------------------------------------------------------------------------
# Permutation
# ------------------------------------------------------------------------------------------------
def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Group (token, expert) pairs by expert: tokens [T, H], routing_map [T, E] bool, probs [T, E] or None ->
    (permuted tokens [N, H] expert-major, in token order inside an expert; permuted probs [N] or None;
    sorted_indices [N], the source token of each row). N = routing_map.sum()."""
    num_tokens = tokens.size(0)
    num_experts = routing_map.size(1)
    map_t = routing_map.bool().t().contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(map_t)
    permuted_probs = probs.t().contiguous().masked_select(map_t) if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: Optional[torch.Tensor] = None, routing_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`permute`: sum each token's rows (weighted by its probs when ``probs`` [T, E] is
    given, with the same ``routing_map``) back into [T, H] = ``restore_shape``."""
    hidden = restore_shape[-1]
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute with probs needs the routing_map")
        permuted_probs = probs.t().contiguous().masked_select(routing_map.t().contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    return output.scatter_add(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)


def sort_chunks_by_idxs(input_: torch.Tensor, split_sizes: List[int], sorted_idxs: List[int],
                        probs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Split dim 0 into chunks of ``split_sizes`` and concatenate them in the order ``sorted_idxs``."""
    chunks = torch.split(input_, split_sizes, dim=0)
    output = torch.cat([chunks[i] for i in sorted_idxs], dim=0)
    if probs is None:
        return output, None
    prob_chunks = torch.split(probs, split_sizes, dim=0)
    return output, torch.cat([prob_chunks[i] for i in sorted_idxs], dim=0)


# ------------------------------------------------------------------------------------------------
# Logging tracker (per layer, accumulated over micro-batches; Megatron's names)
# ------------------------------------------------------------------------------------------------
_MOE_LAYER_WISE_LOGGING_TRACKER: Dict[str, dict] = {}


def get_moe_layer_wise_logging_tracker() -> Dict[str, dict]:
    """``{name: {"values": [num_layers] tensor, "reduce_group": group, "avg_group": group}}``."""
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: Optional[int], num_layers: int,
                               reduce_group=None, avg_group=None) -> None:
    """Add ``loss`` (detached) into ``tracker[name]["values"][layer_number - 1]``; no-op without a layer number."""
    if layer_number is None:
        return
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:
        tracker[name] = {"values": torch.zeros(num_layers, device=loss.device)}
    tracker[name]["values"][layer_number - 1] += loss.detach().to(tracker[name]["values"].dtype)
    tracker[name]["reduce_group"] = reduce_group
    tracker[name]["avg_group"] = avg_group


def clear_aux_losses_tracker() -> None:
    """Zero every tracked value (the names stay)."""
    for entry in get_moe_layer_wise_logging_tracker().values():
        entry["values"].zero_()


def _all_reduce(values: torch.Tensor, group, average: bool) -> None:
    """In-place SUM (or mean) of ``values`` over ``group`` (gloo has no AVG: sum, then divide)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    buf = values.to(get_collective_device(group))
    dist.all_reduce(buf, group=group)
    if average:
        buf = buf / dist.get_world_size(group)
    values.copy_(buf.to(values.device))


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[List[str]] = None) -> None:
    """SUM over the pipeline group, SUM over each entry's reduce group, AVG over its avg group, then AVG over
    the data-parallel-with-CP group (Megatron's order). Single process without groups: nothing to do."""
    tracker = get_moe_layer_wise_logging_tracker()
    names = list(tracker) if track_names is None else track_names
    initialized = dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    for name in names:
        if name not in tracker:
            continue
        values = tracker[name]["values"]
        if initialized:
            _all_reduce(values, parallel_state.get_pipeline_model_parallel_group(), average=False)
        _all_reduce(values, tracker[name].get("reduce_group"), average=False)
        _all_reduce(values, tracker[name].get("avg_group"), average=True)
        if initialized:
            _all_reduce(values, parallel_state.get_data_parallel_group(with_context_parallel=True), average=True)


def _num_moe_layers(num_layers: Optional[int], moe_layer_freq: Optional[Union[int, List[int]]]) -> int:
    if moe_layer_freq is None:
        return num_layers
    if isinstance(moe_layer_freq, int):
        return sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    if isinstance(moe_layer_freq, (list, tuple)):
        return sum(moe_layer_freq)
    raise ValueError(f"invalid moe_layer_freq {moe_layer_freq!r}")


def track_moe_metrics(loss_scale: float, iteration: int, writer, wandb_writer=None, total_loss_dict=None,
                      per_layer_logging: bool = False, force_initialize: bool = False,
                      track_names: Optional[List[str]] = None, num_layers: Optional[int] = None,
                      moe_layer_freq: Optional[Union[int, List[int]]] = None) -> None:
    """Reduce the tracker across ranks, add ``sum_layers * loss_scale / num_moe_layers`` per name into
    ``total_loss_dict`` and the writers (``moe/{name}_layer_{i}`` with ``per_layer_logging``), then clear it.

    ``force_initialize`` creates zero entries for ``track_names`` so every rank joins the collectives.
    """
    tracker = get_moe_layer_wise_logging_tracker()
    if force_initialize and track_names is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for key in track_names:
            if key not in tracker:
                tracker[key] = {"values": torch.zeros(num_layers, device=device), "reduce_group": None,
                                "avg_group": None}
    reduce_aux_losses_tracker_across_ranks(track_names)
    num_moe_layers = _num_moe_layers(num_layers, moe_layer_freq)
    for name, entry in tracker.items():
        loss_list = entry["values"].float() * loss_scale
        mean_over_layers = loss_list.sum() / num_moe_layers
        if total_loss_dict is not None:
            if name not in total_loss_dict:
                total_loss_dict[name] = mean_over_layers
            else:
                total_loss_dict[name] += mean_over_layers
        if writer is not None:
            writer.add_scalar(name, mean_over_layers, iteration)
            if per_layer_logging:
                for i, loss in enumerate(loss_list.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", loss, iteration)
        if wandb_writer:
            wandb_writer.log({name: mean_over_layers}, iteration)
            if per_layer_logging:
                wandb_writer.log({f"moe/{name}_layer_{i}": loss for i, loss in enumerate(loss_list.tolist())},
                                 iteration)
    clear_aux_losses_tracker()


# ------------------------------------------------------------------------------------------------
# Aux-loss-free expert bias (Wang et al. 2024, arXiv:2408.15664)
# ------------------------------------------------------------------------------------------------
def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            expert_bias_update_rate: float, group=None) -> torch.Tensor:
    """``expert_bias + sign(mean(count) - count) * rate`` after summing ``tokens_per_expert`` ([E] or
    [layers, E], in place) over the TP x DP x CP group (``group`` overrides; none in a single process)."""
    with torch.no_grad():
        if group is None and dist.is_available() and dist.is_initialized() \
                and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        _all_reduce(tokens_per_expert, group, average=False)
        average_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        offset = average_tokens - tokens_per_expert
        return expert_bias + torch.sign(offset) * expert_bias_update_rate
