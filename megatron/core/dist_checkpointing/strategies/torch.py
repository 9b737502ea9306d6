"""Megatron-LM's ``MCoreSavePlan`` under its pickled name, so a Megatron-written ``.metadata`` can be read.

Megatron core_v0.14 keeps every rank's save plan in ``Metadata.all_local_plans`` (a cache for later
saves); unpickling the metadata needs a class of this module path and name. Only the fields are
needed here: this project never uses the cached plans.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from torch.distributed.checkpoint.planner import SavePlan


@dataclasses.dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """A torch SavePlan plus Megatron's per-tensor data (``{key: {'nd_reformulated_orig_global_shape': shape}}``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


__all__ = ["MCoreSavePlan"]
