"""``--bias-gelu-fusion`` / ``--bias-swiglu-fusion``: bias add, activation and GLU product as one fused kernel."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.core.fusions.pointwise import fuse_pointwise


def bias_activation(intermediate: torch.Tensor, bias: Optional[torch.Tensor], activation_func: Callable,
                    gated_linear_unit: bool) -> torch.Tensor:
    """The unfused reference: ``act(x + b)``, or ``act(gate) * up`` for a GLU.

    intermediate [s, b, f] (f = 2 * ffn/tp for a GLU, the gate half first), bias [f] or None;
    returns [s, b, ffn/tp].
    """
    if bias is not None:
        intermediate = intermediate + bias
    if gated_linear_unit:
        gate, up = torch.chunk(intermediate, 2, dim=-1)
        return activation_func(gate) * up
    return activation_func(intermediate)


bias_activation_fused = fuse_pointwise(bias_activation)
bias_activation_fused.__doc__ = "bias_activation as one fused kernel on CUDA (see fuse_pointwise)."
