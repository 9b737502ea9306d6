"""CUDA RNG tracker on a GPU: named CUDA generator states, fork semantics, Megatron's seed offsets, recompute.

On the CPU CI the tracker falls back to the CPU generator; here its states must be CUDA generator
states so that dropout on the GPU is reproducible and per-TP-rank.
"""
import torch

from gpu_utils import requires_cuda

pytestmark = requires_cuda


def test_fork_uses_the_named_cuda_state_and_leaves_the_default_alone(nccl_group):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)
    tracker = get_cuda_rng_tracker()
    default_before = torch.cuda.get_rng_state()
    with tracker.fork():
        first = torch.rand(1000, device="cuda")
    # Forking neither draws from nor advances the default CUDA generator.
    assert torch.equal(torch.cuda.get_rng_state(), default_before)
    with tracker.fork():
        second = torch.rand(1000, device="cuda")
    assert not torch.equal(first, second)  # the named state advanced and was stored back
    # model-parallel-rng is seed + 2718 + tp_rank (rank 0 here), drawn on the CUDA generator.
    torch.cuda.manual_seed(123 + 2718)
    expected = torch.rand(1000, device="cuda")
    torch.cuda.set_rng_state(default_before)
    assert torch.equal(first, expected)
    # The default stream is seed itself.
    torch.cuda.manual_seed(123)
    reference_default = torch.cuda.get_rng_state()
    model_parallel_cuda_manual_seed(123)
    assert torch.equal(torch.cuda.get_rng_state(), reference_default)
    # States are CUDA generator states and round-trip through get_states/set_states (checkpoints).
    states = tracker.get_states()
    assert all(s.dtype == torch.uint8 and s.numel() == reference_default.numel() for s in states.values())
    with tracker.fork():
        a = torch.rand(10, device="cuda")
    tracker.set_states(states)
    with tracker.fork():
        b = torch.rand(10, device="cuda")
    assert torch.equal(a, b)


def test_recomputed_dropout_draws_the_same_cuda_mask(nccl_group):
    """``tensor_parallel.checkpoint`` replays forward in backward: its CUDA dropout mask must be the same."""
    from megatron.core import tensor_parallel

    def block(x):
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(x * 2.0, p=0.5, training=True)

    tensor_parallel.model_parallel_cuda_manual_seed(5)
    x = torch.randn(4096, device="cuda", requires_grad=True)
    block(x).sum().backward()
    plain = x.grad.clone()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    x.grad = None
    out = tensor_parallel.checkpoint(block, False, x)
    out.sum().backward()
    assert ((plain == 0) | (plain == 4.0)).all() and (plain == 0).any() and (plain != 0).any()
    assert torch.equal(x.grad, plain)
