"""Benchmark: training tokens/s of pretrain_gpt.py against a minimal plain-PyTorch loop of the same model.

Both run the same GPT shape (4 layers, hidden 128, 4 heads, seq 128, GPT-2 vocabulary padded to 50,304,
tied embeddings, no dropout), the same batch (micro batch 8, global batch 16 -> 2 microbatches), AdamW
and grad clipping, in one process each, alternating so machine noise hits both alike. The ratio is
framework tokens/s divided by plain-loop tokens/s (target >= 0.97).

    python bench/bench_training.py [--iters 60] [--repeats 2] [--threads 2]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
LAYERS, HIDDEN, HEADS, SEQ, MBS, GBS, VOCAB = 4, 128, 4, 128, 8, 16, 50304


def plain_loop(data_prefix: str, iters: int, use_megatron_model: bool) -> float:
    """A minimal loop on the same data; returns ms per iteration after warm-up.

    The model is either a self-contained nanoGPT-style module or this project's GPTModel used
    directly (no DDP wrapper, optimizer wrapper, data loader or training loop).
    """
    import numpy as np
    import torch

    torch.manual_seed(1234)

    def GPT():  # the nanoGPT-style reference model (bench/nanogpt_model.py)
        from nanogpt_model import build_nanogpt
        return build_nanogpt(LAYERS, HIDDEN, HEADS, SEQ, VOCAB)

    if use_megatron_model:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0, gradient_accumulation_fusion=False)
        core = GPTModel(config, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True)
        positions = torch.arange(SEQ).expand(MBS, SEQ)
        model = core

        def forward(tokens, labels):
            return core(tokens, positions, None, labels=labels).mean()
    else:
        model = GPT()
        forward = model
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    tokens_all = np.memmap(data_prefix + ".bin", dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    times = []
    for it in range(iters):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(GBS // MBS):
            offsets = rng.integers(0, len(tokens_all) - SEQ - 1, size=MBS)
            chunk = torch.from_numpy(np.stack([tokens_all[o:o + SEQ + 1].astype(np.int64) for o in offsets]))
            loss = forward(chunk[:, :-1], chunk[:, 1:]) / (GBS // MBS)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    warm = times[iters // 3:]
    return 1000.0 * sum(warm) / len(warm)


def framework_run(data_prefix: str, iters: int, env) -> float:
    """pretrain_gpt.py on one rank; returns the mean logged ms per iteration after warm-up."""
    log_interval = max(iters // 6, 1)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "pretrain_gpt.py",
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MBS),
        "--global-batch-size", str(GBS), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "1e-3", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--train-iters", str(iters), "--log-interval", str(log_interval), "--eval-iters", "0",
        "--data-path", data_prefix, "--split", "100,0,0", "--num-workers", "1",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(SHARED / "gpt2-vocab.json"),
        "--merge-file", str(SHARED / "gpt2-merges.txt"), "--distributed-backend", "gloo",
    ]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pretrain_gpt.py failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    values = [(int(m.group(1)), float(m.group(2))) for m in
              re.finditer(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    warm = [ms for it, ms in values if it > iters // 3]
    if not warm:
        sys.exit(f"no log lines after warm-up in pretrain_gpt.py output:\n{out.stdout[-2000:]}")
    return sum(warm) / len(warm)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads per run")
    parser.add_argument("--plain-loop", metavar="PREFIX", help=argparse.SUPPRESS)
    parser.add_argument("--megatron-model", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.plain_loop:
        import torch

        torch.set_num_threads(args.threads)
        print(f"{plain_loop(args.plain_loop, args.iters, args.megatron_model):.3f}")
        return

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "shakes")
        subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(SHARED / "tinyshakespeare.jsonl"),
                        "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", str(SHARED / "gpt2-vocab.json"), "--merge-file", str(SHARED / "gpt2-merges.txt"),
                        "--append-eod", "--workers", "2", "--log-interval", "100000"],
                       cwd=REPO, check=True, capture_output=True)
        data = prefix + "_text_document"
        runs = {"plain loop, nanoGPT-style model": [], "plain loop, this project's GPTModel": [],
                "pretrain_gpt.py": []}
        for r in range(args.repeats):
            for name, extra in (("plain loop, nanoGPT-style model", []),
                                ("plain loop, this project's GPTModel", ["--megatron-model"])):
                out = subprocess.run([sys.executable, __file__, "--plain-loop", data, "--iters", str(args.iters),
                                      "--threads", str(args.threads), *extra],
                                     env=env, capture_output=True, text=True, check=True)
                runs[name].append(float(out.stdout.strip().splitlines()[-1]))
            runs["pretrain_gpt.py"].append(framework_run(data, args.iters, env))
            print(f"repeat {r + 1}: " + ", ".join(f"{name} {ms[-1]:.1f} ms/iter" for name, ms in runs.items()),
                  flush=True)
    tokens = GBS * SEQ
    tps = {name: tokens / (statistics.median(ms) / 1000.0) for name, ms in runs.items()}
    for name, value in tps.items():
        print(f"{name:38s}: {value:10.0f} tokens/s")
    for name in list(tps)[:2]:
        print(f"ratio pretrain_gpt.py / {name}: {tps['pretrain_gpt.py'] / tps[name]:.3f}  (target >= 0.97)")


if __name__ == "__main__":
    main()
