"""Pipeline schedules in one process with a mocked p2p layer: forward/backward order per stage and
warm-up counts against Megatron's formulas, for several (pp, micro-batches, virtual stages)."""
import contextlib

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    get_num_warmup_microbatches,
)

SEQ, MBS, HIDDEN = 2, 1, 3


class _Record(torch.autograd.Function):
    """Identity whose backward appends ("B", chunk, microbatch) to a log."""

    @staticmethod
    def forward(ctx, x, log, chunk, microbatch):
        ctx.meta = (log, chunk, microbatch)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        log, chunk, microbatch = ctx.meta
        log.append(("B", chunk, microbatch))
        log.synced.append(not log.in_no_sync)
        return grad, None, None, None


class Chunk(torch.nn.Module):
    def __init__(self, chunk, log):
        super().__init__()
        self.config = ModelParallelConfig()
        self.config.hidden_size = HIDDEN
        self.chunk, self.log = chunk, log
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.input_tensor = None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    @contextlib.contextmanager
    def no_sync(self):
        self.log.in_no_sync = True
        try:
            yield
        finally:
            self.log.in_no_sync = False

    def forward(self, microbatch):
        x = self.input_tensor if self.input_tensor is not None else torch.ones(SEQ, MBS, HIDDEN)
        self.log.append(("F", self.chunk, microbatch))
        return _Record.apply(x * self.weight, self.log, self.chunk, microbatch)


def forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(output):
        loss = output.sum()
        return loss, {"loss": loss.detach()}

    return output, loss_func


@pytest.fixture
def fake_pipeline(monkeypatch):
    """Pretend to be stage ``rank`` of ``pp``; record the p2p calls instead of communicating."""
    calls = []

    def communicate(*, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, config,
                    microbatch_ids=None):
        calls.append({"send_next": tensor_send_next is not None, "send_prev": tensor_send_prev is not None,
                      "recv_prev": recv_prev, "recv_next": recv_next})
        shape = tuple(tensor_shape)
        return (torch.ones(shape, requires_grad=True) if recv_prev else None,
                torch.ones(shape) if recv_next else None)

    monkeypatch.setattr(p2p, "_communicate", communicate)

    def setup(pp, rank, vp=None):
        calls.clear()
        parallel_state.set_pipeline_model_parallel_world_size(pp)
        parallel_state.set_pipeline_model_parallel_rank(rank)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
        return calls

    yield setup
    parallel_state.set_pipeline_model_parallel_world_size(None)
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    parallel_state.set_virtual_pipeline_model_parallel_rank(None)


# Megatron's formulas, restated independently of the implementation.
def megatron_warmup(pp, rank, m, chunks, forward_only=False):
    if chunks == 1:
        return min(pp - rank - 1, m)
    if forward_only or m == pp:
        return m * chunks
    return min((pp - rank - 1) * 2 + (chunks - 1) * pp, m * chunks)


def expected_order(pp, rank, m, chunks):
    total, group = m * chunks, pp * chunks
    warmup = megatron_warmup(pp, rank, m, chunks)

    def fwd(k):
        return ("F", (k % group) // pp, (k // group) * pp + k % pp)

    def bwd(k):
        return ("B", chunks - 1 - (k % group) // pp, (k // group) * pp + k % pp)

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


class Log(list):
    """Events ("F"/"B", chunk, micro-batch); ``synced``: per backward, whether grad sync was on."""

    def __init__(self):
        super().__init__()
        self.in_no_sync, self.synced = False, []


def _run(pp, rank, m, chunks, forward_only=False):
    log = Log()
    model = [Chunk(c, log) for c in range(chunks)]
    iterators = [iter(range(m)) for _ in range(chunks)]
    func = get_forward_backward_func()
    reports = func(forward_step_func=forward_step, data_iterator=iterators if chunks > 1 else iterators[0],
                   model=model, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                   forward_only=forward_only)
    return log, reports


ONE_F_ONE_B = [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8)]
INTERLEAVED = [(2, 2, 2), (2, 4, 2), (2, 6, 3), (4, 4, 2), (4, 8, 3)]


@pytest.mark.parametrize("pp,m", ONE_F_ONE_B)
def test_1f1b_order_and_warmup(fake_pipeline, pp, m):
    sends_next, recvs_prev = [], []
    for rank in range(pp):
        calls = fake_pipeline(pp, rank)
        assert get_forward_backward_func() is forward_backward_pipelining_without_interleaving
        log, reports = _run(pp, rank, m, 1)
        assert log == expected_order(pp, rank, m, 1), f"pp={pp} rank={rank} m={m}"
        assert log.synced == [False] * (m - 1) + [True]  # grad sync only for the last backward
        warmup = megatron_warmup(pp, rank, m, 1)
        assert get_num_warmup_microbatches(m, pp, rank) == warmup
        first_backward = log.index(next(e for e in log if e[0] == "B"))
        assert first_backward == (warmup + 1 if warmup < m else m)
        assert len(reports) == (m if rank == pp - 1 else 0)
        sends_next.append(sum(c["send_next"] for c in calls))
        recvs_prev.append(sum(c["recv_prev"] for c in calls))
        assert sum(c["send_prev"] for c in calls) == (0 if rank == 0 else m)
        assert sum(c["recv_next"] for c in calls) == (0 if rank == pp - 1 else m)
    # every activation sent to the next stage is received there
    assert sends_next[:-1] == recvs_prev[1:] == [m] * (pp - 1)


@pytest.mark.parametrize("pp,m,chunks", INTERLEAVED)
def test_interleaved_order_and_warmup(fake_pipeline, pp, m, chunks):
    sends_next, recvs_prev, sends_prev, recvs_next = [], [], [], []
    for rank in range(pp):
        calls = fake_pipeline(pp, rank, vp=chunks)
        assert get_forward_backward_func() is forward_backward_pipelining_with_interleaving
        log, reports = _run(pp, rank, m, chunks)
        assert log == expected_order(pp, rank, m, chunks), f"pp={pp} rank={rank} m={m} chunks={chunks}"
        backwards = [e for e in log if e[0] == "B"]
        last_of_chunk = {c: max(i for i, e in enumerate(backwards) if e[1] == c) for c in range(chunks)}
        assert log.synced == [i in last_of_chunk.values() for i in range(len(backwards))]
        warmup = megatron_warmup(pp, rank, m, chunks)
        assert get_num_warmup_microbatches(m, pp, rank, chunks) == warmup
        first_backward = log.index(next(e for e in log if e[0] == "B"))
        assert first_backward == (warmup + 1 if warmup < m * chunks else m * chunks)
        assert len(reports) == (m if rank == pp - 1 else 0)
        sends_next.append(sum(c["send_next"] for c in calls))
        recvs_prev.append(sum(c["recv_prev"] for c in calls))
        sends_prev.append(sum(c["send_prev"] for c in calls))
        recvs_next.append(sum(c["recv_next"] for c in calls))
    # Around the ring (last stage -> first stage between chunks) every send has its receive.
    assert recvs_prev == sends_next[-1:] + sends_next[:-1]
    assert recvs_next == sends_prev[1:] + sends_prev[:1]
    # m * (pp * chunks - 1) activations cross a virtual-stage boundary in total
    assert sum(sends_next) == m * (pp * chunks - 1) == sum(sends_prev)


@pytest.mark.parametrize("pp,m,chunks", [(2, 4, 1), (4, 2, 1), (2, 4, 2), (4, 8, 3)])
def test_forward_only_runs_every_forward_and_no_backward(fake_pipeline, pp, m, chunks):
    for rank in range(pp):
        fake_pipeline(pp, rank, vp=chunks if chunks > 1 else None)
        log, reports = _run(pp, rank, m, chunks, forward_only=True)
        assert [e for e in log if e[0] == "B"] == []
        assert sorted(log) == sorted(("F", c, i) for c in range(chunks) for i in range(m))
        assert len(reports) == (m if rank == pp - 1 else 0)


def test_interleaving_refuses_microbatches_not_multiple_of_pp(fake_pipeline):
    fake_pipeline(4, 0, vp=2)
    with pytest.raises(ValueError, match=r"number of microbatches \(6\) is not divisible by "
                                         r"pipeline-model-parallel-size \(4\)"):
        _run(4, 0, 6, 2)


def test_get_forward_backward_func_without_pipelining():
    assert get_forward_backward_func() is forward_backward_no_pipelining


def test_exception_on_a_stage_is_reported_with_its_rank(fake_pipeline, caplog):
    fake_pipeline(2, 1)

    def failing_step(data_iterator, model):
        if next(data_iterator) == 1:
            raise FloatingPointError("NaN in loss")
        return forward_step(iter([0]), model)

    with pytest.raises(FloatingPointError):
        forward_backward_pipelining_without_interleaving(
            forward_step_func=failing_step, data_iterator=iter(range(3)), model=[Chunk(0, Log())],
            num_microbatches=3, seq_length=SEQ, micro_batch_size=MBS)
    assert "pipeline stage failed on rank 0 (pipeline stage 1): FloatingPointError: NaN in loss" in caplog.text
    # a neighbour's failure is not reported as this stage's own
    caplog.clear()

    def peer_failure(data_iterator, model):
        raise p2p.PipelinePeerError("recv_forward with rank 0 failed")

    with pytest.raises(p2p.PipelinePeerError):
        forward_backward_pipelining_without_interleaving(
            forward_step_func=peer_failure, data_iterator=iter(range(3)), model=[Chunk(0, Log())],
            num_microbatches=3, seq_length=SEQ, micro_batch_size=MBS)
    assert "pipeline stage failed" not in caplog.text


def test_deallocate_output_tensor_keeps_the_graph():
    w = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)
    out = x + torch.tanh(x @ w)  # the add saves nothing, so the data of out is not needed backward
    grad = torch.randn(2, 3)
    expected = torch.autograd.grad(x + torch.tanh(x @ w), w, grad)[0]
    schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    assert out.numel() == 1
    schedules.custom_backward(out, grad)
    assert torch.allclose(w.grad, expected)
    view = (x @ w)[0]
    schedules.deallocate_output_tensor(view, deallocate_pipeline_outputs=True)
    assert view.shape == (3,)  # a view is left alone
