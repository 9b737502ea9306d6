"""Expert parameters (``allreduce = False``) in DistributedDataParallel, the distributed optimizer and the grad norm.

4 gloo ranks, EP=2 (so expert-DP=2, DP=4): a toy model with a dense weight (the same on every rank) and an
"expert" weight that differs between the two expert-parallel ranks. Each rank writes known values into the
main grads; after ``finish_grad_sync``:
- dense grads are the mean over the 4 data-parallel ranks;
- expert grads are the sum over the 2 expert-data-parallel ranks divided by 4 (Megatron's 1/(DP x CP)), also with
  ``average_in_collective`` (pre-scale expert_dp/dp, then the average);
- the distributed optimizer shards the expert buffer over the expert-data-parallel group;
- the grad norm (and the zero count) counts every distinct grad element once: the dense ones once, each
  expert-parallel rank's experts once (not once per data-parallel rank, and not only this rank's).
"""
import math

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(120)


class _ExpertToy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig

        self.config = ModelParallelConfig(expert_model_parallel_size=2)
        self.config.num_moe_experts = 4  # what get_megatron_optimizer reads to count expert grads apart
        self.dense = torch.nn.Parameter(torch.zeros(6))
        self.expert = torch.nn.Parameter(torch.zeros(10))
        self.expert.allreduce = False  # Megatron's marker of an expert-parallel param
        self.expert.tensor_model_parallel = True


def _grad_values(rank):
    """Rank-dependent main-grad values: dense [6], expert [10]."""
    return torch.arange(6.0) + 10 * rank, torch.arange(10.0) * (rank + 1)


def _worker(rank, world, average_in_collective, distributed_optimizer):
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    edp = dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
    ep = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    model = _ExpertToy()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        average_in_collective=average_in_collective, use_distributed_optimizer=distributed_optimizer), model)
    assert len(ddp.buffers) == 1 and len(ddp.expert_parallel_buffers) == 1
    assert ddp.expert_parallel_buffers[0].params == [model.expert]
    dense, expert = _grad_values(rank)
    model.dense.main_grad.copy_(dense)
    model.expert.main_grad.copy_(expert)
    ddp.finish_grad_sync()
    expected_dense = sum(_grad_values(r)[0] for r in range(world)) / world
    expected_expert = sum(_grad_values(r)[1] for r in edp) / world
    if distributed_optimizer:  # reduce-scatter: only this rank's shard of each buffer is reduced
        shard = ddp.expert_parallel_buffers[0].buckets[0].grad_data.numel() // len(edp)
        lo = edp.index(rank) * shard
        hi = min(lo + shard, model.expert.numel())
        torch.testing.assert_close(model.expert.main_grad[lo:hi], expected_expert[lo:hi])
    else:
        torch.testing.assert_close(model.dense.main_grad, expected_dense)
        torch.testing.assert_close(model.expert.main_grad, expected_expert)

    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed_optimizer,
                                                       clip_grad=1.0), [ddp])
    assert optimizer.has_expert_params
    if distributed_optimizer:  # every piece of the expert param lies in this rank's expert-DP shard
        pieces = [p for p in optimizer.pieces() if p.model_param is model.expert]
        assert all(p.param_start == edp.index(rank) * shard for p in pieces)
    if distributed_optimizer:  # this rank's shards of the reduced grads become the main params' grads
        optimizer._copy_model_grads_to_main_grads()
    else:
        optimizer.prepare_grads()
    # Distinct grads: the dense mean once; the reduced expert grad of each expert-parallel rank once (each expert-
    # parallel rank's expert-DP group, gathered from every rank's view of the rank layout).
    layouts = [None] * world
    dist.all_gather_object(layouts, (ps.get_expert_model_parallel_rank(), tuple(edp)))
    expected_sq = float(expected_dense.pow(2).sum())
    for _, group in sorted(set(layouts)):
        expected_sq += float((sum(_grad_values(r)[1] for r in group) / world).pow(2).sum())
    assert len(set(layouts)) == 2 and len(ep) == 2
    norm = optimizer.get_grad_norm()
    # One zero per distinct expert grad (index 0 of arange * (rank + 1)); the dense mean has none.
    assert optimizer.count_zeros() == len(set(layouts))
    ps.destroy_model_parallel()
    return norm, math.sqrt(expected_sq)


@pytest.mark.parametrize("average_in_collective", [False, True])
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_expert_grads_reduce_over_expert_dp_and_count_once_in_the_norm(average_in_collective,
                                                                       distributed_optimizer):
    results = run_distributed(_worker, 4, average_in_collective, distributed_optimizer)
    for norm, expected in results:
        assert norm == pytest.approx(expected, rel=1e-6)
    assert len({round(norm, 9) for norm, _ in results}) == 1


class _BiasedRouters(torch.nn.Module):
    """Two routers' expert-bias buffers (what finalize_model_grads finds by attribute), E = 4."""

    def __init__(self, counts):
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig

        self.config = ModelParallelConfig()
        self.config.moe_router_enable_expert_bias = True
        self.config.moe_router_bias_update_rate = 0.25
        self.routers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for router, layer_counts in zip(self.routers, counts):
            router.register_buffer("local_tokens_per_expert", torch.tensor(layer_counts, dtype=torch.float32),
                                   persistent=False)
            router.register_buffer("expert_bias", torch.full((4,), 1.0))


def _bias_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    ps.initialize_model_parallel()
    # Per rank and layer; summed over the 2 data-parallel ranks: layer 0 [4, 8, 6, 6], layer 1 [5, 5, 5, 5].
    counts = [[[1, 6, 3, 2], [5, 0, 2, 3]], [[3, 2, 3, 4], [0, 5, 3, 2]]][rank]
    model = _BiasedRouters(counts)
    finalize_model_grads([model])
    ps.destroy_model_parallel()
    return ([router.expert_bias.tolist() for router in model.routers],
            [router.local_tokens_per_expert.tolist() for router in model.routers])


def test_expert_bias_updates_once_per_step_from_the_counts_of_all_data_parallel_ranks():
    """bias += sign(mean(count) - count) * rate with the counts summed over TP x DP x CP; counts zeroed."""
    for biases, counts in run_distributed(_bias_worker, 2):
        assert biases == [[1.25, 0.75, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
        assert counts == [[0.0] * 4, [0.0] * 4]
