"""GPTModel under tensor parallelism: each rank's shards, TP-invariant init, dropout RNG per TP rank, recompute."""
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import DotProductAttention

V, S, B = 64, 8, 2
# (TransformerConfig kwargs, GPTModel kwargs): a GPT-2-like and a Llama-like (GQA, SwiGLU, RoPE) model.
MODELS = {
    "gpt2": (dict(num_layers=2, hidden_size=16, num_attention_heads=4),
             dict(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")),
    "llama": (dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                   gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False),
              dict(share_embeddings_and_output_weights=False, position_embedding_type="rope")),
}
# Every matmul weight and the column-parallel biases are split across TP ranks; norms, position
# embeddings and the biases added after a row-parallel reduction are replicated.
SPLIT = ("word_embeddings.weight", "linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
         "linear_fc2.weight", "output_layer.weight", "linear_qkv.bias", "linear_fc1.bias")


def _model(kind, tp, seed=7, **config_overrides):
    config_kw, model_kw = MODELS[kind]
    config = TransformerConfig(**{"hidden_dropout": 0.0, "attention_dropout": 0.0, **config_kw,
                                  "tensor_model_parallel_size": tp, **config_overrides})
    torch.manual_seed(seed)
    return GPTModel(config, vocab_size=V, max_sequence_length=S, **model_kw)


def _batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S), torch.randint(0, V, (B, S), generator=g)


def _gather_full(param):
    """All-gather a TP-split tensor and undo the stride interleaving: the full [..] tensor of TP=1."""
    tp = ps.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([pieces[rank][k] for k in range(stride) for rank in range(tp)], dim)


# --------------------------------------------------------------------------- shards and initial weights
def _shards(rank, world):
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    for kind in MODELS:
        model = _model(kind, world)
        out[kind] = {
            name: dict(local_shape=tuple(p.shape), split=bool(getattr(p, "tensor_model_parallel", False)),
                       dim=getattr(p, "partition_dim", -1),
                       full=(_gather_full(p) if getattr(p, "tensor_model_parallel", False) else p.detach()).numpy())
            for name, p in model.named_parameters()
        }
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_one_tp_th_of_every_split_weight_cut_from_the_tp1_weights(tp):
    results = run_distributed(_shards, tp)
    for kind in MODELS:
        reference = dict(_model(kind, 1).named_parameters())
        full_count = sum(p.numel() for p in reference.values())
        split_count = sum(p.numel() for name, p in reference.items() if name.endswith(SPLIT))
        for rank, result in enumerate(results):
            shards = result[kind]
            assert shards.keys() == reference.keys()
            for name, info in shards.items():
                full_shape = tuple(reference[name].shape)
                assert info["split"] == name.endswith(SPLIT), f"{kind} {name}: split={info['split']}"
                expected = list(full_shape)
                if info["split"]:
                    expected[info["dim"]] //= tp
                assert info["local_shape"] == tuple(expected), f"{kind} {name} rank {rank}"
                # Default initialisation gives every TP size the same full matrices.
                np.testing.assert_array_equal(info["full"], reference[name].detach().numpy(),
                                              err_msg=f"{kind} {name} rank {rank}")
            local_count = sum(int(np.prod(info["local_shape"])) for info in shards.values())
            assert local_count == split_count // tp + (full_count - split_count), kind


def test_default_gpu_style_init_is_the_slice_of_one_full_master():
    """The default (CUDA) path draws one full master with the default generator and keeps a slice."""
    def init(weight):
        torch.nn.init.normal_(weight, std=0.5)

    torch.manual_seed(11)
    full = torch.empty(12, 5)
    init(full)
    for world, stride in ((2, 1), (3, 1), (2, 2)):
        for rank in range(world):
            shard = torch.empty(12 // world, 5)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(tensor_parallel.layers, "get_tensor_model_parallel_rank", lambda: rank)
                mp.setattr(tensor_parallel.layers, "get_tensor_model_parallel_world_size", lambda: world)
                torch.manual_seed(11)
                _initialize_affine_weight_gpu(shard, init, partition_dim=0, stride=stride, full_size=(12, 5),
                                              per_partition_size=12 // world)
            chunks = full.split(12 // world // stride, 0)
            torch.testing.assert_close(shard, torch.cat(chunks[rank::world]), rtol=0, atol=0)
            assert (shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride) == (True, 0, stride)


# --------------------------------------------------------------------------- dropout RNG across TP ranks
def _record_dropout_masks():
    """Patch F.dropout to keep each call's drop mask (positions set to zero)."""
    masks, real = [], F.dropout

    def recording(input, p=0.5, training=True, inplace=False):
        out = real(input, p, training, inplace)
        if training and p > 0:
            masks.append((out == 0).numpy().copy())
        return out

    F.dropout = recording
    return masks, lambda: setattr(F, "dropout", real)


def _dropout(rank, world):
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    ids, pos, labels = _batch()
    results = {}
    for sp in (False, True):
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        model = _model("gpt2", world, hidden_dropout=0.3, sequence_parallel=sp)
        masks, restore = _record_dropout_masks()
        try:
            loss = model(ids, pos, None, labels=labels)
        finally:
            restore()
        results[sp] = dict(loss=loss.detach().numpy(), masks=masks)

    # Attention-probability dropout: inside the model-parallel fork, which leaves the default state alone.
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, attention_dropout=0.5,
                               tensor_model_parallel_size=world)
    core = DotProductAttention(config, layer_number=1)
    q = torch.ones(S, B, 4 // world, 4)
    before = torch.get_rng_state()
    context = core(q, q, q, None)
    results["attention"] = context.numpy()
    results["default_state_untouched"] = torch.equal(before, torch.get_rng_state())
    return results


def test_dropout_differs_across_tp_ranks_only_on_split_activations():
    ranks = run_distributed(_dropout, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    ids, pos, labels = _batch()
    reference = _model("gpt2", 1, hidden_dropout=0.3)(ids, pos, None, labels=labels).detach().numpy()
    # Without SP, hidden and embedding dropout act on replicated activations: same masks on every
    # TP rank, drawn from the default generator exactly as at TP=1.
    no_sp = [r[False] for r in ranks]
    assert len(no_sp[0]["masks"]) == 5  # embedding + 2 per layer
    for a, b in zip(no_sp[0]["masks"], no_sp[1]["masks"]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(no_sp[0]["loss"], reference, rtol=1e-5, atol=1e-6)
    # With SP each rank drops on its own sequence chunk: the masks must differ between ranks.
    with_sp = [r[True] for r in ranks]
    assert len(with_sp[0]["masks"]) == 5
    for a, b in zip(with_sp[0]["masks"], with_sp[1]["masks"]):
        assert a.shape == b.shape == (S // 2, B, 16)
        assert not np.array_equal(a, b)
    # Attention heads differ per rank, so do their dropout masks; the default RNG is not consumed.
    assert not np.array_equal(ranks[0]["attention"], ranks[1]["attention"])
    assert ranks[0]["default_state_untouched"] and ranks[1]["default_state_untouched"]


# --------------------------------------------------------------------------- recompute replays the RNG
def _recompute(rank, world, overrides):
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    ids, pos, labels = _batch()
    grads = {}
    for recompute in (False, True):
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        extra = dict(overrides["recompute"]) if recompute else {}
        model = _model("gpt2", world, hidden_dropout=0.2, attention_dropout=0.2,
                       sequence_parallel=overrides["sp"], **extra)
        loss = model(ids, pos, None, labels=labels)
        loss.mean().backward()
        grads[recompute] = {"loss": loss.detach().numpy(),
                            **{n: p.grad.numpy() for n, p in model.named_parameters()}}
    return grads


@pytest.mark.parametrize("sp,recompute", [
    (True, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    (False, dict(recompute_granularity="selective")),
], ids=["sp-full", "selective"])
def test_activation_recompute_replays_dropout_at_tp2(sp, recompute):
    for rank, grads in enumerate(run_distributed(_recompute, 2, dict(sp=sp, recompute=recompute))):
        for name, plain in grads[False].items():
            np.testing.assert_allclose(grads[True][name], plain, rtol=1e-6, atol=1e-7,
                                       err_msg=f"rank {rank} {name}")
