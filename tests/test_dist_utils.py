"""The multi-process test harness itself: ranks run, communicate and report failures."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_all_reduce_over_two_ranks():
    assert run_distributed(_sum_ranks, 2) == [1.0, 1.0]


def test_child_error_is_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail_on_rank1, 2, timeout=60)
