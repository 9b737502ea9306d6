"""Rank strategies: which ranks of a job export telemetry, with a registry for custom rules."""
from __future__ import annotations

import hashlib
import os
import threading
from typing import Callable, Dict, Optional, Tuple

__all__ = [
    "RankStrategyFn", "register_rank_strategy", "register_export_strategy", "unregister_rank_strategy",
    "registered_rank_strategies", "get_rank_strategy", "should_export", "rank_sample_fraction",
    "node_local_rank", "BUILTIN_RANK_STRATEGIES", "lowest_exporting_rank", "effective_sampling_strategy",
]


# Here, not in config, because both this module and sampling need it and config imports both.
def effective_sampling_strategy(config) -> str:
    """The SDK-level sampling strategy ``config`` asks for, lower case, ``""`` for none (the SDK's own
    ``OTEL_TRACES_SAMPLER``): ``sampler_enabled`` False (nemo-lens's ``SAMPLER_ENABLED=0``) means none
    whatever ``sampling_strategy`` says; True with no strategy named means ``rank_aware``; unset leaves
    it to ``sampling_strategy``."""
    switch = getattr(config, "sampler_enabled", None)
    if switch is False:
        return ""
    name = (getattr(config, "sampling_strategy", "") or "").strip().lower()
    return name or ("rank_aware" if switch else "")


# fn(config, rank, world_size) -> bool
RankStrategyFn = Callable[[object, int, int], bool]


def rank_sample_fraction(rank: int) -> float:
    """Deterministic pseudo-uniform number in [0, 1) for ``rank`` (SHA-256 of the rank).

    The same on every rerun and every process, so ``sampled`` and ``rank_aware`` pick the same ranks.
    """
    digest = hashlib.sha256(f"megatron.otel.rank/{int(rank)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def node_local_rank() -> int:
    """Node-local rank from ``LOCAL_RANK``, else ``SLURM_LOCALID``, else 0.

    Raises ``ValueError`` naming the variable when it is not an integer.
    """
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer node-local rank") from None
    return 0


def _single_rank(config, rank: int, world_size: int) -> bool:
    target = int(getattr(config, "export_rank", -1))
    if target < 0:
        target = world_size - 1
    return rank == target


def _all_ranks(config, rank: int, world_size: int) -> bool:
    return True


def _sampled(config, rank: int, world_size: int) -> bool:
    rate = float(getattr(config, "export_sample_rate", 1.0))
    return rank_sample_fraction(rank) < rate


def _first_rank_per_node(config, rank: int, world_size: int) -> bool:
    return node_local_rank() == 0


BUILTIN_RANK_STRATEGIES: Tuple[str, ...] = ("single_rank", "all_ranks", "sampled", "first_rank_per_node")
_REGISTRY: Dict[str, RankStrategyFn] = {
    "single_rank": _single_rank,
    "all_ranks": _all_ranks,
    "sampled": _sampled,
    "first_rank_per_node": _first_rank_per_node,
}
_BUILTIN_FNS: Dict[str, RankStrategyFn] = dict(_REGISTRY)
_LOCK = threading.Lock()


def _normalise(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"Strategy name must be a non-empty string, got {name!r}.")
    return name.strip().lower()


def register_rank_strategy(name: str, fn: RankStrategyFn, *, allow_override: bool = False) -> None:
    """Register ``fn(config, rank, world_size) -> bool`` under ``name`` (case-insensitive).

    A built-in name (``single_rank``, ...) can be replaced too, like any registered one, but only
    with ``allow_override=True`` (as in nemo-lens); ``unregister_rank_strategy`` then restores the
    built-in. Raises ``ValueError`` when the name is empty or already registered and
    ``allow_override`` is false; ``TypeError`` when ``fn`` is not callable.
    """
    key = _normalise(name)
    if not callable(fn):
        raise TypeError(f"rank strategy {name!r}: fn must be callable, got {type(fn).__name__}")
    with _LOCK:
        if key in _REGISTRY and not allow_override:
            kind = " (a built-in)" if key in BUILTIN_RANK_STRATEGIES else ""
            raise ValueError(f"Strategy {key!r} is already registered{kind}. Pass allow_override=True to replace it.")
        _REGISTRY[key] = fn


register_export_strategy = register_rank_strategy


def unregister_rank_strategy(name: str) -> bool:
    """Remove a custom strategy (returns ``True``); an overridden built-in gets its original back.

    Raises ``ValueError`` for a name that is not registered (as nemo-lens does) and for a built-in
    that was not overridden (built-ins cannot be removed).
    """
    key = _normalise(name)
    with _LOCK:
        if key in _BUILTIN_FNS:
            if _REGISTRY.get(key) is _BUILTIN_FNS[key]:
                raise ValueError(f"Cannot unregister built-in strategy {key!r}.")
            _REGISTRY[key] = _BUILTIN_FNS[key]
            return True
        if key not in _REGISTRY:
            raise ValueError(f"Strategy {key!r} is not registered. Registered strategies: {', '.join(_REGISTRY)}.")
        del _REGISTRY[key]
        return True


def registered_rank_strategies() -> Tuple[str, ...]:
    """Names of all strategies, built-ins first, then custom ones in registration order."""
    with _LOCK:
        return tuple(_REGISTRY)


def get_rank_strategy(name: str) -> RankStrategyFn:
    """The strategy function for ``name``; ``ValueError`` listing the valid names when unknown."""
    key = _normalise(name)
    with _LOCK:
        fn = _REGISTRY.get(key)
    if fn is None:
        raise ValueError(f"unknown rank strategy {name!r}; valid choices: " + ", ".join(registered_rank_strategies()))
    return fn


def should_export(config, rank: int, world_size: int, strategy=None) -> bool:
    """Whether ``rank`` of ``world_size`` exports under ``strategy`` (a name, a callable, or
    ``None`` for ``config.rank_strategy``). Raises ``ValueError`` for an unknown name."""
    if strategy is None:
        strategy = getattr(config, "rank_strategy", "single_rank")
    fn = strategy if callable(strategy) else get_rank_strategy(strategy)
    return bool(fn(config, int(rank), int(world_size)))


def lowest_exporting_rank(config, world_size: int, strategy=None) -> Optional[int]:
    """The lowest rank that exports under ``strategy`` (as ``should_export``), computed by every
    rank alike without communication, or ``None`` when no rank exports.

    The built-ins are pure functions of ``(config, rank, world_size)`` except
    ``first_rank_per_node``, which reads this process's node-local rank: under it rank 0 is taken
    (launchers give global rank 0 node-local rank 0). A custom strategy is called for each rank in
    turn, so it must depend on nothing else for the answer to agree across ranks.
    """
    if strategy is None:
        strategy = getattr(config, "rank_strategy", "single_rank")
    fn = strategy if callable(strategy) else get_rank_strategy(strategy)
    if fn is _first_rank_per_node:
        return 0
    if fn is _single_rank:
        target = int(getattr(config, "export_rank", -1))
        target = world_size - 1 if target < 0 else target
        return target if 0 <= target < world_size else None
    keep = None
    if effective_sampling_strategy(config) == "rank_aware":
        rate = float(getattr(config, "export_sample_rate", 1.0))
        keep = lambda rank: rank_sample_fraction(rank) < rate  # noqa: E731 (the rank_aware sampler's rule)
    for rank in range(int(world_size)):
        if fn(config, rank, int(world_size)) and (keep is None or keep(rank)):
            return rank
    return None
