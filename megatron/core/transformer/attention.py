"""Self-attention: fused per-group QKV projection, RoPE, scaled-dot-product core attention, output projection."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_context_parallel_group, get_tensor_model_parallel_world_size
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.attention_backend import check_attention_backend, sdpa_backends
from megatron.core.transformer.context_parallel import context_parallel_attention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.transformer_config import TransformerConfig

_MODEL_PARALLEL_RNG = "model-parallel-rng"


class DotProductAttention(MegatronModule):
    """softmax(q kᵀ * scale + mask) v with dropout, via ``torch.nn.functional.scaled_dot_product_attention``.

    Vaswani et al. 2017, "Attention Is All You Need", section 3.2.1; grouped-query attention per
    Ainslie et al. 2023 (query head i reads key/value group i // (heads/groups)). Inputs
    q [s, b, np, hn], k/v [s, b, ng, hn] (this rank's heads); attention_mask [b, 1, s, s] bool with
    True = masked, or None for a causal mask. Output [s, b, np * hn]. Scale = softmax_scale or
    1/sqrt(kv_channels) (query-key layer scaling cancels out mathematically and needs no code).
    ``config.attention_backend`` restricts SDPA to its kernels (``attention_backend.py``) through
    ``torch.nn.attention.sdpa_kernel``, which ``torch.compile`` traces without a graph break.
    Dropout on the probabilities runs inside the model-parallel RNG fork only at TP > 1 without
    sequence parallelism, where heads differ per TP rank and so must their masks (under sequence
    parallelism the enclosing TransformerBlock holds that fork; at TP = 1 the default generator
    serves, as for every other dropout, and the compiled graph needs no RNG-state swap).

    With a context-parallel group of more than one rank (``model_comm_pgs.cp``, else parallel_state's),
    q/k/v hold this rank's two sequence chunks and attention goes through
    ``context_parallel_attention`` with ``config.cp_comm_type`` (this layer's entry when a list):
    causal, no mask, no dropout.

    Raises ValueError (from ``check_attention_backend``) when the backend's kernel does not exist here.
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 model_comm_pgs=None):
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_attention_head = config.kv_channels
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * config.kv_channels
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.enable_gqa = self.num_query_groups_per_partition != self.num_attention_heads_per_partition
        backend = check_attention_backend(config.attention_backend, flag="attention_backend")
        kernels = sdpa_backends(backend)
        self._sdpa_backends = list(kernels) if kernels is not None else None
        # Grouped-query heads are native only to the flash and math kernels; for cuDNN and
        # memory-efficient attention the key/value groups are repeated per query head.
        self._repeat_kv_groups = self.enable_gqa and backend is AttnBackend.fused
        self._fork_for_dropout = tp > 1 and not config.sequence_parallel
        # Context parallelism: this rank holds two chunks of each sequence (context_parallel package).
        self.cp_group = model_comm_pgs.cp if model_comm_pgs is not None \
            else get_context_parallel_group(check_initialized=False)
        self.cp_comm_type = None
        if self.cp_group is not None and dist.get_world_size(self.cp_group) > 1:
            comm_type = config.cp_comm_type or "p2p"
            if isinstance(comm_type, (list, tuple)):  # one per layer; layer_number is 1-based
                comm_type = comm_type[self.layer_number - 1]
            self.cp_comm_type = comm_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        """q [s, b, np, hn], k/v [s, b, ng, hn], mask [b, 1, s, s] (True = masked) or None -> [s, b, np*hn]."""
        # SDPA wants [b, heads, s, hn].
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        dropout_p = self.attention_dropout_p if self.training else 0.0
        if self.cp_comm_type is not None:
            if attention_mask is not None or dropout_p > 0.0:
                raise ValueError("context-parallel attention takes no attention mask and no attention dropout")
            context = context_parallel_attention(q, k, v, cp_group=self.cp_group, comm_type=self.cp_comm_type,
                                                 softmax_scale=self.softmax_scale)
            s, b = context.size(2), context.size(0)
            return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
        if attention_mask is None:
            mask, is_causal = None, True
        else:
            mask, is_causal = ~attention_mask, False
        if dropout_p > 0.0 and self._fork_for_dropout and _MODEL_PARALLEL_RNG in get_cuda_rng_tracker().states_:
            with get_cuda_rng_tracker().fork(_MODEL_PARALLEL_RNG):
                context = self._sdpa(q, k, v, mask, dropout_p, is_causal)
        else:
            context = self._sdpa(q, k, v, mask, dropout_p, is_causal)
        # [b, np, s, hn] -> [s, b, np*hn]
        s, b = context.size(2), context.size(0)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              dropout_p: float, is_causal: bool) -> torch.Tensor:
        """SDPA on [b, heads, s, hn] tensors with the configured kernels."""
        enable_gqa = self.enable_gqa
        if self._repeat_kv_groups:
            repeats = q.size(1) // k.size(1)
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
            enable_gqa = False
        if self._sdpa_backends is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=self.softmax_scale, enable_gqa=enable_gqa)
        with sdpa_kernel(self._sdpa_backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=self.softmax_scale, enable_gqa=enable_gqa)


class SelfAttention(MegatronModule):
    """Multi-head / grouped-query self-attention with tensor-parallel projections.

    linear_qkv (ColumnParallelLinear, [(np + 2 ng) * hn, h] per rank set of groups) produces, per
    query group g, ``[q heads of g | k_g | v_g]``; optional q/k layernorm over hn; RoPE applied to q
    and k; core attention; linear_proj (RowParallelLinear, input is parallel, bias returned
    separately for the fused bias-dropout-add). forward(hidden [s, b, h]) -> (out [s, b, h], bias [h] or None).
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, model_comm_pgs=None):
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        tp = get_tensor_model_parallel_world_size()
        self.hidden_size_per_attention_head = config.kv_channels
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)

        # Megatron's creation order (core_attention, linear_proj, then linear_qkv, q/k layernorm) fixes
        # the order of named_parameters(), hence of the optimizer's state in legacy checkpoints.
        self.core_attention = DotProductAttention(config, layer_number, attn_mask_type, "self",
                                                  model_comm_pgs=model_comm_pgs)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            self.query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
        )
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, self.query_projection_size + 2 * self.kv_projection_size,
            config=config, init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
        )
        if config.qk_layernorm:
            self.q_layernorm = build_norm(config, self.hidden_size_per_attention_head)
            self.k_layernorm = build_norm(config, self.hidden_size_per_attention_head)
        else:
            self.q_layernorm = None
            self.k_layernorm = None
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self._split_sizes = [
            self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            * self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
        ]

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [s, b, h] -> q [s, b, np, hn], k [s, b, ng, hn], v [s, b, ng, hn] (this rank's heads)."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        s, b = mixed_qkv.size(0), mixed_qkv.size(1)
        mixed_qkv = mixed_qkv.view(s, b, self.num_query_groups_per_partition, -1)
        query, key, value = torch.split(mixed_qkv, self._split_sizes, dim=3)
        query = query.reshape(s, b, -1, self.hidden_size_per_attention_head)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
            key = self.k_layernorm(key)
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states: Optional[torch.Tensor] = None, inference_params=None,
                rotary_pos_emb: Optional[torch.Tensor] = None, packed_seq_params=None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden [s, b, h] -> (output [s, b, h], linear_proj bias or None)."""
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            if isinstance(rotary_pos_emb, tuple):
                q_pos_emb, k_pos_emb = rotary_pos_emb
            else:
                q_pos_emb = k_pos_emb = rotary_pos_emb
            query = apply_rotary_pos_emb(query, q_pos_emb, self.config.rotary_interleaved)
            key = apply_rotary_pos_emb(key, k_pos_emb, self.config.rotary_interleaved)
        if self.checkpoint_core_attention and self.training:
            core_attn_out = tensor_parallel.checkpoint(
                self.core_attention, False, query, key, value, attention_mask
            )
        else:
            core_attn_out = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(core_attn_out)
