"""The process groups a model uses (Megatron core_v0.14's ModelCommProcessGroups) and their check against its config.

``ModelCommProcessGroups.use_mpu_process_groups()`` is a view of the groups ``parallel_state`` built;
``GPTModel(..., model_comm_pgs=None)`` takes that default. The layers still read ``parallel_state``,
so this object is the one seam where a model meets its groups: ``check_parallel_config`` refuses a
``TransformerConfig`` whose tensor- or pipeline-parallel size differs from its groups', which would
otherwise build silently with wrongly sized shards. New parallelisms add their groups here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron.core import parallel_state

__all__ = ["ModelCommProcessGroups", "ParallelConfigMismatchError", "check_parallel_config"]


class ParallelConfigMismatchError(ValueError):
    """A model's config names a parallel size its process groups do not have.

    Reported as one ``error:`` line without a traceback (``megatron.training.user_errors``): the
    sizes are the same on every rank, so every rank raises it alike and rank 0 alone prints it.
    """

    exit_status = 1
    same_on_every_rank = True


def _tp_cp_group():
    # The only getter here without check_initialized: it asserts, so ask it only once groups exist.
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_and_context_parallel_group()


# Field name -> the parallel_state getter of that group (None before initialize_model_parallel).
_MPU_GETTERS: Dict[str, Callable[[], object]] = {
    "tp": lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False),
    "pp": lambda: parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    "mp": lambda: parallel_state.get_model_parallel_group(check_initialized=False),
    "embd": lambda: parallel_state.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    "cp": lambda: parallel_state.get_context_parallel_group(check_initialized=False),
    "tp_cp": _tp_cp_group,
    "ep": lambda: parallel_state.get_expert_model_parallel_group(check_initialized=False),
    "expt_tp": lambda: parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    "tp_ep": lambda: parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
    "tp_ep_pp": lambda: parallel_state.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
    "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(check_initialized=False),
}


@dataclasses.dataclass
class ModelCommProcessGroups:
    """The process groups one model uses, under Megatron core_v0.14's field names.

    ``tp`` tensor-parallel, ``pp`` pipeline-parallel, ``mp`` tp x pp (one model replica), ``embd``
    the ranks holding (tied) word embeddings, ``pos_embd`` the ranks holding position embeddings,
    ``cp`` context-parallel, ``tp_cp`` tp x cp, ``ep`` expert-parallel, ``expt_tp`` the tensor-parallel
    group inside expert layers, ``tp_ep`` expt_tp x ep, ``tp_ep_pp`` expt_tp x ep x pp, ``expt_dp``
    the data-parallel group of expert parameters. ``None``: not built (a single process without
    groups, where every size is 1, or a rank outside ``embd``/``pos_embd``). Megatron's ``hcp``
    (hierarchical context parallelism) has no group in this project yet.
    """

    tp: Optional[object] = None
    pp: Optional[object] = None
    mp: Optional[object] = None
    embd: Optional[object] = None
    pos_embd: Optional[object] = None
    cp: Optional[object] = None
    tp_cp: Optional[object] = None
    ep: Optional[object] = None
    expt_tp: Optional[object] = None
    tp_ep: Optional[object] = None
    tp_ep_pp: Optional[object] = None
    expt_dp: Optional[object] = None

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[List[str]] = None) -> "ModelCommProcessGroups":
        """The groups ``parallel_state`` holds now: all fields, or only those named in ``required_pgs``
        (the others stay None).

        Raises:
            ValueError: ``required_pgs`` names a field this class does not have (listing the valid ones).
        """
        names = list(_MPU_GETTERS) if required_pgs is None else list(required_pgs)
        unknown = [name for name in names if name not in _MPU_GETTERS]
        if unknown:
            raise ValueError(f"unknown process group(s) {unknown}; valid choices: {', '.join(_MPU_GETTERS)}")
        return cls(**{name: _MPU_GETTERS[name]() for name in names})


def _size_seen_by_layers(group, mpu_group, mpu_size: Callable[[], int]) -> int:
    """The number of ranks in ``group`` as the model's layers will count them.

    The layers read ``parallel_state``, whose size getters also honour its ``set_*_world_size``
    overrides (converters build a model for a rank they are not) and answer 1 in a single process
    without groups: that answer counts for parallel_state's own group (or None); another group
    counts its members.
    """
    if group is None or group is mpu_group:
        return mpu_size()
    return dist.get_world_size(group=group)


def check_parallel_config(config, pgs: ModelCommProcessGroups) -> None:
    """Refuse ``config`` (a ``TransformerConfig``) when its tensor-, pipeline- or context-parallel size is
    not the size of the matching group of ``pgs``.

    Raises:
        ParallelConfigMismatchError: one line naming the config field, both sizes and the fix.
    """
    checks = (
        ("tensor_model_parallel_size", "tensor-parallel", pgs.tp,
         parallel_state.get_tensor_model_parallel_group(check_initialized=False),
         parallel_state.get_tensor_model_parallel_world_size),
        ("pipeline_model_parallel_size", "pipeline-parallel", pgs.pp,
         parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
         parallel_state.get_pipeline_model_parallel_world_size),
        ("context_parallel_size", "context-parallel", pgs.cp,
         parallel_state.get_context_parallel_group(check_initialized=False),
         parallel_state.get_context_parallel_world_size),
    )
    for field, label, group, mpu_group, mpu_size in checks:
        wanted = int(getattr(config, field))
        actual = _size_seen_by_layers(group, mpu_group, mpu_size)
        if wanted != actual:
            raise ParallelConfigMismatchError(
                f"{type(config).__name__}.{field}={wanted} but the {label} group has {actual} rank(s): "
                "build the model after initializing model parallel with the same size"
            )
