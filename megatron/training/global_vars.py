"""Process-wide singletons of a training run: args, tokenizer, timers, TensorBoard writer, telemetry."""
import logging
import os

_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_TIMERS = None
_GLOBAL_TELEMETRY = None

logger = logging.getLogger(__name__)


def _ensure_initialized(value, name):
    if value is None:
        raise RuntimeError(f"{name} is not initialized; call set_global_variables() (or set_{name}()) first")
    return value


def get_args():
    """The parsed command-line arguments (argparse.Namespace). Raises RuntimeError before set_args()."""
    return _ensure_initialized(_GLOBAL_ARGS, "args")


def set_args(args):
    """Install ``args`` as the global arguments (tests and tools use this directly)."""
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_tokenizer():
    """The tokenizer built from the tokenizer flags. Raises RuntimeError if none was built."""
    return _ensure_initialized(_GLOBAL_TOKENIZER, "tokenizer")


def get_tensorboard_writer():
    """The TensorBoard SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_timers():
    """The run's Timers object. Raises RuntimeError before set_global_variables()."""
    return _ensure_initialized(_GLOBAL_TIMERS, "timers")


def get_telemetry():
    """The TelemetryHandle of this process, or None when telemetry is off or unavailable."""
    return _GLOBAL_TELEMETRY


def set_global_variables(args, build_tokenizer=True):
    """Install args and build the microbatch calculator, tokenizer, TensorBoard writer, timers, telemetry.

    Runs before the process group exists: bad MEGATRON_OTEL_* values fail here on every rank,
    and the telemetry run id comes from launcher state all ranks share (no communication).
    """
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.timers import Timers

    set_args(args)
    init_num_microbatches_calculator(
        args.rank, getattr(args, "rampup_batch_size", None), args.global_batch_size,
        args.micro_batch_size, args.data_parallel_size,
        getattr(args, "decrease_batch_size_if_needed", False),
    )
    if build_tokenizer:
        _build_tokenizer(args)
    _set_tensorboard_writer(args)
    global _GLOBAL_TIMERS
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)
    _set_telemetry(args)


def _build_tokenizer(args):
    global _GLOBAL_TOKENIZER
    from megatron.training.tokenizer import build_tokenizer

    _GLOBAL_TOKENIZER = build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def _set_tensorboard_writer(args):
    """Megatron writes TensorBoard events from the last rank only."""
    global _GLOBAL_TENSORBOARD_WRITER
    if getattr(args, "tensorboard_dir", None) and args.rank == args.world_size - 1:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(args.tensorboard_dir, exist_ok=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(
            log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size
        )
        for name, value in sorted(vars(args).items()):
            _GLOBAL_TENSORBOARD_WRITER.add_text(name, str(value))


def _set_telemetry(args):
    """Configure OpenTelemetry from MEGATRON_OTEL_* / NEMO_LENS_* variables and the --otel-* flags.

    The one place where environment and command line meet (spec section 1). Bad values raise
    ValueError on every rank before the model is built. Returns the handle, or None when
    OpenTelemetry is not installed (training then runs unchanged).
    """
    global _GLOBAL_TELEMETRY
    from megatron.core.telemetry import setup_telemetry_from_args

    _GLOBAL_TELEMETRY = setup_telemetry_from_args(
        args, rank=args.rank, world_size=args.world_size, local_rank=getattr(args, "local_rank", 0)
    )
    return _GLOBAL_TELEMETRY


def destroy_global_variables():
    """Close the writer, shut telemetry down and forget every singleton (tests, repeated runs)."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_TIMERS, _GLOBAL_TELEMETRY
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_TELEMETRY is not None:
        _GLOBAL_TELEMETRY.shutdown()
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_TIMERS = _GLOBAL_TELEMETRY = None
