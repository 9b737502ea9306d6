"""Per-iteration reporting: Megatron's log line, TensorBoard scalars, step metrics, and the FLOP count."""
import math
from datetime import datetime

import torch

from megatron.training import telemetry_hooks as telemetry
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers
from megatron.training.utils import print_rank_last

# Level-1 timers Megatron prints after each log line (§8.4 of the compatibility spec).
_LOGGED_TIMERS = [
    "forward-backward", "all-grads-sync", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
    "batch-generator", "forward-compute", "backward-compute",
]


def num_floating_point_operations(args, batch_size: int) -> int:
    """Training FLOPs of one iteration of a dense GPT (forward + backward), Megatron's formula.

    ``B*s*[6*h*f*g*L + 6*L*(h*(q+k+v) + q*h) + 6*h*V] + B*s^2*L*6*q`` with q = kv_channels*heads,
    k = v = kv_channels*groups, g = 3 for SwiGLU else 2 (spec §8.3; Narayanan et al. 2021, §5.1).
    """
    s, L, h = args.seq_length, args.num_layers, args.hidden_size
    f = args.ffn_hidden_size
    V = args.padded_vocab_size
    q = args.kv_channels * args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    kv = args.kv_channels * groups
    g = 3 if args.swiglu else 2
    per_token = 6 * h * f * g * L + 6 * L * (h * (q + 2 * kv) + q * h) + 6 * h * V
    return batch_size * s * per_token + batch_size * s * s * L * 6 * q



# ---------------------------------------------------------------------------------------------------

class LogAccumulator:
    """Sums losses and counts between two log lines (Megatron's ``total_loss_dict``)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.losses = {}
        self.advanced = 0
        self.skipped = 0
        self.nan = 0

    def add(self, loss_dict, skipped_iter):
        """Count one iteration; a skipped one (optimizer step not taken) is a "nan iteration" when its loss was NaN/Inf."""
        if skipped_iter:
            self.skipped += 1
            if any(not math.isfinite(float(value)) for value in loss_dict.values()):
                self.nan += 1
            return
        self.advanced += 1
        for key, value in loss_dict.items():  # device tensors: no host sync until the log line
            self.losses[key] = self.losses.get(key, 0.0) + value


def training_log(acc, loss_dict, learning_rate, loss_scale, iteration, grad_norm, params_norm,
                 num_zeros_in_grad, skipped_iter, elapsed_since_last_log, iterations_since_last_log,
                 num_microbatches, is_log_iteration):
    """Accumulate this iteration; on log iterations print Megatron's log line (last rank).

    TensorBoard scalars are written every ``--tensorboard-log-interval`` iterations. Returns the
    averaged losses on log iterations, else None.
    """
    args = get_args()
    timers = get_timers()
    writer = get_tensorboard_writer()
    acc.add(loss_dict, skipped_iter)
    batch_size = args.micro_batch_size * args.data_parallel_size * num_microbatches

    if writer is not None and iteration % args.tensorboard_log_interval == 0:
        samples = args.consumed_train_samples
        scalars = {"learning-rate": learning_rate, "batch-size": batch_size}
        scalars.update({key: float(value) for key, value in loss_dict.items()})
        if args.log_loss_scale_to_tensorboard:
            scalars["loss-scale"] = float(loss_scale)
        if grad_norm is not None:
            scalars["grad-norm"] = grad_norm
        if num_zeros_in_grad is not None:
            scalars["num-zeros"] = num_zeros_in_grad
        if params_norm is not None:
            scalars["params-norm"] = params_norm
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
            writer.add_scalar(tag + " vs samples", value, samples)
        if args.log_world_size_to_tensorboard:
            writer.add_scalar("world-size", args.world_size, iteration)
        if args.log_memory_to_tensorboard and torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            writer.add_scalar("mem-reserved-bytes", stats["reserved_bytes.all.current"], iteration)
            writer.add_scalar("mem-allocated-bytes", stats["allocated_bytes.all.current"], iteration)
            writer.add_scalar("mem-max-allocated-bytes", stats["allocated_bytes.all.peak"], iteration)
            writer.add_scalar("mem-allocated-count", stats["allocation.all.current"], iteration)

    if not is_log_iteration:
        return None
    elapsed_per_iteration = elapsed_since_last_log / max(iterations_since_last_log, 1)
    flops = num_floating_point_operations(args, batch_size)
    throughput = flops / (elapsed_per_iteration * 1e12 * args.world_size)
    if writer is not None and args.log_timers_to_tensorboard:
        writer.add_scalar("iteration-time", elapsed_per_iteration, iteration)
        if args.log_throughput:
            writer.add_scalar("throughput", throughput, iteration)
        timers.write(_LOGGED_TIMERS, writer, iteration, normalizer=max(iterations_since_last_log, 1))

    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    line += f" consumed samples: {args.consumed_train_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_per_iteration * 1000.0:.1f} |"
    if args.log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    if learning_rate is not None:
        line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {batch_size:5d} |"
    averages = {}
    for key, total in acc.losses.items():
        averages[key] = float(total) / max(acc.advanced, 1)
        if averages[key] >= 0:
            line += f" {key}: {averages[key]:.6E} |"
    line += f" loss scale: {float(loss_scale):.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros_in_grad is not None:
        line += f" num zeros: {num_zeros_in_grad} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {acc.skipped:3d} |"
    line += f" number of nan iterations: {acc.nan:3d} |"
    print_rank_last(line)
    telemetry.record_step_metrics(
        elapsed_ms=elapsed_per_iteration * 1000.0, loss=averages.get("lm loss"), throughput_tflops=throughput,
        tokens_per_sec=batch_size * args.seq_length / max(elapsed_per_iteration, 1e-12), grad_norm=grad_norm,
        skipped=acc.skipped, learning_rate=learning_rate,
    )
    acc.reset()
    timers.log([name for name in _LOGGED_TIMERS], normalizer=max(iterations_since_last_log, 1))
    return averages
