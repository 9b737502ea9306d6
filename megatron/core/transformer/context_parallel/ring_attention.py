"""Ring attention (``--cp-comm-type p2p``): K/V blocks go around the CP ring and are merged by log-sum-exp.

Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context", section 3: every
rank keeps its queries and passes its key/value block to the next rank of the ring, so after ``cp`` steps
each query has seen every key; the partial results of the blocks are combined with the online-softmax
rule (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): for two partial results
``(o1, l1)``, ``(o2, l2)`` of the same rows (``l`` = the row's log-sum-exp of its scores),
``l = log(exp(l1) + exp(l2))`` and ``o = o1 exp(l1 - l) + o2 exp(l2 - l)``.

Which blocks are computed (the load-balanced layout of ``__init__``: rank ``r`` holds chunks ``r`` and
``2cp-1-r``, its local queries ``q = [q0 | q1]`` and keys ``k = [k0 | k1]`` are two chunks each). At ring
step ``i`` rank ``r`` holds the K/V of rank ``j = (r - i) mod cp``:

- ``i = 0`` (``j = r``): the local tokens are in increasing global order (``r < 2cp-1-r``), so this is
  ordinary causal attention of ``q`` over ``k``; q0-k1 lies wholly in the future and is skipped, leaving
  q0-k0 (causal) and q1-[k0 | k1] (causal, shifted by one chunk).
- ``j < r``: chunk ``j`` precedes both of rank ``r``'s chunks and chunk ``2cp-1-j`` follows both, so all
  of ``q`` attends to ``k0`` only, without a mask.
- ``j > r``: chunk ``j`` and chunk ``2cp-1-j`` both lie after chunk ``r`` and before chunk ``2cp-1-r``,
  so only ``q1`` attends, to all of ``k``, without a mask.

Every off-diagonal step is therefore one ``[s/2cp, s/cp]``-sized block per head: the same work on every
rank (Megatron-LM / Transformer Engine split their steps the same way). Scores, softmax statistics and
the accumulators are fp32 whatever the input dtype; K/V travel in the input dtype, dK/dV accumulators
in fp32.

Backward (explicit, as in FlashAttention): the per-row log-sum-exp ``lse`` of the forward is saved,
each block's probabilities are recomputed as ``exp(q kᵀ scale - lse)`` and freed, and the dK/dV
accumulator of every K/V block travels around the ring with it, reaching its owner after ``cp``
steps. Nothing of size ``[s, s]`` is ever saved; the largest saved tensors are ``q, k, v, out``.

Overlap: the exchange of the next K/V block (``batch_isend_irecv``) is started before this block's
compute and waited for after it; in backward, the dK/dV accumulator received from the previous rank is
waited for only after this block's gradients are computed. Under NCCL the transfers run on NCCL's own
stream, so they overlap the compute kernels of the current stream.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device

_KV_TAG, _DKV_TAG = 0, 1  # gloo matches messages by tag; NCCL by order, which is the same on every rank


class _Ring:
    """This rank's place in the CP ring: size, rank, the global ranks of its neighbours, the comm device."""

    def __init__(self, group):
        if dist.is_available() and dist.is_initialized():
            self.group = group if group is not None else dist.group.WORLD
            self.size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        else:  # one process without torch.distributed: a ring of one
            self.group, self.size, self.rank = None, 1, 0
        if self.size > 1:
            self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
            self.device = get_collective_device(self.group)

    def exchange(self, tensor: torch.Tensor, tag: int) -> "_Transfer":
        """Start sending ``tensor`` to the next rank and receiving a tensor like it from the previous one."""
        send = tensor.to(self.device).contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return _Transfer(send, recv, dist.batch_isend_irecv(ops))


class _Transfer:
    """One started ring exchange; :meth:`wait` returns the received tensor on ``device``."""

    def __init__(self, send, recv, works):
        self._send, self._recv, self._works = send, recv, works  # the send buffer must outlive the transfer

    def wait(self, device) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._send = None
        return self._recv.to(device)


def _block_plan(step: int, rank: int, chunk: int) -> List[Tuple[slice, slice, Optional[int]]]:
    """The blocks ``(query rows, key columns, causal offset)`` of ring step ``step`` on CP rank ``rank``.

    ``causal offset`` ``o``: query row ``i`` of the block sees key columns ``<= i + o``; None: no mask.
    Step 0 is split into q0 x k0 (causal) and q1 x [k0 | k1] (causal with offset ``chunk``), which leaves
    out the masked q0 x k1 quarter (see the module docstring for the other steps).
    """
    if step == 0:
        return [(slice(0, chunk), slice(0, chunk), 0), (slice(chunk, None), slice(None), chunk)]
    if step <= rank:  # the K/V of rank j = rank - step < rank
        return [(slice(None), slice(0, chunk), None)]
    return [(slice(chunk, None), slice(None), None)]  # j = rank - step + cp > rank


def _scores(q, k, scale, causal_offset):
    """fp32 ``q kᵀ scale`` ``[b, ng, rep, sq, sk]``; keys after row ``i + causal_offset`` at -inf (None: no mask)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal_offset is not None:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1 + causal_offset)
        scores.masked_fill_(future, float("-inf"))
    return scores


def _block_forward(q, k, v, scale, causal_offset):
    """Softmax attention of one block: ``(out [b, ng, rep, sq, hn], lse [b, ng, rep, sq])``, fp32.

    ``q`` is ``[b, ng, rep, sq, hn]`` (the ``rep`` query heads of each K/V group), ``k, v`` are
    ``[b, ng, 1, sk, hn]``; all fp32.
    """
    scores = _scores(q, k, scale, causal_offset)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, causal_offset):
    """Gradients of one block ``(dq [b, ng, rep, sq, hn], dk, dv [b, ng, sk, hn])``, fp32.

    ``lse`` is the rows' log-sum-exp over ALL keys (from forward), so ``exp(scores - lse)`` are the
    block's entries of the full softmax; ``delta = rowsum(dout * out)`` ``[b, ng, rep, sq]``.
    """
    probs = _scores(q, k, scale, causal_offset).sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(dim=2)
    dscores = torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(probs).mul_(scale)
    del probs
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2)
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Fold a block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place (log-sum-exp rule)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _grouped(x: torch.Tensor, ng: int) -> torch.Tensor:
    """``[b, np, s, hn]`` -> fp32 ``[b, ng, np/ng, s, hn]``: query heads under their K/V group (GQA)."""
    b, heads, s, hn = x.shape
    return x.float().reshape(b, ng, heads // ng, s, hn)


def _kv_block(kv: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fp32 ``[b, ng, 1, s, hn]`` key and value of a stacked ``[2, b, ng, s, hn]`` K/V block."""
    kv = kv.to(device=device, dtype=torch.float32)
    return kv[0].unsqueeze(2), kv[1].unsqueeze(2)


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the load-balanced CP layout, with an explicit ring backward."""

    @staticmethod
    def forward(ctx, query, key, value, cp_group, softmax_scale):
        ring = _Ring(cp_group)
        b, heads, s, hn = query.shape
        ng, chunk = key.shape[1], s // 2
        q = _grouped(query, ng)
        kv = torch.stack([key, value])  # one message per step; travels in the input dtype
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            k, v = _kv_block(kv, query.device)
            for rows, cols, causal_offset in _block_plan(step, ring.rank, chunk):
                block_out, block_lse = _block_forward(q[..., rows, :], k[..., cols, :], v[..., cols, :],
                                                      softmax_scale, causal_offset)
                if step == 0:  # step 0's blocks cover every row once, so lse is finite from here on
                    out[..., rows, :], lse[..., rows] = block_out, block_lse
                else:
                    _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
                del block_out, block_lse
            del k, v
            if pending is not None:
                kv = pending.wait(query.device)
        out = out.reshape(b, heads, s, hn).to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.cp_group, ctx.softmax_scale = cp_group, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.cp_group), ctx.softmax_scale
        b, heads, s, hn = query.shape
        ng, chunk = key.shape[1], s // 2
        q, dout = _grouped(query, ng), _grouped(grad_out, ng)
        delta = (dout * _grouped(out, ng)).sum(dim=-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([key, value])
        incoming: Optional[_Transfer] = None  # the accumulator of the K/V block we hold, from the previous rank
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            k, v = _kv_block(kv, query.device)
            dkv = torch.zeros(2, b, ng, s, hn, dtype=torch.float32, device=query.device)
            for rows, cols, causal_offset in _block_plan(step, ring.rank, chunk):
                block_dq, block_dk, block_dv = _block_backward(
                    q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :], lse[..., rows],
                    delta[..., rows], scale, causal_offset)
                dq[..., rows, :] += block_dq
                dkv[0][..., cols, :] += block_dk
                dkv[1][..., cols, :] += block_dv
                del block_dq, block_dk, block_dv
            del k, v
            if incoming is not None:
                dkv += incoming.wait(query.device)
            # After the last step the accumulator we hold is the next rank's own: this send delivers it.
            incoming = ring.exchange(dkv, _DKV_TAG) if ring.size > 1 else None
            if pending is not None:
                kv = pending.wait(query.device)
        if incoming is not None:
            dkv = incoming.wait(query.device)
        dq = dq.reshape(b, heads, s, hn).to(query.dtype)
        return dq, dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_group,
              softmax_scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence by ring attention (``--cp-comm-type p2p``).

    Args:
        query: ``[b, np, s_local, hn]``, this rank's two chunks (``chunk_ids`` of the package).
        key, value: ``[b, ng, s_local, hn]``; ``np`` a multiple of ``ng`` (GQA).
        cp_group: the context-parallel group (None: the default group, or one rank without torch.distributed).
        softmax_scale: the scale of ``q kᵀ``.

    Returns ``[b, np, s_local, hn]`` in the dtype of ``query``. Raises ValueError on inconsistent shapes.
    """
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(f"ring attention takes query [b, np, s, hn] and key/value [b, ng, s, hn]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    b, heads, s, hn = query.shape
    if key.shape[0] != b or key.shape[2:] != (s, hn) or heads % key.shape[1] != 0:
        raise ValueError(f"key/value {tuple(key.shape)} do not fit query {tuple(query.shape)}: need the same b, "
                         "s, hn and a number of query heads that is a multiple of the key/value groups")
    if s % 2 != 0:
        raise ValueError(f"local sequence length {s} is not two equal chunks (see local_positions)")
    return RingAttention.apply(query, key, value, cp_group, softmax_scale)
