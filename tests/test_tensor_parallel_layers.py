"""Tensor-parallel layers, cross entropy and mappings at TP=2/4 (with and without SP) vs single-process torch.nn."""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import mappings
from megatron.training.tokenizer import _vocab_size_with_padding

# Sizes: s divisible by 4 (sequence chunks at TP=4); every partitioned dim divisible by 4 * stride 2.
S, B = 8, 2
COL_IN, COL_OUT = 12, 16
ROW_IN, ROW_OUT = 16, 12
MLP_H, MLP_FFN = 8, 32
EMB_H = 8
GPT2_VOCAB = 50257
MAP_K = 8
ATOL = RTOL = 1e-5


def _init(std=0.3):
    """init_method drawing N(0, std) from the default generator (what the layers' CPU init calls)."""
    return lambda w: torch.nn.init.normal_(w, 0.0, std)


def _randn(*shape, seed, scale=1.0):
    """[*shape] fp32 from a private generator, so every rank draws the same tensor whatever its history."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _full_master(rows, cols, seed):
    """The [rows, cols] fp32 matrix the CPU init path draws after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    master = torch.empty(rows, cols)
    _init()(master)
    return master


class _Checks:
    """Collects {check_name: (ok, detail)} for one rank; only booleans and strings cross the queue."""

    def __init__(self):
        self.results = {}

    def record(self, name, ok, detail=""):
        assert name not in self.results, f"duplicate check name {name}"
        self.results[name] = (bool(ok), detail)

    def close(self, name, got, want, atol=ATOL, rtol=RTOL):
        """Compare ``got`` with the reference ``want`` (cast to got's dtype); detail gives max |diff|."""
        if got is None:
            self.record(name, False, "got None (no gradient reached this tensor)")
            return
        if tuple(got.shape) != tuple(want.shape):
            self.record(name, False, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
            return
        got = got.detach()
        want = want.detach().to(got.dtype)
        diff = (got - want).abs().max().item() if got.numel() else 0.0
        ok = torch.allclose(got, want, atol=atol, rtol=rtol)
        self.record(name, ok, f"max|diff|={diff:.3e} max|ref|={want.abs().max().item():.3e} "
                              f"(atol={atol:g}, rtol={rtol:g})")

    def raises(self, name, exc_type, fn, must_contain=()):
        """``fn()`` must raise ``exc_type`` whose message contains every string in ``must_contain``."""
        try:
            fn()
        except exc_type as exc:
            message = str(exc)
            missing = [m for m in must_contain if m not in message]
            self.record(name, not missing, f"{type(exc).__name__}: {message!r}" +
                        (f"; message lacks {missing}" if missing else ""))
            return
        except Exception as exc:  # wrong type: report it rather than crash the whole rank
            self.record(name, False, f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
            return
        self.record(name, False, f"no {exc_type.__name__} raised")


def _all_reduce_tp(tensor):
    """Sum ``tensor`` over the TP group, in place (test-side reduction of partial grads)."""
    dist.all_reduce(tensor, group=ps.get_tensor_model_parallel_group())
    return tensor


# ------------------------------------------------------------------ ColumnParallelLinear
def _check_column(c, cfg, rank, world, sp):
    """Column-parallel linear [s, b, in] -> [s, b, out/tp] vs nn.Linear(in, out)."""
    seed = 11
    full_bias = _randn(COL_OUT, seed=12)
    x_full = _randn(S, B, COL_IN, seed=13)
    g_full = _randn(S, B, COL_OUT, seed=14)
    out_shard = slice(rank * COL_OUT // world, (rank + 1) * COL_OUT // world)

    def build(**kw):
        torch.manual_seed(seed)
        return tp.ColumnParallelLinear(COL_IN, COL_OUT, config=cfg, init_method=_init(),
                                       keep_master_weight_for_test=True, **kw)

    def reference():
        ref = torch.nn.Linear(COL_IN, COL_OUT)
        with torch.no_grad():
            ref.weight.copy_(master)
            ref.bias.copy_(full_bias)
        x = x_full.clone().requires_grad_()
        return ref, x, ref(x)

    def local_input():
        # With SP the layer consumes this rank's [s/tp, b, in] sequence chunk.
        return (x_full.chunk(world, dim=0)[rank] if sp else x_full).clone().requires_grad_()

    def expected_input_grad(ref_x):
        return ref_x.grad.chunk(world, dim=0)[rank] if sp else ref_x.grad

    # gather_output=False, bias added.
    layer = build(bias=True, gather_output=False)
    master = _full_master(COL_OUT, COL_IN, seed)
    c.close("column/master_weight == seeded full init (same on every rank and every TP)", layer.master_weight,
            master, atol=0, rtol=0)
    c.record("column/weight shard shape and attributes",
             tuple(layer.weight.shape) == (COL_OUT // world, COL_IN) and layer.weight.partition_dim == 0
             and layer.weight.partition_stride == 1 and layer.weight.tensor_model_parallel
             and tuple(layer.bias.shape) == (COL_OUT // world,) and layer.bias.partition_dim == 0,
             f"weight {tuple(layer.weight.shape)} dim {layer.weight.partition_dim}, bias {tuple(layer.bias.shape)}")
    c.close("column/weight == master rows of this rank", layer.weight, master[out_shard], atol=0, rtol=0)
    c.close("column/bias zero-initialised", layer.bias, torch.zeros(COL_OUT // world), atol=0, rtol=0)
    with torch.no_grad():
        layer.bias.copy_(full_bias[out_shard])
    x = local_input()
    out, out_bias = layer(x)
    ref, ref_x, ref_out = reference()
    c.record("column/no bias returned without skip_bias_add", out_bias is None, repr(type(out_bias)))
    c.close("column/output shard", out, ref_out[..., out_shard])
    out.backward(g_full[..., out_shard])
    ref_out.backward(g_full)
    c.close("column/input grad" + (" (reduce-scattered seq chunk)" if sp else " (all-reduced)"), x.grad,
            expected_input_grad(ref_x))
    c.close("column/weight grad shard", layer.weight.grad, ref.weight.grad[out_shard])
    c.close("column/bias grad shard", layer.bias.grad, ref.bias.grad[out_shard])

    # gather_output=True: full output without SP; refused with SP.
    layer = build(bias=True, gather_output=True)
    with torch.no_grad():
        layer.bias.copy_(full_bias[out_shard])
    if sp:
        c.raises("column/gather_output with sequence_parallel raises RuntimeError", RuntimeError,
                 lambda: layer(local_input()))
    else:
        x = local_input()
        out, _ = layer(x)
        ref, ref_x, ref_out = reference()
        c.close("column/gather_output full output", out, ref_out)
        out.backward(g_full)
        ref_out.backward(g_full)
        c.close("column/gather_output input grad", x.grad, ref_x.grad)
        c.close("column/gather_output weight grad shard", layer.weight.grad, ref.weight.grad[out_shard])
        c.close("column/gather_output bias grad shard", layer.bias.grad, ref.bias.grad[out_shard])

    # skip_bias_add: the matmul alone is returned and the bias shard comes back separately.
    layer = build(bias=True, skip_bias_add=True)
    with torch.no_grad():
        layer.bias.copy_(full_bias[out_shard])
    x = local_input()
    out, out_bias = layer(x)
    ref, ref_x, ref_out = reference()
    c.record("column/skip_bias_add returns the layer's bias", out_bias is layer.bias, repr(type(out_bias)))
    c.close("column/skip_bias_add output excludes bias", out, (ref_out - full_bias)[..., out_shard])
    (out + out_bias).backward(g_full[..., out_shard])
    ref_out.backward(g_full)
    c.close("column/skip_bias_add bias grad shard", layer.bias.grad, ref.bias.grad[out_shard])

    # stride=2 (SwiGLU fc1 = [gate; up]): each rank holds [gate_r; up_r].
    layer = build(bias=False, stride=2)
    master = layer.master_weight
    gate, up = master.chunk(2, dim=0)
    expected = torch.cat([gate.chunk(world, dim=0)[rank], up.chunk(world, dim=0)[rank]], dim=0)
    c.record("column/stride=2 partition_stride attribute", layer.weight.partition_stride == 2,
             f"partition_stride={layer.weight.partition_stride}")
    c.close("column/stride=2 weight == [gate_r; up_r] of the master", layer.weight, expected, atol=0, rtol=0)
    x = local_input()
    out, _ = layer(x)
    ref_gate_up = F.linear(x_full, master).chunk(2, dim=-1)
    c.close("column/stride=2 output == [gate_r | up_r] of the full matmul", out,
            torch.cat([ref_gate_up[0].chunk(world, dim=-1)[rank], ref_gate_up[1].chunk(world, dim=-1)[rank]],
                      dim=-1))


# ------------------------------------------------------------------ RowParallelLinear
def _check_row(c, cfg, rank, world, sp):
    """Row-parallel linear [s, b, in/tp] -> [s, b, out] ([s/tp, b, out] with SP) vs nn.Linear(in, out)."""
    seed = 21
    full_bias = _randn(ROW_OUT, seed=22)
    y_full = _randn(S, B, ROW_IN, seed=23)
    g_full = _randn(S, B, ROW_OUT, seed=24)
    in_shard = slice(rank * ROW_IN // world, (rank + 1) * ROW_IN // world)

    def build(input_is_parallel):
        torch.manual_seed(seed)
        layer = tp.RowParallelLinear(ROW_IN, ROW_OUT, config=cfg, init_method=_init(), bias=True,
                                     input_is_parallel=input_is_parallel, skip_bias_add=False,
                                     keep_master_weight_for_test=True)
        with torch.no_grad():
            layer.bias.copy_(full_bias)
        return layer

    def reference():
        ref = torch.nn.Linear(ROW_IN, ROW_OUT)
        with torch.no_grad():
            ref.weight.copy_(master)
            ref.bias.copy_(full_bias)
        y = y_full.clone().requires_grad_()
        return ref, y, ref(y)

    master = _full_master(ROW_OUT, ROW_IN, seed)
    layer = build(input_is_parallel=True)
    c.record("row/weight shard shape and attributes, bias replicated",
             tuple(layer.weight.shape) == (ROW_OUT, ROW_IN // world) and layer.weight.partition_dim == 1
             and tuple(layer.bias.shape) == (ROW_OUT,) and not getattr(layer.bias, "tensor_model_parallel", False),
             f"weight {tuple(layer.weight.shape)} dim {layer.weight.partition_dim}, bias {tuple(layer.bias.shape)}")
    c.close("row/weight == master columns of this rank", layer.weight, master[:, in_shard], atol=0, rtol=0)
    c.record("row/bias.sequence_parallel attribute == sp", getattr(layer.bias, "sequence_parallel", None) is sp,
             f"bias.sequence_parallel={getattr(layer.bias, 'sequence_parallel', 'missing')}")

    y = y_full[..., in_shard].clone().requires_grad_()
    out, _ = layer(y)
    ref, ref_y, ref_out = reference()
    # Equality with the reference also proves the bias is added once, after the reduction.
    if sp:
        c.close("row/output seq chunk [s/tp, b, out], bias after reduce-scatter", out,
                ref_out.chunk(world, dim=0)[rank])
        out.backward(g_full.chunk(world, dim=0)[rank])
    else:
        c.close("row/output [s, b, out], bias after all-reduce", out, ref_out)
        out.backward(g_full)
    ref_out.backward(g_full)
    c.close("row/input grad (last-dim shard)", y.grad, ref_y.grad[..., in_shard])
    c.close("row/weight grad shard", layer.weight.grad, ref.weight.grad[:, in_shard])
    if sp:
        # Each rank only saw its own sequence chunk: the grad is partial until summed over TP.
        c.close("row/bias grad is this rank's seq-chunk partial", layer.bias.grad,
                g_full.chunk(world, dim=0)[rank].sum(dim=(0, 1)))
        c.close("row/bias grad all-reduced over TP == full", _all_reduce_tp(layer.bias.grad.clone()),
                ref.bias.grad)
    else:
        c.close("row/bias grad == full on every rank", layer.bias.grad, ref.bias.grad)

    if sp:
        c.raises("row/sequence_parallel without input_is_parallel raises RuntimeError", RuntimeError,
                 lambda: build(input_is_parallel=False), must_contain=("input_is_parallel",))
        return
    layer = build(input_is_parallel=False)
    y = y_full.clone().requires_grad_()
    out, _ = layer(y)
    ref, ref_y, ref_out = reference()
    c.close("row/input_is_parallel=False output", out, ref_out)
    out.backward(g_full)
    ref_out.backward(g_full)
    c.close("row/input_is_parallel=False input grad (all-gathered)", y.grad, ref_y.grad)
    c.close("row/input_is_parallel=False weight grad shard", layer.weight.grad, ref.weight.grad[:, in_shard])


# ------------------------------------------------------------------ Column -> GELU -> Row
def _check_mlp(c, cfg, rank, world, sp):
    """Transformer MLP [s, b, h] -> Column(h, ffn) -> GELU -> Row(ffn, h) vs nn.Sequential."""
    b1 = _randn(MLP_FFN, seed=31)
    b2 = _randn(MLP_H, seed=32)
    x_full = _randn(S, B, MLP_H, seed=33)
    g_full = _randn(S, B, MLP_H, seed=34)
    ffn_shard = slice(rank * MLP_FFN // world, (rank + 1) * MLP_FFN // world)

    torch.manual_seed(35)
    fc1 = tp.ColumnParallelLinear(MLP_H, MLP_FFN, config=cfg, init_method=_init(), bias=True, gather_output=False,
                                  keep_master_weight_for_test=True)
    torch.manual_seed(36)
    fc2 = tp.RowParallelLinear(MLP_FFN, MLP_H, config=cfg, init_method=_init(), bias=True, input_is_parallel=True,
                               skip_bias_add=False, keep_master_weight_for_test=True)
    with torch.no_grad():
        fc1.bias.copy_(b1[ffn_shard])
        fc2.bias.copy_(b2)
    ref = torch.nn.Sequential(torch.nn.Linear(MLP_H, MLP_FFN), torch.nn.GELU(), torch.nn.Linear(MLP_FFN, MLP_H))
    with torch.no_grad():
        ref[0].weight.copy_(_full_master(MLP_FFN, MLP_H, 35))
        ref[0].bias.copy_(b1)
        ref[2].weight.copy_(_full_master(MLP_H, MLP_FFN, 36))
        ref[2].bias.copy_(b2)

    x = (x_full.chunk(world, dim=0)[rank] if sp else x_full).clone().requires_grad_()
    hidden, _ = fc1(x)
    out, _ = fc2(F.gelu(hidden))
    ref_x = x_full.clone().requires_grad_()
    ref_out = ref(ref_x)
    ref_out.backward(g_full)
    tag = " (seq chunk)" if sp else ""
    if sp:
        c.close("mlp/output" + tag, out, ref_out.chunk(world, dim=0)[rank])
        out.backward(g_full.chunk(world, dim=0)[rank])
        c.close("mlp/input grad" + tag, x.grad, ref_x.grad.chunk(world, dim=0)[rank])
    else:
        c.close("mlp/output", out, ref_out)
        out.backward(g_full)
        c.close("mlp/input grad", x.grad, ref_x.grad)
    c.close("mlp/fc1 weight grad shard", fc1.weight.grad, ref[0].weight.grad[ffn_shard])
    c.close("mlp/fc2 weight grad shard", fc2.weight.grad, ref[2].weight.grad[:, ffn_shard])


# ------------------------------------------------------------------ VocabParallelEmbedding
def _boundary_ids(padded, world, seed):
    """[B, S] ids in [0, GPT2_VOCAB): first/last id of every rank's range, 50256, rest random, shuffled."""
    per_rank = padded // world
    special = [0, GPT2_VOCAB - 1]
    for r in range(world):
        special += [r * per_rank, min((r + 1) * per_rank - 1, GPT2_VOCAB - 1)]
    special = sorted(set(special))
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randint(0, GPT2_VOCAB, (B * S - len(special),), generator=gen)
    ids = torch.cat([torch.tensor(special), rest])
    return ids[torch.randperm(B * S, generator=gen)].view(B, S), special


def _padded_vocab(world):
    """GPT-2's vocab padded by the project's own function for this TP size (divisible-by 128)."""
    args = SimpleNamespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=world, rank=1)
    return _vocab_size_with_padding(GPT2_VOCAB, args)


def _check_padding(c, world):
    """Padded V = ceil(V / (128 * tp)) * 128 * tp, recomputed independently."""
    multiple = 128 * world
    want = math.ceil(GPT2_VOCAB / multiple) * multiple
    got = _padded_vocab(world)
    c.record(f"padding/GPT-2 50257 at tp={world}", got == want and got % world == 0, f"got {got}, expected {want}")
    got_tp1 = _vocab_size_with_padding(GPT2_VOCAB, SimpleNamespace(make_vocab_size_divisible_by=128,
                                                                    tensor_model_parallel_size=1, rank=1))
    c.record("padding/GPT-2 50257 at tp=1 -> 50304 (spec)", got_tp1 == 50304, f"got {got_tp1}")


def _check_embedding(c, cfg, rank, world, sp):
    """Vocab-parallel embedding ids [b, s] -> [b, s, h] ([s/tp, b, h] with SP) vs nn.Embedding(padded, h)."""
    padded = _padded_vocab(world)
    per_rank = padded // world
    seed = 41
    torch.manual_seed(seed)
    emb = tp.VocabParallelEmbedding(padded, EMB_H, init_method=_init(), config=cfg, reduce_scatter_embeddings=sp)
    master = _full_master(padded, EMB_H, seed)
    c.record("embedding/weight shard shape [padded/tp, h]",
             tuple(emb.weight.shape) == (per_rank, EMB_H) and emb.weight.partition_dim == 0,
             f"weight {tuple(emb.weight.shape)}, padded={padded}")
    c.close("embedding/weight == master rows of this rank", emb.weight, master[rank * per_rank:(rank + 1) * per_rank],
            atol=0, rtol=0)
    shards = [torch.empty_like(emb.weight.detach()) for _ in range(world)]
    dist.all_gather(shards, emb.weight.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    c.close("embedding/all-gathered shards == seeded full table", torch.cat(shards, dim=0), master, atol=0, rtol=0)

    ids, special = _boundary_ids(padded, world, seed=42)
    ref = torch.nn.Embedding(padded, EMB_H)
    with torch.no_grad():
        ref.weight.copy_(master)
    ref_out = ref(ids)  # [b, s, h]
    out = emb(ids)
    if sp:
        ref_sbh = ref_out.transpose(0, 1)
        c.close("embedding/output [s/tp, b, h] (reduce-scattered) incl. shard-boundary ids", out,
                ref_sbh.chunk(world, dim=0)[rank])
        g_full = _randn(S, B, EMB_H, seed=43)
        out.backward(g_full.chunk(world, dim=0)[rank])
        ref_sbh.backward(g_full)
    else:
        c.close("embedding/output [b, s, h] incl. shard-boundary ids", out, ref_out)
        g_full = _randn(B, S, EMB_H, seed=43)
        out.backward(g_full)
        ref_out.backward(g_full)
    c.close("embedding/weight grad shard", emb.weight.grad, ref.weight.grad[rank * per_rank:(rank + 1) * per_rank])
    c.record("embedding/boundary ids present", set(special) <= set(ids.flatten().tolist()), f"ids {special}")

    c.raises(f"embedding/vocab {GPT2_VOCAB} not divisible by tp={world} raises ValueError naming both", ValueError,
             lambda: tp.VocabParallelEmbedding(GPT2_VOCAB, EMB_H, init_method=_init(), config=cfg),
             must_contain=(f"num_embeddings ({GPT2_VOCAB})", f"tensor_model_parallel_size ({world})",
                           "--make-vocab-size-divisible-by"))


# ------------------------------------------------------------------ vocab_parallel_cross_entropy
@contextlib.contextmanager
def _no_all_gather(collective_sizes):
    """Make every all-gather raise and record the numel of each all-reduce into ``collective_sizes``."""
    def forbidden(*args, **kwargs):
        raise AssertionError("vocab_parallel_cross_entropy called an all-gather")

    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        collective_sizes.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    patches = [(dist, name) for name in ("all_gather", "all_gather_into_tensor", "all_gather_single",
                                         "_all_gather_base", "all_gather_object") if hasattr(dist, name)]
    # mappings binds its flat all-gather at import time, so patch that name too.
    patches.append((mappings, "_all_gather_flat"))
    saved = [(module, name, getattr(module, name)) for module, name in patches]
    try:
        for module, name in patches:
            setattr(module, name, forbidden)
        dist.all_reduce = recording_all_reduce
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
        dist.all_reduce = real_all_reduce


def _check_cross_entropy(c, rank, world):
    """Loss [s, b] and grad of logits [s, b, padded/tp] vs F.cross_entropy on the full [s, b, padded] (fp64)."""
    padded = _padded_vocab(world)
    per_rank = padded // world
    vocab_shard = slice(rank * per_rank, (rank + 1) * per_rank)
    logits = _randn(S, B, padded, seed=51, scale=2.0)
    target, _ = _boundary_ids(padded, world, seed=52)
    target = target.t().contiguous()  # [s, b]
    grad_loss = torch.rand(S, B, generator=torch.Generator().manual_seed(53))
    for alpha in (0.0, 0.1):
        shard = logits[..., vocab_shard].clone().requires_grad_()
        collective_sizes = []
        try:
            with _no_all_gather(collective_sizes):
                loss = tp.vocab_parallel_cross_entropy(shard, target, label_smoothing=alpha)
                loss.backward(grad_loss)
        except AssertionError as exc:
            c.record(f"cross_entropy/alpha={alpha} never all-gathers", False, str(exc))
            continue
        c.record(f"cross_entropy/alpha={alpha} never all-gathers; collectives are per-token sized",
                 # at most three per-token sums: target logit, sum-exp, shifted-logit sum (smoothing)
                 bool(collective_sizes) and max(collective_sizes) <= 3 * S * B,
                 f"all-reduce numels {collective_sizes}")
        full = logits.double().requires_grad_()
        # Megatron's smoothing a*V/(V-1) over the padded V is torch's label_smoothing at that value.
        ref = F.cross_entropy(full.view(-1, padded), target.view(-1), reduction="none",
                              label_smoothing=alpha * padded / (padded - 1)).view(S, B)
        ref.backward(grad_loss.double())
        c.close(f"cross_entropy/alpha={alpha} per-token loss [s, b]", loss, ref)
        # Softmax entries are ~1/V = 2e-5, so an absolute 1e-5 would hide errors such as a missing
        # smoothing/V term (2e-6); 1e-7 still leaves fp32 rounding room.
        c.close(f"cross_entropy/alpha={alpha} logits-shard grad", shard.grad, full.grad[..., vocab_shard],
                atol=1e-7, rtol=1e-4)
        c.record(f"cross_entropy/alpha={alpha} leaves input logits untouched",
                 torch.equal(shard.detach(), logits[..., vocab_shard]), "")


# ------------------------------------------------------------------ mappings
def _check_mappings(c, rank, world):
    """Each mapping's forward and backward vs spec 4.2, with a different input and grad on every rank."""
    def per_rank(shape, seed):
        return [_randn(*shape, seed=seed + 100 * r) for r in range(world)]

    def run(name, fn, in_shape, out_shape, want_out, want_grad):
        xs, gs = per_rank(in_shape, 61), per_rank(out_shape, 62)
        leaf = xs[rank].clone().requires_grad_()
        # clone: reduce_from all-reduces its (activation) input in place.
        out = fn(leaf.clone())
        out.backward(gs[rank])
        c.close(f"mapping/{name} forward", out, want_out(xs))
        c.close(f"mapping/{name} backward", leaf.grad, want_grad(gs))

    k = MAP_K
    s_chunk = S // world
    run("copy_to_tensor_model_parallel_region (identity / all-reduce)", tp.copy_to_tensor_model_parallel_region,
        (S, B, k), (S, B, k), lambda xs: xs[rank], lambda gs: sum(gs))
    run("reduce_from_tensor_model_parallel_region (all-reduce / identity)",
        tp.reduce_from_tensor_model_parallel_region,
        (S, B, k), (S, B, k), lambda xs: sum(xs), lambda gs: gs[rank])
    run("scatter_to_tensor_model_parallel_region (split last / all-gather last)",
        tp.scatter_to_tensor_model_parallel_region,
        (S, B, k), (S, B, k // world), lambda xs: xs[rank].chunk(world, dim=-1)[rank], lambda gs: torch.cat(gs, -1))
    run("gather_from_tensor_model_parallel_region (all-gather last / split last)",
        tp.gather_from_tensor_model_parallel_region,
        (S, B, k // world), (S, B, k), lambda xs: torch.cat(xs, -1), lambda gs: gs[rank].chunk(world, dim=-1)[rank])
    run("scatter_to_sequence_parallel_region (split first / all-gather first)",
        tp.scatter_to_sequence_parallel_region,
        (S, B, k), (s_chunk, B, k), lambda xs: xs[rank].chunk(world, dim=0)[rank], lambda gs: torch.cat(gs, 0))
    run("gather_from_sequence_parallel_region(tensor_parallel_output_grad=True) (all-gather / reduce-scatter)",
        lambda t: tp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True),
        (s_chunk, B, k), (S, B, k), lambda xs: torch.cat(xs, 0), lambda gs: sum(gs).chunk(world, dim=0)[rank])
    run("gather_from_sequence_parallel_region(tensor_parallel_output_grad=False) (all-gather / split)",
        lambda t: tp.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
        (s_chunk, B, k), (S, B, k), lambda xs: torch.cat(xs, 0), lambda gs: gs[rank].chunk(world, dim=0)[rank])
    run("reduce_scatter_to_sequence_parallel_region (reduce-scatter / all-gather)",
        tp.reduce_scatter_to_sequence_parallel_region,
        (S, B, k), (s_chunk, B, k), lambda xs: sum(xs).chunk(world, dim=0)[rank], lambda gs: torch.cat(gs, 0))


# ------------------------------------------------------------------ worker and test
def _check_layers(rank, world, sequence_parallel):
    """All checks of one (TP size, SP) case on one rank; returns {check_name: (ok, detail)}."""
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
                              use_cpu_initialization=True)
    c = _Checks()
    c.record("config/sequence_parallel kept at tp>1", cfg.sequence_parallel is sequence_parallel,
             f"cfg.sequence_parallel={cfg.sequence_parallel}")
    _check_column(c, cfg, rank, world, sequence_parallel)
    _check_row(c, cfg, rank, world, sequence_parallel)
    _check_mlp(c, cfg, rank, world, sequence_parallel)
    _check_padding(c, world)
    _check_embedding(c, cfg, rank, world, sequence_parallel)
    _check_cross_entropy(c, rank, world)
    _check_mappings(c, rank, world)
    return c.results


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sp"])
@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp4"])
def test_tensor_parallel_layers_match_torch_nn(world, sequence_parallel):
    results = run_distributed(_check_layers, world, sequence_parallel)
    names = set(results[0])
    assert all(set(r) == names for r in results), "ranks ran different checks"
    families = {name.split("/")[0] for name in names}
    assert families >= {"column", "row", "mlp", "padding", "embedding", "cross_entropy", "mapping"}, families
    failures = [f"rank {rank}: {name}: {detail}"
                for rank, result in enumerate(results)
                for name, (ok, detail) in sorted(result.items()) if not ok]
    assert not failures, f"{len(failures)} failed checks at tp={world} sp={sequence_parallel}:\n" + "\n".join(failures)
