"""BlendedDataset and BlendedMegatronDatasetBuilder: greedy blending, per-prefix sizes, caching, ranks."""
import math
import os
from collections import OrderedDict

import numpy
import pytest
import torch

from dist_utils import run_distributed
from megatron.core.datasets.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    build_exhaustive_blending_indices,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.utils import Split, get_blend_from_list

EOD = 0


class _Tokenizer:
    """Stand-in with the tokenizer attributes datasets use."""

    eod, pad, vocab_size = EOD, -1, 64
    unique_identifiers = OrderedDict([("class", "StandIn")])


def _write(prefix, n_sequences, first_token):
    """n sequences of 5 tokens; every token of this prefix is ``first_token`` (identifies the prefix)."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for _ in range(n_sequences):
        builder.add_item([first_token] * 4 + [EOD])
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def _config(tmp_path, **overrides):
    options = dict(random_seed=1234, sequence_length=4, tokenizer=_Tokenizer(), path_to_cache=str(tmp_path / "cache"))
    options.update(overrides)
    return GPTDatasetConfig(**options)


def _reference_greedy(weights, size):
    """argmax_i (w_i * max(k, 1) - count_i), first index on ties, one numpy step per sample."""
    w = numpy.asarray(weights, dtype=numpy.float64)
    counts = numpy.zeros(len(w), dtype=numpy.int64)
    out_d, out_s = [], []
    for k in range(size):
        i = int(numpy.argmax(w * max(k, 1) - counts))
        out_d.append(i)
        out_s.append(int(counts[i]))
        counts[i] += 1
    return numpy.array(out_d), numpy.array(out_s)


def _reference_exhaustive(sizes):
    w = numpy.asarray(sizes, dtype=numpy.float64) / sum(sizes)
    counts = numpy.zeros(len(sizes), dtype=numpy.int64)
    out_d, out_s = [], []
    for k in range(sum(sizes)):
        error = numpy.where(counts < numpy.asarray(sizes), w * max(k, 1) - counts, -numpy.inf)
        i = int(numpy.argmax(error))
        out_d.append(i)
        out_s.append(int(counts[i]))
        counts[i] += 1
    return numpy.array(out_d), numpy.array(out_s)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3], [0.05, 0.95]])
def test_greedy_blending_matches_reference(weights):
    index, sample = build_blending_indices(weights, 500)
    ref_index, ref_sample = _reference_greedy(weights, 500)
    assert index.dtype == numpy.int16 and sample.dtype == numpy.int64
    numpy.testing.assert_array_equal(index, ref_index)
    numpy.testing.assert_array_equal(sample, ref_sample)


def test_exhaustive_blending_matches_reference():
    sizes = [13, 7, 29]
    index, sample = build_exhaustive_blending_indices(sizes)
    ref_index, ref_sample = _reference_exhaustive(sizes)
    numpy.testing.assert_array_equal(index, ref_index)
    numpy.testing.assert_array_equal(sample, ref_sample)
    assert numpy.bincount(index).tolist() == sizes


def test_weighted_blend_sizes_and_samples(tmp_path):
    a = _write(str(tmp_path / "a"), 40, 11)
    b = _write(str(tmp_path / "b"), 40, 22)
    prefixes, weights = get_blend_from_list(["3", a, "1", b])
    config = _config(tmp_path, blend=(prefixes, weights), split="90,10,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [50, 6, 0], lambda: True, config).build()
    assert isinstance(train, BlendedDataset) and test is None
    # Requested per prefix: ceil(ceil(size*w) * 1.005); blended size: sum(ceil(size*w)).
    assert [d.num_samples for d in train.datasets] == [math.ceil(math.ceil(50 * 0.75) * 1.005),
                                                     math.ceil(math.ceil(50 * 0.25) * 1.005)]
    assert len(train) == math.ceil(50 * 0.75) + math.ceil(50 * 0.25)
    assert len(valid) == math.ceil(6 * 0.75) + math.ceil(6 * 0.25)
    ref_index, ref_sample = _reference_greedy([0.75, 0.25], len(train))
    numpy.testing.assert_array_equal(train.dataset_index, ref_index)
    for i in range(len(train)):
        item = train[i]
        component = train.datasets[item["dataset_id"]][int(ref_sample[i])]
        assert torch.equal(item["tokens"], component["tokens"])
        assert set(item["tokens"].tolist()) <= {EOD, (11, 22)[item["dataset_id"]]}
    # Blended indices are cached only under --data-cache-path.
    names = os.listdir(tmp_path / "cache")
    assert sum(f"-BlendedDataset-train-{n}" in " ".join(names) for n in
               ("dataset_index.npy", "dataset_sample_index.npy", "description.txt")) == 3
    again = BlendedMegatronDatasetBuilder(GPTDataset, [50, 6, 0], lambda: True, config).build()[0]
    assert not again.built_anew_on_cache_miss
    numpy.testing.assert_array_equal(again.dataset_sample_index, train.dataset_sample_index)


def test_unweighted_blend_uses_dataset_lengths(tmp_path):
    a = _write(str(tmp_path / "a"), 30, 11)
    b = _write(str(tmp_path / "b"), 10, 22)
    config = _config(tmp_path, blend=get_blend_from_list([a, b]), split="1,0,0", path_to_cache=None)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, config).build()[0]
    lengths = [len(d) for d in train.datasets]
    assert train.weights == pytest.approx([w / sum(lengths) for w in lengths]) and len(train) == 10
    assert all(d.num_samples is None for d in train.datasets)
    full = BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], lambda: True, config).build()[0]
    assert len(full) == sum(lengths) and full.weights == lengths


def test_blend_per_split(tmp_path):
    a = _write(str(tmp_path / "a"), 20, 11)
    b = _write(str(tmp_path / "b"), 20, 22)
    c = _write(str(tmp_path / "c"), 20, 33)
    config = _config(tmp_path, blend_per_split=[get_blend_from_list(["1", a, "1", b]), get_blend_from_list([c]), None])
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [8, 4, 4], lambda: True, config).build()
    assert isinstance(train, BlendedDataset) and isinstance(valid, GPTDataset) and test is None
    assert valid.index_split == Split.valid and len(valid.indices) == 20  # the whole prefix
    assert set(valid[0]["tokens"].tolist()) <= {EOD, 33}
    assert {d.dataset_path for d in train.datasets} == {a, b}


def test_oversampling_raises_index_error(tmp_path):
    a = _write(str(tmp_path / "a"), 6, 11)
    b = _write(str(tmp_path / "b"), 6, 22)
    config = _config(tmp_path, blend=([a, b], None), split="1,0,0")
    small = [GPTDataset(IndexedDataset(p), p, numpy.arange(6, dtype=numpy.int32), 2, Split.train, config) for p in (a, b)]
    with pytest.raises(IndexError, match="blend oversamples the contributing datasets"):
        BlendedDataset(small, [0.5, 0.5], 100, config)


def test_weights_need_sizes(tmp_path):
    a = _write(str(tmp_path / "a"), 6, 11)
    config = _config(tmp_path, blend=([a, a], [0.5, 0.5]), split="1,0,0")
    with pytest.raises(ValueError, match="no requested size"):
        BlendedMegatronDatasetBuilder(GPTDataset, [None, 0, 0], lambda: True, config)


def _two_rank_build(rank, world_size, a, b, cache):
    config = GPTDatasetConfig(random_seed=1234, sequence_length=4, tokenizer=_Tokenizer(), path_to_cache=cache,
                              blend=([a, b], [0.5, 0.5]), split="1,0,0")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [20, 0, 0], lambda: True, config).build()[0]
    return (train.built_anew_on_cache_miss, [d.built_anew_on_cache_miss for d in train.datasets],
            numpy.asarray(train.dataset_index).tolist(), train[5]["tokens"].tolist())


def test_rank0_builds_other_ranks_load(tmp_path):
    a = _write(str(tmp_path / "a"), 20, 11)
    b = _write(str(tmp_path / "b"), 20, 22)
    rank0, rank1 = run_distributed(_two_rank_build, 2, a, b, str(tmp_path / "cache"))
    assert rank0[0] and all(rank0[1])
    assert not rank1[0] and not any(rank1[1])
    assert rank0[2:] == rank1[2:]
