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

    MoE (``num_moe_experts`` set): Megatron's rules in ``_check_moe``; ``is_moe_layer(n)`` says which
    layers get the MoE MLP.

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

    # Mixture of experts (megatron/core/transformer/moe; Megatron core_v0.14 names and defaults).
    # num_moe_experts None: every layer has a dense MLP. moe_layer_freq: int N gives MoE at layers with
    # 0-based index i % N == 0; a list gives one 0/1 per layer. moe_ffn_hidden_size None: ffn_hidden_size.
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    moe_router_topk: int = 2
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: Optional[str] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_grouped_gemm: bool = False
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"
    moe_per_layer_logging: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"

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

        if self.num_moe_experts is not None:
            self._check_moe()

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

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether the 1-based global ``layer_number`` has an MoE MLP (``moe_layer_freq``, Megatron's
        ``get_gpt_decoder_block_spec``: int N -> 0-based index % N == 0; list -> its 0/1 entry)."""
        if self.num_moe_experts is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number - 1])

    def _check_moe(self) -> None:
        """Megatron's MoE rules from ``TransformerConfig.__post_init__`` (same conditions, field names).

        Raises ValueError naming the fields.
        """
        num_experts = self.num_moe_experts
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_moe_experts must be a positive integer, got {num_experts!r}")
        if self.add_bias_linear:
            raise ValueError("Bias is not supported for MoE (num_moe_experts is set): set add_bias_linear=False "
                             "(--disable-bias-linear)")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        etp = self.expert_tensor_parallel_size
        if self.moe_ffn_hidden_size % etp != 0:
            raise ValueError(f"moe_ffn_hidden_size ({self.moe_ffn_hidden_size}) must be a multiple of "
                             f"expert_tensor_parallel_size ({etp})")
        if num_experts % self.expert_model_parallel_size != 0:
            raise ValueError(f"num_moe_experts ({num_experts}) must be a multiple of expert_model_parallel_size "
                             f"({self.expert_model_parallel_size})")
        if isinstance(self.moe_layer_freq, int):
            if self.moe_layer_freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        elif len(self.moe_layer_freq) != self.num_layers or any(v not in (0, 1) for v in self.moe_layer_freq):
            raise ValueError(f"moe_layer_freq as a list needs one 0/1 entry per layer (num_layers "
                             f"{self.num_layers}), got {list(self.moe_layer_freq)}")
        if self.moe_shared_expert_intermediate_size is not None and self.moe_shared_expert_intermediate_size <= 0:
            raise ValueError("moe_shared_expert_intermediate_size must be num_shared_experts * ffn_size_of_each_"
                             f"shared_expert > 0, got {self.moe_shared_expert_intermediate_size}")
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type != "alltoall":
            raise ValueError("moe_shared_expert_overlap only works with the alltoall token dispatcher, got "
                             f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ValueError(f"moe_token_dispatcher_type must be 'allgather' or 'alltoall' (flex needs DeepEP, not "
                             f"available here), got {self.moe_token_dispatcher_type!r}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', got "
                             f"{self.moe_router_score_function!r}")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"moe_router_dtype must be None, 'fp32' or 'fp64', got {self.moe_router_dtype!r}")
        if self.moe_token_drop_policy not in ("probs", "position"):
            raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got "
                             f"{self.moe_token_drop_policy!r}")
        if not 1 <= self.moe_router_topk <= num_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be between 1 and num_moe_experts "
                             f"({num_experts})")
        balancing = self.moe_router_load_balancing_type
        types = list(balancing) if isinstance(balancing, (list, tuple)) else [balancing]
        for kind in types:
            if kind not in ("aux_loss", "seq_aux_loss", "none"):
                raise ValueError(f"moe_router_load_balancing_type must be aux_loss, seq_aux_loss or none (sinkhorn "
                                 f"is not available here), got {kind!r}")
        coeffs = self.moe_aux_loss_coeff
        if isinstance(balancing, (list, tuple)) and (not isinstance(coeffs, (list, tuple))
                                                     or len(coeffs) != len(balancing)):
            raise ValueError(f"moe_aux_loss_coeff needs one value per moe_router_load_balancing_type entry "
                             f"({list(balancing)}), got {coeffs!r}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("Expert bias for aux-loss-free routing only supports sigmoid score function. "
                             "Please set --moe-router-score-function sigmoid for sigmoid score function.")
        if (self.moe_router_topk == 1 and self.moe_router_score_function == "softmax"
                and not self.moe_router_pre_softmax):
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1.")
        if self.moe_router_group_topk is not None:
            groups = self.moe_router_num_groups
            if not groups:
                raise ValueError("When using group limited routing, moe_router_num_groups must be specified.")
            if num_experts % groups != 0:
                raise ValueError(f"num_moe_experts ({num_experts}) should be divisible by moe_router_num_groups "
                                 f"({groups}).")
            if self.moe_router_group_topk > groups:
                raise ValueError(f"moe_router_group_topk ({self.moe_router_group_topk}) should be smaller than "
                                 f"moe_router_num_groups ({groups}).")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            self.moe_expert_capacity_factor = None  # Megatron: a negative factor means dropless
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity")
