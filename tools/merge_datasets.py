"""Concatenate every `X.bin/X.idx` dataset in a folder, in sorted name order, into one dataset.

The token dtype is taken from the first dataset; one with a different dtype is an error. `.bin`
bytes are copied verbatim and document indices are offset, as Megatron-LM's tool does. Output is
written under temporary names and renamed only when complete.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)


class MergeError(Exception):
    """A user-facing failure: bad folder, unpaired file, dtype mismatch or unreadable dataset."""


def find_prefixes(directory: str) -> List[str]:
    """Sorted prefixes (full paths) of the `.bin/.idx` pairs in ``directory``.

    Files with other extensions are ignored. Raises MergeError for a `.bin` without its `.idx`
    (or the reverse) and for a folder with no pair.
    """
    names = {}
    for basename in os.listdir(directory):
        stem, ext = os.path.splitext(basename)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, basename)):
            names.setdefault(stem, set()).add(ext)
    for stem, exts in sorted(names.items()):
        if exts != {".bin", ".idx"}:
            missing = ".idx" if ".bin" in exts else ".bin"
            raise MergeError(f"--input {directory}: {stem}{missing} is missing for {stem}{exts.pop()}")
    if not names:
        raise MergeError(f"--input {directory}: no .bin/.idx pair found")
    return [os.path.join(directory, stem) for stem in sorted(names)]


def merge_datasets(prefixes: List[str], output_prefix: str, multimodal: bool = False) -> None:
    """Write ``output_prefix.bin/.idx`` holding every dataset of ``prefixes`` in the given order.

    Raises MergeError if a dataset cannot be read or its dtype differs from the first one's;
    no output is left behind then.
    """
    try:
        dtype = IndexedDataset(prefixes[0], multimodal=multimodal).dtype
    except (OSError, ValueError) as error:
        raise MergeError(str(error)) from None
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    temp_bin, temp_idx = f"{bin_path}.tmp{os.getpid()}", f"{idx_path}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(temp_bin, dtype=dtype, multimodal=multimodal)
    try:
        for prefix in prefixes:
            try:
                builder.add_index(prefix)
            except (OSError, ValueError) as error:
                raise MergeError(f"{prefix}: {error}") from None
        builder.finalize(temp_idx)
        os.replace(temp_bin, bin_path)
        os.replace(temp_idx, idx_path)
    except BaseException:
        try:  # finalize is the builder's only way to close its stream; the result is deleted below
            builder.finalize(temp_idx)
        except OSError:
            pass
        for path in (temp_bin, temp_idx):
            if os.path.exists(path):
                os.remove(path)
        raise


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse Megatron's merge_datasets flags; errors name the flag."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to directory containing all document files to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true", help="Whether the datasets are assumed to be multimodal")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input} is not a directory")
    parent = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(parent):
        parser.error(f"--output-prefix {args.output_prefix}: folder {parent} does not exist")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tool; returns the exit status (0 ok, 1 error)."""
    args = get_args(argv)
    try:
        prefixes = find_prefixes(args.input)
        merge_datasets(prefixes, args.output_prefix, args.multimodal)
    except MergeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
