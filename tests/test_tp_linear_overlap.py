"""TP=2 (with and without SP) linear layers: the overlapped backward gives TP=1's grads, in Megatron's order.

The column-parallel backward must issue its collectives asynchronously around the GEMMs
(Korthikanti et al. 2022, section 4.2.2; Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication):
SP: start all-gather(input), dgrad GEMM, wait, start reduce-scatter(dgrad), wgrad GEMM, wait;
no SP: dgrad GEMM, start all-reduce(dgrad), wgrad GEMM, wait. Grads (input, weight / main_grad over
two micro-batches, bias) must equal the single-device fp64 reference within 1e-5.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import mappings

S, B, HIDDEN, FFN = 8, 2, 12, 16
MICROBATCHES = 2
TOL = 1e-5


class _RecordingWork:
    """Wraps a collective's Work so that its wait() lands in the event list."""

    def __init__(self, work, label, events):
        self._work, self._label, self._events = work, label, events

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._events.append(f"wait {self._label}")
        return result


class _GemmRecorder(TorchDispatchMode):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("aten.mm", "aten.addmm")):
            self.events.append("gemm")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _record_backward(events):
    """Record GEMMs and the TP collectives (with async flag and wait) into ``events``, in call order."""
    def wrap(label, collective):
        def call(*args, async_op=False, **kwargs):
            work = collective(*args, async_op=async_op, **kwargs)
            events.append(f"{label}{'(async)' if async_op else ''}")
            return _RecordingWork(work, label, events) if async_op else work
        return call

    saved = [(mappings, "_all_gather_flat"), (mappings, "_reduce_scatter_flat"), (dist, "all_reduce")]
    originals = [getattr(module, name) for module, name in saved]
    labels = ["all_gather", "reduce_scatter", "all_reduce"]
    try:
        for (module, name), original, label in zip(saved, originals, labels):
            setattr(module, name, wrap(label, original))
        with _GemmRecorder(events):
            yield
    finally:
        for (module, name), original in zip(saved, originals):
            setattr(module, name, original)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(failures, name, got, want):
    got = got.detach().double()
    if got.shape != want.shape or not torch.allclose(got, want, atol=TOL, rtol=TOL):
        diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)}"
        failures.append(f"{name}: max|diff|={diff}")


def _check_layer(kind, fusion, rank, world, sp, failures):
    """One layer, two micro-batches; returns the events of the first micro-batch's backward."""
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp, use_cpu_initialization=True,
                              gradient_accumulation_fusion=fusion)
    torch.manual_seed(7)
    init = lambda w: torch.nn.init.normal_(w, 0.0, 0.3)  # noqa: E731
    if kind == "column":
        layer = tp.ColumnParallelLinear(HIDDEN, FFN, config=cfg, init_method=init, bias=True,
                                        keep_master_weight_for_test=True)
        in_dim, out_dim = HIDDEN, FFN
        own_out = slice(rank * FFN // world, (rank + 1) * FFN // world)
        weight_shard = (own_out, slice(None))
    else:
        layer = tp.RowParallelLinear(FFN, HIDDEN, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False, keep_master_weight_for_test=True)
        in_dim, out_dim = FFN, HIDDEN
        own_in = slice(rank * FFN // world, (rank + 1) * FFN // world)
        weight_shard = (slice(None), own_in)
    with torch.no_grad():
        layer.bias.normal_(generator=torch.Generator().manual_seed(8))
    master = layer.master_weight.double()
    if fusion:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
        layer.weight.grad_added_to_main_grad = False
        layer.weight.zero_out_wgrad = False

    name = f"{kind} fusion={fusion}"
    events, ref_wgrad = [], torch.zeros(out_dim, in_dim, dtype=torch.float64)
    for mb in range(MICROBATCHES):
        x_full = _randn(S, B, in_dim, seed=100 + mb)
        g_full = _randn(S, B, out_dim, seed=200 + mb)
        ref_wgrad += g_full.reshape(-1, out_dim).t() @ x_full.reshape(-1, in_dim)
        ref_dgrad = g_full @ master
        if kind == "column":
            x = x_full.chunk(world, dim=0)[rank] if sp else x_full
            g = g_full[..., own_out]
            want_dgrad = ref_dgrad.chunk(world, dim=0)[rank] if sp else ref_dgrad
        else:
            x = x_full[..., own_in]
            g = g_full.chunk(world, dim=0)[rank] if sp else g_full
            want_dgrad = ref_dgrad[..., own_in]
        x = x.float().clone().requires_grad_()
        out, _ = layer(x)
        with _record_backward(events) if mb == 0 else contextlib.nullcontext():
            out.backward(g.float())
        _close(failures, f"{name} micro-batch {mb} input grad", x.grad, want_dgrad)

    wgrad = layer.weight.main_grad if fusion else layer.weight.grad
    _close(failures, f"{name} weight grad over {MICROBATCHES} micro-batches", wgrad, ref_wgrad[weight_shard])
    if kind == "column":
        ref_bgrad = sum(_randn(S, B, out_dim, seed=200 + mb).sum(dim=(0, 1)) for mb in range(MICROBATCHES))
        _close(failures, f"{name} bias grad", layer.bias.grad, ref_bgrad[own_out])
    return events


def _overlap_checks(rank, world, sp):
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    failures, events = [], {}
    for kind in ("column", "row"):
        for fusion in (False, True):
            events[(kind, fusion)] = _check_layer(kind, fusion, rank, world, sp, failures)
    return failures, events


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_overlapped_backward_matches_tp1_and_follows_megatron_order(sp):
    results = run_distributed(_overlap_checks, 2, sp, timeout=300)
    for rank, (failures, events) in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
        for fusion in (False, True):
            column = events[("column", fusion)]
            if sp:
                want = ["all_gather(async)", "gemm", "wait all_gather", "reduce_scatter(async)", "gemm",
                        "wait reduce_scatter"]
            else:
                want = ["gemm", "all_reduce(async)", "gemm", "wait all_reduce"]
            assert column == want, f"rank {rank} column fusion={fusion}: {column}"
            # Row-parallel: no collective inside the linear's backward (the input grad is already a
            # shard); under SP the output mapping's backward all-gathers the grad before the GEMMs.
            row = events[("row", fusion)]
            assert row == (["all_gather"] if sp else []) + ["gemm", "gemm"], f"rank {rank} row fusion={fusion}: {row}"
