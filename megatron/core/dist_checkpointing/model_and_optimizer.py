"""The sharded state of a GPT model and its optimizer, keyed by global names that do not depend on the layout.

Keys:
  * model tensors: the module's state-dict names with the pipeline stage's local layer index
    replaced by the global one (``decoder.layers.<layer_number - 1>.``), also for interleaved
    virtual stages; the last stage's tied output weight is a replica of ``embedding.word_embeddings.weight``;
  * optimizer tensors: ``optimizer.state.<model key>.<name>`` with ``name`` ``exp_avg`` /
    ``exp_avg_sq`` (Adam), ``momentum_buffer`` (SGD) and ``fp32_param`` (the fp32 main copy of an
    fp16/bf16 parameter), each sharded like its parameter, whether the optimizer is distributed
    (a flat range of the parameter per data-parallel rank) or not (the whole local parameter).

Tensor-parallel parameters carry their global shape and offsets (``partition_dim`` and
``partition_stride`` attributes); the vocabulary dimension of the embedding and output weights
may differ between layouts (padding to a multiple of ``--make-vocab-size-divisible-by`` x TP), so
those keys allow a shape mismatch in dimension 0. Scalars (Adam's step, hyper-parameters, the grad
scaler) are not sharded: see :func:`optimizer_common_state`.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    TPLayout,
    sharded_tensors_of_flat_range,
    sharded_tensors_of_local,
)

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _layer_numbers(chunk: torch.nn.Module) -> Dict[int, int]:
    """{local layer index: 0-based global layer index} of this chunk's decoder."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None:
        return {}
    return {index: int(getattr(layer, "layer_number", index + 1)) - 1 for index, layer in enumerate(layers)}


def global_key(chunk: torch.nn.Module, name: str, numbers: Optional[Dict[int, int]] = None) -> Tuple[str, bool]:
    """``(layout-independent key, is a replica saved elsewhere)`` of state-dict entry ``name`` of the
    (unwrapped) model chunk ``chunk``."""
    numbers = _layer_numbers(chunk) if numbers is None else numbers
    match = _LAYER.match(name)
    if match is not None:
        name = f"decoder.layers.{numbers[int(match.group(1))]}." + name[match.end():]
    if (name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False)
            and not getattr(chunk, "pre_process", True)):
        # Tied weights over pipeline stages: the last stage holds a synchronized copy of the first
        # stage's embedding, which the first stage saves.
        return "embedding.word_embeddings.weight", True
    return name, False


def _layout(tensor: torch.Tensor) -> TPLayout:
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if getattr(tensor, "tensor_model_parallel", False) and tp_size > 1:
        dim = int(getattr(tensor, "partition_dim", 0))
        return TPLayout(tuple(tensor.shape), dim, int(getattr(tensor, "partition_stride", 1)), tp_rank, tp_size)
    return TPLayout(tuple(tensor.shape), None, 1, tp_rank, tp_size)


def param_keys_and_layouts(model_chunks) -> Dict[torch.Tensor, Tuple[str, TPLayout, bool, bool]]:
    """{parameter: (global key, tensor-parallel layout, allow vocabulary shape mismatch, replica)} over all chunks."""
    out = {}
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        numbers = _layer_numbers(chunk)
        for name, param in chunk.named_parameters():
            key, replica = global_key(chunk, name, numbers)
            out.setdefault(param, (key, _layout(param), key in VOCAB_KEYS, replica))
    return out


def model_sharded_state(model_chunks) -> List[ShardedTensor]:
    """Every tensor of the state dicts of ``model_chunks`` (wrapped or not) as sharded tensors (views)."""
    out = []
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        numbers = _layer_numbers(chunk)
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"model state {name!r} is a {type(tensor).__name__}, not a tensor: the torch_dist "
                                "format stores tensors only")
            key, replica = global_key(chunk, name, numbers)
            out.extend(sharded_tensors_of_local(key, tensor.detach(), _layout(tensor), key in VOCAB_KEYS, replica))
    return out


# ---------------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------------

def _is_distributed(optimizer) -> bool:
    return hasattr(optimizer, "pieces") and hasattr(optimizer, "pieces_by_group")


def _model_params_of_main(optimizer) -> Dict[torch.Tensor, torch.Tensor]:
    """{main param the inner optimizer steps: model param} for the non-distributed wrappers."""
    mapping = {}
    for model_group, main_group in zip(getattr(optimizer, "float16_groups", []),
                                       getattr(optimizer, "fp32_from_float16_groups", [])):
        for model_param, main_param in zip(model_group, main_group):
            mapping[main_param] = model_param
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            mapping.setdefault(param, param)
    return mapping


def _state_tensors(state: Dict, like: torch.Tensor) -> Dict[str, torch.Tensor]:
    return {name: value for name, value in state.items()
            if name != "step" and isinstance(value, torch.Tensor) and value.shape == like.shape}


def ensure_optimizer_state(optimizer) -> None:
    """Allocate the optimizer's per-parameter state (zeros) where none exists yet, so a load can fill it.

    Adam: ``exp_avg`` / ``exp_avg_sq`` through the optimizer's ``init_state_fn``; SGD with momentum:
    a zero ``momentum_buffer`` (equivalent to torch's lazily created buffer without dampening).
    """
    inner = optimizer.optimizer
    optimizer.init_state_fn(inner)
    for group in inner.param_groups:
        if isinstance(inner, torch.optim.SGD) and group.get("momentum", 0):
            for param in group["params"]:
                if inner.state[param].get("momentum_buffer") is None:
                    inner.state[param]["momentum_buffer"] = torch.zeros_like(param.detach())


def optimizer_sharded_state(model_chunks, optimizer) -> List[ShardedTensor]:
    """The optimizer's per-parameter tensors as sharded tensors (views of the live state)."""
    info = param_keys_and_layouts(model_chunks)
    inner = optimizer.optimizer
    out = []
    if _is_distributed(optimizer):
        for piece in optimizer.pieces():
            key, layout, mismatch, replica = info[piece.model_param]
            shape = tuple(piece.model_param.shape)
            tensors = dict(_state_tensors(inner.state.get(piece.main_param, {}), piece.main_param))
            if piece.is_copy:
                tensors["fp32_param"] = piece.main_param.detach()
            for name, tensor in sorted(tensors.items()):
                out.extend(sharded_tensors_of_flat_range(f"optimizer.state.{key}.{name}", tensor, shape,
                                                         piece.param_start, layout, mismatch, replica))
        return out
    for main_param, model_param in _model_params_of_main(optimizer).items():
        if model_param not in info:
            raise KeyError("an optimizer parameter does not belong to the model chunks being saved")
        key, layout, mismatch, replica = info[model_param]
        tensors = dict(_state_tensors(inner.state.get(main_param, {}), main_param))
        if main_param is not model_param:
            tensors["fp32_param"] = main_param.detach()
        for name, tensor in sorted(tensors.items()):
            layout_of_main = TPLayout(tuple(tensor.shape), layout.partition_dim, layout.stride, layout.tp_rank,
                                      layout.tp_size)
            out.extend(sharded_tensors_of_local(f"optimizer.state.{key}.{name}", tensor.detach(), layout_of_main,
                                                mismatch, replica))
    return out


def _group_steps(optimizer) -> List[Optional[float]]:
    """Adam's step per param group (None for a group without state here, e.g. no piece on this rank)."""
    inner = optimizer.optimizer
    steps = []
    for group in inner.param_groups:
        values = [float(inner.state[p]["step"]) for p in group["params"] if "step" in inner.state.get(p, {})]
        steps.append(max(values) if values else None)
    return steps


def optimizer_common_state(optimizer) -> Dict:
    """The optimizer's unsharded state: hyper-parameters and Adam's step per param group, the grad scaler.

    ``{'param_groups': [{hyper-parameters..., 'step': float or None}], 'grad_scaler'?: {...}}``;
    the same on every rank, so rank 0 writes it.
    """
    groups = []
    for group, step in zip(optimizer.optimizer.param_groups, _group_steps(optimizer)):
        saved = {k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
        saved["step"] = step
        groups.append(saved)
    state = {"param_groups": groups}
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None:
        state["grad_scaler"] = scaler.state_dict()
    return state


def load_optimizer_common_state(optimizer, state: Dict, source: str) -> None:
    """Restore :func:`optimizer_common_state` output; Adam's step goes to every param with state.

    Call after the sharded tensors were loaded (the state entries exist then). Raises ValueError
    naming ``source`` when the number of param groups differs.
    """
    inner = optimizer.optimizer
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        raise ValueError(f"{source}: the checkpoint's optimizer has {len(saved_groups)} param groups, this "
                         f"optimizer has {len(inner.param_groups)} (a different model or weight-decay rule)")
    known = [g.get("step") for g in saved_groups if g.get("step") is not None]
    fallback = max(known) if known else None
    for group, saved in zip(inner.param_groups, saved_groups):
        for key, value in saved.items():
            if key not in ("params", "step"):
                group[key] = value
        step = saved.get("step", fallback)
        step = fallback if step is None else step
        if step is None:
            continue
        for param in group["params"]:
            entry = inner.state.get(param)
            if entry and any(isinstance(v, torch.Tensor) and k != "step" for k, v in entry.items()):
                entry["step"] = torch.tensor(float(step), dtype=torch.float32)
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and "grad_scaler" in state:
        scaler.load_state_dict(state["grad_scaler"])
