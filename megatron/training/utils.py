"""Small training helpers: rank-aware printing, batch broadcast within a TP group, norms, memory report."""
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.core.optimizer.clip_grads import get_data_parallel_group_if_dtensor, to_local_if_dtensor
from megatron.core.console import write_line
from megatron.core.transformer.context_parallel import batch as _cp_batch

# Megatron-LM re-exports it here.
get_batch_on_this_cp_rank = _cp_batch.get_batch_on_this_cp_rank


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str):
    """Print ``message`` on global rank 0 only, in one write call (:func:`write_line`)."""
    if get_rank() == 0:
        write_line(message)


def print_rank_last(message: str):
    """Print ``message`` on the last global rank only (the rank that holds the loss under pipeline
    parallelism), in one write call (:func:`write_line`)."""
    if is_last_rank():
        write_line(message)


def get_device() -> torch.device:
    """Where this rank's model and batches live: the current CUDA device when CUDA is available, else the CPU.

    A compute device, not a collective one: tensors passed to ``torch.distributed`` are placed by
    ``megatron.core.collective_device.get_collective_device`` (the two agree under NCCL).
    """
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch_on_this_tp_rank(data_iterator, needs_attention_mask: bool):
    """Next micro batch on every rank of a tensor-parallel group, on this rank's compute device.

    Only TP rank 0 reads from ``data_iterator`` (other ranks may pass None); the tensors are
    broadcast from it. Returns a dict: tokens, labels, position_ids int64 ``[b, s]``, loss_mask
    float32 ``[b, s]``, attention_mask bool ``[b, 1, s, s]`` (True = masked) or None.
    """
    device = get_device()
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        batch = next(data_iterator)
        out = {k: batch[k] for k in _BATCH_KEYS if k in batch and batch[k] is not None}
    else:
        out = _broadcast_batch(data_iterator, needs_attention_mask)
    out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    if not needs_attention_mask or "attention_mask" not in out:
        out["attention_mask"] = None
    return out


# [micro-batch size, sequence length] of the batches broadcast over TP, learnt from the first one
# after each forget_broadcast_batch_shape().
_broadcast_batch_shape: Optional[Tuple[int, int]] = None


def forget_broadcast_batch_shape() -> None:
    """Make the next TP batch broadcast learn its [b, s] again. Every rank calls it at the same point:
    where the micro-batch size may change (evaluation runs at ``--eval-micro-batch-size``)."""
    global _broadcast_batch_shape
    _broadcast_batch_shape = None


def _broadcast_batch(data_iterator, needs_attention_mask: bool):
    """TP rank 0's next batch on every rank of its TP group, on the group's collective device.

    Between two forget_broadcast_batch_shape() calls every batch has the [b, s] of the first (one
    micro-batch size and sequence length), so its shape is broadcast and read to the host once, not
    once per micro-batch (a device sync under NCCL). Raises RuntimeError on TP rank 0 if a later
    batch has another shape.
    """
    global _broadcast_batch_shape
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    comm_device = get_collective_device(group)
    out = {}
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        out = {k: batch[k].to(comm_device) for k in _BATCH_KEYS if k in batch and batch[k] is not None}
        if _broadcast_batch_shape is not None and tuple(out["tokens"].shape) != _broadcast_batch_shape:
            raise RuntimeError(f"micro-batch of shape {tuple(out['tokens'].shape)} after batches of shape "
                               f"{_broadcast_batch_shape}: tensor-parallel ranks expect one [b, s] per run")
    if _broadcast_batch_shape is None:
        if out:
            shape = torch.tensor(list(out["tokens"].shape), dtype=torch.int64, device=comm_device)
        else:
            shape = torch.empty(2, dtype=torch.int64, device=comm_device)
        dist.broadcast(shape, src, group=group)
        _broadcast_batch_shape = tuple(shape.tolist())
    b, s = _broadcast_batch_shape
    specs = {
        "tokens": ((b, s), torch.int64), "labels": ((b, s), torch.int64),
        "loss_mask": ((b, s), torch.float32), "position_ids": ((b, s), torch.int64),
    }
    if needs_attention_mask:
        specs["attention_mask"] = ((b, 1, s, s), torch.bool)
    for key, (size, dtype) in specs.items():
        if key not in out:
            out[key] = torch.empty(size, dtype=dtype, device=comm_device)
        dist.broadcast(out[key], src, group=group)
    return out


def calc_params_l2_norm(model) -> float:
    """L2 norm of all parameters, each counted once across tensor-parallel ranks (``--log-params-norm``)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_model_parallel_group() if dist.is_initialized() else None
    device = get_collective_device(group)
    params = [param for chunk in model for param in chunk.parameters()
              if not getattr(param, "shared", False) and (getattr(param, "tensor_model_parallel", False) or tp_rank == 0)]
    # FSDP2: local shards, summed over their data-parallel mesh group first.
    dtensor_group = get_data_parallel_group_if_dtensor(params)
    squares = [to_local_if_dtensor(param.detach()).double().pow(2).sum() for param in params]
    if squares:
        total = torch.stack(squares).sum().reshape(1).to(device)
    else:
        total = torch.zeros(1, dtype=torch.float64, device=device)
    for reduce_group in (dtensor_group, group):
        if reduce_group is not None:
            total = total.to(get_collective_device(reduce_group))
            dist.all_reduce(total, group=reduce_group)
    return total.sqrt().item()


def report_memory(name: str) -> str:
    """CUDA memory statistics in MB, or an empty string on CPU."""
    if not torch.cuda.is_available():
        return ""
    mega = 1024.0 * 1024.0
    return (
        f"[Rank {get_rank()}] (after {name}) memory (MB) | allocated: {torch.cuda.memory_allocated() / mega:.1f}"
        f" | max allocated: {torch.cuda.max_memory_allocated() / mega:.1f}"
        f" | reserved: {torch.cuda.memory_reserved() / mega:.1f}"
        f" | max reserved: {torch.cuda.max_memory_reserved() / mega:.1f}"
    )
