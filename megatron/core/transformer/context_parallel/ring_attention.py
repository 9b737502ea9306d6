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
  q0-k0 (causal), q1-k0 (no mask) and q1-k1 (causal).
- ``j < r``: chunk ``j`` precedes both of rank ``r``'s chunks and chunk ``2cp-1-j`` follows both, so all
  of ``q`` attends to ``k0`` only, without a mask.
- ``j > r``: chunk ``j`` and chunk ``2cp-1-j`` both lie after chunk ``r`` and before chunk ``2cp-1-r``,
  so only ``q1`` attends, to all of ``k``, without a mask.

Every off-diagonal step is therefore one ``[s/2cp, s/cp]``-sized block per head: the same work on every
rank (Megatron-LM / Transformer Engine split their steps the same way). Scores, softmax statistics and
the accumulators are fp32 whatever the input dtype; K/V travel in the input dtype, dK/dV accumulators
in fp32.

Backward (explicit, as in FlashAttention): the per-row log-sum-exp ``lse`` of the forward is saved,
each block's probabilities are recomputed as ``exp(q kᵀ scale - lse)`` and freed (on CPU by PyTorch's
flash-attention kernels, which take the saved output and ``lse``; elsewhere by plain tensor ops), and
the dK/dV accumulator of every K/V block travels around the ring with it, reaching its owner after
``cp`` steps. Nothing of size ``[s, s]`` is ever saved; the largest saved tensors are ``q, k, v, out``.

Overlap: the exchange of the next K/V block (``batch_isend_irecv``) is started before this block's
compute and waited for after it; in backward, the dK/dV accumulator received from the previous rank is
waited for only after this block's gradients are computed. Under NCCL the transfers run on NCCL's own
stream, so they overlap the compute kernels of the current stream.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device
from megatron.core.transformer.context_parallel.comm import cp_comm_section

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
        with cp_comm_section("ring_post", **{"megatron.cp.size": self.size}):
            works = dist.batch_isend_irecv(ops)
        return _Transfer(send, recv, works)


class _Transfer:
    """One started ring exchange; :meth:`wait` returns the received tensor on ``device``."""

    def __init__(self, send, recv, works):
        self._send, self._recv, self._works = send, recv, works  # the send buffer must outlive the transfer

    def wait(self, device) -> torch.Tensor:
        with cp_comm_section("ring_wait"):  # the part of the transfer that compute did not hide
            for work in self._works:
                work.wait()
        self._send = None
        return self._recv.to(device)


def _block_plan(step: int, rank: int, chunk: int) -> List[Tuple[slice, slice, bool]]:
    """The blocks ``(query rows, key columns, causal)`` of ring step ``step`` on CP rank ``rank``.

    ``causal``: query row ``i`` of the (square) block sees key columns ``<= i``; else every column.
    Step 0 is q0 x k0 (causal), q1 x k0 (full), q1 x k1 (causal), leaving out the masked q0 x k1
    quarter (see the module docstring for the other steps).
    """
    if step == 0:
        return [(slice(0, chunk), slice(0, chunk), True), (slice(chunk, None), slice(0, chunk), False),
                (slice(chunk, None), slice(chunk, None), True)]
    if step <= rank:  # the K/V of rank j = rank - step < rank
        return [(slice(None), slice(0, chunk), False)]
    return [(slice(chunk, None), slice(None), False)]  # j = rank - step + cp > rank


# ---- one block's attention and its gradients, all fp32. q [b, np, sq, hn], k, v [b, ng, sk, hn] (GQA).
# PyTorch's CPU flash kernels return the row log-sum-exp and take it back in backward (the same private
# ops torch.distributed.tensor's own ring attention calls); elsewhere (CUDA, or a torch without them) the
# plain-tensor-op kernels below do the same arithmetic, one block of scores at a time.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_cpu_flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _CPU_FLASH is not None and _CPU_FLASH_BACKWARD is not None


def _scores(q, k, scale, causal):
    """``q kᵀ scale`` ``[b, ng, rep, sq, sk]`` of grouped ``q`` ``[b, ng, rep, sq, hn]`` and ``k``
    ``[b, ng, 1, sk, hn]``; with ``causal`` (a square block) the keys after each row at -inf."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(future, float("-inf"))
    return scores


def _grouped(q, k, v):
    """``q`` ``[b, np, s, hn]`` -> ``[b, ng, np/ng, s, hn]`` (query heads under their K/V group); ``k, v`` get dim 2."""
    b, heads, sq, hn = q.shape
    return q.reshape(b, k.shape[1], heads // k.shape[1], sq, hn), k.unsqueeze(2), v.unsqueeze(2)


def _plain_block_forward(q, k, v, scale, causal):
    qg, kg, vg = _grouped(q, k, v)
    scores = _scores(qg, kg, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), vg)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _plain_block_backward(q, k, v, dout, out, lse, scale, causal):
    qg, kg, vg = _grouped(q, k, v)
    doutg = dout.reshape(qg.shape)
    delta = (dout * out).sum(dim=-1).reshape(qg.shape[:-1])
    probs = _scores(qg, kg, scale, causal).sub_(lse.reshape(qg.shape[:-1]).unsqueeze(-1)).exp_()
    dv = torch.matmul(probs.transpose(-1, -2), doutg).sum(dim=2)
    dscores = torch.matmul(doutg, vg.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(probs).mul_(scale)
    del probs
    dq = torch.matmul(dscores, kg).reshape(q.shape)
    dk = torch.matmul(dscores.transpose(-1, -2), qg).sum(dim=2)
    return dq, dk, dv


def _repeat_groups(k, v, heads):
    """K/V ``[b, ng, sk, hn]`` repeated to ``heads`` heads, contiguous (the flash kernels want equal heads)."""
    rep = heads // k.shape[1]
    return tuple((t.repeat_interleave(rep, dim=1) if rep > 1 else t).contiguous() for t in (k, v))


def _block_forward(q, k, v, scale, causal):
    """Softmax attention of one block: ``(out [b, np, sq, hn], lse [b, np, sq])``, fp32 (``lse``: the rows'
    log-sum-exp of their scaled scores over this block's keys)."""
    if not _use_cpu_flash(q):
        return _plain_block_forward(q, k, v, scale, causal)
    k, v = _repeat_groups(k, v, q.shape[1])
    return _CPU_FLASH(q.contiguous(), k, v, 0.0, causal, scale=scale)


def _block_backward(q, k, v, dout, out, lse, scale, causal):
    """Gradients ``(dq [b, np, sq, hn], dk, dv [b, ng, sk, hn])`` of one block, fp32.

    ``out`` and ``lse`` are the rows' FINAL output and log-sum-exp over ALL keys (from forward), so
    ``exp(scores - lse)`` are this block's entries of the full softmax and ``rowsum(dout * out)`` is the
    full softmax's correction term: the block's share of the gradient, as in FlashAttention's backward.
    """
    if not _use_cpu_flash(q):
        return _plain_block_backward(q, k, v, dout, out, lse, scale, causal)
    b, ng, sk, hn = k.shape
    kr, vr = _repeat_groups(k, v, q.shape[1])
    dq, dk, dv = _CPU_FLASH_BACKWARD(dout.contiguous(), q.contiguous(), kr, vr, out.contiguous(), lse.contiguous(),
                                     0.0, causal, scale=scale)
    if kr is not k:  # sum the copies of each K/V group
        dk, dv = (t.reshape(b, ng, -1, sk, hn).sum(dim=2) for t in (dk, dv))
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse):
    """Fold a block's ``(block_out, block_lse)`` into the running ``(out, lse)`` in place (log-sum-exp rule)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


def _kv_block(kv: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fp32 ``[b, ng, s, hn]`` key and value of a stacked ``[2, b, ng, s, hn]`` K/V block."""
    kv = kv.to(device=device, dtype=torch.float32)
    return kv[0], kv[1]


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the load-balanced CP layout, with an explicit ring backward."""

    @staticmethod
    def forward(ctx, query, key, value, cp_group, softmax_scale):
        ring = _Ring(cp_group)
        chunk = query.shape[2] // 2
        q = query.float()
        kv = torch.stack([key, value])  # one message per step; travels in the input dtype
        # Every row's first block meets lse = -inf: logaddexp gives the block's lse and out * 0 + block_out.
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            k, v = _kv_block(kv, query.device)
            for rows, cols, causal in _block_plan(step, ring.rank, chunk):
                block_out, block_lse = _block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                                      softmax_scale, causal)
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                del block_out, block_lse
            del k, v
            if pending is not None:
                kv = pending.wait(query.device)
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.cp_group, ctx.softmax_scale = cp_group, softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring, scale = _Ring(ctx.cp_group), ctx.softmax_scale
        chunk = query.shape[2] // 2
        q, dout, out = query.float(), grad_out.float(), out.float()
        dq = torch.zeros_like(q)
        kv = torch.stack([key, value])
        incoming: Optional[_Transfer] = None  # the accumulator of the K/V block we hold, from the previous rank
        for step in range(ring.size):
            pending = ring.exchange(kv, _KV_TAG) if step + 1 < ring.size else None
            k, v = _kv_block(kv, query.device)
            dkv = torch.zeros((2,) + tuple(key.shape), dtype=torch.float32, device=query.device)
            for rows, cols, causal in _block_plan(step, ring.rank, chunk):
                block_dq, block_dk, block_dv = _block_backward(
                    q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows], out[:, :, rows],
                    lse[:, :, rows], scale, causal)
                dq[:, :, rows] += block_dq
                dkv[0][:, :, cols] += block_dk
                dkv[1][:, :, cols] += block_dv
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
        dq = dq.to(query.dtype)
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
