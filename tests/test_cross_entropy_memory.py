"""The cross entropy owns the single fp32 upcast of the logits: allocation count, numerics, gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

# s * b * V is larger than every other tensor of the tiny model (attention scores, MLP activations,
# the [V, h] embedding), so each fresh fp32 tensor of that size is a copy of the logits.
H, HEADS, V, S, B = 16, 4, 72, 8, 3


class _FreshFp32Outputs(TorchDispatchMode):
    """Record every op (forward and backward) whose output is a newly allocated fp32 tensor of at
    least ``numel`` elements; views and in-place results share an input's storage and do not count."""

    def __init__(self, numel):
        super().__init__()
        self.numel = numel
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel
                    and t.untyped_storage().data_ptr() not in inputs):
                self.ops.append(str(func))
        return out


def _gpt(dtype):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype)
    return GPTModel(config, vocab_size=V, max_sequence_length=S).to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, V, (B, S), generator=g), torch.arange(S).expand(B, S),
            torch.randint(0, V, (B, S), generator=g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_loss_makes_one_fp32_copy_of_the_logits(dtype):
    """Forward + backward of the loss: one fp32 [s, b, V] buffer (the cross entropy's) besides the
    logits themselves when the model computes in fp32.

    Before the change, bf16 logits were upcast in the model and cloned again in the loss: two.
    """
    model = _gpt(dtype)
    ids, pos, labels = _batch()
    with _FreshFp32Outputs(S * B * V) as record:
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
    assert loss.dtype == torch.float32
    logits_themselves = ["aten.mm.default"] if dtype == torch.float32 else []  # output_layer's GEMM
    assert record.ops == logits_themselves + ["aten.empty.memory_format"], record.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cross_entropy_alone_allocates_one_fp32_buffer_and_keeps_input(dtype):
    logits = (torch.randn(S, B, V) * 3).to(dtype).requires_grad_()
    before = logits.detach().clone()
    target = torch.randint(0, V, (S, B))
    with _FreshFp32Outputs(S * B * V) as record:
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)
        loss.sum().backward()
    assert len(record.ops) == 1, record.ops
    assert logits.grad.dtype == dtype
    assert torch.equal(logits.detach(), before), "the caller's logits were modified"


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bf16_logits_loss_and_grad_match_fp32_reference(smoothing):
    torch.manual_seed(7)
    full = torch.randn(S, B, V) * 4
    target = torch.randint(0, V, (S, B))
    alpha = smoothing * V / (V - 1)  # Megatron's smoothing is torch's label_smoothing at this value

    logits = full.bfloat16().requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
    g = torch.rand(S, B)
    loss.backward(g)

    # Same bf16 values upcast by hand: the same fp32 math, so (nearly) bit-equal.
    upcast = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(upcast.view(-1, V), target.view(-1), reduction="none", label_smoothing=alpha).view(S, B)
    ref.backward(g)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    # The bf16 grad is the fp32 one rounded: at most one bf16 ulp (2^-7 relative) apart.
    torch.testing.assert_close(logits.grad.float(), upcast.grad, rtol=2 ** -7, atol=1e-7)

    # Against the unrounded fp32 logits: within what rounding the logits to bf16 costs.
    ref_fp32 = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none", label_smoothing=alpha).view(S, B)
    torch.testing.assert_close(loss, ref_fp32, rtol=2e-2, atol=4e-2)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fp32_grad_matches_autograd_of_reference(smoothing):
    torch.manual_seed(8)
    logits = (torch.randn(S, B, V) * 2).requires_grad_()
    target = torch.randint(0, V, (S, B))
    g = torch.rand(S, B)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
    loss.backward(g)
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none",
                          label_smoothing=smoothing * V / (V - 1)).view(S, B)
    ref.backward(g.double())
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    # softmax entries are ~1/V: an absolute 1e-7 keeps a missing smoothing/V term visible.
    torch.testing.assert_close(logits.grad, ref_logits.grad.float(), rtol=1e-5, atol=1e-7)
