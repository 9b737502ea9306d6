"""Start-up helpers: the rendezvous host and port taken from SLURM variables."""
import os

import pytest

from megatron.training.initialize import _set_rendezvous_env_from_slurm, first_slurm_host


@pytest.mark.parametrize("nodelist, host", [
    ("gpu001", "gpu001"),
    ("gpu[003-005,009]", "gpu003"),
    ("gpu[010,012],cpu1", "gpu010"),
    ("a-node-7,b-node-1", "a-node-7"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_empty_nodelist_is_refused():
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        first_slurm_host("  ")


def test_rendezvous_from_slurm_variables(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NODELIST", "node[17-18]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    _set_rendezvous_env_from_slurm()
    import os

    assert os.environ["MASTER_ADDR"] == "node17"
    assert os.environ["MASTER_PORT"] == str(10000 + 123456 % 50000)


def test_cuda_device_max_connections_set_for_tp_and_user_value_kept(monkeypatch):
    from megatron.training.initialize import _set_cuda_device_max_connections

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    _set_cuda_device_max_connections(1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    _set_cuda_device_max_connections(2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    _set_cuda_device_max_connections(2)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
