"""Save and load checkpoints atomically: ``torch_dist`` (sharded, reshardable; megatron.core.dist_checkpointing)
and Megatron-LM's legacy ``torch`` format (one file per (tp, pp) rank)."""
import argparse
import enum
import errno
import io
import os
import random
import shutil
import types

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.core.console import write_line
from megatron.core.dist_checkpointing.safe_loading import CheckpointReadError, load_torch_file
from megatron.core.dist_checkpointing.serialization import SaveFailedOnAnotherRankError
from megatron.core.optimizer_param_scheduler import SchedulerMismatchError
from megatron.core.transformer.enums import AttnBackend, ModelType
from megatron.training import checkpoint_integrity, legacy_optimizer_state
from megatron.training.arguments import non_directory_ancestor
from megatron.training.checkpointing.layout import (
    CHECKPOINT_BASENAME,
    CHECKPOINT_VERSION,
    CKPT_FORMATS,
    COMMON_BASENAME,
    DISTRIBUTED_OPTIMIZER_BASENAME,
    RNG_DIRNAME,
    TRACKER_FILENAME,
    common_file_name,
    common_state,
    current_parallel_layout,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    iteration_dirname,
    rank_dirnames,
    read_common_state,
    rng_file_name,
)
from megatron.training.checkpointing.layout import detect_format as detect_checkpoint_format
from megatron.training.checkpoint_errors import CheckpointContentError
from megatron.training.global_vars import get_args
from megatron.training.training_state import TrainingState
from megatron.training.user_errors import UserInputError, one_line
from megatron.training.utils import print_rank_0

_CHECKPOINT_VERSION = None


def set_checkpoint_version(value):
    """Remember the version of the checkpoint being loaded (Megatron's global)."""
    global _CHECKPOINT_VERSION
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    """Version of the last loaded checkpoint, or None before any load."""
    return _CHECKPOINT_VERSION


# ---------------------------------------------------------------------------------------------------
# Names and tracker
# ---------------------------------------------------------------------------------------------------

def non_persistent_checkpoint_dir(args, save_dir=None):
    """Where --non-persistent-save-interval checkpoints go: ``--non-persistent-global-ckpt-dir``, else
    ``<save_dir or --save>/non_persistent`` (Megatron-LM's layout); None when neither is set."""
    explicit = getattr(args, "non_persistent_global_ckpt_dir", None)
    if explicit:
        return explicit
    base = save_dir if save_dir is not None else args.save
    return None if base is None else os.path.join(base, checkpoint_integrity.NON_PERSISTENT_SUBDIR)


def _is_distributed_optimizer(optimizer):
    return optimizer is not None and hasattr(optimizer, "get_parameter_state_dp_zero")


def read_metadata(tracker_filename):
    """Read a tracker file. Returns ``(iteration, release)``.

    When torch.distributed is initialised the maximum iteration over all ranks is returned
    (a rank reading a stale copy on a non-shared file system prints a warning).
    Raises FileNotFoundError if the file is missing and checkpoint_integrity.CheckpointTrackerError
    (a ValueError) naming the file when it holds neither a positive integer nor ``release``.
    """
    iteration, release = checkpoint_integrity.read_tracker(tracker_filename)

    if dist.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long, device=get_collective_device())
        dist.all_reduce(iters, op=dist.ReduceOp.MAX)
        max_iter = int(iters.item())
        if max_iter != iteration:
            write_line(f"WARNING: on rank {dist.get_rank()} found iteration {iteration} in the metadata while max "
                       f"iteration across the ranks is {max_iter}, replacing it with max iteration.")
        iteration = max_iter
    return iteration, release


# ---------------------------------------------------------------------------------------------------
# Collective helpers (no-ops in a single process)
# ---------------------------------------------------------------------------------------------------

def _world_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _any_rank(flag):
    if not dist.is_initialized():
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=get_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _broadcast_int_from_rank_0(value):
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=get_collective_device())
    dist.broadcast(tensor, src=0)
    return int(tensor.item())


# ---------------------------------------------------------------------------------------------------
# State pieces
# ---------------------------------------------------------------------------------------------------

def _unwrap(model):
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    try:
        from megatron.core.utils import unwrap_model

        return unwrap_model(chunks)
    except ImportError:
        # Without megatron.core.utils (or its wrapper classes) strip `.module` chains by hand.
        unwrapped = []
        for chunk in chunks:
            while isinstance(getattr(chunk, "module", None), torch.nn.Module):
                chunk = chunk.module
            unwrapped.append(chunk)
        return unwrapped


def _rng_tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def get_rng_state(data_parallel_random_init=False):
    """RNG states of this rank as Megatron stores them: a list of dicts.

    Each dict holds ``random_rng_state`` (python), ``np_rng_state``, ``torch_rng_state``
    (CPU), ``cuda_rng_state`` and ``rng_tracker_states`` (the tensor-parallel RNG tracker's
    states). The list has one entry, or one per data-parallel rank (gathered over the
    data-parallel group) with ``data_parallel_random_init``.

    Without CUDA the tracker runs on the CPU generator, whose states a CUDA generator refuses,
    and Megatron-LM's loader stops without ``cuda_rng_state``: then ``cuda_rng_state`` and
    ``rng_tracker_states`` are the CUDA states a GPU run seeded the same way starts from
    (offset 0, :func:`megatron.core.tensor_parallel.seeded_cuda_rng_states`) and the CPU tracker
    states are kept under ``cpu_rng_tracker_states``, which a CPU resume restores.
    """
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": _rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    else:
        from megatron.core.tensor_parallel import seeded_cuda_rng_states

        seeded = seeded_cuda_rng_states()
        if seeded is not None:
            state["cpu_rng_tracker_states"] = state["rng_tracker_states"]
            state.update(seeded)
    if (data_parallel_random_init and dist.is_initialized()
            and parallel_state.get_data_parallel_world_size() > 1):
        states = [None] * parallel_state.get_data_parallel_world_size()
        dist.all_gather_object(states, state, group=parallel_state.get_data_parallel_group())
        return states
    return [state]


def _set_rng_state(rng_state, checkpoint_name):
    try:
        _apply_rng_state(rng_state, checkpoint_name)
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:  # not the states torch saves
        raise CheckpointContentError(f"unable to load rng state from checkpoint {checkpoint_name} ({type(exc).__name__}: "
                                     f"{one_line(exc)[:160]}); specify --no-load-rng to skip it") from exc


def _apply_rng_state(rng_state, checkpoint_name):
    random.setstate(_as_python_rng_state(rng_state["random_rng_state"]))
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    tracker_states = rng_state.get("rng_tracker_states")
    if torch.cuda.is_available():
        if "cuda_rng_state" in rng_state:
            torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
        else:
            print_rank_0(f"WARNING: {checkpoint_name} has no CUDA RNG state (saved without CUDA); "
                         "the CUDA generator keeps its current state")
    elif "cpu_rng_tracker_states" in rng_state:  # saved on a CPU: the tracker's own (CPU generator) states
        tracker_states = rng_state["cpu_rng_tracker_states"]
    # States of the other device's generator (a checkpoint of an older CPU run read with CUDA, or of a
    # GPU run read without) would fail at the tracker's first fork: keep the seeded ones instead.
    size = _get_device_rng_size()
    values = list(tracker_states.values()) if isinstance(tracker_states, dict) else []
    if values and all(isinstance(v, torch.Tensor) for v in values) and any(v.numel() != size for v in values):
        print_rank_0(f"WARNING: {checkpoint_name} holds RNG tracker states of another device's generator; "
                     "the tracker keeps its seeded states")
        tracker_states = None
    if tracker_states:
        _rng_tracker().set_states(tracker_states)


def _get_device_rng_size() -> int:
    """Bytes of a state of the generator the RNG tracker uses (CUDA's, else the CPU's)."""
    return (torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()).numel()


def _as_python_rng_state(value):
    # random.setstate insists on tuples; keep it robust if a converter stored lists.
    version, internal, gauss = value
    return version, tuple(internal), gauss


def _sanitize(value):
    """``value`` reduced to types torch.load(weights_only=True) accepts, or _DROP.

    Enums Megatron-LM stores in its args (AttnBackend, ModelType) are kept: both loaders admit them.
    """
    if isinstance(value, enum.Enum):
        return value if type(value) in _ARGS_ENUMS else value.name
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.dtype):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_sanitize(v) for v in value]
        items = [v for v in items if v is not _DROP]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            k, v = _sanitize(k), _sanitize(v)
            if k is not _DROP and v is not _DROP:
                out[k] = v
        return out
    return _DROP


_DROP = object()


# Enums of Megatron-LM's saved args: kept as enums on save, admitted on load.
_ARGS_ENUMS = (AttnBackend, ModelType)


def _sanitized_args(args):
    """A Namespace copy of ``args`` holding only plain values (functions, objects dropped; enums as names,
    but for those of Megatron-LM's args, which keep their types: ``attention_backend`` is saved as
    the AttnBackend member Megatron-LM stores)."""
    clean = argparse.Namespace()
    for name, value in vars(args).items():
        if name == "attention_backend" and isinstance(value, str) and value in AttnBackend.__members__:
            value = AttnBackend[value]
        value = _sanitize(value)
        if value is not _DROP:
            setattr(clean, name, value)
    return clean


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration,
                        num_floating_point_operations_so_far, train_state=None):
    """The dict written per (tp, pp) rank: args, checkpoint_version, iteration, model (``model0..``
    for several chunks), optimizer (unless --no-save-optim), opt_param_scheduler, rng_state
    (unless ``rng_state`` is None), num_floating_point_operations_so_far.

    The sample counters of ``train_state`` are stored as attributes of the saved args, where
    Megatron-LM's legacy checkpoints keep them (``consumed_train_samples`` ...); without a state the
    ones found on ``args`` are used.
    """
    saved_args = _sanitized_args(args)
    state = TrainingState.from_args(args) if train_state is None else train_state
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(saved_args, name, getattr(state, name))
    state_dict = {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    if len(model) == 1:
        state_dict["model"] = model[0].state_dict()
    else:
        for i, chunk in enumerate(model):
            state_dict[f"model{i}"] = chunk.state_dict()
    if not args.no_save_optim:
        if optimizer is not None:
            # Megatron's positional layout (plus torch's per-group 'param_names') so Megatron-LM loads it.
            state_dict["optimizer"] = legacy_optimizer_state.to_megatron_layout(optimizer.state_dict())
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return state_dict


# ---------------------------------------------------------------------------------------------------
# Durable file-system steps
# ---------------------------------------------------------------------------------------------------

def _fsync_dir(path):
    # A rename or a new entry is only durable once the directory holding it is flushed.
    checkpoint_integrity.fsync_dir(path)


class _ErrorRecordingWriter(io.RawIOBase):
    """A file for torch.save that remembers the OSError of a failed write: torch.save reports it only as
    "unexpected pos" (a full disk would otherwise read as an internal error)."""

    def __init__(self, f):
        super().__init__()
        self.f, self.error = f, None

    def writable(self):
        return True

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise


# What a failed write's errno most likely means for a checkpoint save.
_WRITE_FAILURE_HINTS = {errno.ENOSPC: "disk full", errno.EFBIG: "disk full or file-size limit, see ulimit -f",
                        errno.EDQUOT: "disk quota exceeded"}


class CheckpointWriteError(OSError):
    """A checkpoint file or directory that could not be written: the message names it and the cause.

    ``errno`` is the failed call's (ENOSPC, EFBIG, EACCES...), ``path`` the file or directory.
    """

    def __init__(self, message, error_number=None, path=None):
        super().__init__(message)
        self.errno, self.path = error_number, path

    def __str__(self):
        return self.args[0]


def write_failure(cause: OSError, path=None) -> CheckpointWriteError:
    """``cause`` (a failed write, open or mkdir) as a CheckpointWriteError naming the file (``path``, else the
    error's own file name) and the cause: ``could not write PATH: File too large (disk full or file-size
    limit, see ulimit -f)``; a directory that cannot be created under a file names that file."""
    if isinstance(cause, CheckpointWriteError):
        return cause
    path = path or cause.filename
    reason = cause.strerror or str(cause)
    if cause.errno in _WRITE_FAILURE_HINTS:
        reason += f" ({_WRITE_FAILURE_HINTS[cause.errno]})"
    if cause.errno in (errno.ENOTDIR, errno.EEXIST) and path is not None:
        blocker = non_directory_ancestor(path)
        if blocker is not None:
            return CheckpointWriteError(f"could not create directory {path}: {blocker} is a file, not a directory",
                                        cause.errno, path)
    message = f"could not write {path}: {reason}" if path is not None else f"could not write: {reason}"
    return CheckpointWriteError(message, cause.errno, path)


def _write_durably(state_dict, path):
    """torch.save ``state_dict`` to ``path`` and fsync it; an OSError (e.g. ENOSPC) is raised as a
    CheckpointWriteError naming ``path``."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "wb")
    except OSError as exc:
        raise write_failure(exc) from exc
    writer = _ErrorRecordingWriter(f)
    try:
        torch.save(state_dict, writer)
        f.flush()
        os.fsync(f.fileno())
        f.close()
    except Exception as exc:
        try:
            f.close()
        except OSError:
            pass
        cause = exc if isinstance(exc, OSError) else writer.error
        if cause is None:
            raise
        raise write_failure(cause, path) from exc
    _fsync_dir(os.path.dirname(path))


# ---------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------

_rng_file_name = rng_file_name  # the names async_checkpointing imports


def _ckpt_format(args):
    ckpt_format = getattr(args, "ckpt_format", "torch")
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format} is not available in this version; use torch_dist or torch")
    return ckpt_format


def _prepare_save_directory(save_dir, dirname, iteration):
    """Create the hidden temporary directory all ranks write into; all ranks call it (a collective).

    Returns ``(tmp_dir, final_dir)``. Rank 0 removes leftovers of an earlier save of the same
    iteration that died before its rename.
    """
    final_dir = os.path.join(save_dir, dirname)
    # All writers must agree on one temporary directory: use rank 0's pid.
    owner_pid = _broadcast_int_from_rank_0(os.getpid())
    tmp_dir = os.path.join(save_dir, f".{dirname}.tmp-{owner_pid}")
    error = None
    if _world_rank() == 0:
        try:
            checkpoint_integrity.prepare_save_dir(save_dir)  # also repairs what a crashed save left
            os.makedirs(tmp_dir)
        except Exception as exc:  # reported to every rank below instead of leaving them in a barrier
            error = exc
    if _any_rank(error is not None):
        _raise_save_failure(error, iteration, final_dir, _failure_reports(error))
    return tmp_dir, final_dir


def _publish_checkpoint(save_dir, iteration, tmp_dir, final_dir, write_error=None, non_persistent=False,
                        known_digests=None):
    """The last step of every save, in both formats, synchronous or asynchronous; all ranks call it.

    Every rank reports whether its writes (``write_error``) succeeded; only when all did,
    checkpoint_integrity.publish_iteration writes the ``integrity_manifest.json`` (size and CRC-32
    per file), moves ``tmp_dir`` to ``final_dir`` (an existing one is swapped atomically) and only then
    atomically replaces the tracker, so it never names an incomplete directory; then
    --save-retain-interval prunes older iterations (``non_persistent``: only the newest is kept). On
    any failure the temporary directory is removed, the previous checkpoint and tracker stay as they
    were, and every rank raises. ``known_digests``: this rank's CRC-32s computed by an ``--async-save``
    background writer (checkpoint_integrity.write_manifest digests only the other files).
    """
    rank = _world_rank()
    if _any_rank(write_error is not None):
        failures = _failure_reports(write_error)
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(write_error, iteration, final_dir, failures)
    try:
        # Manifest, then the directory, and the tracker last: it never names an incomplete directory.
        checkpoint_integrity.publish_iteration(
            save_dir, tmp_dir, iteration, keep_only_newest=non_persistent, known_digests=known_digests,
            retain_interval=None if non_persistent else getattr(get_args(), "save_retain_interval", None))
    except Exception as exc:  # raised on every rank
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(exc, iteration, final_dir)
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} {}".format(
        iteration, save_dir, _rank_summary()))


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, train_state=None, non_persistent_ckpt=False):
    """Write a checkpoint of ``iteration`` under ``--save`` in the ``--ckpt-format``; all ranks call it.

    ``torch`` (Megatron's legacy layout, spec §8.8): ``<save>/iter_{iteration:07d}/mp_rank_XX[_YYY]/
    model_optim_rng.pt``, one file per (tp, pp) rank written by data-parallel rank 0. With the
    distributed optimizer its sharded state is gathered to data-parallel rank 0 and written beside
    it as ``distrib_optim.pt`` (see DistributedOptimizer.get_parameter_state_dp_zero);
    ``model_optim_rng.pt`` then holds only its param groups and scaler. Reloads at the same TP/PP only.

    ``torch_dist``: ``<save>/iter_{iteration:07d}/`` holds Megatron-LM core_v0.14's layout
    (docs/megatron-checkpoints.md): torch.distributed.checkpoint files (``.metadata``,
    ``__<rank>_0.distcp``) with every model and optimizer tensor under Megatron's key (layer
    tensors stacked over the layers) with its global shape (megatron.core.dist_checkpointing), each
    rank writing its own chunks, and ``metadata.json``; ``common.pt`` (rank 0: args, training state,
    scheduler, optimizer hyper-parameters and step, grad scaler, the parallel layout) and
    ``rng/rank_XXXXX.pt`` (each rank's RNG states). Reloads at any TP/PP/DP layout, with or without
    the distributed optimizer; Megatron-LM loads it too, and this loads Megatron-LM's.
    With ``--async-save`` the call returns once the state is staged in host memory; the files are
    written in the background and published by :func:`finalize_async_save`.

    Atomic in both formats: files go to a hidden ``.iter_{iteration:07d}.tmp-<pid>`` directory in the
    same parent, are fsynced, and :func:`_publish_checkpoint` writes the integrity manifest, renames it
    and then replaces the tracker once every rank has finished. A failure on any rank leaves the
    previous checkpoint and tracker untouched and raises on every rank. ``non_persistent_ckpt``
    (``--non-persistent-save-interval``): the same under ``--non-persistent-global-ckpt-dir`` (default
    ``<save>/non_persistent``), keeping only the newest.

    Args:
        iteration: training iteration (int) the state belongs to.
        model: list of model chunks (wrapped or not).
        optimizer: object with ``state_dict()`` or None.
        opt_param_scheduler: object with ``state_dict()`` or None.
        num_floating_point_operations_so_far: FLOPs done so far (int), stored for throughput logs.
        checkpointing_context: accepted for Megatron's signature; unused.
        train_state: the training loop's :class:`TrainingState` (its counters are saved); None
            (Megatron's signature) takes them from ``args``.
        non_persistent_ckpt: write a non-persistent checkpoint (see above).
    Raises ValueError without ``--save`` or with an unavailable ``--ckpt-format``; RuntimeError
    (or the original error on the failing rank) when writing fails.
    """
    args = get_args()
    save_dir = args.save
    if save_dir is None:
        raise ValueError("save_checkpoint needs --save")
    if non_persistent_ckpt:
        save_dir = non_persistent_checkpoint_dir(args, save_dir)
    ckpt_format = _ckpt_format(args)
    # The previous asynchronous save is published before this one starts.
    finalize_async_save(blocking=True)
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        sync = getattr(chunk, "sync_params_for_read", None)
        if sync is not None:  # --overlap-param-gather leaves the updated shards ungathered until the next forward
            sync()
    model = _unwrap(model)
    state = TrainingState.from_args(args) if train_state is None else TrainingState(**train_state.state_dict())
    state.iteration = iteration
    state.num_floating_point_operations_so_far = num_floating_point_operations_so_far
    print_rank_0("saving checkpoint at iteration {:7d} to {} in {} format".format(iteration, save_dir, ckpt_format))

    # Every rank takes part: with --data-parallel-random-init this is a collective.
    rng_state = None if args.no_save_rng else get_rng_state(
        getattr(args, "data_parallel_random_init", False) and ckpt_format == "torch")

    tmp_dir, final_dir = _prepare_save_directory(save_dir, iteration_dirname(iteration, release=False), iteration)
    error = None
    try:
        if ckpt_format == "torch":
            _write_torch_format(args, tmp_dir, final_dir, model, optimizer, opt_param_scheduler, rng_state, state)
        else:
            from megatron.training import async_checkpointing

            writer = async_checkpointing.start_torch_dist_save(
                args, tmp_dir, model, optimizer, _torch_dist_common_state(args, optimizer, opt_param_scheduler, state),
                rng_state, asynchronous=bool(getattr(args, "async_save", False)))
            if writer is not None:  # --async-save: published later by finalize_async_save
                _PENDING.append((writer, save_dir, iteration, tmp_dir, final_dir, non_persistent_ckpt))
                return
        checkpoint_integrity.test_hook("in_write", iteration)
    except Exception as exc:
        error = exc
    _publish_checkpoint(save_dir, iteration, tmp_dir, final_dir, error, non_persistent_ckpt)


# Asynchronous saves started but not yet published: (writer, save_dir, iteration, tmp_dir, final_dir, non-persistent).
_PENDING = []


def finalize_async_save(blocking=True):
    """Publish the pending ``--async-save`` checkpoint once every rank's background write finished.

    All ranks call it at the same points (the training loop: every iteration while a save is
    pending with ``blocking=False``, before the next save and before exit with ``blocking=True``).
    Non-blocking: publishes only when every rank is done (one all-reduce), else returns False.
    Returns True when nothing is pending any more. Raises like :func:`save_checkpoint` when a
    background write failed on any rank.
    """
    if not _PENDING:
        return True
    writer, save_dir, iteration, tmp_dir, final_dir, non_persistent = _PENDING[0]
    if not blocking and not _all_ranks(writer.done()):
        return False
    _PENDING.pop(0)
    error = writer.wait()
    writer.publish_span(lambda: _publish_checkpoint(save_dir, iteration, tmp_dir, final_dir, error, non_persistent,
                                                    writer.digests))
    return True


def async_save_pending():
    """Whether an ``--async-save`` checkpoint was started and not yet published."""
    return bool(_PENDING)


def wait_for_async_staging():
    """Block until the pending async save has its own copy of the state (before the parameters change)."""
    for writer, *_ in _PENDING:
        writer.wait_staged()


def _all_ranks(flag):
    return not _any_rank(not flag)


def _write_torch_format(args, tmp_dir, final_dir, model, optimizer, opt_param_scheduler, rng_state, state):
    # The distributed optimizer's shards are gathered to data-parallel rank 0 (a collective).
    param_state = None
    if _is_distributed_optimizer(optimizer) and not args.no_save_optim:
        param_state = optimizer.get_parameter_state_dp_zero()
    if parallel_state.get_data_parallel_rank() == 0:
        final_name = get_checkpoint_name(os.path.dirname(final_dir), state.iteration)
        tmp_name = os.path.join(tmp_dir, os.path.relpath(final_name, final_dir))
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, state.iteration,
                                         state.num_floating_point_operations_so_far, state)
        _write_durably(state_dict, tmp_name)
        if param_state is not None:
            _write_durably(param_state, get_distributed_optimizer_checkpoint_name(tmp_name))


def _torch_dist_common_state(args, optimizer, opt_param_scheduler, state):
    """``common.pt`` of a torch_dist checkpoint (written by rank 0; the same on every rank)."""
    from megatron.core.dist_checkpointing.model_and_optimizer import optimizer_common_state

    saved_args = _sanitized_args(args)
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(saved_args, name, getattr(state, name))  # where Megatron-LM readers look for them
    save_optim = not args.no_save_optim
    return common_state(
        saved_args, state.iteration, state.state_dict(), state.num_floating_point_operations_so_far,
        current_parallel_layout(), bool(getattr(args, "use_distributed_optimizer", False)),
        optimizer_common_state(optimizer) if save_optim and optimizer is not None else None,
        opt_param_scheduler.state_dict() if save_optim and opt_param_scheduler is not None else None)


class CheckpointSaveError(CheckpointWriteError):
    """A save that failed on this rank (a file that could not be written, named with the cause) or on
    another rank (named); the previous checkpoint and tracker were left unchanged. The entry points
    report it as one line (training.checkpoint_save_errors_as_user_errors)."""


def _raise_save_failure(error, iteration, final_dir, failures=None):
    """Raise on this rank after a failed save: ``error`` is this rank's (None when another rank failed),
    ``failures`` ``{rank: one-line report}`` of the failing ranks when known. A file-system error becomes
    a CheckpointSaveError naming the file and the cause, another rank's failure one naming that rank; any
    other error of this rank (an internal one) is raised unchanged, with its traceback."""
    outcome = (f"saving checkpoint at iteration {iteration} to {final_dir} failed; the previous checkpoint and "
               "tracker were left unchanged")
    if isinstance(error, OSError):
        cause = write_failure(error)
        raise CheckpointSaveError(f"{cause}; {outcome}", cause.errno, cause.path) from error
    if isinstance(error, (SaveFailedOnAnotherRankError, checkpoint_integrity.FailedOnAnotherRankError)):
        raise CheckpointSaveError(f"{error}; {outcome}") from error
    if error is not None:
        raise error
    others = sorted((failures or {}).items())
    if others:
        rank, report = others[0]
        raise CheckpointSaveError(f"{outcome} (rank {rank}: {report})")
    raise CheckpointSaveError(f"{outcome} (on another rank)")


def _failure_reports(error):
    """``{rank: one-line report}`` of the ranks whose ``error`` is not None (all ranks call it, after they
    agreed that one failed)."""
    report = None if error is None else one_line(error)[:400]
    if not dist.is_initialized():
        return {0: report} if report is not None else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    return {rank: text for rank, text in enumerate(gathered) if text is not None}


# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------

load_state_dict_file = load_torch_file  # Megatron-compatible name of core's one torch.load


# The model-shape flags a reader of a checkpoint's saved args needs (positive integers).
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "num_attention_heads")


def _a(noun):
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def saved_args(state_dict, path, context=None, required=(), positive_if_set=()):
    """The training args a checkpoint file saved (its ``args`` entry, a Namespace), or None without one.

    ``state_dict``: what :func:`load_state_dict_file` returned for ``path`` (``context`` as there).
    ``required``: names of args that must be there as positive integers (e.g. :data:`MODEL_SHAPE_ARGS`
    for a reader that rebuilds the model's shape from them), ``positive_if_set`` names that may be
    missing or None but are otherwise positive integers; checked only when the args are there.
    Raises CheckpointReadError naming the file when it is not a dict, its ``args`` is not a Namespace
    (e.g. a number), or a ``required`` entry is missing or not a positive integer.
    """
    where = f"{path} ({context})" if context else f"{path}"
    if not isinstance(state_dict, dict):
        raise CheckpointReadError(f"cannot read checkpoint file {where}: it is not a checkpoint: it holds "
                                  f"{_a(type(state_dict).__name__)}, not the dict that save_checkpoint writes")
    args = state_dict.get("args")
    if args is None:
        return None
    if not isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        raise CheckpointReadError(f"cannot read checkpoint file {where}: its 'args' entry is "
                                  f"{_a(type(args).__name__)}, not the Namespace of training flags that "
                                  "save_checkpoint writes")
    for name in (*required, *positive_if_set):
        value = getattr(args, name, None)
        if value is None and name not in required:
            continue
        if type(value) is not int or value <= 0:  # bool is not a size either
            found = "missing" if value is None else f"{value!r}"[:40]
            raise CheckpointReadError(f"cannot read checkpoint file {where}: its saved args have {name} {found}, "
                                      "not a positive integer")
    return args


def _layout_hint(iteration_dir):
    found = rank_dirnames(iteration_dir)
    return ", ".join(found) if found else "no mp_rank_* directories"


def _checkpoint_dir_to_load(args, load_dir, load_arg="load"):
    """Which iteration directory of ``load_dir`` to load, for both formats.

    Returns ``(iteration directory, iteration, release, source)`` (``source`` says where the
    iteration came from: ``--ckpt-step`` or the tracker), or None when there is nothing to load
    (no tracker: a warning; FileNotFoundError with --exit-on-missing-checkpoint). Raises
    FileNotFoundError when the directory named does not exist. The iteration is ``--ckpt-step``
    (refused when damaged) or the newest complete one at or below the tracker's, or the newest
    non-persistent one when newer (checkpoint_integrity.choose_checkpoint: files checked against the
    manifest; CRC-32s unless --no-verify-checkpoint); the returned directory may lie in the
    non-persistent checkpoint directory.
    """
    tracker = get_checkpoint_tracker_filename(load_dir)
    non_persistent_dir = None
    if load_arg == "load" and getattr(args, "non_persistent_ckpt_type", None) == "global":
        non_persistent_dir = non_persistent_checkpoint_dir(args, load_dir)
    chosen = checkpoint_integrity.choose_checkpoint(
        load_dir, ckpt_step=args.ckpt_step, verify=not getattr(args, "no_verify_checkpoint", False),
        non_persistent_dir=non_persistent_dir, flag=f"--{load_arg.replace('_', '-')}", warn=print_rank_0)
    if chosen is None:
        if args.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"--exit-on-missing-checkpoint: no checkpoint tracker {tracker} "
                                    f"in --load directory {load_dir}")
        print_rank_0(f"WARNING: could not find the metadata file {tracker}")
        print_rank_0("    will not load any checkpoints and will start from random")
        return None
    load_dir, iteration, release = chosen
    source = (f"--ckpt-step {args.ckpt_step}" if args.ckpt_step is not None
              else f"tracker {get_checkpoint_tracker_filename(load_dir)}")

    iteration_dir = os.path.join(load_dir, iteration_dirname(iteration, release))
    if not os.path.isdir(iteration_dir):
        raise FileNotFoundError(f"checkpoint directory {iteration_dir} (iteration {iteration}, from {source}) "
                                "does not exist")
    return iteration_dir, iteration, release, source


def _legacy_checkpoint_file(iteration_dir, iteration, release):
    """This rank's ``model_optim_rng.pt`` in a torch-format iteration directory (FileNotFoundError naming it)."""
    name = get_checkpoint_name(os.path.dirname(iteration_dir), iteration, release)
    if not os.path.isfile(name):
        raise FileNotFoundError(
            f"checkpoint file {name} does not exist: expected for tensor-parallel rank "
            f"{parallel_state.get_tensor_model_parallel_rank()} of "
            f"{parallel_state.get_tensor_model_parallel_world_size()} and pipeline rank "
            f"{parallel_state.get_pipeline_model_parallel_rank()} of "
            f"{parallel_state.get_pipeline_model_parallel_world_size()}, but {iteration_dir} holds "
            f"{_layout_hint(iteration_dir)}; it was saved with a different tensor/pipeline-parallel layout "
            "(the torch format cannot reshard)")
    return name


def _check_layout(checkpoint_args, checkpoint_name):
    for name, current in (("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
                          ("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())):
        saved = getattr(checkpoint_args, name, None)
        if saved is not None and saved != current:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"checkpoint {checkpoint_name} was saved with {flag} {saved} but this run uses "
                             f"{current}; the torch format cannot reshard, use {flag} {saved}")


def check_checkpoint_args(checkpoint_args, vocab_padding=True):
    """Fail when the model shape stored in the checkpoint differs from the command line.

    Compares num_layers, hidden_size, num_attention_heads, max_position_embeddings,
    make_vocab_size_divisible_by, padded_vocab_size (unless ``vocab_padding`` is False: the
    torch_dist format loads another padding) and tokenizer_type (each only when both sides have
    it). Raises ValueError naming the flag and both values.
    """
    args = get_args()
    names = ["num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "tokenizer_type"]
    if vocab_padding:
        names += ["make_vocab_size_divisible_by", "padded_vocab_size"]
    for name in names:
        saved, current = getattr(checkpoint_args, name, None), getattr(args, name, None)
        if saved is not None and current is not None and saved != current:
            raise ValueError(f"{name} value from checkpoint ({saved}) is not equal to the input argument value "
                             f"({current}) (--{name.replace('_', '-')})")


def warn_if_vocab_padding_differs(checkpoint_args, checkpoint_dir):
    """Warn (rank 0) when the checkpoint's padded vocabulary size differs from this run's.

    torch_dist loads the rows both have (the rest keep their initialisation), which changes the
    softmax over the padding and so the losses slightly; the padding follows the tensor-parallel
    size and --make-vocab-size-divisible-by, so naming both sizes and that flag says how to match it.
    """
    args = get_args()
    saved, current = getattr(checkpoint_args, "padded_vocab_size", None), getattr(args, "padded_vocab_size", None)
    if saved is None or current is None or saved == current:
        return
    saved_divisor = getattr(checkpoint_args, "make_vocab_size_divisible_by", None)
    saved_tp = getattr(checkpoint_args, "tensor_model_parallel_size", None)
    tp = args.tensor_model_parallel_size
    hint = "so that both pad alike"
    if saved_divisor and saved_tp and (saved_divisor * saved_tp) % tp == 0:  # same multiple: same padding
        hint = f"{saved_divisor * saved_tp // tp} to pad as the checkpoint does"
    print_rank_0(f"WARNING: checkpoint {checkpoint_dir} has a padded vocabulary of {saved} rows (saved with "
                 f"--make-vocab-size-divisible-by {saved_divisor} at tensor-parallel size {saved_tp}), this run "
                 f"pads to {current} (--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} at "
                 f"tensor-parallel size {tp}); the rows both have are loaded and the losses can differ "
                 f"slightly: pass --make-vocab-size-divisible-by {hint}")


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, train_state=None):
    """Load the checkpoint named by ``args.<load_arg>`` into model, optimizer and scheduler; all ranks call it.

    Picks the iteration directory from ``--ckpt-step`` or the tracker (:func:`_checkpoint_dir_to_load`,
    shared by both formats) and its format (``--ckpt-format``; either one with
    ``--auto-detect-ckpt-format``): ``torch_dist`` reshards to this run's TP/PP/DP layout, ``torch``
    loads this rank's legacy file (same layout only). Without a tracker: prints a warning
    and returns ``(0, 0)`` (FileNotFoundError with ``--exit-on-missing-checkpoint``).
    ``--finetune``: weights only, iteration 0, counters not restored. ``--no-load-optim`` /
    ``--no-load-rng`` skip those parts. Otherwise restores the training counters (iteration,
    consumed/skipped train samples, consumed valid samples, FLOPs so far) into ``train_state``,
    optimizer + scheduler state and every RNG (python, numpy, torch CPU, CUDA when available, the
    TP tracker). Without a ``train_state`` (Megatron's signature) the counters other than the
    iteration are set on ``args`` as Megatron-LM does.

    Args:
        model: list of model chunks (wrapped or not).
        optimizer: object with ``load_state_dict`` or None.
        opt_param_scheduler: object with ``load_state_dict`` or None.
        load_arg: name of the args attribute holding the directory.
        strict: passed to ``Module.load_state_dict``.
        train_state: the :class:`TrainingState` to restore the counters into (None: see above).
    Returns ``(iteration, num_floating_point_operations_so_far)``.
    Raises FileNotFoundError (directory or rank file missing, naming the expected file),
    ValueError (bad tracker, tp/pp or model-shape mismatch, a checkpoint of the other format without
    --auto-detect-ckpt-format; CheckpointMismatchError for torch_dist tensors missing or of another shape), pickle.UnpicklingError (non
    weights-only content), CheckpointReadError (a CheckpointFileError naming the file, the iteration and
    the load directory: empty, truncated, corrupt or not a checkpoint), CheckpointContentError (a
    RuntimeError: model mismatch, missing optimizer/RNG state without --no-load-optim / --no-load-rng).
    """
    args = get_args()
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        raise ValueError(f"load_checkpoint needs --{load_arg.replace('_', '-')}")
    model = _unwrap(model)

    restored = TrainingState()
    found = _checkpoint_dir_to_load(args, load_dir, load_arg)
    if found is None:
        _deliver_training_state(restored, train_state, args)
        return 0, 0
    iteration_dir, iteration, release, source = found
    flag = f"--{load_arg.replace('_', '-')} {load_dir}"
    context = f"release checkpoint of {flag}" if release else f"iteration {iteration} of {flag}"
    try:
        ckpt_format = _format_to_load(args, iteration_dir, iteration, source)
        if ckpt_format == "torch_dist":
            iteration = _load_torch_dist(args, iteration_dir, iteration, release, context, model, optimizer,
                                         opt_param_scheduler, strict, restored)
        else:
            checkpoint_name = _legacy_checkpoint_file(iteration_dir, iteration, release)
            iteration = _load_torch_format(args, checkpoint_name, iteration, release, context, model, optimizer,
                                           opt_param_scheduler, strict, restored)
    except UserInputError:
        raise
    except SchedulerMismatchError as error:  # flags vs checkpoint: every rank reads the same schedule
        raise UserInputError(f"{flag}: {error}", same_on_every_rank=True) from error
    except ValueError as error:  # the checkpoint does not fit the flags (format, layout, shapes); names them
        raise UserInputError(f"{flag}: {error}") from error

    _barrier()
    _deliver_training_state(restored, train_state, args)
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} {_rank_summary()} at iteration {iteration}")
    return iteration, restored.num_floating_point_operations_so_far


def _format_to_load(args, iteration_dir, iteration, source):
    """The format of ``iteration_dir``; ValueError when it is not ``--ckpt-format`` and
    ``--auto-detect-ckpt-format`` is not given, FileNotFoundError when it holds no checkpoint."""
    found = detect_checkpoint_format(iteration_dir)
    if found is None:
        raise FileNotFoundError(f"checkpoint directory {iteration_dir} (iteration {iteration}, from {source}) holds "
                                "no checkpoint: neither torch_dist files (.metadata, common.pt) nor torch-format "
                                "mp_rank_* directories")
    wanted = getattr(args, "ckpt_format", "torch")
    if found != wanted and not getattr(args, "auto_detect_ckpt_format", False):
        raise ValueError(f"checkpoint {iteration_dir} is in the {found} format but --ckpt-format is {wanted}; "
                         f"pass --ckpt-format {found} or --auto-detect-ckpt-format to load it")
    return found


def _load_torch_format(args, checkpoint_name, iteration, release, context, model, optimizer, opt_param_scheduler,
                       strict, restored):
    """Load a legacy per-rank file into model, optimizer, scheduler, RNG and ``restored``; returns the iteration."""
    state_dict = load_state_dict_file(checkpoint_name, context)
    checkpoint_args = saved_args(state_dict, checkpoint_name, context)
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))

    if checkpoint_args is not None:
        _check_layout(checkpoint_args, checkpoint_name)

    if args.finetune or release:
        iteration = 0
    else:
        try:
            iteration = state_dict["iteration"]
        except KeyError:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} has no 'iteration' entry; load it with "
                                         "--finetune to start from iteration 0") from None

    if args.finetune:
        num_floating_point_operations_so_far = 0
    else:
        if checkpoint_args is not None:
            check_checkpoint_args(checkpoint_args)
            restored.consumed_train_samples = getattr(checkpoint_args, "consumed_train_samples", 0)
            restored.skipped_train_samples = getattr(checkpoint_args, "skipped_train_samples", 0)
            restored.consumed_valid_samples = getattr(checkpoint_args, "consumed_valid_samples", 0)
        else:
            print_rank_0("could not find arguments in the checkpoint ...")
        num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)
    restored.iteration = iteration
    restored.num_floating_point_operations_so_far = num_floating_point_operations_so_far

    _load_model(model, state_dict, strict, checkpoint_name)

    if not release and not args.finetune and not args.no_load_optim:
        try:
            if optimizer is not None:
                optimizer.load_state_dict(_named_optimizer_state(state_dict, model, optimizer, checkpoint_name))
                if _is_distributed_optimizer(optimizer):
                    _load_distributed_optimizer_state(optimizer, checkpoint_name, context)
            if opt_param_scheduler is not None:
                opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
        except KeyError as exc:
            raise CheckpointContentError(f"unable to load optimizer state ({exc} missing) from checkpoint {checkpoint_name}; "
                                         "specify --no-load-optim or --finetune to skip it") from None
    elif (args.fp16 or args.bf16) and optimizer is not None and hasattr(optimizer, "reload_model_params"):
        # Fresh fp32 main params must start from the loaded (low-precision) weights.
        optimizer.reload_model_params()

    if not release and not args.finetune and not args.no_load_rng:
        try:
            rng_states = state_dict["rng_state"]
            index = 0
            if getattr(args, "data_parallel_random_init", False) and len(rng_states) > 1:
                index = parallel_state.get_data_parallel_rank()
            _set_rng_state(rng_states[index], checkpoint_name)
        except (KeyError, IndexError) as exc:
            raise CheckpointContentError(f"unable to load rng state ({exc} missing) from checkpoint {checkpoint_name}; "
                                         "specify --no-load-rng or --finetune to skip it") from None

    return iteration


def _load_torch_dist(args, iteration_dir, iteration, release, context, model, optimizer, opt_param_scheduler,
                     strict, restored):
    """Load a torch_dist checkpoint, resharding to this run's layout; returns the iteration. All ranks call it.

    ``common.pt`` gives the counters, scheduler and optimizer hyper-parameters; DCP reads this
    rank's chunks of every model (and optimizer) tensor in place; RNG states are restored only when
    the parallel layout is the one saved (another layout has other RNG streams: a warning says so).
    An fp32 main copy missing from the checkpoint (saved in fp32) is rebuilt from the loaded weights.
    """
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization

    common_name = common_file_name(iteration_dir)
    common = read_common_state(iteration_dir, context)
    checkpoint_args = saved_args(common, common_name, context)
    set_checkpoint_version(common.get("checkpoint_version", 0))
    warn_if_vocab_padding_differs(checkpoint_args, iteration_dir)
    if args.finetune or release:
        iteration = 0
    else:
        if "iteration" not in common:
            raise CheckpointReadError(f"checkpoint {common_name} ({context}) has no 'iteration' entry; load it with "
                                      "--finetune to start from iteration 0")
        iteration = common["iteration"]
        if checkpoint_args is not None:
            check_checkpoint_args(checkpoint_args, vocab_padding=False)
        if "train_state" in common:
            restored.load_state_dict(common["train_state"])
        else:  # written by Megatron-LM: the sample counters are in the saved args
            for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
                setattr(restored, name, getattr(checkpoint_args, name, 0) or 0)
            restored.num_floating_point_operations_so_far = common.get("num_floating_point_operations_so_far", 0)
    restored.iteration = iteration
    if args.finetune:
        restored.num_floating_point_operations_so_far = 0

    load_optim = optimizer is not None and not release and not args.finetune and not args.no_load_optim
    if load_optim and "optimizer" not in common:
        raise CheckpointContentError(f"unable to load optimizer state from checkpoint {iteration_dir} (saved with "
                                     "--no-save-optim); specify --no-load-optim or --finetune to skip it")
    metadata = serialization.read_metadata(iteration_dir)
    legacy = mo.is_per_layer_layout(metadata.state_dict_metadata)
    if legacy:
        print_rank_0(f"NOTE: checkpoint {iteration_dir} has this project's earlier per-layer torch_dist layout; it "
                     "loads, and checkpoints saved from now on have Megatron-LM's layer-stacked layout")
    sharded = mo.model_sharded_state(model, legacy=legacy)
    finishers = []
    if load_optim:
        mo.ensure_optimizer_state(optimizer)
        reads, finishers = mo.optimizer_load_plan(model, optimizer, metadata.state_dict_metadata, legacy)
        sharded += reads

    def allow_missing(key):
        # fp32 main copies exist only in checkpoints of fp16/bf16 runs (or with the distributed
        # optimizer); strict=False tolerates model keys.
        return (key.startswith(mo.OPTIMIZER_PREFIX + mo.MAIN_PARAM + ".") or key.endswith("." + mo.MAIN_PARAM)
                or (not strict and not key.startswith(mo.OPTIMIZER_PREFIX)))

    skipped = serialization.load(sharded, iteration_dir, metadata=metadata, allow_missing=allow_missing)
    for finish in finishers:
        finish()
    main_param_skipped = any(key.startswith(mo.OPTIMIZER_PREFIX + mo.MAIN_PARAM + ".") or key.endswith(
        "." + mo.MAIN_PARAM) for key in skipped)
    if optimizer is not None and hasattr(optimizer, "reload_model_params") and (not load_optim or main_param_skipped):
        # fp32 main params not in the checkpoint start from the loaded (low-precision) weights.
        optimizer.reload_model_params()
    if load_optim:
        mo.load_optimizer_common_state(optimizer, common["optimizer"], iteration_dir)
        if opt_param_scheduler is not None:
            if "opt_param_scheduler" not in common:
                raise CheckpointContentError(f"unable to load the scheduler state from checkpoint {iteration_dir}; specify "
                                             "--no-load-optim or --finetune to skip it")
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])

    if not release and not args.finetune and not args.no_load_rng:
        _load_torch_dist_rng(args, iteration_dir, common, context)
    return iteration


def _load_torch_dist_rng(args, iteration_dir, common, context):
    if "parallel_layout" not in common and not os.path.isdir(os.path.join(iteration_dir, RNG_DIRNAME)):
        print_rank_0(f"WARNING: checkpoint {iteration_dir} was written by Megatron-LM (its RNG states are pickled "
                     "objects, which this loader does not unpickle): the RNG states are not restored")
        return
    saved_layout, layout = common.get("parallel_layout"), current_parallel_layout()
    if saved_layout != layout:
        print_rank_0(f"WARNING: checkpoint {iteration_dir} was saved with the parallel layout {saved_layout}, this run "
                     f"uses {layout}: the RNG states are not restored (each layout has its own RNG streams)")
        return
    name = _rng_file_name(iteration_dir, _world_rank())
    if not os.path.isfile(name):
        raise CheckpointContentError(f"unable to load rng state from checkpoint {iteration_dir}: {name} does not exist "
                                     "(saved with --no-save-rng?); specify --no-load-rng or --finetune to skip it")
    _set_rng_state(load_state_dict_file(name, context)["rng_state"][0], name)


def _deliver_training_state(restored, train_state, args):
    """Copy the loaded counters into the caller's ``train_state``, or onto ``args`` without one."""
    if train_state is not None:
        train_state.load_state_dict(restored.state_dict())
    else:  # Megatron's signature: its callers read the sample counters from args
        restored.copy_to_args(args)


def _load_distributed_optimizer_state(optimizer, checkpoint_name, context):
    """Read ``distrib_optim.pt`` on data-parallel rank 0 and scatter it to the shards (all ranks call it)."""
    name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
    param_state, error = None, None
    if parallel_state.get_data_parallel_rank() == 0:
        try:
            if not os.path.isfile(name):
                raise FileNotFoundError(f"distributed-optimizer state {name} ({context}) does not exist; it is "
                                        "written by --use-distributed-optimizer runs (specify --no-load-optim to "
                                        "start the optimizer afresh)")
            param_state = load_state_dict_file(name, context)
        except Exception as exc:  # every rank must learn of it, or the others wait in the scatter
            error = exc
    if _any_rank(error is not None):
        if error is not None:
            raise error
        raise CheckpointContentError(f"reading the distributed-optimizer state {name} failed on data-parallel rank 0")
    optimizer.load_parameter_state_from_dp_zero(param_state, source=name)


def _named_optimizer_state(state_dict, model, optimizer, checkpoint_name):
    """The checkpoint's optimizer state keyed by param name (Megatron's positional layout mapped by name)."""
    names = getattr(optimizer, "param_names_by_group", lambda: None)()
    identities = [legacy_optimizer_state.group_identity(group) for group in getattr(optimizer, "param_groups", [])]
    return legacy_optimizer_state.to_named_layout(
        state_dict["optimizer"], names, identities, legacy_optimizer_state.model_keys_in_order(state_dict, len(model)),
        legacy_optimizer_state.param_shapes_by_name(model), checkpoint_name)


def _load_model(model, state_dict, strict, checkpoint_name):
    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    for chunk, key in zip(model, keys):
        if key not in state_dict:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} has no '{key}' entry for {len(model)} model chunk(s)")
        try:
            chunk.load_state_dict(state_dict[key], strict=strict)
        except RuntimeError as exc:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} does not match the model: {exc}") from exc


__all__ = [
    "CHECKPOINT_VERSION", "get_checkpoint_name", "get_checkpoint_tracker_filename", "read_metadata",
    "get_rng_state", "generate_state_dict", "save_checkpoint", "get_distributed_optimizer_checkpoint_name",
    "load_checkpoint", "load_state_dict_file", "finalize_async_save", "async_save_pending",
    "wait_for_async_staging", "detect_checkpoint_format",
    "CheckpointReadError", "check_checkpoint_args", "saved_args", "MODEL_SHAPE_ARGS",
    "CheckpointWriteError", "CheckpointSaveError", "write_failure", "get_checkpoint_version", "set_checkpoint_version",
    "TRACKER_FILENAME", "CHECKPOINT_BASENAME", "DISTRIBUTED_OPTIMIZER_BASENAME", "COMMON_BASENAME", "RNG_DIRNAME",
    "CKPT_FORMATS",
]


def _rank_summary() -> str:
    """Megatron's ``[ t a/b, p e/f ]`` suffix: this rank's (1-based) tensor and pipeline position."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return (f"[ t {parallel_state.get_tensor_model_parallel_rank() + 1}/{tp}, "
            f"p {parallel_state.get_pipeline_model_parallel_rank() + 1}/{pp} ]")
