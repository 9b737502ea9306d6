"""``--cp-comm-type all_gather``: K/V all-gathered over the CP group, dK/dV reduce-scattered back to their owners.

Each rank gathers every rank's keys and values, puts them in global order, and attends its two query
chunks (global chunks ``r`` and ``2 cp - 1 - r``, see ``chunk_ids``) each against the keys at or before
its positions. Only the local q, k, v are kept for backward: the backward gathers K/V again,
recomputes each query chunk's attention on its own (so at most a ``[s / (2 cp), s]`` score block
exists at a time, never ``[s, s]``), and reduce-scatters the gradients of the gathered K/V.
"""
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.collective_device import get_collective_device
from megatron.core.transformer.context_parallel import chunk_ids
from megatron.core.transformer.context_parallel.comm import cp_comm_section

# torch >= 2.13 renamed the flat-tensor collectives; keep working on older releases.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(kv: torch.Tensor, cp_group, cp_size: int) -> torch.Tensor:
    """``[2, b, ng, s_local, hn]`` -> ``[2, b, ng, s, hn]``: every rank's K/V in global token order."""
    device = get_collective_device(cp_group)
    send = kv.contiguous().to(device)
    # Flat along dim 0 (gloo wants [cp * 2, ...]), then viewed per rank.
    gathered = torch.empty((cp_size * kv.size(0),) + tuple(kv.shape[1:]), dtype=kv.dtype, device=device)
    with cp_comm_section("all_gather", **{"megatron.cp.size": cp_size}):
        _all_gather_flat(gathered, send, group=cp_group)
    gathered = gathered.to(kv.device).view((cp_size,) + tuple(kv.shape))
    chunk = kv.size(3) // 2
    pieces = []
    for index in range(2 * cp_size):  # global chunk i lives on rank i (first half) or 2cp-1-i (second)
        owner, half = (index, 0) if index < cp_size else (2 * cp_size - 1 - index, 1)
        pieces.append(gathered[owner, :, :, :, half * chunk:(half + 1) * chunk])
    return torch.cat(pieces, dim=3)


def _reduce_scatter_kv(grad_global: torch.Tensor, cp_group, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Gradient of ``_gather_kv``: ``[2, b, ng, s, hn]`` (global order) summed over ranks into each owner's
    ``[2, b, ng, s_local, hn]``."""
    chunk = grad_global.size(3) // (2 * cp_size)
    per_rank = [torch.cat([grad_global[:, :, :, c * chunk:(c + 1) * chunk] for c in chunk_ids(cp_size, rank)], dim=3)
                for rank in range(cp_size)]
    device = get_collective_device(cp_group)
    send = torch.cat(per_rank).to(device)  # [cp * 2, ...], rank-major
    out = torch.empty(per_rank[0].shape, dtype=send.dtype, device=device)
    with cp_comm_section("reduce_scatter", **{"megatron.cp.size": cp_size}):
        _reduce_scatter_flat(out, send, group=cp_group)
    return out.to(grad_global.device)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, global_chunk: int,
                     softmax_scale: float) -> torch.Tensor:
    """One query chunk ``[b, np, c, hn]`` (global chunk ``global_chunk``) against the keys it can see.

    ``k``/``v`` hold the whole sequence ``[b, ng, s, hn]``; only the prefix up to the chunk's end is read,
    with the causal rule key position <= query position (the last ``c`` keys form the diagonal block).
    """
    c = q.size(2)
    visible = (global_chunk + 1) * c
    k, v = k[:, :, :visible], v[:, :, :visible]
    query_pos = torch.arange(global_chunk * c, visible, device=q.device)
    key_pos = torch.arange(visible, device=q.device)
    allowed = key_pos[None, :] <= query_pos[:, None]  # [c, visible], True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale,
                                          enable_gqa=q.size(1) != k.size(1))


def _local_attention(q: torch.Tensor, k_global: torch.Tensor, v_global: torch.Tensor, cp_size: int,
                     cp_rank: int, softmax_scale: float) -> List[torch.Tensor]:
    """Outputs of this rank's two query chunks, each ``[b, np, c, hn]``."""
    c = q.size(2) // 2
    return [_chunk_attention(q[:, :, h * c:(h + 1) * c], k_global, v_global, g, softmax_scale)
            for h, g in enumerate(chunk_ids(cp_size, cp_rank))]


class _AllGatherAttention(torch.autograd.Function):
    """Forward: gather K/V, attend both local query chunks. Backward: gather again, recompute per chunk,
    reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, query, key, value, cp_group, softmax_scale):
        cp_size = dist.get_world_size(cp_group)
        cp_rank = dist.get_rank(cp_group)
        kv = _gather_kv(torch.stack([key, value]), cp_group, cp_size)
        out = torch.cat(_local_attention(query, kv[0], kv[1], cp_size, cp_rank, softmax_scale), dim=2)
        ctx.save_for_backward(query, key, value)
        ctx.cp = (cp_group, cp_size, cp_rank, softmax_scale)
        return out

    @staticmethod
    def backward(ctx, grad_out) -> Tuple:
        query, key, value = ctx.saved_tensors
        cp_group, cp_size, cp_rank, softmax_scale = ctx.cp
        kv = _gather_kv(torch.stack([key, value]), cp_group, cp_size)
        c = query.size(2) // 2
        grad_q = torch.empty_like(query)
        grad_kv = torch.zeros_like(kv)
        for h, g in enumerate(chunk_ids(cp_size, cp_rank)):
            visible = (g + 1) * c
            with torch.enable_grad():
                q_h = query[:, :, h * c:(h + 1) * c].detach().requires_grad_(True)
                k_h = kv[0, :, :, :visible].detach().requires_grad_(True)
                v_h = kv[1, :, :, :visible].detach().requires_grad_(True)
                out_h = _chunk_attention(q_h, k_h, v_h, g, softmax_scale)
                dq, dk, dv = torch.autograd.grad(out_h, (q_h, k_h, v_h), grad_out[:, :, h * c:(h + 1) * c])
            grad_q[:, :, h * c:(h + 1) * c] = dq
            grad_kv[0, :, :, :visible] += dk
            grad_kv[1, :, :, :visible] += dv
        grad_local = _reduce_scatter_kv(grad_kv, cp_group, cp_size, cp_rank)
        return grad_q, grad_local[0], grad_local[1], None, None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_group,
              softmax_scale: float) -> torch.Tensor:
    """Causal attention of this rank's queries ``[b, np, s_local, hn]`` over the whole sequence, K/V
    ``[b, ng, s_local, hn]`` all-gathered over ``cp_group`` (see the package docstring for the layout).

    Returns ``[b, np, s_local, hn]``. Raises ValueError when ``s_local`` is odd (two chunks per rank).
    """
    if query.size(2) % 2 != 0:
        raise ValueError(f"local sequence length {query.size(2)} must hold two equal chunks")
    return _AllGatherAttention.apply(query, key, value, cp_group, softmax_scale)
