"""Fused element-wise kernels of the transformer layer (bias + activation, bias + dropout + residual)."""
