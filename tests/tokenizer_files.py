"""Small tokenizer files built locally for tests (no download): a Hugging Face BPE, a 70,000-word
Hugging Face vocabulary, and a tiktoken vocabulary in Megatron's JSON format."""
import base64
import json
from pathlib import Path

from megatron.core.tokenizers.gpt2_bpe import bytes_to_unicode


def shakespeare_texts(shared_data: Path, count: int):
    """The first ``count`` documents of tinyshakespeare.jsonl."""
    with open(shared_data / "tinyshakespeare.jsonl", encoding="utf-8") as stream:
        return [json.loads(line)["text"] for _, line in zip(range(count), stream)]


def build_hf_bpe_tokenizer(directory: Path, shared_data: Path, vocab_size: int = 500) -> Path:
    """A byte-level BPE trained on Shakespeare with the ``tokenizers`` library, saved with
    ``transformers`` (``<s>`` prepended as BOS by its post-processor, ``</s>`` = eos); returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(shakespeare_texts(shared_data, 500), trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>")
    wrapped.save_pretrained(str(directory))
    return directory


def build_hf_large_vocab_tokenizer(directory: Path, words: int = 70000) -> Path:
    """A word-level tokenizer of ``words`` entries ``w0 .. w{words-1}`` plus ``<unk>`` and ``</s>``
    (ids above 65,535), split on whitespace; returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    vocab["<unk>"] = words
    vocab["</s>"] = words + 1
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(str(directory))
    return directory


def build_tiktoken_vocab(path: Path, shared_data: Path, merges: int = 3000) -> Path:
    """A tiktoken vocabulary in Megatron's JSON format: the 256 bytes in order, then the tokens of
    GPT-2's first ``merges`` merges (as bytes); returns the path."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = [bytes([i]) for i in range(256)]
    seen = set(tokens)
    with open(shared_data / "gpt2-merges.txt", encoding="utf-8") as stream:
        lines = [line.rstrip("\n") for line in stream if not line.startswith("#version")]
    for line in lines[:merges]:
        first, second = line.split(" ")
        token = bytes(byte_of[char] for char in first + second)
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
                "token_str": token.decode("utf-8", errors="replace")} for rank, token in enumerate(tokens)]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path
