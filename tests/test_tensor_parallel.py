"""tensor_parallel at TP=1: layers vs torch.nn, cross entropy, RNG tracker, recompute (TP>1: test_tensor_parallel_layers.py)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu


def _cfg(**kw):
    return ModelParallelConfig(use_cpu_initialization=True, **kw)


def _init(std=0.5):
    return lambda w: torch.nn.init.normal_(w, 0.0, std)


# ------------------------------------------------------------------ TP = 1 vs torch.nn
def test_column_parallel_linear_matches_nn_linear():
    torch.manual_seed(0)
    layer = tp.ColumnParallelLinear(6, 10, config=_cfg(), init_method=_init(), bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    ref = torch.nn.Linear(6, 10)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(5, 3, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_bias = layer(x)
    assert out_bias is None and out.shape == (5, 3, 10)
    torch.testing.assert_close(out, ref(x_ref))
    g = torch.randn_like(out)
    out.backward(g)
    ref(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    assert layer.weight.partition_stride == 1 and layer.bias.partition_dim == 0


def test_column_skip_bias_add_and_external_weight():
    layer = tp.ColumnParallelLinear(4, 8, config=_cfg(), init_method=_init(), bias=True, skip_bias_add=True,
                                    skip_weight_param_allocation=True)
    assert layer.weight is None
    w = torch.randn(8, 4)
    x = torch.randn(2, 3, 4)
    out, bias = layer(x, weight=w)
    torch.testing.assert_close(out, x @ w.t())
    assert bias is layer.bias
    with pytest.raises(RuntimeError, match="skip_weight_param_allocation"):
        layer(x)
    with pytest.raises(RuntimeError, match="expected"):
        layer(x, weight=torch.randn(4, 4))


def test_row_parallel_linear_matches_nn_linear():
    torch.manual_seed(1)
    layer = tp.RowParallelLinear(8, 4, config=_cfg(), init_method=_init(), bias=True, input_is_parallel=False,
                                 skip_bias_add=False)
    with torch.no_grad():
        layer.bias.normal_()
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x = torch.randn(3, 2, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, _ = layer(x)
    torch.testing.assert_close(out, ref(x_ref))
    out.sum().backward()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    assert layer.weight.partition_dim == 1 and not hasattr(layer.bias, "partition_dim")
    assert set(layer.state_dict()) == {"weight", "bias", "_extra_state"}


def test_vocab_parallel_embedding_matches_nn_embedding():
    torch.manual_seed(2)
    emb = tp.VocabParallelEmbedding(12, 5, init_method=_init(), config=_cfg())
    ref = torch.nn.Embedding(12, 5)
    ref.weight.data.copy_(emb.weight.data)
    ids = torch.randint(0, 12, (3, 7))
    out = emb(ids)
    torch.testing.assert_close(out, ref(ids))
    out.pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_matches_torch(smoothing):
    torch.manual_seed(3)
    V = 11
    logits = torch.randn(4, 3, V, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, V, (4, 3))
    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=smoothing)
    assert loss.shape == (4, 3) and loss.dtype == torch.float32
    # Megatron's smoothing alpha*V/(V-1) equals torch's label_smoothing at that value.
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none",
                          label_smoothing=smoothing * V / (V - 1)).view(4, 3)
    torch.testing.assert_close(loss, ref.float())
    g = torch.rand(4, 3)
    loss.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits.detach(), ref_logits.detach()), "input logits must not be modified"


def test_cross_entropy_with_smoothing_stays_finite_for_large_logits():
    """exp underflows to 0 for most of the vocabulary at logit scale 1e4; log(0) must not leak in."""
    torch.manual_seed(5)
    V = 13
    logits = (torch.randn(3, 2, V, dtype=torch.float64) * 1e4).requires_grad_()
    target = torch.randint(0, V, (3, 2))
    loss = tp.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)
    ref = F.cross_entropy(logits.detach().view(-1, V), target.view(-1), reduction="none",
                          label_smoothing=0.1 * V / (V - 1)).view(3, 2)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=0.0)


def test_cross_entropy_rejects_bad_smoothing_and_accepts_strided_logits():
    logits = torch.randn(2, 3, 7)
    target = torch.randint(0, 7, (3, 2))
    for bad in (-0.5, 1.0):
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
            tp.vocab_parallel_cross_entropy(logits.transpose(0, 1), target, label_smoothing=bad)
    strided = logits.transpose(0, 1)  # [s, b, V] view of [b, s, V] logits, as a caller may pass
    ref = F.cross_entropy(strided.reshape(-1, 7), target.view(-1), reduction="none").view(3, 2)
    torch.testing.assert_close(tp.vocab_parallel_cross_entropy(strided, target), ref)


def test_frozen_weight_with_gradient_accumulation_fusion_gets_no_grad():
    """Partial fine-tuning: a frozen weight has no main_grad, and the fused path must not ask for one."""
    torch.manual_seed(0)
    layer = tp.RowParallelLinear(6, 4, config=_cfg(gradient_accumulation_fusion=True), init_method=_init(),
                                 bias=False, input_is_parallel=True, skip_bias_add=False)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 2, 6, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 2, 4) @ layer.weight)
    assert layer.weight.grad is None


def test_cross_entropy_half_input_gets_half_grad():
    logits = torch.randn(2, 2, 8).bfloat16().requires_grad_()
    target = torch.randint(0, 8, (2, 2))
    loss = tp.vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.detach().float().view(-1, 8), target.view(-1), reduction="none").view(2, 2)
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="target shape"):
        tp.vocab_parallel_cross_entropy(logits, target[:1])


def test_cpu_master_weight_split_matches_tp1_for_strides():
    for stride in (1, 2):
        shards = []
        for rank in range(2):
            torch.manual_seed(7)
            w = torch.empty(8 // 2, 3)
            master = _initialize_affine_weight_cpu(w, 8, 3, 4, 0, _init(), stride=stride, return_master_weight=True,
                                                   rank=rank, world_size=2)
            shards.append(w)
            assert w.partition_stride == stride
        chunks = list(master.split(4 // stride, dim=0))
        expected = [torch.cat(chunks[r::2], dim=0) for r in range(2)]
        for got, want in zip(shards, expected):
            assert torch.equal(got, want)
    # stride 2 on [gate; up] keeps [gate_r; up_r] per rank
    assert torch.equal(shards[0], torch.cat([master[0:2], master[4:6]]))


def test_parallel_attributes_helpers():
    t = torch.nn.Parameter(torch.zeros(2))
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(t)
    assert (t.tensor_model_parallel, t.partition_dim, t.partition_stride) == (False, -1, 1)
    u = torch.nn.Parameter(torch.zeros(2))
    tp.set_tensor_model_parallel_attributes(u, True, 1, 2)
    with pytest.raises(AssertionError):
        tp.set_tensor_model_parallel_attributes(u, True, 0, 1)
    v = torch.nn.Parameter(torch.zeros(2))
    tp.copy_tensor_model_parallel_attributes(v, u)
    assert (v.tensor_model_parallel, v.partition_dim, v.partition_stride) == (True, 1, 2)
    assert tp.param_is_not_tensor_parallel_duplicate(t)


# ------------------------------------------------------------------ RNG tracker
def test_rng_tracker_fork_semantics():
    tracker = tp.CudaRNGStatesTracker()
    tracker.add("a", 11)
    with pytest.raises(RuntimeError, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(RuntimeError, match="cuda rng state a already exists"):
        tracker.add("a", 12)
    with pytest.raises(RuntimeError, match="is not added"):
        with tracker.fork("missing"):
            pass

    torch.manual_seed(5)
    outside_expected = torch.rand(3)
    torch.manual_seed(5)
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    outside = torch.rand(3)
    torch.manual_seed(11)
    stream = torch.rand(6)
    assert torch.equal(torch.cat([first, second]), stream), "fork continues the named stream"
    assert torch.equal(outside, outside_expected), "fork leaves the default stream untouched"

    saved = tracker.get_states()
    with tracker.fork("a"):
        after_save = torch.rand(2)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(2), after_save)


def test_model_parallel_cuda_manual_seed_offsets():
    tp.model_parallel_cuda_manual_seed(100)
    tracker = tp.get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {"model-parallel-rng", "data-parallel-rng", "expert-parallel-rng"}
    for name, seed in (("model-parallel-rng", 100 + 2718), ("data-parallel-rng", 100),
                       ("expert-parallel-rng", 100 + 1024)):
        with tracker.fork(name):
            got = torch.rand(4)
        torch.manual_seed(seed)
        assert torch.equal(got, torch.rand(4)), name


def test_checkpoint_replays_dropout_and_matches_grads():
    tp.model_parallel_cuda_manual_seed(9)
    lin = torch.nn.Linear(6, 6)

    def fn(x, scale):
        with tp.get_cuda_rng_tracker().fork():
            y = F.dropout(lin(x), p=0.5, training=True)
        return F.dropout(y * scale, p=0.3, training=True)

    x = torch.randn(4, 6, requires_grad=True)
    state = (torch.get_rng_state(), tp.get_cuda_rng_tracker().get_states())
    ref = fn(x, 2.0)
    ref.sum().backward()
    ref_grads = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = None
    lin.weight.grad = None
    torch.set_rng_state(state[0])
    tp.get_cuda_rng_tracker().set_states(state[1])
    out = tp.checkpoint(fn, False, x, 2.0)
    torch.rand(10)  # advance the RNG between forward and backward; replay must not see it
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_grads[0])
    torch.testing.assert_close(lin.weight.grad, ref_grads[1])


def test_mappings_identity_at_tp1():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (tp.copy_to_tensor_model_parallel_region, tp.reduce_from_tensor_model_parallel_region,
               tp.scatter_to_tensor_model_parallel_region, tp.gather_from_tensor_model_parallel_region,
               tp.scatter_to_sequence_parallel_region, tp.gather_from_sequence_parallel_region,
               tp.reduce_scatter_to_sequence_parallel_region):
        assert fn(x) is x
