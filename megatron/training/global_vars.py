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


def set_global_variables(args, build_tokenizer=True, config=None):
    """Install args and the configuration built from them once (``get_config()``), and build the
    microbatch calculator, tokenizer, TensorBoard and W&B writers, and timers.

    Runs before the process group exists: bad MEGATRON_OTEL_* values fail here on every rank (the
    configuration's telemetry slice is validated first). Telemetry itself is set up by
    ``set_telemetry`` once the process group exists, because its run id and launch uuid are agreed
    over it (one broadcast from rank 0): launcher state such as MASTER_ADDR/MASTER_PORT is the same for
    two launches on one host, so it cannot name a launch. ``config``: the PretrainConfigContainer
    already built from these args (``initialize_megatron`` builds it first, for the logging level).
    """
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.timers import Timers
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    set_args(args)
    cfg = pretrain_cfg_container_from_args(args) if config is None else config  # ValueError naming a variable
    set_config(cfg)
    init_num_microbatches_calculator(
        cfg.dist.rank, cfg.train.rampup_batch_size, cfg.train.global_batch_size,
        cfg.train.micro_batch_size, cfg.dist.data_parallel_size, cfg.train.decrease_batch_size_if_needed,
    )
    if build_tokenizer:
        _build_tokenizer(cfg, args)
    # The writers record every argument (vars(args)), as Megatron-LM's do, so TensorBoard and W&B keep
    # the names users search for; padded_vocab_size is among them once the tokenizer is built.
    _set_tensorboard_writer(cfg.logger, cfg.dist, vars(args))
    _set_wandb_writer(cfg.logger, cfg.dist, cfg.checkpoint.save, vars(args))
    global _GLOBAL_TIMERS
    _GLOBAL_TIMERS = Timers(cfg.logger.timing_log_level, cfg.logger.timing_log_option)


def _build_tokenizer(cfg, args):
    """The tokenizer of ``cfg.tokenizer``; fills the padded vocabulary in when it was not given.

    The padded size is known only now, so it is the one value written back after the configuration
    is built: into ``cfg.tokenizer`` and into ``args`` (checkpoints store the args, as Megatron's do).
    """
    global _GLOBAL_TOKENIZER
    from megatron.training.tokenizer import build_tokenizer_from_config, vocab_size_with_padding

    log = cfg.dist.rank == 0
    _GLOBAL_TOKENIZER = build_tokenizer_from_config(cfg.tokenizer, log=log)
    if cfg.tokenizer.padded_vocab_size is None:
        cfg.tokenizer.padded_vocab_size = vocab_size_with_padding(
            _GLOBAL_TOKENIZER.vocab_size, cfg.tokenizer.make_vocab_size_divisible_by,
            cfg.model.tensor_model_parallel_size, log=log)
        args.padded_vocab_size = cfg.tokenizer.padded_vocab_size
    return _GLOBAL_TOKENIZER


def _set_tensorboard_writer(logger, dist, settings):
    """Megatron writes TensorBoard events from the last rank only (``logger``: LoggerConfig, ``dist``:
    DistributedInitConfig); ``settings`` (name -> value, the run's arguments) are written as text."""
    global _GLOBAL_TENSORBOARD_WRITER
    if logger.tensorboard_dir and dist.rank == dist.world_size - 1:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(logger.tensorboard_dir, exist_ok=True)
        _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(
            log_dir=logger.tensorboard_dir, max_queue=logger.tensorboard_queue_size
        )
        for name, value in sorted(settings.items()):
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


def _set_wandb_writer(logger, dist, save, settings):
    """Start a Weights & Biases run on the last rank when --wandb-project is set (as Megatron-LM does).

    ``logger``: LoggerConfig, ``dist``: DistributedInitConfig, ``save``: the checkpoint directory,
    ``settings``: the run's arguments (name -> value), sent as the run's config. Files go to
    --wandb-save-dir, else <--save>/wandb. Without an API key and without WANDB_MODE the run is offline
    (no network; upload later with ``wandb sync``). validate_args has already checked that the package
    imports and that the run has a name and a directory.
    """
    global _GLOBAL_WANDB_WRITER
    if not logger.wandb_project or dist.rank != dist.world_size - 1:
        return None
    import wandb

    save_dir = logger.wandb_save_dir or os.path.join(save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    mode = None
    if not os.environ.get("WANDB_MODE") and not _wandb_api_key_configured():
        mode = "offline"
        write_line(f"W&B: no API key configured (WANDB_API_KEY or `wandb login`): logging offline to {save_dir}; "
                   "upload later with `wandb sync`")
    config = {name: _wandb_config_value(value) for name, value in sorted(settings.items())}
    _GLOBAL_WANDB_WRITER = wandb.init(dir=save_dir, name=logger.wandb_exp_name, project=logger.wandb_project,
                                      config=config, mode=mode)
    return _GLOBAL_WANDB_WRITER


def set_telemetry(args):
    """Configure OpenTelemetry from MEGATRON_OTEL_* / NEMO_LENS_* variables and the --otel-* flags.

    The one place where environment and command line meet (spec section 1): the configuration's
    telemetry slice (``get_config().telemetry``). Call it on every rank after
    ``torch.distributed.init_process_group`` (``initialize_megatron`` does): the run id and launch uuid
    are agreed over the process group. Bad values raise ValueError on every rank before the model is
    built. Returns the handle, or None when OpenTelemetry is not installed (training then runs unchanged).
    """
    global _GLOBAL_TELEMETRY
    from megatron.training.argument_utils import setup_telemetry_from_args

    cfg = get_config()
    _GLOBAL_TELEMETRY = setup_telemetry_from_args(
        args, rank=cfg.dist.rank, world_size=cfg.dist.world_size, local_rank=cfg.dist.local_rank,
        config=cfg.telemetry,
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
        from megatron.core.telemetry.handle import AT_EXIT_TIMEOUT_MS

        _GLOBAL_TELEMETRY.shutdown(timeout_ms=AT_EXIT_TIMEOUT_MS)
    _GLOBAL_ARGS = _GLOBAL_TOKENIZER = _GLOBAL_TENSORBOARD_WRITER = _GLOBAL_WANDB_WRITER = None
    _GLOBAL_TIMERS = _GLOBAL_TELEMETRY = _GLOBAL_CONFIG = None
