"""Forward/backward schedules over the microbatches of one iteration (no pipelining for now)."""
import contextlib
from typing import Any, Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.telemetry import managed_span
from megatron.core.utils import get_attr_wrapped_model, get_model_config


def get_forward_backward_func() -> Callable:
    """The schedule for the current parallel layout.

    Raises:
        RuntimeError: pipeline parallelism (pipeline_model_parallel_size > 1) is requested; its
            1F1B / interleaved schedules are not available yet.
    """
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1:
        raise RuntimeError(
            f"pipeline parallelism is not available yet (pipeline_model_parallel_size={pp_size}); "
            "only the no-pipelining schedule (--pipeline-model-parallel-size 1) is implemented"
        )
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
    if timer is not None:
        timer.stop()
    return output_tensor, num_tokens


def backward_step(input_tensor: Optional[Union[torch.Tensor, List]], output_tensor: Union[torch.Tensor, List],
                  output_tensor_grad: Optional[Union[torch.Tensor, List]], config):
    """Backward of one microbatch; returns the grad w.r.t. ``input_tensor`` (None on the first stage).

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
