"""Weight-initialisation factories used by TransformerConfig (normal, scaled normal, xavier)."""
from __future__ import annotations

import functools
import math

import torch


def init_method_normal(sigma: float):
    """Return ``init_(tensor)`` drawing from N(0, sigma^2) in place."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """Return ``init_(tensor)`` drawing from N(0, (sigma / sqrt(multiplier * num_layers))^2).

    Output-layer-style init of GPT-2 (Radford et al. 2019, section 2.3): residual-branch output
    weights are scaled by 1/sqrt(N) with N the number of residual layers (2 per transformer layer).
    """
    std = sigma / math.sqrt(multiplier * num_layers)
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=std)


def xavier_uniform_init_method():
    """Return ``torch.nn.init.xavier_uniform_`` (Glorot & Bengio 2010, eq. 16)."""
    return torch.nn.init.xavier_uniform_
