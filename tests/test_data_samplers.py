"""Samplers and the pretraining DataLoader: DP layout, exact resume, and no use of the global torch RNG."""
import argparse
import itertools

import pytest
import torch

import megatron.training.global_vars as global_vars
from megatron.training.config import DataConfig, RNGConfig, TrainingConfig, ValidationConfig
from megatron.core.datasets.utils import Split
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    build_pretraining_data_loader_from,
)


class _Samples(torch.utils.data.Dataset):
    """Sample i is {"tokens": [i, i]}; consumes no randomness."""

    def __init__(self, n, split=Split.train):
        self.n, self.split = n, split

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i])}


def test_sequential_sampler_layout_and_drop_last():
    mbs, dp, total = 2, 3, 20
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    # Each global step of mbs*dp consecutive indices is dealt out in rank order; the partial tail (18, 19) is dropped.
    steps = [sum((per_rank[r][s] for r in range(dp)), []) for s in range(len(per_rank[0]))]
    assert steps == [list(range(k * 6, k * 6 + 6)) for k in range(3)]
    tail = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp, drop_last=False))[-1] for r in range(dp)]
    assert tail[0] == [18, 19] and tail[1] == [14, 15]  # rank 1 has nothing in the partial tail


def test_sequential_sampler_resume_is_exact():
    mbs, dp = 3, 2
    for rank in range(dp):
        full = list(MegatronPretrainingSampler(50, 0, mbs, rank, dp))
        for steps_done in (1, 4):
            resumed = list(MegatronPretrainingSampler(50, steps_done * mbs * dp, mbs, rank, dp))
            assert resumed == full[steps_done:]


def test_sampler_errors():
    with pytest.raises(ValueError, match="no sample to consume"):
        MegatronPretrainingSampler(0, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        next(iter(MegatronPretrainingRandomSampler(None, 20, 3, 2, 0, 2)))


@pytest.mark.parametrize("data_sharding", [True, False])
def test_random_sampler_epochs_and_resume(data_sharding):
    total, mbs, dp = 22, 2, 2  # 2 trailing samples are never used
    samplers = [MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, data_sharding) for r in range(dp)]
    epoch0 = [list(s) for s in samplers]
    seen = sorted(i for batches in epoch0 for b in batches for i in b)
    assert len(seen) == 20 and len(set(seen)) == 20 and all(0 <= i < total for i in seen)
    epoch1 = [list(s) for s in samplers]  # iterating again is the next (differently shuffled) epoch
    assert epoch1 != epoch0 and samplers[0].epoch == 1
    # A sampler resumed mid-epoch-1 yields exactly the rest of that epoch.
    for r in range(dp):
        resumed = MegatronPretrainingRandomSampler(None, total, 20 + 2 * mbs * dp, mbs, r, dp, data_sharding)
        assert list(resumed) == epoch1[r][2:]


def _config(dataloader_type="single", micro_batch_size=2, num_workers=0, seed=1234, data_sharding=True,
            full_validation=False):
    """The slices of the run's configuration that build_pretraining_data_loader reads."""
    return argparse.Namespace(
        data=DataConfig(dataloader_type=dataloader_type, num_workers=num_workers, data_sharding=data_sharding),
        train=TrainingConfig(micro_batch_size=micro_batch_size), rng=RNGConfig(seed=seed),
        validation=ValidationConfig(full_validation=full_validation))


@pytest.fixture
def installed_args():
    previous = global_vars._GLOBAL_ARGS
    yield lambda **kw: global_vars.set_config(_config(**kw))
    global_vars.set_args(previous)


def test_loader_from_args_batches_and_resume(installed_args):
    installed_args()
    data = _Samples(12)
    batches = [b["tokens"][:, 0].tolist() for b in build_pretraining_data_loader(data, 0)]
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    resumed = [b["tokens"][:, 0].tolist() for b in build_pretraining_data_loader(data, 6)]
    assert resumed == batches[3:]
    assert build_pretraining_data_loader(None, 0) is None


def test_loader_types(installed_args):
    data = _Samples(12)
    installed_args(dataloader_type="external")
    assert build_pretraining_data_loader(data, 0) is data
    installed_args(dataloader_type="bogus")
    with pytest.raises(ValueError, match="--dataloader-type 'bogus'"):
        build_pretraining_data_loader(data, 0)
    installed_args(full_validation=True)
    valid = _Samples(6, split=Split.valid)
    assert len(list(build_pretraining_data_loader(valid, 4))) == 3  # full validation restarts at 0
    installed_args(dataloader_type="cyclic")
    loader = build_pretraining_data_loader(data, 0)
    first, second = [[b["tokens"][:, 0].tolist() for b in loader] for _ in range(2)]
    assert sorted(sum(first, [])) == list(range(12)) and first != second


@pytest.mark.parametrize("dataloader_type", ["single", "cyclic"])
def test_loader_leaves_global_rng_untouched(dataloader_type):
    torch.manual_seed(99)
    state = torch.get_rng_state()
    loader = build_pretraining_data_loader_from(
        _Samples(16), 4, dataloader_type=dataloader_type, micro_batch_size=2, data_parallel_rank=0,
        data_parallel_size=2, num_workers=0, seed=1234,
    )
    list(itertools.islice(iter(loader), 2))
    list(loader)
    assert torch.equal(torch.get_rng_state(), state)
    assert loader.generator is not None and loader.pin_memory == torch.cuda.is_available()


def test_loader_with_workers_matches_in_process_loader():
    common = dict(dataloader_type="single", micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2, seed=7)
    in_process = build_pretraining_data_loader_from(_Samples(12), 4, num_workers=0, **common)
    with_worker = build_pretraining_data_loader_from(_Samples(12), 4, num_workers=1, **common)
    assert with_worker.persistent_workers and not in_process.persistent_workers
    expected = [b["tokens"].tolist() for b in in_process]
    assert expected == [[[6, 6], [7, 7]], [[10, 10], [11, 11]]]
    assert [b["tokens"].tolist() for b in with_worker] == expected
