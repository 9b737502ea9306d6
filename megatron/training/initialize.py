"""Start a run: parse flags, apply the logging level, set the globals, join the process group, build groups, seed."""
import argparse
import logging
import os
import random
import re
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.console import write_line
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, set_model_init_seed
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.argument_groups import logging_level
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import get_args, set_global_variables, set_telemetry
from megatron.training.training_log import CONSOLE_PRINTED
from megatron.training.user_errors import UserInputError
from megatron.training.utils import print_rank_0

_CONSOLE_HANDLER = None


class _ConsoleHandler(logging.StreamHandler):
    """Prints log records on the current ``sys.stderr`` (looked up per record, so redirections
    apply), message only, as Python's last-resort handler does; skips records whose text the
    framework has already printed (``CONSOLE_PRINTED``), so nothing appears twice."""

    def __init__(self, level):
        super().__init__()
        self.setLevel(level)
        self.addFilter(lambda record: not getattr(record, CONSOLE_PRINTED, False))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass

    def emit(self, record):
        """The record's text and its newline in one write call (:func:`write_line`), so a line stays
        whole when the ranks share one stderr."""
        try:
            write_line(self.format(record), file=self.stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def setup_logging(logger_config, dist_config) -> int:
    """Apply ``--logging-level`` (else env MEGATRON_LOGGING_LEVEL) as Megatron-LM does, and give
    framework records somewhere to go.

    With a level: the root and ``megatron`` loggers get it and records at or above it are printed
    on stderr. Without one: the ``megatron`` loggers default to INFO (so the OpenTelemetry log
    bridge receives the operator messages: iteration summary, checkpoints, evaluation) and only
    WARNING and above are printed, as before. The console handler is added to the root logger only
    when no handler other than the log bridge is there (a user's own logging setup is left alone);
    it never prints a message the framework has already printed. Returns the effective level of the
    ``megatron`` logger. Raises ValueError naming MEGATRON_LOGGING_LEVEL when it is not a level.

    ``logger_config``: the LoggerConfig (``logging_level``); ``dist_config``: the DistributedInitConfig
    (only rank 0 prints the level).
    """
    global _CONSOLE_HANDLER
    from megatron.core.telemetry.logging_bridge import OtelLogHandler

    level = logger_config.logging_level
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL", "").strip():
        try:
            level = logging_level(os.environ["MEGATRON_LOGGING_LEVEL"])
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"MEGATRON_LOGGING_LEVEL: {exc}") from None
    root, framework = logging.getLogger(), logging.getLogger("megatron")
    if level is not None:
        root.setLevel(level)
        framework.setLevel(level)
        if dist_config.rank == 0:
            write_line(f"> setting logging level to {logging.getLevelName(level)} ({level})")
    elif framework.level == logging.NOTSET:
        framework.setLevel(logging.INFO)
    console_level = level if level is not None else logging.WARNING
    if _CONSOLE_HANDLER is not None:
        root.removeHandler(_CONSOLE_HANDLER)
        _CONSOLE_HANDLER = None
    if all(isinstance(handler, OtelLogHandler) for handler in root.handlers):
        _CONSOLE_HANDLER = _ConsoleHandler(console_level)
        root.addHandler(_CONSOLE_HANDLER)
    return framework.getEffectiveLevel()


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM node list, e.g. ``"gpu[003-005,009],cpu1"`` -> ``"gpu003"``.

    Raises ValueError for an empty list.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("SLURM_NODELIST is empty: cannot pick the rendezvous host")
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _set_rendezvous_env_from_slurm():
    """torchrun sets MASTER_ADDR/PORT; under plain srun derive them from SLURM's variables."""
    if "SLURM_NODELIST" in os.environ and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = first_slurm_host(os.environ["SLURM_NODELIST"])
    if "SLURM_JOB_ID" in os.environ and "MASTER_PORT" not in os.environ:
        # A job-specific port, so two jobs sharing a node do not collide.
        os.environ["MASTER_PORT"] = str(10000 + int(os.environ["SLURM_JOB_ID"]) % 50000)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "6000")


def _set_cuda_device_max_connections(tensor_model_parallel_size: int) -> None:
    """Set env CUDA_DEVICE_MAX_CONNECTIONS=1 when TP > 1 unless the user set it.

    The TP linear layers' backward overlaps its collectives with the GEMMs, which only works when
    the GPU runs kernels in launch order: one hardware queue. CUDA reads the variable when the
    context is created, so this runs before the first CUDA call.
    """
    if tensor_model_parallel_size > 1 and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def _set_deterministic_mode(deterministic_mode: bool, distributed_backend: str) -> None:
    """--deterministic-mode (Megatron-LM's): ``torch.use_deterministic_algorithms(True)``, and with CUDA the
    environment that makes cuBLAS (CUBLAS_WORKSPACE_CONFIG=:4096:8) and NCCL all-reduce (NCCL_ALGO=Ring,
    under the nccl backend) reproducible, where the user has not set them. Runs before the process group
    and the first CUDA kernel: both variables are read when the library starts."""
    if not deterministic_mode:
        return
    if torch.cuda.is_available():
        # cuBLAS picks reduction splits by workspace size; a fixed workspace gives one order.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if distributed_backend == "nccl":
            os.environ.setdefault("NCCL_ALGO", "Ring")  # Megatron-LM requires one of its listed algorithms
    torch.use_deterministic_algorithms(True)


def _initialize_distributed(model, dist_config):
    """Join the default process group (NCCL on GPU, gloo on CPU) and build the model-parallel groups.

    ``model``: the TransformerConfig (the parallel sizes); ``dist_config``: the DistributedInitConfig.
    """
    _set_cuda_device_max_connections(model.tensor_model_parallel_size)
    backend, local_rank = dist_config.distributed_backend, dist_config.local_rank
    if torch.cuda.is_available() and backend == "nccl":
        device_count = torch.cuda.device_count()
        if local_rank >= device_count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this node has {device_count} (check --nproc_per_node)"
            )
        torch.cuda.set_device(local_rank)
    elif backend == "nccl":
        raise RuntimeError("--distributed-backend nccl needs CUDA GPUs; use --distributed-backend gloo on CPU")

    if not dist.is_initialized():
        _set_rendezvous_env_from_slurm()
        init_options = dict(
            backend=backend,
            world_size=dist_config.world_size,
            rank=dist_config.rank,
            timeout=timedelta(minutes=dist_config.distributed_timeout_minutes),
        )
        if torch.cuda.is_available() and backend == "nccl":
            init_options["device_id"] = torch.device(f"cuda:{local_rank}")
        dist.init_process_group(**init_options)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=model.tensor_model_parallel_size,
            pipeline_model_parallel_size=model.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=model.virtual_pipeline_model_parallel_size,
            context_parallel_size=model.context_parallel_size,
            expert_model_parallel_size=model.expert_model_parallel_size,
            expert_tensor_parallel_size=model.expert_tensor_parallel_size,
            distributed_timeout_minutes=dist_config.distributed_timeout_minutes,
        )
        print_rank_0(
            f"> initialized tensor model parallel with size {parallel_state.get_tensor_model_parallel_world_size()}\n"
            f"> initialized pipeline model parallel with size {parallel_state.get_pipeline_model_parallel_world_size()}"
        )


def _set_random_seed(seed: int, data_parallel_random_init: bool = False):
    """Seed python, numpy, torch and the model-parallel RNG tracker.

    Each pipeline stage gets ``seed + 100 * pp_rank`` so stages do not draw identical dropout
    masks; data-parallel ranks share the seed unless ``data_parallel_random_init``. Weights are
    drawn from ``seed`` without the stage offset (``set_model_init_seed``), per layer, so every
    pipeline layout starts from the same weights.
    Raises ValueError for a non-positive seed.
    """
    if seed is None or seed <= 0:
        raise ValueError(f"--seed must be a positive integer, got {seed}")
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    # Weights come from (seed, layer number) whatever the pipeline layout (model_init_rng).
    set_model_init_seed(seed)
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def initialize_megatron(extra_args_provider=None, args_defaults=None, ignore_unknown_args=False,
                        parsed_args=None, argv=None):
    """Everything a run needs before the model is built. Returns the validated args.

    Raises:
        UserInputError: a bad flag (exit status 2), a missing tokenizer file or a bad telemetry variable.

    Order: parse + validate flags (fails fast with the flag named), build the configuration once
    (telemetry settings checked), apply the logging level, set globals (microbatch calculator,
    tokenizer, timers, TensorBoard, W&B), join the process group, build the parallel groups, set
    telemetry up, seed. ``--deterministic-mode`` is applied before the process group is joined.
    """
    args = parsed_args if parsed_args is not None else parse_args(extra_args_provider, ignore_unknown_args, argv)
    try:
        validate_args(args, args_defaults or {})
    except ValueError as error:  # validate_args raises ValueError only to name a bad flag
        # The flags are the same on every rank, so is this error: rank 0 alone reports it.
        raise UserInputError(str(error), exit_status=2, same_on_every_rank=True) from error
    try:
        cfg = pretrain_cfg_container_from_args(args)
    except ValueError as error:  # a bad MEGATRON_OTEL_* variable: the message names it
        raise UserInputError(str(error)) from error
    setup_logging(cfg.logger, cfg.dist)
    try:
        set_global_variables(args, config=cfg)
    except (FileNotFoundError, ValueError) as error:
        # A missing --vocab-file/--tokenizer-model: the messages name them.
        raise UserInputError(str(error)) from error
    _set_deterministic_mode(cfg.model.deterministic_mode, cfg.dist.distributed_backend)
    _initialize_distributed(cfg.model, cfg.dist)
    set_telemetry(args)  # after the process group: its run id and launch uuid are agreed over it
    _set_random_seed(cfg.rng.seed, cfg.rng.data_parallel_random_init)
    if torch.cuda.is_available() and cfg.model.bf16:
        torch.backends.cuda.matmul.allow_tf32 = True
    return get_args()
