"""Span groups: the group list, every preset, aliases and every spec form."""
import pytest

from megatron.core.telemetry import MegatronSpanGroup, SpanGroup

BASE = {"job", "checkpoint", "evaluate", "model_init", "load_checkpoint", "step", "forward_backward", "optimizer"}
OWN = {"microbatch", "layer", "communication", "activation_offload", "data_loading", "first_iteration",
       "trace_region", "inference"}
DEFAULT = {"job", "checkpoint", "evaluate", "first_iteration", "inference"}
PER_STEP = DEFAULT | {"model_init", "load_checkpoint", "step", "forward_backward", "optimizer", "communication",
                      "data_loading"}


def test_groups():
    assert SpanGroup.groups() == BASE
    assert MegatronSpanGroup.groups() == BASE | OWN
    assert MegatronSpanGroup.STEP == "step" and MegatronSpanGroup.MICROBATCH == "microbatch"


@pytest.mark.parametrize("spec,expected", [
    ("default", DEFAULT), ("per_step", PER_STEP), ("all", BASE | OWN), ("full", BASE | OWN),
    ("profiling", BASE | OWN), ("", set()), ("  ,  ", set()), ("microbatch", {"microbatch"}),
    ("default,microbatch", DEFAULT | {"microbatch"}), (" DEFAULT , Layer ,layer", DEFAULT | {"layer"}),
    ("step,optimizer", {"step", "optimizer"}), ("per_step,all", BASE | OWN),
])
def test_megatron_spec_forms(spec, expected):
    assert MegatronSpanGroup.resolve(spec) == frozenset(expected)


def test_base_presets():
    presets = SpanGroup.presets()
    assert presets["default"] == {"job", "checkpoint", "evaluate"}
    assert presets["per_step"] == BASE and presets["all"] == presets["full"] == presets["profiling"] == BASE


def test_unknown_names_fail_with_choices():
    with pytest.raises(ValueError) as err:
        SpanGroup.resolve("default,microbatch", source="NEMO_LENS_SPAN_GROUPS")
    msg = str(err.value)
    assert msg.startswith("NEMO_LENS_SPAN_GROUPS: Unknown span group or preset: 'microbatch'")
    assert "Valid options: all, default, full, per_step, profiling, checkpoint, evaluate" in msg
    with pytest.raises(ValueError, match="expected a comma-separated string"):
        MegatronSpanGroup.resolve(["step"])
    assert MegatronSpanGroup.resolve(None) == frozenset()
