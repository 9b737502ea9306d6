"""Pipeline schedules over real gloo p2p: 1F1B (PP=2, PP=4) and interleaved (PP=2 and PP=4 with
virtual stages) give the loss and gradients of one process; a failing stage makes every stage fail
fast, naming the failing rank; receives are bounded by the pipeline group's timeout."""
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


@pytest.mark.timeout(300)
def test_pipelined_schedules_match_one_process():
    per_rank = run_distributed(_numerics_worker, 4, timeout=280)
    for index, (pp, vp, m, _) in enumerate(LAYOUTS):
        rows = [results[index] for results in per_rank]
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


@pytest.mark.timeout(200)
def test_failing_stage_fails_every_stage_naming_its_rank():
    per_rank = run_distributed(_failure_worker, 4, timeout=180)
    elapsed, message = per_rank[3]["timeout"]
    assert 2.5 < elapsed < 30 and "recv_forward with rank 1" in message, (elapsed, message)
    for rank, out in enumerate(per_rank):
        assert out["failure"] is not None, f"rank {rank} finished although stage {FAILING_RANK} failed"
        kind, message, elapsed = out["failure"]
        assert elapsed < 60, (rank, elapsed)
        if rank == FAILING_RANK:
            assert (kind, message) == ("RuntimeError", "injected failure in forward")
        else:
            assert kind == "PipelinePeerError", (rank, kind, message)
            assert f"pipeline stage failed on rank {FAILING_RANK}" in message, (rank, message)
