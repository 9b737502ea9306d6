"""Benchmark: optimizer-state bytes per rank and step time of data parallelism (DP=2, gloo, CPU) with and
without --overlap-grad-reduce and --use-distributed-optimizer (+ --overlap-param-gather), as ratios to plain DP.

Each layout is one ``torchrun`` launch of this file as a worker: it builds the model, optimizer and data
exactly as ``pretrain_gpt.py`` does (``setup_model_and_optimizer``, mock data), runs ``train_step``
``--iters`` times and reports, per rank, the optimizer-state bytes measured from the optimizer's tensors
(``get_optimizer_state_bytes``: fp32 main params + Adam states) and the median step time after
``--warmup`` steps. The theoretical memory report's optimizer part is printed beside the measurement.

    python bench/bench_dp.py [--iters 12] [--warmup 3] [--bucket-size 250000] [--bf16]

The model (4 layers, hidden 256, seq 128, vocab 8192, 2 micro-batches of 2 per rank) has ~4.7M
parameters; ``--bucket-size`` (elements) splits it into several buckets so that overlap has something to
overlap. On a 2-core machine the two ranks share the cores, so step-time ratios say more about the
cost of the collectives' bookkeeping than about hidden communication.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "plain DP": [],
    "overlap-grad-reduce": ["--overlap-grad-reduce"],
    "distributed optimizer": ["--use-distributed-optimizer"],
    "distopt + overlap grad/param": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
}
MARK = "BENCH_DP_RESULT "


def common_model_flags(iters: int, bf16: bool) -> list:
    """The data-parallel benchmarks' model and run (4 layers, hidden 256, seq 128, vocab 8192, mock data)."""
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
             "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--lr", "1e-4",
             "--train-iters", str(iters), "--hidden-dropout", "0", "--attention-dropout", "0",
             "--eval-iters", "0", "--num-workers", "0", "--seed", "1234", "--distributed-backend", "gloo",
             "--log-interval", "1000"]
    return flags + (["--bf16"] if bf16 else [])


def model_flags(options) -> list:
    return common_model_flags(options.iters, options.bf16) + ["--ddp-bucket-size", str(options.bucket_size)]


def timed_train_steps(argv: list):
    """One rank: ``pretrain_gpt.py``'s setup (``initialize_megatron``, ``setup_model_and_optimizer``, its
    data) from ``argv``, then ``--train-iters`` calls of ``train_step``, each timed after a barrier.

    Returns ``(args, model, optimizer, step_seconds, losses)``; shared by the data-parallel benchmarks
    (this file, bench_fsdp2.py) so that they time the same loop.
    """
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    import pretrain_gpt
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
    times, losses = [], []
    for _ in range(args.train_iters):
        dist.barrier()
        start = time.perf_counter()
        loss_dict, _, _, _ = train_step(pretrain_gpt.forward_step, train_iterator, model, optimizer, scheduler)
        times.append(time.perf_counter() - start)
        if loss_dict:
            losses.append(float(loss_dict["lm loss"]))
    return args, model, optimizer, times, losses


def worker(argv: list, warmup: int) -> None:
    """One rank: :func:`timed_train_steps`, then optimizer bytes; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from megatron.core.optimizer import get_optimizer_state_bytes
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    args, model, optimizer, times, losses = timed_train_steps(argv)
    measured = torch.tensor([float(get_optimizer_state_bytes(optimizer))], dtype=torch.float64)
    per_rank = [torch.zeros_like(measured) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, measured)
    step = torch.tensor([statistics.median(times[warmup:])], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if dist.get_rank() == 0:
        print(MARK + json.dumps({
            "optimizer_bytes_per_rank": [int(t.item()) for t in per_rank],
            "theoretical_optimizer_bytes": compute_weight_and_optimizer_memory(args).optimizer_bytes,
            "step_ms": step.item() * 1e3, "params": sum(p.numel() for p in model[0].parameters()),
            "final_loss": losses[-1] if losses else None,
        }), flush=True)
    dist.barrier()
    time.sleep(0.25)  # let gloo's worker threads finish before the groups go (see training._shutdown)
    dist.destroy_process_group()


def launch_worker(script: Path, nproc: int, worker_argv: list, options, mark: str) -> dict:
    """``torchrun`` ``nproc`` ranks of ``script --worker --warmup W -- worker_argv`` (this repository on
    PYTHONPATH, ``options.threads`` OMP threads each); returns the JSON rank 0 printed after ``mark``.

    Raises RuntimeError with the tail of the output when the launch fails or prints no result.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), "--worker", "--warmup", str(options.warmup), "--", *worker_argv]
    env = dict(os.environ, OMP_NUM_THREADS=str(options.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=options.timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(mark)]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"launch of {nproc} x {worker_argv[-6:]} failed (exit {result.returncode}):\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len(mark):])


def run_layout(name: str, options) -> dict:
    """One DP=2 launch of the layout ``name`` of :data:`LAYOUTS`."""
    return launch_worker(Path(__file__).resolve(), 2, [*model_flags(options), *LAYOUTS[name]], options, MARK)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=250_000, help="--ddp-bucket-size (elements)")
    parser.add_argument("--bf16", action="store_true", help="bf16 params with fp32 main params")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        worker(options.rest[1:] if options.rest[:1] == ["--"] else options.rest, options.warmup)
        return {}
    if "plain DP" not in options.layouts:
        options.layouts = ["plain DP", *options.layouts]
    results = {name: run_layout(name, options) for name in options.layouts}
    base = results["plain DP"]
    print(f"DP=2 gloo on CPU, {base['params']} parameters, {'bf16' if options.bf16 else 'fp32'}, Adam, "
          f"bucket {options.bucket_size} elements, median of {options.iters - options.warmup} steps")
    print(f"{'layout':<30} {'opt bytes/rank (max)':>21} {'ratio':>7} {'theory bytes':>13} "
          f"{'step ms':>9} {'ratio':>7}")
    for name, r in results.items():
        measured = max(r["optimizer_bytes_per_rank"])
        print(f"{name:<30} {measured:21d} {measured / max(base['optimizer_bytes_per_rank']):7.3f} "
              f"{r['theoretical_optimizer_bytes']:13.0f} {r['step_ms']:9.1f} {r['step_ms'] / base['step_ms']:7.3f}")
    return results


if __name__ == "__main__":
    main()
