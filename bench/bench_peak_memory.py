"""Benchmark: peak resident memory of each pretrain_gpt.py rank against a plain PyTorch loop of the same model.

``python bench/bench_peak_memory.py [--iters 40] [--repeats 3] [--ranks 1 2] [--baseline-ref REF ...]
[--env NAME=VALUE ...] [--trace-ops] [--data FLAGS] [--num-workers N] [--json FILE]``

In every repeat, one after the other from this process and with the same environment:

* two plain loops, one process each: a nanoGPT-style model and this checkout's ``GPTModel`` used
  directly, ``torch.optim.AdamW``, grad clipping, nothing else (no DDP wrapper, no optimizer wrapper,
  no data loader, no training loop);
* ``pretrain_gpt.py`` of this checkout on 1 rank and on 2 data-parallel ranks (torchrun, gloo);
* for each ``--baseline-ref``, ``pretrain_gpt.py`` of that commit, extracted with ``git archive``
  into a temporary folder (nothing is checked out here), on the same rank counts: the code of a
  week ago measured in the same run.

Same shape as ``bench_training.py`` (4 layers, hidden 128, 4 heads, seq 128, GPT-2 vocabulary padded to
50,304, tied embeddings, no dropout), micro batch 8, global batch 16 (2 micro-batches on 1 rank, 1 per
rank on 2), random tokens (``--mock-data`` for the trainer). At this size the fp32 logits of one
micro-batch are 8 x 128 x 50,304 x 4 B = 196 MiB, so anything logits- or activation-sized the trainer
keeps shows.

Reported per run and rank (see ``peak_rank.py``): the peak RSS (``VmHWM``) and the heap malloc holds
between two steps (``mallinfo2``; the median over the steps after the first), with ``--trace-ops`` the
peak heap in use within a step, then the ranges over the repeats and the ratios of median peak RSS
trainer / plain loop (this checkout's ``GPTModel``) and trainer / each baseline. Peak RSS, not time,
so it can be measured on a shared machine.

Reading it: the held and traced figures count live memory only and repeat to a fraction of a MiB;
the peak RSS also counts freed memory glibc keeps in its heap, which depends on its dynamic mmap
threshold and varied by up to 8 % between runs of the same code (bench/RESULTS.md). For a comparison
of RSS that follows the live memory, pin the thresholds for every run: ``--env MALLOC_MMAP_THRESHOLD_=131072 --env
MALLOC_TRIM_THRESHOLD_=131072`` (the environment of all runs is the same; ``MALLOC_*`` of the
caller's environment is dropped).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
LAYERS, HIDDEN, HEADS, SEQ, MBS, GBS, VOCAB = 4, 128, 4, 128, 8, 16, 50304
MOCK_DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 50257"


def plain_loop(kind: str, iters: int) -> dict:
    """One process's plain training loop; returns ``peak_rank``'s record (peak RSS, heap held between steps)."""
    import torch

    from peak_rank import OpPeakTracer, heap_in_use_mib, peak_rss_mib

    torch.manual_seed(1234)

    def GPT():  # the nanoGPT-style reference model (bench/nanogpt_model.py)
        from nanogpt_model import build_nanogpt
        return build_nanogpt(LAYERS, HIDDEN, HEADS, SEQ, VOCAB)

    if kind == "gptmodel":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0, gradient_accumulation_fusion=False)
        model = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
        positions = torch.arange(SEQ).expand(MBS, SEQ)

        def forward(tokens, labels):
            return model(tokens, positions, None, labels=labels).mean()
    else:
        model = GPT()
        forward = model
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(0)
    def step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(GBS // MBS):
            chunk = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
            loss = forward(chunk[:, :-1], chunk[:, 1:]) / (GBS // MBS)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    tracer = OpPeakTracer() if os.environ.get("PEAK_TRACE_OPS", "0") == "1" else None
    record = {"rank": 0, "held_mib": [], "hwm_after_step_mib": [], "op_peaks": []}
    for _ in range(iters):
        if tracer is None:
            step()
        else:
            record["op_peaks"].append(tracer.step(step)[1])
        record["held_mib"].append(heap_in_use_mib())
        record["hwm_after_step_mib"].append(peak_rss_mib()["vm_hwm_mib"])
    return {**record, **peak_rss_mib()}


def trainer_flags(iters: int, data: str = MOCK_DATA, num_workers: int = 0) -> list:
    """pretrain_gpt.py flags of the benchmark's model, batch and run (gloo); ``data``: data and tokenizer flags."""
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MBS),
        "--global-batch-size", str(GBS), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-3", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--train-iters", str(iters), "--log-interval", "10", "--eval-iters", "0", "--eval-interval", str(iters + 1),
        *data.split(), "--num-workers", str(num_workers), "--distributed-backend", "gloo", "--seed", "1234",
    ]


def run_trainer(checkout: Path, ranks: int, flags: list, env: dict, timeout: int) -> list:
    """``checkout``'s pretrain_gpt.py under peak_rank.py on ``ranks`` ranks; returns the records by rank."""
    env = dict(env, PYTHONPATH=str(checkout))
    with tempfile.TemporaryDirectory(prefix="peak_") as out:
        env["PEAK_OUT"] = out
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(BENCH / "peak_rank.py"), str(checkout / "pretrain_gpt.py"), *flags]
        result = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{checkout}/pretrain_gpt.py on {ranks} rank(s) failed:\n{result.stdout[-3000:]}\n"
                               f"{result.stderr[-3000:]}")
        return sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])


def run_plain(kind: str, iters: int, env: dict, timeout: int) -> list:
    """A plain loop in a child process (its own peak); returns [record]."""
    result = subprocess.run([sys.executable, __file__, "--plain-loop", kind, "--iters", str(iters)],
                            env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"plain loop {kind} failed:\n{result.stderr[-3000:]}")
    return [json.loads(result.stdout.strip().splitlines()[-1])]


def extract(ref: str, into: Path) -> Path:
    """This repository's tree at ``ref`` in ``into`` (``git archive``: no checkout, no worktree to clean up)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def held_median(record: dict) -> float:
    values = record["held_mib"][1:] or record["held_mib"]
    return statistics.median(values) if values else float("nan")


def traced_peak(record: dict) -> float:
    """The highest heap-in-use peak of the traced steps after the first (NaN when not traced)."""
    peaks = [p["in_use_mib"] for p in record.get("op_peaks", [])[1:]]
    return max(peaks) if peaks else float("nan")


def fmt_range(values) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:,.0f}" if round(lo) == round(hi) else f"{lo:,.0f}-{hi:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40, help="training iterations per run (default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all runs (default 3)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="trainer rank counts (default 1 2)")
    parser.add_argument("--baseline-ref", action="append", default=[], metavar="REF",
                        help="git ref whose pretrain_gpt.py is measured too (repeatable), e.g. HEAD~20")
    parser.add_argument("--data", default=MOCK_DATA, help="data and tokenizer flags of pretrain_gpt.py (default: mock "
                        "data, GPT-2's vocabulary size); e.g. '--data-path PREFIX --split 100,0,0 --tokenizer-type "
                        "GPT2BPETokenizer --vocab-file V --merge-file M' for a preprocessed corpus")
    parser.add_argument("--num-workers", type=int, default=0, help="--num-workers of the trainer (default 0)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain loops")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment of every run (repeatable), e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--trace-ops", action="store_true", help="also the peak heap in use after each aten op "
                        "(peak_rank.OpPeakTracer; several times slower, use few --iters)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--json", help="also write every record to this file")
    parser.add_argument("--plain-loop", choices=["nanogpt", "gptmodel"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.plain_loop:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        sys.path.insert(0, str(BENCH))
        print(json.dumps(plain_loop(args.plain_loop, args.iters)))
        return

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "OTEL_", "MALLOC_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(item.split("=", 1) for item in args.env)
    if args.trace_ops:
        env["PEAK_TRACE_OPS"] = "1"
    flags = trainer_flags(args.iters, args.data, args.num_workers)
    runs = {}  # name -> list over repeats of [record per rank]
    with tempfile.TemporaryDirectory(prefix="peak_refs_") as tmp:
        checkouts = {"HEAD (this checkout)": REPO}
        for ref in args.baseline_ref:
            sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.strip()
            checkouts[f"{ref} ({sha})"] = extract(ref, Path(tmp) / sha)
        for repeat in range(args.repeats):
            if not args.no_plain:
                for kind, name in (("nanogpt", "plain loop, nanoGPT-style model"),
                                   ("gptmodel", "plain loop, this checkout's GPTModel")):
                    runs.setdefault(name, []).append(run_plain(kind, args.iters, env, args.timeout))
            for ranks in args.ranks:
                for label, checkout in checkouts.items():
                    records = run_trainer(checkout, ranks, flags, env, args.timeout)
                    runs.setdefault(f"pretrain_gpt.py {label}, {ranks} rank(s)", []).append(records)
            print(f"repeat {repeat + 1}: " + "; ".join(
                f"{name}: " + ", ".join(f"{r['vm_hwm_mib']:.0f}" for r in recs[-1]) for name, recs in runs.items()),
                flush=True)

    print(f"\npeak memory, {args.iters} iterations, {args.repeats} repeats, data '{args.data}', env "
          f"{' '.join(args.env) or '(glibc defaults)'}, OMP_NUM_THREADS=1")
    print("| run | rank | peak RSS (VmHWM, MiB) | heap held between steps (MiB) | peak heap in use in a step (MiB, "
          "--trace-ops) |")
    print("|---|---|---|---|---|")
    peaks = {}
    for name, repeats in runs.items():
        for rank in range(len(repeats[0])):
            hwm = [recs[rank]["vm_hwm_mib"] for recs in repeats]
            held = [held_median(recs[rank]) for recs in repeats]
            traced = [traced_peak(recs[rank]) for recs in repeats]
            peaks[(name, rank)] = statistics.median(hwm)
            print(f"| {name} | {rank} | {fmt_range(hwm)} | {fmt_range(held)} | {fmt_range(traced)} |")
    plain = peaks.get(("plain loop, this checkout's GPTModel", 0))
    print("\nratios of median peak RSS")
    for (name, rank), peak in peaks.items():
        if not name.startswith("pretrain_gpt.py HEAD"):
            continue
        line = f"{name}, rank {rank}:"
        if plain:
            line += f" / plain loop (GPTModel) {peak / plain:.3f}"
        for label in list(checkouts)[1:]:
            other = peaks.get((name.replace("HEAD (this checkout)", label), rank))
            if other:
                line += f"; / {label} {peak / other:.3f}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({name: recs for name, recs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
