"""A small Megatron-LM-compatible GPT pretraining framework with OpenTelemetry (``megatron.core``, ``megatron.training``)."""
from megatron.torch_requirement import require_torch

require_torch()

__version__ = "0.1.0"
