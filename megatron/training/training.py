"""The pretraining driver: build model, optimizer and data, run the training loop, evaluate, checkpoint, exit."""
import contextlib
import dataclasses
import gc
import inspect
import math
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.core.console import write_line
from megatron.core.distributed import (
    DistributedDataParallel,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.num_microbatches_calculator import (
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.weight_decay import no_weight_decay_cond
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.progress import PROGRESS, in_section
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.utils import get_model_config
from megatron.training import argument_utils
from megatron.training import telemetry_hooks as telemetry
from megatron.training.checkpoint_errors import checkpoint_errors_as_user_errors
from megatron.training.checkpointing import (
    CheckpointSaveError,
    async_save_pending,
    finalize_async_save,
    load_checkpoint,
    non_persistent_checkpoint_dir,
    save_checkpoint,
    wait_for_async_staging,
)
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.config import CheckpointConfig, DataConfig, TrainingConfig, ValidationConfig
from megatron.training.global_vars import (
    get_args,
    get_config,
    get_telemetry,
    get_tensorboard_writer,
    get_timers,
    get_wandb_writer,
)
from megatron.training.initialize import initialize_megatron
from megatron.training.profiling import RunProfiler, start_memory_history
from megatron.training.moe_metrics import MoERoutingReport
from megatron.training.step_breakdown import StepBreakdown, wrap_data_iterator
from megatron.training.training_state import TrainingState
from megatron.training.troubleshooting import SlowStepDetector, stop_hang_monitor
from megatron.training.user_errors import UserInputError, one_line
from megatron.training.training_log import (
    LogAccumulator,
    gpt_floating_point_operations,
    log_operator_message,
    training_log,
)
from megatron.training.utils import calc_params_l2_norm, forget_broadcast_batch_shape, get_device
from megatron.training.utils import get_rank, is_last_rank, print_rank_0, print_rank_last

_TRAIN_START_TIME = time.time()

# Moved to the configuration builder, which derives a --train-samples run's iterations; kept importable here.
train_iters_for_samples = argument_utils.train_iters_for_samples

# ---------------------------------------------------------------------------------------------------
# Model, optimizer, scheduler
# ---------------------------------------------------------------------------------------------------

def _build_model_chunks(model_provider_func):
    """This rank's model chunks: one per virtual pipeline stage (interleaving), else one.

    Chunk v gets ``pre_process`` only on the first stage's chunk 0 and ``post_process`` only on the
    last stage's last chunk; the provider is passed ``vp_stage=v`` when it accepts it (Megatron's
    newer signature), and the current virtual rank is set while it runs in any case.
    """
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1 or vp_size is None:
        return [model_provider_func(pre_process=parallel_state.is_pipeline_first_stage(),
                                    post_process=parallel_state.is_pipeline_last_stage())]
    takes_vp_stage = "vp_stage" in inspect.signature(model_provider_func).parameters
    chunks = []
    for vp_stage in range(vp_size):
        parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
        kwargs = dict(pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                      post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
        if takes_vp_stage:
            kwargs["vp_stage"] = vp_stage
        chunks.append(model_provider_func(**kwargs))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def get_model(model_provider_func, wrap_with_ddp: bool = True):
    """Build this rank's model chunk(s) (a list), move them to the device and dtype, wrap with DDP.

    Megatron's signature: the dtype (``model.params_dtype``) and the DDP settings (``ddp``) come from
    the run's configuration (``get_config()``).
    """
    cfg = get_config()
    model = _build_model_chunks(model_provider_func)
    for chunk in model:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if parallel_state.get_data_parallel_rank() == 0:
        count = sum(sum(p.nelement() for p in chunk.parameters()) for chunk in model)
        write_line(f" > number of parameters on (tensor, pipeline) model parallel rank "
                   f"({parallel_state.get_tensor_model_parallel_rank()}, "
                   f"{parallel_state.get_pipeline_model_parallel_rank()}): {count}")
    device = get_device()
    for chunk in model:
        chunk.to(device=device, dtype=cfg.model.params_dtype)
    if not wrap_with_ddp:
        return model
    config = get_model_config(model[0])
    # Chunks after the first run their backward last in an iteration: no bucketing (Megatron-LM).
    # --use-torch-fsdp2 makes the ddp slice a TorchFullyShardedDataParallelConfig: wrap with FSDP2.
    wrapper = (TorchFullyShardedDataParallel if isinstance(cfg.ddp, TorchFullyShardedDataParallelConfig)
               else DistributedDataParallel)
    model = [wrapper(config, cfg.ddp, chunk, disable_bucketing=index > 0)
             for index, chunk in enumerate(model)]
    for chunk in model:
        chunk.broadcast_params()
    return model


def get_optimizer_param_scheduler(optimizer):
    """Learning-rate / weight-decay schedule in samples, from the iteration- or sample-based flags.

    The lengths in samples (warm-up, decay, weight-decay increment, WSD anneal) are derived once by the
    configuration builder (``scheduler`` slice); the peak and final lr are the optimizer's.
    """
    cfg = get_config()
    scheduler_cfg = cfg.scheduler
    # Megatron-LM fills the defaulted decay length in on args here, and checkpoints save args.
    if cfg.train.train_samples is None:
        _record_on_args(lr_decay_iters=scheduler_cfg.lr_decay_iters)
    else:
        _record_on_args(lr_decay_samples=scheduler_cfg.lr_decay_samples)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=scheduler_cfg.lr_warmup_init,
        max_lr=cfg.optimizer.lr,
        min_lr=cfg.optimizer.min_lr,
        lr_warmup_steps=scheduler_cfg.lr_warmup_steps,
        lr_decay_steps=scheduler_cfg.lr_decay_steps,
        lr_decay_style=scheduler_cfg.lr_decay_style,
        start_wd=scheduler_cfg.start_weight_decay,
        end_wd=scheduler_cfg.end_weight_decay,
        wd_incr_steps=scheduler_cfg.wd_incr_steps,
        wd_incr_style=scheduler_cfg.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=scheduler_cfg.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=scheduler_cfg.override_opt_param_scheduler,
        wsd_decay_steps=scheduler_cfg.wsd_decay_steps,
        lr_wsd_decay_style=scheduler_cfg.lr_wsd_decay_style,
    )


def _record_on_args(**values):
    """Set run-time values on the global ``args`` where Megatron-LM sets them (``lr_decay_iters``,
    ``do_train``/``do_valid``/``do_test``, ``start_iteration``, ``curr_iteration``, a sample-based
    run's ``train_iters``). Checkpoints save ``args``, so the saved args stay as they were, and
    Megatron-LM code that reads them there finds them; this package reads its configuration instead.
    """
    args = get_args()
    for name, value in values.items():
        setattr(args, name, value)


def _grad_nan_check(model):
    """The optimizer's ``grad_norm_check`` under ``--check-for-nan-in-loss-and-grad``.

    A NaN or Inf in any rank's local grads reaches the reduced grads and so the global grad norm;
    a finite norm (already read to the host for clipping) proves every local grad finite, and
    the step costs no further host read. Otherwise (no clipping, a non-finite norm, an fp16
    overflow) each chunk reads its buckets' local norms once and the rank whose grads were not
    finite raises, before the inner optimizer step. Either way the recorded norms are dropped then.
    """
    def check(grad_norm):
        if grad_norm is not None and math.isfinite(grad_norm):
            for chunk in model:  # decided without them: nothing recorded in backward outlives the step
                chunk.discard_local_grad_norms()
            return
        for chunk in model:
            chunk.check_for_nan_in_grad()

    return check


def setup_model_and_optimizer(model_provider_func, train_state=None):
    """Model chunks, optimizer and scheduler; loads ``--load`` when given. Returns the three.

    ``train_state`` (a :class:`TrainingState`, the loop's counters) receives the loaded counters;
    without one they are loaded into a throw-away state. Megatron's signature: the settings come from
    the run's configuration (``get_config()``).
    """
    cfg = get_config()
    train_state = TrainingState() if train_state is None else train_state
    timers = get_timers()
    with telemetry.span("model_init", "megatron.model_init"):
        start_memory_history(cfg.profiling)  # --record-memory-history: from before the model's allocations
        model = get_model(model_provider_func)
        config = get_model_config(model[0])
        config.timers = timers
        optimizer, opt_param_scheduler = None, None
        if not (cfg.validation.skip_train and cfg.optimizer.lr is None):  # evaluation-only runs need no optimizer
            optimizer_config = dataclasses.replace(cfg.optimizer, timers=timers)
            no_wd = no_weight_decay_cond(cfg.optimizer.apply_wd_to_qk_layernorm)
            optimizer = get_megatron_optimizer(optimizer_config, model, no_weight_decay_cond=no_wd)
            opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
            config.grad_scale_func = optimizer.scale_loss
            if cfg.ddp.check_for_nan_in_grad:
                for chunk in model:
                    chunk.defer_nan_check = True
                optimizer.grad_norm_check = _grad_nan_check(model)
        config.finalize_model_grads_func = finalize_model_grads
        if not cfg.ddp.overlap_grad_reduce:
            # Several chunks (interleaving): one per chunk, as Megatron-LM passes them to the schedule.
            config.no_sync_func = model[0].no_sync if len(model) == 1 else [chunk.no_sync for chunk in model]

    if cfg.checkpoint.load is not None:
        with telemetry.span("load_checkpoint", "megatron.load_checkpoint"):
            timers("load-checkpoint", log_level=0).start(barrier=True)
            with checkpoint_errors_as_user_errors():  # a bad checkpoint is one line naming its file
                load_checkpoint(model, optimizer, opt_param_scheduler, train_state=train_state)
            timers("load-checkpoint").stop(barrier=True)
            timers.log(["load-checkpoint"])
        if train_state.iteration > 0 or cfg.checkpoint.finetune:
            log_operator_message(f"successfully loaded checkpoint from {cfg.checkpoint.load} at iteration "
                                 f"{train_state.iteration}", printed_on_this_rank=get_rank() == 0)
    return model, optimizer, opt_param_scheduler


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------

def get_train_valid_test_num_samples():
    """Samples each split must provide (spec §2.2), from the run's configuration."""
    cfg = get_config()
    return _split_num_samples(cfg.train, cfg.validation)


def _split_num_samples(train_cfg: TrainingConfig, validation_cfg: ValidationConfig):
    """``[train, valid, test]`` samples: the run's training samples; ``eval_iters`` global evaluation
    batches per evaluation, one evaluation every ``eval_interval`` iterations plus the final one."""
    eval_iters, interval = validation_cfg.eval_iters, validation_cfg.eval_interval
    train = train_cfg.train_samples if train_cfg.train_samples else train_cfg.train_iters * train_cfg.global_batch_size
    valid_iters = (train_cfg.train_iters // interval + 1) * eval_iters if interval else eval_iters
    eval_batch = validation_cfg.eval_global_batch_size
    return [train, valid_iters * eval_batch, eval_iters * eval_batch]


def build_train_valid_test_data_iterators(train_valid_test_dataset_provider, train_state=None):
    """Datasets -> resumable samplers -> iterators (None for a split that has no data).

    The train and validation samplers start after ``train_state``'s consumed samples (a fresh run
    without a state). Megatron's signature: the settings come from the run's configuration.
    """
    cfg = get_config()
    iterators, _ = _data_iterators(train_valid_test_dataset_provider, train_state, cfg.train, cfg.validation,
                                   cfg.data, cfg.checkpoint)
    return iterators


def _data_iterators(train_valid_test_dataset_provider, train_state, train_cfg: TrainingConfig,
                    validation_cfg: ValidationConfig, data_cfg: DataConfig, checkpoint_cfg: CheckpointConfig):
    """``((train, valid, test) iterators, (do_train, do_valid, do_test))``: which splits this run has,
    agreed by every rank (ranks without datasets, TP rank > 0, learn it from the others).

    Raises:
        UserInputError: training asked for (``--train-iters`` > 0, no ``--skip-train``) on an empty
            training split; or a checkpoint that consumed a whole split (see ``_resumed_data_loader``).
    """
    train_state = TrainingState() if train_state is None else train_state
    print_rank_0("> building train, validation, and test datasets ...")
    train_ds, valid_ds, test_ds = train_valid_test_dataset_provider(_split_num_samples(train_cfg, validation_cfg))
    sizes = (train_cfg, validation_cfg, data_cfg, checkpoint_cfg.load)
    train_loader = _resumed_data_loader("training", train_ds, train_state.consumed_train_samples, *sizes)
    valid_loader = _resumed_data_loader("validation", valid_ds, train_state.consumed_valid_samples, *sizes,
                                        validation_cfg.eval_micro_batch_size)
    test_loader = build_pretraining_data_loader(test_ds, 0, validation_cfg.eval_micro_batch_size)
    # Ranks without datasets (TP rank > 0) learn from the others which splits exist.
    eval_iters = validation_cfg.eval_iters
    flags = torch.tensor(
        [train_loader is not None and train_cfg.train_iters > 0, valid_loader is not None and eval_iters > 0,
         test_loader is not None and eval_iters > 0], dtype=torch.int32, device=get_collective_device())
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    do_train, do_valid, do_test = (bool(v) for v in flags.tolist())
    _record_on_args(do_train=do_train, do_valid=do_valid, do_test=do_test)
    if train_cfg.train_iters > 0 and not validation_cfg.skip_train and not do_train:
        # Every rank agrees (flags are reduced): rank 0 alone reports it.
        raise UserInputError(_empty_train_split_message(data_cfg, train_cfg.train_iters), same_on_every_rank=True)

    def _iterator(loader):
        if loader is None:
            return None
        if data_cfg.dataloader_type == "cyclic":
            return _cyclic_iter(loader)
        return iter(loader)

    return (_iterator(train_loader), _iterator(valid_loader), _iterator(test_loader)), (do_train, do_valid, do_test)


def _resumed_data_loader(split, dataset, consumed, train_cfg: TrainingConfig, validation_cfg: ValidationConfig,
                         data_cfg: DataConfig, load, micro_batch_size=None):
    """``build_pretraining_data_loader``; a checkpoint that consumed the whole split is the user's error.

    Raises:
        UserInputError: ``consumed`` >= the dataset's length, naming the split, the dataset, the
            checkpoint (``load``, the ``--load`` folder) and the flags that size it.
    """
    if dataset is None or consumed < len(dataset):
        return build_pretraining_data_loader(dataset, consumed, micro_batch_size)
    if data_cfg.data_path:
        source = f"--data-path {' '.join(data_cfg.data_path)} --split {data_cfg.split}"
    else:
        paths = data_cfg.train_data_path if split == "training" else data_cfg.valid_data_path
        source = f"--{'train' if split == 'training' else 'valid'}-data-path {' '.join(paths or [])}"
    wanted = _split_num_samples(train_cfg, validation_cfg)[0 if split == "training" else 1]
    if split == "training":
        sizing = (f"this run asks for {wanted} (--train-iters {train_cfg.train_iters} x --global-batch-size "
                  f"{train_cfg.global_batch_size}, or --train-samples): ask for more than the checkpoint has consumed")
    else:
        sizing = (f"this run asks for {wanted} ((--train-iters {train_cfg.train_iters} // --eval-interval "
                  f"{validation_cfg.eval_interval} + 1) x --eval-iters {validation_cfg.eval_iters} x "
                  f"--eval-global-batch-size {validation_cfg.eval_global_batch_size}): raise --eval-iters or lower "
                  "--eval-interval to ask for more than the checkpoint has consumed")
    raise UserInputError(f"no {split} samples left to consume: the checkpoint of --load {load} has consumed "
                         f"{consumed} {split} samples of {source}, this run's {split} dataset holds {len(dataset)}; "
                         f"{sizing}")


def _empty_train_split_message(data_cfg: DataConfig, train_iters: int) -> str:
    """Why training was asked for but there is nothing to train on, naming the flags to change."""
    if data_cfg.data_path:
        where = (f"--split {data_cfg.split!r} leaves no documents of --data-path {' '.join(data_cfg.data_path)} "
                 "for training; give the first (train) weight of --split a positive value")
    elif data_cfg.train_data_path or data_cfg.valid_data_path or data_cfg.test_data_path:
        train_paths = data_cfg.train_data_path
        where = f"--train-data-path is {' '.join(train_paths) if train_paths else 'not given'}"
    else:
        where = "the dataset provider returned no training dataset"
    return (f"--train-iters {train_iters} asks for training, but the training split is empty: {where} "
            "(or pass --skip-train to only evaluate)")


def _cyclic_iter(iterable):
    while True:
        yield from iterable


# ---------------------------------------------------------------------------------------------------
# One iteration
# ---------------------------------------------------------------------------------------------------

def _reduce_reports(reports):
    """Per-microbatch ``{key: [sum, count]}`` reports -> ``{key: token-weighted mean over the DP group}``."""
    reduced = {}
    if not reports:
        return reduced
    for key in reports[0]:
        values = torch.stack([r[key].view(-1).float() for r in reports])
        if values.shape[1] == 2:
            totals = values.sum(dim=0)
            if dist.is_initialized():
                group = parallel_state.get_data_parallel_group(with_context_parallel=True)
                totals = totals.to(get_collective_device(group))
                dist.all_reduce(totals, group=group)
            reduced[key] = totals[0] / totals[1].clamp(min=1)
        else:
            reduced[key] = values.mean()
    return reduced


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler):
    """Forward/backward over the global batch, optimizer step, scheduler step.

    Returns ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``; loss_dict is empty on
    ranks that do not hold the loss. Megatron's signature: the sizes come from the run's configuration.
    """
    cfg = get_config()
    train_cfg = cfg.train
    timers = get_timers()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()

    with telemetry.span("forward_backward", "megatron.forward_backward", num_microbatches=get_num_microbatches()):
        timers("forward-backward", log_level=1).start()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=get_num_microbatches(),
            seq_length=cfg.data.seq_length,
            micro_batch_size=train_cfg.micro_batch_size,
            forward_only=False,
        )
        timers("forward-backward").stop()
    if train_cfg.empty_unused_memory_level >= 1 and torch.cuda.is_available():
        torch.cuda.empty_cache()  # trade speed for headroom against fragmentation

    PROGRESS.phase = "optimizer"
    with telemetry.span("optimizer", "megatron.optimizer_step") as span:
        timers("optimizer", log_level=1).start()
        # An --async-save in progress must have copied the parameters before the step changes them.
        wait_for_async_staging()
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
        timers("optimizer").stop()
        telemetry.set_attributes(span, update_successful=update_successful, grad_norm=grad_norm)

    if train_cfg.empty_unused_memory_level >= 2 and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if update_successful:
        opt_param_scheduler.step(
            increment=get_num_microbatches() * train_cfg.micro_batch_size * cfg.dist.data_parallel_size)
    skipped_iter = 0 if update_successful else 1
    loss_dict = _reduce_reports(reports) if parallel_state.is_pipeline_last_stage() else {}
    return loss_dict, skipped_iter, grad_norm, num_zeros_in_grad


# ---------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------

def evaluate(forward_step_func, data_iterator, model, verbose=False, train_state=None):
    """``--eval-iters`` forward-only global batches; returns ``{key: token-weighted mean loss}``.

    Advances ``train_state.consumed_valid_samples`` (the validation iterator's position) when given.
    Megatron's signature: the sizes come from the run's configuration.
    """
    cfg = get_config()
    validation_cfg = cfg.validation
    eval_iters, eval_global_batch_size = validation_cfg.eval_iters, validation_cfg.eval_global_batch_size
    for chunk in model:
        chunk.eval()
    num_microbatches = eval_global_batch_size // (validation_cfg.eval_micro_batch_size * cfg.dist.data_parallel_size)
    totals = {}
    forget_broadcast_batch_shape()  # --eval-micro-batch-size may differ from training's
    with torch.no_grad(), telemetry.span("evaluate", "megatron.evaluate", eval_iters=eval_iters), \
            in_section("evaluation"):
        for step in range(eval_iters):
            if verbose:
                print_rank_0(f"Evaluating iter {step + 1}/{eval_iters}")
            with telemetry.span("evaluate", "megatron.evaluate.step"):
                reports = get_forward_backward_func()(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=num_microbatches, seq_length=cfg.data.seq_length,
                    micro_batch_size=validation_cfg.eval_micro_batch_size, forward_only=True,
                )
            for report in reports:
                for key, value in report.items():
                    value = value.view(-1).double()
                    totals[key] = totals.get(key, 0) + value
            if train_state is not None:
                train_state.consumed_valid_samples += eval_global_batch_size
    for chunk in model:
        chunk.train()
    forget_broadcast_batch_shape()
    results = {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for key, value in totals.items():
        if dist.is_initialized():
            value = value.to(get_collective_device(group))
            dist.all_reduce(value, group=group)
        results[key] = (value[0] / value[1].clamp(min=1)).item() if value.numel() == 2 else value.mean().item()
    return results


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration, verbose=False,
                               split="validation", train_state=None):
    """Evaluate, print Megatron's validation block on the last rank (also sent through ``logging``),
    and write TensorBoard and W&B scalars. ``split`` ("validation" or "test") labels the telemetry
    gauges (TensorBoard keeps Megatron's tags, which do not name the split). Megatron's signature: what
    is logged where comes from the run's configuration (``logger``)."""
    log_ppl = get_config().logger.log_validation_ppl_to_tensorboard
    writer = get_tensorboard_writer()
    wandb_writer = get_wandb_writer()
    results = evaluate(forward_step_func, data_iterator, model, verbose, train_state=train_state)
    consumed_train_samples = train_state.consumed_train_samples if train_state is not None else 0
    string = f" validation loss at {prefix} | "
    for key, loss in results.items():
        ppl = math.exp(min(20.0, loss))
        string += f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} validation", loss, iteration)
            writer.add_scalar(f"{key} validation vs samples", loss, consumed_train_samples)
            if log_ppl:
                writer.add_scalar(f"{key} validation ppl", ppl, iteration)
                writer.add_scalar(f"{key} validation ppl vs samples", ppl, consumed_train_samples)
        if key == "lm loss":
            telemetry.record_validation_metrics(loss=loss, ppl=ppl, split=split)
        if wandb_writer is not None:
            scalars = {f"{key} validation": loss}
            if log_ppl:
                scalars[f"{key} validation ppl"] = ppl
            wandb_writer.log(scalars, step=iteration)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
    log_operator_message(string.strip(), printed_on_this_rank=is_last_rank())
    return results


# ---------------------------------------------------------------------------------------------------
# Exit handling
# ---------------------------------------------------------------------------------------------------

class _SignalFlag:
    """Remembers that ``--exit-signal`` arrived, so the loop can save and stop at an iteration boundary."""

    def __init__(self, sig):
        self.received = False
        self.signal = sig
        signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.received = True


def _any_rank(flag: bool) -> bool:
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=get_collective_device())
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@contextlib.contextmanager
def checkpoint_save_errors_as_user_errors():
    """A checkpoint save that failed (CheckpointSaveError: a file that could not be written, e.g. a full disk,
    a file-size limit or a --save under a file; or another rank's failure) ends the run with one line on
    each rank naming the file and the cause (exit status 1) instead of a traceback; the previous
    checkpoint and tracker were left unchanged. Other exceptions pass unchanged."""
    try:
        yield
    except CheckpointSaveError as error:
        raise UserInputError(one_line(error)) from error


def _save(iteration, model, optimizer, opt_param_scheduler, flops_so_far, train_state, checkpoint_cfg: CheckpointConfig,
          non_persistent=False):
    """``save_checkpoint`` timed and in a span; then the operator message naming where it went
    (``checkpoint_cfg.save``, or the non-persistent folder)."""
    timers = get_timers()
    with telemetry.span("checkpoint", "megatron.save_checkpoint", iteration=iteration), in_section("checkpoint"):
        timers("save-checkpoint", log_level=0).start(barrier=True)
        with checkpoint_save_errors_as_user_errors():
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops_so_far, train_state=train_state,
                            non_persistent_ckpt=non_persistent)
        timers("save-checkpoint").stop(barrier=True)
        timers.log(["save-checkpoint"])
    where = non_persistent_checkpoint_dir(checkpoint_cfg) if non_persistent else checkpoint_cfg.save
    log_operator_message(f"successfully saved {'non-persistent ' if non_persistent else ''}checkpoint from "
                         f"iteration {iteration:7d} to {where}", printed_on_this_rank=get_rank() == 0)


def _exit_message(message):
    print_rank_0(message)
    log_operator_message(message, printed_on_this_rank=get_rank() == 0)


def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, flops_so_far, signal_flag,
                               train_state=None):
    """Save on schedule or on exit conditions (signal, duration, exit interval); True means stop now.

    ``train_state`` (the loop's counters) is what the checkpoints record. Megatron's name: the schedule
    comes from the run's configuration (``checkpoint`` and ``train``).
    """
    cfg = get_config()
    checkpoint_cfg, train_cfg = cfg.checkpoint, cfg.train
    save = checkpoint_cfg.save

    def _save_now(non_persistent=False):
        _save(iteration, model, optimizer, opt_param_scheduler, flops_so_far, train_state, checkpoint_cfg,
              non_persistent=non_persistent)

    saved = False
    if signal_flag is not None and _any_rank(signal_flag.received):
        if save:
            _save_now()
        _exit_message(f"exiting program after receiving {signal_flag.signal.name}.")
        return True
    if save and checkpoint_cfg.save_interval and iteration % checkpoint_cfg.save_interval == 0:
        _save_now()
        saved = True
    elif (save and checkpoint_cfg.non_persistent_save_interval
          and iteration % checkpoint_cfg.non_persistent_save_interval == 0):
        _save_now(non_persistent=True)
        saved = True
    if train_cfg.exit_duration_in_mins:
        elapsed_minutes = (time.time() - _TRAIN_START_TIME) / 60.0
        value = torch.tensor([elapsed_minutes], dtype=torch.float64, device=get_collective_device())
        if dist.is_initialized():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if value.item() > train_cfg.exit_duration_in_mins:
            if save and not saved:
                _save_now()
            _exit_message(f"exiting program after {value.item():.2f} minutes")
            return True
    if train_cfg.exit_interval and iteration % train_cfg.exit_interval == 0:
        if save and not saved:
            _save_now()
        _exit_message(f"exiting program at iteration {iteration}")
        return True
    return False


# ---------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------

def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          train_state=None, do_valid=None):
    """Run iterations until ``--train-iters`` or an exit condition. Returns (iteration, flops_so_far, exited).

    ``train_state`` (a :class:`TrainingState`, the loaded one on a resume; fresh when None) is advanced
    in place every iteration and is what the checkpoints record. ``do_valid``: whether the run has
    validation data (``pretrain`` passes it); None reads it where Megatron-LM's callers of this
    function leave it, on ``args`` (``build_train_valid_test_data_iterators`` sets it there). Megatron's
    name: the settings come from the run's configuration.
    """
    cfg = get_config()
    train_cfg, validation_cfg, logger_cfg = cfg.train, cfg.validation, cfg.logger
    if do_valid is None:
        args = get_args()
        do_valid = args.do_valid
    train_state = TrainingState() if train_state is None else train_state
    for chunk in model:
        chunk.train()
    iteration = start_iteration = train_state.iteration
    _record_on_args(start_iteration=start_iteration)
    flops_so_far = train_state.num_floating_point_operations_so_far
    signal_flag = _SignalFlag(train_cfg.exit_signal) if train_cfg.exit_signal_handler else None
    acc = LogAccumulator()
    if train_cfg.manual_gc:
        # Python's automatic GC pauses ranks at different moments and stalls the collectives of
        # the others; collect at the same iterations everywhere instead.
        gc.disable()
        gc.collect()
    gc_eval = train_cfg.manual_gc and train_cfg.manual_gc_eval
    last_log_time, last_log_iteration = time.perf_counter(), iteration
    # Where each rank's step time goes (--log-straggler or telemetry metrics): see step_breakdown.py.
    breakdown = StepBreakdown.create(logger_cfg, get_telemetry())
    # Per-expert routing counts of the MoE layers (telemetry metrics on): see moe_metrics.py.
    moe_report = MoERoutingReport.create(cfg.model, get_telemetry())
    train_data_iterator = wrap_data_iterator(train_data_iterator)
    telemetry.prepare_metrics()
    slow_steps = SlowStepDetector(logger_cfg.slow_step_factor, get_rank()) if logger_cfg.slow_step_factor else None
    world_size, data_parallel_size, seq_length = cfg.dist.world_size, cfg.dist.data_parallel_size, cfg.data.seq_length

    print_rank_0("training ...")
    profiler = RunProfiler.create(cfg.profiling, logger_cfg.tensorboard_dir)  # --profile*, --record-memory-history
    with telemetry.span("job", "megatron.train", train_iters=train_cfg.train_iters), \
            contextlib.closing(profiler) if profiler is not None else contextlib.nullcontext():
        while iteration < train_cfg.train_iters:
            # --rampup-batch-size: this iteration's batch follows the samples consumed so far.
            update_num_microbatches(train_state.consumed_train_samples, consistency_check=True, verbose=True)
            num_microbatches = get_num_microbatches()
            _record_on_args(curr_iteration=iteration)
            if async_save_pending():  # every rank has the same pending save: publish it once all wrote it
                with checkpoint_save_errors_as_user_errors():
                    finalize_async_save(blocking=False)
            if profiler is not None:  # before the breakdown's clock: writing a trace is not the step's time
                profiler.begin_iteration(iteration)
            if breakdown is not None:
                breakdown.step_begin()
            PROGRESS.iteration, PROGRESS.section, PROGRESS.phase = iteration + 1, "train", None
            step_started = time.perf_counter()
            with telemetry.step_span(iteration + 1, first=(iteration == start_iteration)) as step_span:
                loss_dict, skipped_iter, grad_norm, num_zeros = train_step(
                    forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler
                )
                telemetry.set_attributes(step_span, loss=loss_dict.get("lm loss"), grad_norm=grad_norm,
                                         **(profiler.span_attributes(iteration + 1) if profiler is not None else {}))
            if breakdown is not None:
                breakdown.step_end()
            if slow_steps is not None:
                slow_steps.step(iteration + 1, time.perf_counter() - step_started)
            telemetry.note_step_finished()
            iteration += 1
            batch_size = train_cfg.micro_batch_size * data_parallel_size * num_microbatches
            flops = gpt_floating_point_operations(cfg.model, seq_length, cfg.tokenizer.padded_vocab_size, batch_size)
            flops_so_far += flops
            train_state.iteration = iteration
            train_state.consumed_train_samples += batch_size
            train_state.num_floating_point_operations_so_far = flops_so_far

            is_log_iteration = iteration % logger_cfg.log_interval == 0 or iteration == start_iteration + 1
            if logger_cfg.log_params_norm and is_log_iteration and cfg.ddp.overlap_param_gather:
                for chunk in model:  # the updated shards are otherwise gathered only by the next forward
                    chunk.sync_params_for_read()
            params_norm = calc_params_l2_norm(model) if logger_cfg.log_params_norm and is_log_iteration else None
            now = time.perf_counter() if is_log_iteration else last_log_time
            learning_rate = optimizer.param_groups[0]["lr"]
            if is_log_iteration and breakdown is not None:  # collective: every rank, same iterations
                breakdown.report(flops / world_size)
            if is_log_iteration and moe_report is not None:  # collective: every rank, same iterations
                moe_report.report()
            if is_log_iteration and slow_steps is not None:  # the slow steps of the interval, explained
                slow_steps.report(breakdown.last_table if breakdown is not None else None, last_log_iteration + 1,
                                  iteration)
            training_log(
                acc, loss_dict, learning_rate, optimizer.get_loss_scale(),
                iteration, grad_norm, params_norm, num_zeros, skipped_iter, now - last_log_time,
                iteration - last_log_iteration, num_microbatches, is_log_iteration, train_state=train_state,
                logger_cfg=logger_cfg, train_iters=train_cfg.train_iters, world_size=world_size,
                seq_length=seq_length, batch_size=batch_size, flops=flops,
            )
            if is_log_iteration:
                last_log_time, last_log_iteration = time.perf_counter(), iteration
            if profiler is not None:
                profiler.end_iteration(iteration, iteration % logger_cfg.log_interval == 0)

            if train_cfg.manual_gc and train_cfg.manual_gc_interval and iteration % train_cfg.manual_gc_interval == 0:
                gc.collect()
            # Evaluation and checkpoint time is not training time: shift the log window past it.
            paused_at = time.perf_counter()
            if validation_cfg.eval_interval and iteration % validation_cfg.eval_interval == 0 and do_valid:
                if gc_eval:
                    gc.collect()
                evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator, model,
                                           iteration, train_state=train_state)
                if gc_eval:
                    gc.collect()
            if checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, flops_so_far, signal_flag,
                                          train_state):
                return iteration, flops_so_far, True
            last_log_time += time.perf_counter() - paused_at
    return iteration, flops_so_far, False


def pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func, extra_args_provider=None,
             args_defaults=None, argv=None):
    """Megatron's entry point: initialise, build everything, train, evaluate, save.

    Args:
        train_valid_test_dataset_provider: ``f([n_train, n_valid, n_test]) -> (train, valid, test)`` datasets.
        model_provider: ``f(pre_process, post_process) -> torch.nn.Module`` for this pipeline stage.
        forward_step_func: ``f(data_iterator, model) -> (output_tensor, loss_func)``.
        argv: flags to parse instead of ``sys.argv`` (tests).
    """
    initialize_megatron(extra_args_provider, args_defaults, argv=argv)
    cfg = get_config()
    train_cfg, checkpoint_cfg = cfg.train, cfg.checkpoint
    # A --train-samples run still counts iterations: the configuration derived them; Megatron-LM sets
    # them on args too (and checkpoints save args).
    _record_on_args(train_iters=train_cfg.train_iters)
    with telemetry.span("job", "megatron.pretrain", model_type="GPT", train_iters=train_cfg.train_iters,
                        global_batch_size=train_cfg.global_batch_size):
        # The loop's counters: loaded with the checkpoint, advanced by train(), saved in checkpoints.
        train_state = TrainingState()
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, train_state)
        (train_it, valid_it, test_it), (do_train, do_valid, do_test) = _data_iterators(
            train_valid_test_dataset_provider, train_state, train_cfg, cfg.validation, cfg.data, checkpoint_cfg)
        if len(model) > 1:
            # Interleaving: the schedule takes one iterator per chunk. Only chunk 0 of the first stage and
            # the last chunk of the last stage read data (see pretrain_gpt.get_batch), so they can share one.
            train_it, valid_it, test_it = ([it] * len(model) for it in (train_it, valid_it, test_it))
        iteration = train_state.iteration
        exited = False
        if do_train and not cfg.validation.skip_train:
            iteration, flops_so_far, exited = train(
                forward_step_func, model, optimizer, opt_param_scheduler, train_it, valid_it, train_state,
                do_valid=do_valid,
            )
            if (not exited and checkpoint_cfg.save and iteration != 0
                    and iteration % checkpoint_cfg.save_interval != 0):
                _save(iteration, model, optimizer, opt_param_scheduler, flops_so_far, train_state, checkpoint_cfg)
        if not exited:
            if do_valid:
                evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func, valid_it,
                                           model, iteration, verbose=True, train_state=train_state)
            if do_test:
                evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_it,
                                           model, iteration, verbose=True, split="test")
    with checkpoint_save_errors_as_user_errors():
        finalize_async_save(blocking=True)  # an --async-save still being written is published before exit
    _shutdown()
    if exited:
        sys.exit(0)


_GLOO_DRAIN_S = 0.25  # see _shutdown


def _shutdown():
    from megatron.core import step_timing
    from megatron.core.transformer.moe import routing_stats
    from megatron.training.global_vars import destroy_global_variables

    step_timing.uninstall()  # the step-breakdown recorder of train(), if any
    routing_stats.uninstall()  # the MoE routing recorder of train(), if any
    stop_hang_monitor()  # before the store goes away with the process group

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    destroy_global_variables()
    if dist.is_initialized():
        dist.barrier()
        # A gloo worker thread releases a finished collective's tensors after the caller has seen it
        # complete, and needs the GIL for that. If the interpreter is already finalizing, CPython ends
        # the thread with pthread_exit and libstdc++ aborts the whole process ("terminate called
        # without an active exception") after a run that succeeded. So give those threads the GIL
        # now, then release the groups while the interpreter is intact.
        time.sleep(_GLOO_DRAIN_S)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
