"""Pipeline parallelism gives the numbers of one process: 20 training iterations per layout, same seed,
data and global batch, fp32 on gloo, loss and grad norm within 1e-5 relative of TP=PP=DP=1.

One launch of 4 worker processes runs every layout: the workers re-form a process group of the size a
layout needs (1, 2 or 4 ranks; the others wait), and re-initialise parallel_state between layouts.
Each layout trains a tiny GPT with Megatron's pieces (GPTModel chunks per virtual stage, DDP,
finalize_model_grads, the Megatron optimizer with clipping, ``get_forward_backward_func``); the
reference runs the same code on one rank. ``pretrain_gpt.py`` end to end is covered by
tests/test_pipeline_parallel_pretrain.py.
"""
import datetime
from functools import partial

import pytest
import torch
import torch.distributed as dist

from dist_utils import free_port, run_distributed

ITERS = 20
SEQ, MBS, GBS, HIDDEN, HEADS, VOCAB = 16, 2, 8, 32, 4, 128

# (name, world, tp, pp, vp, num_layers, tied, first-stage layers) -> compared with the world-1 run of
# the same (num_layers, tied). Layouts named in DISTRIBUTED_OPTIMIZER train with the distributed optimizer
# and both overlaps (--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather).
LAYOUTS = [
    ("pp2-tied", 2, 1, 2, None, 4, True, None),
    ("pp2-untied", 2, 1, 2, None, 4, False, None),
    ("pp2-vp2-tied", 2, 1, 2, 2, 4, True, None),
    ("pp2-vp2-untied", 2, 1, 2, 2, 4, False, None),
    ("pp2-uneven-1-of-3", 2, 1, 2, None, 3, True, 1),
    ("pp4-tied", 4, 1, 4, None, 4, True, None),
    ("pp2-tp2", 4, 2, 2, None, 4, True, None),
    ("pp2-dp2", 4, 1, 2, None, 4, True, None),
    ("pp2-dp2-distopt", 4, 1, 2, None, 4, True, None),
]
DISTRIBUTED_OPTIMIZER = {"pp2-dp2-distopt"}
REFERENCES = sorted({(layers, tied) for *_, layers, tied, _ in LAYOUTS})


def _global_batch(iteration):
    """Token ids [GBS, SEQ + 1] of one iteration (the same on every rank and layout): arithmetic
    sequences with a random start and step, which the model learns within a few iterations."""
    generator = torch.Generator().manual_seed(1000 + iteration)
    start = torch.randint(0, VOCAB, (GBS, 1), generator=generator)
    step = torch.randint(1, 4, (GBS, 1), generator=generator)
    return (start + step * torch.arange(SEQ + 1)) % VOCAB


def _data_iterator(dp_rank, dp_size):
    """Micro batches in the order Megatron's sampler gives them: DP rank r takes rows [r*mbs, (r+1)*mbs)
    of each consecutive group of mbs*dp samples."""
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    for iteration in range(ITERS):
        batch = _global_batch(iteration)
        for start in range(0, GBS, MBS * dp_size):
            rows = batch[start + dp_rank * MBS: start + (dp_rank + 1) * MBS]
            yield {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
                   "position_ids": position_ids}


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def _forward_step(data_iterator, model):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    vp_stage = unwrap_model(model).vp_stage
    if ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage):
        batch = next(data_iterator)
        tokens, labels, loss_mask, position_ids = (batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
    else:  # a middle block: its input comes from the previous stage
        tokens = labels = loss_mask = position_ids = None
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


def _train_layout(tp, pp, vp, num_layers, tied, first_layers, distopt=False):
    """Train ITERS iterations; returns [(loss, grad norm)] per iteration on the rank that logs (last
    stage, TP and DP rank 0), else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, set_model_init_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp)
    try:
        torch.manual_seed(1234 + 100 * ps.get_pipeline_model_parallel_rank())
        model_parallel_cuda_manual_seed(1234 + 100 * ps.get_pipeline_model_parallel_rank())
        set_model_init_seed(1234)
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
            attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp, num_layers_in_first_pipeline_stage=first_layers)
        chunks = []
        for vp_stage in range(vp or 1):
            ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
            chunks.append(GPTModel(
                config, vocab_size=VOCAB, max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=tied, vp_stage=vp_stage if vp else None))
        ps.set_virtual_pipeline_model_parallel_rank(0)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, overlap_grad_reduce=distopt, overlap_param_gather=distopt)
        model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
                 for i, chunk in enumerate(chunks)]
        for chunk in model:
            chunk.broadcast_params()
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                                                          use_distributed_optimizer=distopt), model)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss

        dp_size = ps.get_data_parallel_world_size()
        iterator = _data_iterator(ps.get_data_parallel_rank(), dp_size)
        num_microbatches = GBS // (MBS * dp_size)
        history = []
        for _ in range(ITERS):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reports = get_forward_backward_func()(
                forward_step_func=_forward_step, data_iterator=[iterator] * len(model) if vp else iterator,
                model=model, num_microbatches=num_microbatches,
                seq_length=SEQ, micro_batch_size=MBS, decoder_seq_length=SEQ, forward_only=False)
            update_successful, grad_norm, _ = optimizer.step()
            assert update_successful
            if ps.is_pipeline_last_stage():
                totals = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
                dist.all_reduce(totals, group=ps.get_data_parallel_group())
                history.append(((totals[0] / totals[1]).item(), grad_norm))
            else:
                assert reports == []  # the loss lives on the last stage only
        logs = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_data_parallel_rank() == 0
        return history if logs else None
    finally:
        ps.destroy_model_parallel()
        set_model_init_seed(None)


def _in_world(rank, world, port, jobs):
    """Run each ``(key, fn)`` of ``jobs`` in one fresh process group of the first ``world`` ranks;
    ``{key: fn()}`` of the values that are not None ({} on ranks outside the group)."""
    if rank >= world:
        return {}
    # One group (one store on ``port``) per phase: re-creating it per layout could let a fast rank
    # reach the previous layout's store before the slow one has closed it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        results = {key: fn() for key, fn in jobs}
        dist.barrier()
        return {key: value for key, value in results.items() if value is not None}
    finally:
        dist.destroy_process_group()


def _all_layouts(rank, world_size):
    torch.set_num_threads(1)
    ports = [free_port() for _ in range(3)] if rank == 0 else [None] * 3
    dist.broadcast_object_list(ports, src=0)
    dist.destroy_process_group()
    results = _in_world(rank, 1, ports[0], [
        (("reference", layers, tied), partial(_train_layout, 1, 1, None, layers, tied, None))
        for layers, tied in REFERENCES])
    for port, world in ((ports[1], 2), (ports[2], 4)):
        results.update(_in_world(rank, world, port, [
            (name, partial(_train_layout, tp, pp, vp, layers, tied, first, name in DISTRIBUTED_OPTIMIZER))
            for name, layout_world, tp, pp, vp, layers, tied, first in LAYOUTS if layout_world == world]))
    return results


@pytest.fixture(scope="module")
def runs():
    merged = {}
    for result in run_distributed(_all_layouts, 4, timeout=840):
        merged.update(result)
    return merged


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_pipeline_layout_matches_one_process_for_20_iterations(runs, layout):
    name, world, tp, pp, vp, layers, tied, first = layout
    reference = runs["reference", layers, tied]
    run = runs[name]
    assert len(run) == len(reference) == ITERS
    for iteration, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(run, reference), start=1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{name}: loss at iteration {iteration}"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"{name}: grad norm at iteration {iteration}"
    assert reference[-1][0] < reference[0][0] - 0.1  # it learns, so the comparison means something
