"""Save a checkpoint in either format, atomically: prepare the hidden directory, write, publish; and the pending ``--async-save``."""
import os
import shutil

from megatron.core.dist_checkpointing.serialization import SaveFailedOnAnotherRankError
from megatron.training.checkpointing import integrity
from megatron.training.checkpointing.collectives import (
    all_ranks,
    any_rank,
    broadcast_int_from_rank_0,
    failure_reports,
    rank_summary,
    world_rank,
)
from megatron.training.checkpointing.dist_format import save_torch_dist
from megatron.training.checkpointing.durable import fault_point, write_failure
from megatron.training.checkpointing.errors import CheckpointSaveError, FailedOnAnotherRankError
from megatron.training.checkpointing.layout import CKPT_FORMATS, NON_PERSISTENT_SUBDIR, iteration_dirname
from megatron.training.checkpointing.state import get_rng_state, unwrap_model
from megatron.training.checkpointing.torch_format import write_torch_format
from megatron.training.global_vars import get_args
from megatron.training.training_state import TrainingState
from megatron.training.utils import print_rank_0


def non_persistent_checkpoint_dir(args, save_dir=None):
    """Where --non-persistent-save-interval checkpoints go: ``--non-persistent-global-ckpt-dir``, else
    ``<save_dir or --save>/non_persistent`` (Megatron-LM's layout); None when neither is set."""
    explicit = getattr(args, "non_persistent_global_ckpt_dir", None)
    if explicit:
        return explicit
    base = save_dir if save_dir is not None else args.save
    return None if base is None else os.path.join(base, NON_PERSISTENT_SUBDIR)


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
    owner_pid = broadcast_int_from_rank_0(os.getpid())
    tmp_dir = os.path.join(save_dir, f".{dirname}.tmp-{owner_pid}")
    error = None
    if world_rank() == 0:
        try:
            integrity.prepare_save_dir(save_dir)  # also repairs what a crashed save left
            os.makedirs(tmp_dir)
        except Exception as exc:  # reported to every rank below instead of leaving them in a barrier
            error = exc
    if any_rank(error is not None):
        _raise_save_failure(error, iteration, final_dir, failure_reports(error))
    return tmp_dir, final_dir


def _publish_checkpoint(save_dir, iteration, tmp_dir, final_dir, write_error=None, non_persistent=False,
                        known_digests=None):
    """The last step of every save, in both formats, synchronous or asynchronous; all ranks call it.

    Every rank reports whether its writes (``write_error``) succeeded; only when all did,
    integrity.publish_iteration writes the ``integrity_manifest.json`` (size and CRC-32
    per file), moves ``tmp_dir`` to ``final_dir`` (an existing one is swapped atomically) and only then
    atomically replaces the tracker, so it never names an incomplete directory; then
    --save-retain-interval prunes older iterations (``non_persistent``: only the newest is kept). On
    any failure the temporary directory is removed, the previous checkpoint and tracker stay as they
    were, and every rank raises. ``known_digests``: this rank's CRC-32s computed by an ``--async-save``
    background writer (manifest.write_manifest digests only the other files).
    """
    rank = world_rank()
    if any_rank(write_error is not None):
        failures = failure_reports(write_error)
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(write_error, iteration, final_dir, failures)
    try:
        # Manifest, then the directory, and the tracker last: it never names an incomplete directory.
        integrity.publish_iteration(
            save_dir, tmp_dir, iteration, keep_only_newest=non_persistent, known_digests=known_digests,
            retain_interval=None if non_persistent else getattr(get_args(), "save_retain_interval", None))
    except Exception as exc:  # raised on every rank
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _raise_save_failure(exc, iteration, final_dir)
    print_rank_0("  successfully saved checkpoint from iteration {:7d} to {} {}".format(
        iteration, save_dir, rank_summary()))


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
    model = unwrap_model(model)
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
            write_torch_format(args, tmp_dir, final_dir, model, optimizer, opt_param_scheduler, rng_state, state)
        else:
            writer = save_torch_dist(args, tmp_dir, model, optimizer, opt_param_scheduler, rng_state, state)
            if writer is not None:  # --async-save: published later by finalize_async_save
                _PENDING.append((writer, save_dir, iteration, tmp_dir, final_dir, non_persistent_ckpt))
                return
        fault_point("in_write", iteration)
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
    if not blocking and not all_ranks(writer.done()):
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
    if isinstance(error, (SaveFailedOnAnotherRankError, FailedOnAnotherRankError)):
        raise CheckpointSaveError(f"{error}; {outcome}") from error
    if error is not None:
        raise error
    others = sorted((failures or {}).items())
    if others:
        rank, report = others[0]
        raise CheckpointSaveError(f"{outcome} (rank {rank}: {report})")
    raise CheckpointSaveError(f"{outcome} (on another rank)")
