"""Export a checkpoint of pretrain_gpt.py (torch at any TP/PP, or torch_dist) to a Hugging Face `transformers` folder.

Writes ``config.json`` (GPT2Config, LlamaConfig or MixtralConfig), ``model.safetensors`` and the tokenizer files
into ``--save``. GPT-2 architecture: learned positions, LayerNorm, GeLU (tied or untied);
Llama architecture: RoPE, RMSNorm, SwiGLU, grouped-query attention (tied or untied); Mixtral architecture
(``MixtralForCausalLM``): the same with MoE layers routed as Mixtral (``--num-experts``, softmax over the top-k
logits, experts in every layer, no shared expert), under the Hub's names (``block_sparse_moe.gate``,
``block_sparse_moe.experts.<e>.w1``/``w3``/``w2``). The padded
vocabulary rows are dropped. Tokenizer files are written for GPT2BPETokenizer (from the vocab and
merge files) and HuggingFaceTokenizer (its own files); other tokenizers are reported and skipped.

Usage::

    python tools/checkpoint/export_hf.py --load CHECKPOINT_DIR --save HF_DIR
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('HF_DIR')"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from convert import ConvertError, read_checkpoint  # noqa: E402
from hf_conversion import UnsupportedModelError, hf_config, megatron_to_hf  # noqa: E402
from legacy_checkpoint import CheckpointLayoutError  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.training.checkpointing.errors import is_checkpoint_user_error  # noqa: E402
from megatron.training.user_errors import one_line  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ExportError(CheckpointingException):
    """A user-facing failure (bad flag, missing file, unsupported model)."""


def _tokenizer_args(ckpt_args, cli) -> argparse.Namespace:
    """The checkpoint's tokenizer flags, with the ones given on this command line taking precedence.

    Whether a Hugging Face tokenizer may run code of its own comes from this command line only
    (``--trust-remote-code``), never from the checkpoint: a checkpoint's saved args would otherwise choose
    both the tokenizer folder and that its Python files run.
    """
    args = argparse.Namespace(**vars(ckpt_args))
    for name in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        value = getattr(cli, name)
        if value is not None:
            setattr(args, name, value)
    args.trust_remote_code = cli.trust_remote_code
    if cli.trust_remote_code and cli.tokenizer_model is None:
        raise ExportError("--trust-remote-code needs --tokenizer-model: the checkpoint's saved tokenizer path "
                          f"({getattr(ckpt_args, 'tokenizer_model', None)}) is not trusted to choose code to run")
    args.rank = 1  # silences build_tokenizer's messages
    return args


def _build_tokenizer(args):
    from megatron.training.tokenizer import build_tokenizer

    saved = args.padded_vocab_size
    try:
        return build_tokenizer(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        raise ExportError(f"cannot rebuild the checkpoint's tokenizer ({error}); give its files with "
                          "--vocab-file/--merge-file/--tokenizer-model, or --vocab-size") from None
    finally:
        args.padded_vocab_size = saved


def _gpt2_hf_tokenizer(vocab_file: str, merge_file: str):
    """GPT-2's byte-level BPE as a ``transformers`` fast tokenizer, built with the ``tokenizers`` library
    (the same on transformers 4 and 5, whose GPT2TokenizerFast constructors differ)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    end_of_text = "<|endoftext|>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=end_of_text,
                                                eos_token=end_of_text, unk_token=end_of_text)


def save_tokenizer_files(args, save_dir: str) -> Optional[str]:
    """Write HF tokenizer files for the checkpoint's tokenizer; returns what was written or None (skipped)."""
    import transformers

    kind = getattr(args, "tokenizer_type", None)
    if kind == "GPT2BPETokenizer":
        tokenizer = _gpt2_hf_tokenizer(args.vocab_file, args.merge_file)
    elif kind == "HuggingFaceTokenizer":
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                args.tokenizer_model, trust_remote_code=args.trust_remote_code)
        except ValueError as error:  # e.g. a folder whose code would need --trust-remote-code: the user's input
            raise ExportError(str(error)) from None
    else:
        return None
    tokenizer.save_pretrained(save_dir)
    return type(tokenizer).__name__


def export(load_dir: str, save_dir: str, cli) -> dict:
    """Do the export; returns a summary. Raises ExportError, ConvertError (the checkpoint folder is not one
    this tool reads), UnsupportedModelError."""
    from safetensors.torch import save_file

    try:
        full = read_checkpoint(load_dir, cli.iteration, with_optimizer=False,
                               verify=not getattr(cli, "no_verify_checkpoint", False))
    except ConvertError as error:  # the reader speaks of convert.py's --load-dir; this tool's flag is --load
        raise ConvertError(str(error).replace("--load-dir ", "--load ")) from None
    state, ckpt_args, info = full.model, full.args, full.layout
    tokenizer_args = _tokenizer_args(ckpt_args, cli)
    tokenizer = None
    if cli.vocab_size is not None:
        vocab_size = cli.vocab_size
    else:
        tokenizer = _build_tokenizer(tokenizer_args)
        vocab_size = tokenizer.vocab_size
    padded = state["embedding.word_embeddings.weight"].size(0)
    if not 0 < vocab_size <= padded:
        raise ExportError(f"vocabulary size {vocab_size} does not fit the checkpoint's {padded} embedding rows")
    dtype = _DTYPES[cli.dtype] if cli.dtype else state["embedding.word_embeddings.weight"].dtype
    tensors = {key: value.to(dtype) for key, value in megatron_to_hf(state, ckpt_args, vocab_size).items()}
    bos = eos = None
    if tokenizer is not None:
        bos, eos = getattr(tokenizer, "bos", None), getattr(tokenizer, "eod", None)
    config = hf_config(ckpt_args, vocab_size, bos_id=bos, eos_id=eos, dtype=dtype)
    os.makedirs(save_dir, exist_ok=True)
    config.save_pretrained(save_dir)
    save_file(tensors, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})
    written = save_tokenizer_files(tokenizer_args, save_dir) if not cli.no_tokenizer else None
    return {"architecture": config.model_type, "tp": info["tp"], "pp": info["pp"], "vocab_size": vocab_size,
            "tensors": len(tensors), "tokenizer": written, "dtype": str(dtype)}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--load", required=True, help="checkpoint folder written by pretrain_gpt.py --save")
    parser.add_argument("--save", required=True, help="output folder for the Hugging Face model")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="true vocabulary size (default: from the checkpoint's tokenizer)")
    parser.add_argument("--tokenizer-type", default=None, help="override the checkpoint's --tokenizer-type")
    parser.add_argument("--tokenizer-model", default=None, help="override the checkpoint's --tokenizer-model")
    parser.add_argument("--vocab-file", default=None, help="override the checkpoint's --vocab-file")
    parser.add_argument("--merge-file", default=None, help="override the checkpoint's --merge-file")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="dtype of the saved weights (default: the checkpoint's)")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let the HuggingFaceTokenizer given by --tokenizer-model run its own Python code "
                             "(never taken from the checkpoint)")
    parser.add_argument("--no-verify-checkpoint", action="store_true",
                        help="do not check the checkpoint's files against its integrity manifest (CRC-32)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tool; 0 on success, 1 with one ``error:`` line on a user error."""
    cli = get_args(argv)
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"error: export_hf needs transformers and safetensors (pip install 'megatron-otel[hf]'): {error}",
              file=sys.stderr)
        return 1
    try:
        summary = export(cli.load, cli.save, cli)
    except Exception as error:  # a bad flag, or a checkpoint missing, damaged, unsafe or of another model
        if not isinstance(error, (ExportError, ConvertError, CheckpointLayoutError, UnsupportedModelError)) and \
                not is_checkpoint_user_error(error):
            raise
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 1
    if summary["tokenizer"] is None and not cli.no_tokenizer:
        print("warning: no tokenizer files written (only GPT2BPETokenizer and HuggingFaceTokenizer are exported)",
              file=sys.stderr)
    print(f"exported {summary['architecture']} model (from TP={summary['tp']}, PP={summary['pp']}; "
          f"vocab {summary['vocab_size']}; {summary['tensors']} tensors, {summary['dtype']}) to {cli.save}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
