"""Tests for the GPT-2 BPE, SentencePiece and null tokenizers and the tokenizer flags/factory."""
import argparse
import json
import pickle

import pytest
import sentencepiece

from megatron.core.tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    MegatronTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
)
from megatron.core.tokenizers import gpt2_bpe
from megatron.training.tokenizer import _vocab_size_with_padding, add_tokenizer_args, build_tokenizer


@pytest.fixture(scope="module")
def gpt2(shared_data):
    # The pure-Python reference; tests/test_hf_tiktoken_tokenizers.py checks the tiktoken path against it.
    return GPT2BPETokenizer(str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt"),
                            backend="python")


@pytest.fixture(scope="module")
def sp_model(shared_data):
    return str(shared_data / "shakespeare-sp8k.model")


@pytest.fixture(scope="module")
def shakespeare_docs(shared_data):
    with open(shared_data / "tinyshakespeare.jsonl", encoding="utf-8") as stream:
        return [json.loads(line)["text"] for line in stream]


def _parse(argv):
    return add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)


# ------------------------------------------------------------------ GPT-2 BPE


def test_gpt2_known_ids(gpt2):
    assert gpt2.tokenize("Hello world, it's me") == [15496, 995, 11, 340, 338, 502]
    assert gpt2.eod == 50256 == gpt2.vocab["<|endoftext|>"]
    assert gpt2.vocab_size == 50257
    assert gpt2.pad == -1
    assert gpt2.unique_identifiers["class"] == "GPT2BPETokenizer"
    paths = gpt2.unique_identifiers["tokenizer_path"]
    assert isinstance(paths, list) and [p.rsplit("/", 1)[-1] for p in paths] == ["gpt2-vocab.json", "gpt2-merges.txt"]


def test_gpt2_tinyshakespeare_token_count(gpt2, shakespeare_docs):
    assert len(shakespeare_docs) == 7222
    assert sum(len(gpt2.tokenize(text)) for text in shakespeare_docs) == 323582


def test_gpt2_round_trip(gpt2, shakespeare_docs):
    samples = shakespeare_docs[:50] + ["naïve café — 東京 🎉\n\n  tabs\tand  spaces  ", "x" * 300, "1234567 89"]
    for text in samples:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text


def test_gpt2_pieces_are_vocab_entries(gpt2):
    # Reference: the byte-level spelling of a word the vocab holds whole must map to that one id.
    spelling = "".join(gpt2_bpe.bytes_to_unicode()[b] for b in " Hello".encode("utf-8"))
    assert gpt2.tokenize(" Hello") == [gpt2.vocab[spelling]]
    table = gpt2_bpe.bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(gpt2.vocab[table[b]] < 256 for b in range(256))


def test_gpt2_literal_end_of_text(gpt2):
    hello = gpt2.tokenize("Hello")
    assert gpt2.tokenize("Hello<|endoftext|>Hello") == hello + [50256] + hello
    assert gpt2.tokenize("<|endoftext|>") == [50256]


def test_gpt2_invalid_bytes_decode_to_replacement(gpt2):
    byte_ff = gpt2.vocab[gpt2_bpe.bytes_to_unicode()[0xFF]]
    assert gpt2.detokenize([byte_ff]) == "\ufffd"


def test_gpt2_bounded_cache_gives_same_ids(gpt2, shakespeare_docs, monkeypatch):
    text = "\n".join(shakespeare_docs[:40])
    expected = gpt2.tokenize(text)
    fresh = pickle.loads(pickle.dumps(gpt2))
    monkeypatch.setattr(gpt2_bpe, "_CACHE_LIMIT", 16)
    assert fresh.tokenize(text) == expected
    assert len(fresh._cache) <= 16


def test_gpt2_whitespace_sets_are_the_patterns_whitespace():
    """tokenize_many's ASCII / non-ASCII whitespace sets together are exactly what ``\\s`` matches in the
    pre-tokenization patterns (Unicode White_Space)."""
    import regex

    every_character = "".join(map(chr, range(0x110000)))
    whitespace = [ord(char) for char in regex.findall(r"\s", every_character)]
    assert set(gpt2_bpe._ASCII_WHITESPACE) == {code for code in whitespace if code < 128}
    assert [ord(char) for char in gpt2_bpe._NON_ASCII_WHITESPACE.findall(every_character)] == \
        [code for code in whitespace if code >= 128]


def test_gpt2_lone_surrogate_raises(gpt2):
    with pytest.raises(UnicodeEncodeError):
        gpt2.tokenize("bad \ud800 text")


def test_gpt2_missing_and_malformed_files(shared_data, tmp_path):
    merges = str(shared_data / "gpt2-merges.txt")
    vocab = str(shared_data / "gpt2-vocab.json")
    with pytest.raises(FileNotFoundError, match=r"--vocab-file.*nope\.json"):
        GPT2BPETokenizer(str(tmp_path / "nope.json"), merges)
    with pytest.raises(FileNotFoundError, match=r"--merge-file.*nope\.txt"):
        GPT2BPETokenizer(vocab, str(tmp_path / "nope.txt"))
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree symbols here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"merges\.txt:3"):
        GPT2BPETokenizer(vocab, str(bad_merges))
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--vocab-file .*vocab\.json"):
        GPT2BPETokenizer(str(bad_vocab), merges)


# ------------------------------------------------------------------ SentencePiece


def test_sentencepiece_matches_library_and_megatron_specials(sp_model, shakespeare_docs):
    tokenizer = SentencePieceTokenizer(sp_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    for text in shakespeare_docs[:100]:
        assert tokenizer.tokenize(text) == reference.encode(text)
    # Megatron appends <CLS>, <SEP>, <EOD>, <MASK>, <PAD> after the 8,000 pieces; <s>, </s> exist.
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad) == (8000, 8001, 8002, 8003, 8004)
    assert (tokenizer.bos, tokenizer.eos) == (reference.bos_id(), reference.eos_id())
    assert tokenizer.vocab_size == 8005 == len(tokenizer.inv_vocab)
    assert tokenizer.vocab["<EOD>"] == 8002


def test_sentencepiece_special_text_and_detokenize(sp_model):
    tokenizer = SentencePieceTokenizer(sp_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    ids = tokenizer.tokenize("First Citizen<EOD>Speak</s>")
    assert ids == reference.encode("First Citizen") + [8002] + reference.encode("Speak") + [reference.eos_id()]
    assert tokenizer.detokenize(ids) == "First Citizen <EOD> Speak </s> "
    assert tokenizer.detokenize(reference.encode("Before we proceed")) == "Before we proceed"
    extra = SentencePieceTokenizer(sp_model, vocab_extra_ids=3)
    assert extra.additional_special_tokens_ids == [8005, 8006, 8007]
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize("Speak, speak.") == tokenizer.tokenize("Speak, speak.")


def test_gpt_sentencepiece(sp_model):
    tokenizer = GPTSentencePieceTokenizer(sp_model)
    reference = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    assert tokenizer.vocab_size == 8000
    assert tokenizer.eod == tokenizer.eos == reference.eos_id()
    assert tokenizer.pad == -1
    assert tokenizer.tokenize("<EOD> citizens") == reference.encode("<EOD> citizens")
    assert tokenizer.detokenize(tokenizer.tokenize("All citizens")) == "All citizens"


def test_sentencepiece_missing_or_bad_model(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model.*missing\.model"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"--tokenizer-model .*junk\.model"):
        GPTSentencePieceTokenizer(str(junk))


# ------------------------------------------------------------------ Null


def test_null_tokenizer():
    """Megatron's NullTokenizer: eod is --vocab-size itself, so the vocabulary holds --vocab-size + 1 ids."""
    tokenizer = NullTokenizer(100)
    assert tokenizer.tokenize("3 1  4\n1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.tokenize("") == []
    assert tokenizer.detokenize([3, 1, 4]) == "3 1 4"
    assert tokenizer.eod == 100 and tokenizer.pad == -1 and tokenizer.vocab_size == 101
    assert tokenizer.tokenize("0 100") == [0, 100]  # the eod id is in the vocabulary
    assert len(tokenizer.vocab) == 101 and tokenizer.inv_vocab[100] == "100"
    assert NullTokenizer(100, eod_id=0, pad_id=1).eod == 0
    assert NullTokenizer(100, eod_id=99).vocab_size == 101
    with pytest.raises(ValueError, match="'x'"):
        tokenizer.tokenize("1 x")
    with pytest.raises(ValueError, match=r"id 101 is outside the vocabulary \[0, 100\]"):
        tokenizer.tokenize("101")
    with pytest.raises(ValueError, match="id -1 is outside"):
        tokenizer.tokenize("-1")
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id"):
        NullTokenizer(10, eod_id=11)
    with pytest.raises(ValueError, match="--vocab-size"):
        NullTokenizer(None)


def test_base_class_reports_missing_special_ids():
    class Letters(MegatronTokenizer):
        vocab_size = property(lambda self: 26)
        vocab = property(lambda self: {chr(97 + i): i for i in range(26)})
        inv_vocab = property(lambda self: {i: chr(97 + i) for i in range(26)})

        def tokenize(self, text):
            return [ord(c) - 97 for c in text]

        def detokenize(self, ids):
            return "".join(chr(97 + i) for i in ids)

    letters = Letters()
    assert letters.eod is None and letters.bos is None and letters.pad == -1
    assert letters.detokenize(letters.tokenize("abc")) == "abc"


# ------------------------------------------------------------------ flags and factory


def test_tokenizer_flag_defaults():
    args = _parse([])
    assert args.tokenizer_type is None and args.vocab_file is None and args.merge_file is None
    assert args.tokenizer_model is None and args.vocab_size is None and args.padded_vocab_size is None
    assert args.vocab_extra_ids == 0 and args.tiktoken_num_special_tokens == 1000
    assert args.null_tokenizer_eod_id is None and args.null_tokenizer_pad_id == -1
    assert args.trust_remote_code is False and args.tokenizer_special_tokens is None
    assert args.tokenizer_hf_use_fast is True and args.tokenizer_hf_include_special_tokens is True
    with pytest.raises(SystemExit):
        _parse(["--tokenizer-type", "NoSuchTokenizer"])


def _reference_padding(size, multiple):
    padded = size
    while padded % multiple:
        padded += 1
    return padded


@pytest.mark.parametrize("divisible_by,tp", [(128, 1), (128, 2), (64, 4), (1, 1)])
def test_padded_vocab_size(divisible_by, tp):
    args = argparse.Namespace(make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp, rank=1)
    for size in (50257, 8005, 8000, 1):
        assert _vocab_size_with_padding(size, args) == _reference_padding(size, divisible_by * tp)


def test_build_tokenizer_gpt2_pads_and_prints_on_rank0(shared_data, capsys):
    args = _parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(shared_data / "gpt2-vocab.json"),
                   "--merge-file", str(shared_data / "gpt2-merges.txt")])
    tokenizer = build_tokenizer(args)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert args.padded_vocab_size == 50304
    assert "building GPT2BPETokenizer tokenizer ..." in capsys.readouterr().out
    args.rank = 3
    args.padded_vocab_size = 60000
    build_tokenizer(args)
    assert args.padded_vocab_size == 60000
    assert capsys.readouterr().out == ""


def test_build_tokenizer_other_types(sp_model):
    args = _parse(["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model])
    args.rank = 1
    assert build_tokenizer(args).eod == 8002 and args.padded_vocab_size == 8064
    args = _parse(["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model])
    args.rank, args.tensor_model_parallel_size = 1, 4
    assert build_tokenizer(args).vocab_size == 8000 and args.padded_vocab_size == 8192
    args = _parse(["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--null-tokenizer-eod-id", "5"])
    args.rank = 1
    assert build_tokenizer(args).eod == 5 and args.padded_vocab_size == 1024
    # As Megatron: 128 ids plus the eod id 128 make 129, padded to the next multiple of 128.
    args = _parse(["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"])
    args.rank = 1
    assert build_tokenizer(args).eod == 128 and args.padded_vocab_size == 256


def test_build_tokenizer_errors(tmp_path):
    args = _parse(["--tokenizer-type", "BertWordPieceCase"])
    with pytest.raises(ValueError, match=r"--tokenizer-type BertWordPieceCase.*GPT2BPETokenizer"):
        build_tokenizer(args)
    with pytest.raises(ValueError, match="--tokenizer-type is required"):
        build_tokenizer(_parse([]))
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer(_parse(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"]))
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer(_parse(["--tokenizer-type", "NullTokenizer"]))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer(_parse(["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                str(tmp_path / "x.model")]))
