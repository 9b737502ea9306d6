"""SDK-level samplers for exporting ranks: the built-in ``rank_aware`` sampler and a registry."""
from __future__ import annotations

import threading
from typing import Callable, Dict, Tuple

from .strategies import effective_sampling_strategy, rank_sample_fraction

__all__ = [
    "register_sampling_strategy", "unregister_sampling_strategy", "registered_sampling_strategies",
    "build_sampler", "BUILTIN_SAMPLING_STRATEGIES",
]

# factory(config, rank, world_size) -> opentelemetry.sdk.trace.sampling.Sampler
SamplerFactory = Callable[[object, int, int], object]


def _rank_aware_factory(config, rank: int, world_size: int):
    """Keep every trace on ranks selected by the ``sampled`` hash at ``export_sample_rate`` and
    none elsewhere, then defer to the SDK's environment sampler (``OTEL_TRACES_SAMPLER``) so that a
    ratio sampler still thins the kept ranks' traces (composition, not replacement)."""
    from .providers import rank_aware_sampler

    keep_rank = rank_sample_fraction(rank) < float(getattr(config, "export_sample_rate", 1.0))
    return rank_aware_sampler(keep_rank, rank)


BUILTIN_SAMPLING_STRATEGIES: Tuple[str, ...] = ("rank_aware",)
_REGISTRY: Dict[str, SamplerFactory] = {"rank_aware": _rank_aware_factory}
_LOCK = threading.Lock()


def register_sampling_strategy(name: str, factory: SamplerFactory, *, allow_override: bool = False) -> None:
    """Register ``factory(config, rank, world_size) -> Sampler`` under ``name`` (case-insensitive).

    Raises ``ValueError`` for an empty name, a built-in name, or a duplicate without
    ``allow_override``; ``TypeError`` when ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"sampling strategy name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"sampling strategy {name!r}: factory must be callable")
    key = name.strip().lower()
    with _LOCK:
        if key in BUILTIN_SAMPLING_STRATEGIES:
            raise ValueError(f"sampling strategy {key!r} is built in and cannot be replaced")
        if key in _REGISTRY and not allow_override:
            raise ValueError(f"sampling strategy {key!r} is already registered; pass allow_override=True")
        _REGISTRY[key] = factory


def unregister_sampling_strategy(name: str) -> bool:
    """Remove a custom sampling strategy; returns whether it existed. ``ValueError`` for built-ins."""
    key = name.strip().lower()
    with _LOCK:
        if key in BUILTIN_SAMPLING_STRATEGIES:
            raise ValueError(f"sampling strategy {key!r} is built in and cannot be unregistered")
        return _REGISTRY.pop(key, None) is not None


def registered_sampling_strategies() -> Tuple[str, ...]:
    """All sampling strategy names, built-ins first."""
    with _LOCK:
        return tuple(_REGISTRY)


def build_sampler(config, rank: int, world_size: int):
    """The Sampler for ``config.sampling_strategy``, or ``None`` (keep the SDK's own ``OTEL_TRACES_SAMPLER``).

    ``config.sampler_enabled`` (``MEGATRON_OTEL_SAMPLER_ENABLED`` / ``NEMO_LENS_SAMPLER_ENABLED``) is
    nemo-lens's switch: ``False`` turns the SDK-level sampler off whatever the strategy says; ``True``
    with no strategy named means ``rank_aware``; unset (``None``) leaves the decision to the strategy
    (empty: none).

    Raises ``ValueError`` listing the valid names for an unknown strategy.
    """
    name = effective_sampling_strategy(config)
    if not name:
        return None
    with _LOCK:
        factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown sampling strategy {name!r}; valid choices: "
                         + ", ".join(registered_sampling_strategies()))
    return factory(config, int(rank), int(world_size))
