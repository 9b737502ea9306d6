"""Feed-forward block: column-parallel fc1, GeLU or gated (SwiGLU) activation, row-parallel fc2."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_activation import bias_activation, bias_activation_fused
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class MLP(MegatronModule):
    """h -> ffn -> h MLP (Vaswani et al. 2017, section 3.3; gated variant per Shazeer 2020, "GLU Variants").

    linear_fc1: ColumnParallelLinear [ffn/tp, h] ([2*ffn/tp, h] with ``gated_linear_unit``, rows
    ``[gate_r; up_r]`` per rank, activation applied to the gate half); linear_fc2: RowParallelLinear
    [h, ffn/tp]. forward(hidden [s, b, h]) -> (output [s, b, h], fc2 bias [h] or None), the bias
    returned separately for bias-dropout-add.

    ``ffn_hidden_size`` overrides ``config.ffn_hidden_size`` (MoE experts and shared experts). A MoE
    expert (``is_expert``) is split over the expert-TP group ``tp_group`` and does no collective
    itself (the token dispatcher does); its forward takes ``per_token_scale`` [tokens], the routing
    probabilities multiplied in after the activation (Megatron core_v0.14's ``MLP.forward``).
    """

    def __init__(self, config: TransformerConfig, is_expert: bool = False, input_size: Optional[int] = None,
                 ffn_hidden_size: Optional[int] = None, tp_group=None):
        super().__init__(config)
        self.input_size = input_size if input_size is not None else config.hidden_size
        self.ffn_hidden_size = config.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
        ffn_hidden_size = self.ffn_hidden_size
        if config.gated_linear_unit:
            ffn_hidden_size *= 2
        expert_kwargs = {"tp_group": tp_group} if is_expert else {}
        # stride 2 keeps gate and up halves paired per TP rank when splitting the master weight.
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            self.input_size, ffn_hidden_size, config=config, init_method=config.init_method,
            gather_output=False, bias=config.add_bias_linear, skip_bias_add=True, is_expert=is_expert,
            stride=2 if config.gated_linear_unit else 1, **expert_kwargs,
        )
        self.activation_func = config.activation_func
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            self.ffn_hidden_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=is_expert, **expert_kwargs,
        )

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden [s, b, h] (or [tokens, h]) -> (output, bias [h] or None); ``per_token_scale``
        [tokens] multiplies each token's activation (MoE routing probabilities)."""
        intermediate, bias = self.linear_fc1(hidden_states)
        # --bias-gelu-fusion / --bias-swiglu-fusion: bias, activation and GLU product in one kernel.
        impl = bias_activation_fused if self.config.bias_activation_fusion else bias_activation
        intermediate = impl(intermediate, bias, self.activation_func, self.config.gated_linear_unit)
        if per_token_scale is not None:
            intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
        return self.linear_fc2(intermediate)
