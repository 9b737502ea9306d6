"""Per-iteration reporting: Megatron's log line, TensorBoard/W&B scalars, step metrics, operator log records, FLOPs."""
import logging
import math
from datetime import datetime

import torch

from megatron.core.console import write_line
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import telemetry_hooks as telemetry
from megatron.training.argument_utils import (
    core_transformer_config_from_args,
    data_config_from_args,
    tokenizer_config_from_args,
)
from megatron.training.config.training_config import LoggerConfig
from megatron.training.global_vars import (
    get_config,
    get_telemetry,
    get_tensorboard_writer,
    get_timers,
    get_wandb_writer,
)
from megatron.training.theoretical_memory_usage import report_theoretical_memory
from megatron.training.utils import is_last_rank, print_rank_last, report_memory

logger = logging.getLogger(__name__)

# LogRecord attribute marking a message that is already on the console (printed by print_rank_*):
# the framework's console handler skips such records, so nothing is printed twice.
CONSOLE_PRINTED = "megatron_console_printed"

# Level-1 timers Megatron prints after each log line (§8.4 of the compatibility spec).
_LOGGED_TIMERS = [
    "forward-backward", "all-grads-sync", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
    "batch-generator", "forward-compute", "backward-compute",
]


def gpt_floating_point_operations(model_cfg: TransformerConfig, seq_length: int, padded_vocab_size: int,
                                  batch_size: int) -> int:
    """Training FLOPs of one iteration of a dense GPT (forward + backward), Megatron's formula.

    ``B*s*[6*h*f*g*L + 6*L*(h*(q+k+v) + q*h) + 6*h*V] + B*s^2*L*6*q`` with q = kv_channels*heads,
    k = v = kv_channels*groups, g = 3 for SwiGLU (a gated linear unit) else 2 (spec §8.3; Narayanan et
    al. 2021, §5.1). ``model_cfg.num_query_groups`` is the heads without grouped-query attention.
    """
    return _gpt_flops(batch_size, seq_length, model_cfg.num_layers, model_cfg.hidden_size,
                      model_cfg.ffn_hidden_size, padded_vocab_size, model_cfg.kv_channels,
                      model_cfg.num_attention_heads, model_cfg.num_query_groups, model_cfg.gated_linear_unit)


def num_floating_point_operations(args, batch_size: int) -> int:
    """:func:`gpt_floating_point_operations` with Megatron-LM's signature, over validated ``args``
    (their model, sequence length and padded vocabulary, read by ``argument_utils``' builders)."""
    model_cfg = core_transformer_config_from_args(args)
    seq_length = data_config_from_args(args).seq_length
    return gpt_floating_point_operations(model_cfg, seq_length, tokenizer_config_from_args(args).padded_vocab_size,
                                         batch_size)


def _gpt_flops(batch_size, s, L, h, f, V, kv_channels, heads, groups, gated) -> int:
    """The formula of :func:`gpt_floating_point_operations` over plain numbers (integer arithmetic)."""
    q = kv_channels * heads
    kv = kv_channels * groups
    g = 3 if gated else 2
    per_token = 6 * h * f * g * L + 6 * L * (h * (q + 2 * kv) + q * h) + 6 * h * V
    return batch_size * s * per_token + batch_size * s * s * L * 6 * q


# ---------------------------------------------------------------------------------------------------

def log_operator_message(message: str, printed_on_this_rank: bool, level: int = logging.INFO) -> None:
    """Send a message that is also printed on the console (iteration summary, checkpoint saved or
    loaded, evaluation results, exit reason) through Python ``logging`` as well.

    The record goes out on the rank that printed it and on ranks whose OpenTelemetry log bridge is
    active (which may not be the printing rank), so the bridge and any user handler receive it; it
    carries ``CONSOLE_PRINTED`` so the framework's console handler does not print it a second time.
    """
    if not (printed_on_this_rank or _log_bridge_active()):
        return
    if logger.isEnabledFor(level):
        logger.log(level, message, extra={CONSOLE_PRINTED: True})


def _log_bridge_active() -> bool:
    handle = get_telemetry()
    return handle is not None and getattr(handle, "logger_provider", None) is not None


class _WandbScalars:
    """``add_scalar(tag, value, step)`` onto a W&B run, so Timers.write serves both writers."""

    def __init__(self, run):
        self.run = run

    def add_scalar(self, tag, value, step):
        self.run.log({tag: value}, step=step)


class LogAccumulator:
    """Sums losses and counts between two log lines (Megatron's ``total_loss_dict``)."""

    def __init__(self):
        self.reset()
        # Megatron's report_memory_flag: the memory report follows the first log line of a run only.
        self.memory_reported = False
        # Keys the line prints only when their average is above 0 (Megatron's ``avg > 0.0``): the MoE aux losses,
        # which Megatron's track_moe_metrics adds as zeros when their coefficient is 0.
        self.shown_when_positive = set()

    def reset(self):
        self.losses = {}
        self.advanced = 0
        self.skipped = 0
        self._nan_flags = []  # per iteration: a bool, or a device bool tensor read at the log line

    @property
    def nan(self) -> int:
        """Iterations since the last reset whose loss or grad norm was NaN/Inf (host sync on device flags)."""
        return sum(int(flag) for flag in self._nan_flags)

    def add(self, loss_dict, skipped_iter, grad_norm=None):
        """Count one iteration.

        A "nan iteration" is one whose loss or grad norm was NaN/Inf, whether its optimizer step was
        skipped (fp16 overflow) or applied (fp32/bf16 with ``--no-check-for-nan-in-loss-and-grad``,
        which, as in Megatron-LM, lets training proceed). Losses of applied steps are summed as they
        are, so a non-finite loss shows in the averaged loss of the log line.
        """
        if grad_norm is not None and not math.isfinite(grad_norm):
            self._nan_flags.append(True)
        elif loss_dict:
            # Device tensors: the flag is read at the log line, so no host sync per iteration.
            flags = [~torch.isfinite(torch.as_tensor(value)).all() for value in loss_dict.values()]
            self._nan_flags.append(torch.stack(flags).any() if len(flags) > 1 else flags[0])
        if skipped_iter:
            self.skipped += 1
            return
        self.advanced += 1
        for key, value in loss_dict.items():  # device tensors: no host sync until the log line
            self.losses[key] = self.losses.get(key, 0.0) + value

    def read(self, loss_scale) -> tuple:
        """``(loss totals {key: float}, float(loss_scale), nan count)`` with one device-to-host read.

        The device values (loss totals, loss scale, per-iteration NaN flags) are stacked and read
        together; host values pass through. Leaves the accumulator unchanged.
        """
        entries = [("loss", key, value) for key, value in self.losses.items()]
        entries.append(("scale", None, loss_scale))
        entries += [("nan", None, flag) for flag in self._nan_flags]
        on_device = [value for _, _, value in entries if isinstance(value, torch.Tensor)]
        read_back = iter([])
        if on_device:
            device = on_device[0].device
            read_back = iter(torch.stack([v.detach().reshape(()).to(device, torch.float64) for v in on_device])
                             .tolist())
        losses, scale, nan = {}, 1.0, 0
        for kind, key, value in entries:
            value = next(read_back) if isinstance(value, torch.Tensor) else value
            if kind == "loss":
                losses[key] = float(value)
            elif kind == "scale":
                scale = float(value)
            else:
                nan += int(bool(value))
        return losses, scale, nan


def training_log(acc, loss_dict, learning_rate, loss_scale, iteration, grad_norm, params_norm,
                 num_zeros_in_grad, skipped_iter, elapsed_since_last_log, iterations_since_last_log,
                 num_microbatches, is_log_iteration, train_state=None, *, logger_cfg: LoggerConfig,
                 train_iters: int, world_size: int, seq_length: int, batch_size: int, flops: int):
    """Accumulate this iteration; on log iterations print Megatron's log line (last rank).

    TensorBoard scalars (and the same names on W&B, without the ``vs samples`` twins) are written
    every ``--tensorboard-log-interval`` iterations. The log line also goes through ``logging``
    (see :func:`log_operator_message`). ``num_microbatches`` is this iteration's count, so the
    ``global batch size`` shown follows ``--rampup-batch-size``. Returns the averaged losses on log
    iterations, else None. ``train_state`` (the loop's :class:`TrainingState`) gives the consumed
    samples shown and logged (0 without one).

    ``logger_cfg`` says what goes where; ``train_iters`` (the run's length), ``world_size`` (ranks) and
    ``seq_length`` are shown or divide the throughput; ``batch_size`` is this iteration's global batch
    (micro batch x data-parallel size x ``num_microbatches``) and ``flops`` its training FLOPs.
    """
    timers = get_timers()
    writer = get_tensorboard_writer()
    wandb_writer = get_wandb_writer()
    acc.add(loss_dict, skipped_iter, grad_norm)
    consumed_train_samples = train_state.consumed_train_samples if train_state is not None else 0

    if (writer is not None or wandb_writer is not None) and iteration % logger_cfg.tensorboard_log_interval == 0:
        samples = consumed_train_samples
        scalars = {"learning-rate": learning_rate, "batch-size": batch_size}
        scalars.update({key: float(value) for key, value in loss_dict.items()})
        if logger_cfg.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = float(loss_scale)
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        if num_zeros_in_grad is not None:
            scalars["num-zeros"] = num_zeros_in_grad
        if params_norm is not None:
            scalars["params-norm"] = params_norm
        per_iteration = {}  # no "vs samples" twin
        if logger_cfg.log_world_size_to_tensorboard:
            per_iteration["world-size"] = world_size
        if logger_cfg.log_memory_to_tensorboard and torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            per_iteration["mem-reserved-bytes"] = stats["reserved_bytes.all.current"]
            per_iteration["mem-allocated-bytes"] = stats["allocated_bytes.all.current"]
            per_iteration["mem-max-allocated-bytes"] = stats["allocated_bytes.all.peak"]
            per_iteration["mem-allocated-count"] = stats["allocation.all.current"]
        if writer is not None:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
                writer.add_scalar(tag + " vs samples", value, samples)
            for tag, value in per_iteration.items():
                writer.add_scalar(tag, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({**scalars, **per_iteration}, step=iteration)
    _track_moe_metrics(acc, iteration, num_microbatches, writer, wandb_writer)

    if not is_log_iteration:
        return None
    elapsed_per_iteration = elapsed_since_last_log / max(iterations_since_last_log, 1)
    throughput = flops / (elapsed_per_iteration * 1e12 * world_size)
    if logger_cfg.log_timers_to_tensorboard:
        for target in (writer, _WandbScalars(wandb_writer) if wandb_writer is not None else None):
            if target is None:
                continue
            target.add_scalar("iteration-time", elapsed_per_iteration, iteration)
            if logger_cfg.log_throughput:
                target.add_scalar("throughput", throughput, iteration)
            timers.write(_LOGGED_TIMERS, target, iteration, normalizer=max(iterations_since_last_log, 1))

    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_per_iteration * 1000.0:.1f} |"
    if logger_cfg.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if learning_rate is not None:
        line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    averages = {}
    loss_totals, loss_scale_value, nan_iterations = acc.read(loss_scale)  # the log line's one host read
    for key, total in loss_totals.items():
        averages[key] = total / max(acc.advanced, 1)
        if key in acc.shown_when_positive and averages[key] == 0:
            continue
        if not averages[key] < 0:  # NaN/Inf are shown: hiding them would hide the divergence
            line += f" {key}: {averages[key]:.6E} |"
    line += f" loss scale: {loss_scale_value:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        line += f" num zeros: {num_zeros_in_grad} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {acc.skipped:3d} |"
    line += f" number of nan iterations: {nan_iterations:3d} |"
    print_rank_last(line)
    log_operator_message(line, printed_on_this_rank=is_last_rank())
    telemetry.record_step_metrics(
        elapsed_ms=elapsed_per_iteration * 1000.0, loss=averages.get("lm loss"), throughput_tflops=throughput,
        tokens_per_sec=batch_size * seq_length / max(elapsed_per_iteration, 1e-12), grad_norm=grad_norm,
        skipped=acc.skipped, learning_rate=learning_rate, iteration=iteration,
        consumed_samples=consumed_train_samples,
    )
    acc.reset()
    if not acc.memory_reported:
        _report_memory(iteration, num_microbatches)
        acc.memory_reported = True
    timers.log([name for name in _LOGGED_TIMERS], normalizer=max(iterations_since_last_log, 1))
    return averages


def moe_track_names(model_cfg) -> list:
    """The MoE auxiliary losses a run logs (Megatron's ``training_log``): ``load_balancing_loss`` with aux_loss,
    ``seq_load_balancing_loss`` with seq_aux_loss, ``z_loss`` with a z-loss coefficient. A list of balancing types is
    read by membership (Megatron's ``in`` on a single string would also match aux_loss inside seq_aux_loss, whose
    always-zero value Megatron's log line then hides)."""
    kinds = model_cfg.moe_router_load_balancing_type
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    names = []
    if "aux_loss" in kinds:
        names.append("load_balancing_loss")
    if "seq_aux_loss" in kinds:
        names.append("seq_load_balancing_loss")
    if model_cfg.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def _track_moe_metrics(acc, iteration, num_microbatches, writer, wandb_writer):
    """Every iteration, on every rank (the reduction is collective): Megatron's ``track_moe_metrics`` with
    ``loss_scale = 1 / num_microbatches``. It adds each aux loss, averaged over the MoE layers, into the log line's
    totals (``acc.losses``, after ``lm loss``: the line prints ``load_balancing_loss: %.6E |`` there), writes it to
    TensorBoard / W&B, and with ``--moe-per-layer-logging`` each layer's value as ``moe/{name}_layer_{i}``. As in
    Megatron, an aux loss whose coefficient is 0 is logged as 0 to TensorBoard but left out of the line."""
    model_cfg = get_config().model
    if getattr(model_cfg, "num_moe_experts", None) is None:
        return
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    names = moe_track_names(model_cfg)
    acc.shown_when_positive.update(names)
    track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=iteration, writer=writer,
                      wandb_writer=wandb_writer, total_loss_dict=acc.losses,
                      per_layer_logging=model_cfg.moe_per_layer_logging, force_initialize=True,
                      track_names=names, num_layers=model_cfg.num_layers,
                      moe_layer_freq=model_cfg.moe_layer_freq)


def _report_memory(iteration, num_microbatches):
    """After the first log line, once the optimizer state exists: the theoretical footprint and, on
    CUDA, the allocator's statistics, as Megatron-LM prints them. Printed by the rank that prints the
    log line (Megatron-LM uses rank 0), so that no other rank's output can land inside these lines.
    The estimator reads the whole run's configuration (model, parallel sizes, precision, batch)."""
    if not is_last_rank():
        return
    report_theoretical_memory(get_config(), num_microbatches=num_microbatches, verbose=True)
    measured = report_memory(f"{iteration} iterations")
    if measured:
        write_line(measured)
