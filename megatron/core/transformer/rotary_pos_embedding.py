"""Rotary position embedding (RoPE) frequencies and their application to query/key heads.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", section 3.4.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch


def _apply_llama3_scaling(inv_freq: torch.Tensor, factor: float = 8.0, low_freq_factor: float = 1.0,
                          high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192
                          ) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths divided by ``factor``, short kept, smooth in between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Rotation angles for RoPE over ``dim = int(kv_channels * rotary_percent)`` channels.

    ``inv_freq[i] = 1 / rotary_base^(2i/dim)``; positions are divided by
    ``seq_len_interpolation_factor`` when given. forward(max_seq_len) returns angles
    [s, 1, 1, dim]: ``[f, f]`` concatenated (rotate-half layout) or each frequency repeated twice
    (``rotary_interleaved``). Results are cached per (length, offset, device); there are no
    parameters or state-dict entries.

    Raises ValueError if the rotary dim is odd or zero.
    """

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: float = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0):
        super().__init__()
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        if dim <= 0 or dim % 2 != 0:
            raise ValueError(
                f"rotary dim int(kv_channels ({kv_channels}) * rotary_percent ({rotary_percent})) = {dim} "
                "must be a positive even number"
            )
        self.dim = dim
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if rope_scaling:
            inv_freq = _apply_llama3_scaling(inv_freq, factor=rope_scaling_factor)
        # A plain attribute, not a buffer: model.half() must not round the frequencies.
        self.inv_freq = inv_freq
        self._cache: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}

    def forward(self, max_seq_len: int, offset: int = 0, device: Optional[torch.device] = None) -> torch.Tensor:
        """Angles [max_seq_len, 1, 1, dim] (fp32) for positions offset .. offset+max_seq_len-1."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        key = (max_seq_len, offset, torch.device(device))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        inv_freq = self.inv_freq.to(device)
        seq = torch.arange(max_seq_len, device=device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, inv_freq)
        if self.rotary_interleaved:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[:, None, None, :]
        self._cache[key] = emb
        return emb


def _rotate_half(x: torch.Tensor, rotary_interleaved: bool) -> torch.Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.size(-1)`` channels of t [s, b, n, d] by angles freqs [s, 1, 1, rot_dim].

    ``t * cos + rotate_half(t) * sin`` with cos/sin cast to t's dtype; remaining channels pass
    through. Raises ValueError if the sequence lengths differ or rot_dim > d.
    """
    rot_dim = freqs.size(-1)
    if freqs.size(0) != t.size(0) or rot_dim > t.size(-1):
        raise ValueError(f"rotary angles {tuple(freqs.shape)} do not fit tensor {tuple(t.shape)}")
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    if t_pass.size(-1) == 0:
        return t_rot
    return torch.cat((t_rot, t_pass), dim=-1)
