"""Rank strategies for ranks 0..N, registration rules, and the SDK-level samplers."""
import hashlib

import pytest

from megatron.core.telemetry import (
    TelemetryConfig, register_export_strategy, register_rank_strategy, register_sampling_strategy,
    registered_rank_strategies, registered_sampling_strategies, should_export, unregister_rank_strategy,
    unregister_sampling_strategy,
)
from megatron.core.telemetry.sampling import build_sampler
from telemetry_testutil import clean_telemetry  # noqa: F401  (autouse fixture)


def _exporters(cfg, world_size):
    return [r for r in range(world_size) if should_export(cfg, r, world_size)]


def _reference_fraction(rank):
    return int(hashlib.sha256(f"megatron.otel.rank/{rank}".encode()).hexdigest()[:16], 16) / 2**64


@pytest.mark.parametrize("world_size", [1, 2, 5, 8])
def test_single_and_all_ranks(world_size):
    assert _exporters(TelemetryConfig(), world_size) == [world_size - 1]
    assert _exporters(TelemetryConfig(export_rank=0), world_size) == [0]
    assert _exporters(TelemetryConfig(export_rank=-5), world_size) == [world_size - 1]
    assert _exporters(TelemetryConfig(export_rank=world_size), world_size) == []
    assert _exporters(TelemetryConfig(rank_strategy="all_ranks"), world_size) == list(range(world_size))


@pytest.mark.parametrize("rate", [0.0, 0.25, 0.5, 1.0])
def test_sampled_is_deterministic_hash(rate):
    cfg = TelemetryConfig(rank_strategy="sampled", export_sample_rate=rate)
    expected = [r for r in range(64) if _reference_fraction(r) < rate]
    assert _exporters(cfg, 64) == expected == _exporters(cfg, 64)
    if rate == 0.5:
        assert 16 < len(expected) < 48  # the hash spreads ranks, it does not pick a prefix


def test_first_rank_per_node(monkeypatch):
    cfg = TelemetryConfig(rank_strategy="first_rank_per_node")
    assert should_export(cfg, 5, 8)  # no LOCAL_RANK/SLURM_LOCALID: node-local rank 0
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert not should_export(cfg, 1, 8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # LOCAL_RANK wins over SLURM_LOCALID
    assert should_export(cfg, 4, 8)
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        should_export(cfg, 0, 8)


def test_custom_strategy_registration_rules():
    def even(config, rank, world_size):
        return rank % 2 == 0

    try:
        register_rank_strategy("Even", even)
        assert "even" in registered_rank_strategies()
        assert _exporters(TelemetryConfig(rank_strategy="even"), 6) == [0, 2, 4]
        TelemetryConfig(rank_strategy="even").validate()
        with pytest.raises(ValueError, match="already registered"):
            register_rank_strategy("even", even)
        register_export_strategy("even", lambda c, r, w: r == 1, allow_override=True)
        assert _exporters(TelemetryConfig(rank_strategy="even"), 6) == [1]
        assert should_export(TelemetryConfig(), 3, 6, strategy=even) is False  # explicit callable
        with pytest.raises(ValueError, match=r"already registered \(a built-in\). Pass allow_override=True"):
            register_rank_strategy("all_ranks", even)
        with pytest.raises(ValueError, match="Cannot unregister built-in strategy"):
            unregister_rank_strategy("single_rank")
        with pytest.raises(TypeError, match="must be callable"):
            register_rank_strategy("bad", 3)
        with pytest.raises(ValueError, match="non-empty"):
            register_rank_strategy(" ", even)
    finally:
        assert unregister_rank_strategy("even") is True
    with pytest.raises(ValueError, match="'even' is not registered"):
        unregister_rank_strategy("even")
    with pytest.raises(ValueError, match="unknown rank strategy 'even'"):
        should_export(TelemetryConfig(rank_strategy="even"), 0, 2)


def test_sampling_registry_and_rank_aware_composition(monkeypatch):
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision

    assert build_sampler(TelemetryConfig(), 0, 4) is None
    with pytest.raises(ValueError, match="built in"):
        register_sampling_strategy("rank_aware", lambda c, r, w: ALWAYS_ON)
    try:
        register_sampling_strategy("always", lambda c, r, w: ALWAYS_ON)
        assert "always" in registered_sampling_strategies()
        assert build_sampler(TelemetryConfig(sampling_strategy="always"), 0, 4) is ALWAYS_ON
        with pytest.raises(ValueError, match="already registered"):
            register_sampling_strategy("always", lambda c, r, w: ALWAYS_ON)
    finally:
        unregister_sampling_strategy("always")

    rate = 0.5
    kept = [r for r in range(16) if _reference_fraction(r) < rate]
    dropped = [r for r in range(16) if r not in kept]
    cfg = TelemetryConfig(sampling_strategy="rank_aware", export_sample_rate=rate)
    trace_id_low = (1 << 127) | 5  # low 64 bits tiny: any ratio sampler keeps it
    trace_id_high = (1 << 64) - 1  # low 64 bits maximal: a 0.1 ratio sampler drops it
    for rank in kept:
        assert build_sampler(cfg, rank, 16).should_sample(None, trace_id_high, "s").decision == Decision.RECORD_AND_SAMPLE
    for rank in dropped:
        assert build_sampler(cfg, rank, 16).should_sample(None, trace_id_low, "s").decision == Decision.DROP
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    sampler = build_sampler(cfg, kept[0], 16)
    assert sampler.should_sample(None, trace_id_low, "s").decision == Decision.RECORD_AND_SAMPLE
    assert sampler.should_sample(None, trace_id_high, "s").decision == Decision.DROP


def test_sampler_enabled_switch_of_nemo_lens():
    from opentelemetry.sdk.trace.sampling import Decision

    from megatron.core.telemetry.strategies import lowest_exporting_rank

    rate = 0.5
    kept = [r for r in range(16) if _reference_fraction(r) < rate]
    dropped = [r for r in range(16) if r not in kept]
    trace_id = (1 << 127) | 5
    env = {"NEMO_LENS_SAMPLER_ENABLED": "1", "NEMO_LENS_EXPORT_SAMPLE_RATE": str(rate)}
    cfg = TelemetryConfig.from_env(environ=env).validate()
    assert cfg.sampler_enabled is True and cfg.sampling_strategy == ""  # on, no strategy named: rank_aware
    for rank in (kept[0], dropped[0]):
        decision = build_sampler(cfg, rank, 16).should_sample(None, trace_id, "s").decision
        assert decision == (Decision.RECORD_AND_SAMPLE if rank in kept else Decision.DROP)
    all_ranks = TelemetryConfig.from_env(environ={**env, "NEMO_LENS_RANK_STRATEGY": "all_ranks"})
    assert lowest_exporting_rank(all_ranks, 16) == kept[0]  # the root span's rank follows the sampler

    # Off: no SDK-level sampler, whatever strategy is named (the SDK's OTEL_TRACES_SAMPLER decides).
    off = TelemetryConfig.from_env(environ={"NEMO_LENS_SAMPLER_ENABLED": "false",
                                            "MEGATRON_OTEL_SAMPLING_STRATEGY": "rank_aware",
                                            "MEGATRON_OTEL_RANK_STRATEGY": "all_ranks",
                                            "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": str(rate)})
    assert off.sampler_enabled is False and build_sampler(off, dropped[0], 16) is None
    assert lowest_exporting_rank(off, 16) == 0
    # The prefixed variable beats the fallback; unset leaves the strategy in charge.
    prefixed = TelemetryConfig.from_env(environ={"MEGATRON_OTEL_SAMPLER_ENABLED": "0",
                                                 "NEMO_LENS_SAMPLER_ENABLED": "1"})
    assert prefixed.sampler_enabled is False and prefixed.sources["sampler_enabled"] == "MEGATRON_OTEL_SAMPLER_ENABLED"
    assert TelemetryConfig.from_env(environ={}).sampler_enabled is None
    assert build_sampler(TelemetryConfig(sampling_strategy="rank_aware"), kept[0], 16) is not None
    with pytest.raises(ValueError, match="Invalid boolean for NEMO_LENS_SAMPLER_ENABLED: 'maybe'"):
        TelemetryConfig.from_env(environ={"NEMO_LENS_SAMPLER_ENABLED": "maybe"})
