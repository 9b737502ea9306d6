"""The optimizer's sharded state under Megatron-LM core_v0.14's torch_dist keys, and its unsharded common state.

Keys: ``optimizer.state.<name>.<model key>`` (model keys: :mod:`megatron.core.models.gpt.checkpoint_keys`)
with ``name`` ``exp_avg`` / ``exp_avg_sq`` (Adam), ``momentum_buffer`` (SGD), ``fp32_param`` (the
fp32 main copy). Without the distributed optimizer they have their parameter's (stacked) shape. With
it they are Megatron's ``fully_sharded_model_space`` form: per parameter, the tensor-parallel
fragments of the global tensor, each flattened, ``[num_layers?, *fragments per dimension, fragment
numel]``, every data-parallel rank writing the flat range it owns (``mcore_data`` in ``.metadata``
holds the original shape).

Loading reshards: plain optimizer tensors are global; a flattened optimizer tensor saved at the same
tensor-parallel fragmentation is read in place, at another one (or another vocabulary padding) its
fragments are read whole and reassembled. Scalars (Adam's step, hyper-parameters, the grad scaler)
are not sharded: see :func:`optimizer_common_state`.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    TPLayout,
    sharded_tensors_of_flat_range,
    sharded_tensors_of_local,
)
from megatron.core.models.gpt.checkpoint_keys import (
    OPTIMIZER_PREFIX,
    GroupedExperts,
    EntryKey,
    ParamInfo,
    param_keys_and_layouts,
    stack_layer_axis,
)
from megatron.core.optimizer import PARAM_GROUP_KEYS, param_group_key

MAIN_PARAM = "fp32_param"
DISTRIB_OPTIM_SHARDING_TYPE = "fully_sharded_model_space"
CONTENT_METADATA_KEY = "content_metadata"


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


@dataclasses.dataclass
class _Target:
    """One optimizer tensor of one parameter on this rank.

    ``tensor``: the whole tensor-parallel-local state (``start`` None) or the flat range
    ``[start, start + numel)`` of the flattened local parameter (distributed optimizer);
    ``load``: False for a tensor saved for Megatron's readers only (the distributed optimizer's
    ``fp32_param`` of an fp32 parameter, which is the parameter itself).
    """

    name: str
    info: ParamInfo
    tensor: torch.Tensor
    start: Optional[int]
    load: bool = True
    # A GroupedMLP weight's distributed-optimizer shard: its experts (``info`` is the first one's, the key being
    # the same for all) and the weight's local shape; saved and read parameter-shaped (``GroupedExperts``).
    grouped: Optional[GroupedExperts] = None
    param_shape: Optional[Tuple[int, ...]] = None


def _optimizer_targets(model_chunks, optimizer) -> List[_Target]:
    info = param_keys_and_layouts(model_chunks)
    inner = optimizer.optimizer
    out = []
    if _is_distributed(optimizer):
        for piece in optimizer.pieces():
            grouped = info[piece.model_param]
            if isinstance(grouped, GroupedExperts):
                shape = tuple(piece.model_param.shape)
                first = grouped.infos(torch.empty(shape, device="meta"))[0]
                tensors = _state_tensors(inner.state.get(piece.main_param, {}), piece.main_param)
                for name, tensor in sorted(tensors.items()):
                    out.append(_Target(name, first, tensor, piece.param_start, grouped=grouped, param_shape=shape))
                out.append(_Target(MAIN_PARAM, first, piece.main_param.detach(), piece.param_start,
                                   load=piece.is_copy, grouped=grouped, param_shape=shape))
                continue
            tensors = _state_tensors(inner.state.get(piece.main_param, {}), piece.main_param)
            for name, tensor in sorted(tensors.items()):
                out.append(_Target(name, info[piece.model_param], tensor, piece.param_start))
            main = piece.main_param.detach()  # fp32 params: the param itself (a view of its buffer)
            out.append(_Target(MAIN_PARAM, info[piece.model_param], main, piece.param_start, load=piece.is_copy))
        return out
    for main_param, model_param in _model_params_of_main(optimizer).items():
        if model_param not in info:
            raise KeyError("an optimizer parameter does not belong to the model chunks being saved")
        tensors = dict(_state_tensors(inner.state.get(main_param, {}), main_param))
        if main_param is not model_param:
            tensors[MAIN_PARAM] = main_param.detach()
        for name, tensor in sorted(tensors.items()):
            grouped = info[model_param]
            if isinstance(grouped, GroupedExperts):  # one target per local expert, views of the state
                for expert_info, view in zip(grouped.infos(tensor), grouped.views(tensor.detach())):
                    out.append(_Target(name, expert_info, view, None))
                continue
            out.append(_Target(name, grouped, tensor.detach(), None))
    return out


def optimizer_key(name: str, entry: EntryKey, legacy: bool = False) -> str:
    """``optimizer.state.<name>.<model key>`` (legacy: ``optimizer.state.<per-layer key>.<name>``)."""
    return f"{OPTIMIZER_PREFIX}{entry.legacy}.{name}" if legacy else f"{OPTIMIZER_PREFIX}{name}.{entry.key}"


def _plain(target: _Target, key: str, stack: bool = True) -> List[ShardedTensor]:
    """``target`` as chunks of the parameter-shaped global tensor (stacked over layers when ``stack``)."""
    if target.grouped is not None:
        return target.grouped.flat_range_items(key, target.tensor.view(-1), target.start, target.param_shape)
    layout, info = target.info.layout, target.info
    if target.start is None:
        layout = TPLayout(tuple(target.tensor.shape), layout.partition_dim, layout.stride, layout.tp_rank,
                          layout.tp_size)
        items = sharded_tensors_of_local(key, target.tensor, layout, info.vocab, info.entry.replica)
    else:
        items = sharded_tensors_of_flat_range(key, target.tensor, layout.local_shape, target.start, layout,
                                              info.vocab, info.entry.replica)
    return stack_layer_axis(items, info.entry) if stack else items


def _fragments(info: ParamInfo) -> Tuple[Tuple[int, ...], int, List[Tuple[Tuple[int, ...], int]]]:
    """Megatron's tensor-parallel fragments of a parameter: (fragments per dimension, numel of one
    fragment, [(this rank's fragment index, its start in the flattened local parameter)])."""
    layout = info.layout
    shape, dim = layout.local_shape, layout.partition_dim
    numel = 1
    for size in shape:
        numel *= size
    counts = [1] * len(shape)
    if dim is None:
        return tuple(counts), numel, [((0,) * len(shape), 0)]
    if layout.stride > 1 and any(size != 1 for size in shape[:dim]):
        raise ValueError(f"{info.entry.key}: a strided tensor-parallel split along dimension {dim} is not contiguous "
                         "in the flattened parameter")
    counts[dim] = layout.stride * layout.tp_size
    piece = numel // layout.stride
    pieces = []
    for j in range(layout.stride):
        index = [0] * len(shape)
        index[dim] = j * layout.tp_size + layout.tp_rank
        pieces.append((tuple(index), j * piece))
    return tuple(counts), piece, pieces


def flattened_shape(info: ParamInfo) -> Tuple[int, ...]:
    """Global shape of a parameter's distributed-optimizer tensors: ``[num_layers?, num_experts?, *fragments,
    fragment numel]`` (the leading axes of :attr:`EntryKey.axes`, as Megatron keeps its sharded offsets in front)."""
    counts, piece, _ = _fragments(info)
    return (*(size for _, size in info.entry.axes), *counts, piece)


def _flattened(target: _Target, key: str) -> List[ShardedTensor]:
    """``target`` in Megatron's ``fully_sharded_model_space`` form (views of ``target.tensor``)."""
    info = target.info
    counts, piece, pieces = _fragments(info)
    flat = target.tensor.view(-1)
    start = 0 if target.start is None else target.start
    end = start + flat.numel()
    shape = flattened_shape(info)
    prefix = tuple(index for index, _ in info.entry.axes)
    out = []
    for index, piece_start in pieces:
        lo, hi = max(start, piece_start), min(end, piece_start + piece)
        if lo >= hi:
            continue
        data = flat[lo - start:hi - start].view(*([1] * (len(shape) - 1)), hi - lo)
        out.append(ShardedTensor(key, data, shape, (*prefix, *index, lo - piece_start), replica=info.entry.replica,
                                 orig_global_shape=_plain_shape(info)))
    return out


def _plain_shape(info: ParamInfo, legacy: bool = False) -> Tuple[int, ...]:
    shape = info.layout.global_shape
    return shape if legacy else (*(size for _, size in info.entry.axes), *shape)


def _fragment_shapes(param_shape: Sequence[int], counts: Sequence[int], piece: int) -> Tuple[List[int], List[int]]:
    """Shape of one fragment of ``param_shape`` cut ``counts`` times per dimension, holding ``piece`` elements,
    and of the whole the fragments make: the rows are the saved ones (the vocabulary padding may differ)."""
    piece_shape = [size // count for size, count in zip(param_shape, counts)]
    rest = 1
    for size in piece_shape[1:]:
        rest *= size
    piece_shape[0] = piece // rest
    return piece_shape, [size * count for size, count in zip(piece_shape, counts)]


def _reassembled(target: _Target, key: str, saved_shape: Sequence[int], dtype: torch.dtype):
    """Read a flattened optimizer tensor saved at another fragmentation (or vocabulary padding):
    ``(reads of its whole fragments of this target's layer, a function copying this target's part
    from them)``. Raises ValueError when the saved shape is not a fragmentation of the parameter."""
    info = target.info
    lead = tuple(index for index, _ in info.entry.axes)
    counts, piece = tuple(saved_shape[len(lead):-1]), int(saved_shape[-1])
    ours = info.layout.global_shape
    if len(counts) != len(ours) or any(size % count for size, count in zip(ours[1:], counts[1:])):
        raise ValueError(f"{key}: checkpoint shape {list(saved_shape)} is no fragmentation of {list(ours)}")
    piece_shape, whole = _fragment_shapes(ours, counts, piece)
    full = torch.empty(whole, dtype=dtype)
    reads, copies = [], []
    for index in itertools.product(*(range(count) for count in counts)):
        buffer = torch.empty(piece, dtype=dtype)
        offset = lead + tuple(index) + (0,)
        reads.append(ShardedTensor(key, buffer.view(*([1] * (len(saved_shape) - 1)), piece), tuple(saved_shape),
                                   offset))
        copies.append((tuple(slice(i * p, (i + 1) * p) for i, p in zip(index, piece_shape)), buffer))

    def finish():
        for region, buffer in copies:
            full[region] = buffer.view(piece_shape)
        for item in _plain(target, key, stack=False):
            rows = min(item.data.shape[0], whole[0] - item.global_offset[0])
            if rows <= 0:
                continue  # padding rows this checkpoint does not have
            box = tuple(slice(o, o + (rows if d == 0 else s))
                        for d, (o, s) in enumerate(zip(item.global_offset, item.data.shape)))
            item.data.narrow(0, 0, rows).copy_(full[box])
    return reads, finish


def optimizer_sharded_state(model_chunks, optimizer) -> List[ShardedTensor]:
    """The optimizer's per-parameter tensors to save, as sharded tensors (views of the live state)."""
    out = []
    distributed = _is_distributed(optimizer)
    for target in _optimizer_targets(model_chunks, optimizer):
        key = optimizer_key(target.name, target.info.entry)
        flattened = distributed and target.grouped is None  # GroupedMLP shards: parameter-shaped
        out.extend(_flattened(target, key) if flattened else _plain(target, key))
    return out


def optimizer_load_plan(model_chunks, optimizer, stored: Dict, legacy: bool = False
                        ) -> Tuple[List[ShardedTensor], List[Callable[[], None]]]:
    """What to read for the optimizer from a checkpoint whose ``.metadata`` entries are ``stored``:
    ``(sharded tensors to read in place, functions to call after the read)``.

    Each tensor is read in whichever form the checkpoint holds (parameter-shaped, or Megatron's
    flattened fragments, at this or another fragmentation); ``legacy``: this project's earlier
    per-layer keys. A missing or otherwise shaped key is requested as parameter-shaped, so the
    read reports it.
    """
    reads, after = [], []
    for target in _optimizer_targets(model_chunks, optimizer):
        if not target.load:
            continue
        key = optimizer_key(target.name, target.info.entry, legacy)
        md = stored.get(key)
        saved = tuple(getattr(md, "size", ()) or ())
        plain = _plain_shape(target.info, legacy)
        if md is None or legacy or len(saved) == len(plain) or target.grouped is not None:
            reads.extend(_plain(target, key, stack=not legacy))
        elif saved == flattened_shape(target.info):
            reads.extend(_flattened(target, key))
        else:
            more, finish = _reassembled(target, key, saved, md.properties.dtype)
            reads.extend(more)
            after.append(finish)
    return reads, after


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


def _group_steps(optimizer) -> List[Optional[float]]:
    """Adam's step per param group (None for a group without state here, e.g. no piece on this rank)."""
    inner = optimizer.optimizer
    steps = []
    for group in inner.param_groups:
        values = [float(inner.state[p]["step"]) for p in group["params"] if "step" in inner.state.get(p, {})]
        steps.append(max(values) if values else None)
    return steps


def optimizer_common_state(optimizer) -> Dict:
    """The optimizer's unsharded state as Megatron core_v0.14 puts it into a torch_dist checkpoint's common state.

    Param groups without ``params``; Adam's step as ``state.common_step`` (plain optimizer),
    ``optimizer.state.common_step`` (fp16/bf16 wrapper, beside ``grad_scaler``) or as each group's
    ``step`` (distributed optimizer, with ``param_state_sharding_type``). The same on every rank.
    With expert params in groups of their own (``is_expert_parallel``): at expert-parallel size above 1
    Megatron's chained form ``{0: dense, 1: experts}``, at size 1 the expert groups folded into the dense
    ones, as Megatron groups them there (:func:`load_optimizer_common_state` reads either into ours).
    """
    steps = _group_steps(optimizer)
    groups = [{k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
              for group in optimizer.optimizer.param_groups]
    experts = [i for i, group in enumerate(groups) if group.get("is_expert_parallel")]
    if not experts:
        return _common_form(optimizer, groups, steps)
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # Megatron chains a second optimizer for the expert params: {0: dense optimizer's, 1: expert optimizer's}.
        dense = [i for i in range(len(groups)) if i not in experts]
        return {index: _common_form(optimizer, [groups[i] for i in part], [steps[i] for i in part])
                for index, part in enumerate((dense, experts))}
    # Expert-parallel size 1: Megatron keeps the expert params in the dense groups (its linears set
    # ``allreduce = not (is_expert and expert_parallel)``), so the groups are written as it groups them.
    dense_keys = {_without_expert(param_group_key(group)) for i, group in enumerate(groups) if i not in experts}
    kept = [i for i in range(len(groups)) if i not in experts or _without_expert(param_group_key(groups[i])) not in
            dense_keys]
    merged = [dict(groups[i], is_expert_parallel=False) for i in kept]
    return _common_form(optimizer, merged, [steps[i] for i in kept])


def _without_expert(key: Tuple) -> Tuple:
    at = PARAM_GROUP_KEYS.index("is_expert_parallel")
    return key[:at] + key[at + 1:]


def _common_form(optimizer, groups: List[Dict], steps: List[Optional[float]]) -> Dict:
    """One (Megatron) optimizer's common state of ``groups`` (param groups without ``params``) and their steps."""
    known = [s for s in steps if s is not None]
    scaler = getattr(optimizer, "grad_scaler", None)
    if _is_distributed(optimizer):
        for group, step in zip(groups, steps):
            group["step"] = step if step is not None else (max(known) if known else None)
        state = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": DISTRIB_OPTIM_SHARDING_TYPE}
        if scaler is not None:
            state["grad_scaler"] = scaler.state_dict()
        return state
    inner = {"state": {"common_step": torch.tensor(max(known) if known else 0.0)}, "param_groups": groups}
    if hasattr(optimizer, "fp32_from_float16_groups"):
        return {"optimizer": inner, "grad_scaler": None if scaler is None else scaler.state_dict()}
    return inner


def content_metadata(distributed_optimizer: bool) -> Dict:
    """The common state's ``content_metadata``: what Megatron-LM core_v0.14's ``save_checkpoint`` records
    (``_build_sharded_state_dict_metadata``) and its ``load_checkpoint`` builds the sharded state dict
    from. Without it Megatron assumes the ``dp_zero_gather_scatter`` distributed-optimizer layout,
    which this project never writes; with it, the ``fully_sharded_model_space`` layout written here."""
    metadata = {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING_TYPE} if distributed_optimizer else {}
    metadata.update(chained_optim_avoid_prefix=True, singleton_local_shards=False)
    return metadata


def saved_groups_and_steps(state: Dict, source: str) -> Tuple[List[Dict], List[Optional[float]]]:
    """(param groups, Adam's step per group) of any form :func:`optimizer_common_state` writes (and
    this project's earlier ``{'param_groups': [..., 'step']}``, and Megatron's chained optimizer of an
    expert-parallel run, ``{0: <dense optimizer's>, 1: <expert optimizer's>}``, whose groups are concatenated)."""
    if state and all(isinstance(key, int) for key in state):
        groups, steps = [], []
        for index in sorted(state):
            more, more_steps = saved_groups_and_steps(state[index], source)
            groups, steps = groups + list(more), steps + list(more_steps)
        return groups, steps
    if "param_state_sharding_type" in state:
        groups = state["optimizer"]["param_groups"]
        return groups, [g.get("step") for g in groups]
    inner = state["optimizer"] if isinstance(state.get("optimizer"), dict) else state
    if "param_groups" not in inner:
        raise ValueError(f"{source}: the checkpoint's optimizer state has no param_groups")
    groups = inner["param_groups"]
    common = (inner.get("state") or {}).get("common_step")
    if common is not None:
        return groups, [float(common)] * len(groups)
    return groups, [g.get("step") for g in groups]


def _group_order(groups: List[Dict], saved: List[Dict]) -> Optional[List[int]]:
    """For each of ``groups``, the index of the saved group with the same (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr) when those identify the groups uniquely on both sides;
    else, with as many groups on both sides, the positions (the writer's groups in the same order);
    else (expert params in their own groups on one side only: Megatron groups them apart only at
    expert-parallel size above 1) the saved group with the same key but ``is_expert_parallel``, which
    holds the same hyper-parameters and step; None when some group has no such match."""
    ours, theirs = [param_group_key(g) for g in groups], [param_group_key(g) for g in saved]
    if len(set(ours)) == len(ours) and sorted(ours, key=repr) == sorted(theirs, key=repr):
        return [theirs.index(sig) for sig in ours]
    if len(groups) == len(saved):
        return list(range(len(saved)))
    expert_at = PARAM_GROUP_KEYS.index("is_expert_parallel")

    def loose(sig):
        return sig[:expert_at] + sig[expert_at + 1:]

    order = []
    for sig in ours:
        exact = [i for i, other in enumerate(theirs) if other == sig]
        close = exact or [i for i, other in enumerate(theirs) if loose(other) == loose(sig)]
        if not close:
            return None
        order.append(close[0])
    return order


def saved_grad_scaler(state: Dict) -> Optional[Dict]:
    """The grad scaler's state dict in any form :func:`optimizer_common_state` writes (None without one)."""
    return state.get("grad_scaler")


def load_optimizer_common_state(optimizer, state: Dict, source: str) -> None:
    """Restore :func:`optimizer_common_state` output; Adam's step goes to every param with state.

    Call after the sharded tensors were loaded (the state entries exist then). Raises ValueError
    naming ``source`` when the number of param groups differs.
    """
    inner = optimizer.optimizer
    saved_groups, steps = saved_groups_and_steps(state, source)
    order = _group_order(inner.param_groups, saved_groups)
    if order is None:
        raise ValueError(f"{source}: the checkpoint's optimizer has {len(saved_groups)} param groups, this "
                         f"optimizer has {len(inner.param_groups)} (a different model or weight-decay rule)")
    known = [s for s in steps if s is not None]
    fallback = max(known) if known else None
    saved_groups, steps = [saved_groups[i] for i in order], [steps[i] for i in order]
    for group, saved, step in zip(inner.param_groups, saved_groups, steps):
        for key, value in saved.items():
            if key not in ("params", "step"):
                group[key] = value
        step = fallback if step is None else step
        if step is None:
            continue
        for param in group["params"]:
            entry = inner.state.get(param)
            if entry and any(isinstance(v, torch.Tensor) and k != "step" for k, v in entry.items()):
                entry["step"] = torch.tensor(float(step), dtype=torch.float32)
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and saved_grad_scaler(state) is not None:
        scaler.load_state_dict(saved_grad_scaler(state))


def unflatten_fragments(saved: torch.Tensor, param_shape: Sequence[int], layered) -> torch.Tensor:
    """A whole distributed-optimizer tensor ``[*leading axes, *fragments, fragment numel]`` -> the
    parameter-shaped tensor (``[*leading axes, *param_shape]``, rows as saved: the vocabulary padding
    may differ from ``param_shape[0]``). ``layered``: the number of leading axes (layer, expert), or a bool
    (True: one, the layer axis)."""
    lead = int(layered)
    leading = tuple(saved.shape[:lead])
    counts, piece = tuple(saved.shape[lead:-1]), saved.shape[-1]
    piece_shape, whole = _fragment_shapes(param_shape, counts, piece)
    rows = 1
    for size in leading:
        rows *= size
    out = torch.empty((rows, *whole), dtype=saved.dtype)
    flat = saved.reshape(rows, *counts, piece)
    for index in itertools.product(*(range(count) for count in counts)):
        region = tuple(slice(i * p, (i + 1) * p) for i, p in zip(index, piece_shape))
        out[(slice(None), *region)] = flat[(slice(None), *index)].reshape(rows, *piece_shape)
    return out.reshape(*leading, *whole)
