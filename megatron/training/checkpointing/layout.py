"""Every on-disk name of a checkpoint, the one format detector, the parallel-layout record, ``common.pt`` and the rank order.

Used by training and by tools/ alike, so both write and read the same layout (docs/megatron-checkpoints.md):

``<dir>/latest_checkpointed_iteration.txt``            the tracker: the newest complete iteration (or ``release``)
``<dir>/iter_{N:07d}/`` or ``<dir>/release/``          one iteration
    ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``  legacy ``torch`` format: one file per (tp, pp, ep) rank
    ``mp_rank_.../distrib_optim.pt``                    its distributed-optimizer state (data-parallel rank 0)
    ``.metadata``, ``__<rank>_0.distcp``                ``torch_dist``: torch.distributed.checkpoint files
    ``metadata.json``                                   Megatron core_v0.14's description of a torch_dist checkpoint
    ``common.pt``                                       torch_dist: args, counters, scheduler, optimizer hyper-parameters
    ``rng/rank_{global rank:05d}.pt``                   torch_dist: each rank's RNG states
    ``integrity_manifest.json``                         size and CRC-32 of every file (integrity.py)
``<dir>/non_persistent/``                               --non-persistent-save-interval checkpoints
"""
import os
import re

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import model_and_optimizer as mo
from megatron.core.dist_checkpointing.safe_loading import CheckpointReadError, load_torch_file
from megatron.core.dist_checkpointing.serialization import (
    MEGATRON_METADATA_FILENAME,
    METADATA_FILENAME,
    is_distributed_checkpoint,
)

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKPOINT_BASENAME = "model_optim_rng.pt"
DISTRIBUTED_OPTIMIZER_BASENAME = "distrib_optim.pt"
COMMON_BASENAME = "common.pt"
RNG_DIRNAME = "rng"
MANIFEST_FILENAME = "integrity_manifest.json"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's _NON_PERSISTENT_CKPT_SUBDIR
RELEASE_DIRNAME = "release"
RANK_DIR_PREFIX = "mp_rank_"
CKPT_FORMATS = ("torch", "torch_dist")

__all__ = [
    "CHECKPOINT_VERSION", "TRACKER_FILENAME", "CHECKPOINT_BASENAME", "DISTRIBUTED_OPTIMIZER_BASENAME",
    "COMMON_BASENAME", "RNG_DIRNAME", "MANIFEST_FILENAME", "NON_PERSISTENT_SUBDIR", "RELEASE_DIRNAME",
    "RANK_DIR_PREFIX", "CKPT_FORMATS", "METADATA_FILENAME", "MEGATRON_METADATA_FILENAME",
    "iteration_dirname", "get_checkpoint_tracker_filename", "rank_dirname", "is_rank_dirname", "rank_dirnames",
    "parse_rank_dirname",
    "get_checkpoint_name", "get_distributed_optimizer_checkpoint_name", "common_file_name", "rng_file_name",
    "detect_format", "rank_of", "parallel_layout", "current_parallel_layout", "common_state", "read_common_state",
]


# ---------------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------------

def iteration_dirname(iteration, release=False):
    """``iter_{iteration:07d}``, or ``release`` for a release checkpoint."""
    return RELEASE_DIRNAME if release else "iter_{:07d}".format(iteration)


def get_checkpoint_tracker_filename(checkpoints_path):
    """``<checkpoints_path>/latest_checkpointed_iteration.txt``: holds the last complete iteration."""
    return os.path.join(checkpoints_path, TRACKER_FILENAME)


def rank_dirname(tensor_rank, pipeline_rank=0, pipeline_parallel=False, expert_rank=0, expert_parallel=False):
    """``mp_rank_{tp:02d}`` without pipeline parallelism, ``mp_rank_{tp:02d}_{pp:03d}`` with it, and
    ``_{ep:03d}`` appended with expert parallelism (Megatron-LM core_v0.14's ``get_checkpoint_name``)."""
    name = f"{RANK_DIR_PREFIX}{tensor_rank:02d}"
    if pipeline_parallel:
        name += f"_{pipeline_rank:03d}"
    if expert_parallel:
        name += f"_{expert_rank:03d}"
    return name


def is_rank_dirname(name):
    """Whether the directory entry ``name`` is a legacy-format rank directory (``mp_rank_*``)."""
    return name.startswith(RANK_DIR_PREFIX)


def rank_dirnames(iteration_dir):
    """The sorted ``mp_rank_*`` entries of ``iteration_dir``."""
    return sorted(entry for entry in os.listdir(iteration_dir) if is_rank_dirname(entry))


_RANK_DIRNAME = re.compile(rf"^{RANK_DIR_PREFIX}(\d{{2}})(?:_(\d{{3}}))?$")


def parse_rank_dirname(name):
    """``(tensor rank, pipeline rank)`` of a legacy rank directory name (the inverse of :func:`rank_dirname`;
    pipeline rank 0 without the ``_{pp:03d}`` part), or None for any other name."""
    match = _RANK_DIRNAME.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def parse_rank_dirname_with_experts(name, pipeline_parallel, expert_parallel):
    """``(tensor rank, pipeline rank, expert rank)`` of a legacy rank directory name written with or without
    pipeline and expert parallelism (the inverse of :func:`rank_dirname`; a single ``_{:03d}`` part is the
    pipeline rank or the expert rank depending on which is used), or None for another name."""
    match = re.match(rf"^{RANK_DIR_PREFIX}(\d{{2}})((?:_\d{{3}})*)$", name)
    if match is None:
        return None
    parts = [int(part) for part in match.group(2).split("_")[1:]]
    if len(parts) != int(bool(pipeline_parallel)) + int(bool(expert_parallel)):
        return None
    pipeline_rank = parts.pop(0) if pipeline_parallel else 0
    expert_rank = parts.pop(0) if expert_parallel else 0
    return int(match.group(1)), pipeline_rank, expert_rank


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None,
                        tensor_rank=None, pipeline_rank=None, expert_parallel=None, expert_rank=None):
    """Path of this rank's checkpoint file.

    ``<path>/iter_{iteration:07d}/mp_rank_{tp:02d}/model_optim_rng.pt`` without pipeline
    parallelism, ``.../mp_rank_{tp:02d}_{pp:03d}/...`` with it, ``_{ep:03d}`` appended to the directory
    with expert parallelism, ``release`` instead of the iteration directory when ``release``. Ranks and
    sizes not given are read from parallel_state (0 in a single process without groups).
    """
    if pipeline_parallel is None:
        pipeline_parallel = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = parallel_state.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = dist.is_initialized() and parallel_state.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = parallel_state.get_expert_model_parallel_rank() if expert_parallel else 0
    return os.path.join(checkpoints_path, iteration_dirname(iteration, release),
                        rank_dirname(tensor_rank, pipeline_rank, pipeline_parallel, expert_rank, expert_parallel),
                        CHECKPOINT_BASENAME)


def writes_legacy_file() -> bool:
    """Whether this rank writes its (tp, pp[, ep]) ``model_optim_rng.pt``: the expert-data-parallel rank 0, as
    Megatron-LM core_v0.14 (without expert parallelism, and with the expert tensor-parallel size equal to the
    dense one, that is data-parallel (with context-parallel) rank 0)."""
    if not dist.is_initialized():
        return True
    if (parallel_state.get_expert_model_parallel_world_size() > 1
            or parallel_state.get_expert_tensor_parallel_world_size()
            != parallel_state.get_tensor_model_parallel_world_size()):
        return parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    """``distrib_optim.pt`` in the directory of ``model_checkpoint_name`` (Megatron's legacy layout)."""
    return os.path.join(os.path.dirname(model_checkpoint_name), DISTRIBUTED_OPTIMIZER_BASENAME)


def common_file_name(iteration_dir):
    """``<iteration dir>/common.pt`` of a torch_dist checkpoint."""
    return os.path.join(iteration_dir, COMMON_BASENAME)


def rng_file_name(checkpoint_dir, rank):
    """``<iteration dir>/rng/rank_<global rank:05d>.pt``: one rank's RNG states in the torch_dist format."""
    return os.path.join(checkpoint_dir, RNG_DIRNAME, f"rank_{rank:05d}.pt")


# ---------------------------------------------------------------------------------------------------
# Format
# ---------------------------------------------------------------------------------------------------

def detect_format(iteration_dir):
    """The format of the iteration directory ``iteration_dir``: the one rule of the project.

    ``'torch_dist'`` when core's :func:`is_distributed_checkpoint` says so (``metadata.json``, else a DCP
    ``.metadata``) or ``common.pt`` is there, ``'torch'`` for ``mp_rank_*`` directories, None otherwise.
    """
    if is_distributed_checkpoint(iteration_dir) or os.path.isfile(common_file_name(iteration_dir)):
        return "torch_dist"
    if any(is_rank_dirname(entry) for entry in os.listdir(iteration_dir)):
        return "torch"
    return None


# ---------------------------------------------------------------------------------------------------
# Ranks and the parallel layout
# ---------------------------------------------------------------------------------------------------

def rank_of(tensor_rank, pipeline_rank, tensor_model_parallel_size, data_parallel_rank=0, data_parallel_size=1):
    """Global rank of a (tensor, data, pipeline) position in Megatron's rank order (tp-cp-ep-dp-pp, fastest first)."""
    return tensor_rank + tensor_model_parallel_size * (data_parallel_rank + data_parallel_size * pipeline_rank)


def parallel_layout(tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size=1,
                    virtual_pipeline_model_parallel_size=None, world_size=None, context_parallel_size=1,
                    expert_model_parallel_size=1):
    """The ``parallel_layout`` record of ``common.pt`` and of each RNG file (RNG states are restored only at
    the same one). ``world_size`` defaults to the product of the four sizes.

    ``context_parallel_size`` and ``expert_model_parallel_size`` are recorded only when above 1, so a record
    without them keeps the bytes it had before they existed (and that older checkpoints hold).
    """
    if world_size is None:
        world_size = (tensor_model_parallel_size * pipeline_model_parallel_size * data_parallel_size
                      * context_parallel_size)
    record = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "data_parallel_size": data_parallel_size,
        "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
        "world_size": world_size,
    }
    if context_parallel_size > 1:
        record["context_parallel_size"] = context_parallel_size
    if expert_model_parallel_size > 1:  # each expert-parallel rank has its own expert-parallel RNG stream
        record["expert_model_parallel_size"] = expert_model_parallel_size
    return record


def current_parallel_layout():
    """:func:`parallel_layout` of this run (parallel_state's sizes; 1 for DP and CP without torch.distributed)."""
    return parallel_layout(
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_data_parallel_world_size() if dist.is_initialized() else 1,
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        dist.get_world_size() if dist.is_initialized() else 1,
        parallel_state.get_context_parallel_world_size() if dist.is_initialized() else 1,
        parallel_state.get_expert_model_parallel_world_size() if dist.is_initialized() else 1)


# ---------------------------------------------------------------------------------------------------
# common.pt
# ---------------------------------------------------------------------------------------------------

def common_state(saved_args, iteration, train_state, num_floating_point_operations_so_far, layout,
                 distributed_optimizer, optimizer_state=None, scheduler_state=None):
    """``common.pt`` of a torch_dist checkpoint (written by rank 0), in the order both writers keep.

    ``saved_args``: the sanitized args Namespace (state.sanitized_args, with the sample counters set);
    ``train_state``: the counters dict; ``layout``: :func:`parallel_layout` (None: no RNG files);
    ``distributed_optimizer``: the optimizer layout recorded in the content metadata; ``optimizer_state``
    (dist_checkpointing's optimizer_common_state) and ``scheduler_state`` are stored when not None.
    """
    common = {
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "ckpt_format": "torch_dist",
        "iteration": iteration,
        "train_state": train_state,
        "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
        "parallel_layout": layout,
        mo.CONTENT_METADATA_KEY: mo.content_metadata(distributed_optimizer),
    }
    if optimizer_state is not None:
        common["optimizer"] = optimizer_state
    if scheduler_state is not None:
        common["opt_param_scheduler"] = scheduler_state
    return common


def read_common_state(iteration_dir, context):
    """The ``common.pt`` dict of the torch_dist checkpoint ``iteration_dir`` (``context`` names it in errors).

    Raises FileNotFoundError when it is missing, CheckpointReadError when it is not a torch_dist ``common.pt``
    (and what core's load_torch_file raises for an unreadable or unsafe file).
    """
    common_name = common_file_name(iteration_dir)
    if not os.path.isfile(common_name):
        raise FileNotFoundError(f"torch_dist checkpoint {iteration_dir} ({context}) has no {COMMON_BASENAME}")
    common = load_torch_file(common_name, context)
    if not isinstance(common, dict) or common.get("ckpt_format", "torch_dist") != "torch_dist":
        raise CheckpointReadError(f"cannot read checkpoint file {common_name} ({context}): it is not the "
                                  f"{COMMON_BASENAME} of a torch_dist checkpoint")
    return common
