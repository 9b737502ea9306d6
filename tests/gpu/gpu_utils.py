"""Helpers of the GPU tests: the CUDA skip marker, small GPT configs, relative error, a free port."""
import socket

import pytest
import torch

NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False); run bash bench/gpu.sh on a GPU machine"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_gpt_config(**overrides):
    """A 2-layer GPT config (hidden 128, 4 heads, dropout 0) initialised on the CPU, so a seed fixes it."""
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=128, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                use_cpu_initialization=True)
    base.update(overrides)
    return TransformerConfig(**base)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖got − ref‖ / ‖ref‖`` in float64 (bf16 operands typically land between 1e-3 and 1e-2)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))
