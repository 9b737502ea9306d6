"""The PyTorch floor: pyproject's pin, and the one-line refusal of an older torch (version or missing feature)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron import torch_requirement

REPO = Path(__file__).resolve().parents[1]


def test_installed_torch_passes():
    assert torch_requirement.missing_torch_features(torch) == []
    assert torch_requirement.torch_requirement_error(torch) == ""


@pytest.mark.parametrize("version", ["2.5.1", "2.4.0+cu121", "1.13.1"])
def test_older_version_is_refused_in_one_line(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(SystemExit) as raised:
        torch_requirement.require_torch()
    message = str(raised.value.code)
    assert message == (f"error: megatron-otel needs PyTorch >= 2.6, found torch {version}; "
                       "install torch>=2.6 (see pyproject.toml)")


@pytest.mark.parametrize("version", ["2.6.0a0+ecf3bae40a", "2.6.0", "2.13.0+cpu", "3.0"])
def test_new_enough_versions_pass_including_prereleases(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    torch_requirement.require_torch()


def test_missing_feature_is_refused_even_at_a_new_version(monkeypatch):
    import torch.nn.attention

    def sdpa_kernel_of_torch_2_5(backends):  # the signature before set_priority existed
        raise AssertionError("not called")

    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", sdpa_kernel_of_torch_2_5)
    message = torch_requirement.torch_requirement_error(torch)
    assert "lacks torch.nn.attention.sdpa_kernel(set_priority=...)" in message and "\n" not in message
    monkeypatch.delattr(torch.serialization, "safe_globals")
    assert "torch.serialization.safe_globals" in torch_requirement.torch_requirement_error(torch)


def test_importing_megatron_with_an_old_torch_prints_one_line_and_exits_1():
    code = "import torch; torch.__version__ = '2.5.1'; import megatron.core.parallel_state"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: megatron-otel needs PyTorch >= 2.6, found torch 2.5.1; install torch>=2.6 (see pyproject.toml)"]


def test_pyproject_states_the_floor():
    text = (REPO / "pyproject.toml").read_text()
    floor = ".".join(map(str, torch_requirement.MINIMUM_TORCH))
    assert re.search(r'"torch>=([0-9.]+)"', text).group(1) == floor
