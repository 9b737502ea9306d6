"""Context-parallel attention kernels (p2p ring, a2a Ulysses, all_gather) on 2 and 4 gloo ranks vs full causal SDPA.

Errors are ``max |got - want| / (1 + |want|)`` (atol = rtol). Each rank draws the same global q, k, v, dO,
keeps its load-balanced rows (``local_positions``), runs
``context_parallel_attention`` and compares output and q/k/v gradients with full causal attention on the
whole sequence in one process. It also records every tensor saved for backward (saved_tensors_hooks)
and checks that none is larger than this rank's query ``[b, np, s/cp, hn]`` (so neither an ``[s, s]``
score matrix nor any per-block score block is kept for backward).
"""
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron.core.transformer import context_parallel as cp_attn

KERNEL_DIR = Path(cp_attn.__file__).parent
# hn < s / (2 cp) for cp <= 4: even the smallest score block ([b, np, s/2cp, s/cp]) outgrows q [b, np, s/cp, hn]
S_GLOBAL, HN = 64, 4
# name: (b, np, ng, dtype, forward tolerance, gradient tolerance)
CASES = {
    "mha_fp32": (1, 4, 4, torch.float32, 1e-6, 1e-6),
    "gqa_fp32_b2": (2, 4, 2, torch.float32, 1e-6, 1e-6),
    "mqa_fp32": (1, 4, 1, torch.float32, 1e-6, 1e-6),
    "gqa_bf16_b2": (2, 4, 2, torch.bfloat16, 2e-2, 5e-2),
}


def _global_tensors(b, heads, groups, dtype, seed=1234):
    """The same global q, k, v, dO on every rank, rounded to ``dtype``; scale 0.5 keeps the softmax peaked."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, S_GLOBAL, HN, generator=gen) * 0.5
    k = torch.randn(b, groups, S_GLOBAL, HN, generator=gen) * 0.5
    v = torch.randn(b, groups, S_GLOBAL, HN, generator=gen)
    dout = torch.randn(b, heads, S_GLOBAL, HN, generator=gen)
    return [t.to(dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, scale):
    """fp32 full causal attention and its q, k, v gradients, in this process."""
    q, k, v = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def _max_err(got, want) -> float:
    """max |got - want| / (1 + |want|): an absolute error for entries below 1, a relative one above
    (``torch.allclose`` with atol = rtol = the tolerance)."""
    return ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()


def _run_case(comm_type, group, cp, cp_rank, b, heads, groups, dtype):
    """``{'fwd', 'dq', 'dk', 'dv': max abs error, 'saved_max_numel', 'saved_limit'}`` on this rank."""
    scale = 1.0 / math.sqrt(HN)
    q, k, v, dout = _global_tensors(b, heads, groups, dtype)
    ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, scale)
    pos = cp_attn.local_positions(S_GLOBAL, cp, cp_rank)
    lq, lk, lv = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cp_attn.context_parallel_attention(lq, lk, lv, cp_group=group, comm_type=comm_type,
                                                 softmax_scale=scale)
    assert out.shape == lq.shape and out.dtype == dtype, (out.shape, out.dtype)
    out.backward(dout[:, :, pos])
    return {"fwd": _max_err(out, ref_out[:, :, pos]), "dq": _max_err(lq.grad, ref_dq[:, :, pos]),
            "dk": _max_err(lk.grad, ref_dk[:, :, pos]), "dv": _max_err(lv.grad, ref_dv[:, :, pos]),
            "saved_max_numel": max(saved, default=0), "saved_limit": lq.numel()}


def _check_kernel(rank, world, comm_type, case_names, subgroups, plain_ring_kernels=False):
    """Every case on this rank: ``{case: errors}``; with ``subgroups`` the CP groups are halves of the world;
    ``plain_ring_kernels``: ring attention without PyTorch's CPU flash ops (its path on other devices)."""
    torch.set_num_threads(1)
    if plain_ring_kernels:  # this rank is its own process: the change ends with it
        from megatron.core.transformer.context_parallel import ring_attention

        ring_attention._CPU_FLASH = None
    if subgroups:  # CP groups {0..w/2-1}, {w/2..w-1}: neighbours by global rank, not group rank
        half = world // 2
        groups = [dist.new_group(list(range(start, start + half))) for start in (0, half)]
        group, cp, cp_rank = groups[rank // half], half, rank % half
    else:
        group, cp, cp_rank = dist.group.WORLD, world, rank
    results = {}
    for name in case_names:
        b, heads, groups_kv, dtype, _, _ = CASES[name]
        results[name] = _run_case(comm_type, group, cp, cp_rank, b, heads, groups_kv, dtype)
    return results


def _assert_within(results, comm_type, world):
    failures, lines = [], []
    for rank, per_case in enumerate(results):
        for name, err in sorted(per_case.items()):
            _, _, _, _, fwd_tol, grad_tol = CASES[name]
            lines.append(f"{comm_type} cp={world} rank{rank} {name}: fwd {err['fwd']:.2e} dq {err['dq']:.2e} "
                         f"dk {err['dk']:.2e} dv {err['dv']:.2e} saved max numel {err['saved_max_numel']}")
            if err["fwd"] > fwd_tol or max(err["dq"], err["dk"], err["dv"]) > grad_tol:
                failures.append(lines[-1])
            if err["saved_max_numel"] > err["saved_limit"]:
                failures.append(f"{lines[-1]}: a saved tensor larger than the local query "
                                f"({err['saved_limit']} elements): scores kept for backward")
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
@pytest.mark.parametrize("comm_type", cp_attn.CP_COMM_TYPES)
def test_context_parallel_attention_matches_full_attention(comm_type, world):
    results = run_distributed(_check_kernel, world, comm_type, sorted(CASES), False, timeout=240)
    _assert_within(results, comm_type, world)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("comm_type", cp_attn.CP_COMM_TYPES)
def test_context_parallel_attention_on_subgroups(comm_type):
    """Two CP groups of 2 in a world of 4: peers are addressed by global rank."""
    results = run_distributed(_check_kernel, 4, comm_type, ["gqa_fp32_b2"], True, timeout=240)
    _assert_within(results, comm_type, 2)


@pytest.mark.timeout(300)
def test_ring_attention_with_plain_block_kernels():
    """p2p on 4 ranks through the plain-tensor-op block kernels (what runs off CPU)."""
    results = run_distributed(_check_kernel, 4, "p2p", sorted(CASES), False, True, timeout=240)
    _assert_within(results, "p2p(plain)", 4)


def _a2a_heads_error(rank, world):
    q = torch.zeros(1, 2, 8, HN)
    try:
        cp_attn.context_parallel_attention(q, q, q, cp_group=dist.group.WORLD, comm_type="a2a", softmax_scale=1.0)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_a2a_refuses_heads_not_divisible_by_cp():
    messages = run_distributed(_a2a_heads_error, 4, timeout=240)
    for message in messages:
        assert message is not None and "--num-attention-heads" in message and "--context-parallel-size" in message


def test_kernels_without_process_group_equal_causal_sdpa():
    """One process, no torch.distributed: both kernels are plain causal attention (a ring of one)."""
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised in this process; this case needs a single process with none")
    q, k, v, dout = _global_tensors(2, 4, 2, torch.float32)
    ref_out, ref_dq, _, _ = _reference(q, k, v, dout, 0.3)
    for comm_type in ("p2p", "a2a"):
        lq = q.clone().requires_grad_()
        out = cp_attn.context_parallel_attention(lq, k, v, cp_group=None, comm_type=comm_type, softmax_scale=0.3)
        out.backward(dout)
        assert _max_err(out, ref_out) <= 1e-6 and _max_err(lq.grad, ref_dq) <= 1e-6, comm_type


def test_unknown_comm_type_and_bad_shapes_are_refused():
    q = torch.zeros(1, 4, 8, HN)
    with pytest.raises(ValueError, match="--cp-comm-type"):
        cp_attn.context_parallel_attention(q, q, q, cp_group=None, comm_type="ring", softmax_scale=1.0)
    with pytest.raises(ValueError, match="multiple of the key/value groups"):
        cp_attn.context_parallel_attention(q, q[:, :3], q[:, :3], cp_group=None, comm_type="p2p", softmax_scale=1.0)


def test_saved_tensor_check_sees_a_score_block():
    """The saved-tensor limit is meaningful at these sizes: plain autograd attention of the smallest ring
    block (half the local queries against all local keys) saves a tensor larger than the local query."""
    q = torch.randn(2, 4, S_GLOBAL // 4, HN, requires_grad=True)  # cp = 4
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
        torch.softmax(q[:, :, S_GLOBAL // 8:] @ q.transpose(-1, -2), dim=-1).sum()
    assert max(saved) > q.numel()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_block_plan_covers_each_causal_pair_once(cp):
    """Over the cp ring steps, rank r's blocks (causal ones lower-triangular) cover every (query, key) pair with
    key position <= query position exactly once, and no other pair: skipped blocks are all in the future."""
    from megatron.core.transformer.context_parallel.ring_attention import _block_plan

    seq, chunk = 8 * cp, 4  # 2 cp chunks of 4 tokens
    for rank in range(cp):
        q_pos = cp_attn.local_positions(seq, cp, rank)
        covered = torch.zeros(2 * chunk, seq, dtype=torch.int64)
        for step in range(cp):
            k_pos = cp_attn.local_positions(seq, cp, (rank - step) % cp)
            for rows, cols, causal in _block_plan(step, rank, chunk):
                n_rows, n_cols = len(q_pos[rows]), len(k_pos[cols])
                seen = torch.ones(n_rows, n_cols, dtype=torch.bool)
                if causal:
                    assert n_rows == n_cols
                    seen = seen.tril()
                covered[rows][:, k_pos[cols]] += seen  # rows is a slice: a view of covered
        want = (torch.arange(seq)[None, :] <= q_pos[:, None]).long()
        assert torch.equal(covered, want), (cp, rank)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_block_kernels_plain_ops_equal_cpu_flash(causal):
    """The two block kernels of ring_attention (PyTorch's CPU flash ops; plain tensor ops, the path off CPU)
    agree, forward and backward with the final out/lse of a longer row (GQA: 4 query heads, 2 K/V groups)."""
    from megatron.core.transformer.context_parallel import ring_attention as ra

    if not ra._use_cpu_flash(torch.zeros(1)):
        pytest.skip("this torch has no CPU flash-attention ops: only the plain kernels run")
    gen = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(2, 4, 8, HN, generator=gen) for _ in range(2))
    k, v, k_more, v_more = (torch.randn(2, 2, 8, HN, generator=gen) for _ in range(4))
    scale = 0.4
    # final out / lse over this block plus an earlier one, as the ring passes them to backward
    out1, lse1 = ra._plain_block_forward(q, k_more, v_more, scale, False)
    out2, lse2 = ra._plain_block_forward(q, k, v, scale, causal)
    flash_out, flash_lse = ra._block_forward(q, k, v, scale, causal)
    assert _max_err(flash_out, out2) <= 1e-6 and _max_err(flash_lse, lse2) <= 1e-6
    out, lse = out1.clone(), lse1.clone()
    ra._merge(out, lse, out2, lse2)
    for got, want in zip(ra._block_backward(q, k, v, dout, out, lse, scale, causal),
                         ra._plain_block_backward(q, k, v, dout, out, lse, scale, causal)):
        assert got.shape == want.shape and _max_err(got, want) <= 1e-6
