"""Map a full GPTModel state dict to Hugging Face GPT-2 / Llama / Mixtral tensors and config, and back.

Facts used (spec §7.2-7.3): Megatron's ``linear_qkv`` rows are grouped per query group,
``[q heads of group g | k_g | v_g]``; HF Llama keeps separate ``q_proj``/``k_proj``/``v_proj``
and HF GPT-2 a ``c_attn`` of ``[Q_all | K_all | V_all]`` stored as Conv1D (``[in, out]``, i.e.
transposed). A SwiGLU ``linear_fc1`` is ``[gate; up]``. Megatron's non-interleaved RoPE is HF's
rotate-half, so no permutation is needed. The padded vocabulary rows are dropped on export and
zero-filled on import.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException

GPT2, LLAMA, MIXTRAL = "gpt2", "llama", "mixtral"


class UnsupportedModelError(CheckpointingException, ValueError):
    """The checkpoint's architecture has no Hugging Face counterpart here (message names the flag)."""


def _get(args, name, default=None):
    return getattr(args, name, default)


def architecture_of(args) -> str:
    """``"gpt2"`` (learned positions, LayerNorm, GeLU, MHA) or ``"llama"`` (RoPE, RMSNorm, SwiGLU).

    Raises UnsupportedModelError naming the flags that fit neither.
    """
    refused = [flag for flag, on in (
        ("--qk-layernorm", _get(args, "qk_layernorm", False)),
        ("--apply-layernorm-1p", _get(args, "apply_layernorm_1p", False)),
        ("--apply-residual-connection-post-layernorm", _get(args, "apply_residual_connection_post_layernorm", False)),
        ("--rotary-interleaved", _get(args, "rotary_interleaved", False)),
        ("--use-rope-scaling", _get(args, "use_rope_scaling", False)),
        ("--rotary-seq-len-interpolation-factor", _get(args, "rotary_seq_len_interpolation_factor") is not None),
        ("--rotary-percent", _get(args, "rotary_percent", 1.0) != 1.0),
        ("--squared-relu", _get(args, "squared_relu", False)),
    ) if on]
    if refused:
        raise UnsupportedModelError(f"no Hugging Face export for checkpoints trained with {', '.join(refused)}")
    if _get(args, "num_experts"):
        return _mixtral_or_refuse(args)
    position = _get(args, "position_embedding_type", "learned_absolute")
    norm = _get(args, "normalization", "LayerNorm")
    swiglu = _get(args, "swiglu", False)
    if position == "learned_absolute" and norm == "LayerNorm" and not swiglu:
        if _num_query_groups(args) != args.num_attention_heads:
            raise UnsupportedModelError("GPT-2 has no grouped-query attention (--group-query-attention)")
        if _kv_channels(args) * args.num_attention_heads != args.hidden_size:
            raise UnsupportedModelError("GPT-2 needs --kv-channels = --hidden-size / --num-attention-heads")
        return GPT2
    if position == "rope" and norm == "RMSNorm" and swiglu:
        return LLAMA
    raise UnsupportedModelError(
        f"--position-embedding-type {position}, --normalization {norm}{', --swiglu' if swiglu else ''} matches "
        "neither GPT-2 (learned_absolute, LayerNorm, GeLU) nor Llama (rope, RMSNorm, --swiglu)")


def _mixtral_or_refuse(args) -> str:
    """``"mixtral"`` for an MoE checkpoint whose routing is Mixtral's: RoPE, RMSNorm, SwiGLU experts in every layer,
    softmax over the top-k router logits (the same probabilities as Mixtral's softmax, top-k and renormalisation),
    no shared expert, no biases. Raises UnsupportedModelError naming the flags that differ."""
    freq = _get(args, "moe_layer_freq", 1)
    refused = [flag for flag, on in (
        ("--moe-layer-freq (MoE in some layers only)", freq != 1 and (not isinstance(freq, list) or not all(freq))),
        ("--moe-shared-expert-intermediate-size", bool(_get(args, "moe_shared_expert_intermediate_size"))),
        ("--moe-router-score-function sigmoid", _get(args, "moe_router_score_function", "softmax") != "softmax"),
        ("--moe-router-pre-softmax", _get(args, "moe_router_pre_softmax", False)),
        ("--moe-router-topk-scaling-factor", _get(args, "moe_router_topk_scaling_factor") is not None),
        ("--moe-router-num-groups", _get(args, "moe_router_num_groups") is not None),
        ("--moe-router-enable-expert-bias", _get(args, "moe_router_enable_expert_bias", False)),
        ("--moe-router-topk 1", int(_get(args, "moe_router_topk", 2)) < 2),
        ("linear biases (no --disable-bias-linear)", _get(args, "add_bias_linear", True)),
        ("--add-qkv-bias", _get(args, "add_qkv_bias", False)),
    ) if on]
    if refused:
        raise UnsupportedModelError(f"no Hugging Face export (MixtralForCausalLM) for MoE checkpoints trained with "
                                    f"{', '.join(refused)}")
    if (_get(args, "position_embedding_type", "learned_absolute") != "rope"
            or _get(args, "normalization", "LayerNorm") != "RMSNorm" or not _get(args, "swiglu", False)):
        raise UnsupportedModelError("an MoE checkpoint exports as Mixtral only with --position-embedding-type rope, "
                                    "--normalization RMSNorm and --swiglu")
    return MIXTRAL


def _aux_loss_coeff(args) -> float:
    coeff = _get(args, "moe_aux_loss_coeff", 0.0) or 0.0  # Megatron's flag takes a list (one per balancing type)
    return float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff)


def _num_query_groups(args) -> int:
    return args.num_query_groups if _get(args, "group_query_attention", False) else args.num_attention_heads


def _kv_channels(args) -> int:
    return _get(args, "kv_channels") or args.hidden_size // args.num_attention_heads


def _ffn_hidden_size(args) -> int:
    return _get(args, "ffn_hidden_size") or 4 * args.hidden_size


def _tied(args) -> bool:
    return not _get(args, "untie_embeddings_and_output_weights", False)


# ----------------------------------------------------------------------------------------------- export


def hf_config(args, vocab_size: int, bos_id=None, eos_id=None, dtype: torch.dtype = torch.float32):
    """The ``transformers`` config (GPT2Config or LlamaConfig) of a checkpoint's args."""
    import transformers

    arch = architecture_of(args)
    common = dict(vocab_size=vocab_size, tie_word_embeddings=_tied(args), bos_token_id=bos_id, eos_token_id=eos_id,
                  torch_dtype=str(dtype).replace("torch.", ""))
    if arch == GPT2:
        activation = "gelu_new" if _get(args, "openai_gelu", False) else "gelu"
        return transformers.GPT2Config(
            n_positions=args.max_position_embeddings, n_embd=args.hidden_size, n_layer=args.num_layers,
            n_head=args.num_attention_heads, n_inner=_ffn_hidden_size(args), activation_function=activation,
            layer_norm_epsilon=_get(args, "norm_epsilon", 1e-5), resid_pdrop=_get(args, "hidden_dropout", 0.1),
            embd_pdrop=_get(args, "hidden_dropout", 0.1), attn_pdrop=_get(args, "attention_dropout", 0.1),
            scale_attn_weights=True, **common)
    if arch == MIXTRAL:
        return transformers.MixtralConfig(
            hidden_size=args.hidden_size, intermediate_size=_get(args, "moe_ffn_hidden_size") or _ffn_hidden_size(args),
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
            num_key_value_heads=_num_query_groups(args), head_dim=_kv_channels(args), hidden_act="silu",
            max_position_embeddings=args.max_position_embeddings, rms_norm_eps=_get(args, "norm_epsilon", 1e-5),
            rope_theta=float(_get(args, "rotary_base", 10000)), attention_dropout=_get(args, "attention_dropout", 0.0),
            num_local_experts=args.num_experts, num_experts_per_tok=int(_get(args, "moe_router_topk", 2)),
            router_aux_loss_coef=_aux_loss_coeff(args), sliding_window=None, **common)
    bias = _get(args, "add_bias_linear", True)
    return transformers.LlamaConfig(
        hidden_size=args.hidden_size, intermediate_size=_ffn_hidden_size(args), num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=_num_query_groups(args),
        head_dim=_kv_channels(args), hidden_act="silu", max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=_get(args, "norm_epsilon", 1e-5), rope_theta=float(_get(args, "rotary_base", 10000)),
        attention_bias=bool(bias or _get(args, "add_qkv_bias", False)), mlp_bias=bool(bias),
        attention_dropout=_get(args, "attention_dropout", 0.0), **common)


def _split_qkv(weight: torch.Tensor, args) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` rows ([(heads + 2 groups) d, ...]) -> q [heads d, ...], k, v [groups d, ...]."""
    groups, heads, d = _num_query_groups(args), args.num_attention_heads, _kv_channels(args)
    per_group = heads // groups
    grouped = weight.reshape(groups, per_group + 2, d, *weight.shape[1:])
    q = grouped[:, :per_group].reshape(heads * d, *weight.shape[1:])
    k = grouped[:, per_group].reshape(groups * d, *weight.shape[1:])
    v = grouped[:, per_group + 1].reshape(groups * d, *weight.shape[1:])
    return q, k, v


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args) -> torch.Tensor:
    """The inverse of ``_split_qkv``."""
    groups, heads, d = _num_query_groups(args), args.num_attention_heads, _kv_channels(args)
    per_group = heads // groups
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
                         v.reshape(groups, 1, d, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def megatron_to_hf(state: Dict[str, torch.Tensor], args, vocab_size: int) -> Dict[str, torch.Tensor]:
    """Full GPTModel state dict -> HF tensors (GPT2LMHeadModel or LlamaForCausalLM names), vocab rows cut to ``vocab_size``.

    Missing biases (``--disable-bias-linear``) are written as zeros where the HF model has one.
    Raises UnsupportedModelError (see ``architecture_of``), KeyError for a state dict that lacks a tensor.
    """
    arch = architecture_of(args)
    hidden = args.hidden_size
    out: Dict[str, torch.Tensor] = {}

    def bias(key, size, like):
        return state.get(key) if state.get(key) is not None else torch.zeros(size, dtype=like.dtype)

    embedding = state["embedding.word_embeddings.weight"][:vocab_size]
    for n in range(args.num_layers):
        p = f"decoder.layers.{n}."
        qkv_w = state[p + "self_attention.linear_qkv.weight"]
        proj_w = state[p + "self_attention.linear_proj.weight"]
        if arch == MIXTRAL:
            out.update(_mixtral_layer(state, args, n, qkv_w, proj_w))
            continue
        fc1_w = state[p + "mlp.linear_fc1.weight"]
        fc2_w = state[p + "mlp.linear_fc2.weight"]
        qkv_b = bias(p + "self_attention.linear_qkv.bias", qkv_w.size(0), qkv_w)
        proj_b = bias(p + "self_attention.linear_proj.bias", hidden, proj_w)
        fc1_b = bias(p + "mlp.linear_fc1.bias", fc1_w.size(0), fc1_w)
        fc2_b = bias(p + "mlp.linear_fc2.bias", hidden, fc2_w)
        if arch == GPT2:
            h = f"transformer.h.{n}."
            q, k, v = _split_qkv(qkv_w, args)
            qb, kb, vb = _split_qkv(qkv_b, args)
            out[h + "ln_1.weight"] = state[p + "input_layernorm.weight"]
            out[h + "ln_1.bias"] = state[p + "input_layernorm.bias"]
            out[h + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t()
            out[h + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], dim=0)
            out[h + "attn.c_proj.weight"] = proj_w.t()
            out[h + "attn.c_proj.bias"] = proj_b
            out[h + "ln_2.weight"] = state[p + "pre_mlp_layernorm.weight"]
            out[h + "ln_2.bias"] = state[p + "pre_mlp_layernorm.bias"]
            out[h + "mlp.c_fc.weight"] = fc1_w.t()
            out[h + "mlp.c_fc.bias"] = fc1_b
            out[h + "mlp.c_proj.weight"] = fc2_w.t()
            out[h + "mlp.c_proj.bias"] = fc2_b
        else:
            h = f"model.layers.{n}."
            q, k, v = _split_qkv(qkv_w, args)
            gate, up = torch.chunk(fc1_w, 2, dim=0)
            out[h + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"], out[h + "self_attn.o_proj.weight"] = v, proj_w
            out[h + "post_attention_layernorm.weight"] = state[p + "pre_mlp_layernorm.weight"]
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = fc2_w
            if _get(args, "add_bias_linear", True) or _get(args, "add_qkv_bias", False):
                qb, kb, vb = _split_qkv(qkv_b, args)
                out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"] = qb, kb
                out[h + "self_attn.v_proj.bias"], out[h + "self_attn.o_proj.bias"] = vb, proj_b
            if _get(args, "add_bias_linear", True):
                gate_b, up_b = torch.chunk(fc1_b, 2, dim=0)
                out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gate_b, up_b
                out[h + "mlp.down_proj.bias"] = fc2_b
    if arch == GPT2:
        out["transformer.wte.weight"] = embedding
        out["transformer.wpe.weight"] = state["embedding.position_embeddings.weight"]
        out["transformer.ln_f.weight"] = state["decoder.final_layernorm.weight"]
        out["transformer.ln_f.bias"] = state["decoder.final_layernorm.bias"]
    else:
        out["model.embed_tokens.weight"] = embedding
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not _tied(args):
        out["lm_head.weight"] = state["output_layer.weight"][:vocab_size]
    return {key: value.detach().contiguous() for key, value in out.items()}


def _mixtral_layer(state, args, n: int, qkv_w: torch.Tensor, proj_w: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Layer ``n`` under the Hugging Face Hub's Mixtral names (``block_sparse_moe.gate`` and ``experts.<e>.w1``
    (gate), ``w3`` (up), ``w2`` (down), which transformers 4 loads as they are and 5 converts on load)."""
    p, h = f"decoder.layers.{n}.", f"model.layers.{n}."
    q, k, v = _split_qkv(qkv_w, args)
    out = {h + "input_layernorm.weight": state[p + "input_layernorm.weight"],
           h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
           h + "self_attn.o_proj.weight": proj_w,
           h + "post_attention_layernorm.weight": state[p + "pre_mlp_layernorm.weight"],
           h + "block_sparse_moe.gate.weight": state[p + "mlp.router.weight"]}
    for e in range(args.num_experts):
        expert = f"{p}mlp.experts.local_experts.{e}."
        gate, up = torch.chunk(state[expert + "linear_fc1.weight"], 2, dim=0)
        moe = f"{h}block_sparse_moe.experts.{e}."
        out[moe + "w1.weight"], out[moe + "w3.weight"] = gate, up
        out[moe + "w2.weight"] = state[expert + "linear_fc2.weight"]
    return out


# ----------------------------------------------------------------------------------------------- import


def _mixtral_experts_from_hf(hf: Dict[str, torch.Tensor], args, n: int) -> Dict[str, torch.Tensor]:
    """Layer ``n``'s router and experts from Mixtral tensors, under the Hub's names (``block_sparse_moe.*``,
    ``experts.<e>.w1/w3/w2``) or transformers 5's (``mlp.gate``, ``mlp.experts.gate_up_proj`` [E, 2F, H],
    ``mlp.experts.down_proj`` [E, H, F])."""
    p, h = f"decoder.layers.{n}.", f"model.layers.{n}."
    fused = h + "mlp.experts.gate_up_proj" in hf
    state = {p + "mlp.router.weight": hf[h + ("mlp.gate.weight" if fused else "block_sparse_moe.gate.weight")]}
    for e in range(args.num_experts):
        expert = f"{p}mlp.experts.local_experts.{e}."
        if fused:
            fc1, fc2 = hf[h + "mlp.experts.gate_up_proj"][e], hf[h + "mlp.experts.down_proj"][e]
        else:
            moe = f"{h}block_sparse_moe.experts.{e}."
            fc1 = torch.cat([hf[moe + "w1.weight"], hf[moe + "w3.weight"]], dim=0)
            fc2 = hf[moe + "w2.weight"]
        state[expert + "linear_fc1.weight"], state[expert + "linear_fc1._extra_state"] = fc1, None
        state[expert + "linear_fc2.weight"], state[expert + "linear_fc2._extra_state"] = fc2, None
    return state


def megatron_flags_from_hf(config) -> list:
    """Megatron command-line flags describing an HF GPT-2 or Llama config (what pretrain_gpt.py needs).

    Raises UnsupportedModelError for another ``model_type`` or options without a Megatron flag here.
    """
    model_type = getattr(config, "model_type", None)
    if model_type == GPT2:
        if config.activation_function not in ("gelu", "gelu_new"):
            raise UnsupportedModelError(f"GPT-2 activation {config.activation_function!r} has no Megatron flag here")
        flags = ["--num-layers", config.n_layer, "--hidden-size", config.n_embd,
                 "--num-attention-heads", config.n_head, "--ffn-hidden-size", config.n_inner or 4 * config.n_embd,
                 "--max-position-embeddings", config.n_positions, "--norm-epsilon", config.layer_norm_epsilon,
                 "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm"]
        if config.activation_function == "gelu_new":
            flags.append("--openai-gelu")
    elif model_type in (LLAMA, MIXTRAL):
        if config.hidden_act != "silu":
            raise UnsupportedModelError(f"Llama activation {config.hidden_act!r} is not SwiGLU")
        # transformers >= 5 keeps RoPE settings in rope_parameters (rope_scaling aliases it); 4.x in
        # rope_theta plus an optional rope_scaling.
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"Llama RoPE scaling {rope_type!r} is not supported by import_hf")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        flags = ["--num-layers", config.num_hidden_layers, "--hidden-size", config.hidden_size,
                 "--num-attention-heads", config.num_attention_heads, "--ffn-hidden-size", config.intermediate_size,
                 "--max-position-embeddings", config.max_position_embeddings, "--norm-epsilon", config.rms_norm_eps,
                 "--position-embedding-type", "rope", "--rotary-base", int(theta), "--normalization", "RMSNorm",
                 "--swiglu", "--kv-channels", head_dim]
        groups = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if groups != config.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", groups]
        if getattr(config, "mlp_bias", False) != getattr(config, "attention_bias", False):
            raise UnsupportedModelError("Llama with attention_bias != mlp_bias has no Megatron flag here")
        if not getattr(config, "attention_bias", False):
            flags.append("--disable-bias-linear")
        if model_type == MIXTRAL:
            if getattr(config, "sliding_window", None) is not None:
                raise UnsupportedModelError("Mixtral with sliding_window attention has no Megatron flag here")
            flags += ["--num-experts", config.num_local_experts, "--moe-router-topk", config.num_experts_per_tok,
                      "--moe-ffn-hidden-size", config.intermediate_size, "--moe-router-load-balancing-type",
                      "aux_loss", "--moe-aux-loss-coeff", getattr(config, "router_aux_loss_coef", 0.0)]
    else:
        raise UnsupportedModelError(f"model_type {model_type!r}: import_hf reads gpt2, llama and mixtral models")
    if not getattr(config, "tie_word_embeddings", True):
        flags.append("--untie-embeddings-and-output-weights")
    return [str(flag) for flag in flags]


def hf_to_megatron(hf: Dict[str, torch.Tensor], args, padded_vocab_size: int) -> Dict[str, torch.Tensor]:
    """HF tensors -> full GPTModel state dict (``_extra_state`` entries included, vocab zero-padded).

    ``args`` are the Megatron args built from ``megatron_flags_from_hf``. Raises KeyError for a
    missing HF tensor.
    """
    arch = architecture_of(args)

    def pad(weight):
        padded = torch.zeros(padded_vocab_size, weight.size(1), dtype=weight.dtype)
        padded[:weight.size(0)] = weight
        return padded

    state: Dict[str, torch.Tensor] = {}
    if arch == GPT2:
        hf = {key[len("transformer."):] if key.startswith("transformer.") else key: value for key, value in hf.items()}
        state["embedding.word_embeddings.weight"] = pad(hf["wte.weight"])
        state["embedding.position_embeddings.weight"] = hf["wpe.weight"]
    else:
        state["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"])
    bias = _get(args, "add_bias_linear", True)
    for n in range(args.num_layers):
        p = f"decoder.layers.{n}."
        if arch == GPT2:
            h = f"h.{n}."
            q, k, v = torch.chunk(hf[h + "attn.c_attn.weight"].t(), 3, dim=0)
            qb, kb, vb = torch.chunk(hf[h + "attn.c_attn.bias"], 3, dim=0)
            state[p + "input_layernorm.weight"] = hf[h + "ln_1.weight"]
            state[p + "input_layernorm.bias"] = hf[h + "ln_1.bias"]
            state[p + "self_attention.linear_qkv.weight"] = _join_qkv(q, k, v, args)
            state[p + "self_attention.linear_qkv.bias"] = _join_qkv(qb, kb, vb, args)
            state[p + "self_attention.linear_proj.weight"] = hf[h + "attn.c_proj.weight"].t()
            state[p + "self_attention.linear_proj.bias"] = hf[h + "attn.c_proj.bias"]
            state[p + "pre_mlp_layernorm.weight"] = hf[h + "ln_2.weight"]
            state[p + "pre_mlp_layernorm.bias"] = hf[h + "ln_2.bias"]
            state[p + "mlp.linear_fc1.weight"] = hf[h + "mlp.c_fc.weight"].t()
            state[p + "mlp.linear_fc1.bias"] = hf[h + "mlp.c_fc.bias"]
            state[p + "mlp.linear_fc2.weight"] = hf[h + "mlp.c_proj.weight"].t()
            state[p + "mlp.linear_fc2.bias"] = hf[h + "mlp.c_proj.bias"]
        else:
            h = f"model.layers.{n}."
            state[p + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
            state[p + "self_attention.linear_qkv.weight"] = _join_qkv(
                hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"],
                args)
            state[p + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            state[p + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
            if arch == MIXTRAL:
                state.update(_mixtral_experts_from_hf(hf, args, n))
                for linear in ("self_attention.linear_qkv", "self_attention.linear_proj"):
                    state[p + linear + "._extra_state"] = None
                continue
            state[p + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"],
                                                            hf[h + "mlp.up_proj.weight"]], dim=0)
            state[p + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
            if bias:
                state[p + "self_attention.linear_qkv.bias"] = _join_qkv(
                    hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"],
                    args)
                state[p + "self_attention.linear_proj.bias"] = hf[h + "self_attn.o_proj.bias"]
                state[p + "mlp.linear_fc1.bias"] = torch.cat([hf[h + "mlp.gate_proj.bias"],
                                                              hf[h + "mlp.up_proj.bias"]], dim=0)
                state[p + "mlp.linear_fc2.bias"] = hf[h + "mlp.down_proj.bias"]
        for linear in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            state[p + linear + "._extra_state"] = None
    if arch == GPT2:
        state["decoder.final_layernorm.weight"] = hf["ln_f.weight"]
        state["decoder.final_layernorm.bias"] = hf["ln_f.bias"]
    else:
        state["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not _tied(args):
        state["output_layer.weight"] = pad(hf["lm_head.weight"])
    state["output_layer._extra_state"] = None
    return {key: value.contiguous() if torch.is_tensor(value) else value for key, value in state.items()}

