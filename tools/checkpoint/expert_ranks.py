"""Expert parallelism in legacy ('torch' format) checkpoints: merge the expert-parallel rank files into one, split one.

Megatron-LM core_v0.14 (spec megatron-scale 3.6) writes one ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]`` file per
(tensor, pipeline, expert-parallel) rank. Each holds the dense weights (the same in every expert-parallel rank) and
its local experts ``decoder.layers.<i>.mlp.experts.local_experts.<j>.*``, global expert ``ep_rank * E_loc + j``.
Merged, the experts carry their global index (the checkpoint of expert-parallel size 1); split, each rank keeps
its ``E_loc`` experts renumbered from 0. The optimizer state (name-keyed here) follows the same renaming.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, Optional, Tuple

from full_checkpoint import ConvertError
from megatron.training.checkpointing import layout, load_state_dict_file

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def expert_of(name: str) -> Optional[int]:
    """The expert index in a routed expert's state-dict ``name`` (optionally ``model<i>.``-prefixed), else None."""
    match = _EXPERT.match(name)
    return int(match.group(2)) if match else None


def renumber(name: str, shift: int) -> str:
    """``name`` with its expert index moved by ``shift`` (other names unchanged)."""
    match = _EXPERT.match(name)
    return f"{match.group(1)}{int(match.group(2)) + shift}{match.group(3)}" if match else name


def expert_parallel_size(iteration_dir: str) -> Tuple[int, object]:
    """(expert-parallel size, saved args) of a legacy iteration folder, from the args of its first rank file."""
    names = layout.rank_dirnames(iteration_dir)
    if not names:
        return 1, None
    args = load_state_dict_file(os.path.join(iteration_dir, names[0], layout.CHECKPOINT_BASENAME)).get("args")
    return int(getattr(args, "expert_model_parallel_size", 1) or 1), args


def rank_files(iteration_dir: str, args) -> Dict[Tuple[int, int, int], str]:
    """``{(tp rank, pp rank, ep rank): file}`` of a legacy checkpoint written with expert parallelism.

    Raises ConvertError naming the folder when a rank's file is missing."""
    pipeline = int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1
    files = {}
    for name in layout.rank_dirnames(iteration_dir):
        rank = layout.parse_rank_dirname_with_experts(name, pipeline, True)
        if rank is not None:
            files[rank] = os.path.join(iteration_dir, name, layout.CHECKPOINT_BASENAME)
    sizes = [1 + max(rank[i] for rank in files) for i in range(3)] if files else [0, 0, 0]
    missing = [(t, p, e) for t in range(sizes[0]) for p in range(sizes[1]) for e in range(sizes[2])
               if (t, p, e) not in files]
    if not files or missing:
        raise ConvertError(f"{iteration_dir}: missing rank folders for (tp, pp, ep) = {missing or 'all'}")
    return files


def _merged_model(models: List[dict], local: int) -> dict:
    """One model state dict from the expert-parallel ranks' (in rank order): each layer's experts, renumbered
    globally, where the first rank's experts of that layer are."""
    out, done = {}, set()
    for key, value in models[0].items():
        match = _EXPERT.match(key)
        if match is None:
            out[key] = value
            continue
        if match.group(1) in done:
            continue
        done.add(match.group(1))
        for e, model in enumerate(models):
            for name, tensor in model.items():
                if name.startswith(match.group(1)):
                    out[renumber(name, e * local)] = tensor
    return out


def merge(loaded: Dict[Tuple[int, int, int], dict], files: Dict[Tuple[int, int, int], str], num_experts: int,
          named: Callable[[dict, List[dict], str], dict]) -> Tuple[Dict[Tuple[int, int], dict],
                                                                  Dict[Tuple[int, int], str]]:
    """The rank files of each (tp, pp) merged over the expert-parallel ranks: ``(loaded, files)`` keyed (tp, pp),
    as a checkpoint of expert-parallel size 1 (its files: those of expert-parallel rank 0).

    ``named(optimizer, model chunks, path)`` turns a rank's optimizer state into the name-keyed form.
    Raises ConvertError for virtual pipeline chunks or Megatron's chained (list) optimizer states.
    """
    ep = 1 + max(e for _, _, e in loaded)
    local = num_experts // ep
    out, out_files = {}, {}
    for t, p in sorted({(t, p) for t, p, _ in loaded}):
        ranks = [loaded[(t, p, e)] for e in range(ep)]
        if any("model" not in rank for rank in ranks):
            raise ConvertError(f"{files[(t, p, 0)]}: virtual-pipeline chunks with expert parallelism are not "
                               "supported by this tool")
        merged = dict(ranks[0], model=_merged_model([rank["model"] for rank in ranks], local))
        merged.pop("rng_state", None)  # each expert-parallel rank has its own; none belongs to the merged file
        if all(isinstance(rank.get("optimizer"), dict) for rank in ranks):
            merged["optimizer"] = _merged_optimizer(
                [named(rank["optimizer"], [rank["model"]], files[(t, p, e)]) for e, rank in enumerate(ranks)], local)
        elif any(rank.get("optimizer") is not None for rank in ranks):
            raise ConvertError(f"{files[(t, p, 0)]}: an optimizer state of another form (Megatron's chained optimizer "
                               "of an expert-parallel run?) is not converted; convert with --no-save-optim")
        out[(t, p)], out_files[(t, p)] = merged, files[(t, p, 0)]
    return out, out_files


def _merged_optimizer(states: List[dict], local: int) -> dict:
    """Name-keyed optimizer states of the expert-parallel ranks -> one (experts renumbered, groups joined)."""
    wrapped = "optimizer" in states[0] and "param_groups" not in states[0]
    inners = [state["optimizer"] if wrapped else state for state in states]
    groups, state, mains = [], {}, []
    for index, group in enumerate(inners[0]["param_groups"]):
        names, masters = [], []
        for e, inner in enumerate(inners):
            other = inner["param_groups"][index]
            for position, name in enumerate(other["params"]):
                global_name = renumber(name, e * local)
                if global_name in names:
                    continue
                names.append(global_name)
                if wrapped:
                    masters.append(states[e]["fp32_from_fp16_params"][index][position])
        groups.append(dict(group, params=names))
        mains.append(masters)
    for e, inner in enumerate(inners):
        for name, value in inner["state"].items():
            state.setdefault(renumber(name, e * local), value)
    inner = {"state": state, "param_groups": groups}
    if not wrapped:
        return inner
    return dict(states[0], optimizer=inner, fp32_from_fp16_params=mains)


def split(rank_dict: dict, ep: int, num_experts: int) -> List[dict]:
    """A (tp, pp) rank's legacy dict (model, name-keyed optimizer) -> one per expert-parallel rank, each with
    its ``num_experts / ep`` experts renumbered from 0."""
    local = num_experts // ep
    out = []
    for e in range(ep):
        keep = range(e * local, (e + 1) * local)

        def mine(name):
            expert = expert_of(name)
            return expert is None or expert in keep

        part = dict(rank_dict)
        part["model"] = {renumber(k, -e * local): v for k, v in rank_dict["model"].items() if mine(k)}
        optimizer = rank_dict.get("optimizer")
        if optimizer is not None:
            wrapped = "optimizer" in optimizer and "param_groups" not in optimizer
            inner = optimizer["optimizer"] if wrapped else optimizer
            groups, mains = [], []
            for index, group in enumerate(inner["param_groups"]):
                kept = [i for i, name in enumerate(group["params"]) if mine(name)]
                groups.append(dict(group, params=[renumber(group["params"][i], -e * local) for i in kept]))
                if wrapped:
                    mains.append([optimizer["fp32_from_fp16_params"][index][i] for i in kept])
            new_inner = {"state": {renumber(k, -e * local): v for k, v in inner["state"].items() if mine(k)},
                         "param_groups": groups}
            part["optimizer"] = dict(optimizer, optimizer=new_inner, fp32_from_fp16_params=mains) if wrapped \
                else new_inner
        out.append(part)
    return out
