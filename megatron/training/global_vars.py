"""Process-wide singletons of a training run: args, tokenizer, timers, TensorBoard and W&B writers, telemetry."""
import logging
import netrc
import os
from urllib.parse import urlparse

from megatron.core.console import write_line

_GLOBAL_ARGS = None
_GLOBAL_CONFIG = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None
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
    """Install ``args`` as the global arguments (tests and tools use this directly).

    Forgets the cached configuration: the next ``get_config()`` builds it from these args.
    """
    global _GLOBAL_ARGS, _GLOBAL_CONFIG
    _GLOBAL_ARGS = args
    _GLOBAL_CONFIG = None


def get_config():
    """The run's ``PretrainConfigContainer``, built once from ``get_args()`` on first use and cached.

    Call it after ``validate_args`` and after the tokenizer is built (``set_global_variables`` builds it
    then), so that derived values such as ``tokenizer.padded_vocab_size`` are in. ``set_args`` and
    ``destroy_global_variables`` forget it. Raises RuntimeError before ``set_args()``.
    """
    global _GLOBAL_CONFIG
    if _GLOBAL_CONFIG is None:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        _GLOBAL_CONFIG = pretrain_cfg_container_from_args(get_args())
    return _GLOBAL_CONFIG


def set_config(config):
    """Install ``config`` (a ``PretrainConfigContainer``) as the run's configuration, or ``None`` to forget it."""
    global _GLOBAL_CONFIG
    _GLOBAL_CONFIG = config


def get_tokenizer():
    """The tokenizer built from the tokenizer flags. Raises RuntimeError if none was built."""
    return _ensure_initialized(_GLOBAL_TOKENIZER, "tokenizer")


def get_tensorboard_writer():
    """The TensorBoard SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The Weights & Biases run on the last rank when --wandb-project is set, else None.

    As in Megatron-LM, scalars are logged with ``get_wandb_writer().log({name: value}, iteration)``.
    """
    return _GLOBAL_WANDB_WRITER


def get_timers():
    """The run's Timers object. Raises RuntimeError before set_global_variables()."""
    return _ensure_initialized(_GLOBAL_TIMERS, "timers")


def get_telemetry():
    """The TelemetryHandle of this process, or None when telemetry is off or unavailable."""
    return _GLOBAL_TELEMETRY


def set_global_variables(args, build_tokenizer=True):
    """Install args, check the telemetry settings, and build the microbatch calculator, tokenizer,
    TensorBoard and W&B writers, and timers.

    Runs before the process group exists: bad MEGATRON_OTEL_* values fail here on every rank.
    Telemetry itself is set up by ``set_telemetry`` once the process group exists, because its run
    id and launch uuid are agreed over it (one broadcast from rank 0): launcher state such as
    MASTER_ADDR/MASTER_PORT is the same for two launches on one host, so it cannot name a launch.
    """
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.timers import Timers

    set_args(args)
    from megatron.core.telemetry.args_integration import load_config_from_args

    load_config_from_args(args)  # ValueError naming the variable, on every rank, before anything is built
    init_num_microbatches_calculator(
        args.rank, getattr(args, "rampup_batch_size", None), args.global_batch_size,
        args.micro_batch_size, args.data_parallel_size,
        getattr(args, "decrease_batch_size_if_needed", False),
    )
    if build_tokenizer:
        _build_tokenizer(args)
    # Built once here, after validation and the tokenizer (which fixes padded_vocab_size).
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    set_config(pretrain_cfg_container_from_args(args))
    _set_tensorboard_writer(args)
    _set_wandb_writer(args)
    global _GLOBAL_TIMERS
    _GLOBAL_TIMERS = Timers(args.timing_log_level, args.timing_log_option)


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


def _wandb_api_key_configured() -> bool:
    """Whether W&B could authenticate: WANDB_API_KEY, or a ~/.netrc entry for its host (wandb login)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return host is not None and netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_config_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_wandb_config_value(v) for v in value]
    return str(value)  # dtypes, signals, functions


def _set_wandb_writer(args):
    """Start a Weights & Biases run on the last rank when --wandb-project is set (as Megatron-LM does).

    Files go to --wandb-save-dir, else <--save>/wandb. Without an API key and without WANDB_MODE the
    run is offline (no network; upload later with ``wandb sync``). validate_args has already checked
    that the package imports and that the run has a name and a directory.
    """
    global _GLOBAL_WANDB_WRITER
    if not getattr(args, "wandb_project", "") or args.rank != args.world_size - 1:
        return None
    import wandb

    save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    mode = None
    if not os.environ.get("WANDB_MODE") and not _wandb_api_key_configured():
        mode = "offline"
        write_line(f"W&B: no API key configured (WANDB_API_KEY or `wandb login`): logging offline to {save_dir}; "
                   "upload later with `wandb sync`")
    config = {name: _wandb_config_value(value) for name, value in sorted(vars(args).items())}
    _GLOBAL_WANDB_WRITER = wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                                      config=config, mode=mode)
    return _GLOBAL_WANDB_WRITER


def set_telemetry(args):
    """Configure OpenTelemetry from MEGATRON_OTEL_* / NEMO_LENS_* variables and the --otel-* flags.

    The one place where environment and command line meet (spec section 1). Call it on every rank
    after ``torch.distributed.init_process_group`` (``initialize_megatron`` does): the run id and
    launch uuid are agreed over the process group. Bad values raise ValueError on every rank before
    the model is built. Returns the handle, or None when OpenTelemetry is not installed (training
    then runs unchanged).
    """
    global _GLOBAL_TELEMETRY
    from megatron.core.telemetry import setup_telemetry_from_args

    _GLOBAL_TELEMETRY = setup_telemetry_from_args(
        args, rank=args.rank, world_size=args.world_size, local_rank=getattr(args, "local_rank", 0)
    )
    return _GLOBAL_TELEMETRY


def destroy_global_variables():
    """Close the writers, shut telemetry down and forget every singleton (tests, repeated runs)."""
    global _GLOBAL_ARGS, _GLOBAL_TOKENIZER, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER, _GLOBAL_TIMERS
    global _GLOBAL_TELEMETRY, _GLOBAL_CONFIG
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
    if _GLOBAL_WANDB_WRITER is not None:
        _GLOBAL_WANDB_WRITER.finish()
    if _GLOBAL_TELEMETRY is not None:
        _GLOBAL_TELEMETRY.shutdown()
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = None
    _GLOBAL_TIMERS = _GLOBAL_TELEMETRY = _GLOBAL_CONFIG = None
