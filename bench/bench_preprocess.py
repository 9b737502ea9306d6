"""Print the end-to-end throughput (MB/s, start-up included) of tools/preprocess_data.py with GPT-2 BPE.

Both GPT-2 BPE paths are measured in the same run: tiktoken built from the vocab/merge files (the
default when tiktoken is installed) and the pure-Python reference (MEGATRON_GPT2_BPE_BACKEND=python).
The last columns give the tiktoken path's rate over the pure-Python path's and over the reference
tool's 1.1-1.5 MB/s per worker (Megatron-LM's tools/preprocess_data.py on non-repetitive text; the
issue's target is >= 10x per worker).

Runs the tool as a subprocess with --workers 1 and 2 on tinyshakespeare.jsonl and on a generated
corpus (default 8 MB) that does not repeat documents: its words are drawn from the Shakespeare
vocabulary with Zipf-like frequencies plus a share of random made-up words, so the per-word cache
sees a realistic stream of new words instead of replaying the same text. A one-line run measures
the fixed start-up cost, reported separately so the tokenizing rate can be read off as well.
Each figure is the best of --repeats runs, since other load on the machine only ever slows a run.

Usage: python bench/bench_preprocess.py [--generated-mb 8] [--workers 1 2] [--repeats 3]
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
TOOL = REPO_ROOT / "tools" / "preprocess_data.py"


def generate_corpus(path: Path, target_bytes: int, seed: int = 1234) -> None:
    """Write ``target_bytes`` of JSON lines built from Shakespeare's words plus 3% invented words."""
    text = (SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")
    words = re.findall(r"[A-Za-z']+", text)
    counts = {}
    for word in words:
        counts[word] = counts.get(word, 0) + 1
    vocabulary = sorted(counts, key=counts.get, reverse=True)
    cumulative, total = [], 0.0
    for rank in range(len(vocabulary)):
        total += 1.0 / (rank + 1)
        cumulative.append(total)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    written = 0
    with open(path, "w", encoding="utf-8") as stream:
        doc_id = 0
        while written < target_bytes:
            sentences = []
            for _ in range(rng.randint(1, 12)):
                length = rng.randint(4, 18)
                chosen = rng.choices(vocabulary, cum_weights=cumulative, k=length)
                chosen = ["".join(rng.choices(letters, k=rng.randint(3, 10))) if rng.random() < 0.03 else w
                          for w in chosen]
                sentence = " ".join(chosen)
                sentences.append(sentence[:1].upper() + sentence[1:] + rng.choice([".", ",", ";", "!", "?"]))
            line = json.dumps({"id": doc_id, "text": "\n".join(sentences)}) + "\n"
            stream.write(line)
            written += len(line.encode("utf-8"))
            doc_id += 1


# Megatron-LM's own tool, per worker on non-repetitive text (MB/s): the range quoted by issue 14.
REFERENCE_TOOL_MB_S = (1.1, 1.5)
BACKENDS = ("tiktoken", "python")


def run_tool(input_path: Path, workers: int, scratch: Path, repeats: int, backend: str) -> float:
    """Best wall seconds over ``repeats`` tool runs (subprocess, start-up included) with GPT-2 BPE ``backend``.

    Raises CalledProcessError if the tool fails.
    """
    command = [
        sys.executable, str(TOOL), "--input", str(input_path), "--output-prefix", str(scratch / f"out_w{workers}"),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(SHARED_DATA / "gpt2-vocab.json"),
        "--merge-file", str(SHARED_DATA / "gpt2-merges.txt"), "--append-eod", "--workers", str(workers),
        "--log-interval", "100000000",
    ]
    env = dict(os.environ, MEGATRON_GPT2_BPE_BACKEND=backend)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=env)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generated-mb", type=float, default=8.0, help="size of the generated corpus (MB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the fastest is reported")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        tiny = scratch / "one.jsonl"
        tiny.write_text(json.dumps({"text": "Hello world"}) + "\n", encoding="utf-8")
        generated = scratch / "generated.jsonl"
        generate_corpus(generated, int(args.generated_mb * 1e6))
        corpora = [("tinyshakespeare.jsonl", SHARED_DATA / "tinyshakespeare.jsonl"), ("generated", generated)]
        print(f"{'corpus':<22}{'MB':>7}{'workers':>9}{'backend':>10}{'wall s':>9}{'MB/s':>8}"
              f"{'MB/s excl. start-up':>22}{'x python':>10}{'x reference/worker':>20}")
        for workers in args.workers:
            startup = {backend: run_tool(tiny, workers, scratch, args.repeats, backend) for backend in BACKENDS}
            for backend in BACKENDS:
                print(f"{'(start-up, 1 line)':<22}{0:>7.2f}{workers:>9}{backend:>10}{startup[backend]:>9.2f}")
            for name, path in corpora:
                megabytes = os.path.getsize(path) / 1e6
                seconds = {backend: run_tool(path, workers, scratch, args.repeats, backend) for backend in BACKENDS}
                for backend in BACKENDS:
                    rate = megabytes / seconds[backend]
                    net = (f"{megabytes / (seconds[backend] - startup[backend]):.2f}"
                           if seconds[backend] > startup[backend] else "n/a (noisy)")
                    ratio = seconds["python"] / seconds[backend]
                    per_worker = rate / workers
                    versus = f"{per_worker / REFERENCE_TOOL_MB_S[1]:.1f}-{per_worker / REFERENCE_TOOL_MB_S[0]:.1f}"
                    print(f"{name:<22}{megabytes:>7.2f}{workers:>9}{backend:>10}{seconds[backend]:>9.2f}{rate:>8.2f}"
                          f"{net:>22}{ratio:>10.2f}{versus:>20}")

if __name__ == "__main__":
    main()
