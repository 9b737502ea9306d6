"""Read a legacy ('torch' format) checkpoint of any TP x PP as one full GPTModel state dict, and write one back split for TP.

Layout (spec §8.8): one rank file per (tensor, pipeline) rank under ``<dir>/iter_{N:07d}`` (or ``release``); every
name comes from ``megatron.training.checkpointing.layout``.
Merging rules (spec §7.3): column-parallel weights and biases (``linear_qkv``, ``linear_fc1``) and
the vocabulary-parallel ``word_embeddings``/``output_layer`` concatenate on dim 0 (a SwiGLU
``linear_fc1`` shard is ``[gate_r; up_r]``, so its halves are gathered separately); row-parallel
weights (``linear_proj``, ``linear_fc2``) on dim 1; everything else is replicated. Pipeline stages
number their layers locally; a stage's layers are renumbered by the layers of the stages before it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.training.checkpointing import MODEL_SHAPE_ARGS, layout, load_state_dict_file, saved_args  # noqa: E402
from megatron.training.checkpointing.errors import CheckpointTrackerError  # noqa: E402
from megatron.training.checkpointing.tracker import read_tracker, tracker_exists  # noqa: E402

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
# A routed expert's or the shared expert's linears split over TP as the dense MLP's (the expert tensor-parallel
# size being the tensor-parallel size): their names are matched as ``mlp.linear_fc*``.
_EXPERT_MLP = re.compile(r"^mlp\.(?:experts\.local_experts\.\d+\.|shared_experts\.)")


def _split_suffix(key: str) -> str:
    """The name that decides how ``key`` is split over TP (layer index dropped, expert MLPs as the dense MLP)."""
    match = _LAYER_KEY.match(key)
    return _EXPERT_MLP.sub("mlp.", match.group(2)) if match else key


class CheckpointLayoutError(CheckpointingException, ValueError):
    """The folder is not a legacy checkpoint this tool can read (message names the path)."""


def find_iteration_dir(load_dir: str, iteration: Optional[int] = None) -> str:
    """The ``iter_*``/``release`` folder to read: ``iteration`` if given, else the tracker file's.

    Raises CheckpointLayoutError naming ``load_dir`` when there is none.
    """
    if iteration is not None:
        path = os.path.join(load_dir, layout.iteration_dirname(iteration))
    else:
        tracker = layout.get_checkpoint_tracker_filename(load_dir)
        try:
            if not tracker_exists(tracker):
                raise CheckpointLayoutError(f"--load {load_dir}: no {layout.TRACKER_FILENAME} (not a checkpoint "
                                            "folder?)")
            found, release = read_tracker(tracker)
        except CheckpointTrackerError as error:
            raise CheckpointLayoutError(f"--load {load_dir}: {error}") from None
        path = os.path.join(load_dir, layout.iteration_dirname(found, release))
    if not os.path.isdir(path):
        raise CheckpointLayoutError(f"--load {load_dir}: checkpoint folder {path} does not exist")
    return path


def _rank_files(iteration_dir: str) -> Dict[Tuple[int, int], str]:
    files = {}
    for entry in sorted(os.listdir(iteration_dir)):
        rank = layout.parse_rank_dirname(entry)
        if rank is not None:
            files[rank] = os.path.join(iteration_dir, entry, layout.CHECKPOINT_BASENAME)
    if not files:
        raise CheckpointLayoutError(f"{iteration_dir}: no {layout.RANK_DIR_PREFIX}* folders (a torch_dist checkpoint? "
                                    "only the legacy 'torch' format is read)")
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise CheckpointLayoutError(f"{iteration_dir}: missing rank folders for (tp, pp) = {missing}")
    return files


def _model_state(checkpoint: dict, path: str) -> dict:
    if "model" in checkpoint:
        return checkpoint["model"]
    if "model0" in checkpoint:
        raise CheckpointLayoutError(f"{path}: virtual-pipeline chunks (model0, model1, ...) are not supported")
    raise CheckpointLayoutError(f"{path}: no 'model' entry")


def _merge_tp(shards: List[dict], swiglu: bool) -> dict:
    """Full state dict of one pipeline stage from its TP shards (see module docstring)."""
    merged = {}
    for key, first in shards[0].items():
        if first is None or not torch.is_tensor(first) or len(shards) == 1:
            merged[key] = first
            continue
        parts = [shard[key] for shard in shards]
        suffix = _split_suffix(key)
        if suffix in _COLUMN_PARALLEL:
            if swiglu and suffix.startswith("mlp.linear_fc1"):
                halves = [torch.chunk(part, 2, dim=0) for part in parts]
                merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                merged[key] = torch.cat(parts, dim=0)
        elif suffix in _ROW_PARALLEL:
            merged[key] = torch.cat(parts, dim=1)
        elif key in _VOCAB_PARALLEL:
            merged[key] = torch.cat(parts, dim=0)
        else:
            merged[key] = first
    return merged


def _layer_count(state: dict) -> int:
    numbers = [int(m.group(1)) for m in map(_LAYER_KEY.match, state) if m]
    return 1 + max(numbers) if numbers else 0


def read_checkpoint(load_dir: str, iteration: Optional[int] = None) -> Tuple[dict, argparse.Namespace, dict]:
    """Load every rank of a legacy checkpoint and merge it.

    Returns ``(state, args, info)``: ``state`` is the full TP=1/PP=1 GPTModel state dict (global
    layer numbers, padded vocabulary, ``_extra_state`` entries kept), ``args`` the Namespace saved
    with rank (0, 0), and ``info`` ``{"tp", "pp", "iteration_dir"}``.

    Raises CheckpointLayoutError for a missing or incomplete checkpoint, and the errors of
    ``megatron.training.checkpointing.load_state_dict_file`` for an unreadable file.
    """
    iteration_dir = find_iteration_dir(load_dir, iteration)
    files = _rank_files(iteration_dir)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    args = None
    state: dict = {}
    layer_offset = 0
    for stage in range(pp):
        shards = []
        for rank in range(tp):
            checkpoint = load_state_dict_file(files[(rank, stage)], context=f"--load {load_dir}")
            saved = saved_args(checkpoint, files[(rank, stage)], f"--load {load_dir}", MODEL_SHAPE_ARGS)
            if args is None:
                args = saved
                if args is None:
                    raise CheckpointLayoutError(f"{files[(rank, stage)]}: no saved 'args' (model shape unknown)")
            shards.append(_model_state(checkpoint, files[(rank, stage)]))
        stage_state = _merge_tp(shards, swiglu=bool(getattr(args, "swiglu", False)))
        count = _layer_count(stage_state)
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        for key, value in stage_state.items():
            match = _LAYER_KEY.match(key)
            if match:
                key = f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"
            elif key == "output_layer.weight" and tied and stage > 0:
                continue  # with PP > 1 the last stage holds a copy of the tied embedding
            state.setdefault(key, value)
        layer_offset += count
    if layer_offset != args.num_layers:
        raise CheckpointLayoutError(f"{iteration_dir}: found {layer_offset} layers, the saved args say "
                                    f"--num-layers {args.num_layers}")
    return state, args, {"tp": tp, "pp": pp, "iteration_dir": iteration_dir}


def split_tp(state: dict, tp: int, swiglu: bool) -> List[dict]:
    """The inverse of the TP merge: ``tp`` per-rank state dicts from a full one.

    Raises ValueError when a split dimension is not divisible by ``tp``.
    """
    shards: List[dict] = [{} for _ in range(tp)]
    for key, value in state.items():
        suffix = _split_suffix(key)
        if value is None or not torch.is_tensor(value) or tp == 1:
            parts = [value] * tp
        elif suffix in _COLUMN_PARALLEL and swiglu and suffix.startswith("mlp.linear_fc1"):
            gate, up = torch.chunk(value, 2, dim=0)
            parts = [torch.cat([g, u], dim=0) for g, u in zip(_chunk(gate, tp, 0, key), _chunk(up, tp, 0, key))]
        elif suffix in _COLUMN_PARALLEL or key in _VOCAB_PARALLEL:
            parts = _chunk(value, tp, 0, key)
        elif suffix in _ROW_PARALLEL:
            parts = _chunk(value, tp, 1, key)
        else:
            parts = [value] * tp
        for shard, part in zip(shards, parts):
            shard[key] = part.clone() if torch.is_tensor(part) else part
    return shards


def _chunk(value: torch.Tensor, tp: int, dim: int, key: str) -> List[torch.Tensor]:
    if value.size(dim) % tp:
        raise ValueError(f"{key}: dimension {dim} of size {value.size(dim)} is not divisible by TP {tp}")
    return list(torch.chunk(value, tp, dim=dim))


def write_checkpoint(save_dir: str, state: dict, args: argparse.Namespace, tp: int) -> List[str]:
    """Write ``state`` (full, TP=1) as a ``release`` legacy checkpoint split for ``tp`` ranks.

    Each rank file holds ``args`` (with ``tensor_model_parallel_size = tp``), ``checkpoint_version``,
    ``iteration`` 0 and ``model``; no optimizer or RNG state, so train from it with ``--finetune``
    (or ``--no-load-optim --no-load-rng``). Returns the files written.
    """
    args = argparse.Namespace(**vars(args))
    args.tensor_model_parallel_size = tp
    args.pipeline_model_parallel_size = 1
    written = []
    for rank, shard in enumerate(split_tp(state, tp, swiglu=bool(getattr(args, "swiglu", False)))):
        folder = os.path.join(save_dir, layout.iteration_dirname(0, release=True), layout.rank_dirname(rank))
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, layout.CHECKPOINT_BASENAME)
        torch.save({"args": args, "checkpoint_version": layout.CHECKPOINT_VERSION, "iteration": 0, "model": shard},
                   path)
        written.append(path)
    with open(layout.get_checkpoint_tracker_filename(save_dir), "w") as stream:
        stream.write("release")
    return written
