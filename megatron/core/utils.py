"""Helpers that look through model wrappers (DDP, Float16Module, ...) to the model they wrap."""
from typing import Any, List, Optional, Sequence, Tuple, Type, Union

import torch

from megatron.core.transformer.context_parallel import batch as _cp_batch

# Megatron-LM's home of the context-parallel batch split (it lives in transformer/context_parallel/batch.py).
get_batch_on_this_cp_rank = _cp_batch.get_batch_on_this_cp_rank


def get_attr_wrapped_model(model: Any, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """Find ``attr`` on ``model`` or on the first object down its ``.module`` chain that has it.

    Args:
        model: a module, possibly wrapped (DDP, Float16Module, ...), or a one-element list of them.
        attr: attribute name to look up.
        allow_none: when False an attribute whose value is None does not count as found.
        return_model_obj: return the object that carries ``attr`` instead of the attribute's value.

    Raises:
        RuntimeError: a list with more than one model chunk is given (the caller must pick a chunk).
        AttributeError: no object in the ``.module`` chain carries ``attr``.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise RuntimeError(
                f"get_attr_wrapped_model({attr!r}) got {len(model)} model chunks; pass a single chunk"
            )
        model = model[0]
    current = model
    while True:
        if hasattr(current, attr) and (allow_none or getattr(current, attr) is not None):
            return current if return_model_obj else getattr(current, attr)
        inner = getattr(current, "module", None)
        if inner is None:
            raise AttributeError(
                f"{type(model).__name__} and the modules it wraps have no attribute {attr!r}"
            )
        current = inner


def get_model_config(model: Any):
    """The ``.config`` (a ModelParallelConfig / TransformerConfig) of a possibly wrapped model.

    Raises:
        AttributeError: no object in the ``.module`` chain carries a non-None ``config``.
    """
    return get_attr_wrapped_model(model, "config", allow_none=False)


def unwrap_model(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    module_instances: Optional[Tuple[Type, ...]] = None,
) -> Union[torch.nn.Module, List[torch.nn.Module]]:
    """Strip wrapper modules and return the innermost model (or a list of them for a list input).

    Args:
        model: one module or a list of model chunks.
        module_instances: wrapper classes to strip. Default: any object whose ``.module`` is a
            ``torch.nn.Module``, i.e. Megatron's and torch's DistributedDataParallel, Float16Module
            and any other wrapper (matched by that attribute rather than by class, so this module
            needs no import of megatron.core.distributed, which imports it).
    """
    return_list = isinstance(model, (list, tuple))
    chunks = list(model) if return_list else [model]
    unwrapped = []
    for chunk in chunks:
        if module_instances is None:
            while isinstance(getattr(chunk, "module", None), torch.nn.Module):
                chunk = chunk.module
        else:
            while isinstance(chunk, tuple(module_instances)):
                chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if return_list else unwrapped[0]
