"""Cross entropy over vocabulary-parallel logits without gathering the full vocabulary."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy for logits split on the vocab dim over TP (Megatron-LM section 3).

    Forward: global row max via all-reduce MAX, target logit picked on the owning rank and
    all-reduced (SUM) together with sum(exp); loss = log(sum_exp) - target_logit. The logits arrive
    in their compute dtype (bf16/fp16/fp32) and are upcast exactly once, fused with the max
    subtraction, into one contiguous fp32 buffer that then holds exp(logit - max) and finally the
    gradient; the caller's tensor is never written.

    Passes over the [s, b, V/tp] logits (element-wise kernels or full reductions), forward and
    backward together: amax (of the input), subtract-and-upcast, exp, sum, and in backward one
    ``(exp * grad / sum_exp) -> logits dtype`` (an addcmul with label smoothing): five. The softmax
    is never normalised in a pass of its own; the target's ``-1`` is a gather-sized scatter into
    the unnormalised buffer (``exp - sum_exp``) before that last pass.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        world_size = get_tensor_model_parallel_world_size()
        group = get_tensor_model_parallel_group() if world_size > 1 else None
        input_dtype = vocab_parallel_logits.dtype

        # The max of low-precision values is exact in that precision, so it is taken before the upcast.
        logits_max = vocab_parallel_logits.amax(dim=-1).float()
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # The single fp32 copy of the logits [s, b, V/tp]: subtraction and upcast in one kernel.
        logits = torch.empty(vocab_parallel_logits.shape, dtype=torch.float32, device=vocab_parallel_logits.device)
        torch.sub(vocab_parallel_logits, logits_max.unsqueeze(-1), out=logits)

        partition_vocab_size = logits.size(-1)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_tensor_model_parallel_rank(), world_size
        )
        vocab_size = partition_vocab_size * world_size
        if world_size > 1:
            target_mask = (target < vocab_start) | (target >= vocab_end)
            masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        else:
            target_mask = None
            masked_target = target

        logits_2d = logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.reshape(-1)
        arange_1d = torch.arange(logits_2d.size(0), device=logits_2d.device)
        predicted_logits = logits_2d[arange_1d, masked_target_1d].view_as(target)
        if target_mask is not None:
            predicted_logits = predicted_logits.masked_fill(target_mask, 0.0)

        # With smoothing, sum_v log p_v = sum_v (logit_v - max) - V log(sum_exp): taken from the
        # shifted logits rather than log(softmax), which is -inf where a probability underflows.
        sums = [predicted_logits]
        if label_smoothing > 0:
            sums.append(logits.sum(dim=-1))
        exp_logits = logits.exp_()
        sums.append(exp_logits.sum(dim=-1))
        if world_size > 1:
            # One collective for all the sums.
            packed = torch.stack(sums)
            dist.all_reduce(packed, group=group)
            sums = list(packed.unbind(0))
        predicted_logits, sum_exp_logits = sums[0], sums[-1]

        log_sum_exp = torch.log(sum_exp_logits)
        loss = log_sum_exp - predicted_logits

        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # Mean over the full vocabulary (Megatron averages only the local shard under TP>1).
            mean_log_probs = sums[1] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.smoothing = smoothing
        ctx.vocab_size = vocab_size
        ctx.input_dtype = input_dtype
        ctx.save_for_backward(exp_logits, sum_exp_logits,
                              target_mask if target_mask is not None else torch.empty(0), masked_target_1d)
        ctx.has_mask = target_mask is not None
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        """d loss / d logit_v = (softmax_v - (1 - a') [v = target] - a' / V) * grad, in the logits' dtype."""
        exp_logits, sum_exp_logits, target_mask, masked_target_1d = ctx.saved_tensors
        partition_vocab_size = exp_logits.size(-1)
        exp_2d = exp_logits.view(-1, partition_vocab_size)  # reused in place: not needed afterwards
        arange_1d = torch.arange(exp_2d.size(0), device=exp_2d.device)
        sum_exp_1d = sum_exp_logits.reshape(-1)
        # softmax - onehot = (exp - sum_exp * onehot) / sum_exp: one element per token, not a pass.
        target_weight = (1.0 - ctx.smoothing) * sum_exp_1d
        if ctx.has_mask:
            target_weight = target_weight.masked_fill(target_mask.reshape(-1), 0.0)
        exp_2d[arange_1d, masked_target_1d] -= target_weight
        scale = (grad_output / sum_exp_logits).unsqueeze(-1)
        # The last pass writes the logits' dtype directly (in place when that is fp32).
        if ctx.input_dtype == torch.float32:
            grad_input = exp_logits
        else:
            grad_input = torch.empty(exp_logits.shape, dtype=ctx.input_dtype, device=exp_logits.device)
        if ctx.smoothing > 0:
            offset = (grad_output * (-ctx.smoothing / ctx.vocab_size)).unsqueeze(-1)
            torch.addcmul(offset, exp_logits, scale, out=grad_input)
        else:
            torch.mul(exp_logits, scale, out=grad_input)
        return grad_input, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) from logits [s, b, V/tp] (any float dtype, any strides) and target ids [s, b].

    Math is in fp32 whatever the logits dtype, with exactly one fp32 [s, b, V/tp] buffer (pass
    bf16/fp16 logits as they are: upcasting them first would add a second copy); the gradient has
    the logits' dtype. No reduction over tokens is applied. Label smoothing
    alpha gives ``(1 - a') * nll - a' * mean_v(log p_v)`` with ``a' = alpha * V / (V - 1)``.

    Raises ValueError if target's shape differs from logits' leading dims or label_smoothing is
    outside [0, 1).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits shape "
            f"{tuple(vocab_parallel_logits.shape)} without its vocab dim"
        )
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
