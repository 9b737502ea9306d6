"""What goes into a checkpoint and what comes out: the per-rank state dict, the sanitized args, the RNG states, the saved-args checks."""
import argparse
import enum
import random
import types

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.safe_loading import CheckpointReadError
from megatron.core.transformer.enums import AttnBackend, ModelType
from megatron.training.checkpointing import legacy_optimizer_state
from megatron.training.checkpointing.errors import CheckpointContentError, CheckpointMismatchError
from megatron.training.checkpointing.layout import CHECKPOINT_VERSION
from megatron.training.global_vars import get_args
from megatron.training.training_state import TrainingState
from megatron.training.user_errors import one_line
from megatron.training.utils import print_rank_0

_CHECKPOINT_VERSION = None


def set_checkpoint_version(value):
    """Remember the version of the checkpoint being loaded (Megatron's global)."""
    global _CHECKPOINT_VERSION
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    """Version of the last loaded checkpoint, or None before any load."""
    return _CHECKPOINT_VERSION


def is_distributed_optimizer(optimizer):
    """Whether ``optimizer`` is the distributed optimizer (its state is sharded over data-parallel ranks)."""
    return optimizer is not None and hasattr(optimizer, "get_parameter_state_dp_zero")


def unwrap_model(model):
    """The model chunks (a list) without their DDP/Float16 wrappers."""
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


def set_rng_state(rng_state, checkpoint_name):
    """Restore one rank's RNG states (an entry of :func:`get_rng_state`); CheckpointContentError naming the file when they are not such states."""
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
    """``value`` reduced to types a weights-only torch load accepts, or _DROP.

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


def sanitized_args(args):
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
    saved_args = sanitized_args(args)
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
            optimizer_state = optimizer.state_dict()
            if parallel_state.get_expert_model_parallel_world_size() == 1:  # Megatron's grouping at EP 1
                optimizer_state = legacy_optimizer_state.fold_expert_groups(
                    optimizer_state, legacy_optimizer_state.model_keys_in_order(state_dict, len(model)))
            state_dict["optimizer"] = legacy_optimizer_state.to_megatron_layout(optimizer_state)
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict["rng_state"] = rng_state
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return state_dict



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
            raise CheckpointMismatchError(f"{name} value from checkpoint ({saved}) is not equal to the input argument value "
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
