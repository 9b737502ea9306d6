"""TransformerConfig: architecture, init and recompute settings of the GPT decoder (Megatron names)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.attention_backend import as_attn_backend
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts
from megatron.core.transformer.utils import (
    init_method_normal,
    scaled_init_method_normal,
    xavier_uniform_init_method,
)


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Decoder architecture settings; defaults follow Megatron-LM's TransformerConfig.

    Derived defaults (filled in ``__post_init__``): ``num_query_groups`` = heads,
    ``ffn_hidden_size`` = 4*hidden, ``kv_channels`` = hidden/heads, ``init_method`` = N(0, std),
    ``output_layer_init_method`` = N(0, std/sqrt(2*num_layers)), ``embedding_init_method`` =
    N(0, embedding_init_method_std or std); with ``init_method_xavier_uniform`` both linear inits
    become xavier-uniform. ``apply_query_key_layer_scaling`` forces ``attention_softmax_in_fp32``.

    ``attention_backend`` (an ``AttnBackend`` or its name) picks the SDPA kernel;
    ``compile_transformer_layers`` wraps each TransformerLayer's forward in ``torch.compile``.

    Raises ValueError (naming the numbers) when heads or query groups do not fit the tensor-parallel
    size, hidden is not divisible by heads with ``kv_channels`` unset, num_layers does not split over
    pipeline stages, or normalization / recompute / attention-backend settings are unknown or
    inconsistent.
    """

    # Architecture
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    softmax_scale: Optional[float] = None

    # Pipeline split (pipeline_layout.py): uneven first/last stages, embedding/loss counted as layers
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    # Initialisation
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    embedding_init_method: Optional[Callable] = None
    embedding_init_method_std: Optional[float] = None
    init_method_xavier_uniform: bool = False

    # Attention numerics
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    rotary_interleaved: bool = False
    apply_rope_fusion: bool = False

    # Core-attention kernel (attention_backend.py; a name string is accepted) and per-layer torch.compile
    attention_backend: AttnBackend = AttnBackend.auto
    # Context-parallel attention (transformer/context_parallel): "p2p", "all_gather" or "a2a" for every
    # layer, or a list with one per layer; None means p2p. Read only when the cp group has > 1 rank.
    cp_comm_type: Optional[Union[str, List[str]]] = None
    compile_transformer_layers: bool = False

    # Activation recomputation
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: Optional[bool] = None

    # Fusions: bias+activation(+GLU) and bias+dropout+add run as one torch.compile'd kernel on CUDA
    # (megatron/core/fusions); masked_softmax_fusion is kept for argument compatibility (SDPA fuses it).
    masked_softmax_fusion: bool = False
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False

    def __post_init__(self):
        super().__post_init__()
        tp = self.tensor_model_parallel_size
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})."
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})."
            )
        if self.num_query_groups % tp != 0 and tp % self.num_query_groups != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be a multiple or divisor of "
                f"tensor_model_parallel_size ({tp})."
            )
        if self.num_query_groups % tp != 0:
            # Fewer groups than TP ranks would need replicated K/V heads with TP-summed grads,
            # which the local attention implementation does not build.
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) smaller than tensor_model_parallel_size ({tp}) "
                "(replicated key/value heads) is not supported by this implementation; use a multiple of "
                "tensor_model_parallel_size."
            )

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"ffn_hidden_size ({self.ffn_hidden_size}) must be a multiple of "
                f"tensor_model_parallel_size ({tp})."
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads}) when kv_channels is not set."
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads

        self.attention_backend = as_attn_backend(self.attention_backend)
        if isinstance(self.cp_comm_type, (list, tuple)) and len(self.cp_comm_type) != self.num_layers:
            raise ValueError(f"cp_comm_type has {len(self.cp_comm_type)} entries; a list needs one per layer "
                             f"(num_layers {self.num_layers})")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True

        pp = self.pipeline_model_parallel_size
        pipeline_layer_counts(  # raises ValueError naming the numbers when the split does not add up
            self.num_layers, pp, self.virtual_pipeline_model_parallel_size,
            self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage,
            self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split)

        if self.recompute_granularity is not None:
            if self.recompute_granularity not in ("full", "selective"):
                raise ValueError(
                    f"recompute_granularity must be 'full' or 'selective', got {self.recompute_granularity!r}"
                )
            if self.recompute_granularity == "full":
                if self.recompute_method not in ("uniform", "block"):
                    raise ValueError(
                        "When using recompute_granularity: full you must specify recompute_method "
                        f"('uniform' or 'block'), got {self.recompute_method!r}"
                    )
                layers_per_stage = self.num_layers // pp
                if self.recompute_num_layers is None or not 1 <= self.recompute_num_layers <= layers_per_stage:
                    raise ValueError(
                        f"recompute_num_layers ({self.recompute_num_layers}) must be between 1 and "
                        f"num_layers_per_pipeline_rank ({layers_per_stage}) with recompute_granularity full."
                    )
            elif self.recompute_num_layers is not None:
                raise ValueError(
                    f"recompute_num_layers ({self.recompute_num_layers}) must be None with "
                    "recompute_granularity selective."
                )

        if self.distribute_saved_activations and self.sequence_parallel:
            # SP already shards the saved layer input along the sequence; a second split would not line up.
            raise ValueError(
                f"distribute_saved_activations: {self.distribute_saved_activations} must be false when "
                f"sequence parallel is enabled: {self.sequence_parallel}"
            )

        if self.init_method_xavier_uniform:
            self.init_method = xavier_uniform_init_method()
            self.output_layer_init_method = xavier_uniform_init_method()
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        if self.embedding_init_method_std is None:
            self.embedding_init_method_std = self.init_method_std
        if self.embedding_init_method is None:
            self.embedding_init_method = init_method_normal(self.embedding_init_method_std)
