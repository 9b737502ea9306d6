"""Issue 9 item 6: every launch gets its own run id and its own per-iteration trace ids.

A plain ``torchrun --master_addr A --master_port P`` launch has no launcher id; two launches on the
same address, port and world size (or a SLURM requeue, which reuses the job id) must still not share
trace ids, while all ranks of one launch agree on both.
"""
import os

from dist_utils import free_port, run_distributed

from telemetry_testutil import clean_telemetry  # noqa: F401

_ARGV = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters", "1",
         "--distributed-backend", "gloo", "--lr", "1e-3"]


def _launch_body(rank, world_size, port, extra_env):
    """Start the run as ``pretrain`` does (initialize_megatron joins the process group itself)."""
    import torch.distributed as dist

    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.telemetry_hooks import step_span

    dist.destroy_process_group()  # the harness joined one; start like a fresh torchrun worker instead
    for name in [n for n in os.environ if n.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "SLURM_", "TORCHELASTIC_",
                                                           "OTEL_"))]:
        del os.environ[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="none",
                      MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_RANK_STRATEGY="all_ranks",
                      MEGATRON_OTEL_EXPORTER="console", MEGATRON_OTEL_METRICS_ENABLED="0",
                      MEGATRON_OTEL_SPAN_GROUPS="step", **extra_env)
    initialize_megatron(argv=_ARGV)
    handle = global_vars.get_telemetry()
    with step_span(1) as span:
        trace_id = span.get_span_context().trace_id
    run_id = handle.run_id
    global_vars.destroy_global_variables()
    return {"run_id": run_id, "trace_id": trace_id}


def _two_launches(extra_env):
    port = free_port()  # the same address, port and world size for both launches
    first = run_distributed(_launch_body, 2, port, extra_env, timeout=240)
    second = run_distributed(_launch_body, 2, port, extra_env, timeout=240)
    return first, second


def test_plain_torchrun_launches_get_distinct_run_ids_and_trace_ids():
    first, second = _two_launches({})
    for launch in (first, second):
        assert launch[0] == launch[1]  # every rank of one launch agrees
        assert len(launch[0]["run_id"]) == 12
    assert first[0]["run_id"] != second[0]["run_id"]
    assert first[0]["trace_id"] != second[0]["trace_id"]


def test_requeue_and_explicit_run_id_keep_the_id_but_not_the_trace_ids():
    # A SLURM requeue reuses the job id; a user-set id is kept as given. Trace ids still differ.
    for env in ({"SLURM_JOB_ID": "4242"}, {"MEGATRON_OTEL_RUN_ID": "my-experiment"}):
        first, second = _two_launches(env)
        expected = env.get("SLURM_JOB_ID") or env["MEGATRON_OTEL_RUN_ID"]
        for launch in (first, second):
            assert launch[0] == launch[1]
            assert launch[0]["run_id"] == expected
        assert first[0]["trace_id"] != second[0]["trace_id"]
