"""One pre-LN decoder layer: norm -> self-attention -> residual, norm -> MLP -> residual."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.telemetry import managed_span
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig


class TransformerLayer(MegatronModule):
    """Pre-LN transformer decoder layer (Xiong et al. 2020, "On Layer Normalization in the
    Transformer Architecture", figure 1(b)).

    ``x = x + Dropout(Proj(Attn(LN1(x))))``; ``x = x + Dropout(FC2(act(FC1(LN2(x)))))``. With
    ``apply_residual_connection_post_layernorm`` the residual is the norm output. ``layer_number``
    is global and 1-based; ``mlp`` is a ``MoELayer`` where ``config.is_moe_layer(layer_number)``, else an
    ``MLP``. forward(hidden [s, b, h], attention_mask [b, 1, s, s] bool or None,
    rotary_pos_emb [s, 1, 1, d] or None) -> (hidden [s, b, h], context).
    """

    def __init__(self, config: TransformerConfig, submodules=None, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, model_comm_pgs=None):
        super().__init__(config)
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number=layer_number, model_comm_pgs=model_comm_pgs)
        self.pre_mlp_layernorm = build_norm(config)
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(config, layer_number=layer_number, model_comm_pgs=model_comm_pgs)
        else:
            self.mlp = MLP(config)
        # --bias-dropout-fusion (Megatron's default): residual + dropout(x + bias) in one kernel.
        self.bias_dropout_add = get_bias_dropout_add(config.bias_dropout_fusion)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_params=None, packed_seq_params=None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden [s, b, h] -> (hidden [s, b, h], context passed through).

        Emits ``megatron.layer.forward`` > ``megatron.layer.self_attention`` / ``megatron.layer.mlp``
        spans when the ``layer`` telemetry group is on (forward only; a disabled group costs a lookup).
        """
        with managed_span("layer", "megatron.layer.forward", **{"megatron.layer_number": self.layer_number}):
            residual = hidden_states
            layernorm_output = self.input_layernorm(hidden_states)
            with managed_span("layer", "megatron.layer.self_attention"):
                attention_output, attention_bias = self.self_attention(
                    layernorm_output, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                )
            if self.config.apply_residual_connection_post_layernorm:
                residual = layernorm_output
            hidden_states = self.bias_dropout_add(attention_output, attention_bias, residual, self.hidden_dropout,
                                                  self.training)

            residual = hidden_states
            layernorm_output = self.pre_mlp_layernorm(hidden_states)
            with managed_span("layer", "megatron.layer.mlp"):
                mlp_output, mlp_bias = self.mlp(layernorm_output)
            if self.config.apply_residual_connection_post_layernorm:
                residual = layernorm_output
            output = self.bias_dropout_add(mlp_output, mlp_bias, residual, self.hidden_dropout, self.training)
        return output, context
