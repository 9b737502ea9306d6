"""Global grad norm across model-parallel ranks, clipping by that norm, and zero counting."""
import math
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device


def _tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _expert_tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_rank()


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the tied output-layer copy of the embedding (its grad is counted on the first stage)."""
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param: torch.nn.Parameter, tp_rank: Optional[int] = None) -> bool:
    """True if ``param`` is TP-partitioned, or it is replicated across TP and this is TP rank 0."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return (_tp_rank() if tp_rank is None else tp_rank) == 0


def get_data_parallel_group_if_dtensor(tensors):
    """The process group of the (one-dimensional) mesh the DTensors among ``tensors`` are sharded over
    (FSDP2's data-parallel group), or None when none is a DTensor."""
    from torch.distributed.tensor import DTensor

    for tensor in tensors:
        if isinstance(tensor, DTensor):
            return tensor.device_mesh.get_group()
    return None


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def get_grad_norm_fp32(grads_for_norm: Union[List[torch.Tensor], torch.Tensor], norm_type: float = 2,
                       model_parallel_group=None) -> float:
    """Norm of all grads together, reduced over ``model_parallel_group``.

    The caller passes only the grads that count (see ``param_is_not_shared`` and
    ``param_is_not_tensor_parallel_duplicate``); each rank contributes its local part.
    L-p norms sum ``|g|^p`` locally, all-reduce SUM, then take the p-th root; the inf-norm uses MAX.

    Args:
        grads_for_norm: grad tensors of any shape/dtype (accumulated in fp64 on CPU, fp32 on CUDA).
        norm_type: p (2 by default) or ``inf``.
        model_parallel_group: group to reduce over; None reduces nothing (single process).

    Returns:
        The total norm as a Python float (NaN/Inf when a grad is non-finite).
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    # FSDP2: the grads are DTensor shards; their norms^p are summed over the mesh group first (Megatron's
    # get_data_parallel_group_if_dtensor), then over the model-parallel group as for any grad.
    dtensor_group = get_data_parallel_group_if_dtensor(grads_for_norm)
    grads_for_norm = [to_local_if_dtensor(g) for g in grads_for_norm]
    norm_type = float(norm_type)
    # The norms are computed where the grads are; only the [1] total moves to the reduction's device.
    comm_device = get_collective_device(model_parallel_group)
    device = grads_for_norm[0].device if grads_for_norm else comm_device
    if norm_type == math.inf:
        if grads_for_norm:
            total = torch.stack([g.detach().abs().max().float() for g in grads_for_norm]).max().reshape(1)
        else:
            total = torch.zeros(1, dtype=torch.float, device=comm_device)
        for group in (dtensor_group, model_parallel_group):
            if group is not None:
                total = total.to(get_collective_device(group))
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total.item()
    # CPU kernels sum a tensor's squares sequentially in fp32 (about 1e-4 relative error on a
    # million-element embedding grad, and a different error for each TP split), so accumulate in
    # fp64 there; CUDA reductions are tree-shaped and accurate in fp32.
    acc_dtype = torch.float64 if device.type == "cpu" else torch.float32
    if grads_for_norm:
        norms = torch._foreach_norm([g.detach() for g in grads_for_norm], norm_type, dtype=acc_dtype)
        total = torch.stack(list(norms)).pow(norm_type).sum().reshape(1)
    else:
        total = torch.zeros(1, dtype=acc_dtype, device=comm_device)
    for group in (dtensor_group, model_parallel_group):
        if group is not None:
            total = total.to(get_collective_device(group))
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(parameters: Union[Iterable[torch.nn.Parameter], torch.nn.Parameter],
                                 max_norm: float, total_norm: float):
    """Scale all grads by ``max_norm / (total_norm + 1e-6)`` when that is below 1.

    A NaN ``total_norm`` gives a NaN coefficient, which is not < 1, so nothing is touched.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [to_local_if_dtensor(p.grad.detach()) for p in parameters if p.grad is not None]  # FSDP2: the local shards
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def count_zeros_fp32(parameters: Iterable[torch.nn.Parameter], grad_stats_parallel_group=None,
                     tp_rank: Optional[int] = None) -> int:
    """Number of zero grad entries over the counted params (same filter as the norm), summed over the group.
    ``tp_rank``: the TP rank deciding which replicated params count (default this rank's; the expert TP rank for
    expert params)."""
    tp_rank = _tp_rank() if tp_rank is None else tp_rank
    total = None
    parameters = list(parameters)
    dtensor_group = get_data_parallel_group_if_dtensor([p.grad for p in parameters if p.grad is not None])
    for param in parameters:
        grad = param.grad
        if grad is None or not param_is_not_shared(param) or not param_is_not_tensor_parallel_duplicate(param, tp_rank):
            continue
        grad = to_local_if_dtensor(grad)
        zeros = grad.numel() - torch.count_nonzero(grad)
        total = zeros if total is None else total + zeros
    comm_device = get_collective_device(grad_stats_parallel_group)
    if total is None:
        total = torch.zeros((), dtype=torch.long, device=comm_device)
    total = total.reshape(1).to(device=comm_device, dtype=torch.long)
    for group in (dtensor_group, grad_stats_parallel_group):  # FSDP2 shards: the mesh group first
        if group is not None:
            total = total.to(get_collective_device(group))
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())
