"""Process groups for tensor, pipeline, context, data and expert parallelism with Megatron's rank layout."""
from __future__ import annotations

import contextlib
import datetime
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.collective_device import device_backend_map
from megatron.core import rank_generator as _rank_generator
from megatron.core.rank_generator import RankGenerator, default_embedding_ranks, default_position_embedding_ranks

# The rank arithmetic moved to megatron.core.rank_generator; Megatron's path to it stays valid.
generate_masked_orthogonal_rank_groups = _rank_generator.generate_masked_orthogonal_rank_groups

# ----------------------------------------------------------------------------------------------
# Global state. Every group is None until initialize_model_parallel() and again after
# destroy_model_parallel(); getters assert on None so a missing init fails loudly.
# ----------------------------------------------------------------------------------------------
_TENSOR_MODEL_PARALLEL_GROUP = None
_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_PIPELINE_GLOBAL_RANKS = None
_MODEL_PARALLEL_GROUP = None
_MODEL_PARALLEL_GLOBAL_RANKS = None
_EMBEDDING_GROUP = None
_EMBEDDING_GLOBAL_RANKS = None
_POSITION_EMBEDDING_GROUP = None
_POSITION_EMBEDDING_GLOBAL_RANKS = None
_DATA_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP_GLOO = None
_DATA_PARALLEL_GLOBAL_RANKS = None
_DATA_PARALLEL_GROUP_WITH_CP = None
_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = None
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
_CONTEXT_PARALLEL_GROUP = None
_CONTEXT_PARALLEL_GLOBAL_RANKS = None
_TENSOR_AND_DATA_PARALLEL_GROUP = None
_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = None
_TENSOR_AND_CONTEXT_PARALLEL_GROUP = None

_EXPERT_MODEL_PARALLEL_GROUP = None
_EXPERT_TENSOR_PARALLEL_GROUP = None
_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = None
_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP_GLOO = None

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_PIPELINE_MODEL_PARALLEL_SPLIT_RANK = None

# Explicit overrides (Megatron's set_* helpers); used by tests and by code that builds a model
# for a rank it is not (e.g. checkpoint converters).
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_TENSOR_MODEL_PARALLEL_RANK = None
_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_PIPELINE_MODEL_PARALLEL_RANK = None
_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_MODEL_PARALLEL_RANK = None


# ----------------------------------------------------------------------------------------------
# Group creation: each distinct rank set once
# ----------------------------------------------------------------------------------------------
# Groups built so far in this job, {(sorted ranks, backend or None, timeout): group}; a rank that is
# not a member stores GroupMember.NON_GROUP_MEMBER. Kept across destroy_model_parallel (the torch
# groups outlive it anyway) and dropped when the default group changes.
_GROUP_CACHE: Dict[Tuple, object] = {}
_GROUP_CACHE_WORLD = None


class _GroupFactory:
    """Hands out one process group per distinct rank set, creating as few as Megatron's layout allows.

    - A rank set equal to an earlier one (e.g. dp-cp when cp == 1, tp-pp when pp == 1, the expert
      groups when ep == 1 and expert tp == tp) reuses that group.
    - The full world reuses the default group.
    - One-member sets: only this rank's own set matters, so it is created once per rank with
      ``use_local_synchronization=True`` (only the member calls new_group; the group name is a
      hash, so the global group counter stays aligned across ranks). It is created in the
      constructor, at the same point on every rank, because with an NCCL default group bound to a
      device (``init_process_group(device_id=...)``) torch builds it by ``ncclCommSplit``, a
      collective over the whole world.
    - Every other set: ``dist.new_group`` called by all ranks (members and non-members), in the
      same order on all ranks because every rank walks the same rank lists.

    ``get_gloo`` gives the CPU copy of a group (Megatron's ``*_GLOO`` groups): the group itself
    when the default backend already carries CPU tensors (gloo, ``cpu:gloo,cuda:nccl``), else a
    gloo group, created the same way; None when ``create_gloo`` is False.
    """

    def __init__(self, timeout: datetime.timedelta, create_gloo: bool):
        global _GROUP_CACHE, _GROUP_CACHE_WORLD
        if _GROUP_CACHE_WORLD is not dist.group.WORLD:
            _GROUP_CACHE, _GROUP_CACHE_WORLD = {}, dist.group.WORLD
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.create_gloo = create_gloo
        self.gloo_backend = None if "cpu" in device_backend_map() else "gloo"
        self.get([self.rank])
        if create_gloo:
            self.get_gloo([self.rank])

    def get(self, ranks: Sequence[int], backend: Optional[str] = None):
        """The group of ``ranks`` (any order), or GroupMember.NON_GROUP_MEMBER on a non-member."""
        members = tuple(sorted(ranks))
        key = (members, backend, self.timeout)
        if key in _GROUP_CACHE:
            return _GROUP_CACHE[key]
        if backend is None and len(members) == self.world_size:
            group = dist.group.WORLD
        elif len(members) == 1:
            if members[0] != self.rank:
                return dist.GroupMember.NON_GROUP_MEMBER
            with _no_comm_split(backend):
                group = dist.new_group(list(members), timeout=self.timeout, backend=backend,
                                       use_local_synchronization=True)
        else:
            with _no_comm_split(backend):
                group = dist.new_group(list(members), timeout=self.timeout, backend=backend)
        _GROUP_CACHE[key] = group
        return group

    def get_gloo(self, ranks: Sequence[int]):
        """CPU-capable copy of the group of ``ranks`` (see the class docstring), or None."""
        if not self.create_gloo:
            return None
        return self.get(ranks, backend=self.gloo_backend)


@contextlib.contextmanager
def _no_comm_split(backend: Optional[str]):
    """Build a gloo group beside a device-bound NCCL default group without an NCCL split.

    With a bound device torch creates every subgroup by splitting the default NCCL communicator,
    and the ranks outside the new group join with a "no colour" split, but the members of a gloo
    group do not split at all, so the two sides' NCCL collectives would no longer match. Unbinding
    the device for the duration turns the split off for this one (non-NCCL) group.
    """
    world = dist.group.WORLD
    bound = getattr(world, "bound_device_id", None)
    if backend is None or bound is None:
        yield
        return
    world.bound_device_id = None
    try:
        yield
    finally:
        world.bound_device_id = bound


# ----------------------------------------------------------------------------------------------
# Initialisation
# ----------------------------------------------------------------------------------------------
def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
) -> None:
    """Set up every model- and data-parallel group getter for the current job.

    Layout: ``dp = world / (tp * pp * cp)`` and ranks are laid out per ``order`` (fastest axis
    first): for the default ``global_rank = tp_r + tp*(cp_r + cp*(dp_r + dp*pp_r))``. Every
    getter gets Megatron's rank list, but a process group is created only once per distinct rank
    set (see ``_GroupFactory``): axes of size 1 (cp, ep, pp, ...) add no group, the full world is
    the default group, and all one-member groups of a rank are one group. 8 ranks of plain data
    parallelism need 1 new group instead of 93. Groups use the default process group's backend;
    data-parallel groups also get CPU (gloo) copies unless ``create_gloo_process_groups`` is False
    (the same groups when the default backend carries CPU tensors). Every rank must call this
    with identical arguments after ``torch.distributed.init_process_group``. Ranks outside a
    (position) embedding group get None from its getter.

    Raises RuntimeError if torch.distributed is not initialised, if the world size is not
    divisible by ``tp*pp*cp`` (or by ``etp*ep*pp`` for experts), if a virtual pipeline size is
    given with pp <= 1, or if ``order`` omits an axis whose size is not 1; AssertionError if a
    group is already initialised (call ``destroy_model_parallel`` first).
    """
    global _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS
    global _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_GLOBAL_RANKS
    global _MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GLOBAL_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_GLOBAL_RANKS, _POSITION_EMBEDDING_GROUP, _POSITION_EMBEDDING_GLOBAL_RANKS
    global _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS
    global _DATA_PARALLEL_GROUP_WITH_CP, _DATA_PARALLEL_GROUP_WITH_CP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP
    global _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO
    global _INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    global _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_GLOBAL_RANKS
    global _TENSOR_AND_DATA_PARALLEL_GROUP, _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    global _TENSOR_AND_CONTEXT_PARALLEL_GROUP
    global _EXPERT_MODEL_PARALLEL_GROUP, _EXPERT_TENSOR_PARALLEL_GROUP, _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP
    global _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_GLOO
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first"
        )
    for name, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("num_distributed_optimizer_instances", num_distributed_optimizer_instances),
    ):
        if int(value) < 1:
            raise RuntimeError(f"{name} must be >= 1, got {value}")

    world_size = dist.get_world_size()
    rank = dist.get_rank()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    model_size = tp * pp * cp
    if world_size % model_size != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by {model_size} "
            f"(tensor {tp} x pipeline {pp} x context {cp} parallel sizes)"
        )
    dp = world_size // model_size
    if (dp * cp) % num_distributed_optimizer_instances != 0:
        raise RuntimeError(
            "Data parallel size should be divisible by partial DistOpt shard factor "
            f"(dp*cp = {dp * cp}, num_distributed_optimizer_instances = {num_distributed_optimizer_instances})"
        )

    if virtual_pipeline_model_parallel_size is not None:
        if not pp > 1:
            raise RuntimeError(
                "pipeline-model-parallel size should be greater than 1 with interleaved schedule "
                f"(pipeline_model_parallel_size={pp}, virtual_pipeline_model_parallel_size="
                f"{virtual_pipeline_model_parallel_size})"
            )
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    if pipeline_model_parallel_split_rank is not None:
        _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = pipeline_model_parallel_split_rank

    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    expert_tmp = etp * ep * pp
    if world_size % expert_tmp != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size ({expert_tmp})"
        )
    expert_dp = world_size // expert_tmp

    decoder_gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert_gen = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order)
    for dense_pp, expert_pp in zip(decoder_gen.get_ranks("pp"), expert_gen.get_ranks("pp")):
        assert dense_pp == expert_pp, (
            "Pipeline parallel groups are expected to be the same for Non-Expert and Expert part "
            f"({dense_pp} vs {expert_pp})"
        )

    groups = _GroupFactory(datetime.timedelta(minutes=distributed_timeout_minutes), create_gloo_process_groups)

    # Every rank walks the same rank lists in the same order, so the globally synchronised
    # dist.new_group calls inside the factory line up on all ranks. An axis of size 1 yields
    # lists equal to another axis' lists (or one-member lists), so it costs no new group.
    assert _DATA_PARALLEL_GROUP is None, "data parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("dp"):
        group, group_gloo = groups.get(ranks), groups.get_gloo(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS = group, group_gloo, ranks
    intra_size = (dp * cp) // num_distributed_optimizer_instances
    for ranks_with_cp in decoder_gen.get_ranks("dp-cp"):
        group, group_gloo = groups.get(ranks_with_cp), groups.get_gloo(ranks_with_cp)
        if rank in ranks_with_cp:
            _DATA_PARALLEL_GROUP_WITH_CP = group
            _DATA_PARALLEL_GROUP_WITH_CP_GLOO = group_gloo
            _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = ranks_with_cp
        if num_distributed_optimizer_instances > 1:
            # Partial distributed optimizer: consecutive chunks form the sharding groups and the
            # strided remainder connects the instances.
            for i in range(num_distributed_optimizer_instances):
                chunk = ranks_with_cp[i * intra_size:(i + 1) * intra_size]
                intra, intra_gloo = groups.get(chunk), groups.get_gloo(chunk)
                if rank in chunk:
                    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = intra
                    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = intra_gloo
            for i in range(intra_size):
                strided = ranks_with_cp[i::intra_size]
                inter = groups.get(strided)
                if rank in strided:
                    _INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = inter
        elif rank in ranks_with_cp:
            _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = group
            _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = group_gloo

    assert _CONTEXT_PARALLEL_GROUP is None, "context parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("cp"):
        group = groups.get(ranks)
        if rank in ranks:
            _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_GLOBAL_RANKS = group, ranks

    assert _MODEL_PARALLEL_GROUP is None, "model parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("tp-pp"):
        group = groups.get(ranks)
        if rank in ranks:
            _MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GLOBAL_RANKS = group, ranks

    assert _TENSOR_MODEL_PARALLEL_GROUP is None, "tensor model parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("tp"):
        group = groups.get(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = group, ranks

    assert _PIPELINE_MODEL_PARALLEL_GROUP is None, "pipeline model parallel group is already initialized"
    assert _EMBEDDING_GROUP is None, "embedding group is already initialized"
    assert _POSITION_EMBEDDING_GROUP is None, "position embedding group is already initialized"
    embedding_ranks_fn = get_embedding_ranks or default_embedding_ranks
    position_ranks_fn = get_position_embedding_ranks or default_position_embedding_ranks
    for ranks in decoder_gen.get_ranks("pp"):
        group = groups.get(ranks)
        if rank in ranks:
            _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_GLOBAL_RANKS = group, ranks
        # Only the members get the (position) embedding group: a middle stage holds no embedding
        # and must not be handed a group it cannot use (it sees None and is_rank_in_*() False).
        embedding_ranks = list(embedding_ranks_fn(ranks, _PIPELINE_MODEL_PARALLEL_SPLIT_RANK))
        group = groups.get(embedding_ranks)
        if rank in embedding_ranks:
            _EMBEDDING_GROUP, _EMBEDDING_GLOBAL_RANKS = group, embedding_ranks
        position_ranks = list(position_ranks_fn(ranks, _PIPELINE_MODEL_PARALLEL_SPLIT_RANK))
        group = groups.get(position_ranks)
        if rank in position_ranks:
            _POSITION_EMBEDDING_GROUP, _POSITION_EMBEDDING_GLOBAL_RANKS = group, position_ranks

    assert _TENSOR_AND_DATA_PARALLEL_GROUP is None, "Tensor + data parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("tp-dp-cp"):
        group = groups.get(ranks)
        if rank in ranks:
            _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = group
    for ranks in decoder_gen.get_ranks("tp-dp"):
        group = groups.get(ranks)
        if rank in ranks:
            _TENSOR_AND_DATA_PARALLEL_GROUP = group

    assert _TENSOR_AND_CONTEXT_PARALLEL_GROUP is None, "Tensor + context parallel group is already initialized"
    for ranks in decoder_gen.get_ranks("tp-cp"):
        group = groups.get(ranks)
        if rank in ranks:
            _TENSOR_AND_CONTEXT_PARALLEL_GROUP = group

    # Expert groups (an MoE layer's view of the same ranks). With ep == 1 and expert tp == tp
    # their rank lists are the dense ones, so they alias the dense groups.
    assert _EXPERT_MODEL_PARALLEL_GROUP is None, "Expert parallel group is already initialized"
    for ranks in expert_gen.get_ranks("ep"):
        group = groups.get(ranks)
        if rank in ranks:
            _EXPERT_MODEL_PARALLEL_GROUP = group
    assert _EXPERT_TENSOR_PARALLEL_GROUP is None, "Expert tensor model parallel group is already initialized"
    for ranks in expert_gen.get_ranks("tp"):
        group = groups.get(ranks)
        if rank in ranks:
            _EXPERT_TENSOR_PARALLEL_GROUP = group
    assert _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP is None, (
        "Expert tensor + model parallel group is already initialized"
    )
    for ranks in expert_gen.get_ranks("tp-ep"):
        group = groups.get(ranks)
        if rank in ranks:
            _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = group
    assert _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP is None, (
        "The expert_tensor_model_pipeline parallel group is already initialized"
    )
    for ranks in expert_gen.get_ranks("tp-ep-pp"):
        group = groups.get(ranks)
        if rank in ranks:
            _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = group
    assert _EXPERT_DATA_PARALLEL_GROUP is None, "Expert data group is already initialized"
    for ranks in expert_gen.get_ranks("dp"):
        group, group_gloo = groups.get(ranks), groups.get_gloo(ranks)
        if rank in ranks:
            _EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_GLOO = group, group_gloo


def is_initialized() -> bool:
    """True once initialize_model_parallel has built the data-parallel group."""
    return _DATA_PARALLEL_GROUP is not None


def model_parallel_is_initialized() -> bool:
    """True once the tensor, pipeline and data-parallel groups exist."""
    return not (
        _TENSOR_MODEL_PARALLEL_GROUP is None
        or _PIPELINE_MODEL_PARALLEL_GROUP is None
        or _DATA_PARALLEL_GROUP is None
    )


def _single_process() -> bool:
    # Without any process group (or with a 1-process world) every parallel size is 1, so
    # single-process tools and tests may use the getters without initialising groups.
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def _check(group, name: str, check_initialized: bool = True):
    if check_initialized:
        assert group is not None, f"{name} group is not initialized"
    return group


# ----------------------------------------------------------------------------------------------
# Group getters
# ----------------------------------------------------------------------------------------------
def get_model_parallel_group(check_initialized: bool = True):
    """Group of ranks holding one full model replica (tp x pp)."""
    return _check(_MODEL_PARALLEL_GROUP, "model parallel", check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True):
    """Tensor-model-parallel group of the calling rank."""
    return _check(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    """Pipeline-model-parallel group of the calling rank."""
    return _check(_PIPELINE_MODEL_PARALLEL_GROUP, "pipeline_model parallel", check_initialized)


def get_context_parallel_group(check_initialized: bool = True):
    """Context-parallel group of the calling rank."""
    return _check(_CONTEXT_PARALLEL_GROUP, "context parallel", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True):
    """Global ranks of the calling rank's context-parallel group."""
    return _check(_CONTEXT_PARALLEL_GLOBAL_RANKS, "context parallel", check_initialized)


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """Data-parallel group; ``with_context_parallel`` gives the dp-cp group used for grad reduction.

    ``partial_data_parallel`` (requires ``with_context_parallel``) gives the intra-instance group of a
    partial distributed optimizer.
    """
    if with_context_parallel:
        if partial_data_parallel:
            return _check(_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, "Intra partial data parallel")
        return _check(_DATA_PARALLEL_GROUP_WITH_CP, "data parallel with context parallel")
    assert not partial_data_parallel, "Partial DP for Optimizer needs to include CP"
    return _check(_DATA_PARALLEL_GROUP, "data parallel")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """Gloo copy of the data-parallel group (for CPU-side collectives, e.g. checkpoint sharding)."""
    if with_context_parallel:
        if partial_data_parallel:
            return _check(_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO, "Intra partial data parallel-gloo")
        return _check(_DATA_PARALLEL_GROUP_WITH_CP_GLOO, "data parallel with context parallel-gloo")
    assert not partial_data_parallel, "Partial DP for Optimizer needs to include CP"
    return _check(_DATA_PARALLEL_GROUP_GLOO, "data parallel-gloo")


def get_inter_partial_data_parallel_group():
    """Group connecting the instances of a partial distributed optimizer."""
    return _check(_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, "Inter partial data parallel")


def get_embedding_group(check_initialized: bool = True):
    """Group of ranks holding (tied) word embeddings: first and last pipeline stage.

    None on a rank outside it (a middle pipeline stage); see ``is_rank_in_embedding_group``.
    """
    if _EMBEDDING_GROUP is None and _PIPELINE_MODEL_PARALLEL_GROUP is not None:
        return None
    return _check(_EMBEDDING_GROUP, "embedding", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    """Group of ranks holding position embeddings: the first pipeline stage (None on other ranks)."""
    if _POSITION_EMBEDDING_GROUP is None and _PIPELINE_MODEL_PARALLEL_GROUP is not None:
        return None
    return _check(_POSITION_EMBEDDING_GROUP, "position embedding", check_initialized)


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    """Group spanning tp x dp (x cp when ``with_context_parallel``)."""
    if with_context_parallel:
        return _check(_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP, "tensor and data parallel with context parallel")
    return _check(_TENSOR_AND_DATA_PARALLEL_GROUP, "tensor and data parallel")


def get_tensor_and_context_parallel_group():
    """Group spanning tp x cp."""
    return _check(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, "tensor and context parallel")


def get_expert_model_parallel_group(check_initialized: bool = True):
    """Expert-parallel group (a single rank when expert_model_parallel_size is 1)."""
    return _check(_EXPERT_MODEL_PARALLEL_GROUP, "expert model parallel", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    """Tensor-parallel group used inside expert layers (equals the dense tp group by default)."""
    return _check(_EXPERT_TENSOR_PARALLEL_GROUP, "Expert tensor parallel", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    """Group spanning expert tp x ep."""
    return _check(_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, "Expert tensor and model parallel", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True):
    """Group spanning expert tp x ep x pp."""
    return _check(
        _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP, "Expert tensor-model-pipeline parallel", check_initialized
    )


def get_expert_data_parallel_group(check_initialized: bool = True):
    """Data-parallel group of expert parameters."""
    return _check(_EXPERT_DATA_PARALLEL_GROUP, "Expert data parallel", check_initialized)


def get_expert_data_parallel_group_gloo():
    """Gloo copy of the expert data-parallel group."""
    return _check(_EXPERT_DATA_PARALLEL_GROUP_GLOO, "Expert data parallel-gloo")


# ----------------------------------------------------------------------------------------------
# Sizes and ranks
# ----------------------------------------------------------------------------------------------
def _group_size(group, name: str) -> int:
    if group is None and _single_process():
        return 1
    return dist.get_world_size(group=_check(group, name))


def _group_rank(group, name: str) -> int:
    if group is None and _single_process():
        return 0
    return dist.get_rank(group=_check(group, name))


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the tensor-parallel world size reported by the getter (None clears)."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the tensor-parallel rank reported by the getter (None clears)."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the pipeline-parallel world size reported by the getter (None clears)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the pipeline-parallel rank reported by the getter (None clears)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_RANK
    _MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in the tensor-parallel group (1 in a single process without groups)."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return _group_size(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel")


def get_tensor_model_parallel_rank() -> int:
    """Rank within the tensor-parallel group (0 in a single process without groups)."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return _group_rank(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in the caller's group."""
    if _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS is None and _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    return _check(_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, "tensor model parallel")[0]


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages (1 in a single process without groups)."""
    if _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    return _group_size(_PIPELINE_MODEL_PARALLEL_GROUP, "pipeline_model parallel")


def get_pipeline_model_parallel_rank() -> int:
    """Pipeline stage index of the calling rank (0 in a single process without groups)."""
    if _MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_RANK
    return _group_rank(_PIPELINE_MODEL_PARALLEL_GROUP, "pipeline_model parallel")


def _pipeline_global_ranks() -> List[int]:
    if _PIPELINE_GLOBAL_RANKS is None and _single_process():
        return [dist.get_rank() if dist.is_initialized() else 0]
    assert _PIPELINE_GLOBAL_RANKS is not None, "Pipeline parallel group is not initialized"
    return _PIPELINE_GLOBAL_RANKS


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first pipeline stage in the caller's pipeline."""
    return _pipeline_global_ranks()[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last pipeline stage in the caller's pipeline."""
    return _pipeline_global_ranks()[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (wraps around from the last to the first)."""
    ranks = _pipeline_global_ranks()
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous pipeline stage (wraps around from the first to the last)."""
    ranks = _pipeline_global_ranks()
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    """Legacy encoder/decoder split rank, or None."""
    return _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def set_pipeline_model_parallel_split_rank(rank: Optional[int]) -> None:
    """Set the legacy encoder/decoder split rank."""
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = rank


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """Current virtual (interleaved) pipeline stage, or None without interleaving."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Set the current virtual pipeline stage (schedules switch it per model chunk)."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Number of model chunks per pipeline stage, or None without interleaving."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Set the number of model chunks per pipeline stage."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the first pipeline stage; with ``ignore_virtual=False`` also requires virtual stage 0.

    ``vp_stage`` defaults to the current virtual rank set by ``set_virtual_pipeline_model_parallel_rank``.
    """
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        stage = vp_stage if vp_stage is not None else get_virtual_pipeline_model_parallel_rank()
        assert stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline stage; with ``ignore_virtual=False`` also requires the last virtual stage."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        stage = vp_stage if vp_stage is not None else get_virtual_pipeline_model_parallel_rank()
        assert stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if stage != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def _embedding_ranks_or_self(ranks: Optional[List[int]], rank: int) -> List[int]:
    # Before initialize_model_parallel a process counts as the whole (one-stage) pipeline; after
    # it, no recorded ranks means this rank is not a member.
    if ranks is not None:
        return ranks
    return [] if _PIPELINE_MODEL_PARALLEL_GROUP is not None else [rank]


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True if this rank holds a copy of the word embeddings that must be kept in sync."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = _embedding_ranks_or_self(_EMBEDDING_GLOBAL_RANKS, rank)
    if rank not in ranks:
        return False
    if ignore_virtual:
        return True
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    """True if this rank holds position embeddings."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank in _embedding_ranks_or_self(_POSITION_EMBEDDING_GLOBAL_RANKS, rank)


def get_data_parallel_world_size(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Number of data-parallel replicas (x cp when ``with_context_parallel``); 1 without groups."""
    if _DATA_PARALLEL_GROUP is None and _single_process():
        return 1
    return dist.get_world_size(group=get_data_parallel_group(with_context_parallel, partial_data_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    """Rank within the data-parallel group; 0 without groups."""
    if _DATA_PARALLEL_GROUP is None and _single_process():
        return 0
    return dist.get_rank(group=get_data_parallel_group(with_context_parallel, partial_data_parallel))


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of data-parallel rank 0 in the caller's group."""
    ranks = _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP if with_context_parallel else _DATA_PARALLEL_GLOBAL_RANKS
    if ranks is None and _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    assert ranks is not None, "Data parallel group is not initialized"
    return ranks[0]


def get_context_parallel_world_size() -> int:
    """Number of context-parallel ranks (1 without groups)."""
    return _group_size(_CONTEXT_PARALLEL_GROUP, "context parallel")


def get_context_parallel_rank() -> int:
    """Rank within the context-parallel group (0 without groups)."""
    return _group_rank(_CONTEXT_PARALLEL_GROUP, "context parallel")


def get_tensor_and_context_parallel_world_size() -> int:
    """Size of the tp x cp group."""
    return _group_size(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, "tensor and context parallel")


def get_tensor_and_context_parallel_rank() -> int:
    """Rank within the tp x cp group."""
    return _group_rank(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, "tensor and context parallel")


def get_tensor_and_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Size of the tp x dp (x cp) group."""
    group = _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP if with_context_parallel else _TENSOR_AND_DATA_PARALLEL_GROUP
    return _group_size(group, "tensor and data parallel")


def get_tensor_and_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank within the tp x dp (x cp) group."""
    group = _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP if with_context_parallel else _TENSOR_AND_DATA_PARALLEL_GROUP
    return _group_rank(group, "tensor and data parallel")


def get_model_parallel_world_size() -> int:
    """Size of the tp x pp group."""
    return _group_size(_MODEL_PARALLEL_GROUP, "model parallel")


def get_model_parallel_src_rank() -> int:
    """Global rank of the first member of the caller's model-parallel group."""
    if _MODEL_PARALLEL_GLOBAL_RANKS is None and _single_process():
        return dist.get_rank() if dist.is_initialized() else 0
    return _check(_MODEL_PARALLEL_GLOBAL_RANKS, "model parallel")[0]


def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the expert-parallel world size reported by the getter (None clears)."""
    global _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the expert-parallel rank reported by the getter (None clears)."""
    global _MPU_EXPERT_MODEL_PARALLEL_RANK
    _MPU_EXPERT_MODEL_PARALLEL_RANK = rank


def get_expert_model_parallel_world_size() -> int:
    """Number of expert-parallel ranks (1 for dense models)."""
    if _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    return _group_size(_EXPERT_MODEL_PARALLEL_GROUP, "expert model parallel")


def get_expert_model_parallel_rank() -> int:
    """Rank within the expert-parallel group (0 for dense models)."""
    if _MPU_EXPERT_MODEL_PARALLEL_RANK is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_RANK
    return _group_rank(_EXPERT_MODEL_PARALLEL_GROUP, "expert model parallel")


def get_expert_tensor_parallel_world_size() -> int:
    """Tensor-parallel size inside expert layers."""
    return _group_size(_EXPERT_TENSOR_PARALLEL_GROUP, "Expert tensor parallel")


def get_expert_tensor_parallel_rank() -> int:
    """Tensor-parallel rank inside expert layers."""
    return _group_rank(_EXPERT_TENSOR_PARALLEL_GROUP, "Expert tensor parallel")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    """Size of the expert tp x ep group."""
    return _group_size(_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, "Expert tensor and model parallel")


def get_expert_tensor_and_model_parallel_rank() -> int:
    """Rank within the expert tp x ep group."""
    return _group_rank(_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, "Expert tensor and model parallel")


def get_expert_data_parallel_world_size() -> int:
    """Data-parallel size of expert parameters."""
    return _group_size(_EXPERT_DATA_PARALLEL_GROUP, "Expert data parallel")


def get_expert_data_parallel_rank() -> int:
    """Data-parallel rank of expert parameters."""
    return _group_rank(_EXPERT_DATA_PARALLEL_GROUP, "Expert data parallel")


def destroy_model_parallel() -> None:
    """Forget every group and override so initialize_model_parallel may be called again.

    The underlying process groups are not destroyed here; ``torch.distributed.destroy_process_group()``
    on the default group releases them all.
    """
    names = [
        "_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
        "_PIPELINE_MODEL_PARALLEL_GROUP", "_PIPELINE_GLOBAL_RANKS",
        "_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GLOBAL_RANKS",
        "_EMBEDDING_GROUP", "_EMBEDDING_GLOBAL_RANKS",
        "_POSITION_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GLOBAL_RANKS",
        "_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GLOBAL_RANKS",
        "_DATA_PARALLEL_GROUP_WITH_CP", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS",
        "_TENSOR_AND_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
        "_EXPERT_MODEL_PARALLEL_GROUP", "_EXPERT_TENSOR_PARALLEL_GROUP",
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
        "_PIPELINE_MODEL_PARALLEL_SPLIT_RANK",
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    ]
    module_globals = globals()
    for name in names:
        module_globals[name] = None

