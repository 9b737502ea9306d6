"""The small collectives of a checkpoint save or load (all no-ops in a single process without torch.distributed)."""
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.training.checkpointing.errors import FailedOnAnotherRankError
from megatron.training.user_errors import one_line


def world_rank():
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    """The number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    """dist.barrier() when torch.distributed is initialised."""
    if dist.is_initialized():
        dist.barrier()


def any_rank(flag):
    """Whether ``flag`` is true on any rank (one all-reduce)."""
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=get_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_ranks(flag):
    """Whether ``flag`` is true on every rank (one all-reduce)."""
    return not any_rank(not flag)


def broadcast_int_from_rank_0(value):
    """Rank 0's integer ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=get_collective_device())
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_object(obj):
    """Every rank's ``obj``, in rank order."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def first_error_everywhere(error):
    """Raise on every rank if any rank has ``error``: the rank's own error, else a FailedOnAnotherRankError
    naming the other rank."""
    reports = all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            raise FailedOnAnotherRankError(f"checkpoint step failed on rank {rank}: {report}")


def failure_reports(error):
    """``{rank: one-line report}`` of the ranks whose ``error`` is not None (all ranks call it, after they
    agreed that one failed)."""
    report = None if error is None else one_line(error)[:400]
    if not dist.is_initialized():
        return {0: report} if report is not None else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return {rank: text for rank, text in enumerate(gathered) if text is not None}


def rank_summary() -> str:
    """Megatron's ``[ t a/b, p e/f ]`` suffix: this rank's (1-based) tensor and pipeline position."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return (f"[ t {parallel_state.get_tensor_model_parallel_rank() + 1}/{tp}, "
            f"p {parallel_state.get_pipeline_model_parallel_rank() + 1}/{pp} ]")
