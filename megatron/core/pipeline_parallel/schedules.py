"""Forward/backward schedules over the microbatches of one iteration: no pipelining, 1F1B, interleaved 1F1B.

The pipelined schedules follow Megatron-LM (``megatron/core/pipeline_parallel/schedules.py``), whose
1F1B order is PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 2.2.1) and whose interleaved order is that paper's
section 2.2.2. Communication is in ``p2p_communication``.
"""
import contextlib
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.telemetry import create_linked_span, managed_span
from megatron.core.utils import get_attr_wrapped_model, get_model_config


def get_forward_backward_func() -> Callable:
    """The schedule for the current parallel layout (Megatron's choice).

    - pipeline size 1: ``forward_backward_no_pipelining``;
    - pipeline size > 1 and a virtual pipeline size (model chunks per stage) set in
      ``parallel_state``: ``forward_backward_pipelining_with_interleaving``;
    - otherwise ``forward_backward_pipelining_without_interleaving`` (1F1B).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


def _check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def _start_timer(config, name: str):
    if config.timers is None:
        return None
    timer = config.timers(name, log_level=2)
    timer.start()
    return timer


def forward_step(forward_step_func: Callable, data_iterator: Optional[Iterator], model: torch.nn.Module,
                 num_microbatches: int, input_tensor: Optional[torch.Tensor], forward_data_store: List[Any],
                 config, collect_non_loss_data: bool = False, checkpoint_activations_microbatch: Optional[bool] = None,
                 is_first_microbatch: bool = False, is_last_stage: bool = True):
    """Run one microbatch forward and, on the last stage, its loss function.

    ``forward_step_func(data_iterator, model)`` returns ``(output_tensor, loss_func)``;
    ``loss_func(output_tensor)`` returns ``(loss, num_tokens, report)`` -- the loss is divided by
    ``max(num_tokens, 1)`` and by ``num_microbatches`` unless ``config.calculate_per_token_loss`` --
    or the legacy ``(loss, report)`` -- the loss is multiplied by the context-parallel size and
    divided by ``num_microbatches``. ``report`` is appended to ``forward_data_store``. With
    ``collect_non_loss_data``, ``loss_func(output_tensor, non_loss_data=True)`` is stored instead.

    Args:
        input_tensor: activation received from the previous stage (None on the first stage), set on
            the model through ``set_input_tensor`` when the model has it.
        checkpoint_activations_microbatch: passed as a third argument to ``forward_step_func`` when
            not None (per-microbatch activation recomputation of pipeline schedules).

    Returns:
        ``(output_tensor, num_tokens)``: the scaled loss (last stage) or the stage's output tensor,
        and the microbatch's token count (0 where not reported).

    Raises:
        ValueError: ``loss_func`` returns neither 2 nor 3 values.
    """
    timer = _start_timer(config, "forward-compute")
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    try:
        set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    except AttributeError:
        set_input_tensor = None
    if set_input_tensor is not None:
        set_input_tensor(input_tensor if isinstance(input_tensor, list) else [input_tensor])

    if checkpoint_activations_microbatch is None:
        output_tensor, loss_func = forward_step_func(data_iterator, model)
    else:
        output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)

    num_tokens = 0
    if is_last_stage:
        if collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            outputs = loss_func(output_tensor)
            if len(outputs) == 3:
                output_tensor, num_tokens, report = outputs
                if not config.calculate_per_token_loss:
                    if isinstance(num_tokens, torch.Tensor):
                        output_tensor = output_tensor / num_tokens.clamp(min=1)
                    else:
                        output_tensor = output_tensor / max(num_tokens, 1)
                    output_tensor = output_tensor / num_microbatches
            elif len(outputs) == 2:
                output_tensor, report = outputs
                output_tensor = output_tensor * parallel_state.get_context_parallel_world_size() / num_microbatches
            else:
                raise ValueError(
                    f"loss_func returned {len(outputs)} values; expected (loss, num_tokens, report) or (loss, report)"
                )
            forward_data_store.append(report)
    if getattr(config, "num_moe_experts", None) is not None:
        _set_moe_aux_loss_scale(config, output_tensor, num_microbatches)
    if timer is not None:
        timer.stop()
    return output_tensor, num_tokens


def _set_moe_aux_loss_scale(config, output_tensor: torch.Tensor, num_microbatches: int):
    """The gradient the MoE auxiliary losses inject in backward (Megatron core_v0.14 ``forward_step_calc_loss``).

    The aux losses are not part of the returned loss: ``MoEAuxLossAutoScaler`` adds ``d loss = scale`` for them in
    backward, so the scale must match what the main loss goes through: the loss scaler's factor
    (``grad_scale_func(1)``, 1 without one), divided by ``num_microbatches`` unless the loss is per token.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    one = torch.ones(1, device=output_tensor.device)
    loss_scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    if not config.calculate_per_token_loss:
        loss_scale = loss_scale / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(loss_scale)


def backward_step(input_tensor: Optional[Union[torch.Tensor, List]], output_tensor: Union[torch.Tensor, List],
                  output_tensor_grad: Optional[Union[torch.Tensor, List]], config):
    """Backward of one microbatch; returns the grad w.r.t. ``input_tensor`` (None on the first stage).

    ``output_tensor_grad`` is the gradient ``[s, b, h]`` received from the next stage (None on the
    last stage, where ``output_tensor`` is the loss).

    On the last stage (``output_tensor_grad`` None) the loss is first passed through
    ``config.grad_scale_func`` (the loss scaler) when it is set.
    """
    timer = _start_timer(config, "backward-compute")
    unwrap_input_tensor_grad = not isinstance(input_tensor, list)
    input_tensors = [input_tensor] if unwrap_input_tensor_grad else input_tensor
    for x in input_tensors:
        if x is not None:
            x.retain_grad()
    output = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
    output_grad = output_tensor_grad[0] if isinstance(output_tensor_grad, list) else output_tensor_grad
    if output_grad is None and config.grad_scale_func is not None:
        output = config.grad_scale_func(output)
    if output_grad is not None and config.deallocate_pipeline_outputs:
        custom_backward(output, output_grad)  # output.data may have been freed after its send
    else:
        torch.autograd.backward(output, grad_tensors=output_grad)
    input_tensor_grad = [None if x is None else x.grad for x in input_tensors]
    if timer is not None:
        timer.stop()
    return input_tensor_grad[0] if unwrap_input_tensor_grad else input_tensor_grad


def _model_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def forward_backward_no_pipelining(*, forward_step_func: Callable, data_iterator, model, num_microbatches: int,
                                   seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step: Optional[bool] = None) -> List[Any]:
    """Run forward and backward of ``num_microbatches`` microbatches on one model (pp = 1).

    Microbatches 0..M-2 run inside ``config.no_sync_func`` (default ``model.no_sync``) so grads only
    accumulate; the last one runs outside it so the data-parallel reduction can start. Afterwards
    (unless ``forward_only``) ``config.finalize_model_grads_func([model], num_tokens)`` is called, with
    the iteration's token count when ``config.calculate_per_token_loss`` and None otherwise.
    ``seq_length``, ``micro_batch_size`` and ``decoder_seq_length`` describe the p2p tensor shape in
    pipeline schedules and are unused here.

    Returns:
        The list of per-microbatch ``report`` dicts returned by the loss function.

    Raises:
        ValueError: several model chunks / data iterators, or ``num_microbatches`` < 1.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"the non-pipeline-parallel schedule does not support model chunking "
                             f"(got {len(model)} chunks)")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(f"the non-pipeline-parallel schedule does not support model chunking "
                             f"(got {len(data_iterator)} data iterators)")
        data_iterator = data_iterator[0]
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")

    config = get_model_config(model)
    no_sync_func = config.no_sync_func or getattr(model, "no_sync", None) or contextlib.nullcontext

    forward_data_store: List[Any] = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=_model_device(model))

    def run_microbatch(index: int):
        with managed_span("microbatch", "megatron.microbatch.forward", **{"megatron.microbatch_id": index}):
            output_tensor, num_tokens = forward_step(
                forward_step_func, data_iterator, model, num_microbatches, None, forward_data_store, config,
                collect_non_loss_data,
                is_first_microbatch=_check_first_val_step(first_val_step, forward_only, index == 0),
            )
        total_num_tokens.add_(num_tokens)
        if not forward_only:
            with managed_span("microbatch", "megatron.microbatch.backward", **{"megatron.microbatch_id": index}):
                backward_step(None, output_tensor, None, config)

    with no_sync_func():
        for index in range(num_microbatches - 1):
            run_microbatch(index)
    run_microbatch(num_microbatches - 1)

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model], total_num_tokens if config.calculate_per_token_loss else None
        )
    return forward_data_store


# ----------------------------------------------------------------------------------------------
# Pipeline-parallel schedules
# ----------------------------------------------------------------------------------------------
def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False) -> None:
    """Free the data of a stage output once it has been sent, keeping its ``grad_fn`` (Megatron's trick).

    The next stage holds its own copy, and the backward only needs the graph behind ``out``, not
    ``out``'s values, so ``out.data`` is replaced by a 1-element tensor. Skipped unless
    ``deallocate_pipeline_outputs`` (``config.deallocate_pipeline_outputs``), and for a view
    (``out._base`` set), whose storage would stay alive anyway. ``backward_step`` then runs the
    backward through ``custom_backward``. Only safe when no autograd node saved ``out`` itself.
    """
    if out is None or not deallocate_pipeline_outputs or not isinstance(out, torch.Tensor) or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backward from ``output`` with ``grad_output`` ([s, b, h]) even when ``output.data`` was freed.

    ``torch.autograd.backward`` compares ``grad_output`` with ``output``'s current (1-element) shape;
    the autograd engine itself checks it against the shape recorded in ``output.grad_fn``, which is
    still the original one, so the engine is called directly.
    """
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True,
    )


class _GradSync:
    """Megatron's disable/enable_grad_sync: grads only accumulate while ``no_sync_func`` is entered."""

    def __init__(self, config, model_chunks: List[torch.nn.Module]):
        # config.no_sync_func: one context manager factory, or one per chunk (Megatron's training sets
        # a list with several chunks); default: each chunk's own no_sync.
        no_sync_func = config.no_sync_func
        if isinstance(no_sync_func, list):
            funcs = no_sync_func
            no_sync_func = lambda: _enter_all(funcs)  # noqa: E731
        if no_sync_func is None:
            funcs = [m.no_sync for m in model_chunks if hasattr(m, "no_sync")]
            no_sync_func = (lambda: _enter_all(funcs)) if funcs else contextlib.nullcontext
        self._func = no_sync_func
        self._context = None

    def disable(self):
        if self._context is None:
            self._context = self._func()
            self._context.__enter__()

    def enable(self):
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


@contextlib.contextmanager
def _enter_all(funcs):
    with contextlib.ExitStack() as stack:
        for func in funcs:
            stack.enter_context(func())
        yield


def _fail_loudly(schedule: Callable) -> Callable:
    """Report an exception raised on this stage (``p2p.report_stage_failure``) before it propagates,
    so the stages blocked in a receive from this one fail with a message naming its rank instead of
    waiting; a ``PipelinePeerError`` is a neighbour's failure and is only re-raised."""

    def wrapped(**kwargs):
        try:
            return schedule(**kwargs)
        except p2p.PipelinePeerError:
            raise
        except Exception as exc:
            p2p.report_stage_failure(exc)
            raise

    wrapped.__name__, wrapped.__qualname__, wrapped.__doc__ = schedule.__name__, schedule.__qualname__, schedule.__doc__
    wrapped.__wrapped__ = schedule
    return wrapped


def _linked_recv_span(microbatch_id: int, receives: Optional[bool] = None):
    # Spec section 7: warm-up receives carry a Link to the iteration's shared trace context. By
    # default only a stage after the first receives (the first stage's first chunk reads data).
    if not (receives if receives is not None else not parallel_state.is_pipeline_first_stage()):
        return _NO_SPAN
    return create_linked_span("megatron.pp.recv_forward.linked", **{
        "dl.pipeline_parallel.rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dl.microbatch_id": microbatch_id})


_NO_SPAN = contextlib.nullcontext()


def _fwd_span(microbatch_id: int):
    return managed_span("microbatch", "megatron.microbatch.forward", **{"megatron.microbatch_id": microbatch_id})


def _bwd_span(microbatch_id: int):
    return managed_span("microbatch", "megatron.microbatch.backward", **{"megatron.microbatch_id": microbatch_id})


def get_num_warmup_microbatches(num_microbatches: int, pipeline_parallel_size: int, pipeline_parallel_rank: int,
                                num_model_chunks: int = 1, forward_only: bool = False) -> int:
    """Forward passes a stage runs before its first backward (Megatron's formulas).

    - 1F1B: ``min(pp - rank - 1, num_microbatches)``.
    - interleaved (``num_model_chunks`` > 1), with ``total = num_microbatches * num_model_chunks``:
      all of ``total`` when ``forward_only`` or ``num_microbatches == pp``, else
      ``min((pp - rank - 1) * 2 + (num_model_chunks - 1) * pp, total)``.
    """
    if num_model_chunks == 1:
        return min(pipeline_parallel_size - pipeline_parallel_rank - 1, num_microbatches)
    total = num_microbatches * num_model_chunks
    if forward_only or num_microbatches == pipeline_parallel_size:
        return total
    warmup = (pipeline_parallel_size - pipeline_parallel_rank - 1) * 2 + (num_model_chunks - 1) * pipeline_parallel_size
    return min(warmup, total)


def _single(model, data_iterator, name):
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"{name} takes one model chunk (got {len(model)}); interleaving needs "
                             "a virtual pipeline size and forward_backward_pipelining_with_interleaving")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(f"{name} takes one data iterator (got {len(data_iterator)})")
        data_iterator = data_iterator[0]
    return model, data_iterator


def _forward_backward_pipelining_without_interleaving(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None) -> List[Any]:
    """1F1B over the pipeline stages (one model chunk per stage).

    Each stage runs ``W = min(pp - rank - 1, num_microbatches)`` warm-up forwards, then alternates
    one forward and one backward for the remaining ``num_microbatches - W`` microbatches (steady
    state), then ``W`` cool-down backwards. Activations ``[s, b, h]`` (``p2p.get_tensor_shape``) go
    to the next stage, their gradients come back. Grad sync (``no_sync``) is disabled until the last
    backward; then ``config.finalize_model_grads_func([model], num_tokens)`` runs as in the
    no-pipelining schedule. ``decoder_seq_length`` is unused (no encoder-decoder models).

    Returns:
        The per-microbatch reports of the loss function on the last stage; ``[]`` on other stages.

    Raises:
        ValueError: several model chunks, or ``num_microbatches`` < 1.
        p2p.PipelinePeerError: a neighbouring stage failed or the group's timeout elapsed.
    """
    model, data_iterator = _single(model, data_iterator, "forward_backward_pipelining_without_interleaving")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    config = get_model_config(model)
    tensor_shape = p2p.get_tensor_shape(config, seq_length, micro_batch_size)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    is_last = parallel_state.is_pipeline_last_stage()
    num_warmup = get_num_warmup_microbatches(num_microbatches, parallel_state.get_pipeline_model_parallel_world_size(),
                                             pp_rank)
    num_remaining = num_microbatches - num_warmup
    deallocate = config.deallocate_pipeline_outputs and not is_last
    grad_sync = _GradSync(config, [model])
    if not forward_only:
        grad_sync.disable()

    forward_data_store: List[Any] = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=_model_device(model))
    input_tensors: List[Any] = []
    output_tensors: List[Any] = []

    def run_forward(index: int, input_tensor):
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config,
            collect_non_loss_data,
            is_first_microbatch=_check_first_val_step(first_val_step, forward_only, index == 0),
            is_last_stage=is_last,
        )
        total_num_tokens.add_(num_tokens)
        return output_tensor

    # Warm-up: forwards only.
    for i in range(num_warmup):
        with _fwd_span(i):
            with _linked_recv_span(i):
                input_tensor = p2p.recv_forward(tensor_shape, config, microbatch_id=i)
            output_tensor = run_forward(i, input_tensor)
            p2p.send_forward(output_tensor, config, microbatch_id=i)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor, deallocate)

    # Steady state: one forward (microbatch W + i), one backward (microbatch i).
    input_tensor = None
    for i in range(num_remaining):
        fwd_id, last_iteration = num_warmup + i, i == num_remaining - 1
        with _fwd_span(fwd_id):
            if i == 0:
                with _linked_recv_span(fwd_id):
                    input_tensor = p2p.recv_forward(tensor_shape, config, microbatch_id=fwd_id)
            elif forward_only:
                input_tensor = p2p.recv_forward(tensor_shape, config, microbatch_id=fwd_id)
            output_tensor = run_forward(fwd_id, input_tensor)
            if forward_only:
                p2p.send_forward(output_tensor, config, microbatch_id=fwd_id)
            else:
                output_tensor_grad = p2p.send_forward_recv_backward(
                    output_tensor, tensor_shape, config, microbatch_ids={"send_forward": fwd_id, "recv_backward": i})
        if forward_only:
            continue
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        deallocate_output_tensor(output_tensor, deallocate)
        input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
        with _bwd_span(i):
            if num_warmup == 0 and last_iteration:
                grad_sync.enable()
            input_tensor_grad = _backward(input_tensor, output_tensor, output_tensor_grad, config)
            if last_iteration:
                input_tensor = None
                p2p.send_backward(input_tensor_grad, config, microbatch_id=i)
            else:
                input_tensor = p2p.send_backward_recv_forward(
                    input_tensor_grad, tensor_shape, config,
                    microbatch_ids={"send_backward": i, "recv_forward": fwd_id + 1})

    # Cool-down: the warm-up microbatches' backwards.
    if not forward_only:
        for i in range(num_warmup):
            bwd_id = num_remaining + i
            with _bwd_span(bwd_id):
                if i == num_warmup - 1:
                    grad_sync.enable()
                input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
                output_tensor_grad = p2p.recv_backward(tensor_shape, config, microbatch_id=bwd_id)
                input_tensor_grad = _backward(input_tensor, output_tensor, output_tensor_grad, config)
                p2p.send_backward(input_tensor_grad, config, microbatch_id=bwd_id)
        grad_sync.enable()
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func([model], total_num_tokens if config.calculate_per_token_loss else None)
    return forward_data_store if is_last else []


def _backward(input_tensor, output_tensor, output_tensor_grad, config):
    grad = backward_step(input_tensor, output_tensor, output_tensor_grad, config)
    if grad is None and input_tensor is not None:
        # The previous stage waits for a gradient of fixed shape: an input that did not reach the
        # loss still gets one (zeros), never a missing send.
        grad = torch.zeros_like(input_tensor)
    return grad


forward_backward_pipelining_without_interleaving = _fail_loudly(_forward_backward_pipelining_without_interleaving)


def _forward_backward_pipelining_with_interleaving(
        *, forward_step_func: Callable, data_iterator, model, num_microbatches: int, seq_length: int,
        micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None) -> List[Any]:
    """Interleaved 1F1B: each stage holds ``C = len(model)`` model chunks (virtual stages).

    Virtual stage ``c * pp + rank`` is chunk ``c`` of stage ``rank``; activations travel around the
    ring of stages ``C`` times (the last stage's chunk ``c`` feeds the first stage's chunk ``c + 1``).
    The ``num_microbatches * C`` chunk-microbatches run in groups of ``pp`` per chunk: forward
    ``k`` uses chunk ``(k mod (pp*C)) // pp`` and backward ``k`` the mirror chunk. Warm-up count:
    ``get_num_warmup_microbatches``. ``data_iterator`` is one iterator per chunk (or one shared).

    Returns:
        The per-microbatch loss reports on the last stage; ``[]`` on other stages.

    Raises:
        ValueError: ``model`` is not a list of chunks, the data iterators do not match the chunks,
            or ``num_microbatches`` is not a multiple of the pipeline size (Megatron's constraint
            for this schedule).
        p2p.PipelinePeerError: a neighbouring stage failed or the group's timeout elapsed.
    """
    if not isinstance(model, list):
        raise ValueError("the interleaved schedule needs a list of model chunks")
    num_chunks = len(model)
    if not isinstance(data_iterator, list):
        data_iterator = [data_iterator] * num_chunks
    if len(data_iterator) != num_chunks:
        raise ValueError(f"the interleaved schedule got {len(data_iterator)} data iterators for {num_chunks} chunks")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if num_microbatches < 1 or num_microbatches % pp:
        raise ValueError(
            f"number of microbatches ({num_microbatches}) is not divisible by pipeline-model-parallel-size ({pp}) "
            "when using the interleaved schedule (--num-layers-per-virtual-pipeline-stage / "
            "--num-virtual-stages-per-pipeline-rank): choose a global batch size that gives a multiple of "
            f"{pp} microbatches per data-parallel rank"
        )
    config = get_model_config(model[0])
    tensor_shape = p2p.get_tensor_shape(config, seq_length, micro_batch_size)
    total = num_microbatches * num_chunks
    group_size = pp * num_chunks
    all_warmup = forward_only or num_microbatches == pp
    num_warmup = get_num_warmup_microbatches(num_microbatches, pp, pp_rank, num_chunks, forward_only)
    num_remaining = total - num_warmup
    grad_sync = _GradSync(config, model)
    if not forward_only:
        grad_sync.disable()

    def chunk_id(k: int, forward: bool) -> int:
        chunk = (k % group_size) // pp
        return chunk if forward else num_chunks - chunk - 1

    def microbatch_id(k: int) -> int:
        return (k // group_size) * pp + k % pp

    def is_first_for_chunk(k: int) -> bool:
        return k // group_size == 0 and (k % group_size) % pp == 0

    def is_last_for_chunk(k: int) -> bool:
        return k // group_size == total // group_size - 1 and (k % group_size) % pp == pp - 1

    first_stage = parallel_state.is_pipeline_first_stage()
    last_stage = parallel_state.is_pipeline_last_stage()

    def is_last_virtual(chunk: int) -> bool:
        return last_stage and chunk == num_chunks - 1

    def is_first_virtual(chunk: int) -> bool:
        return first_stage and chunk == 0
    forward_data_store: List[Any] = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=_model_device(model[0]))
    input_tensors: List[List[Any]] = [[] for _ in range(num_chunks)]
    output_tensors: List[List[Any]] = [[] for _ in range(num_chunks)]
    output_tensor_grads: List[List[Any]] = [[] for _ in range(num_chunks)]

    def forward_helper(k: int):
        chunk = chunk_id(k, True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if is_first_virtual(chunk) and len(input_tensors[chunk]) == len(output_tensors[chunk]):
            input_tensors[chunk].append(None)
        output_tensor, num_tokens = forward_step(
            forward_step_func, data_iterator[chunk], model[chunk], num_microbatches, input_tensors[chunk][-1],
            forward_data_store, config, collect_non_loss_data,
            is_first_microbatch=_check_first_val_step(first_val_step, forward_only, is_first_for_chunk(k)),
            is_last_stage=is_last_virtual(chunk),
        )
        output_tensors[chunk].append(output_tensor)
        total_num_tokens.add_(num_tokens)
        if forward_only:
            input_tensors[chunk].pop()
            output_tensors[chunk].pop()
        return output_tensor

    def backward_helper(k: int):
        chunk = chunk_id(k, False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if is_last_for_chunk(k):
            grad_sync.enable()  # this chunk's last backward: let its data-parallel reduction start
        if is_last_virtual(chunk) and len(output_tensor_grads[chunk]) == 0:
            output_tensor_grads[chunk].append(None)
        input_tensor = input_tensors[chunk].pop(0)
        output_tensor = output_tensors[chunk].pop(0)
        output_tensor_grad = output_tensor_grads[chunk].pop(0)
        input_tensor_grad = _backward(input_tensor, output_tensor, output_tensor_grad, config)
        grad_sync.disable()
        return input_tensor_grad

    def sent_output(k: int, output_tensor):
        # The last virtual stage keeps its output (the loss); deallocation only for what was sent.
        if is_last_virtual(chunk_id(k, True)):
            return None
        return output_tensor

    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    try:
        with _fwd_span(0):
            with _linked_recv_span(0):
                input_tensors[0].append(p2p.recv_forward(tensor_shape, config, microbatch_id=0))

        # Warm-up.
        for k in range(num_warmup):
            with _fwd_span(microbatch_id(k)):
                output_tensor = sent_output(k, forward_helper(k))
                next_chunk = chunk_id(k + 1, True)
                recv_prev = not (first_stage and next_chunk == 0) and k != total - 1
                ids = {"send_forward": microbatch_id(k), "recv_forward": microbatch_id(k + 1)}
                if k == num_warmup - 1 and not all_warmup:
                    ids["recv_backward"] = microbatch_id(0)
                    input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                        output_tensor, None, recv_prev=recv_prev, recv_next=not last_stage,
                        tensor_shape=tensor_shape, config=config, microbatch_ids=ids)
                    output_tensor_grads[num_chunks - 1].append(output_tensor_grad)
                else:
                    with _linked_recv_span(microbatch_id(k + 1), receives=recv_prev):
                        input_tensor = p2p.send_forward_recv_forward(output_tensor, recv_prev, tensor_shape, config,
                                                                     microbatch_ids=ids)
                if recv_prev:
                    input_tensors[next_chunk].append(input_tensor)
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

        # Steady state: forward k + W and backward k, then one exchange in both directions.
        for k in range(num_remaining):
            fwd_k = k + num_warmup
            with _fwd_span(microbatch_id(fwd_k)):
                output_tensor = sent_output(fwd_k, forward_helper(fwd_k))
            with _bwd_span(microbatch_id(k)):
                input_tensor_grad = backward_helper(k)
                if is_first_virtual(chunk_id(k, False)):
                    input_tensor_grad = None
                if first_stage:
                    next_fwd_chunk = chunk_id(fwd_k - (pp - 1), True)
                    recv_prev = next_fwd_chunk != num_chunks - 1
                    next_fwd_chunk += 1
                else:
                    next_fwd_chunk = chunk_id(fwd_k + 1, True)
                    recv_prev = True
                if last_stage:
                    next_bwd_chunk = chunk_id(k - (pp - 1), False)
                    recv_next = next_bwd_chunk != 0
                    next_bwd_chunk -= 1
                else:
                    next_bwd_chunk = chunk_id(k + 1, False)
                    recv_next = True
                if k == num_remaining - 1:
                    recv_prev = False
                input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                    output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next,
                    tensor_shape=tensor_shape, config=config,
                    microbatch_ids={"send_forward": microbatch_id(fwd_k), "send_backward": microbatch_id(k),
                                    "recv_forward": microbatch_id(fwd_k + 1), "recv_backward": microbatch_id(k + 1)})
            deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
            if recv_prev:
                input_tensors[next_fwd_chunk].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_bwd_chunk].append(output_tensor_grad)

        # Cool-down.
        if not forward_only:
            if all_warmup:
                with _bwd_span(microbatch_id(num_remaining)):
                    output_tensor_grads[num_chunks - 1].append(
                        p2p.recv_backward(tensor_shape, config, microbatch_id=microbatch_id(num_remaining)))
            for k in range(num_remaining, total):
                with _bwd_span(microbatch_id(k)):
                    input_tensor_grad = backward_helper(k)
                    if is_first_virtual(chunk_id(k, False)):
                        input_tensor_grad = None
                    next_bwd_chunk = chunk_id(k + 1, False)
                    recv_next = not (last_stage and next_bwd_chunk == num_chunks - 1) and k != total - 1
                    output_tensor_grads[next_bwd_chunk].append(p2p.send_backward_recv_backward(
                        input_tensor_grad, recv_next, tensor_shape, config,
                        microbatch_ids={"send_backward": microbatch_id(k), "recv_backward": microbatch_id(k + 1)}))
            grad_sync.enable()
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(
                    model, total_num_tokens if config.calculate_per_token_loss else None)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    return forward_data_store if last_stage else []


forward_backward_pipelining_with_interleaving = _fail_loudly(_forward_backward_pipelining_with_interleaving)
