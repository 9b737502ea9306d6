"""HuggingFaceTokenizer and TikTokenizer: ids equal the libraries', preprocessing (dtype, EOD) and flags;
GPT-2 BPE on tiktoken equals the pure-Python reference."""
import argparse
import base64
import json
import pickle
import random

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer
from megatron.core.tokenizers.tiktokenizer import TIKTOKEN_PATTERNS
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer
from test_preprocess_data import _documents, _run, _write_jsonl
from tokenizer_files import (
    build_hf_bpe_tokenizer,
    build_hf_large_vocab_tokenizer,
    build_tiktoken_vocab,
    shakespeare_texts,
)

transformers = pytest.importorskip("transformers")
tiktoken = pytest.importorskip("tiktoken")

ODD_TEXTS = ["naïve café — 東京 🎉\n\n  tabs\tand  spaces  ", "x" * 300, "1234567 89", "CamelCaseWord/path\r\n\n",
             "</s> <s> literal specials", ""]


@pytest.fixture(scope="module")
def texts(shared_data):
    return shakespeare_texts(shared_data, 300) + ODD_TEXTS


@pytest.fixture(scope="module")
def hf_dir(shared_data, tmp_path_factory):
    return build_hf_bpe_tokenizer(tmp_path_factory.mktemp("hf_bpe"), shared_data)


@pytest.fixture(scope="module")
def tiktoken_file(shared_data, tmp_path_factory):
    return build_tiktoken_vocab(tmp_path_factory.mktemp("tiktoken") / "vocab.json", shared_data)


def _parse(argv):
    args = add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)
    args.rank = 1
    return args


# ------------------------------------------------------------------ HuggingFaceTokenizer


def test_hf_tokenizer_ids_equal_the_library(hf_dir, texts):
    library = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tokenizer = build_tokenizer(_parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]))
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    for text in texts:
        assert tokenizer.tokenize(text) == library(text)["input_ids"]
    assert tokenizer.tokenize("Hi")[0] == library.bos_token_id == tokenizer.bos  # the library's own BOS
    assert tokenizer.eod == tokenizer.eos == library.eos_token_id == library.convert_tokens_to_ids("</s>")
    assert tokenizer.vocab_size == len(library) == 500 and tokenizer.pad == -1
    assert tokenizer.detokenize(library(texts[0], add_special_tokens=False)["input_ids"]) == texts[0]
    assert tokenizer.inv_vocab[tokenizer.vocab["</s>"]] == "</s>"
    # --tokenizer-hf-no-include-special-tokens: no BOS.
    plain = build_tokenizer(_parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir),
                                    "--tokenizer-hf-no-include-special-tokens"]))
    assert plain.tokenize(texts[1]) == library(texts[1], add_special_tokens=False)["input_ids"]
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(texts[2]) == tokenizer.tokenize(texts[2])


def test_hf_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer(_parse(["--tokenizer-type", "HuggingFaceTokenizer"]))
    with pytest.raises(ValueError, match=f"--tokenizer-model {tmp_path}: cannot load"):
        build_tokenizer(_parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]))


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_with_hf_tokenizer(hf_dir, texts, tmp_path, workers):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in texts])
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    assert _run(source, tmp_path / "out", flags, "--append-eod", "--workers", str(workers)) == 0
    library = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    # Megatron's EOD handling: the eos id appended to every non-empty document (the BOS stays).
    expected = []
    for text in texts:
        ids = library(text)["input_ids"]
        expected.append([ids + [library.eos_token_id]] if ids else [])
    assert _documents(tmp_path / "out_text_document") == expected
    assert IndexedDataset(str(tmp_path / "out_text_document")).dtype == numpy.uint16


def test_preprocess_hf_vocabulary_above_65535_is_int32(tmp_path):
    directory = build_hf_large_vocab_tokenizer(tmp_path / "big")
    records = [{"text": "w1 w65535 w65536 w69999"}, {"text": "w0 nosuchword"}]
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory)]
    assert _run(source, tmp_path / "out", flags, "--append-eod", "--workers", "1") == 0
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == numpy.int32
    library = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert _documents(tmp_path / "out_text_document") == [
        [library(r["text"])["input_ids"] + [70001]] for r in records]
    assert _documents(tmp_path / "out_text_document")[0][0] == [1, 65535, 65536, 69999, 70001]


# ------------------------------------------------------------------ TikTokenizer


def _library_encoding(path, pattern, num_special):
    """tiktoken called directly on the same file, with Megatron's id layout."""
    entries = json.loads(path.read_text())
    ranks = {base64.b64decode(e["token_bytes"]): e["rank"] + num_special for e in entries}
    return tiktoken.Encoding(name="direct", pat_str=TIKTOKEN_PATTERNS[pattern], mergeable_ranks=ranks,
                             special_tokens={})


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_equal_the_library(tiktoken_file, texts, pattern):
    inner = len(json.loads(tiktoken_file.read_text()))
    args = _parse(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file),
                   "--tiktoken-pattern", pattern, "--tiktoken-num-special-tokens", "100",
                   "--vocab-size", str(inner + 100)])
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, TikTokenizer)
    library = _library_encoding(tiktoken_file, pattern, 100)
    for text in texts:
        ids = tokenizer.tokenize(text)
        assert ids == library.encode_ordinary(text)
        assert tokenizer.detokenize(ids) == text
    assert min(min(tokenizer.tokenize(t)) for t in texts if t) >= 100  # specials never come from text
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (0, 1, 2, 2)
    assert tokenizer.vocab_size == inner + 100 and args.padded_vocab_size == -(-(inner + 100) // 128) * 128
    assert tokenizer.inv_vocab[3] == "<SPECIAL_3>" and tokenizer.vocab[b"a"] == 100 + ord("a")
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(texts[0]) == tokenizer.tokenize(texts[0])


def test_tiktokenizer_special_tokens_and_errors(tiktoken_file):
    inner = len(json.loads(tiktoken_file.read_text()))
    base = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file), "--tiktoken-pattern", "v2",
            "--tiktoken-num-special-tokens", "10", "--vocab-size", str(inner + 10)]
    custom = build_tokenizer(_parse([*base, "--tokenizer-special-tokens", "<pad>", "<unk>", "<s>", "</s>"]))
    assert (custom.unk, custom.bos, custom.eod) == (1, 2, 3)
    deprecated = build_tokenizer(_parse([*base, "--tiktoken-special-tokens", "<s>", "</s>", "<unk>"]))
    assert deprecated.eod == 1
    # Fewer ids than the file: the file is cut, as Megatron does.
    assert build_tokenizer(_parse([*base[:-1], "266"])).tokenize("the") == [10 + ord("t"), 10 + ord("h"),
                                                                           10 + ord("e")]
    with pytest.raises(ValueError, match="fewer than --vocab-size"):
        build_tokenizer(_parse([*base[:-1], str(inner + 11)]))
    with pytest.raises(ValueError, match="--tiktoken-pattern v1 or v2"):
        build_tokenizer(_parse(base[:4]))
    with pytest.raises(ValueError, match="must include"):
        build_tokenizer(_parse([*base, "--tokenizer-special-tokens", "<s>", "</s>"]))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(_parse(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "/no/such.json",
                                "--tiktoken-pattern", "v1"]))


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_tiktokenizer_vocabulary_above_65535_is_int32(tiktoken_file, texts, tmp_path, workers):
    """20,000 reserved special ids push every text id above 20,000 and the vocabulary above 65,535."""
    inner = len(json.loads(tiktoken_file.read_text()))
    vocab_size = 63000 + inner
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in texts])
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file), "--tiktoken-pattern", "v2",
             "--tiktoken-num-special-tokens", "63000", "--vocab-size", str(vocab_size)]
    assert _run(source, tmp_path / "out", flags, "--append-eod", "--workers", str(workers)) == 0
    assert IndexedDataset(str(tmp_path / "out_text_document")).dtype == numpy.int32
    library = _library_encoding(tiktoken_file, "v2", 63000)
    expected = [[library.encode_ordinary(text) + [2]] if text else [] for text in texts]
    documents = _documents(tmp_path / "out_text_document")
    assert documents == expected
    assert max(max(doc[0]) for doc in documents if doc) > 65535


# ------------------------------------------------------------------ GPT-2 BPE through tiktoken


def test_gpt2_tiktoken_equals_the_python_reference(shared_data):
    vocab, merges = str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    fast = GPT2BPETokenizer(vocab, merges, backend="tiktoken")
    reference = GPT2BPETokenizer(vocab, merges, backend="python")
    assert (fast.backend, reference.backend) == ("tiktoken", "python")
    assert GPT2BPETokenizer(vocab, merges).backend == "tiktoken"  # the default when tiktoken is installed
    texts = shakespeare_texts(shared_data, 10000) + ODD_TEXTS + [
        "a<|endoftext|>b<|endoftext|>", "<|endoftext|>", "x  \n\n y\t\t'sz \u3000\u3000w", "  's   've\n\n\n1"]
    assert [fast.tokenize(t) for t in texts] == [reference.tokenize(t) for t in texts]
    with pytest.raises(UnicodeEncodeError):
        fast.tokenize("\ud800")
    assert pickle.loads(pickle.dumps(reference)).backend == "python"


def test_gpt2_tokenize_many_equals_tokenize_per_text(shared_data):
    """tiktoken's batch path (one call per batch, whitespace cuts found in the ids and redone) gives the
    pure-Python reference's ids per text, for any batch boundaries; random texts stress whitespace runs,
    contractions, non-ASCII whitespace and literal <|endoftext|>."""
    vocab, merges = str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    fast = GPT2BPETokenizer(vocab, merges, backend="tiktoken")
    reference = GPT2BPETokenizer(vocab, merges, backend="python")
    rng = random.Random(14)
    alphabet = ["a", "b", "s", "t", "re", "'", " ", "  ", "\n", "\t", "\r", "\x0b", "1", ".", "é", "東", "🎉",
                "\xa0", "\u3000", "\u2028", "\x1c", "<|endoftext|>"]
    texts = shakespeare_texts(shared_data, 2000) + ODD_TEXTS + [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(3000)]
    expected = [reference.tokenize(text) for text in texts]
    for size in (1, 7, 500, len(texts)):
        for start in range(0, len(texts), size):
            ids, counts = fast.tokenize_many(texts[start:start + size])
            assert counts.tolist() == [len(e) for e in expected[start:start + size]]
            assert ids.tolist() == [i for e in expected[start:start + size] for i in e]
    spelled = "a <|megatron-tokenize-many-text-end|> b"  # the batch marker as plain text
    ids, counts = fast.tokenize_many([spelled, "c"])
    assert ids.tolist() == reference.tokenize(spelled) + reference.tokenize("c") and counts.tolist()[1] == 1
    assert [a.tolist() for a in fast.tokenize_many([])] == [[], []]
    with pytest.raises(UnicodeEncodeError):
        fast.tokenize_many(["fine", "\ud800"])
    ids, counts = reference.tokenize_many(texts[:50])  # the base class's per-text loop
    assert ids.tolist() == [i for e in expected[:50] for i in e]


def test_gpt2_backend_choice(shared_data, tmp_path, monkeypatch):
    vocab, merges = str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    monkeypatch.setenv("MEGATRON_GPT2_BPE_BACKEND", "python")
    assert GPT2BPETokenizer(vocab, merges).backend == "python"
    monkeypatch.setenv("MEGATRON_GPT2_BPE_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="MEGATRON_GPT2_BPE_BACKEND"):
        GPT2BPETokenizer(vocab, merges)
    # A merge file whose token ids do not follow the merge order cannot run on tiktoken: auto falls back.
    lines = (shared_data / "gpt2-merges.txt").read_text(encoding="utf-8").splitlines()
    swapped = tmp_path / "merges.txt"
    swapped.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n", encoding="utf-8")
    monkeypatch.delenv("MEGATRON_GPT2_BPE_BACKEND")
    with pytest.warns(UserWarning, match="pure-Python"):
        assert GPT2BPETokenizer(vocab, str(swapped)).backend == "python"
    with pytest.raises(ValueError, match="cannot be run by tiktoken"):
        GPT2BPETokenizer(vocab, str(swapped), backend="tiktoken")


# ------------------------------------------------------------------ training flags


def test_training_accepts_tokenizer_flags_only_with_their_type(monkeypatch, hf_dir):
    from megatron.training.arguments import parse_args, validate_args

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    valid = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]
    validate_args(parse_args(args=[*valid, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                   str(hf_dir), "--trust-remote-code", "--tokenizer-hf-no-use-fast"]))
    validate_args(parse_args(args=[*valid, "--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v1",
                                   "--tokenizer-special-tokens", "<unk>", "<s>", "</s>"]))
    with pytest.raises(ValueError, match="--trust-remote-code applies only to --tokenizer-type HuggingFaceTokenizer"):
        validate_args(parse_args(args=[*valid, "--tokenizer-type", "GPT2BPETokenizer", "--trust-remote-code"]))



def test_tiktoken_pattern_without_tiktokenizer_is_ignored_with_a_warning(monkeypatch, capsys):
    """As Megatron-LM: the pattern is read only when a TikTokenizer is built; here a warning says so."""
    from megatron.training.arguments import parse_args, validate_args

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    valid = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]
    args = validate_args(parse_args(args=[*valid, "--tokenizer-type", "GPT2BPETokenizer", "--tiktoken-pattern", "v2"]))
    assert args.tiktoken_pattern == "v2" and args.tokenizer_type == "GPT2BPETokenizer"
    assert ("WARNING: --tiktoken-pattern v2 is ignored: it applies only to --tokenizer-type TikTokenizer "
            "(got GPT2BPETokenizer)") in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_training_runs_on_tiktokenizer_data(shared_data, tiktoken_file, tmp_path):
    """pretrain_gpt.py accepts --tokenizer-type TikTokenizer: data preprocessed with it trains, the EOD is </s>."""
    from pretrain_utils import losses_from_log, run_pretrain

    inner = len(json.loads(tiktoken_file.read_text()))
    tokenizer_flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(tiktoken_file),
                       "--tiktoken-pattern", "v2", "--tiktoken-num-special-tokens", "100",
                       "--vocab-size", str(inner + 100)]
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in shakespeare_texts(shared_data, 300)])
    assert _run(source, tmp_path / "tik", tokenizer_flags, "--append-eod", "--workers", "1") == 0
    assert _documents(tmp_path / "tik_text_document")[0][0][-1] == 2  # </s>
    out = run_pretrain(1, [*tokenizer_flags, "--micro-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "1",
                           "--eval-iters", "0"], shared_data, str(tmp_path / "tik_text_document"), tmp_path)
    losses = losses_from_log(out)
    assert sorted(losses) == [1, 2] and all(float(loss) > 0 for loss in losses.values())
    padded = -(-(inner + 100) // 128) * 128
    assert f"padded vocab (size: {inner + 100}) with {padded - inner - 100} dummy tokens (new size: {padded})" in out
