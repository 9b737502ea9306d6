"""No-pipelining schedule: loss scaling contract, no_sync placement, finalize hook, timers (single process)."""
import contextlib

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.timers import Timers

M, MBS = 4, 3


class Model(torch.nn.Module):
    """[b, 5] -> [b, 2] with a record of whether each forward ran inside no_sync."""

    def __init__(self, **config):
        super().__init__()
        torch.manual_seed(0)
        self.config = ModelParallelConfig(**config)
        self.linear = torch.nn.Linear(5, 2)
        self.in_no_sync = False
        self.forward_in_no_sync = []

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        try:
            yield
        finally:
            self.in_no_sync = False

    def forward(self, x):
        self.forward_in_no_sync.append(self.in_no_sync)
        return self.linear(x)


def _batches(with_mask=False):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * MBS, 5, generator=g), torch.randn(M * MBS, 2, generator=g)
    mask = (torch.rand(M * MBS, 2, generator=g) > 0.4).float() if with_mask else torch.ones(M * MBS, 2)
    return [(x[i * MBS:(i + 1) * MBS], y[i * MBS:(i + 1) * MBS], mask[i * MBS:(i + 1) * MBS]) for i in range(M)]


def _forward_step(legacy=False):
    def forward_step(data_iterator, model):
        x, y, mask = next(data_iterator)
        output = model(x)

        def loss_func(output, non_loss_data=False):
            if non_loss_data:
                return {"output_sum": output.sum().item()}
            per_token = (output - y) ** 2
            loss = (per_token * mask).sum()
            num_tokens = mask.sum().to(torch.int)
            if legacy:
                mean = loss / num_tokens
                return mean, {"lm loss": mean.detach()}
            return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

        return output, loss_func

    return forward_step


def _run(model, batches, legacy=False, **kwargs):
    return forward_backward_no_pipelining(forward_step_func=_forward_step(legacy), data_iterator=iter(batches),
                                          model=[model], num_microbatches=len(batches), seq_length=1,
                                          micro_batch_size=MBS, **kwargs)


def _reference_grads(batches, combine):
    model = Model()
    losses = []
    for x, y, mask in batches:
        per_token = (model.linear(x) - y) ** 2
        losses.append(((per_token * mask).sum(), mask.sum()))
    combine(losses).backward()
    return [p.grad for p in model.linear.parameters()]


def _grads(model):
    return [p.grad for p in model.linear.parameters()]


@pytest.mark.parametrize("legacy", [False, True])
def test_mean_loss_over_microbatches_equals_one_big_batch(legacy):
    batches = _batches()
    model = Model()
    reports = _run(model, batches, legacy=legacy)
    assert len(reports) == M
    big_batch = _reference_grads([tuple(torch.cat(t) for t in zip(*batches))],
                                 lambda losses: losses[0][0] / losses[0][1])
    for ours, ref in zip(_grads(model), big_batch):
        assert torch.allclose(ours, ref, atol=1e-6)
    # grad sync is disabled for all but the last microbatch
    assert model.forward_in_no_sync == [True] * (M - 1) + [False]


def test_unequal_token_counts_average_per_microbatch_means():
    batches = _batches(with_mask=True)
    model = Model()
    _run(model, batches)
    expected = _reference_grads(batches, lambda losses: sum(l / n for l, n in losses) / M)
    for ours, ref in zip(_grads(model), expected):
        assert torch.allclose(ours, ref, atol=1e-6)


def test_per_token_loss_passes_total_tokens_to_finalize():
    batches = _batches(with_mask=True)
    calls = []
    model = Model(calculate_per_token_loss=True)
    model.config.finalize_model_grads_func = lambda chunks, num_tokens: calls.append((chunks, num_tokens.clone()))
    _run(model, batches)
    (chunks, num_tokens), = calls
    assert chunks == [model] and int(num_tokens) == int(sum(b[2].sum() for b in batches))
    expected = _reference_grads(batches, lambda losses: sum(l for l, _ in losses))  # unnormalised sum
    for ours, ref in zip(_grads(model), expected):
        assert torch.allclose(ours, ref, atol=1e-5)


def test_grad_scale_func_no_sync_func_and_finalize_without_per_token():
    batches = _batches()
    calls, no_sync_entries = [], []

    @contextlib.contextmanager
    def no_sync():
        no_sync_entries.append(True)
        yield

    model = Model()
    model.config.grad_scale_func = lambda loss: loss * 8.0
    model.config.no_sync_func = no_sync
    model.config.finalize_model_grads_func = lambda chunks, num_tokens: calls.append(num_tokens)
    _run(model, batches)
    assert calls == [None] and no_sync_entries == [True]
    unscaled = Model()
    _run(unscaled, batches)
    for ours, ref in zip(_grads(model), _grads(unscaled)):
        assert torch.allclose(ours, 8.0 * ref, atol=1e-5)


def test_forward_only_and_non_loss_data():
    batches = _batches()
    model = Model()
    model.config.finalize_model_grads_func = lambda *args: pytest.fail("finalize must not run in forward_only")
    reports = _run(model, batches, forward_only=True)
    assert len(reports) == M and all(p.grad is None for p in model.parameters())
    data = _run(model, batches, forward_only=True, collect_non_loss_data=True)
    assert [set(d) for d in data] == [{"output_sum"}] * M


def test_timers_are_driven():
    model = Model()
    model.config.timers = Timers(log_level=2)
    _run(model, _batches())
    assert model.config.timers("forward-compute", log_level=2).active_time() > 0
    assert model.config.timers("backward-compute", log_level=2).active_time() > 0


def test_errors():
    model = Model()
    with pytest.raises(ValueError, match="model chunking"):
        forward_backward_no_pipelining(forward_step_func=_forward_step(), data_iterator=iter(_batches()),
                                       model=[model, model], num_microbatches=M, seq_length=1, micro_batch_size=MBS)

    def bad_step(data_iterator, model):
        next(data_iterator)
        return torch.zeros(1, requires_grad=True), lambda out: (out,)

    with pytest.raises(ValueError, match="returned 1 values"):
        forward_backward_no_pipelining(forward_step_func=bad_step, data_iterator=iter(_batches()), model=model,
                                       num_microbatches=M, seq_length=1, micro_batch_size=MBS)


def test_get_forward_backward_func_picks_the_schedule():
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving, forward_backward_pipelining_without_interleaving)

    assert get_forward_backward_func() is forward_backward_no_pipelining
    parallel_state.set_pipeline_model_parallel_world_size(2)
    try:
        assert get_forward_backward_func() is forward_backward_pipelining_without_interleaving
        parallel_state.set_virtual_pipeline_model_parallel_world_size(2)
        assert get_forward_backward_func() is forward_backward_pipelining_with_interleaving
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
