"""IndexedDataset reader/builder: the golden Megatron files read back and rewrite byte-identically."""
import filecmp
import struct

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import (
    DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path,
)


def _write(prefix, docs, dtype=numpy.uint16):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))


def test_golden_gpt2_dataset_facts(shared_data):
    ds = IndexedDataset(str(shared_data / "golden" / "shakes_text_document"))
    assert ds.dtype == numpy.uint16
    assert len(ds) == 7222 and len(ds.document_indices) == 7223
    assert int(ds.sequence_lengths.sum()) == 330804  # 323,582 tokens + one EOD per document
    assert all(int(ds[i][-1]) == 50256 for i in (0, 1, 7221))


def test_golden_rewrites_byte_identically(shared_data, tmp_path):
    source = str(shared_data / "golden" / "shakes_sp_text_document")
    ds = IndexedDataset(source)
    out = str(tmp_path / "copy")
    builder = IndexedDatasetBuilder(get_bin_path(out), dtype=ds.dtype)
    for d in range(len(ds.document_indices) - 1):
        for s in range(ds.document_indices[d], ds.document_indices[d + 1]):
            builder.add_item(ds[s])
        builder.end_document()
    builder.finalize(get_idx_path(out))
    assert filecmp.cmp(get_bin_path(out), get_bin_path(source), shallow=False)
    assert filecmp.cmp(get_idx_path(out), get_idx_path(source), shallow=False)


def test_add_documents_in_bulk_equals_one_at_a_time(shared_data, tmp_path):
    """The golden file rewritten in two bulk calls (documents with several, one and no sequences) is byte-identical."""
    source = str(shared_data / "golden" / "shakes_sp_text_document")
    ds = IndexedDataset(source)
    out = str(tmp_path / "bulk")
    builder = IndexedDatasetBuilder(get_bin_path(out), dtype=ds.dtype)
    bounds = ds.document_indices
    for first, last in ((0, 100), (100, len(bounds) - 1)):
        sequences = range(bounds[first], bounds[last])
        builder.add_documents(numpy.concatenate([ds[s] for s in sequences]),
                              [int(ds.sequence_lengths[s]) for s in sequences], numpy.diff(bounds[first:last + 1]))
    builder.add_documents(numpy.zeros(0, numpy.int64), [], [0])  # an empty document
    builder.finalize(get_idx_path(out))
    assert filecmp.cmp(get_bin_path(out), get_bin_path(source), shallow=False)
    reread = IndexedDataset(out)
    assert reread.document_indices.tolist() == bounds.tolist() + [bounds[-1]]
    with pytest.raises(ValueError, match="sequence lengths sum to 3 but 2 tokens"):
        builder = IndexedDatasetBuilder(str(tmp_path / "bad.bin"), dtype=numpy.uint16)
        builder.add_documents([1, 2], [1, 2], [2])
    with pytest.raises(ValueError, match="documents hold 1 sequences but 2 lengths"):
        builder.add_documents([1, 2], [1, 1], [1])


def test_two_document_example_sizes(tmp_path):
    prefix = str(tmp_path / "tiny")
    _write(prefix, [[[1, 2, 3, 4]], [[5, 6, 7]]])
    assert (tmp_path / "tiny.idx").stat().st_size == 82
    assert (tmp_path / "tiny.bin").stat().st_size == 14
    ds = IndexedDataset(prefix)
    assert ds[1].tolist() == [5, 6, 7]
    assert ds.get(0, offset=1, length=2).tolist() == [2, 3]
    assert ds.document_indices.tolist() == [0, 1, 2]
    with pytest.raises(IndexError):
        ds.get(0, offset=3, length=2)


def test_add_index_merges_with_offsets(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "m"))
    _write(a, [[[1, 2]], [[3], [4, 5]]])
    _write(b, [[[6]]])
    builder = IndexedDatasetBuilder(get_bin_path(merged), dtype=numpy.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(get_idx_path(merged))
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 1, 3, 4]
    _write(str(tmp_path / "c"), [[[7]]], dtype=numpy.int32)
    with pytest.raises(ValueError, match="int32"):
        builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.uint16)
        builder.add_index(str(tmp_path / "c"))


def test_corrupt_files_fail_with_the_file_name(tmp_path):
    prefix = str(tmp_path / "d")
    _write(prefix, [[[1, 2, 3]]])
    with open(get_bin_path(prefix), "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="d.bin does not match"):
        IndexedDataset(prefix)
    _write(prefix, [[[1, 2, 3]]])
    raw = bytearray(open(get_idx_path(prefix), "rb").read())
    raw[9:17] = struct.pack("<Q", 2)
    open(get_idx_path(prefix), "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="bad version"):
        IndexedDataset(prefix)
    open(get_idx_path(prefix), "wb").write(b"NOTANIDX" + bytes(raw[8:]))
    with pytest.raises(ValueError, match="bad header"):
        IndexedDataset(prefix)
    raw[9:17] = struct.pack("<Q", 1)
    open(get_idx_path(prefix), "wb").write(bytes(raw[:40]))
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        IndexedDataset(str(tmp_path / "missing"))


def test_optimal_dtype_threshold():
    assert DType.optimal_dtype(50257) == numpy.uint16
    assert DType.optimal_dtype(65500) == numpy.int32
    assert DType.optimal_dtype(None) == numpy.int32
