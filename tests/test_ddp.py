"""DistributedDataParallel, finalize_model_grads and the no-pipelining schedule across gloo ranks."""
import math

import pytest
import torch

from dist_utils import run_distributed, single_rank_process_group
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

LR, WD, CLIP, STEPS, MICRO = 0.01, 0.1, 0.05, 3, 2


class TinyModel(torch.nn.Module):
    """[b, 4] -> [b, 3]; fc1, norm and fc2 cover 2-D weights, 1-D norm params and biases."""

    def __init__(self, seed: int, calculate_per_token_loss: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.config = ModelParallelConfig(calculate_per_token_loss=calculate_per_token_loss)
        self.fc1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _reference():
    """Single process, full batch, mean loss, torch AdamW + clip_grad_norm_: grads of step 1, final params."""
    x, y = _data()
    model = TinyModel(seed=1234)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR)
    first_grads = None
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _forward_step(data_iterator, model):
    x, y = next(data_iterator)
    output = model(x)

    def loss_func(output):
        squared_error = (output - y) ** 2
        loss = squared_error.sum()
        num_tokens = torch.tensor(squared_error.numel(), dtype=torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def _train_variant(rank, world_size, ddp_kwargs, per_token):
    """DDP + FP32Optimizer trained through the schedule on this rank's half of the batch."""
    x, y = _data()
    per_rank = x.shape[0] // world_size
    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    # Different init per rank: broadcast_params must make them equal to rank 0's (seed 1234).
    module = TinyModel(seed=1234 + rank, calculate_per_token_loss=per_token)
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(**ddp_kwargs), module)
    model.broadcast_params()
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [model])
    module.config.grad_scale_func = optimizer.scale_loss
    module.config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    first_grads, grad_norms, num_buckets = None, [], len(model.bucket_groups)
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        micro = per_rank // MICRO
        batches = iter([(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(micro)])
        reports = forward_backward(forward_step_func=_forward_step, data_iterator=batches, model=[model],
                                   num_microbatches=micro, seq_length=1, micro_batch_size=MICRO)
        assert len(reports) == micro
        if first_grads is None:
            first_grads = {n: p.main_grad.clone() for n, p in module.named_parameters()}
        ok, grad_norm, num_zeros = optimizer.step()
        assert ok and num_zeros is None
        grad_norms.append(grad_norm)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return first_grads, params, grad_norms, num_buckets


VARIANTS = {
    "sync": (dict(), False),
    "overlap_buckets": (dict(overlap_grad_reduce=True, bucket_size=20), False),
    "avg_in_collective": (dict(average_in_collective=True, check_for_nan_in_grad=True), False),
    "per_token": (dict(overlap_grad_reduce=True), True),
}


class _Stage(torch.nn.Module):
    """A pipeline-stage stand-in holding the tied embedding/output weight and a sequence-parallel norm."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.share_embeddings_and_output_weights = True
        self.weight = torch.nn.Parameter(torch.zeros(3))
        self.norm_weight = torch.nn.Parameter(torch.zeros(2))
        self.norm_weight.sequence_parallel = True
        self.other = torch.nn.Parameter(torch.zeros(2))

    def shared_embedding_or_output_weight(self):
        return self.weight


def _finalize_reductions(rank):
    """TP all-reduce of sequence-parallel grads; embedding-group all-reduce and token broadcast with pp=2."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    stage = _Stage(ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    for p in stage.parameters():
        p.main_grad = torch.full_like(p, float(rank + 1))
    finalize_model_grads([stage])
    tp = (stage.norm_weight.main_grad.tolist(), stage.other.main_grad.tolist(), stage.weight.main_grad.tolist())

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    stage = _Stage(ModelParallelConfig(pipeline_model_parallel_size=2))
    for p in stage.parameters():
        p.main_grad = torch.full_like(p, float(rank + 1))
    # Only the last stage computes the loss, so only it knows the token count.
    num_tokens = torch.tensor(4 if parallel_state.is_pipeline_last_stage() else 0, dtype=torch.int)
    finalize_model_grads([stage], num_tokens=num_tokens)
    pp = (stage.weight.main_grad.tolist(), stage.other.main_grad.tolist(), int(num_tokens))
    return tp, pp


def _dp_worker(rank, world_size):
    parallel_state.initialize_model_parallel()
    results = {name: _train_variant(rank, world_size, kwargs, per_token)
               for name, (kwargs, per_token) in VARIANTS.items()}
    return results, _finalize_reductions(rank)


def test_dp2_matches_single_process_and_finalize_reductions():
    ref_grads, ref_params = _reference()
    outputs = run_distributed(_dp_worker, 2)
    results = [out[0] for out in outputs]
    sync_grads = results[0]["sync"][0]
    for rank, (_, (tp, pp)) in enumerate(outputs):
        # tp=2: only sequence-parallel grads are summed over TP (1 + 2); others keep the rank's value.
        assert tp == ([3.0, 3.0], [float(rank + 1)] * 2, [float(rank + 1)] * 3)
        # pp=2: tied weight summed over the embedding group, then every grad divided by the last stage's tokens.
        assert pp == ([3.0 / 4] * 3, [(rank + 1) / 4] * 2, 4)
    for rank, per_variant in enumerate(results):
        for name, (grads, params, grad_norms, num_buckets) in per_variant.items():
            assert all(norm > CLIP for norm in grad_norms), "the test must exercise clipping"
            for key in ref_grads:
                assert torch.allclose(grads[key], ref_grads[key], atol=1e-6, rtol=0), (rank, name, key)
                assert torch.allclose(params[key], ref_params[key], atol=1e-6, rtol=0), (rank, name, key)
                if name != "per_token":  # per-token divides a sum instead of averaging: other rounding
                    # Bucketing / overlap / AVG change nothing: the same sums are formed element by element.
                    assert torch.equal(grads[key], sync_grads[key]), (rank, name, key)
            if name == "overlap_buckets":
                assert num_buckets > 1
            else:
                assert num_buckets == 1


# ---------------------------------------------------------------------------------------------
# Single-rank checks (one gloo process group in this process).
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def single_rank():
    with single_rank_process_group():
        yield


class Sizes(torch.nn.Module):
    """Params of chosen sizes, registered in order a, b, c, d."""

    def __init__(self, sizes, dtype=torch.float32):
        super().__init__()
        self.config = ModelParallelConfig()
        for name, n in zip("abcd", sizes):
            self.register_parameter(name, torch.nn.Parameter(torch.ones(n, dtype=dtype)))

    def forward(self, x):
        return sum((p.float() * x).sum() for p in self.parameters())


def test_buckets_reverse_order_and_close_at_size(single_rank):
    module = Sizes([10, 30, 5, 7])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                bucket_size=12), module)
    (buffer,) = ddp.buffers
    # Reverse order d(7) c(5) | b(30) | a(10): a bucket closes once it holds >= 12 elements.
    assert [[p.numel() for p in b.params] for b in buffer.buckets] == [[7, 5], [30], [10]]
    offsets = [buffer.param_index_map[p][0] for p in (module.d, module.c, module.b, module.a)]
    assert offsets == [0, 7, 12, 42]
    assert buffer.grad_data.numel() == 52
    for p in module.parameters():
        start, end, _ = buffer.param_index_map[p]
        assert p.main_grad.data_ptr() == buffer.grad_data[start:end].data_ptr()
        assert p.main_grad.shape == p.shape


def test_single_bucket_without_overlap_and_default_size(single_rank):
    module = Sizes([10, 30, 5, 7])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(bucket_size=12), module)
    assert len(ddp.buffers[0].buckets) == 1 and ddp.bucket_size is None
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    assert ddp.bucket_size == max(40_000_000, 1_000_000 * 1)
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                                                bucket_size=12), module,
                                  disable_bucketing=True)
    assert len(ddp.buffers[0].buckets) == 1


def test_distributed_optimizer_padding(single_rank):
    module = Sizes([10, 30, 5, 7])
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=12, use_distributed_optimizer=True)
    buffer = DistributedDataParallel(module.config, config, module).buffers[0]
    for p in module.parameters():
        assert buffer.param_index_map[p][0] % 64 == 0
    for bucket in buffer.buckets:
        assert (bucket.offset + bucket.grad_data.numel()) % math.lcm(1, 128) == 0


def test_buffers_grouped_by_dtype_and_fp32_grads(single_rank):
    module = Sizes([4, 6])
    module.c = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    assert sorted((str(b.param_dtype), str(b.grad_dtype)) for b in ddp.buffers) == [
        ("torch.bfloat16", "torch.bfloat16"), ("torch.float32", "torch.float32")]
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module)
    assert module.c.main_grad.dtype == torch.float32


def test_hook_accumulates_into_main_grad_and_frees_grad(single_rank):
    module = Sizes([3, 2])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    with ddp.no_sync():
        ddp(torch.tensor(2.0)).backward()
        ddp(torch.tensor(3.0)).backward()
    for p in module.parameters():
        assert p.grad is None
        assert torch.equal(p.main_grad, torch.full_like(p, 5.0))
    ddp.finish_grad_sync()  # dp = 1: scale 1, sum over one rank
    assert torch.equal(module.a.main_grad, torch.full((3,), 5.0))
    ddp.zero_grad_buffer()
    assert all(not p.main_grad.any() for p in module.parameters())


def test_state_dict_has_no_module_prefix(single_rank):
    module = TinyModel(seed=0)
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    assert list(ddp.state_dict()) == list(module.state_dict())
    assert list(ddp.state_dict_for_save_checkpoint()) == list(module.state_dict())
    ddp.load_state_dict(TinyModel(seed=1).state_dict())
    assert torch.equal(module.fc1.weight, TinyModel(seed=1).fc1.weight)


def test_nan_check_and_missing_grad_errors(single_rank):
    module = Sizes([3, 2])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(check_for_nan_in_grad=True), module)
    ddp(torch.tensor(float("nan"))).backward()
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        ddp.finish_grad_sync()

    module = Sizes([3, 2])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    (module.a * 2).sum().backward()  # b gets no grad, so its bucket is never launched
    with pytest.raises(RuntimeError, match="1/2 params have grad available"):
        ddp.finish_grad_sync()


def test_overlap_launches_only_in_last_microbatch(single_rank):
    module = Sizes([3, 2])
    ddp = DistributedDataParallel(module.config, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    (group,) = ddp.bucket_groups
    with ddp.no_sync():
        ddp(torch.tensor(1.0)).backward()
    assert group.grad_reduce_handle is None and not group.params_with_grad
    ddp(torch.tensor(1.0)).backward()
    assert group.grad_reduce_handle is not None
    ddp.finish_grad_sync()
    assert torch.equal(module.b.main_grad, torch.full((2,), 2.0))


def test_per_token_loss_rejects_average_in_collective(single_rank):
    module = Sizes([3])
    module.config.calculate_per_token_loss = True
    with pytest.raises(ValueError, match="average-in-collective"):
        DistributedDataParallel(module.config, DistributedDataParallelConfig(average_in_collective=True), module)
