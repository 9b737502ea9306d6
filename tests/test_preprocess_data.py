"""Tests for tools/preprocess_data.py: golden byte identity, flags, partitions and the bad-input policy."""
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import GPT2BPETokenizer, MegatronTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pool workers unpickle functions by module name
    spec.loader.exec_module(module)
    return module


preprocess = _load_tool("preprocess_data")


@pytest.fixture(scope="module")
def gpt2_flags(shared_data):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(shared_data / "gpt2-vocab.json"),
            "--merge-file", str(shared_data / "gpt2-merges.txt")]


@pytest.fixture(scope="module")
def gpt2(shared_data):
    return GPT2BPETokenizer(str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt"))


@pytest.fixture(scope="module")
def shakespeare_lines(shared_data):
    return (shared_data / "tinyshakespeare.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


def _run(input_path, prefix, flags, *extra):
    return preprocess.main(["--input", str(input_path), "--output-prefix", str(prefix), *flags, *extra])


def _documents(prefix):
    """Reader view: list of documents, each a list of sequences (lists of ids)."""
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[dataset[i].tolist() for i in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


def _reference_documents(tokenizer, texts, append_eod=True):
    docs = []
    for text in texts:
        ids = tokenizer.tokenize(text)
        docs.append([ids + [tokenizer.eod]] if ids and append_eod else ([ids] if ids else []))
    return docs


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------ golden byte identity


@pytest.mark.parametrize("workers", [1, 2])
def test_golden_gpt2(shared_data, tmp_path, gpt2_flags, workers, monkeypatch):
    """On the tiktoken path (the default when tiktoken is installed; forced here so a fallback to the
    pure-Python BPE fails the test). tests/test_hf_tiktoken_tokenizers.py checks the two paths agree."""
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("MEGATRON_GPT2_BPE_BACKEND", "tiktoken")
    prefix = tmp_path / "shakes"
    assert _run(shared_data / "tinyshakespeare.jsonl", prefix, gpt2_flags, "--append-eod", "--workers", str(workers)) == 0
    for ext in ("bin", "idx"):
        golden = (shared_data / "golden" / f"shakes_text_document.{ext}").read_bytes()
        assert (tmp_path / f"shakes_text_document.{ext}").read_bytes() == golden
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shakes_text_document.bin", "shakes_text_document.idx"]


def test_golden_gpt2_partitions_keep_sequential(shared_data, tmp_path, gpt2_flags):
    """Contiguous partitions merged in order give the same bytes as one pass, and leave only the output."""
    out = tmp_path / "out"
    out.mkdir()
    assert _run(shared_data / "tinyshakespeare.jsonl", out / "shakes", gpt2_flags, "--append-eod", "--workers", "2",
                "--partitions", "2", "--keep-sequential-samples") == 0
    for ext in ("bin", "idx"):
        golden = (shared_data / "golden" / f"shakes_text_document.{ext}").read_bytes()
        assert (out / f"shakes_text_document.{ext}").read_bytes() == golden
    assert sorted(p.name for p in out.iterdir()) == ["shakes_text_document.bin", "shakes_text_document.idx"]


@pytest.mark.parametrize("workers", [1, 2])
def test_golden_sentencepiece(shared_data, tmp_path, workers):
    prefix = tmp_path / "shakes_sp"
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(shared_data / "shakespeare-sp8k.model")]
    assert _run(shared_data / "tinyshakespeare.jsonl", prefix, flags, "--append-eod", "--workers", str(workers)) == 0
    for ext in ("bin", "idx"):
        golden = (shared_data / "golden" / f"shakes_sp_text_document.{ext}").read_bytes()
        assert (tmp_path / f"shakes_sp_text_document.{ext}").read_bytes() == golden


# ------------------------------------------------------------------ input forms and flags


def test_gzip_input_and_progress_lines(tmp_path, gpt2_flags, gpt2, shakespeare_lines, capsys):
    lines = shakespeare_lines[:120]
    source = tmp_path / "part.jsonl.gz"
    with gzip.open(source, "wt", encoding="utf-8") as stream:
        stream.writelines(lines)
    assert _run(source, tmp_path / "gz", gpt2_flags, "--append-eod", "--workers", "1", "--log-interval", "50") == 0
    texts = [json.loads(line)["text"] for line in lines]
    assert _documents(tmp_path / "gz_text_document") == _reference_documents(gpt2, texts)
    progress = re.findall(r"^Processed (\d+) documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.$",
                          capsys.readouterr().err, re.MULTILINE)
    assert progress == ["50", "100"]


def test_multiple_keys_empty_text_and_no_eod(tmp_path, gpt2_flags, gpt2):
    records = [{"text": "Hello world", "title": "One"}, {"text": "", "title": "Two words"},
               {"text": "Bye", "title": ""}]
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    assert _run(source, tmp_path / "out", gpt2_flags, "--json-keys", "text", "title", "--workers", "1") == 0
    for key in ("text", "title"):
        docs = _documents(tmp_path / f"out_{key}_document")
        assert docs == _reference_documents(gpt2, [r[key] for r in records], append_eod=False)
        assert [len(d) for d in docs].count(0) == 1  # the empty text is a document without sequences
    assert IndexedDataset(str(tmp_path / "out_text_document")).dtype == numpy.uint16


def test_null_tokenizer_and_pre_split_sentences(tmp_path):
    records = [{"text": "1 2 3"}, {"text": ["4 5", "", "6"]}, {"text": ""}]
    source = _write_jsonl(tmp_path / "ids.jsonl", records)
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "70000"]
    assert _run(source, tmp_path / "ids", flags, "--append-eod", "--workers", "1") == 0
    dataset = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert dataset.dtype == numpy.int32  # 70,000 ids do not fit Megatron's uint16 threshold
    # Megatron's NullTokenizer appends eod = --vocab-size.
    assert _documents(tmp_path / "ids_text_document") == [[[1, 2, 3, 70000]], [[4, 5], [6, 70000]], []]


@pytest.mark.parametrize("vocab_size,dtype", [(65498, numpy.uint16), (65499, numpy.int32)])
def test_null_tokenizer_dtype_follows_megatron(tmp_path, vocab_size, dtype):
    """--vocab-size V is a vocabulary of V + 1 ids (eod = V); tokens are uint16 only below 65,500 ids."""
    source = _write_jsonl(tmp_path / "ids.jsonl", [{"text": "7 8"}])
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size)]
    assert _run(source, tmp_path / "ids", flags, "--append-eod", "--workers", "1") == 0
    assert IndexedDataset(str(tmp_path / "ids_text_document")).dtype == dtype
    assert _documents(tmp_path / "ids_text_document") == [[[7, 8, vocab_size]]]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_null_tokenizer_bad_ids_are_bad_lines(tmp_path, capsys, workers):
    content = '{"text": "1 2"}\n{"text": "3 101"}\n{"text": "4 x"}\n{"text": "100"}\n'
    source = tmp_path / "ids.jsonl"
    source.write_text(content, encoding="utf-8")
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", workers]
    assert _run(source, tmp_path / "ids", flags) == 1
    err = capsys.readouterr().err
    assert f"{source}:2: key 'text': NullTokenizer: id 101 is outside the vocabulary [0, 100]" in err
    assert list(tmp_path.iterdir()) == [source]
    assert _run(source, tmp_path / "ids", flags, "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    assert "Skipped 2 bad line(s)" in err and f"{source}:2: key 'text'" in err
    assert f"{source}:3: key 'text': NullTokenizer: 'x' is not an integer token id" in err
    assert _documents(tmp_path / "ids_text_document") == [[[1, 2]], [[100]]]


def test_sentence_splitting_with_stand_in_splitter(tmp_path, gpt2_flags, gpt2, monkeypatch):
    class PeriodSplitter:
        def tokenize(self, text):
            return [part + "." for part in text.split(".") if part.strip()]

    monkeypatch.setattr(preprocess, "_build_sentence_splitter", lambda lang, keep_newlines: PeriodSplitter())
    records = [{"text": "One fish. Two fish. Red"}, {"text": "Blue."}]
    source = _write_jsonl(tmp_path / "s.jsonl", records)
    assert _run(source, tmp_path / "s", gpt2_flags, "--split-sentences", "--append-eod", "--workers", "1") == 0
    expected = []
    for record in records:
        sentences = [gpt2.tokenize(s) for s in PeriodSplitter().tokenize(record["text"])]
        sentences[-1] = sentences[-1] + [gpt2.eod]
        expected.append(sentences)
    assert _documents(tmp_path / "s_text_sentence") == expected


def test_split_sentences_without_nltk_is_a_clear_error(tmp_path, gpt2_flags, capsys):
    if importlib.util.find_spec("nltk") is not None:
        pytest.skip("nltk is installed; the missing-package message cannot be exercised")
    source = _write_jsonl(tmp_path / "s.jsonl", [{"text": "A. B."}])
    assert _run(source, tmp_path / "s", gpt2_flags, "--split-sentences", "--workers", "1") == 1
    assert "nltk" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize("sequential", [True, False])
def test_partitions(tmp_path, gpt2_flags, gpt2, shakespeare_lines, sequential):
    lines = shakespeare_lines[:101]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(lines), encoding="utf-8")
    extra = ["--keep-sequential-samples"] if sequential else []
    out = tmp_path / "out"
    out.mkdir()
    assert _run(source, out / "p", gpt2_flags, "--append-eod", "--workers", "2", "--partitions", "2", *extra) == 0
    texts = [json.loads(line)["text"] for line in lines]
    # Round robin puts even lines in partition 0 and odd lines in partition 1; merging keeps partition order.
    order = texts if sequential else texts[0::2] + texts[1::2]
    assert _documents(out / "p_text_document") == _reference_documents(gpt2, order)
    # Partition files are intermediate: nothing but the merged output is left.
    assert sorted(p.name for p in out.iterdir()) == ["p_text_document.bin", "p_text_document.idx"]


def test_workers_must_divide_by_partitions(tmp_path, gpt2_flags):
    with pytest.raises(SystemExit):
        _run(tmp_path / "x.jsonl", tmp_path / "x", gpt2_flags, "--workers", "3", "--partitions", "2")


# ------------------------------------------------------------------ bad input policy


BAD_LINES = {
    "not_json": ('{"text": "fine"}\n{"text": oops}\n', 2, "not JSON"),
    "missing_key": ('{"text": "fine"}\n{"body": "x"}\n', 2, "missing key 'text'"),
    "non_string": ('{"text": 5}\n', 1, "holds int"),
    "lone_surrogate": ('{"text": "fine"}\n{"text": "fine"}\n{"text": "a \\ud800 b"}\n', 3, "lone surrogate"),
    "not_object": ('["text"]\n', 1, "not a JSON object"),
}


@pytest.mark.parametrize("loads", ["orjson if installed", "json"])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_is_an_error_and_leaves_no_output(tmp_path, gpt2_flags, capsys, monkeypatch, case, loads):
    """Also with json parsing the fast path (no orjson), which lets lone surrogates through to the checks."""
    if loads == "json":
        monkeypatch.setattr(preprocess, "_fast_loads", json.loads)
    content, line_number, reason = BAD_LINES[case]
    source = tmp_path / "bad.jsonl"
    source.write_text(content, encoding="utf-8")
    assert _run(source, tmp_path / "bad", gpt2_flags, "--append-eod", "--workers", "1") == 1
    err = capsys.readouterr().err
    assert f"{source}:{line_number}:" in err and reason in err
    assert list(tmp_path.iterdir()) == [source]


def test_invalid_utf8_is_a_bad_line(tmp_path, gpt2_flags, capsys):
    source = tmp_path / "bytes.jsonl"
    source.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    assert _run(source, tmp_path / "b", gpt2_flags, "--workers", "2") == 1
    assert f"{source}:2: not UTF-8" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [source]


def test_skip_bad_lines(tmp_path, gpt2_flags, gpt2, capsys):
    content = '{"text": "Hello"}\nnot json\n{"text": 7}\n{"text": "world"}\n'
    source = tmp_path / "mixed.jsonl"
    source.write_text(content, encoding="utf-8")
    assert _run(source, tmp_path / "m", gpt2_flags, "--append-eod", "--workers", "2", "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    assert "Skipped 2 bad line(s)" in err and f"{source}:2:" in err and f"{source}:3:" in err
    assert _documents(tmp_path / "m_text_document") == _reference_documents(gpt2, ["Hello", "world"])


class _DyingTokenizer(MegatronTokenizer):
    """Ends the worker process that tokenizes with it, as the out-of-memory killer would."""

    vocab_size = property(lambda self: 10)
    vocab = property(lambda self: {})
    inv_vocab = property(lambda self: {})

    def tokenize(self, text):
        os._exit(3)

    def detokenize(self, ids):
        return ""


def test_dead_worker_is_an_error_not_a_hang(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}])
    encoder = preprocess.Encoder(_DyingTokenizer(), ["text"], False, numpy.uint16)
    with pytest.raises(preprocess.PreprocessError, match="a worker process died"):
        preprocess.process_file(str(source), str(tmp_path / "o"), encoder, 2, "document")
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_lines_across_many_batches(tmp_path, gpt2_flags, gpt2, shakespeare_lines, capsys, monkeypatch, workers):
    """Small batches: bad lines deep in the file are named by their line, and the good ones around them
    (encoded by the batch path and the line-by-line path alike) come out in order."""
    monkeypatch.setattr(preprocess, "_BATCH_BYTES", 600)
    lines = list(shakespeare_lines[:60])
    lines[17] = '{"text": ["pre", "split"], "x": 1}\n'  # pre-split sentences: the line-by-line path
    lines.insert(20, "not json\n")
    lines.insert(50, '{"title": "no text"}\n')
    source = tmp_path / "in.jsonl"
    source.write_text("".join(lines), encoding="utf-8")
    assert _run(source, tmp_path / "o", gpt2_flags, "--append-eod", "--workers", workers) == 1
    assert f"{source}:21: not JSON" in capsys.readouterr().err
    assert _run(source, tmp_path / "o", gpt2_flags, "--append-eod", "--workers", workers, "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    assert "Skipped 2 bad line(s)" in err and f"{source}:21: not JSON" in err and f"{source}:51: missing key" in err
    good = [json.loads(line) for index, line in enumerate(lines) if index not in (20, 50)]
    expected = _reference_documents(gpt2, [record["text"] if index != 17 else "" for index, record in enumerate(good)])
    expected[17] = [gpt2.tokenize("pre"), gpt2.tokenize("split") + [gpt2.eod]]
    assert _documents(tmp_path / "o_text_document") == expected


def test_no_usable_document_is_an_error(tmp_path, gpt2_flags, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert _run(empty, tmp_path / "e", gpt2_flags, "--workers", "1") == 1
    assert "no usable document" in capsys.readouterr().err
    all_bad = tmp_path / "bad.jsonl"
    all_bad.write_text("x\ny\n", encoding="utf-8")
    assert _run(all_bad, tmp_path / "b", gpt2_flags, "--workers", "1", "--skip-bad-lines") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.jsonl"]


def test_append_eod_refused_without_eod_id(tmp_path, gpt2_flags, monkeypatch, capsys):
    class NoEod(MegatronTokenizer):
        vocab_size = property(lambda self: 10)
        vocab = property(lambda self: {})
        inv_vocab = property(lambda self: {})

        def tokenize(self, text):
            raise AssertionError("no work may start before the refusal")

        def detokenize(self, ids):
            return ""

    monkeypatch.setattr(preprocess, "build_tokenizer", lambda args: NoEod())
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert _run(source, tmp_path / "o", gpt2_flags, "--append-eod", "--workers", "1") == 1
    assert "--append-eod" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [source]


def test_missing_input_and_command_line_exit_status(tmp_path, gpt2_flags):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    source.write_text(source.read_text() + "{broken\n", encoding="utf-8")
    command = [sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input", str(source),
               "--output-prefix", str(tmp_path / "o"), *gpt2_flags, "--workers", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 1 and f"{source}:2: not JSON" in result.stderr
    assert list(tmp_path.iterdir()) == [source]
    assert _run(tmp_path / "nope.jsonl", tmp_path / "o", gpt2_flags, "--workers", "1") == 1


@pytest.mark.parametrize("sequential", [False, True])
def test_skip_bad_lines_across_partitions(tmp_path, gpt2_flags, gpt2, capsys, sequential):
    """Skipped lines are named by the user's file and line, whichever partition they landed in."""
    first = tmp_path / "in_a.jsonl"
    first.write_text('{"text": "a"}\n{"text": "b"}\nbroken\n{"text": "c"}\n', encoding="utf-8")
    second = tmp_path / "in_b.jsonl"
    second.write_text('{"text": "d"}\n[1]\n{"text": "e"}\n', encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--keep-sequential-samples"] if sequential else []
    assert _run(tmp_path / "in_*.jsonl", out / "p", gpt2_flags, "--workers", "2", "--partitions", "2",
                "--skip-bad-lines", *extra) == 0
    err = capsys.readouterr().err
    assert "Skipped 2 bad line(s)" in err
    assert f"{first}:3: not JSON" in err and f"{second}:2: not a JSON object" in err
    # Round robin deals global lines 0, 2, 4, 6 (a, broken, d, e) to partition 0 and 1, 3, 5 (b, c, [1]) to 1.
    texts = ["a", "b", "c", "d", "e"] if sequential else ["a", "d", "e", "b", "c"]
    assert _documents(out / "p_text_document") == _reference_documents(gpt2, texts, append_eod=False)


def test_find_optimal_num_workers(tmp_path, gpt2_flags, shakespeare_lines, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(shakespeare_lines[:40]), encoding="utf-8")
    assert _run(source, tmp_path / "o", gpt2_flags, "--workers", "1", "--find-optimal-num-workers",
                "--workers-to-check", "1", "2", "--max-documents", "20") == 0
    out = capsys.readouterr().out
    timings = {int(w): float(s) for w, s in re.findall(r"^workers=(\d+): ([\d.]+) s$", out, re.MULTILINE)}
    assert sorted(timings) == [1, 2]
    assert f"Optimal number of workers: {min(timings, key=timings.get)}" in out
    assert list(tmp_path.iterdir()) == [source]


def _stand_in_nltk(monkeypatch, has_data=True):
    """A private stand-in for nltk's punkt module: records how the splitter is assembled."""
    import types

    punkt = types.ModuleType("nltk.tokenize.punkt")

    class PunktLanguageVars:
        _period_context_fmt = "original"

    class PunktTokenizer:
        def __init__(self, lang):
            if not has_data:
                raise LookupError(f"Resource punkt_tab/{lang} not found")
            self.lang, self._params = lang, f"params-{lang}"

    class PunktSentenceTokenizer:
        def __init__(self, train_text, lang_vars):
            self.train_text, self.lang_vars = train_text, lang_vars

    punkt.PunktLanguageVars, punkt.PunktTokenizer = PunktLanguageVars, PunktTokenizer
    punkt.PunktSentenceTokenizer = PunktSentenceTokenizer
    tokenize = types.ModuleType("nltk.tokenize")
    tokenize.punkt = punkt
    nltk = types.ModuleType("nltk")
    nltk.tokenize = tokenize
    monkeypatch.setitem(sys.modules, "nltk", nltk)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", tokenize)
    monkeypatch.setitem(sys.modules, "nltk.tokenize.punkt", punkt)
    return punkt


def test_sentence_splitter_assembly(monkeypatch):
    punkt = _stand_in_nltk(monkeypatch)
    plain = preprocess._build_sentence_splitter("german", keep_newlines=False)
    assert isinstance(plain, punkt.PunktTokenizer) and plain.lang == "german"
    kept = preprocess._build_sentence_splitter("german", keep_newlines=True)
    assert isinstance(kept, punkt.PunktSentenceTokenizer) and kept.train_text == "params-german"
    assert isinstance(kept.lang_vars, punkt.PunktLanguageVars)
    # The end-of-sentence context must swallow trailing whitespace without requiring it.
    assert r"\s*" in kept.lang_vars._period_context_fmt and r"\s+" not in kept.lang_vars._period_context_fmt


def test_sentence_splitter_without_punkt_data(monkeypatch):
    _stand_in_nltk(monkeypatch, has_data=False)
    with pytest.raises(preprocess.PreprocessError, match=r"--lang english.*punkt"):
        preprocess._build_sentence_splitter("english", keep_newlines=False)


def test_empty_partition_is_merged_not_an_error(tmp_path):
    """5 lines over 4 sequential partitions leaves the last one empty; the merge still has all 5 documents."""
    source = _write_jsonl(tmp_path / "five.jsonl", [{"text": f"{i} {i}"} for i in range(1, 6)])
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert _run(source, tmp_path / "p", flags, "--workers", "4", "--partitions", "4",
                "--keep-sequential-samples") == 0
    assert _documents(tmp_path / "p_text_document") == [[[i, i]] for i in range(1, 6)]
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    assert _run(empty, tmp_path / "e", flags, "--workers", "2", "--partitions", "2") != 0
    assert not (tmp_path / "e_text_document.idx").exists()


# ------------------------------------------------------------------ partitions never touch the user's files


def _snapshot(folder):
    """name -> bytes of every plain file in ``folder`` (sorted names), and the names of everything else."""
    entries = sorted(folder.iterdir())
    return {p.name: p.read_bytes() for p in entries if p.is_file()}, [p.name for p in entries if not p.is_file()]


def _ids_records(first, count):
    return [{"text": f"{i} {i + 1}"} for i in range(first, first + count)]


@pytest.mark.parametrize("sequential", [False, True])
def test_partition_glob_over_shards_named_like_partition_files(tmp_path, sequential):
    """Shards c.jsonl, c_0.jsonl, c_1.jsonl under a glob c*.jsonl: none is rewritten, every document is kept."""
    data = tmp_path / "d"
    data.mkdir()
    shards = {"c.jsonl": _ids_records(1, 3), "c_0.jsonl": _ids_records(10, 4), "c_1.jsonl": _ids_records(20, 5)}
    for name, records in shards.items():
        _write_jsonl(data / name, records)
    before, _ = _snapshot(data)
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    extra = ["--keep-sequential-samples"] if sequential else []
    assert _run(data / "c*.jsonl", data / "out", flags, "--workers", "2", "--partitions", "2", *extra) == 0
    after, others = _snapshot(data)
    assert {name: after[name] for name in before} == before  # the user's shards are untouched
    assert sorted(after) == sorted(before) + ["out_text_document.bin", "out_text_document.idx"] and others == []
    lines = [r["text"] for name in sorted(shards) for r in shards[name]]
    order = lines if sequential else lines[0::2] + lines[1::2]
    assert _documents(data / "out_text_document") == [[[int(x) for x in t.split()]] for t in order]


@pytest.mark.parametrize("sequential", [False, True])
def test_partition_rerun_reads_only_the_users_files(tmp_path, sequential):
    """Running the same command twice gives the same output: nothing of the first run is read back as input."""
    data = tmp_path / "d"
    data.mkdir()
    _write_jsonl(data / "corpus_a.jsonl", _ids_records(1, 7))
    _write_jsonl(data / "corpus_b.jsonl", _ids_records(30, 6))
    before, _ = _snapshot(data)
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    extra = ["--keep-sequential-samples"] if sequential else []
    outputs = []
    for _ in range(2):
        assert _run(data / "corpus*.jsonl", data / "out", flags, "--workers", "2", "--partitions", "2", *extra) == 0
        after, others = _snapshot(data)
        assert sorted(after) == sorted(before) + ["out_text_document.bin", "out_text_document.idx"] and others == []
        outputs.append(_documents(data / "out_text_document"))
    assert len(outputs[0]) == 13 and outputs[1] == outputs[0]


def test_partition_failure_leaves_no_intermediate_files_and_names_the_input_line(tmp_path, capsys):
    data = tmp_path / "d"
    data.mkdir()
    _write_jsonl(data / "a.jsonl", _ids_records(1, 3))
    (data / "b.jsonl").write_text('{"text": "5"}\n{"text": "6"}\nbroken\n', encoding="utf-8")
    before = _snapshot(data)
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert _run(data / "*.jsonl", data / "out", flags, "--workers", "2", "--partitions", "2") == 1
    err = capsys.readouterr().err
    assert f"{data / 'b.jsonl'}:3: not JSON" in err  # the user's file and line, not a partition file
    assert _snapshot(data) == before  # no partition input, partition output or temporary folder is left


def test_output_prefix_that_would_overwrite_an_input_is_refused(tmp_path, capsys):
    data = tmp_path / "d"
    data.mkdir()
    victim = _write_jsonl(data / "o_text_document.idx", _ids_records(1, 2))  # a (strangely named) input
    _write_jsonl(data / "p.jsonl", _ids_records(5, 2))
    before = _snapshot(data)
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    for extra in (["--partitions", "2"], ["--partitions", "1"]):
        source = data / "*" if extra[1] == "2" else victim
        assert _run(source, data / "o", flags, "--workers", "2", *extra) == 1
        err = capsys.readouterr().err
        assert "--output-prefix" in err and str(victim) in err and "overwrite" in err
        assert _snapshot(data) == before


def test_partition_glob_matching_a_folder_or_a_damaged_gzip_is_named(tmp_path, capsys):
    data = tmp_path / "d"
    data.mkdir()
    _write_jsonl(data / "a.jsonl", _ids_records(1, 3))
    (data / "sub.jsonl").mkdir()
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--workers", "2", "--partitions", "2"]
    assert _run(data / "*.jsonl", data / "out", flags) == 1
    assert f"matches {data / 'sub.jsonl'}, which is not a file" in capsys.readouterr().err
    (data / "sub.jsonl").rmdir()
    with gzip.open(data / "b.jsonl.gz", "wb") as stream:
        stream.write(b'{"text": "5 6"}\n' * 50)
    (data / "b.jsonl.gz").write_bytes((data / "b.jsonl.gz").read_bytes()[:-12])  # cut inside the trailer
    before, _ = _snapshot(data)
    assert _run(data / "*.jsonl*", data / "out", flags) == 1
    assert f"--input {data / 'b.jsonl.gz'}: damaged gzip file" in capsys.readouterr().err
    assert _snapshot(data) == (before, [])


# ------------------------------------------------------------------ every option under fork, spawn and forkserver

# A file-based stand-in for the part of nltk's punkt module the tool uses (nltk and its punkt data
# cannot be installed here). It is importable by spawned processes, and like nltk it pickles
# PunktLanguageVars without instance state, so only class-level settings survive a process boundary.
_STAND_IN_PUNKT = r'''
import re


class PunktLanguageVars:
    _period_context_fmt = r"""
        %(SentEndChars)s
        (?=(?P<after_tok>
            %(NonWord)s
            |
            \s+(?P<next_tok>\S+)
        ))"""

    def __getstate__(self):
        return 1

    def __setstate__(self, state):
        return 1


class PunktSentenceTokenizer:
    """Splits after . ! ? followed by whitespace; the whitespace stays with the sentence when the
    language variables' period context swallows it (Megatron's --keep-newlines variables)."""

    def __init__(self, train_text=None, lang_vars=None):
        self._params = train_text
        self._lang_vars = lang_vars if lang_vars is not None else PunktLanguageVars()

    def tokenize(self, text):
        keep = r"\s*" in self._lang_vars._period_context_fmt
        pieces = re.split(r"(?<=[.!?])(\s+)", text)
        sentences = []
        for i in range(0, len(pieces), 2):
            sentence = pieces[i] + (pieces[i + 1] if keep and i + 1 < len(pieces) else "")
            if sentence.strip():
                sentences.append(sentence if keep else sentence.strip())
        return sentences


class PunktTokenizer(PunktSentenceTokenizer):
    def __init__(self, lang="english"):
        super().__init__(train_text="params-" + lang)
'''

_LAUNCHER = r'''
import json
import multiprocessing
import runpy
import sys


def main():
    method, tool, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    multiprocessing.set_start_method(method)
    codes = []
    for argv in runs:
        sys.argv = [tool] + argv
        try:
            runpy.run_path(tool, run_name="__main__")  # as `python tools/preprocess_data.py ARGS`
            codes.append(0)
        except SystemExit as exit_:
            codes.append(exit_.code)
        except Exception as error:
            codes.append(f"{type(error).__name__}: {error}")
    print("CODES " + json.dumps(codes), flush=True)


if __name__ == "__main__":
    main()
'''


def _stand_in_nltk_package(root):
    package = root / "nltk"
    (package / "tokenize").mkdir(parents=True)
    (package / "__init__.py").write_text("from nltk import tokenize\n")
    (package / "tokenize" / "__init__.py").write_text("from nltk.tokenize import punkt\n")
    (package / "tokenize" / "punkt.py").write_text(_STAND_IN_PUNKT)
    spec = importlib.util.spec_from_file_location("_stand_in_punkt", package / "tokenize" / "punkt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_option_under_every_start_method(tmp_path, shared_data, gpt2_flags, gpt2, shakespeare_lines):
    """The option matrix under spawn and forkserver (2 workers) gives the bytes fork gives, and fork's are right."""
    punkt = _stand_in_nltk_package(tmp_path / "site")
    texts = [json.loads(line)["text"] for line in shakespeare_lines[:120]]
    records = [{"text": "\n".join(texts[i:i + 4])} for i in range(0, len(texts), 4)]  # several sentences each
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    source.write_text(source.read_text(encoding="utf-8") + "broken line\n", encoding="utf-8")
    ids = _write_jsonl(tmp_path / "ids.jsonl", [{"text": f"{i} {i + 1} {i + 2}"} for i in range(40)])
    sp_model = str(shared_data / "shakespeare-sp8k.model")
    common = ["--workers", "2", "--append-eod", "--skip-bad-lines"]
    configs = {
        "gpt2": [str(source), *gpt2_flags, *common],
        "sp": [str(source), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, *common],
        "gptsp": [str(source), "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
                  *common],
        "null": [str(ids), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *common],
        "split": [str(source), *gpt2_flags, *common, "--split-sentences"],
        "newlines": [str(source), *gpt2_flags, *common, "--split-sentences", "--keep-newlines"],
        "partitions": [str(tmp_path / "in*.jsonl"), *gpt2_flags, "--append-eod", "--skip-bad-lines",
                       "--workers", "4", "--partitions", "2", "--split-sentences", "--keep-newlines"],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "launch.py").write_text(_LAUNCHER)
    outputs = {}
    for method in ("fork", "spawn", "forkserver"):
        out = tmp_path / method
        out.mkdir()
        runs = [["--input", argv[0], "--output-prefix", str(out / name), *argv[1:]] for name, argv in configs.items()]
        runs.append(["--input", str(source), "--output-prefix", str(out / "bench"), *gpt2_flags, "--workers", "1",
                     "--split-sentences", "--keep-newlines", "--find-optimal-num-workers", "--workers-to-check", "2",
                     "--max-documents", "10"])
        result = subprocess.run([sys.executable, str(tmp_path / "launch.py"), method,
                                 str(REPO_ROOT / "tools" / "preprocess_data.py"), json.dumps(runs)],
                                capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
        codes = re.findall(r"^CODES (.*)$", result.stdout, re.MULTILINE)
        assert result.returncode == 0 and codes, f"{method}: {result.stderr[-3000:]}"
        assert json.loads(codes[0]) == [0] * len(runs), f"{method}: {codes[0]}\n{result.stderr[-3000:]}"
        assert "Optimal number of workers: 2" in result.stdout
        outputs[method] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    level = {name: "sentence" if "--split-sentences" in argv else "document" for name, argv in configs.items()}
    assert sorted(outputs["fork"]) == sorted(f"{name}_text_{level[name]}.{ext}" for name in configs
                                             for ext in ("bin", "idx"))
    assert outputs["spawn"] == outputs["fork"] and outputs["forkserver"] == outputs["fork"]
    # Fork's output is the right one: sentences from the (stand-in) splitter, newlines kept or not.
    for name, lang_vars in (("split", punkt.PunktLanguageVars()), ("newlines", None)):
        if lang_vars is None:
            lang_vars = type("KeepNewlines", (punkt.PunktLanguageVars,), {"_period_context_fmt": r"\S*[.]\s*"})()
        splitter = punkt.PunktSentenceTokenizer(lang_vars=lang_vars)
        expected = []
        for record in records:
            sentences = [gpt2.tokenize(s) for s in splitter.tokenize(record["text"])]
            sentences = [s for s in sentences if s]
            sentences[-1] = sentences[-1] + [gpt2.eod]
            expected.append(sentences)
        assert _documents(tmp_path / "fork" / f"{name}_text_sentence") == expected
    assert _documents(tmp_path / "fork" / "newlines_text_sentence") != _documents(tmp_path / "fork" / "split_text_sentence")
