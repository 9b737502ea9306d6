"""On one GPU: flash/fused attention run their kernels and agree with unfused; compiled layers equal eager;
the loss's logits upcast is one fp32 copy by peak memory."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer import DotProductAttention, TransformerConfig
from megatron.core.transformer.attention_backend import attention_backend_unavailable_reason

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); run bash bench/gpu.sh on a GPU machine")

S, B, HEADS, HEAD_DIM = 256, 2, 8, 64
# The aten ops SDPA dispatches to for each restricted backend (cuDNN first, memory-efficient second).
KERNEL_OPS = {
    "flash": {"aten._scaled_dot_product_flash_attention"},
    "fused": {"aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_efficient_attention"},
}


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket._qualified_op_name.replace("::", "."))
        return func(*args, **(kwargs or {}))


def _rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _config(backend, **kw):
    base = dict(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, hidden_dropout=0.0,
                attention_dropout=0.0, attention_backend=backend, bf16=True, params_dtype=torch.bfloat16)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_kernel_runs_and_matches_unfused(backend, groups):
    reason = attention_backend_unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    q, k, v = rand(S, B, HEADS, HEAD_DIM), rand(S, B, groups, HEAD_DIM), rand(S, B, groups, HEAD_DIM)
    grad = rand(S, B, HEADS * HEAD_DIM)
    outputs = {}
    for name in (backend, "unfused"):
        core = DotProductAttention(_config(name, num_query_groups=groups), layer_number=1)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with _OpNames() as ops:
            out = core(*inputs, None)
            out.backward(grad)
        outputs[name] = (out, [t.grad for t in inputs], ops.names)
    assert outputs[backend][2] & KERNEL_OPS[backend], sorted(outputs[backend][2])
    assert not outputs["unfused"][2] & set().union(*KERNEL_OPS.values())
    assert _rel(outputs[backend][0], outputs["unfused"][0]) < 2e-2
    for got, ref in zip(outputs[backend][1], outputs["unfused"][1]):
        assert _rel(got, ref) < 3e-2


def _gpt(**kw):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = _config("auto", num_layers=2, use_cpu_initialization=True, **kw)
    return GPTModel(config, vocab_size=1024, max_sequence_length=S).cuda().bfloat16()


def _loss_and_grads(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (B, S), generator=g).cuda()
    labels = torch.randint(0, 1024, (B, S), generator=g).cuda()
    loss = model(ids, torch.arange(S, device="cuda").expand(B, S), None, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_bf16_decoder_has_no_graph_breaks_on_cuda():
    torch._dynamo.reset()
    model = _gpt()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (B, S), generator=g).cuda()
    explanation = torch._dynamo.explain(model)(ids, torch.arange(S, device="cuda").expand(B, S), None, labels=ids)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]


def test_compiled_layers_match_eager_in_bf16():
    torch._dynamo.reset()
    eager_loss, eager_grads = _loss_and_grads(_gpt())
    compiled = _gpt(compile_transformer_layers=True)
    compiled_loss, compiled_grads = _loss_and_grads(compiled)
    torch._dynamo.reset()
    assert _rel(compiled_loss, eager_loss) < 1e-2
    for name, grad in eager_grads.items():
        assert _rel(compiled_grads[name], grad) < 5e-2, name


def test_loss_peak_memory_is_one_fp32_copy_of_the_logits():
    """bf16 logits [s, b, V] -> loss + backward: the peak grows by about one fp32 copy, not two."""
    from megatron.core.models.gpt import GPTModel

    vocab, seq, batch = 32768, 512, 4
    model = GPTModel(_config("auto", use_cpu_initialization=True, hidden_size=64, num_attention_heads=4),
                     vocab_size=vocab, max_sequence_length=seq)
    logits = torch.randn(seq, batch, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), device="cuda")
    fp32_copy = seq * batch * vocab * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = model.compute_language_model_loss(labels, logits)
    loss.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # one fp32 buffer + the bf16 grad (half of it) + per-token vectors; two fp32 copies would be >= 2x.
    assert extra < 1.75 * fp32_copy, f"peak grew by {extra / fp32_copy:.2f} fp32 copies of the logits"
