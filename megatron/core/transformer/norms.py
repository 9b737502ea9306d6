"""LayerNorm and RMSNorm with Megatron's options, and the factory that picks one from the config."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig


class _Norm(torch.nn.Module):
    """Shared parameter handling: ``weight`` (and ``bias``) over the last dim ``hidden_size``.

    With ``zero_centered_gamma`` the weight stores gamma - 1 (initialised to 0) and 1 is added in
    forward (``--apply-layernorm-1p``). Under sequence parallelism the params carry
    ``sequence_parallel = True`` so their grads are summed over TP.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, has_bias: bool):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.cuda.is_available() and not config.use_cpu_initialization) else torch.device("cpu")
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=config.params_dtype))
        if has_bias:
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        for param in self.parameters():
            setattr(param, "sequence_parallel", sequence_parallel)

    def reset_parameters(self) -> None:
        """Weight to 1 (0 with zero-centered gamma), bias to 0."""
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _effective(self, x: torch.Tensor):
        weight, bias = self.weight, self.bias
        if self.zero_centered_gamma:
            weight = weight + 1
        if x.dtype != weight.dtype:
            # fp32 residual stream with half params: normalise in fp32 (output cast back in forward).
            weight = weight.float()
            bias = bias.float() if bias is not None else None
            x = x.float()
        return x, weight, bias

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """Layer normalisation (Ba et al. 2016, eq. 4) over the last dim: x [*, h] -> [*, h] in params dtype."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps, has_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_, weight, bias = self._effective(x)
        return F.layer_norm(x_, (self.hidden_size,), weight, bias, self.eps).to(self.weight.dtype)


class RMSNorm(_Norm):
    """Root-mean-square normalisation (Zhang & Sennrich 2019, eq. 4): x / sqrt(mean(x^2) + eps) * g."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps, has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_, weight, _ = self._effective(x)
        return F.rms_norm(x_, (self.hidden_size,), weight, self.eps).to(self.weight.dtype)


def build_norm(config: TransformerConfig, hidden_size: Optional[int] = None, eps: Optional[float] = None):
    """``LayerNorm`` or ``RMSNorm`` per ``config.normalization`` over ``hidden_size`` (default config.hidden_size).

    Raises ValueError for an unknown normalization name.
    """
    hidden_size = config.hidden_size if hidden_size is None else hidden_size
    eps = config.layernorm_epsilon if eps is None else eps
    if config.normalization == "LayerNorm":
        return LayerNorm(config, hidden_size, eps)
    if config.normalization == "RMSNorm":
        return RMSNorm(config, hidden_size, eps)
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {config.normalization!r}")
