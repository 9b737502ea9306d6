"""Autograd-correct collectives over an explicit process group for the MoE token dispatchers.

Megatron's dispatchers use ``gather_from_sequence_parallel_region(x, group=...)``,
``reduce_scatter_to_sequence_parallel_region(x, group=...)`` and ``all_to_all(group, x, out_splits,
in_splits)`` (``megatron/core/tensor_parallel/mappings.py``); this project's TP mappings know only the TP
group, so these take the group (expert-parallel, expert-TP or expert-TP x EP) as an argument. Uneven
splits (the all-to-all's token counts, the expert-TP gather after it) go through ``all_to_all_single``,
which NCCL and gloo both implement; equal ones through the flat all-gather / reduce-scatter. Tensors travel on ``get_collective_device(group)`` and come back to
the caller's device. A ``None`` group or a group of one rank is the identity.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device

# torch >= 2.13 renamed the flat-tensor collectives (as in tensor_parallel/mappings.py).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["group_size", "group_rank", "expert_parallel_size_rank", "all_to_all", "gather_along_first_dim", "reduce_scatter_along_first_dim",
           "all_reduce_sum"]


def group_size(group) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def expert_parallel_size_rank(ep_group) -> tuple:
    """(EP size, EP rank) that decide which experts a rank builds.

    parallel_state's own expert-parallel group (or None) answers through its getters, which honour
    ``set_expert_model_parallel_world_size/rank`` (converters build the model of a rank they are not)
    and give (1, 0) in a single process; another group answers for itself.
    """
    if ep_group is None or ep_group is parallel_state.get_expert_model_parallel_group(check_initialized=False):
        try:
            return (parallel_state.get_expert_model_parallel_world_size(),
                    parallel_state.get_expert_model_parallel_rank())
        except AssertionError:  # several processes but parallel_state not initialised: no expert parallelism
            return group_size(ep_group), group_rank(ep_group)
    return group_size(ep_group), group_rank(ep_group)


def _on_comm_device(tensor: torch.Tensor, group) -> torch.Tensor:
    return tensor.to(get_collective_device(group)).contiguous()


def _raw_all_to_all(input_: torch.Tensor, group, output_splits: Optional[List[int]],
                    input_splits: Optional[List[int]]) -> torch.Tensor:
    """all_to_all_single over dim 0: rank i receives ``output_splits[j]`` rows from rank j."""
    n = group_size(group)
    if n == 1:
        return input_
    device = input_.device
    send = _on_comm_device(input_, group)
    rows = send.size(0) if output_splits is None else int(sum(output_splits))
    recv = torch.empty((rows,) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, output_split_sizes=output_splits, input_split_sizes=input_splits,
                           group=group)
    return recv.to(device)


def _raw_gather(input_: torch.Tensor, group, split_sizes: Optional[List[int]]) -> torch.Tensor:
    """Concatenate every rank's rows (rank order); ``split_sizes[j]`` rows from rank j (None: equal)."""
    n = group_size(group)
    if n == 1:
        return input_
    if split_sizes is None or all(size == input_.size(0) for size in split_sizes):
        device = input_.device
        send = _on_comm_device(input_, group)
        out = torch.empty((n * send.size(0),) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        _all_gather_flat(out, send, group=group)
        return out.to(device)
    # Uneven sizes: every rank sends its whole tensor to every rank through one all-to-all.
    send = torch.cat([input_] * n, dim=0) if input_.size(0) else input_
    return _raw_all_to_all(send, group, list(split_sizes), [input_.size(0)] * n)


def _raw_reduce_scatter(input_: torch.Tensor, group, split_sizes: Optional[List[int]]) -> torch.Tensor:
    """Sum over ranks of the rows ``split_sizes[me]`` block (rank order); None: equal blocks."""
    n = group_size(group)
    if n == 1:
        return input_
    if split_sizes is None or len(set(split_sizes)) == 1:
        if input_.size(0) % n:
            raise ValueError(f"reduce-scatter of {input_.size(0)} rows over {n} ranks needs equal blocks")
        device = input_.device
        send = _on_comm_device(input_, group)
        out = torch.empty((send.size(0) // n,) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        _reduce_scatter_flat(out, send, group=group)
        return out.to(device)
    # Uneven blocks: each rank receives every rank's copy of its block through one all-to-all, then sums.
    me = group_rank(group)
    received = _raw_all_to_all(input_, group, [split_sizes[me]] * n, list(split_sizes))
    # Sum the n received blocks in rank order: the same order on every rank, so results agree.
    return received.view(n, split_sizes[me], *input_.shape[1:]).sum(dim=0)


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with (output_splits, input_splits); backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, group, input_, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _raw_all_to_all(input_, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_output):
        return None, _raw_all_to_all(grad_output, ctx.group, ctx.input_splits, ctx.output_splits), None, None


class _GatherFirstDim(torch.autograd.Function):
    """Forward: all-gather rows; backward: reduce-scatter (sum) of the gradient back to each rank's rows."""

    @staticmethod
    def forward(ctx, input_, group, split_sizes):
        ctx.group, ctx.split_sizes = group, split_sizes
        return _raw_gather(input_, group, split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _raw_reduce_scatter(grad_output, ctx.group, ctx.split_sizes), None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Forward: reduce-scatter (sum) rows; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, input_, group, split_sizes):
        ctx.group, ctx.split_sizes = group, split_sizes
        return _raw_reduce_scatter(input_, group, split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        return _raw_gather(grad_output, ctx.group, ctx.split_sizes), None, None


def all_to_all(group, input_: torch.Tensor, output_splits: Optional[List[int]] = None,
               input_splits: Optional[List[int]] = None) -> torch.Tensor:
    """Megatron's ``all_to_all(group, input, output_split_sizes, input_split_sizes)`` on dim 0, with autograd.

    input_ [sum(input_splits), ...] -> [sum(output_splits), ...]; None splits mean equal blocks.
    """
    if group_size(group) == 1:
        return input_
    return _AllToAll.apply(group, input_, output_splits, input_splits)


def gather_along_first_dim(input_: torch.Tensor, group, output_split_sizes: Optional[List[int]] = None
                           ) -> torch.Tensor:
    """All-gather over ``group`` on dim 0 (rank order), backward reduce-scatter (sum); ``output_split_sizes``:
    rows from each rank (None: all equal to this rank's)."""
    if group_size(group) == 1:
        return input_
    if not input_.requires_grad:
        return _raw_gather(input_, group, output_split_sizes)
    return _GatherFirstDim.apply(input_, group, output_split_sizes)


def reduce_scatter_along_first_dim(input_: torch.Tensor, group, input_split_sizes: Optional[List[int]] = None
                                   ) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's block of dim 0; backward all-gather.
    ``input_split_sizes``: the block of each rank (None: equal blocks)."""
    if group_size(group) == 1:
        return input_
    return _ReduceScatterFirstDim.apply(input_, group, input_split_sizes)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` without autograd (counts); returns a new tensor on the caller's device."""
    if group_size(group) == 1:
        return tensor
    buf = tensor.to(get_collective_device(group)).clone()
    dist.all_reduce(buf, group=group)
    return buf.to(tensor.device)
