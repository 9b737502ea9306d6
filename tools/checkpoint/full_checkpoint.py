"""The converter's in-memory checkpoint (one model: global layer numbers, tensor-parallel shards merged) and
the rules its readers and writers of both formats share: key names, param groups, the target's args.

``tools/checkpoint/convert.py`` reads a checkpoint of either format into a :class:`FullCheckpoint`,
plans a :class:`TargetLayout` and writes it back; ``legacy_checkpoint`` holds the tensor-parallel
merge and split rules, ``torch_dist_checkpoint`` the torch_dist reader and writer.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from legacy_checkpoint import _LAYER_KEY  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.optimizer.weight_decay import no_weight_decay_cond  # noqa: E402

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


class ConvertError(CheckpointingException, ValueError):
    """A user-facing conversion failure; the message names the flag, folder or file."""


@dataclass
class OptimizerState:
    """A non-distributed optimizer's state over the full model, keyed by global param name.

    ``kind``: ``"fp32"`` (FP32Optimizer: the torch optimizer's state dict) or ``"float16"``
    (Float16OptimizerWithFloat16Params: that plus fp32 main params and the grad scaler).
    ``param_state``: ``{name: {'exp_avg': full tensor, 'step': tensor, ...}}``.
    ``groups``: hyper-parameters of each param group (no ``params``); ``group_of``: ``{name: index}``.
    ``main_params``: ``{name: full fp32 tensor}`` (float16 only); ``grad_scaler``: its state or None.
    """
    kind: str
    param_state: Dict[str, Dict[str, Any]]
    groups: List[dict]
    group_of: Dict[str, int]
    main_params: Optional[Dict[str, torch.Tensor]] = None
    grad_scaler: Optional[dict] = None


@dataclass
class FullCheckpoint:
    """A checkpoint as one model: global layer numbers, TP shards merged, no tied-output copy.

    ``model``: ``{key: tensor or None}`` in the model's order (``decoder.layers.<global i>.*``,
    ``_extra_state`` entries kept as None); ``output_layer.weight`` is present only when the output
    layer is untied. ``args``: the saved Namespace; ``layout``: ``{'tp', 'pp', 'vp', 'counts'}``.
    ``notes``: what could not be carried over, for the user.
    """
    model: Dict[str, Any]
    args: argparse.Namespace
    iteration: int
    release: bool
    layout: dict
    optimizer: Optional[OptimizerState] = None
    scheduler: Optional[dict] = None
    rng_states: Optional[Dict[Tuple[int, int], Any]] = None
    num_floating_point_operations_so_far: int = 0
    notes: List[str] = field(default_factory=list)


@dataclass
class TargetLayout:
    """Tensor/pipeline layout to write: ``tp``, ``pp``, ``vp`` (virtual stages per pipeline rank),
    ``first``/``last`` (an uneven split), the layer ``counts[p][v]`` computed from them, and ``ep`` (expert
    parallelism: legacy files per expert-parallel rank)."""
    tp: int
    pp: int
    vp: int = 1
    first: Optional[int] = None
    last: Optional[int] = None
    counts: List[List[int]] = field(default_factory=list)
    ep: int = 1


# ----------------------------------------------------------------------------------------------- names


def global_key(key: str, offset: int) -> str:
    """``key`` of a block whose first layer is global layer ``offset``, with its global layer number."""
    match = _LAYER_KEY.match(key)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else key


def local_key(key: str, offset: int) -> str:
    """The inverse of :func:`global_key`: ``key`` numbered within the block that starts at layer ``offset``."""
    match = _LAYER_KEY.match(key)
    return f"decoder.layers.{int(match.group(1)) - offset}.{match.group(2)}" if match else key


def layer_of(key: str) -> Optional[int]:
    """The layer number of a ``decoder.layers.<i>.*`` key, else None."""
    match = _LAYER_KEY.match(key)
    return int(match.group(1)) if match else None


# Persistent buffers of GPTModel's state dict, which no optimizer holds: the MoE router's expert bias.
BUFFER_SUFFIXES = (".mlp.router.expert_bias",)


def is_buffer(key: str) -> bool:
    """Whether a state-dict ``key`` is a persistent buffer (no parameter, no optimizer state)."""
    return key.endswith(BUFFER_SUFFIXES)


def is_tied(args) -> bool:
    """Whether the saved ``args`` tie the output layer to the word embedding (Megatron's default)."""
    return not getattr(args, "untie_embeddings_and_output_weights", False)


# ----------------------------------------------------------------------------------------------- optimizer


def group_signature(name: str, ndim: int, args) -> tuple:
    """(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) of a param, by the rules of
    ``megatron.core.optimizer._get_param_groups`` with pretrain_gpt.py's no-weight-decay condition."""
    no_wd = no_weight_decay_cond(bool(getattr(args, "apply_wd_to_qk_layernorm", False)))(
        name, torch.empty((1,) * ndim, device="meta"))
    decoupled = getattr(args, "decoupled_lr", None) is not None and name in VOCAB_KEYS
    return (0.0 if no_wd else 1.0, 1.0, False, decoupled)


def rank_optimizer(optimizer: OptimizerState, params) -> dict:
    """One rank's optimizer state dict: groups in the optimizer's order (by first appearance of their
    params, as ``_get_param_groups`` orders them)."""
    order: List[int] = []
    members: Dict[int, List[int]] = {}
    for position, (_, src, _, _) in enumerate(params):
        index = optimizer.group_of[src]
        if index not in members:
            order.append(index)
            members[index] = []
        members[index].append(position)
    groups = [{**optimizer.groups[index], "params": [params[i][0] for i in members[index]]} for index in order]
    inner = {"state": {name: entry for name, _, entry, _ in params if entry}, "param_groups": groups}
    if optimizer.kind == "fp32":
        return inner
    result = {"optimizer": inner}
    if optimizer.grad_scaler is not None:
        result["grad_scaler"] = optimizer.grad_scaler
    result["fp32_from_fp16_params"] = [[params[i][3] for i in members[index]] for index in order]
    return result


# ----------------------------------------------------------------------------------------------- target


def target_args(full: FullCheckpoint, target: TargetLayout) -> argparse.Namespace:
    """A copy of the saved args with the parallel layout of ``target``, saved with the converted checkpoint."""
    args = argparse.Namespace(**vars(full.args))
    args.tensor_model_parallel_size = target.tp
    args.pipeline_model_parallel_size = target.pp
    if getattr(args, "num_experts", None):
        args.expert_model_parallel_size = target.ep
    args.virtual_pipeline_model_parallel_size = target.vp if target.vp > 1 else None
    args.num_virtual_stages_per_pipeline_rank = target.vp if target.vp > 1 else None
    args.num_layers_per_virtual_pipeline_stage = None
    args.decoder_first_pipeline_num_layers = target.first
    args.decoder_last_pipeline_num_layers = target.last
    if target.pp == 1:
        args.account_for_embedding_in_pipeline_split = False
        args.account_for_loss_in_pipeline_split = False
    return args
