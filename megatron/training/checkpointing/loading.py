"""Load a checkpoint of either format: choose the iteration (tracker, --ckpt-step, integrity), detect the format, restore."""
import os

from megatron.core.optimizer_param_scheduler import SchedulerMismatchError
from megatron.training.checkpointing import integrity
from megatron.training.checkpointing.collectives import barrier, rank_summary
from megatron.training.checkpointing.dist_format import load_torch_dist
from megatron.training.checkpointing.errors import CheckpointMismatchError
from megatron.training.checkpointing.layout import detect_format, get_checkpoint_tracker_filename, iteration_dirname
from megatron.training.checkpointing.saving import non_persistent_checkpoint_dir
from megatron.training.checkpointing.state import unwrap_model
from megatron.training.checkpointing.torch_format import legacy_checkpoint_file, load_torch_format
from megatron.training.global_vars import get_args
from megatron.training.training_state import TrainingState
from megatron.training.user_errors import UserInputError
from megatron.training.utils import print_rank_0


def _checkpoint_dir_to_load(args, load_dir, load_arg="load"):
    """Which iteration directory of ``load_dir`` to load, for both formats.

    Returns ``(iteration directory, iteration, release, source)`` (``source`` says where the
    iteration came from: ``--ckpt-step`` or the tracker), or None when there is nothing to load
    (no tracker: a warning; FileNotFoundError with --exit-on-missing-checkpoint). Raises
    FileNotFoundError when the directory named does not exist. The iteration is ``--ckpt-step``
    (refused when damaged) or the newest complete one at or below the tracker's, or the newest
    non-persistent one when newer (integrity.choose_checkpoint: files checked against the
    manifest; CRC-32s unless --no-verify-checkpoint); the returned directory may lie in the
    non-persistent checkpoint directory.
    """
    tracker = get_checkpoint_tracker_filename(load_dir)
    non_persistent_dir = None
    if load_arg == "load" and getattr(args, "non_persistent_ckpt_type", None) == "global":
        non_persistent_dir = non_persistent_checkpoint_dir(args, load_dir)
    chosen = integrity.choose_checkpoint(
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
    model = unwrap_model(model)

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
            iteration = load_torch_dist(args, iteration_dir, iteration, release, context, model, optimizer,
                                         opt_param_scheduler, strict, restored)
        else:
            checkpoint_name = legacy_checkpoint_file(iteration_dir, iteration, release)
            iteration = load_torch_format(args, checkpoint_name, iteration, release, context, model, optimizer,
                                           opt_param_scheduler, strict, restored)
    except UserInputError:
        raise
    except SchedulerMismatchError as error:  # flags vs checkpoint: every rank reads the same schedule
        raise UserInputError(f"{flag}: {error}", same_on_every_rank=True) from error
    except ValueError as error:  # the checkpoint does not fit the flags (format, layout, shapes); names them
        raise UserInputError(f"{flag}: {error}") from error

    barrier()
    _deliver_training_state(restored, train_state, args)
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} {rank_summary()} at iteration {iteration}")
    return iteration, restored.num_floating_point_operations_so_far


def _format_to_load(args, iteration_dir, iteration, source):
    """The format of ``iteration_dir``; ValueError when it is not ``--ckpt-format`` and
    ``--auto-detect-ckpt-format`` is not given, FileNotFoundError when it holds no checkpoint."""
    found = detect_format(iteration_dir)
    if found is None:
        raise FileNotFoundError(f"checkpoint directory {iteration_dir} (iteration {iteration}, from {source}) holds "
                                "no checkpoint: neither torch_dist files (.metadata, common.pt) nor torch-format "
                                "mp_rank_* directories")
    wanted = getattr(args, "ckpt_format", "torch")
    if found != wanted and not getattr(args, "auto_detect_ckpt_format", False):
        raise CheckpointMismatchError(f"checkpoint {iteration_dir} is in the {found} format but --ckpt-format is {wanted}; "
                         f"pass --ckpt-format {found} or --auto-detect-ckpt-format to load it")
    return found


def _deliver_training_state(restored, train_state, args):
    """Copy the loaded counters into the caller's ``train_state``, or onto ``args`` without one."""
    if train_state is not None:
        train_state.load_state_dict(restored.state_dict())
    else:  # Megatron's signature: its callers read the sample counters from args
        restored.copy_to_args(args)
