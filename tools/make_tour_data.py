"""Build the README tour's data offline: English prose as JSON lines and a SentencePiece tokenizer for it.

The text is the Python Language Reference's topic pages that every CPython install ships for
``help()`` (``pydoc_data.topics``; Python Software Foundation License), one JSON document
``{"id": N, "topic": TOPIC, "text": ...}`` per section of about 1,000 characters or more (whole
paragraphs), topics in sorted order. Nothing is downloaded and only
the project's own dependencies are used (sentencepiece trains the tokenizer).

    python tools/make_tour_data.py --out runs/tour/data
    # -> runs/tour/data/pydocs.jsonl (about 0.5 MB) and runs/tour/data/pydocs_sp.model (4,000 pieces)
"""
import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def sections(text: str, min_chars: int = 1000):
    """``text`` cut at blank lines into runs of whole paragraphs of at least ``min_chars`` (the last may be
    shorter)."""
    run = []
    for paragraph in (part.strip("\n") for part in text.split("\n\n")):
        if paragraph.strip():
            run.append(paragraph)
        if run and sum(len(part) for part in run) >= min_chars:
            yield "\n\n".join(run)
            run = []
    if run:
        yield "\n\n".join(run)


def build_corpus(jsonl_path: Path) -> int:
    """Write the topic pages' sections as JSONL; returns the number of documents.

    Raises:
        SystemExit: this Python was installed without ``pydoc_data`` (some distributions split it off).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise SystemExit("error: this Python has no pydoc_data module (the help() topics); install your "
                         "distribution's full standard library (Debian: libpython3-stdlib) or use your own JSONL")
    count = 0
    with open(jsonl_path, "w", encoding="utf-8") as out:
        for topic in sorted(topics):
            for text in sections(topics[topic]):
                out.write(json.dumps({"id": count, "topic": topic, "text": text}, ensure_ascii=False) + "\n")
                count += 1
    return count


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for pydocs.jsonl and pydocs_sp.model")
    parser.add_argument("--vocab-size", type=int, default=4000, help="SentencePiece vocabulary size")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT / "examples"))
    from quickstart import train_tokenizer  # the quickstart's byte-fallback BPE trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "pydocs.jsonl"
    count = build_corpus(corpus)
    model = train_tokenizer(corpus, out / "pydocs_sp", args.vocab_size)
    print(f"{corpus}: {count} documents, {corpus.stat().st_size / 1e6:.2f} MB; tokenizer {model}", flush=True)


if __name__ == "__main__":
    main()
