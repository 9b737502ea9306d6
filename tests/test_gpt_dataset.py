"""GPTDataset: split parsing, index arrays against a sequential reference, sample fields, cache, mock data."""
import hashlib
import json
import os
from collections import OrderedDict

import numpy
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
    build_sample_index,
    get_ltor_masks_and_position_ids,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    get_blend_from_list,
    parse_and_normalize_split,
)

EOD = 0


class _Tokenizer:
    """Stand-in with the tokenizer attributes datasets use."""

    def __init__(self, eod=EOD, pad=-1, vocab_size=64):
        self.eod, self.pad, self.vocab_size = eod, pad, vocab_size
        self.unique_identifiers = OrderedDict([("class", "StandIn"), ("vocab_size", vocab_size)])


def _write(prefix, sequences, dtype=numpy.uint16):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for seq in sequences:
        builder.add_item(seq)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def _random_sequences(rng, n, max_len=12, vocab=50):
    """Sequences of random tokens in [1, vocab) ending with EOD."""
    return [list(rng.integers(1, vocab, size=int(rng.integers(0, max_len)))) + [EOD] for _ in range(n)]


def _config(**overrides):
    options = dict(random_seed=1234, sequence_length=8, split="1,0,0", tokenizer=_Tokenizer())
    options.update(overrides)
    if "blend" not in options and not options.get("mock"):
        options["blend"] = (["unused"], None)
    return GPTDatasetConfig(**options)


# ---------------------------------------------------------------- reference computations (plain loops)


def _reference_sample_index(lengths, document_index, S, E, T, drop_last=True, X=1):
    """Sequential walk over document_index, S+X tokens per sample, next sample starts at the last X token."""
    if drop_last:
        num = (E * T - X) // S
    else:
        num = int(numpy.ceil(numpy.float32(E * T - X) / numpy.float32(S)))
    rows = [(0, 0)]
    d, off = 0, 0
    while len(rows) <= num:
        remaining = S + X
        while remaining != 0:
            length = int(lengths[document_index[d]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - X
                remaining = 0
            else:
                if d == len(document_index) - 1:
                    off = int(lengths[document_index[d]]) - X
                    break
                d += 1
                off = 0
        rows.append((d, off))
    return numpy.array(rows, dtype=numpy.int64)


def _reference_indices(lengths, split_ids, num_samples, S, seed, X=1):
    """The three index arrays exactly as the spec (§2.3) describes them, step by step."""
    T = int(sum(int(lengths[i]) for i in split_ids))
    E = 1
    if num_samples is not None:
        while E * T < num_samples * S + X:
            E += 1
    separate = False
    if E > 1:
        sans = ((E - 1) * T - X) // S
        per_epoch = (T - X) // S
        separate = (num_samples - sans) < int(0.80 * per_epoch)
    rng = numpy.random.RandomState(seed)

    def shuffled_epochs(count):
        arr = numpy.array([i for _ in range(count) for i in split_ids], dtype=numpy.int32)
        rng.shuffle(arr)
        return arr

    doc = numpy.concatenate([shuffled_epochs(E - 1), shuffled_epochs(1)]) if separate else shuffled_epochs(E)
    sample = _reference_sample_index(lengths, doc, S, E, T, True, X)
    num_built = len(sample) - 1
    if separate:
        first = numpy.arange(sans, dtype=numpy.uint32)
        rng.shuffle(first)
        last = numpy.arange(sans, num_built, dtype=numpy.uint32)
        rng.shuffle(last)
        shuffle = numpy.concatenate([first, last])
    else:
        shuffle = numpy.arange(num_built, dtype=numpy.uint32)
        rng.shuffle(shuffle)
    return doc, sample, shuffle, E, separate


def _reference_masks(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's per-EOD loop semantics, written out with Python loops."""
    S = len(tokens)
    allowed = [[k <= q for k in range(S)] for q in range(S)]
    loss = [1.0] * S
    positions = list(range(S))
    prev = 0
    for i in range(S):
        if tokens[i] == eod:
            if eod_mask_loss:
                loss[i] = 0.0
            if reset_attention_mask:
                for q in range(i + 1, S):
                    for k in range(i + 1):
                        allowed[q][k] = False
            if reset_position_ids:
                for p in range(i + 1, S):
                    positions[p] -= i + 1 - prev
                prev = i + 1
    mask = ~torch.tensor(allowed).unsqueeze(0)
    return mask, torch.tensor(loss), torch.tensor(positions)


# ---------------------------------------------------------------- split and blend parsing


def test_parse_and_normalize_split():
    assert parse_and_normalize_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at most 3"):
        parse_and_normalize_split("1,1,1,1")
    with pytest.raises(ValueError, match="not all be zero"):
        parse_and_normalize_split("0,0,0")


def test_split_matrix_bookends():
    assert convert_split_vector_to_split_matrix([0.99, 0.01, 0.0]) == [(0, 0.99), (0.99, 1.0), None]
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split("1,1,1"))
    assert matrix[0] == (0, pytest.approx(1 / 3)) and matrix[2][1] == pytest.approx(1.0)


def test_get_blend_from_list_forms():
    assert get_blend_from_list(None) is None
    assert get_blend_from_list(["a"]) == (["a"], None)
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["a", "b", "c"]) == (["a", "b", "c"], None)
    with pytest.raises(ValueError, match="not a number"):
        get_blend_from_list(["0.3", "a", "b", "c"])


def test_config_validation():
    tok = _Tokenizer()
    with pytest.raises(ValueError, match="--split must be provided"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=(["a"], None), tokenizer=tok)
    with pytest.raises(ValueError, match="--split cannot be used"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend_per_split=[(["a"], None), None, None],
                         split="1,0,0", tokenizer=tok)
    with pytest.raises(ValueError, match="incompatible"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=(["a"], None),
                         blend_per_split=[(["a"], None), None, None], tokenizer=tok)
    with pytest.raises(ValueError, match="equal in number"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=(["a", "b"], [1.0]), split="1", tokenizer=tok)
    with pytest.raises(ValueError, match="--seq-length"):
        GPTDatasetConfig(random_seed=1, sequence_length=0, tokenizer=tok)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        GPTDatasetConfig(random_seed=1, sequence_length=4, blend=(["a"], None), split="1")
    mock = GPTDatasetConfig(random_seed=1, sequence_length=4, tokenizer=tok)
    assert mock.mock and mock.split == "1,1,1" and len(mock.split_matrix) == 3


# ---------------------------------------------------------------- index arrays


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop_last", [True, False])
def test_vectorised_sample_index_matches_sequential_walk(extra, drop_last):
    rng = numpy.random.default_rng(7)
    for trial in range(30):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(0 if trial % 2 else 1, 20, size=n).astype(numpy.int32)
        if lengths.sum() < 2:
            lengths[0] = 5
        T = int(lengths.sum())
        S = int(rng.integers(2, 3 * max(T // n, 2) + 2))
        E = int(rng.integers(1, 5))
        document_index = numpy.tile(numpy.arange(n, dtype=numpy.int32), E)
        rng.shuffle(document_index)
        expected = _reference_sample_index(lengths, document_index, S, E, T, drop_last, extra)
        got = build_sample_index(lengths, document_index, S, E, T, drop_last, bool(extra))
        assert got.dtype == numpy.int32
        numpy.testing.assert_array_equal(got, expected, err_msg=f"trial {trial}: S={S} E={E} lengths={lengths}")


@pytest.mark.parametrize(
    "num_samples, expect_epochs, expect_separate",
    [(None, 1, False), (5, 1, False), (78, 3, False), (85, 4, True)],
)
def test_indices_match_reference(tmp_path, num_samples, expect_epochs, expect_separate):
    rng = numpy.random.default_rng(0)
    prefix = _write(str(tmp_path / "data"), _random_sequences(rng, 40))
    low = IndexedDataset(prefix)
    split_ids = numpy.arange(3, 37, dtype=numpy.int32)
    config = _config(blend=([prefix], None), path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(low, prefix, split_ids, num_samples, Split.train, config)

    doc, sample, shuffle, E, separate = _reference_indices(low.sequence_lengths, split_ids, num_samples, 8, 1234)
    assert (E, separate) == (expect_epochs, expect_separate)
    numpy.testing.assert_array_equal(ds.document_index, doc)
    numpy.testing.assert_array_equal(ds.sample_index, sample)
    numpy.testing.assert_array_equal(ds.shuffle_index, shuffle)
    assert ds.document_index.dtype == numpy.int32 and ds.shuffle_index.dtype == numpy.uint32
    assert len(ds) == len(sample) - 1 >= (num_samples or 0)


def test_separate_last_epoch_keeps_final_samples_apart(tmp_path):
    # One sequence of 64 tokens, S=10, 20 samples: E=4, 19 samples before the last epoch, 25 built.
    prefix = _write(str(tmp_path / "one"), [list(range(1, 64)) + [EOD]])
    config = _config(blend=([prefix], None), sequence_length=10, path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(IndexedDataset(prefix), prefix, numpy.arange(1, dtype=numpy.int32), 20, Split.train, config)
    assert len(ds) == 25
    assert sorted(ds.shuffle_index[:19].tolist()) == list(range(19))
    assert sorted(ds.shuffle_index[19:].tolist()) == list(range(19, 25))


def _stream(low, document_index):
    return numpy.concatenate([low[int(i)] for i in document_index]).astype(numpy.int64)


def test_samples_are_overlapping_windows_of_the_stream(tmp_path):
    rng = numpy.random.default_rng(3)
    prefix = _write(str(tmp_path / "data"), _random_sequences(rng, 30))
    low = IndexedDataset(prefix)
    config = _config(blend=([prefix], None), path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(low, prefix, numpy.arange(30, dtype=numpy.int32), 25, Split.train, config)
    stream = _stream(low, ds.document_index)
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        window = torch.from_numpy(stream[j * 8: j * 8 + 9])
        item = ds[i]
        assert torch.equal(item["tokens"], window[:-1]) and torch.equal(item["labels"], window[1:])
        assert item["tokens"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
        assert item["attention_mask"].shape == (1, 8, 8) and item["attention_mask"].dtype == torch.bool
        assert torch.equal(item["position_ids"], torch.arange(8))
        assert torch.equal(item["loss_mask"], torch.ones(8))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_partial_validation_sequence_is_padded(tmp_path):
    prefix = _write(str(tmp_path / "data"), [[5, 6, 7, 8, 9, 10, EOD], [11, 12, 13, EOD]])  # 11 tokens
    low = IndexedDataset(prefix)
    config = _config(blend=([prefix], None), sequence_length=4, drop_last_partial_validation_sequence=False,
                     split="0,1,0", path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(low, prefix, numpy.arange(2, dtype=numpy.int32), None, Split.valid, config)
    assert len(ds) == 3  # ceil((11 - 1) / 4); the floor would give 2
    stream = _stream(low, ds.document_index)
    last = ds[int(numpy.where(ds.shuffle_index == 2)[0][0])]
    # Sample 2 starts at token 8 and has only 3 real tokens; the rest is pad (-1) turned into 0.
    assert last["tokens"].tolist() == stream[8:11].tolist() + [0]
    assert last["labels"].tolist() == stream[9:11].tolist() + [0, 0]
    assert last["loss_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    first = ds[int(numpy.where(ds.shuffle_index == 0)[0][0])]
    assert first["loss_mask"].tolist() == [1.0] * 4  # the cached mask was not polluted by padding
    assert ds[None]["loss_mask"].sum() == 0


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_masks_match_reference(reset_position_ids, reset_attention_mask, eod_mask_loss):
    rng = numpy.random.default_rng(11)
    for _ in range(5):
        tokens = torch.from_numpy(rng.integers(0, 4, size=16)).long()  # EOD=0 appears often
        mask, loss, pos = get_ltor_masks_and_position_ids(
            tokens, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss, True
        )
        ref_mask, ref_loss, ref_pos = _reference_masks(
            tokens.tolist(), EOD, reset_position_ids, reset_attention_mask, eod_mask_loss
        )
        assert torch.equal(mask, ref_mask) and torch.equal(loss, ref_loss) and torch.equal(pos, ref_pos)
    assert get_ltor_masks_and_position_ids(tokens, EOD, False, False, False, False)[0] is None


def test_flags_reach_samples(tmp_path):
    prefix = _write(str(tmp_path / "data"), [[3, 4, EOD], [5, 6, 7, 8, EOD], [9, EOD]] * 4)
    low = IndexedDataset(prefix)
    config = _config(blend=([prefix], None), reset_position_ids=True, reset_attention_mask=True,
                     eod_mask_loss=True, create_attention_mask=False, path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(low, prefix, numpy.arange(12, dtype=numpy.int32), 4, Split.train, config)
    for i in range(len(ds)):
        item = ds[i]
        assert "attention_mask" not in item
        _, ref_loss, ref_pos = _reference_masks(item["tokens"].tolist(), EOD, True, True, True)
        assert torch.equal(item["loss_mask"], ref_loss) and torch.equal(item["position_ids"], ref_pos)
    assert not ds.masks_and_position_ids_are_cached


def test_pad_id_from_tokenizer(tmp_path):
    prefix = _write(str(tmp_path / "data"), [[5, 6, EOD]])
    low = IndexedDataset(prefix)
    ds = GPTDataset(low, prefix, numpy.arange(1, dtype=numpy.int32), None, Split.train,
                    _config(blend=([prefix], None), sequence_length=2, tokenizer=_Tokenizer(pad=63),
                            path_to_cache=str(tmp_path / "c1")))
    assert ds._pad_token_id == 63
    ds = GPTDataset(low, prefix, numpy.arange(1, dtype=numpy.int32), None, Split.train,
                    _config(blend=([prefix], None), sequence_length=2, tokenizer=_Tokenizer(pad=EOD),
                            path_to_cache=str(tmp_path / "c2")))
    assert ds._pad_token_id == -1  # a pad equal to EOD would mask real EOD labels


# ---------------------------------------------------------------- cache


def test_cache_files_description_and_hit(tmp_path):
    rng = numpy.random.default_rng(5)
    prefix = _write(str(tmp_path / "data"), _random_sequences(rng, 20))
    low = IndexedDataset(prefix)
    config = _config(blend=([prefix], None), split="90,10,0")
    ds = GPTDataset(low, prefix, numpy.arange(18, dtype=numpy.int32), 10, Split.train, config)
    cache_dir = os.path.join(prefix, "cache", "GPTDataset_indices")
    md5 = ds.unique_description_hash
    names = sorted(os.listdir(cache_dir))
    assert names == sorted(f"{md5}-GPTDataset-train-{n}" for n in
                           ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"))
    with open(os.path.join(cache_dir, f"{md5}-GPTDataset-train-description.txt")) as f:
        text = f.read()
    assert hashlib.md5(text.encode()).hexdigest() == md5
    assert list(json.loads(text)) == ["class", "dataset_path", "num_samples", "index_split", "random_seed",
                                      "sequence_length", "split", "split_matrix", "tokenizer"]
    assert json.loads(text)["tokenizer"] == {"class": "StandIn", "vocab_size": 64}
    assert ds.built_anew_on_cache_miss

    mtimes = {n: os.stat(os.path.join(cache_dir, n)).st_mtime_ns for n in names}
    again = GPTDataset(low, prefix, numpy.arange(18, dtype=numpy.int32), 10, Split.train, config)
    assert not again.built_anew_on_cache_miss
    assert mtimes == {n: os.stat(os.path.join(cache_dir, n)).st_mtime_ns for n in names}
    for name in ("document_index", "sample_index", "shuffle_index"):
        numpy.testing.assert_array_equal(getattr(again, name), getattr(ds, name))
    assert again[3]["tokens"].tolist() == ds[3]["tokens"].tolist()

    # Anything that shapes the indices changes the hash, so the cache is rebuilt.
    for changed in (_config(blend=([prefix], None), split="90,10,0", random_seed=1),
                    _config(blend=([prefix], None), split="90,10,0", sequence_length=4),
                    _config(blend=([prefix], None), split="80,20,0"),
                    _config(blend=([prefix], None), split="90,10,0", tokenizer=_Tokenizer(vocab_size=65)),
                    _config(blend=([prefix], None), split="90,10,0", add_extra_token_to_sequence=False)):
        other = GPTDataset(low, prefix, numpy.arange(18, dtype=numpy.int32), 10, Split.train, changed)
        assert other.built_anew_on_cache_miss and other.unique_description_hash != md5
    other = GPTDataset(low, prefix, numpy.arange(18, dtype=numpy.int32), 11, Split.train, config)
    assert other.built_anew_on_cache_miss


def test_data_cache_path_overrides_location(tmp_path):
    prefix = _write(str(tmp_path / "data"), [[1, 2, 3, EOD]] * 5)
    config = _config(blend=([prefix], None), path_to_cache=str(tmp_path / "elsewhere"))
    GPTDataset(IndexedDataset(prefix), prefix, numpy.arange(5, dtype=numpy.int32), 2, Split.train, config)
    assert len(os.listdir(tmp_path / "elsewhere")) == 4
    assert not os.path.exists(os.path.join(prefix, "cache"))
    assert not [n for n in os.listdir(tmp_path / "elsewhere") if ".tmp" in n]


# ---------------------------------------------------------------- builder errors, mock and real data


def test_missing_prefix_and_empty_split_errors(tmp_path):
    config = _config(blend=([str(tmp_path / "nothing")], None), split="1,0,0")
    with pytest.raises(FileNotFoundError, match="nothing"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 0], lambda: True, config).build()

    prefix = _write(str(tmp_path / "tiny"), [[1, 2, EOD]] * 10)
    config = _config(blend=([prefix], None), split="99,1,0", path_to_cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="valid split .* is empty"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, 2, 0], lambda: True, config).build()
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 5], lambda: True, config).build()
    assert len(train) >= 4 and valid is None and test is None  # size 0 and zero-width splits are not built


def test_mock_dataset(tmp_path):
    tok = _Tokenizer(eod=99, vocab_size=100)
    low = MockGPTLowLevelDataset(tok)
    expected_lengths = numpy.random.default_rng(0).integers(1, 4096, size=100000, dtype=numpy.int32)
    numpy.testing.assert_array_equal(low.sequence_lengths, expected_lengths)
    seq = low[1]
    n = int(expected_lengths[1])
    assert seq.tolist() == [k % 100 for k in range(1, n)] + [99]
    assert low.get(1, offset=2, length=3).tolist() == seq[2:5].tolist()

    config = GPTDatasetConfig(random_seed=1234, sequence_length=16, tokenizer=tok)
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [8, 4, 0], lambda: True, config).build()
    assert isinstance(train, MockGPTDataset) and test is None
    assert len(train.indices) == 33333 and int(valid.indices[0]) == 33333
    stream = numpy.concatenate([low[int(i)] for i in train.document_index[:64]])
    for i in numpy.where(train.shuffle_index < 50)[0]:  # early samples: the stream prefix above covers them
        j = int(train.shuffle_index[i])
        assert train[int(i)]["labels"].tolist() == stream[j * 16 + 1: j * 16 + 17].tolist()
    assert not os.path.exists(tmp_path / "cache")


def test_golden_dataset_windows(shared_data, tmp_path):
    prefix = str(shared_data / "golden" / "shakes_text_document")
    tok = _Tokenizer(eod=50256, vocab_size=50257)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=64, blend=([prefix], None), split="969, 30, 1",
                              tokenizer=tok, path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [32, 8, 4], lambda: True, config).build()
    assert (len(train.indices), len(valid.indices), len(test.indices)) == (6998, 217, 7)
    for ds in (train, valid):
        stream = _stream(ds.dataset, ds.document_index)
        for i in (0, 1, len(ds) - 1):
            j = int(ds.shuffle_index[i])
            assert ds[i]["tokens"].tolist() == stream[j * 64: j * 64 + 64].tolist()
            assert ds[i]["labels"].tolist() == stream[j * 64 + 1: j * 64 + 65].tolist()
    names = os.listdir(tmp_path / "cache")
    assert len(names) == 12 and {n.split("-")[2] for n in names} == {"train", "valid", "test"}
