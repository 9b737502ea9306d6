"""Convert a pretrain_gpt.py checkpoint offline: to another tensor/pipeline-parallel layout and between formats.

Megatron-LM's ``tools/checkpoint/convert.py`` flags where they exist (``--load-dir``, ``--save-dir``,
``--target-tensor-parallel-size``, ``--target-pipeline-parallel-size``, ``--true-vocab-size``); the
format is chosen with ``--target-ckpt-format`` (``torch``: the legacy layout, one file per tensor and
pipeline rank; ``torch_dist``: torch.distributed.checkpoint files written with ``megatron.core.dist_checkpointing``,
every tensor whole under its layout-free key, which training loads at any TP/PP/DP layout and vocabulary
padding). The source format is detected from the folder. Everything is read into this one process's
memory (about the checkpoint's size).

What is converted, exactly (no arithmetic on any value):

- model weights: tensor-parallel shards are merged and re-split by the rules of
  ``legacy_checkpoint`` (column-, row- and vocabulary-parallel weights, SwiGLU halves), layers are
  renumbered over the pipeline stages (and interleaved virtual stages) of the target layout, the
  tied output weight of the last stage is rebuilt from the word embedding;
- optimizer state of the FP32, mixed-precision and distributed optimizers: Adam moments (any
  per-param tensor of the param's shape) and fp32 main params follow the sharding of their param,
  the param groups are rebuilt per target rank with the source's hyper-parameters. The distributed
  optimizer's ``distrib_optim.pt`` (flat buffers with a ``param_index_map``) is read per parameter and
  written as the non-distributed optimizer's state (torch format: load it without
  ``--use-distributed-optimizer``) or under torch_dist's global keys (which a distributed optimizer
  loads at any data-parallel size);
- iteration, consumed samples (in ``args``), FLOPs so far, the learning-rate scheduler, the grad scaler;
- mixture of experts: the legacy files of the expert-parallel ranks (``mp_rank_*_{ep:03d}``) are merged, each
  local expert taking its global index, and split again for ``--target-expert-model-parallel-size``
  (``expert_ranks.py``); expert linears split over TP as the dense MLP's (the expert tensor-parallel size being
  the tensor-parallel size); torch_dist holds them on its expert axis (Megatron core_v0.14's keys).

What is not: the RNG states, which belong to one (tensor, pipeline) rank and have no counterpart at
another layout. They are kept only when the layout does not change (between formats: without data
parallelism); otherwise load the result with ``--no-load-rng`` (a torch_dist result loads without it
and keeps the seeded RNG, with a warning).

When the target tensor-parallel size of a torch-format output changes the padded vocabulary size (``--make-vocab-size-divisible-by``
x TP) the embedding and output rows are cut, or extended by repeating the last row (Megatron's rule;
their Adam moments are zero-filled); the padded rows take part in the softmax, so the loss then
moves slightly. The true vocabulary size comes from ``--true-vocab-size`` or the checkpoint's tokenizer.

The source's files are checked against its integrity manifest first (``--no-verify-checkpoint`` skips
it). The output is published as training publishes a save: every file goes to a hidden temporary folder
inside ``--save-dir``, gets an integrity manifest and is fsynced, the folder becomes ``iter_XXXXXXX``
(or ``release``), and the tracker file is replaced last.

Usage::

    python tools/checkpoint/convert.py --load-dir CKPT --save-dir OUT --target-tensor-parallel-size 1 \\
        --target-pipeline-parallel-size 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from full_checkpoint import (  # noqa: E402
    EMBEDDING,
    TIED_OUTPUT,
    VOCAB_KEYS,
    ConvertError,
    FullCheckpoint,
    OptimizerState,
    TargetLayout,
    global_key,
    group_signature,
    is_buffer,
    is_tied,
    layer_of,
    local_key,
    rank_optimizer,
    target_args,
)
from legacy_checkpoint import (  # noqa: E402
    CheckpointLayoutError,
    _merge_tp,
    _rank_files,
    find_iteration_dir,
    split_tp,
)
from torch_dist_checkpoint import read_torch_dist, write_torch_dist  # noqa: E402
import expert_ranks  # noqa: E402
from megatron.core.optimizer import param_group_key  # noqa: E402
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts, pipeline_layer_offset  # noqa: E402
from megatron.training.checkpointing import (  # noqa: E402
    MODEL_SHAPE_ARGS,
    durable,
    integrity,
    layout,
    legacy_optimizer_state,
    load_state_dict_file,
    manifest,
    saved_args,
)
from megatron.training.checkpointing.errors import is_checkpoint_user_error  # noqa: E402
from megatron.training.user_errors import one_line  # noqa: E402


def _source_format(load_dir: str, iteration: Optional[int] = None) -> str:
    """The format of the iteration folder to read, by ``layout.detect_format`` (the project's one rule).

    Raises ConvertError naming ``--load-dir`` when the folder is a checkpoint of neither format.
    """
    try:
        iteration_dir = find_iteration_dir(load_dir, iteration)
    except CheckpointLayoutError as error:
        raise ConvertError(str(error).replace("--load ", "--load-dir ")) from None
    found = layout.detect_format(iteration_dir)
    if found is None:
        raise ConvertError(f"--load-dir {load_dir}: {iteration_dir} holds neither {layout.RANK_DIR_PREFIX}* folders "
                           f"(--ckpt-format torch) nor a {layout.METADATA_FILENAME} file (--ckpt-format torch_dist)")
    return found


# ----------------------------------------------------------------------------------------------- read


def _chunks_of(checkpoint: dict, path: str) -> List[dict]:
    if "model" in checkpoint:
        return [checkpoint["model"]]
    chunks = []
    while f"model{len(chunks)}" in checkpoint:
        chunks.append(checkpoint[f"model{len(chunks)}"])
    if not chunks:
        raise ConvertError(f"{path}: no 'model' (or 'model0', 'model1', ...) entry")
    return chunks


def _optimizer_kind(optimizer: Any) -> Optional[str]:
    if not isinstance(optimizer, dict):
        return None
    if "state" in optimizer and "param_groups" in optimizer:
        return "fp32"
    if "fp32_from_fp16_params" in optimizer and isinstance(optimizer.get("optimizer"), dict):
        return "float16"
    return "distributed"


def _strip_chunk_prefix(name: str, vp: int) -> Tuple[int, str]:
    if vp == 1:
        return 0, name
    head, _, rest = name.partition(".")
    if not head.startswith("model") or not head[5:].isdigit():
        raise ConvertError(f"optimizer param name {name!r} lacks the model<i>. prefix of {vp} model chunks")
    return int(head[5:]), rest


def read_legacy(load_dir: str, iteration: Optional[int] = None, with_optimizer: bool = True) -> FullCheckpoint:
    """Read every rank of a legacy ('torch' format) checkpoint into one FullCheckpoint.

    Raises ConvertError (naming the folder or file) for a missing or incomplete checkpoint, and the
    errors of ``megatron.training.checkpointing.load_state_dict_file`` for an unreadable file.
    """
    context = f"--load-dir {load_dir}"
    try:
        iteration_dir = find_iteration_dir(load_dir, iteration)
        ep, ep_args = expert_ranks.expert_parallel_size(iteration_dir)
        files = _rank_files(iteration_dir) if ep == 1 else expert_ranks.rank_files(iteration_dir, ep_args)
    except CheckpointLayoutError as error:
        raise ConvertError(str(error).replace("--load ", "--load-dir ")) from None
    loaded = {rank: load_state_dict_file(path, context) for rank, path in files.items()}
    if ep > 1:  # one file per (tp, pp) rank, its experts numbered globally
        _check_expert_tp(ep_args, files)
        loaded, files = expert_ranks.merge(
            loaded, files, int(ep_args.num_experts),
            lambda optimizer, chunks, path: _named_rank_optimizer(optimizer, chunks, ep_args, path))
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    for rank, checkpoint in loaded.items():
        saved_args(checkpoint, files[rank], context, MODEL_SHAPE_ARGS)  # each a dict; args (if any) a Namespace
    first = loaded[(0, 0)]
    args = first.get("args")
    if args is None:
        raise ConvertError(f"{files[(0, 0)]}: no saved 'args' (the model shape is unknown)")
    swiglu = bool(getattr(args, "swiglu", False))
    chunks = {rank: _chunks_of(ckpt, files[rank]) for rank, ckpt in loaded.items()}
    vp = len(chunks[(0, 0)])
    counts = [[1 + max([layer_of(k) for k in chunks[(0, p)][v] if layer_of(k) is not None], default=-1)
               for v in range(vp)] for p in range(pp)]
    if sum(map(sum, counts)) != args.num_layers:
        raise ConvertError(f"{iteration_dir}: its stages hold {sum(map(sum, counts))} layers, the saved args say "
                           f"--num-layers {args.num_layers}")
    release = os.path.basename(iteration_dir) == layout.RELEASE_DIRNAME
    full = FullCheckpoint(model={}, args=args, iteration=0 if release else int(first.get("iteration", 0)),
                          release=release, layout={"tp": tp, "pp": pp, "vp": vp, "counts": counts, "ep": ep},
                          scheduler=first.get("opt_param_scheduler"),
                          num_floating_point_operations_so_far=first.get("num_floating_point_operations_so_far", 0))
    if all("rng_state" in ckpt for ckpt in loaded.values()):
        full.rng_states = {rank: ckpt["rng_state"] for rank, ckpt in loaded.items()}
    elif ep > 1:
        full.notes.append("the RNG states belong to the source's expert-parallel ranks and were not converted: load "
                          "the result with --no-load-rng")

    # Blocks in model order (chunk-major, see pipeline_layout), so the full dict keeps the model's order.
    blocks = [(p, v) for v in range(vp) for p in range(pp)]
    tied_last = is_tied(args) and pp > 1
    for p, v in blocks:
        offset = pipeline_layer_offset(counts, p, v)
        merged = _merge_tp([chunks[(t, p)][v] for t in range(tp)], swiglu)
        for key, value in merged.items():
            if key == TIED_OUTPUT and tied_last:
                continue  # the last stage's copy of the tied embedding
            full.model.setdefault(global_key(key, offset), value)

    if with_optimizer:
        full.optimizer = _read_optimizer(loaded, files, chunks, full, swiglu)
    return full


def _check_expert_tp(args, files) -> None:
    """Expert weights are merged and split over TP as the dense MLP's: refuse another expert tensor-parallel size."""
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp not in (None, args.tensor_model_parallel_size):
        raise ConvertError(f"{os.path.dirname(os.path.dirname(next(iter(files.values()))))}: saved with "
                           f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size "
                           f"{args.tensor_model_parallel_size}, which this tool does not convert")


def _read_optimizer(loaded, files, chunks, full: FullCheckpoint, swiglu: bool) -> Optional[OptimizerState]:
    tp, pp, vp, counts = (full.layout[k] for k in ("tp", "pp", "vp", "counts"))
    kinds = {_optimizer_kind(ckpt.get("optimizer")) for ckpt in loaded.values()}
    has_distrib = any(os.path.isfile(layout.get_distributed_optimizer_checkpoint_name(path))
                      for path in files.values())
    if kinds == {None}:
        full.notes.append("the source holds no optimizer state (saved with --no-save-optim): load the result with "
                          "--no-load-optim")
        return None
    if has_distrib or "distributed" in kinds:
        try:
            for rank, path in files.items():
                loaded[rank] = dict(loaded[rank], optimizer=_plain_from_distributed(
                    loaded[rank].get("optimizer"), layout.get_distributed_optimizer_checkpoint_name(path),
                    chunks[rank], full.args))
        except ConvertError as error:
            full.notes.append(f"the distributed optimizer's state was not converted ({error}): the optimizer state and "
                              "the learning-rate scheduler were dropped, load the result with --no-load-optim")
            full.scheduler = None
            return None
        kinds = {_optimizer_kind(ckpt.get("optimizer")) for ckpt in loaded.values()}
    if len(kinds) != 1:
        raise ConvertError(f"{os.path.dirname(os.path.dirname(files[(0, 0)]))}: its ranks hold optimizer states of "
                           f"different kinds ({sorted(map(str, kinds))})")
    kind = kinds.pop()
    state = OptimizerState(kind=kind, param_state={}, groups=[], group_of={}, main_params={} if kind == "float16"
                           else None)
    group_index: Dict[tuple, int] = {}
    tied_last = is_tied(full.args) and pp > 1
    for p, v in [(p, v) for v in range(vp) for p in range(pp)]:
        offset = pipeline_layer_offset(counts, p, v)
        per_rank = []  # per TP rank: {local key: {state key: tensor}}, {local key: main param}
        for t in range(tp):
            optimizer = _named_rank_optimizer(loaded[(t, p)]["optimizer"], chunks[(t, p)], full.args, files[(t, p)])
            inner = optimizer if kind == "fp32" else optimizer["optimizer"]
            if not all(isinstance(name, str) for g in inner["param_groups"] for name in g["params"]):
                raise ConvertError(f"{files[(t, p)]}: the optimizer state is keyed by position, not by param name "
                                   "(saved by an older version); convert with --no-save-optim")
            param_state, mains = {}, {}
            for g_index, group in enumerate(inner["param_groups"]):
                masters = optimizer["fp32_from_fp16_params"][g_index] if kind == "float16" else None
                if masters is not None and len(masters) != len(group["params"]):
                    raise ConvertError(f"{files[(t, p)]}: param group {g_index} has {len(group['params'])} params but "
                                       f"{len(masters)} fp32 main params (fp32 params mixed into a bf16/fp16 model); "
                                       "convert with --no-save-optim")
                for position, name in enumerate(group["params"]):
                    chunk, local = _strip_chunk_prefix(name, vp)
                    if chunk != v:
                        continue
                    param_state[local] = inner["state"].get(name, {})
                    if masters is not None:
                        mains[local] = masters[position]
                    if t == 0:
                        template = {k: val for k, val in group.items() if k != "params"}
                        signature = tuple(template.get(k) for k in ("wd_mult", "lr_mult", "is_expert_parallel",
                                                                    "is_decoupled_lr"))
                        if signature not in group_index:
                            group_index[signature] = len(state.groups)
                            state.groups.append(template)
                        global_name = global_key(local, offset)
                        if not (tied_last and local == TIED_OUTPUT):
                            state.group_of.setdefault(global_name, group_index[signature])
            per_rank.append((param_state, mains))
        _merge_optimizer_block(state, per_rank, offset, chunks[(0, p)][v], swiglu, tied_last)
    if kind == "float16":
        state.grad_scaler = loaded[(0, 0)]["optimizer"].get("grad_scaler")
    return state


def _plain_from_distributed(optimizer: Any, path: str, rank_chunks: List[dict], args) -> dict:
    """One rank's distributed-optimizer state (the rank file's groups and scaler plus
    ``distrib_optim.pt``'s flat buffers with their ``param_index_map``) as the name-keyed state dict of the
    non-distributed optimizer of the same precision (FP32Optimizer, or Float16OptimizerWithFloat16Params
    with the buffers' fp32 ``param`` as main params). Param groups are rebuilt by the weight-decay rule.

    Raises ConvertError naming the file when it is missing or does not match the model.
    """
    if not os.path.isfile(path):
        raise ConvertError(f"{path} does not exist")
    flat = load_state_dict_file(path)
    index_map = flat.get("param_index_map") if isinstance(flat, dict) else None
    if not index_map or not flat.get("buckets_coalesced"):
        raise ConvertError(f"{path} is not in the coalesced-buckets layout with a param_index_map")
    saved_groups = optimizer["optimizer"]["param_groups"]
    index_of = {}
    for index, group in enumerate(saved_groups):
        index_of.setdefault(param_group_key(group), index)
    vp = len(rank_chunks)
    low_precision = any(torch.is_tensor(v) and v.dtype in (torch.float16, torch.bfloat16)
                        for chunk in rank_chunks for v in chunk.values())
    members: Dict[int, List[str]] = {}
    state, mains = {}, {}
    for buffer_index, ranges in index_map.items():
        (world,) = flat[buffer_index].values()
        for name, (start, end) in ranges.items():
            chunk, local = _strip_chunk_prefix(name, vp)
            if local not in rank_chunks[chunk]:
                raise ConvertError(f"{path}: parameter {name} is not in the model state")
            shape = rank_chunks[chunk][local].shape
            if end - start != shape.numel():
                raise ConvertError(f"{path}: parameter {name} has {end - start} elements, the model {shape.numel()}")
            signature = group_signature(local, len(shape), args)
            if signature not in index_of:
                raise ConvertError(f"{path}: parameter {name} fits none of the saved param groups")
            group = index_of[signature]
            members.setdefault(group, []).append(name)
            entry = {key: world[key][start:end].view(shape).clone() for key in ("exp_avg", "exp_avg_sq")}
            step = saved_groups[group].get("step")
            if step is not None:
                entry = {"step": torch.tensor(float(step), dtype=torch.float32), **entry}
            state[name] = entry
            mains[name] = world["param"][start:end].view(shape).clone()
    groups = [{**{k: v for k, v in saved_groups[i].items() if k != "step"}, "params": members[i]}
              for i in sorted(members)]
    inner = {"state": state, "param_groups": groups}
    if not low_precision:
        return inner
    result = {"optimizer": inner, "fp32_from_fp16_params": [[mains[n] for n in g["params"]] for g in groups]}
    if "grad_scaler" in optimizer:
        result["grad_scaler"] = optimizer["grad_scaler"]
    return result


def _merge_optimizer_block(state: OptimizerState, per_rank, offset: int, model_chunk: dict, swiglu: bool,
                           tied_last: bool) -> None:
    """Merge one block's TP shards of every per-param tensor (those shaped like the param) into ``state``."""
    for local in per_rank[0][0]:
        if tied_last and local == TIED_OUTPUT:
            continue
        shape = tuple(model_chunk[local].shape)
        entry = {}
        for key, value in per_rank[0][0][local].items():
            if torch.is_tensor(value) and tuple(value.shape) == shape:
                entry[key] = _merge_tp([{local: rank[0][local][key]} for rank in per_rank], swiglu)[local]
            else:
                entry[key] = value  # Adam's step and other per-param scalars are the same on every TP rank
        state.param_state[global_key(local, offset)] = entry
        if state.main_params is not None:
            state.main_params[global_key(local, offset)] = _merge_tp(
                [{local: rank[1][local]} for rank in per_rank], swiglu)[local]


def read_checkpoint(load_dir: str, iteration: Optional[int] = None, with_optimizer: bool = True,
                    verify: bool = True) -> FullCheckpoint:
    """Read a checkpoint of either format (detected) as one FullCheckpoint (see :func:`read_legacy`).

    With ``verify`` the files are first checked against the checkpoint's integrity manifest (size and
    CRC-32; checkpoints written without one are read as they are): ConvertError names a damaged file. A
    ValueError of the readers (content that breaks the layout's rules) is raised as a ConvertError.
    """
    if not os.path.isdir(load_dir):
        raise ConvertError(f"--load-dir {load_dir}: no such directory")
    ckpt_format = _source_format(load_dir, iteration)
    if verify:
        problems, _ = manifest.verify_directory(find_iteration_dir(load_dir, iteration))
        if problems:
            raise ConvertError(f"--load-dir {load_dir}: the checkpoint does not match its "
                               f"{layout.MANIFEST_FILENAME}: {'; '.join(problems[:5])}")
    try:
        if ckpt_format == "torch":
            return read_legacy(load_dir, iteration, with_optimizer)
        return read_torch_dist(load_dir, iteration, with_optimizer)
    except ConvertError:
        raise
    except ValueError as error:  # the checkpoint's content does not fit its rules (a malformed or hostile file)
        raise ConvertError(str(error)) from error


def _named_rank_optimizer(optimizer: dict, rank_chunks: List[dict], args, path: str) -> dict:
    """One rank's optimizer state keyed by param name, from Megatron's positional layout.

    Names come from torch's per-group ``param_names`` when present; otherwise (a Megatron-LM file)
    from the rank's model state-dict order grouped by ``group_signature``, which is how the writer
    discovered its params (see megatron.training.legacy_optimizer_state).
    """
    keys, shapes, groups = [], {}, {}
    for v, chunk in enumerate(rank_chunks):
        for key, value in chunk.items():
            if not torch.is_tensor(value) or key.endswith("._extra_state") or is_buffer(key):
                continue
            name = f"model{v}.{key}" if len(rank_chunks) > 1 else key
            keys.append(name)
            shapes[name] = value.shape
            groups.setdefault(group_signature(key, value.dim(), args), []).append(name)
    inner = optimizer.get("optimizer", optimizer) if isinstance(optimizer, dict) else None
    saved_groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
    if saved_groups and all("param_names" in group for group in saved_groups):
        groups = {legacy_optimizer_state.group_identity(group) or i: list(group["param_names"])
                  for i, group in enumerate(saved_groups)}
    try:
        return legacy_optimizer_state.to_named_layout(optimizer, list(groups.values()), list(groups.keys()), keys,
                                                      shapes, path)
    except legacy_optimizer_state.OptimizerStateMismatch as error:
        raise ConvertError(f"{error} (convert with --no-save-optim)".replace(
            "; use --no-load-optim to start the optimizer afresh", "")) from None


# ----------------------------------------------------------------------------------------------- relayout


def plan_target(full: FullCheckpoint, tp: Optional[int], pp: Optional[int], vp: Optional[int] = None,
                first: Optional[int] = None, last: Optional[int] = None, ep: Optional[int] = None) -> TargetLayout:
    """Check the target layout against the model; fills ``counts``.

    Raises ConvertError naming the ``--target-*`` flag and the model flag it does not divide.
    """
    args = full.args
    tp = full.layout["tp"] if tp is None else tp
    pp = full.layout["pp"] if pp is None else pp
    vp = 1 if vp is None else vp
    for flag, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-parallel-size", pp),
                        ("--target-num-virtual-stages-per-pipeline-rank", vp)):
        if value < 1:
            raise ConvertError(f"{flag} must be >= 1, got {value}")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * args.hidden_size
    for name, value in (("--num-attention-heads", heads), ("--num-query-groups", groups),
                        ("--ffn-hidden-size", ffn)):
        if value % tp:
            raise ConvertError(f"--target-tensor-parallel-size {tp}: the checkpoint's {name} {value} is not "
                               f"divisible by {tp}")
    account = (bool(getattr(args, "account_for_embedding_in_pipeline_split", False)) and pp > 1,
               bool(getattr(args, "account_for_loss_in_pipeline_split", False)) and pp > 1)
    try:
        counts = pipeline_layer_counts(args.num_layers, pp, vp if vp > 1 else None, first, last, *account)
    except ValueError as error:
        raise ConvertError(f"--target-pipeline-parallel-size {pp} (--target-num-virtual-stages-per-pipeline-rank "
                           f"{vp}): the checkpoint's --num-layers {args.num_layers} do not split: {error}") from None
    experts = getattr(args, "num_experts", None) or 0
    ep = (full.layout.get("ep") or int(getattr(args, "expert_model_parallel_size", 1) or 1)) if ep is None else ep
    if ep < 1 or (experts and experts % ep) or (not experts and ep != 1):
        raise ConvertError(f"--target-expert-model-parallel-size {ep}: the checkpoint's --num-experts "
                           f"{experts or None} is not divisible by it")
    if experts and ep > 1 and getattr(args, "expert_tensor_parallel_size", None) not in (None, tp):
        raise ConvertError(f"--target-expert-model-parallel-size {ep}: the checkpoint's --expert-tensor-parallel-size "
                           f"{args.expert_tensor_parallel_size} differs from the tensor-parallel size {tp}")
    return TargetLayout(tp=tp, pp=pp, vp=vp, first=first, last=last, counts=counts, ep=ep)


def _padded_vocab_size(true_vocab_size: int, args, tp: int) -> int:
    multiple = getattr(args, "make_vocab_size_divisible_by", 128) * tp
    return -(-true_vocab_size // multiple) * multiple


def true_vocab_size_of(args, given: Optional[int]) -> int:
    """``given`` (--true-vocab-size) or the vocabulary size of the checkpoint's tokenizer.

    Raises ConvertError asking for --true-vocab-size when the tokenizer cannot be rebuilt.
    """
    if given is not None:
        return given
    from megatron.training.tokenizer import build_tokenizer

    tokenizer_args = argparse.Namespace(**vars(args))
    tokenizer_args.rank = 1  # silences build_tokenizer's messages
    try:
        return build_tokenizer(tokenizer_args).vocab_size
    except Exception as error:  # missing files, an uninstalled tokenizer library...
        raise ConvertError(f"the padded vocabulary size changes with the tensor-parallel size and the checkpoint's "
                           f"tokenizer cannot be rebuilt ({type(error).__name__}: {error}); give --true-vocab-size"
                           ) from None


def _resize_rows(value: torch.Tensor, rows: int, fill: str) -> torch.Tensor:
    if value.size(0) >= rows:
        return value[:rows].clone()
    extra = rows - value.size(0)
    pad = value[-1:].expand(extra, *value.shape[1:]) if fill == "repeat" else value.new_zeros(extra, *value.shape[1:])
    return torch.cat([value, pad], dim=0)


def resize_vocab(full: FullCheckpoint, padded: int) -> None:
    """Cut or extend the padded vocabulary rows of the embedding and output weights to ``padded``
    (weights and main params repeat their last row, optimizer moments are zero-filled)."""
    current = full.model[EMBEDDING].size(0)
    if padded == current:
        return
    for key in VOCAB_KEYS:
        if torch.is_tensor(full.model.get(key)):
            full.model[key] = _resize_rows(full.model[key], padded, "repeat")
            if full.optimizer is not None:
                entry = full.optimizer.param_state.get(key, {})
                for name, value in entry.items():
                    if torch.is_tensor(value) and value.dim() == 2 and value.size(0) == current:
                        entry[name] = _resize_rows(value, padded, "zeros")
                if full.optimizer.main_params is not None and key in full.optimizer.main_params:
                    full.optimizer.main_params[key] = _resize_rows(full.optimizer.main_params[key], padded, "repeat")
    full.notes.append(f"the padded vocabulary changed from {current} to {padded} rows (the padded rows take part in "
                      "the softmax, so the loss moves slightly)")
    full.args.padded_vocab_size = padded


def _block_keys(full: FullCheckpoint, target: TargetLayout, p: int, v: int) -> List[Tuple[str, str]]:
    """``[(local key, full key)]`` of block (p, v) at the target layout, in the model's order."""
    first_block = p == 0 and v == 0
    last_block = p == target.pp - 1 and v == target.vp - 1
    offset = pipeline_layer_offset(target.counts, p, v)
    end = offset + target.counts[p][v]
    keys = []
    for key in full.model:
        layer = layer_of(key)
        if layer is not None:
            if offset <= layer < end:
                keys.append((local_key(key, offset), key))
        elif key.startswith("embedding."):
            if first_block:
                keys.append((key, key))
        elif key.startswith("decoder.final_layernorm") or key.startswith("output_layer."):
            if last_block:
                keys.append((key, key))
        else:
            raise ConvertError(f"state-dict key {key!r} belongs to no known part of GPTModel; this tool cannot "
                               "place it on a pipeline stage")
    if last_block and is_tied(full.args) and not first_block:
        keys.append((TIED_OUTPUT, EMBEDDING))  # the tied output weight: a copy of the word embedding
        # keep the model's order: output_layer.weight before output_layer._extra_state
        keys.sort(key=lambda pair: (pair[0].startswith("output_layer."), pair[0] == "output_layer._extra_state"))
    return keys


def build_rank_state_dicts(full: FullCheckpoint, target: TargetLayout, keep_rng: bool
                           ) -> Dict[Tuple[int, int], dict]:
    """The legacy per-rank dicts ``{(tp rank, pp rank): {...}}`` of ``full`` at ``target``.

    Raises ValueError (from ``split_tp``) when a weight does not divide by the target TP.
    """
    args = target_args(full, target)
    swiglu = bool(getattr(args, "swiglu", False))
    out = {(t, p): {"args": args, "checkpoint_version": layout.CHECKPOINT_VERSION, "iteration": full.iteration}
           for t in range(target.tp) for p in range(target.pp)}
    optimizer = full.optimizer
    per_rank_params: Dict[Tuple[int, int], List[Tuple[str, str, Dict[str, Any], Optional[torch.Tensor]]]] = {
        rank: [] for rank in out}
    for p in range(target.pp):
        for v in range(target.vp):
            keys = _block_keys(full, target, p, v)
            shards = split_tp({local: full.model[src] for local, src in keys}, target.tp, swiglu)
            prefix = f"model{v}." if target.vp > 1 else ""
            for t in range(target.tp):
                out[(t, p)]["model" if target.vp == 1 else f"model{v}"] = shards[t]
            if optimizer is None:
                continue
            trainable = [(local, src) for local, src in keys if src in optimizer.param_state]
            per_key: Dict[str, List[dict]] = {}
            for state_key in {k for _, src in trainable for k in optimizer.param_state[src]}:
                tensors = {local: optimizer.param_state[src][state_key] for local, src in trainable
                           if torch.is_tensor(optimizer.param_state[src].get(state_key))
                           and tuple(optimizer.param_state[src][state_key].shape) == tuple(full.model[src].shape)}
                per_key[state_key] = split_tp(tensors, target.tp, swiglu)
            mains = None
            if optimizer.main_params is not None:
                mains = split_tp({local: optimizer.main_params[src] for local, src in trainable}, target.tp, swiglu)
            for t in range(target.tp):
                for local, src in trainable:
                    entry = {}
                    for state_key, value in optimizer.param_state[src].items():
                        split = per_key[state_key][t]
                        entry[state_key] = split[local] if local in split else (
                            value.clone() if torch.is_tensor(value) else value)
                    per_rank_params[(t, p)].append(
                        (prefix + local, src, entry, mains[t][local] if mains is not None else None))
    for rank, rank_dict in out.items():
        if optimizer is not None:
            rank_dict["optimizer"] = rank_optimizer(optimizer, per_rank_params[rank])
        if full.scheduler is not None and optimizer is not None:
            rank_dict["opt_param_scheduler"] = full.scheduler
        if keep_rng and full.rng_states is not None:
            rank_dict["rng_state"] = full.rng_states[rank]
        rank_dict["num_floating_point_operations_so_far"] = full.num_floating_point_operations_so_far
    if target.ep > 1:  # one file per expert-parallel rank too: (tp, pp, ep)
        out = {(t, p, e): part for (t, p), rank_dict in out.items()
               for e, part in enumerate(expert_ranks.split(rank_dict, target.ep, int(full.args.num_experts)))}
    for rank_dict in out.values():
        if rank_dict.get("optimizer") is not None:
            rank_dict["optimizer"] = legacy_optimizer_state.to_megatron_layout(rank_dict["optimizer"])
    return out


# ----------------------------------------------------------------------------------------------- write


def write_legacy(full: FullCheckpoint, save_dir: str, target: TargetLayout, keep_rng: bool) -> str:
    """Write ``full`` at ``target`` in the legacy layout under ``save_dir``, atomically; returns the
    iteration folder. An existing folder of the same iteration is replaced; the tracker moves last."""
    rank_dicts = build_rank_state_dicts(full, target, keep_rng)
    dirname = layout.iteration_dirname(full.iteration, full.release)
    integrity.prepare_save_dir(save_dir)
    tmp_dir = os.path.join(save_dir, f".{dirname}.tmp-{os.getpid()}")
    final_dir = os.path.join(save_dir, dirname)
    try:
        for rank, state_dict in rank_dicts.items():
            t, p, e = (*rank, 0)[:3]
            rank_dir = layout.rank_dirname(t, p, pipeline_parallel=target.pp > 1, expert_rank=e,
                                           expert_parallel=target.ep > 1)
            durable.write_durably(state_dict, os.path.join(tmp_dir, rank_dir, layout.CHECKPOINT_BASENAME))
        # The same publish as training's save: manifest, fsync, directory swap, tracker last.
        integrity.publish_iteration(save_dir, tmp_dir, full.iteration, release=full.release)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return final_dir


def _same_layout(full: FullCheckpoint, target: TargetLayout) -> bool:
    return (full.layout["tp"], full.layout["pp"], full.layout["counts"], full.layout.get("ep", 1)) == (
        target.tp, target.pp, target.counts, target.ep)


def convert(cli: argparse.Namespace) -> dict:
    """Run a conversion described by the parsed command line; returns a summary.

    Raises ConvertError (bad flag or folder), CheckpointReadError / pickle.UnpicklingError (a
    damaged or unsafe source file, named).
    """
    if cli.target_ckpt_format not in layout.CKPT_FORMATS:
        raise ConvertError(f"--target-ckpt-format {cli.target_ckpt_format!r}: choose one of "
                           f"{', '.join(layout.CKPT_FORMATS)}")
    if os.path.abspath(cli.load_dir) == os.path.abspath(cli.save_dir):
        raise ConvertError(f"--save-dir {cli.save_dir} is the --load-dir: write the converted checkpoint elsewhere")
    source_format = _source_format(cli.load_dir, cli.ckpt_step) if os.path.isdir(cli.load_dir) else None
    full = read_checkpoint(cli.load_dir, cli.ckpt_step, with_optimizer=not cli.no_save_optim,
                           verify=not cli.no_verify_checkpoint)
    if cli.no_save_optim:
        full.scheduler = None
    target = plan_target(full, cli.target_tensor_parallel_size, cli.target_pipeline_parallel_size,
                         cli.target_num_virtual_stages_per_pipeline_rank, cli.target_decoder_first_pipeline_num_layers,
                         cli.target_decoder_last_pipeline_num_layers, cli.target_expert_model_parallel_size)
    to_legacy = cli.target_ckpt_format == "torch"
    # torch_dist loads any vocabulary padding (the rows both sides have); the legacy format needs the target's.
    if to_legacy and target.tp != full.layout["tp"]:
        true_vocab = true_vocab_size_of(full.args, cli.true_vocab_size)
        resize_vocab(full, _padded_vocab_size(true_vocab, full.args, target.tp))
    # RNG states are per (tensor, pipeline) rank: kept only at the same layout (and, in torch_dist, for one
    # data-parallel rank, whose global ranks are then known).
    keep_rng = full.rng_states is not None and _same_layout(full, target) and (
        to_legacy or int(getattr(full.args, "data_parallel_size", 1) or 1) == 1)
    if full.rng_states is not None and not keep_rng:
        full.notes.append("the RNG states belong to the source's (tensor, pipeline) ranks and were not converted: "
                          + ("load the result with --no-load-rng" if to_legacy else
                             "a load keeps the seeded RNG (with a warning)"))
    try:
        if cli.target_ckpt_format == "torch":
            written = write_legacy(full, cli.save_dir, target, keep_rng)
        else:
            written = write_torch_dist(full, cli.save_dir, target, keep_rng)
    except ValueError as error:
        raise ConvertError(f"--target-tensor-parallel-size {target.tp}: {error}") from None
    return {"from": dict(full.layout, format=source_format),
            "to": {"tp": target.tp, "pp": target.pp, "vp": target.vp, "counts": target.counts, "ep": target.ep,
                   "format": cli.target_ckpt_format},
            "iteration": "release" if full.release else full.iteration, "written": written,
            "optimizer": full.optimizer is not None, "rng": keep_rng,
            "notes": full.notes}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model-type", default="GPT", choices=["GPT"], help="model type (only GPT)")
    parser.add_argument("--load-dir", required=True,
                        help="checkpoint folder to read (written by pretrain_gpt.py --save)")
    parser.add_argument("--save-dir", required=True, help="folder to write the converted checkpoint to")
    parser.add_argument("--ckpt-step", "--iteration", dest="ckpt_step", type=int, default=None,
                        help="iteration to convert (default: the one the tracker file names)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="tensor-parallel size of the output (default: the source's)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="pipeline-parallel size of the output (default: the source's)")
    parser.add_argument("--target-expert-model-parallel-size", type=int, default=None,
                        help="expert-parallel size of the output (MoE; legacy files per expert-parallel rank; "
                             "default: the source's)")
    parser.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, default=None,
                        help="interleaved virtual pipeline stages per pipeline rank of the output (default: 1)")
    parser.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                        help="layers of the output's first pipeline stage (uneven split)")
    parser.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                        help="layers of the output's last pipeline stage (uneven split)")
    parser.add_argument("--target-ckpt-format", default="torch",
                        help=f"format of the output, one of {', '.join(layout.CKPT_FORMATS)} (default: torch)")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="unpadded vocabulary size, needed when TP changes the padding and the checkpoint's "
                             "tokenizer files cannot be found (default: from the tokenizer)")
    parser.add_argument("--no-verify-checkpoint", action="store_true",
                        help="do not check the source's files against its integrity manifest (CRC-32)")
    parser.add_argument("--no-save-optim", action="store_true",
                        help="do not convert the optimizer state and scheduler (load the result with --no-load-optim)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tool; 0 on success, 1 with one ``error:`` line on a user error."""
    cli = get_args(argv)
    try:
        summary = convert(cli)
    except Exception as error:  # a bad flag, or a checkpoint missing, damaged, unsafe or of another model
        if not isinstance(error, ConvertError) and not is_checkpoint_user_error(error):
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 1
    source, target = summary["from"], summary["to"]
    source_ep = f" EP={source['ep']}" if source.get("ep", 1) != 1 or target["ep"] != 1 else ""
    target_ep = f" EP={target['ep']}" if source_ep else ""
    print(f"converted iteration {summary['iteration']} from {source['format']} TP={source['tp']} PP={source['pp']} "
          f"VP={source['vp']}{source_ep} to {target['format']} TP={target['tp']} PP={target['pp']} VP={target['vp']}"
          f"{target_ep} "
          f"in {summary['written']} (optimizer state: {'converted' if summary['optimizer'] else 'not converted'}; "
          f"RNG state: {'kept' if summary['rng'] else 'not kept'})")
    for note in summary["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
