"""Megatron's span groups: the base groups plus the training framework's own, and its presets."""
from __future__ import annotations

from typing import ClassVar, Dict, Tuple

from .groups import SpanGroup

__all__ = ["MegatronSpanGroup"]

_DEFAULT = ("job", "checkpoint", "evaluate", "first_iteration", "inference")


class MegatronSpanGroup(SpanGroup):
    """Span groups of this framework (spec section 3).

    Presets: ``default`` = job, checkpoint, evaluate, first_iteration, inference; ``per_step`` =
    default + model_init, load_checkpoint, step, forward_backward, optimizer, communication,
    data_loading; ``all`` (aliases ``full``, ``profiling``) = every group.
    """

    MICROBATCH = "microbatch"
    LAYER = "layer"
    COMMUNICATION = "communication"
    ACTIVATION_OFFLOAD = "activation_offload"
    DATA_LOADING = "data_loading"
    FIRST_ITERATION = "first_iteration"
    TRACE_REGION = "trace_region"
    INFERENCE = "inference"

    PRESETS: ClassVar[Dict[str, Tuple[str, ...]]] = {
        "default": _DEFAULT,
        "per_step": _DEFAULT + (
            "model_init", "load_checkpoint", "step", "forward_backward", "optimizer",
            "communication", "data_loading",
        ),
    }
