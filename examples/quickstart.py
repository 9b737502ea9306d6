"""End-to-end quickstart with nothing downloaded: corpus -> SentencePiece tokenizer -> .bin/.idx -> 2-rank GPT.

The corpus is the docstrings of Python's own standard library (present in every Python install),
one JSON document per docstring. Everything is written under ``--out`` (default ``quickstart_out/``).

    python examples/quickstart.py                # build everything and train ~300 iterations on 2 CPU ranks
    python examples/quickstart.py --train-iters 50 --nproc 1
    python examples/quickstart.py --corpus-mb 0.05 --vocab-size 600 --train-iters 3 --nproc 1   # CI's smoke run
"""
import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_corpus(jsonl_path: Path, max_bytes: int) -> int:
    """Write stdlib docstrings as JSONL ``{"id", "text"}`` in a fixed order. Returns the document count."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    written, count = 0, 0
    with open(jsonl_path, "w", encoding="utf-8") as out:
        for source in sources:
            try:
                tree = ast.parse(source.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are templates or use other encodings
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        line = json.dumps({"id": count, "text": doc}, ensure_ascii=False)
                        out.write(line + "\n")
                        written += len(line) + 1
                        count += 1
                        if written >= max_bytes:
                            return count
    return count


def train_tokenizer(jsonl_path: Path, model_prefix: Path, vocab_size: int) -> Path:
    """Train a byte-fallback BPE SentencePiece model on the corpus text."""
    import sentencepiece as spm

    text_path = model_prefix.with_suffix(".txt")
    with open(jsonl_path, encoding="utf-8") as src, open(text_path, "w", encoding="utf-8") as dst:
        for line in src:
            dst.write(json.loads(line)["text"] + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text_path), model_prefix=str(model_prefix), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, input_sentence_size=200000, shuffle_input_sentence=True,
        num_threads=2, minloglevel=2,
    )
    return model_prefix.with_suffix(".model")


def run(cmd):
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO_ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO_ROOT / "quickstart_out"), help="output folder")
    parser.add_argument("--corpus-mb", type=float, default=2.0, help="corpus size in MB")
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2, help="ranks for torchrun (data parallel)")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "stdlib_docs.jsonl"
    n_docs = build_corpus(corpus, int(args.corpus_mb * 1e6))
    print(f"corpus: {n_docs} documents, {corpus.stat().st_size / 1e6:.2f} MB -> {corpus}", flush=True)
    model = train_tokenizer(corpus, out / "tokenizer", args.vocab_size)
    print(f"tokenizer: {model}", flush=True)

    tokenizer_flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", out / "stdlib",
         "--append-eod", "--workers", "2", "--log-interval", "5000", *tokenizer_flags])

    # Short runs (CI's smoke run) still warm up below --train-iters and log a few iterations.
    warmup, log_interval = min(20, args.train_iters // 10), min(25, max(1, args.train_iters // 3))
    env_threads = {"OMP_NUM_THREADS": "1"}
    os.environ.update(env_threads)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", args.nproc,
         "pretrain_gpt.py",
         "--num-layers", 4, "--hidden-size", 128, "--num-attention-heads", 4, "--seq-length", 128,
         "--max-position-embeddings", 128, "--micro-batch-size", 4, "--global-batch-size", 16,
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", warmup,
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--train-iters", args.train_iters,
         "--data-path", out / "stdlib_text_document", "--split", "98,2,0",
         "--eval-interval", 100, "--eval-iters", 5, "--log-interval", log_interval, "--num-workers", 1,
         "--save", out / "checkpoints", "--save-interval", 1000, "--tensorboard-dir", out / "tensorboard",
         "--distributed-backend", "gloo", *tokenizer_flags])
    print(f"done: checkpoints in {out / 'checkpoints'}, TensorBoard logs in {out / 'tensorboard'}", flush=True)


if __name__ == "__main__":
    main()
