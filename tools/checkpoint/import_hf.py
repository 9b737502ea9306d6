"""Import a Hugging Face GPT-2, Llama or Mixtral model folder as a legacy checkpoint that pretrain_gpt.py can load.

Reads ``config.json`` and ``model.safetensors`` (or the shards named by
``model.safetensors.index.json``) from ``--load`` and writes a ``release`` legacy checkpoint to ``--save``: one
rank file for each of the ``--target-tensor-parallel-size`` ranks, and the tracker file naming ``release``.
The saved args carry the model flags (printed by this tool) and, when the folder holds tokenizer
files, ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <folder>``. The vocabulary is
padded with zero rows to a multiple of ``--make-vocab-size-divisible-by`` x TP. The checkpoint has
no optimizer or RNG state: continue training with ``--load DIR --finetune`` and the printed flags.

Usage::

    python tools/checkpoint/import_hf.py --load HF_DIR --save CHECKPOINT_DIR --target-tensor-parallel-size 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

import torch  # noqa: E402

from hf_conversion import UnsupportedModelError, hf_to_megatron, megatron_flags_from_hf  # noqa: E402
from legacy_checkpoint import write_checkpoint  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class HFImportError(CheckpointingException):
    """A user-facing failure (missing file, unsupported model)."""


def load_hf_tensors(hf_dir: str) -> Dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index names. Raises HFImportError if none."""
    from safetensors.torch import load_file

    def load(path):
        try:
            return load_file(path)
        except OSError:
            raise
        except Exception as error:  # safetensors' SafetensorError for a damaged or non-safetensors file
            raise HFImportError(f"cannot read {path}: {error}") from None

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load(single)
    if os.path.isfile(index):
        try:
            with open(index) as stream:
                shards = sorted(set(json.load(stream)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise HFImportError(f"cannot read {index}: not a safetensors index ({type(error).__name__}: "
                                f"{error})") from None
        tensors: Dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load(os.path.join(hf_dir, shard)))
        return tensors
    raise HFImportError(f"--load {hf_dir}: no model.safetensors or model.safetensors.index.json")


def megatron_args_for(hf_dir: str, config, tp: int, divisible_by: int, dtype: torch.dtype):
    """The args Namespace saved in the checkpoint: Megatron's defaults plus the model's flags."""
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing.state import sanitized_args

    flags = megatron_flags_from_hf(config)
    flags += ["--tensor-model-parallel-size", str(tp), "--make-vocab-size-divisible-by", str(divisible_by)]
    if any(os.path.isfile(os.path.join(hf_dir, name)) for name in _TOKENIZER_FILES):
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.abspath(hf_dir)]
    if dtype == torch.bfloat16:
        flags.append("--bf16")
    elif dtype == torch.float16:
        flags.append("--fp16")
    args = parse_args(args=flags)
    multiple = divisible_by * tp
    args.padded_vocab_size = int(math.ceil(config.vocab_size / multiple)) * multiple
    return sanitized_args(args), flags


def import_model(hf_dir: str, save_dir: str, tp: int, divisible_by: int) -> dict:
    """Do the import; returns a summary. Raises HFImportError, UnsupportedModelError."""
    import transformers

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise HFImportError(f"--load {hf_dir}: no config.json (not a Hugging Face model folder)")
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    hf = load_hf_tensors(hf_dir)
    dtype = next(iter(hf.values())).dtype
    args, flags = megatron_args_for(hf_dir, config, tp, divisible_by, dtype)
    state = hf_to_megatron(hf, args, args.padded_vocab_size)
    written = write_checkpoint(save_dir, state, args, tp)
    return {"model_type": config.model_type, "files": written, "padded_vocab_size": args.padded_vocab_size,
            "flags": flags}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--load", required=True, help="Hugging Face model folder (config.json, *.safetensors)")
    parser.add_argument("--save", required=True, help="output checkpoint folder")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1, help="TP size of the checkpoint")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this times the TP size (Megatron's default 128)")
    args = parser.parse_args(argv)
    if args.target_tensor_parallel_size < 1 or args.make_vocab_size_divisible_by < 1:
        parser.error("--target-tensor-parallel-size and --make-vocab-size-divisible-by must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tool; 0 on success, 1 with one ``error:`` line on a user error."""
    cli = get_args(argv)
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"error: import_hf needs transformers and safetensors (pip install 'megatron-otel[hf]'): {error}",
              file=sys.stderr)
        return 1
    try:
        summary = import_model(cli.load, cli.save, cli.target_tensor_parallel_size, cli.make_vocab_size_divisible_by)
    except (HFImportError, UnsupportedModelError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"imported {summary['model_type']} model into {cli.save} ({len(summary['files'])} rank file(s), padded "
          f"vocab {summary['padded_vocab_size']}); train from it with --load {cli.save} --finetune and: "
          f"{' '.join(summary['flags'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
