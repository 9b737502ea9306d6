"""The GPT model's torch_dist checkpoint keys (Megatron-LM core_v0.14's layout) and its sharded state.

Keys (the layout ``megatron.core`` 0.14 writes for a local-spec GPT, docs/megatron-checkpoints.md):
a model tensor's key is its module state-dict name; a transformer layer's tensors are stacked over
the layers under one key with a leading layer axis of size ``num_layers``
(``decoder.layers.self_attention.linear_qkv.weight`` of global shape ``[num_layers, 3h, h]``), each
pipeline stage (and interleaved chunk) writing the slices of its global layer indices; the layer
norms take the local spec's checkpoint names (``input_layernorm.*`` ->
``self_attention.linear_qkv.layer_norm_*``, ``pre_mlp_layernorm.*`` -> ``mlp.linear_fc1.layer_norm_*``);
a layer's linear ``_extra_state`` is a pickled object under
``decoder.layers.<module>._extra_state/shard_<layer>_<num_layers>``; the last stage's tied output
weight is a replica of ``embedding.word_embeddings.weight``. Model tensors are global, so a load
reshards them. Checkpoints of this project's earlier per-layer layout (``decoder.layers.<i>.<name>``,
``optimizer.state.<key>.<name>``) load too.

Mixture of experts (Megatron core_v0.14, ``SequentialMLP.sharded_state_dict``, spec megatron-scale 3.6): local
expert ``j`` of expert-parallel rank ``e`` (``decoder.layers.<i>.mlp.experts.local_experts.<j>.<name>``) is
global expert ``e * E_loc + j`` on a second leading axis of size ``num_moe_experts`` under
``decoder.layers.mlp.experts.experts.<name>`` (``[L, E, 2F|F, H]`` for fc1, the expert-tensor-parallel split on the
axis after it, with the gated ``[gate; up]`` layout of the dense fc1); the router (``mlp.router.weight`` [L, E, H],
``mlp.router.expert_bias`` [L, E]) and the shared experts (``mlp.shared_experts.*``) are layer entries as any
other. When the layers differ (``moe_layer_freq`` above 1 or a list), every layer entry has its own key
``decoder.layers.<g>.<name>`` (``g`` the 0-based global layer) and no layer axis.

The optimizer's tensors, keyed after these (``optimizer.state.<name>.<model key>``), are in
:mod:`megatron.core.dist_checkpointing.optimizer`.
"""
from __future__ import annotations

import dataclasses
import io
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    TPLayout,
    flat_range_boxes,
    sharded_tensors_of_local,
)


class UnsupportedCheckpointLayoutError(CheckpointingException, NotImplementedError):
    """A model part without a torch_dist mapping here (the message names the flag that builds it)."""


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
# Optimizer keys are a model key behind this prefix; here because is_per_layer_layout reads both kinds.
OPTIMIZER_PREFIX = "optimizer.state."
LAYER_PREFIX = "decoder.layers."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# A SequentialMLP's local expert inside a layer, and its checkpoint name (the expert index becomes an axis).
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
EXPERTS_PREFIX = "mlp.experts.experts."
_GROUPED_EXPERTS = re.compile(r"^mlp\.experts\.weight[12]$")
# Local-spec layer norms under the names Megatron's checkpoints give them (fused-norm style).
_NORM_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def checkpoint_layer_name(name: str) -> str:
    """A layer-relative module state-dict name -> its checkpoint name (``input_layernorm.weight`` ->
    ``self_attention.linear_qkv.layer_norm_weight``); other names are unchanged."""
    for module_prefix, ckpt_prefix in _NORM_NAMES:
        if name.startswith(module_prefix):
            return ckpt_prefix + name[len(module_prefix):]
    return name


def module_layer_name(name: str) -> str:
    """Inverse of :func:`checkpoint_layer_name`."""
    for module_prefix, ckpt_prefix in _NORM_NAMES:
        if name.startswith(ckpt_prefix):
            return module_prefix + name[len(ckpt_prefix):]
    return name


def is_per_layer_layout(keys) -> bool:
    """Whether checkpoint ``keys`` use this project's earlier per-layer layout (``decoder.layers.<i>.``)."""
    return any(_LAYER.match(key) or (key.startswith(OPTIMIZER_PREFIX) and _LAYER.match(key[len(OPTIMIZER_PREFIX):]))
               for key in keys)


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


def _config(chunk: torch.nn.Module):
    return getattr(chunk, "config", None) or getattr(getattr(chunk, "decoder", None), "config", None)


def _num_layers(chunk: torch.nn.Module) -> int:
    return int(_config(chunk).num_layers)


def per_layer_keys(config) -> bool:
    """Whether the decoder's layers are saved under per-layer keys ``decoder.layers.<g>.<name>`` without a layer
    axis: Megatron core_v0.14's ``TransformerBlock.sharded_state_dict`` does so when ``moe_layer_freq`` is a list or
    an int above 1 (the layers differ), whether or not the model has experts."""
    freq = getattr(config, "moe_layer_freq", 1)
    return isinstance(freq, (list, tuple)) or (isinstance(freq, int) and freq > 1)


def model_uses_per_layer_keys(model_chunks) -> bool:
    """:func:`per_layer_keys` of the (wrapped or not) model chunks' config."""
    configs = [_config(_unwrap(chunk)) for chunk in model_chunks]
    return any(per_layer_keys(config) for config in configs if config is not None)


def _global_expert(config, local: int) -> Tuple[int, int]:
    """(global expert index, number of experts) of local expert ``local`` on this expert-parallel rank."""
    num_experts = int(config.num_moe_experts)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    return ep_rank * (num_experts // ep_size) + local, num_experts


@dataclasses.dataclass(frozen=True)
class EntryKey:
    """Where a model state-dict entry lives in the checkpoint.

    ``key``: the checkpoint key (layer entries: without layer index); ``layer``: 0-based global
    layer index (None outside the decoder layers); ``num_layers``: size of the stacked layer axis;
    ``replica``: a copy another rank saves; ``legacy``: the earlier per-layer layout's key;
    ``expert`` / ``num_experts``: global expert index and the size of the expert axis (expert entries);
    ``stacked``: False when the layer index is in the key (:func:`per_layer_keys`) instead of on an axis.
    """

    key: str
    layer: Optional[int]
    num_layers: int
    replica: bool
    legacy: str
    expert: Optional[int] = None
    num_experts: int = 0
    stacked: bool = True

    @property
    def axes(self) -> Tuple[Tuple[int, int], ...]:
        """``((index, size), ...)`` of the leading axes the checkpoint adds in front of the tensor: the layer axis
        (stacked layer entries), then the expert axis (expert entries)."""
        out = []
        if self.layer is not None and self.stacked:
            out.append((self.layer, self.num_layers))
        if self.expert is not None:
            out.append((self.expert, self.num_experts))
        return tuple(out)

    @property
    def is_expert(self) -> bool:
        """Whether the entry is a routed expert's (split over the expert-tensor-parallel group)."""
        return self.expert is not None


def entry_key(chunk: torch.nn.Module, name: str, numbers: Optional[Dict[int, int]] = None) -> EntryKey:
    """The :class:`EntryKey` of state-dict entry ``name`` of the (unwrapped) model chunk ``chunk``."""
    numbers = _layer_numbers(chunk) if numbers is None else numbers
    match = _LAYER.match(name)
    if match is not None:
        layer, rest = numbers[int(match.group(1))], name[match.end():]
        config = _config(chunk)
        stacked = not per_layer_keys(config)
        prefix = LAYER_PREFIX if stacked else f"{LAYER_PREFIX}{layer}."
        expert = _LOCAL_EXPERT.match(rest)
        if expert is not None:
            index, num_experts = _global_expert(config, int(expert.group(1)))
            key = prefix + EXPERTS_PREFIX + rest[expert.end():]
            return EntryKey(key, layer, _num_layers(chunk), False, key, index, num_experts, stacked)
        if _GROUPED_EXPERTS.match(rest):
            raise UnsupportedCheckpointLayoutError(f"{name}: a GroupedMLP (--moe-grouped-gemm) weight is several "
                                                   "checkpoint entries (see grouped_experts)")
        key = prefix + checkpoint_layer_name(rest)
        return EntryKey(key, layer, _num_layers(chunk), False, f"{LAYER_PREFIX}{layer}.{rest}" if stacked else key,
                        None, 0, stacked)
    if (name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False)
            and not getattr(chunk, "pre_process", True)):
        # Tied weights over pipeline stages: the last stage holds a synchronized copy of the first
        # stage's embedding, which the first stage saves.
        name = "embedding.word_embeddings.weight"
        return EntryKey(name, None, 0, True, name)
    return EntryKey(name, None, 0, False, name)


def _layout(tensor: torch.Tensor, expert: bool = False) -> TPLayout:
    """The tensor-parallel layout of a parameter or state; ``expert``: a routed expert's, split over the
    expert-tensor-parallel group (Megatron's ``expert_dist_ckpt_decorator``)."""
    if expert:
        tp_size = parallel_state.get_expert_tensor_parallel_world_size()
        tp_rank = parallel_state.get_expert_tensor_parallel_rank()
    else:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    stride = int(getattr(tensor, "partition_stride", 1))
    # A strided split (the gated MLP's fc1, weight and bias: [gate; up]) keeps its pieces even at TP 1:
    # Megatron's apply_swiglu_sharded_factory cuts fc1 into gate and up at any TP size, so its
    # distributed-optimizer tensors have 2 * TP fragments along that dimension ([L, 2, 1, ffn * h] at TP 1).
    if getattr(tensor, "tensor_model_parallel", False) and (tp_size > 1 or stride > 1):
        dim = int(getattr(tensor, "partition_dim", 0))
        return TPLayout(tuple(tensor.shape), dim, stride, tp_rank, tp_size)
    return TPLayout(tuple(tensor.shape), None, 1, tp_rank, tp_size)


def _entry_layout(tensor: torch.Tensor, entry: EntryKey) -> TPLayout:
    return _layout(tensor, expert=True) if entry.is_expert else _layout(tensor)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """A parameter's :class:`EntryKey`, tensor-parallel layout and whether its dimension 0 is the padded vocabulary."""

    entry: EntryKey
    layout: TPLayout
    vocab: bool


def _expert_layout(shape, dim: int, stride: int) -> TPLayout:
    """:func:`_layout` of a routed expert's linear weight of local ``shape`` split along ``dim`` over expert TP."""
    tp_size = parallel_state.get_expert_tensor_parallel_world_size()
    tp_rank = parallel_state.get_expert_tensor_parallel_rank()
    split = tp_size > 1 or stride > 1
    return TPLayout(tuple(shape), dim if split else None, stride if split else 1, tp_rank, tp_size)


@dataclasses.dataclass(frozen=True)
class GroupedExperts:
    """A GroupedMLP weight as the linear weights of its local experts, the keys SequentialMLP saves (Megatron's
    GroupedMLP writes the same): ``weight1`` [H, E_loc * X] holds expert ``j``'s ``linear_fc1.weight`` [X, H]
    transposed in columns ``j*X:(j+1)*X`` (``X = (2F|F)/ETP``, ``[gate_r | up_r]`` with GLU), ``weight2``
    [E_loc * F', H] its ``linear_fc2.weight`` [H, F'] transposed in rows ``j*F':(j+1)*F'``.

    ``entries``: the local experts' :class:`EntryKey` in order; ``fc``: 1 or 2; ``glu``: gated fc1.
    """

    entries: Tuple[EntryKey, ...]
    fc: int
    glu: bool

    def views(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Per local expert, its linear weight as a (transposed) view of ``tensor`` (the weight, or a state of its
        shape)."""
        n = len(self.entries)
        if self.fc == 1:
            return [tensor.view(tensor.shape[0], n, -1)[:, j, :].t() for j in range(n)]
        return [tensor.view(n, -1, tensor.shape[1])[j].t() for j in range(n)]

    def flat_range_items(self, key: str, flat: torch.Tensor, start: int, param_shape) -> List[ShardedTensor]:
        """Elements ``[start, start + flat.numel())`` of the flattened weight (a distributed-optimizer shard) as
        chunks of the experts' parameter-shaped global tensor under ``key`` (views of ``flat``, leading axes
        included): each box of the flat range (``flat_range_boxes``) cut at the experts' borders and transposed."""
        n, out = len(self.entries), []
        infos = self.infos(torch.empty(tuple(param_shape), device="meta"))
        for flat_start, (row, col), (rows, cols) in flat_range_boxes(param_shape, start, start + flat.numel()):
            box = flat[flat_start - start:flat_start - start + rows * cols].view(rows, cols)
            # fc1: weight1 [H, n*X], column j*X + x of row h is expert j's (x, h); fc2: weight2 [n*F, H], row j*F + f
            # and column h is expert j's (h, f).
            size = (param_shape[1] if self.fc == 1 else param_shape[0]) // n
            lo_all, hi_all = (col, col + cols) if self.fc == 1 else (row, row + rows)
            for j in range(lo_all // size, (hi_all - 1) // size + 1):
                lo, hi = max(lo_all, j * size), min(hi_all, (j + 1) * size)
                if self.fc == 1:
                    part, offsets = box[:, lo - col:hi - col].t(), (lo - j * size, row)
                else:
                    part, offsets = box[lo - row:hi - row, :].t(), (col, lo - j * size)
                info = infos[j]
                items = []
                for local, sizes, global_offsets in info.layout.split_box(offsets, tuple(part.shape)):
                    data = part[tuple(slice(a - o, a - o + z) for a, o, z in zip(local, offsets, sizes))]
                    items.append(ShardedTensor(key, data, info.layout.global_shape, global_offsets))
                out.extend(stack_layer_axis(items, info.entry))
        return out

    def infos(self, tensor: torch.Tensor) -> List[ParamInfo]:
        """Per local expert, the :class:`ParamInfo` of its view of ``tensor``."""
        out = []
        for entry, view in zip(self.entries, self.views(tensor)):
            layout = (_expert_layout(view.shape, 0, 2 if self.glu else 1) if self.fc == 1
                      else _expert_layout(view.shape, 1, 1))
            out.append(ParamInfo(entry, layout, False))
        return out


def grouped_experts(chunk: torch.nn.Module, name: str, numbers: Optional[Dict[int, int]] = None
                    ) -> Optional[GroupedExperts]:
    """The :class:`GroupedExperts` of state-dict entry ``name`` of the (unwrapped) ``chunk``; None for other names."""
    match = _LAYER.match(name)
    if match is None or not _GROUPED_EXPERTS.match(name[match.end():]):
        return None
    numbers = _layer_numbers(chunk) if numbers is None else numbers
    config = _config(chunk)
    layer, fc = numbers[int(match.group(1))], int(name[-1])
    stacked = not per_layer_keys(config)
    key = (LAYER_PREFIX if stacked else f"{LAYER_PREFIX}{layer}.") + f"{EXPERTS_PREFIX}linear_fc{fc}.weight"
    local = int(config.num_moe_experts) // parallel_state.get_expert_model_parallel_world_size()
    entries = []
    for j in range(local):
        index, num_experts = _global_expert(config, j)
        entries.append(EntryKey(key, layer, _num_layers(chunk), False, key, index, num_experts, stacked))
    return GroupedExperts(tuple(entries), fc, bool(config.gated_linear_unit))


def param_keys_and_layouts(model_chunks) -> Dict[torch.Tensor, object]:
    """{parameter: :class:`ParamInfo`} over all chunks (a GroupedMLP weight: its :class:`GroupedExperts`)."""
    out = {}
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        numbers = _layer_numbers(chunk)
        for name, param in chunk.named_parameters():
            grouped = grouped_experts(chunk, name, numbers)
            if grouped is not None:
                out.setdefault(param, grouped)
                continue
            entry = entry_key(chunk, name, numbers)
            out.setdefault(param, ParamInfo(entry, _entry_layout(param, entry), entry.key in VOCAB_KEYS))
    return out


def stack_layer_axis(items: List[ShardedTensor], entry: EntryKey, legacy: bool = False) -> List[ShardedTensor]:
    """Give entries their leading axes (:attr:`EntryKey.axes`: layer, expert), as views
    (``data.view(1, ..., *shape)``)."""
    axes = entry.axes
    if not axes or legacy:
        return items
    ones = (1,) * len(axes)
    return [ShardedTensor(item.key, item.data.view(*ones, *item.data.shape),
                          (*(size for _, size in axes), *item.global_shape),
                          (*(index for index, _ in axes), *item.global_offset), item.allow_shape_mismatch, item.replica)
            for item in items]


def _model_key(entry: EntryKey, legacy: bool) -> str:
    return entry.legacy if legacy else entry.key


def extra_state_bytes(value) -> bytes:
    """Megatron's serialized ``_extra_state`` object: ``torch.save([value])``."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    return buffer.getvalue()


def extra_state_object(entry: EntryKey, value) -> ShardedObject:
    """A layer module's ``_extra_state`` as Megatron's ShardedObject: key ``<key>/shard_<offsets>_<shape>`` over the
    entry's leading axes, dot-joined (``shard_<layer>_<L>``, an expert's ``shard_<layer>.<expert>_<L>.<E>``, per-layer
    keys ``shard_0_1`` or ``shard_<expert>_<E>``), written by the expert-data-parallel rank 0 for experts."""
    axes = entry.axes or ((0, 1),)
    offsets = ".".join(str(index) for index, _ in axes)
    shape = ".".join(str(size) for _, size in axes)
    replica = entry.is_expert and parallel_state.get_expert_data_parallel_rank() != 0
    return ShardedObject(f"{entry.key}/shard_{offsets}_{shape}", extra_state_bytes(value), replica=replica)


def rng_state_object(rng_state) -> ShardedObject:
    """This rank's RNG states (``get_rng_state()``'s list) as Megatron's ``rng_state`` ShardedObject:
    key ``rng_state/shard_<pp rank>.<tp rank>_<pp size>.<tp size>``, written by data-parallel (with context-parallel)
    rank 0, as Megatron-LM (CP ranks share their RNG states)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject(f"rng_state/shard_{pp_rank}.{tp_rank}_{pp_size}.{tp_size}",
                         extra_state_bytes(rng_state),
                         replica=parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0)


def model_sharded_state(model_chunks, legacy: bool = False, with_objects: bool = False) -> List:
    """Every tensor of the state dicts of ``model_chunks`` (wrapped or not) as sharded tensors (views).

    ``legacy``: the earlier per-layer keys; ``with_objects``: also the layers' ``_extra_state``
    entries as :class:`ShardedObject` (saved for Megatron's loader, never read back).
    """
    out = []
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        numbers = _layer_numbers(chunk)
        for name, tensor in chunk.state_dict(keep_vars=True).items():
            grouped = grouped_experts(chunk, name, numbers)
            if grouped is not None:
                if legacy:
                    raise UnsupportedCheckpointLayoutError(f"{name}: GroupedMLP weights did not exist in the earlier "
                                                           "per-layer torch_dist layout")
                data = tensor.detach()
                for info, view in zip(grouped.infos(data), grouped.views(data)):
                    items = sharded_tensors_of_local(info.entry.key, view, info.layout)
                    out.extend(stack_layer_axis(items, info.entry))
                    if with_objects:  # SequentialMLP's per-expert extra state, which Megatron's loader reads
                        extra = dataclasses.replace(info.entry, key=info.entry.key[:-len("weight")] + "_extra_state")
                        out.append(extra_state_object(extra, None))
                continue
            entry = entry_key(chunk, name, numbers)
            if name.endswith("._extra_state"):
                if with_objects and entry.layer is not None and not legacy:
                    out.append(extra_state_object(entry, tensor))
                continue
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"model state {name!r} is a {type(tensor).__name__}, not a tensor: the torch_dist "
                                "format stores tensors only")
            items = sharded_tensors_of_local(_model_key(entry, legacy), tensor.detach(),
                                             _entry_layout(tensor, entry), entry.key in VOCAB_KEYS, entry.replica)
            out.extend(stack_layer_axis(items, entry, legacy))
    return out


# ---------------------------------------------------------------------------------------------------
# Whole tensors (one process, e.g. tools/checkpoint/convert.py)
# ---------------------------------------------------------------------------------------------------

def stack_layers(tensors: Dict[str, torch.Tensor], per_layer: bool = False) -> Dict[str, torch.Tensor]:
    """Whole per-layer state-dict tensors (``decoder.layers.<i>.<name>``) -> checkpoint keys and tensors,
    each layer entry stacked over all layers (``[num_layers, ...]``); a routed expert's entries
    (``...mlp.experts.local_experts.<e>.<name>``, ``e`` the global expert) stacked over the experts behind
    that (``decoder.layers.mlp.experts.experts.<name>`` [L, E, ...]). ``per_layer`` (:func:`per_layer_keys`):
    per-layer keys ``decoder.layers.<i>.<name>`` (experts ``[E, ...]``) instead of the layer axis. Raises
    ValueError when a layer entry is missing from some layer, or an expert from some expert."""
    out, layered, experts = {}, {}, {}
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match is None:
            out[name] = tensor
            continue
        layer, rest = int(match.group(1)), name[match.end():]
        expert = _LOCAL_EXPERT.match(rest)
        if expert is not None:
            key = EXPERTS_PREFIX + rest[expert.end():]
            experts.setdefault((layer, key), {})[int(expert.group(1))] = tensor
            tensor = None
        else:
            key = checkpoint_layer_name(rest)
        if per_layer:
            if tensor is not None:
                out[f"{LAYER_PREFIX}{layer}.{key}"] = tensor
        else:
            layered.setdefault(LAYER_PREFIX + key, {})[layer] = tensor
    for (layer, key), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"decoder.layers.{layer}.{key}: present for experts {sorted(by_expert)}")
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        if per_layer:
            out[f"{LAYER_PREFIX}{layer}.{key}"] = stacked
        else:
            layered[LAYER_PREFIX + key][layer] = stacked
    num_layers = max((max(by_layer) + 1 for by_layer in layered.values()), default=0)
    for key, by_layer in layered.items():
        if sorted(by_layer) != list(range(num_layers)):
            raise ValueError(f"{key}: present in layers {sorted(by_layer)} of {num_layers}")
        out[key] = torch.stack([by_layer[i] for i in range(num_layers)])
    return out


def leading_axes(key: str) -> int:
    """How many leading axes (layer, expert) a checkpoint key of :func:`stack_layers`' layout puts in front of
    the parameter's shape."""
    if not key.startswith(LAYER_PREFIX):
        return 0
    match = _LAYER.match(key)
    rest = key[match.end():] if match else key[len(LAYER_PREFIX):]
    return int(match is None) + int(rest.startswith(EXPERTS_PREFIX))


def unstack_layers(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`stack_layers` (both forms; the earlier per-layer layout's names pass through)."""
    out = {}
    for key, tensor in tensors.items():
        if not key.startswith(LAYER_PREFIX):
            out[key] = tensor
            continue
        match = _LAYER.match(key)
        rest = key[match.end():] if match else key[len(LAYER_PREFIX):]
        layers = [(int(match.group(1)), tensor)] if match else list(enumerate(tensor))
        for layer, value in layers:
            if rest.startswith(EXPERTS_PREFIX):
                tail = rest[len(EXPERTS_PREFIX):]
                for expert in range(value.shape[0]):
                    out[f"{LAYER_PREFIX}{layer}.mlp.experts.local_experts.{expert}.{tail}"] = value[expert]
            else:
                out[f"{LAYER_PREFIX}{layer}.{module_layer_name(rest)}"] = value
    return out
