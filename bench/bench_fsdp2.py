"""Benchmark: per-rank parameter + gradient + optimizer-state bytes of --use-torch-fsdp2 at DP=1, 2, 4 (gloo, CPU)
against one process, and the step-time ratio FSDP2 / distributed optimizer at DP=2.

Each layout is one ``torchrun`` launch of this file as a worker: it builds the model, optimizer and data
exactly as ``pretrain_gpt.py`` does (``setup_model_and_optimizer``, mock data), runs ``train_step``
``--iters`` times and reports, per rank, the bytes it holds after the last step, measured from the tensors:
parameters (the local shard of each FSDP2 ``DTensor``, the whole tensor otherwise), gradients (FSDP2's
local grad shards; DDP's ``main_grad`` buffer views) and optimizer state (``get_optimizer_state_bytes``:
Adam's moments and step, plus fp32 main-param copies under ``--bf16``), and the median step time after
``--warmup`` steps (slowest rank). The goal for FSDP2 is each rank's total within 10 % of 1/DP of the
one-process total.

The step-time comparison runs the FSDP2 and the distributed-optimizer launches alternately from this one
parent process (``--rounds`` pairs, FSDP2 first in odd rounds) and reports the ratio of the medians, so a
change of the machine's load between launches affects both alike.

    python bench/bench_fsdp2.py [--iters 8] [--warmup 3] [--rounds 2] [--bf16]

The model (4 layers, hidden 256, seq 128, vocab 8192, untied output layer, a global batch of 8 in
micro-batches of 2) has ~7.4M parameters. On a 2-core machine DP=4 puts four ranks on two cores: its
step time is not reported as a speed.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FSDP2 = ["--use-torch-fsdp2"]
DISTOPT = ["--use-distributed-optimizer"]
MARK = "BENCH_FSDP2_RESULT "


def model_flags(options) -> list:
    """bench_dp's model, untied and without gradient-accumulation fusion (FSDP2 needs both)."""
    from bench_dp import common_model_flags

    return common_model_flags(options.iters, options.bf16) + ["--untie-embeddings-and-output-weights",
                                                             "--no-gradient-accumulation-fusion"]


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def worker(argv: list, warmup: int) -> None:
    """One rank: bench_dp's timed ``train_step`` loop, then the bytes held; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from bench_dp import timed_train_steps
    from megatron.core.optimizer import get_optimizer_state_bytes

    _, model, optimizer, times, losses = timed_train_steps(argv)
    params = list(model[0].module.parameters())
    held = torch.tensor([
        float(sum(_local_bytes(p) for p in params)),
        float(sum(_local_bytes(getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad) for p in params)),
        float(get_optimizer_state_bytes(optimizer)),
    ], dtype=torch.float64)
    per_rank = [torch.zeros_like(held) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, held)
    step = torch.tensor([statistics.median(times[warmup:])], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if dist.get_rank() == 0:
        print(MARK + json.dumps({
            "bytes_per_rank": [[int(v) for v in t.tolist()] for t in per_rank],
            "step_ms": step.item() * 1e3, "final_loss": losses[-1] if losses else None,
            "params": sum(p.numel() for p in params),
        }), flush=True)
    dist.barrier()
    time.sleep(0.25)  # let gloo's worker threads finish before the groups go (see training._shutdown)
    dist.destroy_process_group()


def run_layout(nproc: int, flags: list, options) -> dict:
    """One launch of ``nproc`` ranks with the model's flags plus ``flags`` (bench_dp's launcher)."""
    from bench_dp import launch_worker

    return launch_worker(Path(__file__).resolve(), nproc, [*model_flags(options), *flags], options, MARK)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating FSDP2 / distributed-optimizer pairs")
    parser.add_argument("--bf16", action="store_true", help="bf16 params with fp32 main params")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        worker(options.rest[1:] if options.rest[:1] == ["--"] else options.rest, options.warmup)
        return {}

    memory = {"one process": run_layout(1, [], options)}
    for dp in (1, 2, 4):
        memory[f"FSDP2 DP={dp}"] = run_layout(dp, FSDP2, options)
    base = sum(memory["one process"]["bytes_per_rank"][0])
    print(f"gloo on CPU, {memory['one process']['params']} parameters, {'bf16' if options.bf16 else 'fp32'}, Adam; "
          "bytes held per rank after the last step (max over ranks)")
    print(f"{'layout':<14} {'params':>11} {'grads':>11} {'optimizer':>11} {'total':>11} {'x DP / one':>10}")
    for name, r in memory.items():
        dp = len(r["bytes_per_rank"])
        worst = max(r["bytes_per_rank"], key=sum)
        print(f"{name:<14} {worst[0]:11d} {worst[1]:11d} {worst[2]:11d} {sum(worst):11d} "
              f"{sum(worst) * dp / base:10.3f}")

    fsdp_ms, distopt_ms = [], []
    for round_index in range(options.rounds):
        order = [(FSDP2, fsdp_ms), (DISTOPT, distopt_ms)]
        for flags, times in (order if round_index % 2 == 0 else order[::-1]):
            times.append(run_layout(2, flags, options)["step_ms"])
    ratio = statistics.median(fsdp_ms) / statistics.median(distopt_ms)
    print(f"DP=2 step ms, FSDP2 {[round(t, 1) for t in fsdp_ms]} vs distributed optimizer "
          f"{[round(t, 1) for t in distopt_ms]}: ratio of medians {ratio:.3f}")
    return {"memory": memory, "fsdp_ms": fsdp_ms, "distopt_ms": distopt_ms, "ratio": ratio}


if __name__ == "__main__":
    main()
