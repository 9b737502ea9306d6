"""Hardening found by using the product (issue 9): silent no-ops and misleading reports in training refused or reported."""
import pytest

from megatron.training.arguments import parse_args, validate_args

VALID = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)


def test_context_parallelism_is_refused_until_it_exists(single_process, monkeypatch):
    """--context-parallel-size 2 used to be accepted and ignored (two ranks doing the same work)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--context-parallel-size 2: context parallelism is not available"):
        validate_args(parse_args(args=[*VALID, "--context-parallel-size", "2"]))
    assert validate_args(parse_args(args=[*VALID, "--context-parallel-size", "1"])).context_parallel_size == 1
