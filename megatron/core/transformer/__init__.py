"""TransformerConfig and the decoder building blocks (attention, MLP, layer, block)."""
from megatron.core.transformer.attention import DotProductAttention, SelfAttention
from megatron.core.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.norms import LayerNorm, RMSNorm, build_norm
from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = [
    "DotProductAttention", "SelfAttention", "AttnMaskType", "AttnType", "LayerType", "ModelType", "MLP",
    "Float16Module", "MegatronModule", "LayerNorm", "RMSNorm", "build_norm", "RotaryEmbedding",
    "apply_rotary_pos_emb", "TransformerBlock", "TransformerConfig", "TransformerLayer",
]
