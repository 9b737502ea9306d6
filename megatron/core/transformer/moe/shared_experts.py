"""The MoE shared expert (Megatron core_v0.14's ``SharedExpertMLP``, ungated): a dense MLP every token passes through."""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SharedExpertMLP"]


class SharedExpertMLP(MLP):
    """An ``MLP`` with ffn = ``moe_shared_expert_intermediate_size`` on the regular TP group (sequence parallel
    as the dense MLP); ``MoELayer`` adds its output after the routed experts' combine. The gated variant
    (``moe_shared_expert_gate``, a sigmoid gate [1, H]) is not in this project.

    forward(hidden [s, b, h] ([s/tp, b, h] under SP)) -> output of the same shape (no bias: MoE has none).
    """

    def __init__(self, config: TransformerConfig, model_comm_pgs=None):
        super().__init__(config, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
        self.use_shared_expert_gate = False

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        output, bias = super().forward(hidden_states)
        return output if bias is None else output + bias
