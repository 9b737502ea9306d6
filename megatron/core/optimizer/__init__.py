"""Build the Megatron optimizer: param groups (weight-decay / lr multipliers), inner optimizer, wrapper."""
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .clip_grads import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32, to_local_if_dtensor
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .distrib_optimizer import DistributedOptimizer
from .optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MegatronOptimizer
from .optimizer_config import OptimizerConfig

__all__ = [
    "OptimizerConfig", "MegatronOptimizer", "FP32Optimizer", "Float16OptimizerWithFloat16Params", "DistributedOptimizer",
    "MegatronGradScaler", "ConstantGradScaler", "DynamicGradScaler", "get_megatron_optimizer",
    "get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32", "get_optimizer_state_bytes",
    "PARAM_GROUP_KEYS", "param_group_key",
]

# What tells Megatron's param groups apart (the keys _get_param_groups groups params by); a checkpoint's
# groups are matched to a run's by these, whatever order the writer put them in.
PARAM_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def param_group_key(group: Dict) -> Tuple:
    """``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`` of a param group (None for a key it lacks)."""
    return tuple(group.get(key) for key in PARAM_GROUP_KEYS)


def get_optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds, measured from the optimizer's own tensors.

    Counts every tensor in the inner optimizer's per-param state (Adam ``exp_avg``, ``exp_avg_sq``,
    ``step``; SGD ``momentum_buffer``) plus the fp32 main params that are separate copies of the
    model params (:meth:`MegatronOptimizer.main_param_copies`: the fp32 copies of fp16/bf16 params,
    or of this rank's shard with the distributed optimizer). FSDP2's DTensors count their local shard. fp32 params updated in place (or
    views of them) are model weights, not optimizer state, and are not counted. This is the
    quantity Megatron's theoretical memory report calls the optimizer part (12 bytes/param for
    Adam with fp32 main params, divided by DP with the distributed optimizer).

    Args:
        optimizer: a :class:`MegatronOptimizer` (or a plain ``torch.optim.Optimizer``).

    Returns:
        int, bytes on this rank (no communication).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    seen = set()
    total = 0

    def add(tensor):
        nonlocal total
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            local = to_local_if_dtensor(tensor)  # FSDP2: the shard this rank holds
            total += local.numel() * local.element_size()

    for state in inner.state.values():
        for value in state.values():
            add(value)
    copies = getattr(optimizer, "main_param_copies", None)
    for tensor in (copies() if copies is not None else []):
        add(tensor)
    return total


def _get_param_groups(model_chunks: List[torch.nn.Module], no_weight_decay_cond: Optional[Callable],
                      scale_lr_cond: Optional[Callable], lr_mult: float, lr: float, min_lr: float,
                      decoupled_lr: Optional[float], decoupled_min_lr: Optional[float]) -> List[Dict]:
    """Group trainable params by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).

    Without ``no_weight_decay_cond``, params with ndim == 1 or a name ending in '.bias' get wd_mult 0.
    Params matching ``scale_lr_cond`` get ``lr_mult``. Groups are in the order their first param
    appears in ``named_parameters()`` (megatron-core 0.14's order: its legacy checkpoints store the
    optimizer state by position, group after group, so the order must match to load them).
    """
    groups: Dict[Tuple[float, float, bool, bool], List[torch.nn.Parameter]] = {}
    seen = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            is_expert_parallel = not getattr(param, "allreduce", True)
            if no_weight_decay_cond is not None:
                no_wd = bool(no_weight_decay_cond(name, param))
            else:
                no_wd = name.endswith(".bias") or param.dim() == 1
            scale_lr = bool(scale_lr_cond(name, param)) if scale_lr_cond is not None else False
            wd_mult = 0.0 if no_wd else 1.0
            group_lr_mult = lr_mult if scale_lr else 1.0
            is_decoupled_lr = decoupled_lr is not None and getattr(param, "is_embedding_or_output_parameter", False)
            groups.setdefault((wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr), []).append(param)

    param_groups = []
    for (wd_mult, group_lr_mult, is_expert_parallel, is_decoupled_lr), params in groups.items():
        if is_decoupled_lr:
            max_lr = decoupled_lr
            group_min_lr = decoupled_min_lr if decoupled_min_lr is not None else min_lr
        else:
            max_lr, group_min_lr = lr, min_lr
        param_groups.append({
            "params": params,
            "wd_mult": wd_mult,
            "lr_mult": group_lr_mult,
            "is_expert_parallel": is_expert_parallel,
            "is_decoupled_lr": is_decoupled_lr,
            "max_lr": max_lr,
            "min_lr": group_min_lr,
            "default_config": wd_mult == 1.0 and group_lr_mult == 1.0 and not is_decoupled_lr,
        })
    return param_groups


def adam_implementation(params: List[torch.Tensor]) -> Dict[str, bool]:
    """AdamW's kernel choice for ``params``: ``{'fused': True}`` when they are all on CUDA, else ``{}``.

    The fused CUDA kernel reads and writes each param, grad and moment once per step (at 1.3B about
    37 GB of traffic against ~108 GB for the multi-tensor ``foreach`` kernels, which also allocate
    a temporary the size of the params). Elsewhere torch's default (``foreach`` where supported) is
    kept; both implement the same update, equal up to fp32 rounding.
    """
    if params and all(p.is_cuda for p in params):
        return {"fused": True}
    return {}


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                           no_weight_decay_cond: Optional[Callable] = None,
                           scale_lr_cond: Optional[Callable] = None, lr_mult: float = 1.0) -> MegatronOptimizer:
    """Build the optimizer for ``model_chunks`` (usually DistributedDataParallel-wrapped chunks).

    Inner optimizer: ``adam`` -> ``torch.optim.AdamW`` (decoupled weight decay, Loshchilov & Hutter,
    "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2), ``sgd`` -> ``torch.optim.SGD``
    with momentum. Wrapper: :class:`Float16OptimizerWithFloat16Params` for fp16/bf16 (constant scaler
    with ``loss_scale``, dynamic for fp16 otherwise, none for bf16), else :class:`FP32Optimizer`.
    Each group's 'lr' / 'weight_decay' is set by OptimizerParamScheduler from max_lr/min_lr,
    lr_mult and wd_mult.

    With ``config.use_distributed_optimizer`` the wrapper is a :class:`DistributedOptimizer`
    (Adam only) over the DDP chunks' buffers.

    The optimizer state of every wrapper is keyed by each param's fully qualified name (prefixed
    ``model{i}.`` when there are several chunks) in ``state_dict()``.

    Raises:
        ValueError: ``config.lr`` is None, the optimizer name is unknown, the distributed optimizer
            is requested with sgd, or no trainable params exist.
    """
    if config.lr is None:
        raise ValueError("OptimizerConfig.lr is None: set --lr")
    if config.use_distributed_optimizer and config.optimizer != "adam":
        raise ValueError(f"--use-distributed-optimizer supports --optimizer adam only, got {config.optimizer!r}")
    min_lr = config.min_lr if config.min_lr is not None else 0.0
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    param_groups = _get_param_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult,
                                     config.lr, min_lr, config.decoupled_lr, config.decoupled_min_lr)
    if not param_groups:
        raise ValueError("get_megatron_optimizer: the model has no trainable params")
    # Sensible values until the scheduler's first step overwrites them.
    for group in param_groups:
        group["lr"] = group["max_lr"] * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]

    if config.optimizer == "adam":
        def make_inner(groups):
            return torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                                     betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                     **adam_implementation([p for g in groups for p in g["params"]]))

        def init_state_fn(opt):
            for group in opt.param_groups:
                for p in group["params"]:
                    if len(opt.state[p]) == 0:
                        opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    elif config.optimizer == "sgd":
        def make_inner(groups):
            return torch.optim.SGD(groups, lr=config.lr, weight_decay=config.weight_decay,
                                   momentum=config.sgd_momentum)

        init_state_fn = None
    else:
        raise ValueError(f"--optimizer {config.optimizer!r} is not supported; choose 'adam' or 'sgd'")
    init_state_fn = init_state_fn or (lambda opt: None)

    grad_scaler: Optional[MegatronGradScaler] = None
    if config.fp16 or config.bf16:
        if config.loss_scale:
            grad_scaler = ConstantGradScaler(config.loss_scale)
        elif config.fp16:
            grad_scaler = DynamicGradScaler(
                initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale, growth_factor=2.0,
                backoff_factor=0.5, growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
            )
    if config.use_distributed_optimizer:
        optimizer = DistributedOptimizer(config, model_chunks, param_groups, make_inner, grad_scaler, init_state_fn)
    else:
        param_names = _param_names(model_chunks)
        inner = make_inner(param_groups)
        if config.fp16 or config.bf16:
            optimizer = Float16OptimizerWithFloat16Params(inner, config, grad_scaler, init_state_fn,
                                                          param_names=param_names)
        else:
            optimizer = FP32Optimizer(inner, config, init_state_fn, param_names=param_names)
    optimizer.has_expert_params = _is_moe_model(model_chunks)
    return optimizer


def _is_moe_model(model_chunks: List[torch.nn.Module]) -> bool:
    """Whether the model has mixture-of-experts layers (its TransformerConfig's ``num_moe_experts``; the same on every
    rank, unlike the presence of expert params, which a pipeline stage without MoE layers lacks)."""
    from megatron.core.utils import get_model_config

    try:
        config = get_model_config(model_chunks[0])
    except (AttributeError, RuntimeError, ValueError):
        return any(not getattr(p, "allreduce", True) for chunk in model_chunks for p in chunk.parameters())
    return getattr(config, "num_moe_experts", None) is not None


def _param_names(model_chunks: List[torch.nn.Module]) -> Dict[torch.nn.Parameter, str]:
    """Fully qualified name of every param (wrappers' ``module.`` removed; ``model{i}.`` for several chunks)."""
    names = {}
    for index, chunk in enumerate(model_chunks):
        while isinstance(getattr(chunk, "module", None), torch.nn.Module):
            chunk = chunk.module
        prefix = f"model{index}." if len(model_chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            names.setdefault(param, prefix + name)
    return names
