"""Benchmark: checkpoint size, save blocking time, load time of the checkpoint formats, as ratios.

For a GPT of ~160M parameters (12 layers, hidden 1024, vocab 8192; fp32 weights 640 MB, with Adam's two
moments a ~1.9 GB checkpoint) trained one step so that the optimizer state exists, one ``torchrun``
launch of this file as a worker measures, in the same processes and repeated ``--repeats`` times
(medians reported; the machine is shared and noisy):

- ``torch`` (legacy): time of ``save_checkpoint`` (a synchronous save), of ``load_checkpoint``;
- ``torch_dist`` synchronous: the same two times;
- ``torch_dist --async-save``: the time the training loop is blocked (``save_checkpoint`` returning plus
  ``wait_for_async_staging``, which the loop calls before its next optimizer step: the copy of the state
  to host memory) and the total time until the background write is finalised and published;
- the bytes on disk of each checkpoint.

Every save is durable (files fsynced before the tracker moves), so save times include the disk's
write speed. Loads read what the save just wrote, mostly from the page cache. The target of the
issue: async blocking time <= 0.2 x the synchronous torch_dist save.

    python bench/bench_checkpoint.py [--repeats 3] [--nproc 1] [--dir /tmp/bench_ckpt] \\
        [--num-layers 12 --hidden-size 1024]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "BENCH_CHECKPOINT_RESULT "


def model_flags(options) -> list:
    return ["--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(max(1, options.hidden_size // 64)), "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", str(options.nproc),
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8191", "--lr", "1e-4",
            "--train-iters", "10", "--eval-iters", "0", "--num-workers", "0", "--seed", "1234",
            "--distributed-backend", "gloo", "--log-interval", "1000", "--use-cpu-initialization",
            "--save", str(Path(options.dir) / "unused"), "--save-interval", "1000", "--ckpt-format", "torch"]


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return total


def worker(argv: list, options) -> None:
    """All ranks: build model + optimizer as pretrain_gpt.py does, one train step, then the timed
    saves and loads; rank 0 prints one JSON line of {measure: [seconds per repeat]}."""
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import (
        build_train_valid_test_data_iterators,
        setup_model_and_optimizer,
        train_step,
    )

    initialize_megatron(argv=argv)
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider)
    train_iterator, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    def step():
        train_step(pretrain_gpt.forward_step, train_iterator, model, optimizer, scheduler)

    step()  # creates Adam's state
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    rank = dist.get_rank()
    results = {"params": params}

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def record(name, value):
        results.setdefault(name, []).append(value)

    formats = [name for name in ("torch", "torch_dist", "torch_dist_async") if name in options.formats]
    step()  # warm-up
    for repeat in range(options.repeats):
        for name in formats:
            folder = os.path.join(options.dir, f"{name}_{repeat}")
            args.save = args.load = folder
            args.ckpt_format = "torch" if name == "torch" else "torch_dist"
            args.async_save = name == "torch_dist_async"
            if name == "torch_dist_async":
                dist.barrier()
                start = time.perf_counter()
                checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
                returned = time.perf_counter() - start
                # The loop runs on after the call, but waits for the copy to host memory before its next
                # optimizer step: the blocking time is the call plus that wait (an upper bound).
                checkpointing.wait_for_async_staging()
                record(f"{name} save returns", returned)
                record(f"{name} save blocking", time.perf_counter() - start)
                writer = checkpointing._PENDING[0][0] if getattr(checkpointing, "_PENDING", None) else None
                checkpointing.finalize_async_save(blocking=True)
                dist.barrier()
                record(f"{name} save total", time.perf_counter() - start)
                if writer is not None:  # where the blocking time goes: the copy of the state to host memory
                    record(f"{name} staging", writer.staging_seconds)
                    record(f"{name} writing", writer.writing_seconds)
                # In the loop: the save call, then a training step, which overlaps the copy with its forward
                # and backward and waits for it only before the optimizer step; the background write then
                # shares the CPU with the step. The loop's loss is this minus a plain step.
                args.save = folder + "_in_loop"
                record("train step", timed(step))  # the reference, measured next to it (the machine is noisy)
                dist.barrier()
                start = time.perf_counter()
                checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
                step()
                dist.barrier()
                record(f"{name} save + step", time.perf_counter() - start)
                checkpointing.finalize_async_save(blocking=True)
                if rank == 0:
                    shutil.rmtree(args.save, ignore_errors=True)
                args.save = folder
            else:
                record(f"{name} save", timed(lambda: checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)))
            if rank == 0:
                record(f"{name} bytes", _dir_bytes(folder))
            record(f"{name} load", timed(lambda: checkpointing.load_checkpoint(model, optimizer, scheduler)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if rank == 0:
        print(MARK + json.dumps(results), flush=True)


def _median(values):
    return statistics.median(values) if values else float("nan")


def table(results: dict) -> str:
    """The measures as a Markdown table (medians, seconds and MB) with the ratios of the issue."""
    rows = []
    sync = _median(results.get("torch_dist save", []))
    legacy = _median(results.get("torch save", []))
    for name in ("torch", "torch_dist", "torch_dist_async"):
        if f"{name} load" not in results:
            continue
        save = results.get(f"{name} save") or results.get(f"{name} save blocking")
        size = _median(results[f"{name} bytes"]) / 1e6
        rows.append((name, size, _median(save), _median(results.get(f"{name} save total", [])),
                     _median(results[f"{name} load"])))
    lines = ["| format | size (MB) | save: blocking (s) | save: total (s) | load (s) | blocking / sync torch_dist save "
             "| blocking / torch save |", "|---|---|---|---|---|---|---|"]
    if "torch_dist_async save returns" in results:
        step = _median(results["train step"])
        in_loop = _median([with_save - alone for with_save, alone in zip(results["torch_dist_async save + step"],
                                                                         results["train step"])])
        lines.insert(0, f"async: the save call returns after {_median(results['torch_dist_async save returns']):.3f} s; "
                        f"blocking adds the wait for the copy to host memory (staging "
                        f"{_median(results.get('torch_dist_async staging', [])):.2f} s, background write "
                        f"{_median(results.get('torch_dist_async writing', [])):.2f} s). In the loop, save + one "
                        f"training step take {in_loop:.2f} s more than a step alone ({step:.2f} s): "
                        f"{in_loop / sync:.3f} of the synchronous torch_dist save.\n")
    for name, size, blocking, total, load in rows:
        total_text = f"{total:.2f}" if total == total else f"{blocking:.2f}"
        lines.append(f"| {name} | {size:.0f} | {blocking:.2f} | {total_text} | {load:.2f} | "
                     f"{blocking / sync:.3f} | {blocking / legacy:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="ranks (data-parallel; each writes its shards)")
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp/bench_checkpoint", help="folder for the checkpoints (emptied)")
    parser.add_argument("--formats", default="torch,torch_dist,torch_dist_async",
                        help="comma-separated subset of torch, torch_dist, torch_dist_async")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options, rest = parser.parse_known_args(argv)
    options.formats = options.formats.split(",")
    if options.worker:  # this parser took the model's --num-layers / --hidden-size: give them back
        worker([*rest, "--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size)], options)
        return {}
    shutil.rmtree(options.dir, ignore_errors=True)
    os.makedirs(options.dir)
    passthrough = ["--repeats", str(options.repeats), "--dir", options.dir, "--formats", ",".join(options.formats),
                   "--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(options.nproc),
           str(Path(__file__).resolve()), "--worker", *passthrough, *model_flags(options)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONPATH=str(REPO))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    if result.returncode != 0 or not lines:
        sys.exit(f"bench_checkpoint worker failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                 f"{result.stderr[-3000:]}")
    results = json.loads(lines[0][len(MARK):])
    shutil.rmtree(options.dir, ignore_errors=True)
    print(f"model: {results['params'] / 1e6:.1f}M parameters, {options.nproc} rank(s), {options.repeats} repeats "
          "(medians)")
    print(table(results))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
