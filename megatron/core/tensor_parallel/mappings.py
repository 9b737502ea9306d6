"""Autograd-aware collectives over the tensor-parallel group (Megatron's copy/reduce/scatter/gather regions)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import step_timing
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.utils import divide, split_tensor_along_last_dim

# torch >= 2.13 renamed the flat-tensor collectives; keep working on older releases.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------------------------
# Raw collectives (no autograd). Each is the identity when the TP group has a single rank.
# --------------------------------------------------------------------------------------------
def _reduce(input_: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """All-reduce (sum) ``input_`` over the TP group.

    ``inplace`` reuses the buffer; only safe for freshly computed activations. Gradients arrive
    possibly aliased with other branches' gradients (e.g. after an add), so they are copied.
    """
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    output = input_.contiguous() if inplace else input_.clone(memory_format=torch.contiguous_format)
    with step_timing.section("tp_comm"):
        dist.all_reduce(output, group=get_tensor_model_parallel_group())
    return output


def _split_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    return split_tensor_along_last_dim(input_, world_size)[get_tensor_model_parallel_rank()].contiguous()


def _split_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's chunk of the first (sequence) dimension."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    chunk = divide(input_.size(0), world_size)
    offset = get_tensor_model_parallel_rank() * chunk
    return input_[offset:offset + chunk].contiguous()


def _gather_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along the last dimension."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    # Gather on dim 0 (one flat collective), then move the rank blocks onto the last dim.
    gathered = _gather_along_first_dim(input_)
    return torch.cat(gathered.chunk(world_size, dim=0), dim=-1).contiguous()


def _gather_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along the first (sequence) dimension."""
    output, _ = _start_gather_along_first_dim(input_, async_op=False)
    return output


def _reduce_scatter_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group and keep this rank's chunk of the first dimension."""
    output, _ = _start_reduce_scatter_along_first_dim(input_, async_op=False)
    return output


class PendingCollective:
    """A collective launched with ``async_op=True`` and the tensors it reads and writes.

    The tensors are kept alive until :meth:`wait` returns, whatever the backend does with them, so
    a caller may drop its own references (e.g. to a temporary ``.contiguous()`` copy) right away.
    """

    def __init__(self, work: dist.Work, *tensors: torch.Tensor):
        self._work = work
        self._tensors = tensors

    def wait(self) -> None:
        """Block (CPU) or make the current CUDA stream wait until the collective has finished."""
        with step_timing.section("tp_comm"):
            self._work.wait()
        self._tensors = ()


def _launch(collective, output: torch.Tensor, input_: torch.Tensor, async_op: bool) -> Optional[PendingCollective]:
    if async_op:  # the wait, not the launch, is where the time goes (PendingCollective.wait)
        work = collective(output, input_, group=get_tensor_model_parallel_group(), async_op=True)
    else:
        with step_timing.section("tp_comm"):
            work = collective(output, input_, group=get_tensor_model_parallel_group(), async_op=False)
    return PendingCollective(work, output, input_) if async_op else None


def _start_gather_along_first_dim(input_: torch.Tensor, async_op: bool = True
                                  ) -> Tuple[torch.Tensor, Optional[PendingCollective]]:
    """Launch the all-gather of [s/tp, ...] into a new [s, ...] buffer; return (buffer, pending).

    With ``async_op`` the buffer is valid only after ``pending.wait()``. At TP=1 (or without
    ``async_op``) pending is None; at TP=1 the input itself is returned.
    """
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_, None
    shape = list(input_.shape)
    shape[0] *= world_size
    output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    return output, _launch(_all_gather_flat, output, input_.contiguous(), async_op)


def _start_reduce_scatter_along_first_dim(input_: torch.Tensor, async_op: bool = True
                                          ) -> Tuple[torch.Tensor, Optional[PendingCollective]]:
    """Launch the reduce-scatter (sum) of [s, ...] into a new [s/tp, ...] buffer; return (buffer, pending).

    With ``async_op`` the buffer is valid, and ``input_`` may be changed, only after ``pending.wait()``.
    """
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_, None
    shape = list(input_.shape)
    shape[0] = divide(shape[0], world_size)
    output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    return output, _launch(_reduce_scatter_flat, output, input_.contiguous(), async_op)


def _start_reduce(input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[PendingCollective]]:
    """Launch the in-place all-reduce (sum) of a freshly computed ``input_`` (no other reader);
    return (the reduced tensor, valid after ``pending.wait()``, and pending; None at TP=1)."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_, None
    output = input_.contiguous()
    work = dist.all_reduce(output, group=get_tensor_model_parallel_group(), async_op=True)
    return output, PendingCollective(work, output)


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------
class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_, inplace=True)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        # A gathered tensor consumed by TP-partitioned compute carries partial grads that must be
        # summed; one consumed redundantly on every rank only needs its own chunk back.
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward identity, backward all-reduce over TP (input of a column-parallel matmul)."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward all-reduce over TP, backward identity (output of a row-parallel matmul)."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: keep own chunk of the last dim ([..., h] -> [..., h/tp]); backward: all-gather it."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: all-gather the last dim ([..., h/tp] -> [..., h]); backward: keep own chunk."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: keep own chunk of the seq dim ([s, b, h] -> [s/tp, b, h]); backward: all-gather."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_: torch.Tensor, tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """Forward: all-gather the seq dim ([s/tp, b, h] -> [s, b, h]).

    Backward: reduce-scatter on the seq dim, or just split when ``tensor_parallel_output_grad`` is
    False (the gathered tensor fed identical computation on every rank).
    """
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Forward: sum over TP and keep own seq chunk ([s, b, h] -> [s/tp, b, h]); backward: all-gather."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
