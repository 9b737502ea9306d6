"""The all_gather context-parallel attention kernel against full causal attention on one process (gloo ranks)."""
import pytest
import torch

from dist_utils import run_distributed


def _reference(seed, b, heads, groups, s, hn):
    torch.manual_seed(seed)
    q = torch.randn(b, heads, s, hn, dtype=torch.float64)
    k = torch.randn(b, groups, s, hn, dtype=torch.float64)
    v = torch.randn(b, groups, s, hn, dtype=torch.float64)
    grad = torch.randn(b, heads, s, hn, dtype=torch.float64)
    return q, k, v, grad


def _cp_rank_fn(rank, world_size, comm_type, b, heads, groups, s, hn):
    import torch.distributed as dist

    from megatron.core.transformer.context_parallel import context_parallel_attention, local_positions

    q, k, v, grad = _reference(0, b, heads, groups, s, hn)
    pos = local_positions(s, world_size, rank)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, cp_group=dist.group.WORLD, comm_type=comm_type,
                                     softmax_scale=hn ** -0.5)
    out.backward(grad[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp,heads,groups", [(2, 4, 4), (2, 4, 2), (4, 2, 1)])
def test_all_gather_matches_full_attention(cp, heads, groups):
    b, s, hn = 2, 16, 8
    q, k, v, grad = _reference(0, b, heads, groups, s, hn)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hn ** -0.5,
                                                            enable_gqa=heads != groups)
    full.backward(grad)
    for pos, out, dq, dk, dv in run_distributed(_cp_rank_fn, cp, "all_gather", b, heads, groups, s, hn):
        torch.testing.assert_close(out, full.detach()[:, :, pos], rtol=0, atol=1e-12)
        torch.testing.assert_close(dq, q.grad[:, :, pos], rtol=0, atol=1e-12)
        torch.testing.assert_close(dk, k.grad[:, :, pos], rtol=0, atol=1e-12)
        torch.testing.assert_close(dv, v.grad[:, :, pos], rtol=0, atol=1e-12)


def _timed_rank_fn(rank, world_size):
    import torch.distributed as dist

    from megatron.core import step_timing
    from megatron.core.transformer.context_parallel.all_gather_attention import attention

    recorder = step_timing.StepTimeRecorder(use_cuda_events=False)
    step_timing.install(recorder)
    try:
        q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
        recorder.step_begin()
        attention(q, k, v, cp_group=dist.group.WORLD, softmax_scale=0.5).sum().backward()
        recorder.step_end()
        return recorder.take()
    finally:
        step_timing.uninstall()


@pytest.mark.timeout(120)
def test_all_gather_collectives_are_charged_to_cp_comm():
    for report in run_distributed(_timed_rank_fn, 2):
        assert report["cp_comm"] > 0.0 and report["steps"] == 1
