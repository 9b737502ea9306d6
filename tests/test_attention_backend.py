"""--attention-backend: the SDPA kernel each choice selects, equal outputs, and refusal where a kernel is missing."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import DotProductAttention, TransformerConfig
from megatron.core.transformer import attention_backend as ab
from megatron.core.transformer.enums import AttnBackend
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

H, HEADS, V, S, B = 16, 4, 32, 8, 2
ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]
_CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket._qualified_op_name.replace("::", "."))
        return func(*args, **(kwargs or {}))


def _config(backend, **kw):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                use_cpu_initialization=True, attention_backend=backend)
    base.update(kw)
    return TransformerConfig(**base)


def _run_gpt(backend):
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = GPTModel(_config(backend), vocab_size=V, max_sequence_length=S)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    with _OpNames() as ops:
        loss = model(ids, torch.arange(S).expand(B, S), None, labels=labels)
        loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, ops.names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU kernels that auto/unfused pick")
def test_unfused_auto_local_run_and_agree_with_the_kernel_each_selects():
    results = {name: _run_gpt(name) for name in ("unfused", "local", "auto")}
    # unfused/local restrict SDPA to the math kernel (plain bmm + softmax); auto lets PyTorch take
    # its CPU flash kernel, so the restriction is visible in the dispatched ops.
    for name in ("unfused", "local"):
        assert _CPU_FLASH not in results[name][2] and "aten.bmm" in results[name][2], name
    assert _CPU_FLASH in results["auto"][2]
    ref_loss, ref_grads, _ = results["unfused"]
    for name in ("local", "auto"):
        loss, grads, _ = results[name]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=name)
        for param, grad in ref_grads.items():
            torch.testing.assert_close(grads[param], grad, rtol=1e-4, atol=1e-6, msg=f"{name} {param}")


def test_sdpa_kernel_choice_does_not_break_the_compiled_graph():
    torch._dynamo.reset()
    core = DotProductAttention(_config("unfused"), layer_number=1)
    q = torch.randn(S, B, HEADS, H // HEADS)
    explanation = torch._dynamo.explain(core)(q, q, q, None)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_grouped_query_heads_repeated_for_kernels_without_native_gqa():
    """The fused path repeats k/v groups per query head; on CPU it is checked with the math kernel."""
    config = _config("unfused", num_query_groups=2)
    native = DotProductAttention(config, layer_number=1)
    repeated = DotProductAttention(config, layer_number=1)
    repeated._repeat_kv_groups = True
    torch.manual_seed(2)
    q = torch.randn(S, B, HEADS, H // HEADS)
    k, v = torch.randn(S, B, 2, H // HEADS), torch.randn(S, B, 2, H // HEADS)
    assert native.enable_gqa and not native._repeat_kv_groups
    torch.testing.assert_close(repeated(q, k, v, None), native(q, k, v, None), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal without CUDA")
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_flash_and_fused_refused_without_cuda(backend):
    with pytest.raises(ValueError, match=rf"--attention-backend {backend} is not available: .*CUDA is not available"):
        validate_args(parse_args(args=ARGS + ["--attention-backend", backend]))
    # Library users building the model directly get the same refusal from the attention module.
    with pytest.raises(ValueError, match=rf"attention_backend {backend} is not available"):
        DotProductAttention(_config(backend), layer_number=1)


def test_refusal_reasons_for_build_and_gpu(monkeypatch):
    """With CUDA faked present: a build without FlashAttention, and a pre-Ampere GPU, are named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert "compiled without FlashAttention" in ab.attention_backend_unavailable_reason("flash")
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    assert "'Tesla V100' has 7.0" in ab.attention_backend_unavailable_reason("flash")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert ab.attention_backend_unavailable_reason("flash") is None
    assert ab.attention_backend_unavailable_reason("fused") is None
    for name in ("unfused", "local", "auto"):
        assert ab.attention_backend_unavailable_reason(name) is None


def test_backend_flows_from_args_to_config_and_maps_to_kernels():
    from torch.nn.attention import SDPBackend

    for name in ("unfused", "local", "auto"):
        config = core_transformer_config_from_args(validate_args(parse_args(args=ARGS + ["--attention-backend", name])))
        assert config.attention_backend is AttnBackend[name]
    assert ab.sdpa_backends("flash") == (SDPBackend.FLASH_ATTENTION,)
    assert ab.sdpa_backends("fused") == (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert ab.sdpa_backends("unfused") == ab.sdpa_backends("local") == (SDPBackend.MATH,)
    assert ab.sdpa_backends("auto") is None
    with pytest.raises(ValueError, match="attention_backend must be one of flash, fused, unfused, local, auto"):
        _config("triton")
