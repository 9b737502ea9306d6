"""--async-save's staging copy on a real GPU: it waits for the training stream and lands before the write.

The state to save is produced by a long queue of kernels still running when the save is scheduled; the
checkpoint must hold the final values. With 2 GPUs the same runs on cuda:1 (the device of local rank 1),
where a staging thread that never set its device waited on an idle stream of cuda:0.
"""
import pytest
import torch
import torch.distributed as dist

from gpu_utils import requires_cuda


def _save_while_busy(device: int, tmp_path):
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.training import async_checkpointing

    torch.cuda.set_device(device)
    generator = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    weight = torch.randn(2048, 2048, device=f"cuda:{device}", generator=generator) / 2048 ** 0.5
    state = torch.zeros(2048, 2048, device=f"cuda:{device}")
    x = torch.randn(2048, 2048, device=f"cuda:{device}", generator=generator)
    for _ in range(200):  # tens of milliseconds of queued work on the training stream
        x = torch.tanh(x @ weight)
    state.copy_(x)
    sharded = [ShardedTensor("state", state, state.shape, (0, 0))]
    # The writer's DCP collectives go over gloo, as in training (an NCCL group of another test's
    # fixture is bound to cuda:0).
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    writer = async_checkpointing.AsyncTorchDistWriter(sharded, str(tmp_path), group, {}, iteration=1)
    assert writer.wait() is None
    expected = state.cpu()  # the training stream's result, read after everything it queued
    loaded = torch.full_like(expected, float("nan"))
    serialization.load([ShardedTensor("state", loaded, loaded.shape, (0, 0))], str(tmp_path), process_group=group)
    return loaded, expected


@requires_cuda
def test_async_staging_waits_for_the_training_stream(tmp_path):
    loaded, expected = _save_while_busy(0, tmp_path)
    assert torch.equal(loaded, expected)


@requires_cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_async_staging_on_the_second_gpu(tmp_path):
    before = torch.cuda.current_device()
    try:
        loaded, expected = _save_while_busy(1, tmp_path)
    finally:
        torch.cuda.set_device(before)
    assert torch.equal(loaded, expected)
