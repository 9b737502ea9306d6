"""GPTModel: Megatron state-dict names/shapes, forward vs a plain-torch reference, init determinism, TP=2 == TP=1."""
import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

H, HEADS, L, V, S, B = 16, 4, 2, 32, 8, 2


def _cfg(**kw):
    base = dict(num_layers=L, hidden_size=H, num_attention_heads=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def _model(seed=0, cfg=None, **kw):
    torch.manual_seed(seed)
    kw.setdefault("share_embeddings_and_output_weights", True)
    return GPTModel(cfg or _cfg(), vocab_size=V, max_sequence_length=S, **kw)


def _expected_keys(cfg, tied, learned):
    d, groups = cfg.kv_channels, cfg.num_query_groups
    ffn = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    has_bias = cfg.normalization == "LayerNorm"
    keys = {"embedding.word_embeddings.weight": (V, H)}
    if learned:
        keys["embedding.position_embeddings.weight"] = (S, H)

    def norm(prefix, size):
        keys[prefix + ".weight"] = (size,)
        if has_bias:
            keys[prefix + ".bias"] = (size,)

    def linear(prefix, shape, bias):
        keys[prefix + ".weight"] = shape
        if bias:
            keys[prefix + ".bias"] = (shape[0],)
        keys[prefix + "._extra_state"] = None

    for n in range(cfg.num_layers):
        p = f"decoder.layers.{n}."
        norm(p + "input_layernorm", H)
        linear(p + "self_attention.linear_qkv", ((HEADS + 2 * groups) * d, H),
               cfg.add_bias_linear or cfg.add_qkv_bias)
        linear(p + "self_attention.linear_proj", (H, HEADS * d), cfg.add_bias_linear)
        if cfg.qk_layernorm:
            norm(p + "self_attention.q_layernorm", d)
            norm(p + "self_attention.k_layernorm", d)
        norm(p + "pre_mlp_layernorm", H)
        linear(p + "mlp.linear_fc1", (ffn, H), cfg.add_bias_linear)
        linear(p + "mlp.linear_fc2", (H, cfg.ffn_hidden_size), cfg.add_bias_linear)
    norm("decoder.final_layernorm", H)
    keys["output_layer._extra_state"] = None
    if not tied:
        keys["output_layer.weight"] = (V, H)
    return keys


VARIANTS = {
    "gpt2": (dict(), True, "learned_absolute"),
    "llama": (dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, ffn_hidden_size=24,
                   add_bias_linear=False, num_query_groups=2), False, "rope"),
    "qk_norm_qkv_bias": (dict(qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True), True, "none"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_state_dict_keys_and_shapes(variant):
    kw, tied, pos = VARIANTS[variant]
    cfg = _cfg(**kw)
    model = _model(cfg=cfg, share_embeddings_and_output_weights=tied, position_embedding_type=pos)
    got = {k: (None if v is None else tuple(v.shape)) for k, v in model.state_dict().items()}
    assert got == _expected_keys(cfg, tied, pos == "learned_absolute")
    # Round trip through load_state_dict (strict) keeps every tensor.
    clone = _model(seed=1, cfg=_cfg(**kw), share_embeddings_and_output_weights=tied, position_embedding_type=pos)
    clone.load_state_dict(model.state_dict())
    for k, v in model.state_dict().items():
        if v is not None:
            assert torch.equal(v, clone.state_dict()[k]), k


def _rope(x, base, interleaved=False):
    """Rotate x [b, s, n, d] by position * base^(-2i/d) using complex numbers."""
    d = x.size(-1)
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(x.size(1), dtype=torch.float64)[:, None] * inv[None]
    rot = torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    z = torch.complex(x[..., 0::2], x[..., 1::2]) if interleaved else torch.complex(x[..., : d // 2], x[..., d // 2:])
    z = z * rot
    return torch.stack([z.real, z.imag], -1).flatten(-2) if interleaved else torch.cat([z.real, z.imag], -1)


def _reference_loss(model, cfg, ids, pos_ids, labels, pos_type, tied):
    """Plain-torch GPT in float64: embeddings, pre-LN blocks with explicit softmax attention, logits, CE."""
    sd = {k: v.double() for k, v in model.state_dict().items() if v is not None}
    np_, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels

    def norm(x, prefix):
        w = sd[prefix + ".weight"]
        if cfg.normalization == "LayerNorm":
            mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
            return (x - mu) / torch.sqrt(var + cfg.layernorm_epsilon) * w + sd[prefix + ".bias"]
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w

    def lin(x, prefix):
        y = x @ sd[prefix + ".weight"].t()
        return y + sd[prefix + ".bias"] if prefix + ".bias" in sd else y

    x = sd["embedding.word_embeddings.weight"][ids]
    if pos_type == "learned_absolute":
        x = x + sd["embedding.position_embeddings.weight"][pos_ids]
    b, s, _ = x.shape
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for n in range(cfg.num_layers):
        p = f"decoder.layers.{n}."
        qkv = lin(norm(x, p + "input_layernorm"), p + "self_attention.linear_qkv").view(b, s, ng, np_ // ng + 2, d)
        q = qkv[..., : np_ // ng, :].reshape(b, s, np_, d)
        k, v = qkv[..., np_ // ng, :], qkv[..., np_ // ng + 1, :]
        if cfg.qk_layernorm:
            q, k = norm(q, p + "self_attention.q_layernorm"), norm(k, p + "self_attention.k_layernorm")
        if pos_type == "rope":
            q, k = _rope(q, 10000.0, cfg.rotary_interleaved), _rope(k, 10000.0, cfg.rotary_interleaved)
        k, v = k.repeat_interleave(np_ // ng, 2), v.repeat_interleave(np_ // ng, 2)
        scores = torch.einsum("bsnd,btnd->bnst", q, k) / math.sqrt(d)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        ctx = torch.einsum("bnst,btnd->bsnd", probs, v).reshape(b, s, np_ * d)
        x = x + lin(ctx, p + "self_attention.linear_proj")
        h = lin(norm(x, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1")
        if cfg.gated_linear_unit:
            gate, up = h.chunk(2, -1)
            h = cfg.activation_func(gate) * up
        else:
            h = cfg.activation_func(h)
        x = x + lin(h, p + "mlp.linear_fc2")
    x = norm(x, "decoder.final_layernorm")
    out_w = sd["embedding.word_embeddings.weight"] if tied else sd["output_layer.weight"]
    logits = x @ out_w.t()
    return F.cross_entropy(logits.view(-1, V), labels.reshape(-1), reduction="none").view(b, s), logits


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["rope_interleaved"])
def test_forward_matches_reference(variant):
    if variant == "rope_interleaved":
        kw, tied, pos = dict(rotary_interleaved=True), True, "rope"
    else:
        kw, tied, pos = VARIANTS[variant]
    cfg = _cfg(**kw)
    model = _model(cfg=cfg, share_embeddings_and_output_weights=tied, position_embedding_type=pos)
    with torch.no_grad():  # non-trivial norm params and biases so they are exercised
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    pos_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    loss = model(ids, pos_ids, None, labels=labels)
    assert loss.shape == (B, S) and loss.dtype == torch.float32
    ref_loss, ref_logits = _reference_loss(model, cfg, ids, pos_ids, labels, pos, tied)
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    logits = model(ids, pos_ids, None)
    assert logits.shape == (B, S, V)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)
    # The explicit causal mask (True = masked) gives the same result as the is_causal fast path.
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1).expand(B, 1, S, S)
    torch.testing.assert_close(model(ids, pos_ids, mask, labels=labels), loss)


def test_tied_output_uses_embedding_and_gets_both_grads():
    model = _model()
    ids = torch.randint(0, V, (B, S))
    pos = torch.arange(S).expand(B, S)
    model(ids, pos, None, labels=ids).sum().backward()
    emb = model.embedding.word_embeddings.weight
    assert model.shared_embedding_or_output_weight() is emb and model.output_layer.weight is None
    assert emb.shared_embedding and emb.is_embedding_or_output_parameter
    # Rows never used as input still receive grad from the output projection.
    unused = sorted(set(range(V)) - set(ids.flatten().tolist()))
    assert unused and emb.grad[unused].abs().sum() > 0


def test_init_is_deterministic_by_seed_and_follows_stds():
    a, b, c = _model(seed=5, share_embeddings_and_output_weights=False), \
        _model(seed=5, share_embeddings_and_output_weights=False), _model(seed=6)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        if v is not None:
            assert torch.equal(v, w), k
    assert not torch.equal(a.embedding.word_embeddings.weight, c.embedding.word_embeddings.weight)
    layer = a.decoder.layers[0]
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.self_attention.linear_qkv.bias == 0)
    big = _model(seed=0, cfg=_cfg(hidden_size=64, num_layers=8, init_method_std=0.05))
    lyr = big.decoder.layers[0]
    assert abs(lyr.mlp.linear_fc1.weight.std().item() - 0.05) < 0.003
    assert abs(lyr.mlp.linear_fc2.weight.std().item() - 0.05 / math.sqrt(16)) < 0.001
    assert abs(lyr.self_attention.linear_proj.weight.std().item() - 0.05 / math.sqrt(16)) < 0.001


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="position_embedding_type"):
        _model(position_embedding_type="alibi")
    with pytest.raises(ValueError, match="position_ids"):
        _model()(torch.zeros(1, 4, dtype=torch.long), None, None)


TP_VARIANTS = dict(VARIANTS, llama_sp=(dict(VARIANTS["llama"][0], sequence_parallel=True), False, "rope"),
                   gpt2_sp=(dict(sequence_parallel=True), True, "learned_absolute"))


def _tp_losses(rank, world, variants):
    if world > 1:
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    results = {}
    for variant in variants:
        kw, tied, pos = TP_VARIANTS[variant]
        if world == 1:
            kw = {k: v for k, v in kw.items() if k != "sequence_parallel"}
        cfg = _cfg(tensor_model_parallel_size=world, **kw)
        model = _model(seed=4, cfg=cfg, share_embeddings_and_output_weights=tied, position_embedding_type=pos)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, V, (B, S), generator=g)
        labels = torch.randint(0, V, (B, S), generator=g)
        loss = model(ids, torch.arange(S).expand(B, S), None, labels=labels)
        loss.mean().backward()
        results[variant] = (loss.detach(), model.decoder.layers[0].mlp.linear_fc1.weight.grad.detach())
    return results


def test_tp2_matches_tp1():
    variants = ["gpt2", "llama", "gpt2_sp", "llama_sp"]
    reference = _tp_losses(0, 1, variants)
    for rank, result in enumerate(run_distributed(_tp_losses, 2, variants)):
        for variant in variants:
            (loss, fc1), (ref_loss, ref_fc1) = result[variant], reference[variant]
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
            if TP_VARIANTS[variant][0].get("gated_linear_unit"):
                gate, up = ref_fc1.chunk(2, 0)
                expected = torch.cat([gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]])
            else:
                expected = ref_fc1.chunk(2, 0)[rank]
            torch.testing.assert_close(fc1, expected, atol=1e-6, rtol=1e-4)
