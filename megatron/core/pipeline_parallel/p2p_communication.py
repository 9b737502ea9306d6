"""Point-to-point send/recv of activations and gradients between neighbouring pipeline stages.

Every exchange is one ``torch.distributed.batch_isend_irecv`` over the pipeline group
(``parallel_state.get_pipeline_model_parallel_group()``), waited on before returning, so a stage that
sends while its neighbour sends back (1F1B's steady state) cannot deadlock. Shapes are known ahead
(``get_tensor_shape``): no shape exchange per micro-batch (Megatron's ``variable_seq_lengths`` is not
supported). Buffers live on ``get_collective_device(pipeline group)``: CUDA under NCCL, CPU under gloo.

A receive that fails (the neighbour died, or the group's timeout, ``--distributed-timeout-minutes``,
ran out) raises ``PipelinePeerError`` naming the peer and, when the failing stage reported itself
(``report_stage_failure``), the rank where the failure started.

Each exchange, posting and waiting, is charged to ``pp_comm`` of the step-time breakdown
(``step_timing.section``: a shared no-op when no breakdown is recorded).

Function names and arguments are Megatron-LM's (``megatron/core/pipeline_parallel/p2p_communication.py``).
"""
import contextlib
import logging
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state, progress, step_timing
from megatron.core.collective_device import get_collective_device
from megatron.core.telemetry import is_span_group_enabled, managed_span

logger = logging.getLogger(__name__)

Shape = Sequence[int]

# Key in the default process group's store under which a failing stage leaves its rank, so that
# the ranks whose receives then fail can name it (first writer wins; read best effort).
FAILED_RANK_KEY = "megatron/pipeline_failed_rank"


_NO_SPANS = contextlib.nullcontext()  # shared: the disabled path allocates no context manager


class PipelinePeerError(RuntimeError):
    """A pipeline send/recv failed because a neighbouring stage failed, exited or timed out."""


def get_tensor_shape(config, seq_length: int, micro_batch_size: int) -> Tuple[int, int, int]:
    """Shape ``[s, b, h]`` of the activation (and its gradient) that crosses a stage boundary.

    ``s`` is ``seq_length`` divided by the context-parallel size and, with ``config.sequence_parallel``,
    by the tensor-parallel size (the decoder output is sequence-split then); ``h`` is
    ``config.hidden_size``.

    Raises:
        ValueError: ``seq_length`` is not divisible by those sizes, or ``config`` has no hidden size.
    """
    hidden_size = getattr(config, "hidden_size", None)
    if not hidden_size:
        raise ValueError("pipeline communication needs config.hidden_size (the [s, b, h] tensor shape)")
    divisor = parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        divisor *= parallel_state.get_tensor_model_parallel_world_size()
    if seq_length % divisor:
        raise ValueError(f"seq_length {seq_length} is not divisible by context-parallel x (sequence-parallel) "
                         f"tensor-parallel size {divisor}")
    return (seq_length // divisor, micro_batch_size, hidden_size)


def _failed_rank_hint() -> str:
    try:
        store = dist.distributed_c10d._get_default_store()
        if store.check([FAILED_RANK_KEY]):
            return f"; pipeline stage failed on rank {store.get(FAILED_RANK_KEY).decode()}"
    except Exception:  # the store may have died with the failing rank: the hint is best effort
        pass
    return ""


def report_stage_failure(exc: BaseException) -> None:
    """Log ``pipeline stage failed on rank R`` and leave R in the default store for the other stages.

    Called by the schedules when a stage raises (not for ``PipelinePeerError``, which is a
    consequence of another stage's failure). Never raises.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    try:
        stage = parallel_state.get_pipeline_model_parallel_rank()
    except Exception:
        stage = "?"
    logger.error("pipeline stage failed on rank %s (pipeline stage %s): %s: %s",
                 rank, stage, type(exc).__name__, exc)
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([FAILED_RANK_KEY]):
            store.set(FAILED_RANK_KEY, str(rank))
    except Exception:
        pass


def _p2p_span(name: str, parent, peer: int, microbatch_id: Optional[int]):
    attrs = {"dl.pipeline_parallel.rank": parallel_state.get_pipeline_model_parallel_rank(),
             "megatron.p2p.peer_rank": peer}
    if microbatch_id is not None:
        attrs["megatron.microbatch_id"] = microbatch_id
    return managed_span("communication", name, context=parent, **attrs)


def _communicate(*, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                 recv_prev: bool, recv_next: bool, tensor_shape: Shape, config,
                 microbatch_ids: Optional[dict] = None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Exchange with the previous and next stage in one batched isend/irecv and wait for it.

    Neighbours wrap around (the first stage's previous is the last), which the interleaved schedule
    uses. ``microbatch_ids`` maps a direction (``send_forward``, ``recv_forward``, ``send_backward``,
    ``recv_backward``) to the micro-batch it carries, for the spans.

    Returns:
        ``(tensor_recv_prev, tensor_recv_next)``: ``[s, b, h]`` tensors of ``config.pipeline_dtype``
        with ``requires_grad=True`` (None where not received).

    Raises:
        PipelinePeerError: the exchange failed (neighbour gone or the group's timeout elapsed).
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    device = get_collective_device(group)
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    dtype = config.pipeline_dtype or config.params_dtype
    tensor_recv_prev = tensor_recv_next = None
    ops: List[dist.P2POp] = []
    directions = []  # (span name, peer) in the order of ops
    # Forward-direction ops (activations) first, then backward-direction ones (gradients), on every
    # rank: at PP=2 the previous and the next stage are the same rank, and messages between two
    # ranks are matched in the order they were posted, so both sides must post activation before
    # gradient or an activation would land in a gradient buffer of the same shape.
    if tensor_send_next is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_next.detach().to(device).contiguous(), next_rank, group))
        directions.append(("send_forward", next_rank))
    if recv_prev:
        tensor_recv_prev = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)
        ops.append(dist.P2POp(dist.irecv, tensor_recv_prev, prev_rank, group))
        directions.append(("recv_forward", prev_rank))
    if tensor_send_prev is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_prev.detach().to(device).contiguous(), prev_rank, group))
        directions.append(("send_backward", prev_rank))
    if recv_next:
        tensor_recv_next = torch.empty(tuple(tensor_shape), dtype=dtype, device=device, requires_grad=True)
        ops.append(dist.P2POp(dist.irecv, tensor_recv_next, next_rank, group))
        directions.append(("recv_backward", next_rank))
    if not ops:
        return tensor_recv_prev, tensor_recv_next

    spans = _NO_SPANS
    if is_span_group_enabled("communication"):
        from opentelemetry import context as otel_context

        # One sibling span per direction under the current span (the micro-batch's), not nested in
        # each other: the directions of one batch run concurrently.
        parent = otel_context.get_current()
        spans = contextlib.ExitStack()
        for direction, peer in directions:
            spans.enter_context(_p2p_span("megatron.p2p." + direction, parent, peer,
                                          (microbatch_ids or {}).get(direction)))
    # Posting the ops and waiting for them is the step's pipeline communication (``pp_comm``): on a
    # stage that waits for its neighbour, most of it is that wait.
    with step_timing.section("pp_comm"), spans:
        try:
            progress.PROGRESS.comm = ("p2p " + ", ".join(f"{d} with rank {p}" for d, p in directions), group)
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            progress.PROGRESS.comm = None
        except RuntimeError as exc:
            names = ", ".join(f"{d} with rank {p}" for d, p in directions)
            raise PipelinePeerError(
                f"pipeline p2p ({names}) failed on rank {dist.get_rank()}{_failed_rank_hint()}: {exc}"
            ) from exc
    # Under NCCL, wait() makes the current CUDA stream wait for the transfer: no host sync needed.
    return tensor_recv_prev, tensor_recv_next


def recv_forward(tensor_shape: Shape, config, microbatch_id: Optional[int] = None) -> Optional[torch.Tensor]:
    """Activation ``[s, b, h]`` from the previous stage; None on the first stage."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                        tensor_shape=tensor_shape, config=config,
                        microbatch_ids={"recv_forward": microbatch_id})[0]


def recv_backward(tensor_shape: Shape, config, microbatch_id: Optional[int] = None) -> Optional[torch.Tensor]:
    """Gradient ``[s, b, h]`` of this stage's output from the next stage; None on the last stage."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
                        tensor_shape=tensor_shape, config=config,
                        microbatch_ids={"recv_backward": microbatch_id})[1]


def send_forward(output_tensor: Optional[torch.Tensor], config, microbatch_id: Optional[int] = None) -> None:
    """Send this stage's output to the next stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
                 tensor_shape=(), config=config, microbatch_ids={"send_forward": microbatch_id})


def send_backward(input_tensor_grad: Optional[torch.Tensor], config, microbatch_id: Optional[int] = None) -> None:
    """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=False,
                 tensor_shape=(), config=config, microbatch_ids={"send_backward": microbatch_id})


def send_forward_recv_backward(output_tensor: Optional[torch.Tensor], tensor_shape: Shape, config,
                               microbatch_ids: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Send the output of one micro-batch forward and receive the output gradient of another (1F1B)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=True,
                        tensor_shape=tensor_shape, config=config, microbatch_ids=microbatch_ids)[1]


def send_backward_recv_forward(input_tensor_grad: Optional[torch.Tensor], tensor_shape: Shape, config,
                               microbatch_ids: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Send an input gradient backward and receive the next micro-batch's activation (1F1B)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
                        tensor_shape=tensor_shape, config=config, microbatch_ids=microbatch_ids)[0]


def send_forward_recv_forward(output_tensor: Optional[torch.Tensor], recv_prev: bool, tensor_shape: Shape, config,
                              microbatch_ids: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Interleaved schedule: send to the next stage and receive from the previous one (ring order)."""
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
                        recv_next=False, tensor_shape=tensor_shape, config=config,
                        microbatch_ids=microbatch_ids)[0]


def send_backward_recv_backward(input_tensor_grad: Optional[torch.Tensor], recv_next: bool, tensor_shape: Shape,
                                config, microbatch_ids: Optional[dict] = None) -> Optional[torch.Tensor]:
    """Interleaved schedule: send a gradient to the previous stage and receive one from the next."""
    return _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                        recv_next=recv_next, tensor_shape=tensor_shape, config=config,
                        microbatch_ids=microbatch_ids)[1]


def send_forward_backward_recv_forward_backward(
        output_tensor: Optional[torch.Tensor], input_tensor_grad: Optional[torch.Tensor], recv_prev: bool,
        recv_next: bool, tensor_shape: Shape, config, microbatch_ids: Optional[dict] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Interleaved schedule: both directions at once; returns ``(input_tensor, output_tensor_grad)``."""
    return _communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
                        recv_next=recv_next, tensor_shape=tensor_shape, config=config,
                        microbatch_ids=microbatch_ids)
