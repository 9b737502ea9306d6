"""Tests for tools/merge_datasets.py: sorted-order round trip, dtype check and folder errors."""
import importlib.util
import sys
from pathlib import Path

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


merge = _load_tool("merge_datasets")


def _write(prefix, documents, dtype=numpy.uint16):
    """documents: list of documents, each a list of sequences."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        flat = [token for sequence in sequences for token in sequence]
        builder.add_document(flat, [len(sequence) for sequence in sequences])
    builder.finalize(f"{prefix}.idx")


def _documents(prefix):
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[dataset[i].tolist() for i in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


PARTS = {
    "b": [[[5, 6, 7]], [[8], [9, 10]]],
    "a": [[[1, 2]], []],
    "c": [[[11]]],
}


def test_round_trip_in_sorted_order(tmp_path):
    source = tmp_path / "parts"
    source.mkdir()
    for name, documents in PARTS.items():
        _write(source / name, documents)
    (source / "notes.txt").write_text("ignored")
    assert merge.main(["--input", str(source), "--output-prefix", str(tmp_path / "merged")]) == 0
    expected = PARTS["a"] + PARTS["b"] + PARTS["c"]
    assert _documents(tmp_path / "merged") == expected
    # Reference: the same documents written directly by the builder give the same bytes.
    _write(tmp_path / "direct", expected)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"direct.{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct.bin", "direct.idx", "merged.bin", "merged.idx", "parts"]


def test_dtype_mismatch_is_a_clear_error(tmp_path, capsys):
    source = tmp_path / "parts"
    source.mkdir()
    _write(source / "a", PARTS["a"], dtype=numpy.uint16)
    _write(source / "b", PARTS["b"], dtype=numpy.int32)
    assert merge.main(["--input", str(source), "--output-prefix", str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err
    assert str(source / "b") in err and "int32" in err and "uint16" in err
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]


def test_folder_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert merge.main(["--input", str(empty), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "no .bin/.idx pair" in capsys.readouterr().err
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    _write(lonely / "a", PARTS["a"])
    (lonely / "a.idx").unlink()
    assert merge.main(["--input", str(lonely), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "a.idx is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        merge.main(["--input", str(tmp_path / "absent"), "--output-prefix", str(tmp_path / "m")])
    with pytest.raises(SystemExit):
        merge.main(["--input", str(empty), "--output-prefix", str(tmp_path / "no" / "m")])
