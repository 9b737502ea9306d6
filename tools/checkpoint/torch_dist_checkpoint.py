"""Read and write a torch_dist checkpoint whole, in this one process, as the converter's FullCheckpoint.

The files are torch.distributed.checkpoint's, written and read with ``megatron.core.dist_checkpointing``:
every tensor whole under its layout-free key (Megatron's layer-stacked keys; the earlier per-layer
layout is read too), beside the common state (args, counters, scheduler, optimizer hyper-parameters) and,
for one data-parallel rank, the RNG states of each rank; every file name and record comes from
``megatron.training.checkpointing.layout``.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import warnings
from typing import Any, Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from full_checkpoint import (  # noqa: E402
    TIED_OUTPUT,
    ConvertError,
    FullCheckpoint,
    OptimizerState,
    TargetLayout,
    group_signature,
    is_buffer,
    is_tied,
    layer_of,
    rank_optimizer,
    target_args,
)
from legacy_checkpoint import _LAYER_KEY, find_iteration_dir  # noqa: E402
from megatron.core.dist_checkpointing import model_and_optimizer as mo  # noqa: E402
from megatron.core.optimizer import param_group_key  # noqa: E402
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts  # noqa: E402
from megatron.training.checkpointing import (  # noqa: E402
    MODEL_SHAPE_ARGS,
    durable,
    integrity,
    layout,
    load_state_dict_file,
    saved_args,
)

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"

_LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
# A layer's state-dict keys in GPTModel's (and Megatron's local spec's) module order (others follow, sorted).
_LAYER_ORDER = ["input_layernorm.weight", "input_layernorm.bias"]
for _module in ("self_attention.linear_proj", "self_attention.linear_qkv"):
    _LAYER_ORDER += [f"{_module}.weight", f"{_module}.bias", f"{_module}._extra_state"]
_LAYER_ORDER += ["self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                 "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
                 "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"]
for _module in ("mlp.linear_fc1", "mlp.linear_fc2"):
    _LAYER_ORDER += [f"{_module}.weight", f"{_module}.bias", f"{_module}._extra_state"]


_MOE_PART = re.compile(r"^mlp\.(?:(router)\.(weight|expert_bias)|experts\.local_experts\.(\d+)\.(linear_fc[12])\.(\w+)"
                       r"|shared_experts\.(linear_fc[12])\.(\w+))$")
_LEAF_RANK = {"weight": 0, "bias": 1, "_extra_state": 2}


def _moe_order(suffix: str):
    """Order of a MoE layer's entries after its pre-MLP norm, as MoELayer creates them: the router (weight,
    expert_bias), the local experts (fc1, fc2 each), the shared expert; None for other names."""
    match = _MOE_PART.match(suffix)
    if match is None:
        return None
    if match.group(1):
        return (0, 0, 0, 0 if match.group(2) == "weight" else 1)
    if match.group(3) is not None:
        return (1, int(match.group(3)), int(match.group(4)[-1]), _LEAF_RANK.get(match.group(5), 3))
    return (2, 0, int(match.group(6)[-1]), _LEAF_RANK.get(match.group(7), 3))


def _model_order(key: str):
    """Sort key putting full-model state-dict keys in GPTModel's order (embedding, layers, final norm, output)."""
    layer = layer_of(key)
    if layer is not None:
        suffix = _LAYER_KEY.match(key).group(2)
        moe = _moe_order(suffix)
        if moe is not None:
            return (1, layer, _LAYER_ORDER.index("pre_mlp_layernorm.bias") + 0.5, moe)
        return (1, layer, _LAYER_ORDER.index(suffix) if suffix in _LAYER_ORDER else len(_LAYER_ORDER), (suffix,))
    module, _, leaf = key.rpartition(".")
    leaf_rank = {"weight": 0, "bias": 1, "_extra_state": 2}.get(leaf, 3)
    if key.startswith("embedding."):
        return (0, 0 if "word_embeddings" in key else 1, leaf_rank, key)
    return (2, 0 if key.startswith("decoder.") else 1, leaf_rank, key)


def _moe_linear(key: str) -> bool:
    match = _LAYER_KEY.match(key)
    order = _moe_order(match.group(2)) if match else None
    return order is not None and order[0] > 0 and key.endswith(".weight")


def _with_extra_state(model: Dict[str, Any]) -> Dict[str, Any]:
    """``model`` plus the ``_extra_state`` (None) entries of its linear layers, which torch_dist does not store
    and a strict ``load_state_dict`` of the legacy format expects, in GPTModel's order."""
    out = dict(model)
    for key in model:
        if any(key.endswith(f".{module}.weight") for module in _LINEAR_MODULES) or _moe_linear(key):
            out.setdefault(key[:-len("weight")] + "_extra_state", None)
    out.setdefault("output_layer._extra_state", None)
    return {key: out[key] for key in sorted(out, key=_model_order)}


def _read_torch_dist_rng(iteration_dir: str, saved_layout: Optional[dict], context: str):
    """{(tp rank, pp rank): rng_state list} of a torch_dist checkpoint saved without data parallelism, else None."""
    if not saved_layout or saved_layout.get("data_parallel_size") != 1:
        return None
    tp, pp = saved_layout["tensor_model_parallel_size"], saved_layout["pipeline_model_parallel_size"]
    states = {}
    for t in range(tp):
        for p in range(pp):
            name = layout.rng_file_name(iteration_dir, layout.rank_of(t, p, tp))
            if not os.path.isfile(name):
                return None
            states[(t, p)] = load_state_dict_file(name, context)["rng_state"]
    return states


def _per_layer_tensors(tensors: Dict[str, torch.Tensor], per_layer_model: bool = False) -> Dict[str, torch.Tensor]:
    """Whole tensors of a torch_dist checkpoint under per-layer names: model ``decoder.layers.<i>.<name>``,
    optimizer ``optimizer.state.<per-layer name>.<state>`` (Megatron's layer-stacked keys are split, the
    experts' axis too, its distributed-optimizer fragments put back into parameter shape); the earlier
    per-layer layout passes. ``per_layer_model``: a model whose own keys are per layer (``moe_layer_freq``)."""
    if mo.is_per_layer_layout(tensors) and not per_layer_model:
        return tensors
    model = {key: value for key, value in tensors.items() if not key.startswith(mo.OPTIMIZER_PREFIX)}
    out = mo.unstack_layers(model)
    by_state: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.startswith(mo.OPTIMIZER_PREFIX):
            continue
        state_key, _, name = key[len(mo.OPTIMIZER_PREFIX):].partition(".")
        param = model.get(name)
        if param is not None and value.dim() != param.dim():  # the distributed optimizer's fragments
            lead = mo.leading_axes(name)
            value = mo.unflatten_fragments(value, tuple(param.shape[lead:]), lead)
        by_state.setdefault(state_key, {})[name] = value
    for state_key, entries in by_state.items():
        for name, value in mo.unstack_layers(entries).items():
            out[f"{mo.OPTIMIZER_PREFIX}{name}.{state_key}"] = value
    return out


def _is_tensor_key(key: str) -> bool:
    """Whether a torch_dist entry ``key`` names a model or optimizer tensor (which this tool reads) rather than
    a pickled object (the ``_extra_state`` of a layer, the RNG state, Megatron-LM's other objects)."""
    base = key.split("/", 1)[0]
    return base.startswith(_MODEL_PREFIXES + (mo.OPTIMIZER_PREFIX,)) and not base.endswith("_extra_state")


_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def read_torch_dist(load_dir, iteration, with_optimizer) -> FullCheckpoint:
    """Read a torch_dist checkpoint (torch.distributed.checkpoint files + the common state) as one FullCheckpoint,
    with ``megatron.core.dist_checkpointing``'s reader, in one process: every tensor is read whole.

    Its tensors are already global (keys with global layer numbers, global shapes), so no merging is
    needed; the optimizer's param groups are rebuilt from the saved hyper-parameters by the rules
    that built them (weight decay by name and dimension). Raises ConvertError naming the folder.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    iteration_dir = find_iteration_dir(load_dir, iteration)
    common_name = layout.common_file_name(iteration_dir)
    if not os.path.isfile(common_name):
        raise ConvertError(f"--load-dir {load_dir}: torch_dist checkpoint {iteration_dir} has no "
                           f"{layout.COMMON_BASENAME}")
    common = layout.read_common_state(iteration_dir, f"--load-dir {load_dir}")
    args = saved_args(common, common_name, f"--load-dir {load_dir}", MODEL_SHAPE_ARGS)
    if args is None:
        raise ConvertError(f"{common_name}: no saved 'args' (the model shape is unknown)")
    stored = serialization.read_metadata(iteration_dir).state_dict_metadata  # sizes checked against the files
    for key, md in stored.items():
        if not isinstance(md, TensorStorageMetadata) and _is_tensor_key(key):
            raise ConvertError(f"{os.path.join(iteration_dir, serialization.METADATA_FILENAME)}: entry {key} is a "
                               f"{type(md).__name__}, not the tensor a model or optimizer state holds")
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in stored.items()
               if isinstance(md, TensorStorageMetadata)
               and (with_optimizer or not key.startswith(mo.OPTIMIZER_PREFIX))}
    with warnings.catch_warnings():  # this tool reads torch_dist checkpoints whole, in one process, on purpose
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        serialization.load([ShardedTensor(key, t, tuple(t.shape), (0,) * t.dim()) for key, t in tensors.items()],
                           iteration_dir)
    tensors = _per_layer_tensors(tensors, mo.per_layer_keys(args))
    release = os.path.basename(iteration_dir) == layout.RELEASE_DIRNAME
    saved_layout = common.get("parallel_layout") or {}
    tp = saved_layout.get("tensor_model_parallel_size", getattr(args, "tensor_model_parallel_size", 1))
    pp = saved_layout.get("pipeline_model_parallel_size", getattr(args, "pipeline_model_parallel_size", 1))
    vp = saved_layout.get("virtual_pipeline_model_parallel_size") or 1
    # The layout it was saved at (torch_dist itself is layout-free): named in convert.py's summary line.
    ep = saved_layout.get("expert_model_parallel_size", getattr(args, "expert_model_parallel_size", 1)) or 1
    model = _with_extra_state({k: v for k, v in tensors.items() if not k.startswith(mo.OPTIMIZER_PREFIX)})
    if is_tied(args):
        model.pop(TIED_OUTPUT, None)
    full = FullCheckpoint(
        model=model, args=args, iteration=0 if release else int(common.get("iteration", 0)), release=release,
        layout={"tp": tp, "pp": pp, "vp": vp, "counts": None, "ep": ep}, scheduler=common.get("opt_param_scheduler"),
        num_floating_point_operations_so_far=common.get("num_floating_point_operations_so_far", 0))
    train_state = common.get("train_state") or {}
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        if name in train_state:
            setattr(full.args, name, train_state[name])
    full.rng_states = _read_torch_dist_rng(iteration_dir, common.get("parallel_layout"), f"--load-dir {load_dir}")
    if full.rng_states is not None:
        full.layout["counts"] = pipeline_layer_counts(
            args.num_layers, pp, saved_layout.get("virtual_pipeline_model_parallel_size"),
            getattr(args, "decoder_first_pipeline_num_layers", None),
            getattr(args, "decoder_last_pipeline_num_layers", None),
            bool(getattr(args, "account_for_embedding_in_pipeline_split", False)) and pp > 1,
            bool(getattr(args, "account_for_loss_in_pipeline_split", False)) and pp > 1)
    elif os.path.isdir(os.path.join(iteration_dir, layout.RNG_DIRNAME)):
        full.notes.append("the RNG states of this torch_dist checkpoint (saved with data parallelism) belong to its "
                          "global ranks and were not converted: load the result with --no-load-rng")
    if not with_optimizer:
        return full
    if "optimizer" not in common:
        full.notes.append("the source holds no optimizer state (saved with --no-save-optim): load the result with "
                          "--no-load-optim")
        full.scheduler = None
        return full
    saved_groups, saved_steps = mo.saved_groups_and_steps(common["optimizer"], common_name)
    saved_groups = [dict(group, step=step) for group, step in zip(saved_groups, saved_steps)]
    index_of = {}
    for index, group in enumerate(saved_groups):
        index_of.setdefault(param_group_key(group), index)
    param_state: Dict[str, Dict[str, Any]] = {}
    main_params: Dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not key.startswith(mo.OPTIMIZER_PREFIX):
            continue
        name, _, state_key = key[len(mo.OPTIMIZER_PREFIX):].rpartition(".")
        if state_key == mo.MAIN_PARAM:
            if name in full.model and full.model[name].dtype == torch.float32:
                continue  # the distributed optimizer's copy of an fp32 param: the param itself
            main_params[name] = value
        else:
            param_state.setdefault(name, {})[state_key] = value
    state = OptimizerState(kind="float16" if main_params else "fp32", param_state={}, groups=[], group_of={},
                           main_params={} if main_params else None,
                           grad_scaler=mo.saved_grad_scaler(common["optimizer"]))
    group_index: Dict[int, int] = {}
    for name, value in full.model.items():
        if not torch.is_tensor(value) or is_buffer(name):
            continue
        signature = group_signature(name, value.dim(), args)
        if signature not in index_of:
            full.notes.append(f"the optimizer's param groups cannot be rebuilt ({name} fits none of the saved groups); "
                              "the optimizer state and scheduler were dropped: load the result with --no-load-optim")
            full.scheduler = None
            return full
        saved = index_of[signature]
        if saved not in group_index:
            group_index[saved] = len(state.groups)
            state.groups.append({k: v for k, v in saved_groups[saved].items() if k not in ("params", "step")})
        state.group_of[name] = group_index[saved]
        entry = dict(param_state.get(name, {}))
        step = saved_groups[saved].get("step")
        if entry and step is not None:
            entry["step"] = torch.tensor(float(step), dtype=torch.float32)
        state.param_state[name] = entry
        if main_params:
            if name not in main_params:
                raise ConvertError(f"--load-dir {load_dir}: {iteration_dir} has fp32 main params but none for {name}")
            state.main_params[name] = main_params[name]
    full.optimizer = state
    return full


def _optimizer_common_state(full: FullCheckpoint) -> dict:
    """The optimizer's entry of the common state: the plain (non-distributed) optimizer's param groups and
    one common step (Megatron core_v0.14's layout, ``optimizer_common_state``'s), with the grad scaler of a
    mixed-precision optimizer."""
    optimizer = full.optimizer
    params = [(name, name, optimizer.param_state[name], None) for name in full.model
              if name in optimizer.param_state]
    groups = rank_optimizer(OptimizerState("fp32", optimizer.param_state, optimizer.groups, optimizer.group_of),
                            params)["param_groups"]
    steps = [float(optimizer.param_state[name]["step"]) for group in groups for name in group["params"]
             if torch.is_tensor(optimizer.param_state[name].get("step"))]
    inner = {"state": {"common_step": torch.tensor(max(steps) if steps else 0.0)},
             "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in groups]}
    if optimizer.main_params:  # fp16/bf16: the wrapper's state, beside the grad scaler
        return {"optimizer": inner, "grad_scaler": optimizer.grad_scaler}
    return inner


def _common_state(full: FullCheckpoint, target: TargetLayout, keep_rng: bool) -> dict:
    """The common state of the converted checkpoint, built by ``layout.common_state`` as training builds it."""
    args = target_args(full, target)
    if not keep_rng:  # no RNG states written: Megatron-LM's loader then skips them instead of stopping
        args.no_save_rng = True
    counters = {"iteration": full.iteration, "num_floating_point_operations_so_far":
                int(full.num_floating_point_operations_so_far or 0)}
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        counters[name] = int(getattr(args, name, 0) or 0)
    optimizer_state = _optimizer_common_state(full) if full.optimizer is not None else None
    return layout.common_state(
        args, full.iteration, counters, counters["num_floating_point_operations_so_far"],
        # With RNG files: the layout they belong to (one data-parallel rank); without: None, which no run's
        # layout equals, so a load keeps its seeded RNG (with a warning) instead of looking for them.
        layout.parallel_layout(target.tp, target.pp, 1, target.vp if target.vp > 1 else None) if keep_rng else None,
        False,  # written with the plain (non-distributed) optimizer's layout
        optimizer_state, full.scheduler if optimizer_state is not None else None)


_EXPERT_EXTRA = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _extra_state_key(key: str, args, per_layer: bool) -> str:
    """Megatron's ShardedObject key of a full-model ``decoder.layers.<i>.<module>._extra_state`` entry (see
    checkpoint_keys.extra_state_object): over the layer axis (unless ``per_layer``) and a routed expert's axis."""
    match = _LAYER_KEY.match(key)
    layer, rest = int(match.group(1)), match.group(2)
    axes, expert = [], _EXPERT_EXTRA.match(rest)
    if expert is not None:
        rest = mo.EXPERTS_PREFIX + expert.group(2)
    if not per_layer:
        axes.append((layer, args.num_layers))
    if expert is not None:
        axes.append((int(expert.group(1)), args.num_experts))
    axes = axes or [(0, 1)]
    prefix = mo.LAYER_PREFIX if not per_layer else f"{mo.LAYER_PREFIX}{layer}."
    offsets, shape = ".".join(str(i) for i, _ in axes), ".".join(str(n) for _, n in axes)
    return f"{prefix}{rest}/shard_{offsets}_{shape}"


def write_torch_dist(full: FullCheckpoint, save_dir: str, target: TargetLayout, keep_rng: bool = False) -> str:
    """Write ``full`` as a torch_dist checkpoint (whole tensors, written by this one process with
    ``megatron.core.dist_checkpointing``), atomically; returns the iteration folder. It loads at any
    TP/PP/DP layout; ``target`` sets the layout recorded in the saved args and, with ``keep_rng``, the
    one the RNG files ``rng/rank_XXXXX.pt`` are written for (one data-parallel rank)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def sharded(key, tensor):
        tensor = tensor.contiguous()
        return ShardedTensor(key, tensor, tuple(tensor.shape), (0,) * tensor.dim())

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = {key: value for key, value in full.model.items() if torch.is_tensor(value)}
    per_layer = mo.per_layer_keys(full.args)
    items = [sharded(key, value) for key, value in mo.stack_layers(model, per_layer).items()]
    for key in full.model:  # the layers' _extra_state objects Megatron's loader expects
        if _LAYER_KEY.match(key) is not None and key.endswith("._extra_state"):
            items.append(ShardedObject(_extra_state_key(key, full.args, per_layer), mo.extra_state_bytes(None)))
    if full.optimizer is not None:
        by_state: Dict[str, Dict[str, torch.Tensor]] = {}
        for name, entry in full.optimizer.param_state.items():
            for state_key, value in entry.items():
                if torch.is_tensor(value) and tuple(value.shape) == tuple(full.model[name].shape):
                    by_state.setdefault(state_key, {})[name] = value
        if full.optimizer.main_params:
            by_state[mo.MAIN_PARAM] = dict(full.optimizer.main_params)
        for state_key, entries in by_state.items():
            for key, value in mo.stack_layers(entries, per_layer).items():
                items.append(sharded(f"{mo.OPTIMIZER_PREFIX}{state_key}.{key}", value))
    if keep_rng:  # Megatron-LM's copy of the RNG states (pretrain_gpt.py writes the same object)
        for (t, p), rng_state in full.rng_states.items():
            items.append(ShardedObject(f"rng_state/shard_{p}.{t}_{target.pp}.{target.tp}",
                                       mo.extra_state_bytes(rng_state)))
    dirname = layout.iteration_dirname(full.iteration, full.release)
    integrity.prepare_save_dir(save_dir)
    tmp_dir = os.path.join(save_dir, f".{dirname}.tmp-{os.getpid()}")
    final_dir = os.path.join(save_dir, dirname)
    try:
        os.makedirs(tmp_dir)
        with warnings.catch_warnings():  # written whole, in one process, on purpose
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            serialization.save(items, tmp_dir)
        common = _common_state(full, target, keep_rng)
        durable.write_durably(common, layout.common_file_name(tmp_dir))
        if keep_rng:
            for (t, p), rng_state in full.rng_states.items():
                name = layout.rng_file_name(tmp_dir, layout.rank_of(t, p, target.tp))
                durable.write_durably({"rng_state": rng_state, "parallel_layout": common["parallel_layout"]}, name)
        # The same publish as training's save: manifest, fsync, directory swap, tracker last.
        integrity.publish_iteration(save_dir, tmp_dir, full.iteration, release=full.release)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return final_dir
