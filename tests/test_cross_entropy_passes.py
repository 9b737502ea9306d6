"""The vocab-parallel cross entropy reads/writes the [s, b, V/tp] logits in five passes (forward + backward),
and its loss and grad equal torch's cross entropy and an unfused autograd composition within 1e-6 (fp32),
at TP = 1 and TP = 2."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dist_utils import run_distributed
from megatron.core import tensor_parallel

S, B, V = 6, 3, 40

# Ops that touch a full-size tensor without a pass over its elements: views, allocation, and the
# per-token gathers/scatters of the target logit.
_NOT_A_PASS = {"aten.view.default", "aten._unsafe_view.default", "aten.detach.default", "aten.alias.default",
               "aten.empty.memory_format", "aten.empty_strided.default", "aten.as_strided.default",
               "aten.unsqueeze.default", "aten.expand.default", "aten.index.Tensor", "aten.index_put_.default",
               "aten.index_put.default", "aten.slice.Tensor", "aten.select.int", "aten.t.default"}


class _LogitPasses(TorchDispatchMode):
    """Count the ops (forward and backward) whose inputs or outputs include a tensor of ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel = numel
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if str(func) not in _NOT_A_PASS and any(t.numel() == self.numel for t in tensors):
            self.ops.append(str(func).replace("aten.", "").replace(".default", ""))
        return out


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_makes_five_passes_over_the_logits(dtype, smoothing):
    """Before: amax, sub, exp_, sum, div_ (softmax), mul_ (grad), _to_copy (bf16 grad): 7 (6 in fp32)."""
    logits = torch.randn(S, B, V).to(dtype).requires_grad_()
    target = torch.randint(0, V, (S, B))
    with _LogitPasses(S * B * V) as record:
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
        loss.backward(torch.rand(S, B))
    extra = 1 if smoothing else 0  # the sum of the shifted logits for the smoothing term
    assert len(record.ops) == 5 + extra, record.ops


def _unfused_reference(full_logits, target, smoothing):
    """Composition of plain autograd ops: log-softmax, target pick, Megatron's smoothing over the full vocab."""
    log_probs = torch.log_softmax(full_logits.float(), dim=-1)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if not smoothing:
        return nll
    a = smoothing * full_logits.size(-1) / (full_logits.size(-1) - 1)
    return (1 - a) * nll - a * log_probs.mean(dim=-1)


def _loss_and_grads(rank, world_size, smoothing):
    """This rank's loss and vocab-slice grad, with the references' (computed on the full logits)."""
    from megatron.core import parallel_state

    if world_size > 1:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(S, B, V, generator=g) * 4
    target = torch.randint(0, V, (S, B), generator=g)
    grad_out = torch.rand(S, B, generator=g)
    shard = V // world_size
    mine = full[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(mine, target, label_smoothing=smoothing)
    loss.backward(grad_out)

    results = {"ours": (loss.detach(), mine.grad)}
    torch_logits = full.clone().requires_grad_()
    torch_loss = F.cross_entropy(torch_logits.view(-1, V), target.view(-1), reduction="none",
                                 label_smoothing=smoothing * V / (V - 1)).view(S, B)
    unfused_logits = full.clone().requires_grad_()
    unfused_loss = _unfused_reference(unfused_logits, target, smoothing)
    for name, ref_loss, ref_logits in (("torch", torch_loss, torch_logits), ("unfused", unfused_loss, unfused_logits)):
        ref_loss.backward(grad_out)
        results[name] = (ref_loss.detach(), ref_logits.grad[..., rank * shard:(rank + 1) * shard])
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("tp", [1, 2])
def test_loss_and_grad_equal_torch_and_unfused_reference(tp, smoothing):
    per_rank = _loss_and_grads(0, 1, smoothing) if tp == 1 else run_distributed(_loss_and_grads, 2, smoothing)
    for results in per_rank if tp > 1 else [per_rank]:
        loss, grad = results["ours"]
        for name in ("torch", "unfused"):
            ref_loss, ref_grad = results[name]
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6, msg=name)
            torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6, msg=name)
