"""Per-step routing counts of the MoE routers, for telemetry: tokens chosen per expert and tokens dropped.

The router calls ``record_routing(layer_number, tokens_per_expert, dropped_tokens)`` once per forward
pass. Nothing is kept unless a recorder is installed (``install``), so an uninstrumented run pays one
global lookup. Counts stay on the device and are summed in place over micro-batches; ``take()`` moves
them to the host once per log interval (one copy, no per-micro-batch synchronisation).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["RoutingStatsRecorder", "install", "uninstall", "active_recorder", "record_routing"]


class RoutingStatsRecorder:
    """Sums, per 1-based global layer number, the tokens the router sent to each expert and the dropped ones.

    ``tokens_per_expert``: ``[E]`` counts over the *global* expert index, of this rank's tokens, counted
    before capacity dropping (each token counts once per chosen expert, so the sum is tokens * topk).
    ``dropped_tokens``: (token, expert) assignments removed by the capacity factor (0 when dropless).
    """

    def __init__(self) -> None:
        self._tokens: Dict[int, torch.Tensor] = {}
        self._dropped: Dict[int, torch.Tensor] = {}

    def record(self, layer_number: int, tokens_per_expert: torch.Tensor,
               dropped_tokens: Optional[torch.Tensor] = None) -> None:
        """Add one forward pass's counts for ``layer_number`` (tensors detached; ``[E]`` and a scalar)."""
        counts = tokens_per_expert.detach().to(torch.int64)
        if layer_number in self._tokens:
            self._tokens[layer_number] += counts
        else:
            self._tokens[layer_number] = counts.clone()
        if dropped_tokens is not None:
            dropped = torch.as_tensor(dropped_tokens).detach().to(torch.int64)
            if layer_number in self._dropped:
                self._dropped[layer_number] += dropped.to(self._dropped[layer_number].device)
            else:
                self._dropped[layer_number] = dropped.clone()

    def take(self) -> Dict[int, Tuple[list, int]]:
        """``{layer_number: (tokens per expert as ints, dropped tokens)}`` since the last take; then reset."""
        out = {layer: (counts.tolist(), int(self._dropped[layer].item()) if layer in self._dropped else 0)
               for layer, counts in sorted(self._tokens.items())}
        self._tokens.clear()
        self._dropped.clear()
        return out


_RECORDER: Optional[RoutingStatsRecorder] = None


def install(recorder: Optional[RoutingStatsRecorder] = None) -> RoutingStatsRecorder:
    """Start recording (a fresh recorder unless one is given); returns it."""
    global _RECORDER
    _RECORDER = recorder if recorder is not None else RoutingStatsRecorder()
    return _RECORDER


def uninstall() -> None:
    """Stop recording."""
    global _RECORDER
    _RECORDER = None


def active_recorder() -> Optional[RoutingStatsRecorder]:
    """The installed recorder, or None."""
    return _RECORDER


def record_routing(layer_number: int, tokens_per_expert: torch.Tensor,
                   dropped_tokens: Optional[torch.Tensor] = None) -> None:
    """Record one router forward (no-op unless a recorder is installed)."""
    recorder = _RECORDER
    if recorder is not None:
        recorder.record(layer_number, tokens_per_expert, dropped_tokens)
