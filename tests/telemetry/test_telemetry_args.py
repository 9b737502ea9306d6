"""setup_telemetry_from_args: env + CLI precedence, validation on every rank, bridge, no probe when off."""
import logging
from argparse import Namespace

import pytest

from megatron.core import telemetry as tel
from megatron.training import argument_utils
from telemetry_testutil import clean_telemetry  # noqa: F401


def _args(**kw):
    base = dict(otel_enabled=False, otel_service_name=None, otel_span_groups=None, local_rank=0,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, global_batch_size=8, seq_length=64,
                num_layers=2, hidden_size=64, num_attention_heads=4, train_iters=10, micro_batch_size=1,
                ckpt_format="torch", fp16=False, bf16=False, world_size=2, rank=0)
    base.update(kw)
    return Namespace(**base)


def test_disabled_by_default_and_no_probe(monkeypatch):
    probed = []
    monkeypatch.setattr(argument_utils, "build_telemetry_resource_attrs", lambda *a, **k: probed.append(1) or {})
    handle = argument_utils.setup_telemetry_from_args(_args(), rank=1, world_size=2, local_rank=1)
    assert handle is not None and not handle.enabled and not handle.is_exporting and probed == []
    # enabled, but rank 0 does not export under the default strategy: still no probe
    handle = argument_utils.setup_telemetry_from_args(_args(otel_enabled=True), rank=0, world_size=2, local_rank=0)
    assert handle.enabled and not handle.is_exporting and probed == []


def test_bad_settings_fail_on_every_rank(monkeypatch):
    monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "nonsense")
    for rank in range(2):
        with pytest.raises(ValueError, match="MEGATRON_OTEL_SPAN_GROUPS: Unknown span group"):
            argument_utils.setup_telemetry_from_args(_args(otel_enabled=True), rank=rank, world_size=2)
    with pytest.raises(ValueError, match="--otel-span-groups"):
        argument_utils.setup_telemetry_from_args(_args(otel_span_groups="x"), rank=0, world_size=2)
    monkeypatch.delenv("MEGATRON_OTEL_SPAN_GROUPS")
    monkeypatch.setenv("NEMO_LENS_ENABLED", "perhaps")
    with pytest.raises(ValueError, match="NEMO_LENS_ENABLED"):
        argument_utils.setup_telemetry_from_args(_args(), rank=0, world_size=2)


def test_cli_overrides_env_and_bridge_starts(monkeypatch):
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "0")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_LOGS_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_METRICS_ENABLED", "0")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "env-name")
    monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "all")
    args = _args(otel_enabled=True, otel_service_name="cli-name", otel_span_groups="per_step")
    handle = argument_utils.setup_telemetry_from_args(args, rank=1, world_size=2, local_rank=1)
    try:
        assert handle.is_exporting and handle.config.service_name == "cli-name"
        assert tel.get_enabled_groups() == tel.MegatronSpanGroup.resolve("per_step")
        assert handle.resource_attributes["service.name"] == "cli-name"
        assert handle.resource_attributes["dl.local_rank"] == 1 and handle.resource_attributes["megatron.num_layers"] == 2
        bridges = [h for h in logging.getLogger().handlers if isinstance(h, tel.logging_bridge.OtelLogHandler)]
        assert len(bridges) == 1
    finally:
        handle.shutdown(timeout_ms=2000)
    assert not [h for h in logging.getLogger().handlers if isinstance(h, tel.logging_bridge.OtelLogHandler)]
