"""Inference helpers: next-token sampling from logits."""
from megatron.core.inference.sampling import sample_logits

__all__ = ["sample_logits"]
