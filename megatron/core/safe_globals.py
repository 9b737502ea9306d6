"""The non-tensor types a checkpoint may hold (Megatron core_v0.14's ``SAFE_GLOBALS``) and a scoped context admitting them.

Unlike Megatron-LM's ``register_safe_globals`` (``torch.serialization.add_safe_globals``, process-wide),
:func:`safe_globals` admits them only for the loads inside its ``with`` block.
"""
import argparse
import pathlib
import types

import numpy as np
import torch

from megatron.core.transformer.enums import AttnBackend, ModelType

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

# The args Namespace and the plain types and enums Megatron-LM (core_v0.14.0) stores in it, and numpy's RNG
# state pieces. Megatron-LM's ``megatron.core.enums.ModelType`` is read as this package's ModelType (same
# values for GPT); AttnBackend has the same import path in both packages.
SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, _reconstruct, np.ndarray, np.dtype,
                AttnBackend, ModelType, (ModelType, "megatron.core.enums.ModelType")]
_UINT32_DTYPE = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
if _UINT32_DTYPE is not None:  # numpy >= 1.25 pickles dtypes through their classes
    SAFE_GLOBALS.append(_UINT32_DTYPE)


def safe_globals():
    """A context in which weights-only ``torch.load`` admits :data:`SAFE_GLOBALS` (and nothing else extra)."""
    return torch.serialization.safe_globals(list(SAFE_GLOBALS))


__all__ = ["SAFE_GLOBALS", "safe_globals"]
