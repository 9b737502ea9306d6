"""End-to-end pretrain_gpt.py runs under torchrun on CPU: log line, DP equivalence, exact resume, TensorBoard."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain_utils import REPO, console_objects, losses_from_log as _losses, run_pretrain as _pretrain, run_ranks_without_launcher


def test_dp2_matches_dp1_and_logs_megatron_format(shared_data, shakespeare_prefix, tmp_path):
    """Same global batch at DP=2 (2 ranks, 1 microbatch) and DP=1 (2 microbatches): same losses."""
    common = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--tensorboard-dir", str(tmp_path / "tb")]
    dp2 = _losses(_pretrain(2, ["--micro-batch-size", "4", *common], shared_data, shakespeare_prefix, tmp_path))
    dp1 = _losses(_pretrain(1, ["--micro-batch-size", "4"] + common[:-2], shared_data, shakespeare_prefix, tmp_path))
    assert sorted(dp2) == list(range(1, 7))
    for it in dp2:
        assert float(dp2[it]) == pytest.approx(float(dp1[it]), rel=1e-5), f"iteration {it}"
    assert float(dp2[6]) < float(dp2[1])  # it learns

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("learning-rate", "batch-size", "lm loss", "lm loss vs samples", "grad-norm", "loss-scale",
                "lm loss validation"):
        assert tag in tags, f"TensorBoard tag {tag!r} missing from {sorted(tags)}"
    assert len(events.Scalars("lm loss")) == 6


def test_resume_prints_exactly_the_uninterrupted_losses(shared_data, shakespeare_prefix, tmp_path):
    """Stop at iteration 4 (dropout on, so RNG state matters), resume to 8: same printed losses."""
    base = ["--micro-batch-size", "2", "--train-iters", "8"]
    full = _losses(_pretrain(2, base, shared_data, shakespeare_prefix, tmp_path))
    ckpt = str(tmp_path / "ckpt")
    first = _pretrain(2, base + ["--save", ckpt, "--save-interval", "4", "--exit-interval", "4"],
                      shared_data, shakespeare_prefix, tmp_path)
    assert "exiting program at iteration 4" in first
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed = _losses(_pretrain(2, base + ["--load", ckpt], shared_data, shakespeare_prefix, tmp_path))
    assert sorted(resumed) == [5, 6, 7, 8]
    assert {it: full[it] for it in resumed} == resumed


def test_telemetry_spans_and_metrics_from_the_training_loop(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    """MEGATRON_OTEL_* switches on console export: the span tree and megatron.training.* metrics appear."""
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step, microbatch, layer")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer secret-token")
    out = _pretrain(2, ["--micro-batch-size", "2", "--train-iters", "3", "--save", str(tmp_path / "ckpt"),
                        "--save-interval", "3"], shared_data, shakespeare_prefix, tmp_path)
    assert "secret-token" not in out
    records = console_objects(out)
    spans = [r for r in records if "name" in r]
    by_name = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    for name in ("megatron.pretrain", "megatron.model_init", "megatron.train", "megatron.train_step",
                 "megatron.forward_backward", "megatron.optimizer_step", "megatron.save_checkpoint",
                 "megatron.evaluate"):
        assert name in by_name, f"span {name} missing; got {sorted(by_name)}"
    # Only the default single_rank strategy's rank (the last) exports.
    assert {s["resource"]["attributes"]["service.instance.id"].rsplit("-", 1)[1] for s in spans} == {"rank1"}
    steps = by_name["megatron.train_step"]
    assert [s["attributes"]["megatron.iteration"] for s in steps] == [1, 2, 3]
    assert all(s["attributes"]["megatron.loss"] > 0 for s in steps)
    # Child spans hang under their step; each iteration is its own trace (shared across pipeline stages).
    for step in steps:
        children = [s for s in by_name["megatron.forward_backward"] if s["parent_id"] == step["context"]["span_id"]]
        assert len(children) == 1
    assert len({s["context"]["trace_id"] for s in steps}) == 3
    span_ids = {s["context"]["span_id"]: s for s in spans}
    # Each step trace has an exported root (megatron.iteration), the step links to megatron.train and
    # back, and no span names a parent that was not exported.
    roots = {s["context"]["span_id"] for s in by_name["megatron.iteration"]}
    assert len(roots) == 3 and all(step["parent_id"] in roots for step in steps)
    train_ids = {s["context"]["span_id"] for s in by_name["megatron.train"]}
    assert all({link["context"]["span_id"] for link in step["links"]} == train_ids for step in steps)
    assert {s["context"]["span_id"] for s in steps} <= {
        link["context"]["span_id"] for s in by_name["megatron.train"] for link in s["links"]}
    assert all(s["parent_id"] is None or s["parent_id"] in span_ids for s in spans)
    parent_name = lambda s: span_ids[s["parent_id"]]["name"] if s["parent_id"] in span_ids else None  # noqa: E731
    for name, parent in (("megatron.microbatch.forward", "megatron.forward_backward"),
                         ("megatron.microbatch.backward", "megatron.forward_backward"),
                         ("megatron.layer.forward", "megatron.microbatch.forward"),
                         ("megatron.layer.self_attention", "megatron.layer.forward"),
                         ("megatron.layer.mlp", "megatron.layer.forward"),
                         ("megatron.grad_sync.finish", "megatron.forward_backward")):
        assert name in by_name, f"span {name} missing"
        assert parent in {parent_name(s) for s in by_name[name]}, f"{name} never under {parent}"
    # 3 iterations x 2 microbatches (micro batch 2 x DP 2 = 4 of the global 8).
    train_mb = [s for s in by_name["megatron.microbatch.backward"]]
    assert sorted(s["attributes"]["megatron.microbatch_id"] for s in train_mb) == [0, 0, 0, 1, 1, 1]
    metric_names = set()
    for record in records:
        for rm in record.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                metric_names.update(m["name"] for m in sm["metrics"])
    for name in ("megatron.training.loss", "megatron.training.step_duration_ms", "megatron.training.learning_rate",
                 "megatron.validation.loss"):
        assert name in metric_names, f"metric {name} missing; got {sorted(metric_names)}"


def test_sample_based_run_timers_tensorboard_and_eval_only_reload(shared_data, shakespeare_prefix, tmp_path):
    """--train-samples drives the loop; timers reach TensorBoard; --skip-train (no --lr) evaluates a checkpoint."""
    tb, ckpt = tmp_path / "tb", str(tmp_path / "ckpt")
    out = _pretrain(1, ["--micro-batch-size", "4", "--train-samples", "40", "--lr-warmup-samples", "8",
                        "--timing-log-level", "2", "--log-timers-to-tensorboard", "--tensorboard-dir", str(tb),
                        "--save", ckpt, "--save-interval", "5"], shared_data, shakespeare_prefix, tmp_path)
    assert sorted(_losses(out)) == [1, 2, 3, 4, 5]  # 40 samples / global batch 8
    assert "forward-compute ......" in out and "batch-generator ......" in out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"forward-backward-time", "iteration-time"} <= set(events.Tags()["scalars"])
    assert "micro_batch_size/text_summary" in events.Tags()["tensors"]

    evaluated = _pretrain(1, ["--micro-batch-size", "4", "--train-iters", "5", "--skip-train", "--load", ckpt,
                              "--no-load-optim", "--no-load-rng"],
                          shared_data, shakespeare_prefix, tmp_path)
    assert "validation loss at iteration 5 on validation set" in evaluated
    assert "elapsed time per iteration" not in evaluated


def test_weight_decay_exclusions_follow_megatron():
    import torch

    from megatron.core.optimizer.weight_decay import no_weight_decay_cond

    weight, bias, norm = torch.zeros(2, 2), torch.zeros(2), torch.zeros(2)
    default = no_weight_decay_cond(apply_wd_to_qk_layernorm=False)
    assert not default("decoder.layers.0.mlp.linear_fc1.weight", weight)
    assert default("decoder.layers.0.mlp.linear_fc1.bias", bias)
    assert default("decoder.layers.0.self_attention.q_layernorm.weight", norm)
    with_qk = no_weight_decay_cond(apply_wd_to_qk_layernorm=True)
    assert not with_qk("decoder.layers.0.self_attention.q_layernorm.weight", norm)
    assert with_qk("decoder.layers.0.input_layernorm.weight", norm)


def test_bad_telemetry_variable_fails_every_rank_at_start_up(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_RANK_STRATEGY", "every_other_rank")
    # Each rank stops on its own, before the process group exists (so no rank waits on the other); run
    # without torchrun, which would kill the slower rank as soon as the first one fails.
    ranks = run_ranks_without_launcher(2, ["--micro-batch-size", "2", "--train-iters", "3"], shared_data,
                                       shakespeare_prefix, tmp_path)
    for rank, (status, out) in enumerate(ranks):
        assert status != 0, f"rank {rank}: {out[-2000:]}"
        assert "MEGATRON_OTEL_RANK_STRATEGY: Unknown export_strategy 'every_other_rank'" in out, f"rank {rank}: {out[-2000:]}"
        assert "Registered strategies: single_rank, all_ranks, sampled, first_rank_per_node" in out
        assert "building GPT model" not in out



def test_exit_signal_saves_and_stops(shared_data, shakespeare_prefix, tmp_path):
    """--exit-signal-handler: SIGTERM mid-run -> checkpoint at the next iteration boundary, exit 0."""
    import signal

    from dist_utils import free_port

    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "pretrain_gpt.py",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
           "--lr", "1e-3", "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0",
           "--data-path", shakespeare_prefix, "--split", "100,0,0", "--num-workers", "0",
           "--data-cache-path", str(tmp_path / "cache"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", str(shared_data / "gpt2-vocab.json"), "--merge-file", str(shared_data / "gpt2-merges.txt"),
           "--save", str(ckpt), "--save-interval", "1000000", "--exit-signal-handler", "--ckpt-format", "torch"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "iteration        3/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines.extend(proc.stdout)
        assert proc.wait(timeout=120) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert "exiting program after receiving SIGTERM." in out
    stopped_at = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert stopped_at >= 3 and (ckpt / f"iter_{stopped_at:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()
