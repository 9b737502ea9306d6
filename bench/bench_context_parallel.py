"""Benchmark: bytes each context-parallel rank saves for backward and tokens/s at CP=1, 2, 4 (gloo, CPU), as ratios.

Each layout (CP size x ``--cp-comm-type``) is one ``torchrun`` launch of this file as a worker, all from this
process, one after the other. A worker builds a Llama-shaped ``GPTModel`` (RoPE, GQA, SwiGLU, RMSNorm, no
biases, untied output layer; fp32, no dropout) on CP ranks only (``initialize_model_parallel(
context_parallel_size=world)``), cuts one batch of ``--seq-length`` tokens with ``get_batch_on_this_cp_rank``
as ``pretrain_gpt.py`` does, and measures:

* saved for backward: over one forward of the model with the loss, a
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook sums the ``nbytes`` of the unique storages of the
  tensors autograd saves. Storages that are parameters (weights saved by the linear layers) are
  counted apart: they exist whatever the sequence length, so the goal (CP=2 at most 0.55x of CP=1) is
  about the activations; both figures are printed. The largest saved storages are listed by shape for
  a reading of what does or does not shrink with CP.
* tokens/s: ``--iters`` forward+backward passes (no optimizer) after one warm-up, the median step time
  of the slowest rank; tokens/s = micro-batch x sequence length / step time (the whole sequence, which
  the CP ranks share).

    python bench/bench_context_parallel.py [--seq-length 2048] [--iters 3] [--cp 1 2 4] [--comm-types p2p ...]

The CPU ranks share the machine's cores (2 on the project's machine), so CP=2 and CP=4 do not get 2x or
4x the compute of CP=1: the tokens/s ratios say little about a GPU cluster; the saved-bytes ratios are
the point of this benchmark.
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
COMM_TYPES = ("p2p", "all_gather", "a2a")
MARK = "BENCH_CP_RESULT "
# Llama-shaped and small enough for 2 CPU cores at sequence 2048: ~7M parameters.
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=704,
             vocab_size=8192)


def worker(options) -> None:
    """One CP rank: saved-for-backward bytes of one forward, timed forward+backward; rank 0 prints JSON."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.training.utils import get_batch_on_this_cp_rank

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    ps.initialize_model_parallel(context_parallel_size=world)
    m = MODEL
    config = TransformerConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                               num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
                               ffn_hidden_size=m["ffn_hidden_size"], gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               context_parallel_size=world, cp_comm_type=options.comm_type)
    torch.manual_seed(1234)
    model = GPTModel(config, vocab_size=m["vocab_size"], max_sequence_length=options.seq_length,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    b, s = options.micro_batch_size, options.seq_length
    g = torch.Generator().manual_seed(3)
    full = {"tokens": torch.randint(0, m["vocab_size"], (b, s), generator=g),
            "labels": torch.randint(0, m["vocab_size"], (b, s), generator=g),
            "position_ids": torch.arange(s).expand(b, s), "loss_mask": torch.ones(b, s)}
    batch = get_batch_on_this_cp_rank(full)

    def loss_of_forward():
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return (losses * batch["loss_mask"]).sum() / (b * s)

    # Saved for backward: unique storages, parameters apart.
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}  # storage data_ptr -> (nbytes, shape, dtype) of the first tensor seen on it

    def pack(tensor):
        try:
            storage = tensor.untyped_storage()
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(tensor.shape), str(tensor.dtype)))
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            pass
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of_forward()
    loss.backward()
    activation = sum(n for ptr, (n, _, _) in saved.items() if ptr not in param_storages)
    parameters = sum(n for ptr, (n, _, _) in saved.items() if ptr in param_storages)
    largest = sorted(((n, shape, dtype) for ptr, (n, shape, dtype) in saved.items() if ptr not in param_storages),
                     reverse=True)
    # Group the activation storages by shape: count and bytes per shape, largest first.
    by_shape = {}
    for n, shape, dtype in largest:
        count, total = by_shape.get(shape, (0, 0))
        by_shape[shape] = (count + 1, total + n)
    shapes = sorted(((total, list(shape), count) for shape, (count, total) in by_shape.items()), reverse=True)[:8]

    times = []
    for it in range(options.iters + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        loss_of_forward().backward()
        if it > 0:  # the first pass warms up
            times.append(time.perf_counter() - start)
    step = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    per_rank = torch.tensor([[activation, parameters]], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    if dist.get_rank() == 0:
        print(MARK + json.dumps({
            "activation_bytes_per_rank": [int(t[0, 0]) for t in gathered],
            "parameter_bytes_saved_per_rank": [int(t[0, 1]) for t in gathered],
            "largest_shapes": shapes, "step_s": step.item(), "tokens_per_s": b * s / step.item(),
            "params": sum(p.numel() for p in model.parameters()), "local_loss": float(loss),
        }), flush=True)
    dist.barrier()
    # As pretrain's shutdown does (megatron/training/training.py, _shutdown): let gloo's worker threads
    # release the last collective's tensors while the interpreter is intact, else one may abort the
    # process at exit ("terminate called without an active exception").
    time.sleep(0.25)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def run_layout(cp: int, comm_type: str, options) -> dict:
    """One torchrun launch of ``cp`` worker ranks; returns rank 0's record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
           str(Path(__file__).resolve()), "--worker", "--comm-type", comm_type,
           "--seq-length", str(options.seq_length), "--micro-batch-size", str(options.micro_batch_size),
           "--iters", str(options.iters)]
    env = dict(os.environ, OMP_NUM_THREADS=str(options.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=options.timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise RuntimeError(f"CP={cp} {comm_type} failed (exit {result.returncode}):\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    if result.returncode != 0:  # after every rank's figures were gathered: the teardown, not the measurement
        tail = " | ".join(result.stderr.strip().splitlines()[-3:])[:300]
        print(f"warning: CP={cp} {comm_type} exited with {result.returncode} after reporting; figures kept ({tail})",
              flush=True)
    return json.loads(lines[-1][len(MARK):])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed forward+backward passes after one warm-up")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP sizes besides 1 (default 2 4)")
    parser.add_argument("--comm-types", nargs="+", default=list(COMM_TYPES), choices=COMM_TYPES)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--json", help="also write every record to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--comm-type", default="p2p", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.iters < 1:
        parser.error(f"--iters must be at least 1, got {options.iters}")
    if options.worker:
        worker(options)
        return {}
    results = {"CP=1": run_layout(1, "p2p", options)}  # one rank: no CP kernel runs, comm type unused
    print(f"CP=1: {json.dumps(results['CP=1'])}", flush=True)
    for cp in sorted(set(options.cp) - {1}):
        for comm_type in options.comm_types:
            results[f"CP={cp} {comm_type}"] = run_layout(cp, comm_type, options)
            print(f"CP={cp} {comm_type}: {json.dumps(results[f'CP={cp} {comm_type}'])}", flush=True)
    base = results["CP=1"]
    base_act = max(base["activation_bytes_per_rank"])
    base_all = base_act + max(base["parameter_bytes_saved_per_rank"])
    print(f"\nLlama-shaped GPTModel ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_attention_heads']} heads / {MODEL['num_query_groups']} groups, ffn {MODEL['ffn_hidden_size']}, "
          f"vocab {MODEL['vocab_size']}, {base['params']} parameters), fp32, seq {options.seq_length}, micro-batch "
          f"{options.micro_batch_size}, gloo on CPU, median of {options.iters} forward+backward passes")
    print("| layout | activations saved / rank (MiB, max) | ratio to CP=1 | incl. saved weights (MiB) | ratio | "
          "tokens/s | ratio to CP=1 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        act = max(r["activation_bytes_per_rank"])
        total = act + max(r["parameter_bytes_saved_per_rank"])
        print(f"| {name} | {act / 2**20:.1f} | {act / base_act:.3f} | {total / 2**20:.1f} | {total / base_all:.3f} | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f} |")
    print("\nlargest saved activation storages by shape (MiB, count):")
    for name, r in results.items():
        print(f"{name}: " + "; ".join(f"{shape} {total / 2**20:.1f} x{count}" for total, shape, count in
                                     r["largest_shapes"][:5]))
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
