"""Ulysses attention (``--cp-comm-type a2a``): all-to-all from sequence chunks to head groups and back.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", section 3: before attention an all-to-all turns "all heads of this rank's
tokens" into "``1/cp`` of the heads, of all tokens"; each rank then runs ordinary causal attention over
the whole sequence for its heads, and a second all-to-all turns the result back. CP rank ``g`` gets head
group ``g`` (query heads ``g np/cp .. (g+1) np/cp``, K/V groups ``g ng/cp ..``), which keeps every query
head with its K/V group under GQA.

The gathered chunks arrive in rank order (chunks ``0, 2cp-1, 1, 2cp-2, ...``, see ``local_positions``);
they are permuted into global order before attention (so the causal mask is the ordinary one) and
permuted back after it. Each all-to-all is an autograd function whose backward is the inverse
all-to-all; the local attention is ``scaled_dot_product_attention`` with its own backward (its flash
kernels save the per-row log-sum-exp, not an ``[s, s]`` matrix).
"""
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.collective_device import get_collective_device
from megatron.core.transformer.context_parallel.comm import cp_comm_section

from . import local_positions


def _group_size_rank(group):
    """``(size, rank)`` of ``group`` (None: the default group; ``(1, 0)`` without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    group = group if group is not None else dist.group.WORLD
    return dist.get_world_size(group), dist.get_rank(group)


def _global_order(seq_length: int, cp: int, device) -> torch.Tensor:
    """Indices that put the rank-ordered gathered sequence ``[s]`` into global token order."""
    gathered = torch.cat([local_positions(seq_length, cp, r) for r in range(cp)])
    return torch.argsort(gathered).to(device)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all along dim 0 (``x[i]`` goes to CP rank ``i``; ``out[i]`` came from CP rank ``i``)."""
    device = x.device
    send = x.to(get_collective_device(group)).contiguous()
    recv = torch.empty_like(send)
    with cp_comm_section("all_to_all", **{"megatron.cp.size": send.shape[0]}):
        dist.all_to_all_single(recv, send, group=group)
    return recv.to(device)


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """``[b, h, s/cp, hn]`` (all heads, this rank's chunks) -> ``[b, h/cp, s, hn]`` (head group, global order)."""
    b, heads, s_local, hn = x.shape
    parts = x.reshape(b, cp, heads // cp, s_local, hn).transpose(0, 1)  # [cp (destination), b, h/cp, s/cp, hn]
    parts = _all_to_all(parts, group)  # [cp (source), b, h/cp, s/cp, hn]
    gathered = parts.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * s_local, hn)
    return gathered.index_select(2, _global_order(cp * s_local, cp, x.device))


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: ``[b, h/cp, s, hn]`` -> ``[b, h, s/cp, hn]``."""
    b, group_heads, s, hn = x.shape
    order = _global_order(s, cp, x.device)
    rank_ordered = torch.empty_like(x)
    rank_ordered.index_copy_(2, order, x)  # undo index_select(2, order)
    parts = rank_ordered.reshape(b, group_heads, cp, s // cp, hn).permute(2, 0, 1, 3, 4)  # [cp (dest), ...]
    parts = _all_to_all(parts, group)  # [cp (source head group), b, h/cp, s/cp, hn]
    return parts.transpose(0, 1).reshape(b, cp * group_heads, s // cp, hn)


class SeqToHeads(torch.autograd.Function):
    """:func:`_seq_to_heads` with the inverse all-to-all as its backward."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.cp), None, None


class HeadsToSeq(torch.autograd.Function):
    """:func:`_heads_to_seq` with the inverse all-to-all as its backward."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.cp), None, None


def _check_heads(heads: int, groups: int, cp: int) -> List[str]:
    """The reasons (none when fine) why ``heads`` query heads and ``groups`` K/V groups cannot split over ``cp``."""
    problems = []
    if heads % cp != 0:
        problems.append(f"--num-attention-heads ({heads} per tensor-parallel rank) is not divisible by "
                        f"--context-parallel-size ({cp})")
    if heads % groups != 0:
        problems.append(f"--num-attention-heads ({heads}) is not a multiple of --num-query-groups ({groups})")
    return problems


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_group,
              softmax_scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence by all-to-all between sequence and heads (``a2a``).

    Args:
        query: ``[b, np, s_local, hn]``, this rank's two chunks (``chunk_ids`` of the package).
        key, value: ``[b, ng, s_local, hn]``; ``np`` a multiple of ``ng`` (GQA).
        cp_group: the context-parallel group (None: the default group).
        softmax_scale: the scale of ``q kᵀ``.

    ``np`` must be divisible by the CP size. When ``ng`` is not, each K/V group is repeated for its
    query heads (``ng`` becomes ``np``), so every rank still gets whole K/V groups.

    Returns ``[b, np, s_local, hn]``. Raises ValueError naming ``--num-attention-heads``,
    ``--num-query-groups`` and ``--context-parallel-size`` when the heads do not split.
    """
    cp, _ = _group_size_rank(cp_group)
    heads, groups = query.shape[1], key.shape[1]
    problems = _check_heads(heads, groups, cp)
    if problems:
        raise ValueError("--cp-comm-type a2a splits the attention heads over the CP ranks: " + "; ".join(problems)
                         + " (--num-query-groups need not divide: its K/V groups are repeated when it does not)")
    if groups % cp != 0:  # e.g. one K/V group at CP=2: give each query head its own copy
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
        groups = heads
    if cp == 1:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=softmax_scale,
                                              enable_gqa=groups != heads)
    q, k, v = (SeqToHeads.apply(x, cp_group, cp) for x in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale, enable_gqa=groups != heads)
    return HeadsToSeq.apply(out, cp_group, cp)
