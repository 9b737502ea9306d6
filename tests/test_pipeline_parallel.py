"""Pipeline schedules over real gloo p2p: 1F1B (PP=2, PP=4) and interleaved (PP=2 and PP=4 with
virtual stages) give the loss and gradients of one process; a failing stage makes every stage fail
fast, naming the failing rank; receives are bounded by the pipeline group's timeout.

One launch of 4 gloo processes runs every layout, then the timeout and failure checks (last: they
break the process group); the tests below read its results.
"""
import time

import pytest
import torch

from dist_utils import run_distributed
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

LAYERS, SEQ, MBS, HIDDEN = 8, 4, 2, 8


def _config(deallocate=False):
    config = ModelParallelConfig(deallocate_pipeline_outputs=deallocate)
    config.hidden_size = HIDDEN
    return config


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3, torch.randn(HIDDEN, generator=g) * 0.1)
            for _ in range(LAYERS)]


class Stage(torch.nn.Module):
    """Layers ``layer_ids`` of a residual tanh-MLP stack: x + tanh(W x + b) per layer, [s, b, h]."""

    def __init__(self, layer_ids, config):
        super().__init__()
        self.config, self.layer_ids, self.input_tensor = config, list(layer_ids), None
        weights = _full_weights()
        self.layers = torch.nn.ModuleList()
        for i in self.layer_ids:
            layer = torch.nn.Linear(HIDDEN, HIDDEN)
            with torch.no_grad():
                layer.weight.copy_(weights[i][0])
                layer.bias.copy_(weights[i][1])
            self.layers.append(layer)

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self, x):
        if self.input_tensor is not None:
            x = self.input_tensor
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _microbatches(m):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, MBS, HIDDEN, generator=g), torch.randn(SEQ, MBS, HIDDEN, generator=g))
            for _ in range(m)]


def _forward_step(data_iterator, model):
    x, y = next(data_iterator)
    output = model(x)

    def loss_func(output):
        loss = ((output - y) ** 2).sum()
        num_tokens = torch.tensor(SEQ * MBS, dtype=torch.int)
        return loss, num_tokens, {"lm loss": loss.detach()}

    return output, loss_func


def _grads(chunks):
    return {i: (layer.weight.grad.clone(), layer.bias.grad.clone())
            for chunk in chunks for i, layer in zip(chunk.layer_ids, chunk.layers)}


def _reference(m):
    model = Stage(range(LAYERS), _config())
    reports = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(_microbatches(m)),
                                             model=[model], num_microbatches=m, seq_length=SEQ,
                                             micro_batch_size=MBS)
    return [r["lm loss"] for r in reports], _grads([model])


def _run_layout(pp, vp, m, forward_only=False, deallocate=False):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp)
    rank, chunks_per_stage = parallel_state.get_pipeline_model_parallel_rank(), vp or 1
    per_virtual_stage = LAYERS // (pp * chunks_per_stage)
    chunks = []
    for c in range(chunks_per_stage):
        first = (c * pp + rank) * per_virtual_stage  # virtual stage c*pp + rank (Megatron's assignment)
        chunks.append(Stage(range(first, first + per_virtual_stage), _config(deallocate)))
    data = _microbatches(m)
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=[iter(data) for _ in chunks] if vp else iter(data),
        model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only)
    return [r["lm loss"] for r in reports], ({} if forward_only else _grads(chunks))


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


LAYOUTS = [  # (pp, vp, microbatches, deallocate)
    (2, None, 4, True), (4, None, 6, False), (4, None, 2, True), (2, 2, 4, False), (4, 2, 8, True),
]


def _numerics_worker(rank, world_size):
    results = []
    for pp, vp, m, deallocate in LAYOUTS:
        ref_losses, ref_grads = _reference(m)
        losses, grads = _run_layout(pp, vp, m, deallocate=deallocate)
        eval_losses, _ = _run_layout(pp, vp, m, forward_only=True)
        last = parallel_state.is_pipeline_last_stage()
        loss_err = max(_rel(a, b) for a, b in zip(losses, ref_losses)) if last else 0.0
        eval_err = max(_rel(a, b) for a, b in zip(eval_losses, ref_losses)) if last else 0.0
        grad_err = max(_rel(grads[i][j], ref_grads[i][j]) for i in grads for j in (0, 1))
        results.append({"layout": (pp, vp, m), "last": last, "n_losses": len(losses), "n_eval": len(eval_losses),
                        "layers": sorted(grads), "loss_err": loss_err, "eval_err": eval_err, "grad_err": grad_err})
    return results


def _telemetry_worker(rank, world_size):
    """PP=2 1F1B (pipelines [0, 2] and [1, 3]) inside an iteration's train_step span, every rank
    exporting to memory: each p2p span's name, micro-batch id and the span above it."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from megatron.core import telemetry as tel

    exporter = InMemorySpanExporter()
    config = tel.TelemetryConfig(enabled=True, rank_strategy="all_ranks", metrics_enabled=False,
                                 span_groups="step,microbatch,communication", run_id="pp-test")
    handle = tel.setup_telemetry(config, rank, world_size, span_exporter=exporter)
    try:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        chunk = Stage(range(4 * stage, 4 * stage + 4), _config())
        context = tel.iteration_trace_context(handle.run_id, 5)
        tel.set_pipeline_carrier(tel.inject_context({}, context))
        with tel.managed_span("step", "megatron.train_step", context=context):
            get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_microbatches(3)),
                                        model=[chunk], num_microbatches=3, seq_length=SEQ, micro_batch_size=MBS)
        handle.force_flush(3000)
        spans = exporter.get_finished_spans()
        by_id = {s.context.span_id: s for s in spans}

        def describe(span):
            parent = by_id.get(span.parent.span_id) if span.parent else None
            return {"name": span.name, "trace_id": span.context.trace_id, "attrs": dict(span.attributes),
                    "parent": (parent.name, dict(parent.attributes)) if parent else None,
                    "links": [(l.context.trace_id, l.context.span_id) for l in span.links]}

        return {"stage": stage, "expected_trace": tel.iteration_span_ids(handle.run_id, 5)[0],
                "spans": [describe(s) for s in spans]}
    finally:
        handle.shutdown(timeout_ms=2000)


def _worker(rank, world_size):
    numerics = _numerics_worker(rank, world_size)
    spans = _telemetry_worker(rank, world_size)
    return numerics, _failure_worker(rank, world_size), spans


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_worker, 4, timeout=400)


@pytest.mark.timeout(420)
def test_pipelined_schedules_match_one_process(per_rank):
    for index, (pp, vp, m, _) in enumerate(LAYOUTS):
        rows = [numerics[index] for numerics, _, _ in per_rank]
        assert sorted(i for row in rows for i in row["layers"]) == sorted(list(range(LAYERS)) * (4 // pp)), rows
        for row in rows:
            assert row["n_losses"] == row["n_eval"] == (m if row["last"] else 0), row
            assert row["loss_err"] < 1e-5 and row["eval_err"] < 1e-5 and row["grad_err"] < 1e-5, row


# ----------------------------------------------------------------------------------------------
# Failure: no stage is left waiting in a receive
# ----------------------------------------------------------------------------------------------
FAILING_RANK, FAILING_MICROBATCH = 2, 2


def _failure_worker(rank, world_size):
    import torch.distributed as dist

    parallel_state.destroy_model_parallel()
    out = {}
    # 1. A receive from a stage that never sends ends with the pipeline group's timeout (3 s here;
    #    --distributed-timeout-minutes in training). Pipelines are [0, 2] and [1, 3].
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, distributed_timeout_minutes=0.05)
    if rank == 3:
        start = time.monotonic()
        try:
            p2p.recv_forward((SEQ, MBS, HIDDEN), _config())
        except p2p.PipelinePeerError as exc:
            out["timeout"] = (time.monotonic() - start, str(exc))
    dist.barrier()
    # 2. PP=4: stage 2 raises in the forward of micro-batch 2; every stage must fail quickly.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=4)
    chunk = Stage(range(2 * rank, 2 * rank + 2), _config())
    seen = []

    def forward_step(data_iterator, model):
        seen.append(None)
        if rank == FAILING_RANK and len(seen) == FAILING_MICROBATCH + 1:
            raise RuntimeError("injected failure in forward")
        return _forward_step(data_iterator, model)

    start = time.monotonic()
    try:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(_microbatches(8)),
                                    model=[chunk], num_microbatches=8, seq_length=SEQ, micro_batch_size=MBS)
        out["failure"] = None
    except Exception as exc:  # returned, not raised: the test checks every rank's error
        out["failure"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


@pytest.mark.timeout(420)
def test_failing_stage_fails_every_stage_naming_its_rank(per_rank):
    elapsed, message = per_rank[3][1]["timeout"]
    assert 2.5 < elapsed < 30 and "recv_forward with rank 1" in message, (elapsed, message)
    for rank, (_, out, _) in enumerate(per_rank):
        assert out["failure"] is not None, f"rank {rank} finished although stage {FAILING_RANK} failed"
        kind, message, elapsed = out["failure"]
        assert elapsed < 60, (rank, elapsed)
        if rank == FAILING_RANK:
            assert (kind, message) == ("RuntimeError", "injected failure in forward")
        else:
            assert kind == "PipelinePeerError", (rank, kind, message)
            assert f"pipeline stage failed on rank {FAILING_RANK}" in message, (rank, message)


@pytest.mark.timeout(420)
def test_p2p_spans_sit_under_their_micro_batch(per_rank):
    """send/recv spans in the communication group under the micro-batch span they serve, in the
    iteration's trace, and linked warm-up receives on the later stage."""
    for _, _, result in per_rank:
        spans, stage = result["spans"], result["stage"]
        assert {s["trace_id"] for s in spans} == {result["expected_trace"]}
        p2p_spans = [s for s in spans if s["name"].startswith("megatron.p2p.")]
        names = sorted({s["name"] for s in p2p_spans})
        if stage == 0:
            assert names == ["megatron.p2p.recv_backward", "megatron.p2p.send_forward"]
        else:
            assert names == ["megatron.p2p.recv_forward", "megatron.p2p.send_backward"]
        for span in p2p_spans:
            assert span["attrs"]["dl.pipeline_parallel.rank"] == stage
            mb = span["attrs"]["megatron.microbatch_id"]
            parent_name, parent_attrs = span["parent"]
            if parent_name == "megatron.pp.recv_forward.linked":
                assert span["name"] == "megatron.p2p.recv_forward" and parent_attrs["dl.microbatch_id"] == mb
                continue
            # the send of micro-batch k sits under k's forward / backward span; a receive under the
            # span of the micro-batch it serves when it runs alone, else beside the send it is
            # batched with (1F1B's steady state pairs them)
            direction = "forward" if span["name"].endswith("forward") else "backward"
            assert parent_name.startswith("megatron.microbatch."), span
            if span["name"].startswith("megatron.p2p.send"):
                assert parent_name == f"megatron.microbatch.{direction}", span
                assert parent_attrs["megatron.microbatch_id"] == mb, span
        sends = sorted(s["attrs"]["megatron.microbatch_id"] for s in p2p_spans if "send" in s["name"])
        recvs = sorted(s["attrs"]["megatron.microbatch_id"] for s in p2p_spans if "recv" in s["name"])
        assert sends == recvs == [0, 1, 2]
        linked = [s for s in spans if s["name"] == "megatron.pp.recv_forward.linked"]
        if stage == 0:
            assert linked == []  # the first stage receives no activation
        else:
            # the warm-up receive (micro-batch 0; W = 0 on the last stage), linked to the iteration's parent
            assert [s["attrs"]["dl.microbatch_id"] for s in linked] == [0]
            assert linked[0]["links"] and linked[0]["links"][0][0] == result["expected_trace"]
            assert linked[0]["parent"][0] == "megatron.microbatch.forward"
