"""Optimizer state of legacy ``model_optim_rng.pt`` files: Megatron-LM's positional layout <-> name-keyed state.

Megatron-LM (core_v0.14.0) stores ``optimizer.state_dict()`` as torch writes it: per-param state keyed
by position (0, 1, ... over the param groups in order) and ``param_groups[i]['params']`` lists of
positions, with no names. A position means "the k-th param of group i in the writer's
``named_parameters()`` order", so state lands on the wrong params when writer and reader order their
params differently. This module makes the mapping explicit, by name:

* :func:`to_megatron_layout` turns this project's name-keyed optimizer state into Megatron's
  positional one (positions in our group order, which is Megatron's) and adds torch's optional
  ``param_names`` list to every group (torch.optim stores it there for named params; Megatron's
  loader carries it along unused).
* :func:`to_named_layout` turns a positional state back into a name-keyed one. Names come from the
  groups' ``param_names`` when present; for a Megatron-written file they are rebuilt from the
  checkpoint's own model state-dict order (the order its writer discovered its params in) and the
  group identity ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``, so the result does not
  depend on the reader's parameter order. Each Adam moment's shape is checked against its param.

Optimizer states that hold no per-param entries (the distributed optimizer's, whose tensors are in
``distrib_optim.pt``) pass through unchanged.
"""
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.optimizer import PARAM_GROUP_KEYS, param_group_key
from megatron.training.user_errors import UserInputError


class OptimizerStateMismatch(CheckpointingException, UserInputError):
    """The optimizer state of a checkpoint does not fit this run's params (count, names or shapes); a
    ValueError that pretrain_gpt.py prints as one line."""


def _inner(optimizer_state: dict) -> Optional[dict]:
    """The torch-optimizer dict inside a Megatron optimizer state (FP32: itself; mixed precision: 'optimizer')."""
    if not isinstance(optimizer_state, dict):
        return None
    inner = optimizer_state.get("optimizer", optimizer_state)
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        return None
    return inner


def _with_inner(optimizer_state: dict, inner: dict) -> dict:
    return dict(optimizer_state, optimizer=inner) if "optimizer" in optimizer_state else inner


def _is_named(inner: dict) -> bool:
    return any(isinstance(p, str) for group in inner["param_groups"] for p in group["params"])


def fold_expert_groups(optimizer_state: dict, model_keys: Sequence[str]) -> dict:
    """A name-keyed optimizer state with its expert param groups (``is_expert_parallel``) folded into the dense
    groups of the same (wd_mult, lr_mult, is_decoupled_lr), params in the model's order (``model_keys``): how
    Megatron-LM groups them at expert-parallel size 1, where its expert linears keep ``allreduce`` True. States
    without expert groups (or not name-keyed) are returned unchanged."""
    inner = _inner(optimizer_state)
    if inner is None or not _is_named(inner) or not any(g.get("is_expert_parallel") for g in inner["param_groups"]):
        return optimizer_state
    groups = inner["param_groups"]
    mains = optimizer_state.get("fp32_from_fp16_params")
    main_of = {}
    if mains is not None:
        for group, values in zip(groups, mains):
            main_of.update(zip(group["params"], values))
    dense = {_with_expert(group_identity(g), False): i for i, g in enumerate(groups)
             if group_identity(g) is not None and not g.get("is_expert_parallel")}
    target = {}
    for i, group in enumerate(groups):
        identity = group_identity(group)
        folded = identity is not None and group.get("is_expert_parallel") and _with_expert(identity, False) in dense
        target[i] = dense[_with_expert(identity, False)] if folded else i
    order = {key: index for index, key in enumerate(model_keys)}
    new_groups = []
    for i, group in enumerate(groups):
        if target[i] != i:
            continue
        names = [name for j, other in enumerate(groups) if target[j] == i for name in other["params"]]
        names.sort(key=lambda name: order.get(name, len(order)))
        new_groups.append(dict(group, params=names, is_expert_parallel=False))
    result = _with_inner(optimizer_state, {"state": inner["state"], "param_groups": new_groups})
    if mains is not None:
        result["fp32_from_fp16_params"] = [[main_of[name] for name in g["params"]] for g in new_groups]
    return result


def to_megatron_layout(optimizer_state: dict) -> dict:
    """Megatron's positional layout of a name-keyed optimizer state (others are returned unchanged).

    Positions run over the groups in order; each group keeps its hyper-parameters and gets
    ``params`` (positions) and ``param_names`` (the names at those positions).
    """
    inner = _inner(optimizer_state)
    if inner is None or not _is_named(inner):
        return optimizer_state
    position, groups = {}, []
    for group in inner["param_groups"]:
        names = list(group["params"])
        for name in names:
            position[name] = len(position)
        groups.append({**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                       "params": [position[name] for name in names], "param_names": names})
    state = {position[name]: value for name, value in inner["state"].items()}
    return _with_inner(optimizer_state, {"state": dict(sorted(state.items())), "param_groups": groups})


def group_identity(group: Mapping) -> Optional[tuple]:
    """``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`` of a param group (None if it lacks one)."""
    if not all(key in group for key in PARAM_GROUP_KEYS):
        return None
    return param_group_key(group)


def _names_from_model_order(saved_groups: Sequence[dict], target_groups: Sequence[Sequence[str]],
                            target_identities: Sequence[Optional[tuple]], model_keys: Sequence[str],
                            where: str) -> List[List[str]]:
    """For each saved group, the param names at its positions, rebuilt from the checkpoint's model order.

    A saved group is matched to this run's group with the same identity (positionally when the
    groups carry no identity); its params are that group's names in the checkpoint's model order.
    """
    order = {key: index for index, key in enumerate(model_keys)}
    by_identity = {identity: names for identity, names in zip(target_identities, target_groups)
                   if identity is not None}
    saved_identities = {group_identity(group) for group in saved_groups}
    result = []
    for index, group in enumerate(saved_groups):
        identity = group_identity(group)
        if identity is not None and not identity[_EXPERT_AT]:
            # A writer without expert groups (Megatron at expert-parallel size 1) holds our expert params with the
            # dense ones of the same (wd_mult, lr_mult, is_decoupled_lr).
            expert = _with_expert(identity, True)
            if expert in by_identity and expert not in saved_identities:
                names = list(by_identity.get(identity, [])) + list(by_identity[expert])
                result.append(_checked_names(names, group, order, index, where))
                continue
        if identity is not None and identity in by_identity:
            names = by_identity[identity]
        elif identity is None and index < len(target_groups):
            names = target_groups[index]
        else:
            raise OptimizerStateMismatch(
                f"{where}: optimizer param group {index} ({dict(zip(PARAM_GROUP_KEYS, identity or ()))}) has "
                "no counterpart in this run's optimizer (other --weight-decay/--decoupled-lr settings?); use "
                "--no-load-optim to start the optimizer afresh")
        result.append(_checked_names(names, group, order, index, where))
    return result


_EXPERT_AT = PARAM_GROUP_KEYS.index("is_expert_parallel")


def _with_expert(identity: tuple, expert: bool) -> tuple:
    return identity[:_EXPERT_AT] + (expert,) + identity[_EXPERT_AT + 1:]


def _checked_names(names, group, order, index, where) -> List[str]:
    """``names`` in the checkpoint's model order, checked against the saved group's param count."""
    missing = [name for name in names if name not in order]
    if missing or len(names) != len(group["params"]):
        raise OptimizerStateMismatch(
            f"{where}: optimizer param group {index} holds {len(group['params'])} params, this run's "
            f"matching group {len(names)}" + (f" (not in the checkpoint's model: {missing[:3]})" if missing else "")
            + "; use --no-load-optim to start the optimizer afresh")
    return sorted(names, key=order.__getitem__)


def to_named_layout(optimizer_state: dict, target_groups: Optional[Sequence[Sequence[str]]],
                    target_identities: Sequence[Optional[tuple]], model_keys: Sequence[str],
                    param_shapes: Mapping[str, torch.Size], where: str) -> dict:
    """The name-keyed form of a positional (Megatron-layout) optimizer state; others unchanged.

    Args:
        optimizer_state: the checkpoint's ``optimizer`` entry.
        target_groups: this run's param names per optimizer group (None: the optimizer has no
            names, the state is returned unchanged).
        target_identities: this run's ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``
            per group.
        model_keys: the checkpoint's model state-dict keys in its order (``model{i}.``-prefixed for
            several chunks): the order its writer created its params in.
        param_shapes: this run's param shape by name.
        where: the checkpoint file, for messages.
    Returns the state with ``state`` keyed by name, groups listing names, in this run's group
    order; ``fp32_from_fp16_params`` (mixed precision) reordered alike.
    Raises OptimizerStateMismatch (a UserInputError, one line naming ``where``) when the groups or a
    moment's shape do not fit this run's params.
    """
    inner = _inner(optimizer_state)
    if inner is None or target_groups is None or _is_named(inner):
        return optimizer_state
    saved_groups = inner["param_groups"]
    if all("param_names" in group for group in saved_groups):
        names_per_group = [list(group["param_names"]) for group in saved_groups]
    else:
        names_per_group = _names_from_model_order(saved_groups, target_groups, target_identities, model_keys, where)
    name_of = {}
    for group, names in zip(saved_groups, names_per_group):
        if len(names) != len(group["params"]):
            raise OptimizerStateMismatch(f"{where}: optimizer param group lists {len(group['params'])} params but "
                                         f"{len(names)} param_names")
        name_of.update(zip(group["params"], names))
    state = {}
    for position, value in inner["state"].items():
        name = name_of.get(position)
        if name is None:
            raise OptimizerStateMismatch(f"{where}: optimizer state entry {position} belongs to no param group")
        shape = param_shapes.get(name)
        for key, tensor in value.items():
            if torch.is_tensor(tensor) and tensor.dim() > 0 and shape is not None and tensor.shape != shape:
                raise OptimizerStateMismatch(
                    f"{where}: optimizer state '{key}' of {name} has shape {tuple(tensor.shape)} but the param has "
                    f"{tuple(shape)}; use --no-load-optim to start the optimizer afresh")
        state[name] = value

    # This run's group order (Megatron's and ours agree; a writer with another order still maps by names).
    order = _match_groups([set(names) for names in names_per_group], [set(names) for names in target_groups], where)
    groups = []
    for target_names, identity, i in zip(target_groups, target_identities, order):
        wanted = set(target_names)
        group = {**{k: v for k, v in saved_groups[i].items() if k not in ("params", "param_names")},
                 "params": [name for name in names_per_group[i] if name in wanted]}
        if identity is not None and group_identity(group) != identity:  # a saved group holding two of ours
            group.update(zip(PARAM_GROUP_KEYS, identity))
        groups.append(group)
    named = _with_inner(optimizer_state, {"state": state, "param_groups": groups})
    if "fp32_from_fp16_params" in optimizer_state:
        mains = optimizer_state["fp32_from_fp16_params"]
        reordered = []
        for target_names, i in zip(target_groups, order):
            if list(names_per_group[i]) == list(target_names):
                reordered.append(mains[i])
            elif len(mains[i]) == len(names_per_group[i]) and set(target_names) < set(names_per_group[i]):
                by_name = dict(zip(names_per_group[i], mains[i]))
                reordered.append([by_name[name] for name in target_names])
            elif len(mains[i]) == len(names_per_group[i]):
                by_name = dict(zip(names_per_group[i], mains[i]))
                reordered.append([by_name[name] for name in target_names])
            else:  # fp32 params mixed into an fp16/bf16 model: the main copies cannot be told apart
                raise OptimizerStateMismatch(f"{where}: fp32_from_fp16_params group {i} cannot be matched to this "
                                             "run's params by name; use --no-load-optim to start the optimizer afresh")
        named["fp32_from_fp16_params"] = reordered
    return named


def _match_groups(saved: List[set], target: List[set], where: str) -> List[int]:
    """For each of this run's groups, the index of the saved group holding the same params, or (a writer that
    keeps expert params with the dense ones) the saved group holding them with the params of other groups of
    this run; every saved group must be the union of the groups matched to it."""
    order = []
    for index, names in enumerate(target):
        found = [i for i, saved_names in enumerate(saved) if saved_names == names]
        found = found or [i for i, saved_names in enumerate(saved) if names and names <= saved_names]
        if not found:
            raise OptimizerStateMismatch(f"{where}: no optimizer param group of the checkpoint holds the params of "
                                         f"this run's group {index} (e.g. {sorted(names)[:2]}); use --no-load-optim "
                                         "to start the optimizer afresh")
        order.append(found[0])
    covered = [set().union(*(target[t] for t, i in enumerate(order) if i == s)) for s in range(len(saved))]
    if covered != saved:
        raise OptimizerStateMismatch(f"{where}: the checkpoint's optimizer has {len(saved)} param groups, this run's "
                                     f"{len(target)}")
    return order


def model_keys_in_order(state_dict: Mapping, num_chunks: int) -> List[str]:
    """The model state-dict keys of a legacy checkpoint, ``model{i}.``-prefixed for several chunks."""
    if num_chunks == 1:
        return list(state_dict.get("model", {}))
    return [f"model{i}.{key}" for i in range(num_chunks) for key in state_dict.get(f"model{i}", {})]


def param_shapes_by_name(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.Size]:
    """Shape of every param by its name in the optimizer (``model{i}.``-prefixed for several chunks)."""
    shapes = {}
    for index, chunk in enumerate(model_chunks):
        prefix = f"model{index}." if len(model_chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            shapes.setdefault(prefix + name, param.shape)
    return shapes
