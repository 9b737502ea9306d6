"""Gradient reductions run after the last microbatch's backward, before the optimizer step."""
import contextlib
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.utils import get_attr_wrapped_model, get_model_config


@contextlib.contextmanager
def _timed(config, name: str, barrier: bool):
    """Level-1 timer ``name`` around the block when the config carries timers."""
    timers = getattr(config, "timers", None)
    timer = None if timers is None else timers(name, log_level=1)
    if timer is not None:
        timer.start(barrier=barrier)
    yield
    if timer is not None:
        timer.stop()


def _main_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    # FSDP2: the reduced local shard (a view); every TP rank holds the same rows of a replicated param.
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _allreduce_coalesced(grads: List[torch.Tensor], group):
    """Sum ``grads`` over ``group`` with one collective per dtype."""
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same_dtype])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same_dtype:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _allreduce_non_tensor_model_parallel_grads(model: List[torch.nn.Module], config):
    """Sum over TP the grads of params replicated across TP but fed TP-split activations.

    Those are params flagged ``sequence_parallel`` (norms and row-parallel biases under sequence
    parallelism) and, with ``qk_layernorm``, the q/k layernorm weights.
    """
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() <= 1:
        return
    qk_layernorm = getattr(config, "qk_layernorm", False)
    if not (getattr(config, "sequence_parallel", False) or qk_layernorm):
        return
    grads = []
    for chunk in model:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if getattr(param, "sequence_parallel", False) or (
                qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            ):
                grad = _main_grad(param)
                if grad is not None:
                    grads.append(grad)
    if grads:
        _allreduce_coalesced(grads, parallel_state.get_tensor_model_parallel_group())


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], config):
    """Sum the tied word-embedding / output-layer weight grad over the embedding group (pp > 1 only)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    # The first stage owns the input embedding (first chunk), the last stage the output layer (last chunk).
    chunk = model[0] if parallel_state.is_pipeline_first_stage() else model[-1]
    try:
        owner = get_attr_wrapped_model(chunk, "shared_embedding_or_output_weight", return_model_obj=True)
    except AttributeError:
        return
    if not getattr(owner, "share_embeddings_and_output_weights", True):
        return
    weight = owner.shared_embedding_or_output_weight()
    if weight is None:
        return
    gather = getattr(chunk, "gather_reduced_grads", None)
    if gather is not None:  # distributed optimizer: the stages shard this grad differently
        gather([weight])
    grad = _main_grad(weight)
    if grad is not None:
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())


def _update_router_expert_bias(model: List[torch.nn.Module], config):
    """Once per step, after the gradient sync: move every router's ``expert_bias`` [E] by its token counts.

    Megatron core_v0.14 ``_update_router_expert_bias``: the routers' ``local_tokens_per_expert`` [E] (accumulated
    by each forward under grad) are stacked [layers, E] and passed to ``moe_utils.get_updated_expert_bias``, which
    sums them over the TP x DP x CP group and returns ``bias + sign(mean(count) - count) * rate``; the counts are
    then zeroed. Aux-loss-free load balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
    Mixture-of-Experts", section 3).
    """
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    tokens_per_expert, expert_bias = [], []
    for chunk in model:
        for module in get_attr_wrapped_model(chunk, "modules")():
            if getattr(module, "expert_bias", None) is not None and hasattr(module, "local_tokens_per_expert"):
                tokens_per_expert.append(module.local_tokens_per_expert)
                expert_bias.append(module.expert_bias)
    if not expert_bias:  # a pipeline stage without MoE layers
        return
    updated = get_updated_expert_bias(torch.stack(tokens_per_expert), torch.stack(expert_bias),
                                      config.moe_router_bias_update_rate)
    for counts, bias, new_bias in zip(tokens_per_expert, expert_bias, updated):
        counts.zero_()
        bias.copy_(new_bias)


def _scale_by_num_tokens(model: List[torch.nn.Module], num_tokens: torch.Tensor):
    """Divide every grad by the global token count (broadcast from the last stage, summed over dp-cp)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    total = int(num_tokens.item())
    if total <= 0:
        return
    scaling = 1.0 / total
    for chunk in model:
        scale = getattr(chunk, "scale_gradients", None)
        if scale is not None:
            scale(scaling)
        else:
            for param in chunk.parameters():
                grad = _main_grad(param)
                if grad is not None:
                    grad.mul_(scaling)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None):
    """Finish all grad reductions of one iteration, in Megatron-LM's order.

    1. data-parallel all-reduce of every chunk (``finish_grad_sync``), timer ``all-grads-sync``;
    2. TP all-reduce of sequence-parallel / qk-layernorm grads, timer ``layernorm-grads-all-reduce``;
    3. embedding-group all-reduce of the tied embedding / output weight when pp > 1, timer
       ``embedding-grads-all-reduce``;
    3b. with ``moe_router_enable_expert_bias``: the routers' expert-bias update (``_update_router_expert_bias``);
    4. with ``num_tokens`` (a scalar int tensor, per-token loss): divide all grads by the token count
       of the whole global batch.

    Args:
        model: the model chunks (DistributedDataParallel-wrapped for step 1).
        num_tokens: tokens this rank's last stage saw in the iteration, or None. Modified in place.
    """
    config = get_model_config(model[0])
    barrier = getattr(config, "barrier_with_L1_time", False)

    with _timed(config, "all-grads-sync", barrier):
        for chunk in model:
            finish = getattr(chunk, "finish_grad_sync", None)
            if finish is not None:
                finish()
    with _timed(config, "layernorm-grads-all-reduce", barrier):
        _allreduce_non_tensor_model_parallel_grads(model, config)
    with _timed(config, "embedding-grads-all-reduce", barrier):
        _allreduce_word_embedding_grads(model, config)
    if getattr(config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias(model, config)

    if num_tokens is not None:
        _scale_by_num_tokens(model, num_tokens)
