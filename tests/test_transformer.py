"""transformer: config validation, norms, RoPE, attention (GQA, masks), MLP, block layout and recompute."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.transformer import (
    MLP,
    Float16Module,
    RotaryEmbedding,
    SelfAttention,
    TransformerBlock,
    TransformerConfig,
    apply_rotary_pos_emb,
    build_norm,
)


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def test_config_defaults_and_init_std():
    c = _cfg(num_layers=8)
    assert (c.num_query_groups, c.ffn_hidden_size, c.kv_channels) == (4, 64, 4)
    w = torch.empty(4000)
    torch.manual_seed(0)
    c.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(16)) < 5e-4
    assert c.embedding_init_method_std == 0.02
    assert _cfg(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=False).attention_softmax_in_fp32


@pytest.mark.parametrize("kw,msg", [
    (dict(num_attention_heads=6, tensor_model_parallel_size=4),
     r"num_attention_heads \(6\) must be a multiple of tensor_model_parallel_size \(4\)"),
    (dict(num_attention_heads=12, num_query_groups=3, tensor_model_parallel_size=2),
     r"num_query_groups \(3\) must be a multiple or divisor of tensor_model_parallel_size \(2\)"),
    (dict(hidden_size=18), r"hidden_size \(18\) must be a multiple of num_attention_heads \(4\)"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(num_layers=3, pipeline_model_parallel_size=2), r"num_layers \(3\)"),
    (dict(recompute_granularity="full"), "recompute_method"),
])
def test_config_validation_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norms_match_reference(normalization):
    c = _cfg(normalization=normalization, layernorm_zero_centered_gamma=True)
    norm = build_norm(c)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 2, 16)
    gamma = norm.weight + 1
    if normalization == "LayerNorm":
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        ref = (x - mu) / torch.sqrt(var + 1e-5) * gamma + norm.bias
    else:
        assert norm.bias is None
        ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    torch.testing.assert_close(norm(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_complex_rotation(interleaved):
    d, s, base = 8, 5, 10000.0
    rope = RotaryEmbedding(d, rotary_percent=0.5, rotary_interleaved=interleaved, rotary_base=base)
    freqs = rope(s, device=torch.device("cpu"))
    assert freqs.shape == (s, 1, 1, 4)
    t = torch.randn(s, 2, 3, d)
    out = apply_rotary_pos_emb(t, freqs, interleaved)
    rot = t[..., :4]
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        z = torch.complex(rot[..., :2], rot[..., 2:])
    inv = 1.0 / base ** (torch.arange(0, 4, 2).float() / 4)
    angle = torch.arange(s).float()[:, None] * inv[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, None, :]
    if interleaved:
        expected_rot = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        expected_rot = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(out[..., :4], expected_rot, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., 4:], t[..., 4:])
    assert rope(s, device=torch.device("cpu")) is freqs, "angles are cached"


def _ref_attention(attn, x, mask=None):
    cfg = attn.config
    np_, ng, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    s, b, _ = x.shape
    qkv = x @ attn.linear_qkv.weight.t()
    if attn.linear_qkv.bias is not None:
        qkv = qkv + attn.linear_qkv.bias
    qkv = qkv.view(s, b, ng, np_ // ng + 2, hn)
    q = qkv[..., : np_ // ng, :].reshape(s, b, np_, hn)
    k = qkv[..., np_ // ng, :].repeat_interleave(np_ // ng, dim=2)
    v = qkv[..., np_ // ng + 1, :].repeat_interleave(np_ // ng, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hn)
    if mask is None:
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    scores = scores.masked_fill(mask, float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, np_ * hn)
    return ctx @ attn.linear_proj.weight.t()


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_self_attention_gqa_matches_reference(groups):
    torch.manual_seed(0)
    attn = SelfAttention(_cfg(num_query_groups=groups), layer_number=1)
    x = torch.randn(6, 2, 16)
    out, bias = attn(x, attention_mask=None)
    assert attn.linear_qkv.weight.shape == ((4 + 2 * groups) * 4, 16)
    torch.testing.assert_close(out, _ref_attention(attn, x), atol=1e-5, rtol=1e-5)
    assert torch.equal(bias, attn.linear_proj.bias)
    # An explicit padding-style mask (True = masked) is honoured.
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, 0] = True
    mask[1, :, 0, 0] = False
    out_masked, _ = attn(x, attention_mask=mask)
    torch.testing.assert_close(out_masked, _ref_attention(attn, x, mask), atol=1e-5, rtol=1e-5)


def test_swiglu_mlp_matches_reference():
    torch.manual_seed(0)
    mlp = MLP(_cfg(gated_linear_unit=True, activation_func=F.silu, ffn_hidden_size=24, add_bias_linear=False))
    assert mlp.linear_fc1.weight.shape == (48, 16) and mlp.linear_fc2.weight.shape == (16, 24)
    x = torch.randn(3, 2, 16)
    out, bias = mlp(x)
    gate, up = (x @ mlp.linear_fc1.weight.t()).split(24, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up) @ mlp.linear_fc2.weight.t(), atol=1e-6, rtol=1e-5)
    assert bias is None


def test_block_builds_stage_layers_with_global_numbers():
    try:
        ps.set_pipeline_model_parallel_world_size(2)
        ps.set_pipeline_model_parallel_rank(1)
        block = TransformerBlock(_cfg(num_layers=4, pipeline_model_parallel_size=2), post_process=True)
        assert [layer.layer_number for layer in block.layers] == [3, 4]
        assert block.final_layernorm is not None
        mid = TransformerBlock(_cfg(num_layers=4, pipeline_model_parallel_size=2), pre_process=False,
                               post_process=False)
        assert mid.final_layernorm is None
        with pytest.raises(RuntimeError, match="set_input_tensor"):
            mid(None)
        x = torch.randn(3, 1, 16)
        mid.set_input_tensor(x)
        assert mid(None).shape == x.shape
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_matches_plain(method):
    torch.manual_seed(0)
    plain = TransformerBlock(_cfg(num_layers=2))
    recompute = TransformerBlock(_cfg(num_layers=2, recompute_granularity="full", recompute_method=method,
                                      recompute_num_layers=1))
    recompute.load_state_dict(plain.state_dict())
    x = torch.randn(5, 2, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    plain(x).sum().backward()
    out = recompute(x2)
    out.sum().backward()
    torch.testing.assert_close(out, plain(x.detach()))
    torch.testing.assert_close(x2.grad, x.grad)
    for (name, p1), p2 in zip(plain.named_parameters(), recompute.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, msg=name)


def test_float16_module_casts_inputs_and_outputs():
    cfg = _cfg(bf16=True, params_dtype=torch.bfloat16)
    wrapped = Float16Module(cfg, torch.nn.Linear(4, 3))
    out = wrapped(torch.randn(2, 4))
    assert out.dtype == torch.float32 and wrapped.module.weight.dtype == torch.bfloat16
    assert set(wrapped.state_dict()) == {"weight", "bias"}
    with pytest.raises(ValueError, match="exactly one"):
        Float16Module(_cfg(), torch.nn.Linear(2, 2))
