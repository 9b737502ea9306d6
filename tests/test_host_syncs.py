"""Host reads of device tensors per training iteration (each one a device sync on a GPU): at most two at
log interval 1 (the grad norm for clipping, the log line), with TP = 2 and with --overlap-grad-reduce.

Before: 6 per iteration on one rank (a NaN check per bucket group, the grad norm, 3 on the log line,
the timers' all-gather), 10 at TP = 2 (+ one shape read per micro-batch), 12 with 7 overlapped buckets.
"""
import json

import pytest
import torch
import torch.distributed as dist

from dist_utils import single_rank_process_group
from pretrain_utils import _pretrain_argv, run_ranks


def _reads_per_iteration(nproc, flags, shared_data, prefix, tmp_path):
    argv = _pretrain_argv(["--micro-batch-size", "2", "--train-iters", "5", "--eval-interval", "1000", *flags],
                          shared_data, prefix, tmp_path)
    argv = ["tests/count_device_reads.py", *argv]
    result = run_ranks(nproc, argv, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("DEVICE_READS ")]
    assert sorted(r["rank"] for r in reports) == list(range(nproc))
    return reports


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc, flags", [
    (2, ["--tensor-model-parallel-size", "2"]),
    # Several buckets under overlap; no clipping, so the deferred NaN check reads the bucket norms itself.
    (2, ["--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--clip-grad", "0"]),
], ids=["tp2", "dp2-overlap-no-clip"])
def test_at_most_two_device_reads_per_iteration(nproc, flags, shared_data, shakespeare_prefix, tmp_path):
    for report in _reads_per_iteration(nproc, flags, shared_data, shakespeare_prefix, tmp_path):
        iterations = report["per_iteration"]
        assert len(iterations) == 4
        # Iteration 1 may learn one-time facts (the TP batch shape); later ones are the steady state.
        assert len(iterations[0]) <= 3, iterations[0]
        for sites in iterations[1:]:
            assert len(sites) <= 2, (report["rank"], sites)


@pytest.fixture
def single_rank():
    with single_rank_process_group():
        yield


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig

        self.config = ModelParallelConfig()
        self.a = torch.nn.Parameter(torch.ones(3))
        self.b = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return (self.a * x).sum() + (self.b * x).sum()


def _ddp_and_optimizer(clip_grad):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import _grad_nan_check

    module = _Net()
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        check_for_nan_in_grad=True, overlap_grad_reduce=True, bucket_size=2), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=clip_grad), [ddp])
    ddp.defer_nan_check = True
    optimizer.grad_norm_check = _grad_nan_check([ddp])
    return module, ddp, optimizer


@pytest.mark.parametrize("clip_grad", [1.0, 0.0])
def test_deferred_nan_check_raises_before_the_step(single_rank, clip_grad):
    module, ddp, optimizer = _ddp_and_optimizer(clip_grad)
    assert len(ddp.bucket_groups) == 2
    ddp.zero_grad_buffer()
    ddp(torch.tensor(float("nan"))).backward()
    ddp.finish_grad_sync()  # deferred: no read, no error here
    with pytest.raises(RuntimeError, match="NaN or Inf in local grad norm"):
        optimizer.step()
    assert torch.equal(module.a.detach(), torch.ones(3)), "the step must not run"


def test_finite_grads_with_clipping_cost_no_extra_read(single_rank, monkeypatch):
    module, ddp, optimizer = _ddp_and_optimizer(1.0)
    ddp.zero_grad_buffer()
    ddp(torch.tensor(2.0)).backward()
    ddp.finish_grad_sync()
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    updated, grad_norm, _ = optimizer.step()
    assert updated and grad_norm == pytest.approx(2.0 * 5 ** 0.5) and reads == []
    assert not torch.equal(module.a.detach(), torch.ones(3))


def test_timers_log_without_an_active_timer_gathers_nothing(single_rank, monkeypatch, capsys):
    from megatron.core.timers import Timers

    gathers = []
    real_all_gather = dist.all_gather
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: gathers.append(1) or real_all_gather(*a, **k))
    timers = Timers(log_level=0, log_option="minmax")
    timers("forward-backward", log_level=1).start()  # above level 0: a dummy, never registered
    timers("forward-backward").stop()
    timers.log(["forward-backward", "optimizer"])
    assert gathers == [] and capsys.readouterr().out == ""
    timers("save-checkpoint", log_level=0).start()
    timers("save-checkpoint").stop()
    timers.log(["save-checkpoint"])
    assert gathers == [1] and "save-checkpoint" in capsys.readouterr().out


def test_rope_angles_are_built_once_per_device():
    """The frequencies reach the device once: a later forward of the same length dispatches no op at all
    (already so before issue 22's change; kept as a guard)."""
    from op_recorder import OpRecorder
    from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(16)
    device = torch.device("meta")  # stands in for CUDA: a copy to it is a dispatched op, as there
    with OpRecorder() as first:
        rope(8, device=device)
    with OpRecorder() as second:
        angles = rope(8, device=device)
    assert "aten._to_copy.default" in first.ops and second.ops == []
    assert angles.device == device and angles.shape == (8, 1, 1, 16)
