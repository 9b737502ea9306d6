"""``--bias-dropout-fusion``: ``residual + dropout(x + bias)`` as one fused kernel (Megatron's bias_dropout_add)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.fusions.pointwise import fuse_pointwise


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias)``; x/residual [s, b, h], bias [h] or None (bias added before dropout)."""
    if bias is not None:
        x = x + bias
    if training and prob > 0.0:
        x = F.dropout(x, p=prob, training=True)
    return residual + x


bias_dropout_add_fused = fuse_pointwise(bias_dropout_add)
bias_dropout_add_fused.__doc__ = (
    "bias_dropout_add as one fused kernel on CUDA (see fuse_pointwise). Compiled dropout draws its mask "
    "with inductor's Philox stream, seeded from the active CUDA generator (the TP RNG tracker's fork "
    "included), so masks differ from the unfused path's; without dropout the results are equal.")


def get_bias_dropout_add(fused: bool) -> Callable:
    """The bias-dropout-add function of a transformer layer: fused (``--bias-dropout-fusion``) or not."""
    return bias_dropout_add_fused if fused else bias_dropout_add
