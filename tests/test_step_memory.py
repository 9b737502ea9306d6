"""Nothing a training step creates outlives it: reference lifetimes, not memory figures (issue 28 item 9).

The deferred NaN check (one host read per step) records each bucket group's local grad norms in
backward; they used to stay alive until the next step's ``zero_grad_buffer``. A tensor kept from one
step to the next is what costs activation-sized memory when it is, or holds, a loss with its graph;
these tests take weak references to every tensor the step's ops create and check that none survives
the step, on the small DDP model of ``test_host_syncs.py`` and on a GPT through the real schedule.
"""
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_utils import single_rank_process_group
from test_host_syncs import _Net  # the two-parameter module the deferred NaN check is tested on


@pytest.fixture
def single_rank():
    with single_rank_process_group():
        yield


class _CreatedTensors(TorchDispatchMode):
    """Weak references to the tensors the ops under this mode return, except those that are one of the
    op's own arguments (in-place and ``out=`` ops return a tensor that existed before)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs or {}))[0]
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not any(tensor is arg for arg in inputs):
                self.refs.append((weakref.ref(tensor), str(func), tuple(tensor.shape)))
        return out

    def alive(self):
        gc.collect()
        return [(func, shape) for ref, func, shape in self.refs if ref() is not None]


def _deferred_check_setup(module, clip_grad, overlap, bucket_size=None):
    """DDP with the training loop's deferred NaN check and the optimizer that decides it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import _grad_nan_check

    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(
        check_for_nan_in_grad=True, overlap_grad_reduce=overlap, bucket_size=bucket_size), module)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=clip_grad), [ddp])
    ddp.defer_nan_check = True
    optimizer.grad_norm_check = _grad_nan_check([ddp])
    return ddp, optimizer


def _step(ddp, optimizer, run_backward):
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    run_backward()
    ddp.finish_grad_sync()
    updated, _, _ = optimizer.step()
    assert updated


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip_grad", [1.0, 0.0], ids=["finite-norm-decides", "norms-read"])
def test_recorded_grad_norms_do_not_outlive_the_step(single_rank, clip_grad):
    """With clipping a finite global norm decides the check without reading the local norms; without
    it they are read. Either way they are gone once the optimizer step has run."""
    ddp, optimizer = _deferred_check_setup(_Net(), clip_grad, overlap=True, bucket_size=2)
    assert len(ddp.bucket_groups) == 2
    ddp.zero_grad_buffer()
    ddp(torch.tensor(2.0)).backward()
    ddp.finish_grad_sync()
    recorded = [weakref.ref(group.local_grad_norms) for group in ddp.bucket_groups]
    assert all(ref() is not None for ref in recorded)  # the check has something to decide on
    optimizer.step()
    gc.collect()
    assert [ref() for ref in recorded] == [None, None]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clip_grad", [1.0, 0.0], ids=["finite-norm-decides", "norms-read"])
def test_no_tensor_of_a_step_survives_it(single_rank, clip_grad):
    ddp, optimizer = _deferred_check_setup(_Net(), clip_grad, overlap=True, bucket_size=2)

    def backward():
        ddp(torch.tensor(2.0)).backward()

    _step(ddp, optimizer, backward)  # the first step creates the optimizer's state, which stays
    created = _CreatedTensors()
    with created:
        _step(ddp, optimizer, backward)
    assert created.refs, "the mode saw no op"
    assert created.alive() == []


@pytest.mark.timeout(120)
def test_gpt_step_through_the_schedule_keeps_no_loss_or_graph(single_rank):
    """A tiny GPT, two micro-batches through the non-pipelined schedule, DDP with the deferred check,
    the optimizer: after the step only the reported (detached) losses remain; no micro-batch's output
    (which holds its graph and saved activations) and nothing else created in the step."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, gradient_accumulation_fusion=False)
    gpt = GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=True)
    ddp, optimizer = _deferred_check_setup(gpt, clip_grad=1.0, overlap=False)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = lambda chunks, num_tokens: [chunk.finish_grad_sync() for chunk in chunks]
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    outputs = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch[:, :-1], positions, None, labels=batch[:, 1:])
        outputs.append(weakref.ref(output))  # holds the graph through its grad_fn

        def loss_func(output_tensor):
            loss = output_tensor.float().sum()
            count = torch.tensor(output_tensor.numel())
            return loss, count, {"lm loss": torch.cat([loss.clone().detach().view(1), count.float().view(1)])}

        return output, loss_func

    def step():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter([tokens] * 2),
                                                 model=ddp, num_microbatches=2, seq_length=16, micro_batch_size=2)
        updated, _, _ = optimizer.step()
        assert updated
        return reports

    step()
    created = _CreatedTensors()
    with created:
        reports = step()
    gc.collect()
    assert [ref() for ref in outputs] == [None] * 4
    reported = {id(report["lm loss"]) for report in reports}
    assert all(not r["lm loss"].requires_grad for r in reports)
    survivors = [(func, shape) for ref, func, shape in created.refs
                 if ref() is not None and id(ref()) not in reported]
    assert survivors == []
