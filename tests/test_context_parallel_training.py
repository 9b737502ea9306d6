"""Context parallelism (--context-parallel-size, --cp-comm-type) gives the numbers of one process.

- gradients: a GPTModel (Llama-shaped: RoPE, GQA, SwiGLU, RMSNorm, no biases; and GPT-2-shaped) run at
  CP=2 on one batch split with ``get_batch_on_this_cp_rank``: the per-parameter gradients, summed over
  the CP ranks, equal those of one process within 1e-6;
- training: pretrain_gpt.py on gloo ranks, fp32, no dropout, --mock-data, 10 iterations with an
  evaluation: CP=2, CP=4, DP=2 x CP=2 (distributed optimizer), CP=2 x TP=2 (--sequence-parallel),
  CP=2 x PP=2 and a Llama-shaped CP=2 give the
  ``lm loss`` (training and validation) of one process within 1e-5 and its grad norm within 1e-5
  relative, for each --cp-comm-type;
- checkpoints: a torch_dist (and a legacy torch) checkpoint saved at CP=2 with the distributed optimizer
  (sharded over the data x context-parallel ranks) resumes at CP=1 (torch_dist also at CP=4) with the
  uninterrupted losses.
"""
import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import one_process_references, run_ranks, tensorboard_scalars

pytestmark = pytest.mark.timeout(300)

COMM_TYPES = ("p2p", "all_gather", "a2a")
ITERS = 10
MODEL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo"]
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1",
         "--mock-data", "--eval-iters", "1", "--eval-interval", "5", "--num-workers", "0",
         "--train-iters", str(ITERS)]
LLAMA = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
         "--normalization", "RMSNorm", "--disable-bias-linear"]
# NullTokenizer's 100 ids pad to 128 at TP=1 and 256 at TP=2; the TP=1 reference pads as TP=2 does.
PAD_TP2 = ["--make-vocab-size-divisible-by", "256"]
LAYOUTS = {  # name: (ranks, flags, flags of the one-process reference)
    "cp2": (2, ["--context-parallel-size", "2"], []),
    "cp2-tp2-sp": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   PAD_TP2),
    "cp2-pp2": (4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"], []),
    "llama-cp2": (2, [*LLAMA, "--context-parallel-size", "2"], LLAMA),
    "cp4": (4, ["--context-parallel-size", "4"], []),
    "dp2-cp2-distopt": (4, ["--context-parallel-size", "2", "--use-distributed-optimizer"], []),
}


def _train(nproc, flags, tmp_path, name):
    tb = tmp_path / f"tb_{name}"
    result = run_ranks(nproc, [*MODEL, *TRAIN, *flags, "--tensorboard-dir", tb], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {tag: tensorboard_scalars(tb, tag) for tag in ("lm loss", "grad-norm", "lm loss validation")}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs, computed on first use: {reference flags (tuple): scalars}."""
    return one_process_references(_train, tmp_path_factory, "cp1")


def _assert_same_numbers(run, reference, what, steps=range(1, ITERS + 1)):
    for step in steps:
        assert abs(run["lm loss"][step] - reference["lm loss"][step]) <= 1e-5, f"{what}: lm loss at {step}"
        assert run["grad-norm"][step] == pytest.approx(reference["grad-norm"][step], rel=1e-5), \
            f"{what}: grad norm at {step}"
    for step, value in reference["lm loss validation"].items():
        if step in steps:
            assert abs(run["lm loss validation"][step] - value) <= 1e-5, f"{what}: validation loss at {step}"


def max_loss_difference(run, reference):
    return max(abs(run["lm loss"][s] - reference["lm loss"][s]) for s in reference["lm loss"])


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_training_matches_one_process(layout, comm_type, references, tmp_path):
    nproc, flags, reference_flags = LAYOUTS[layout]
    run = _train(nproc, [*flags, "--cp-comm-type", comm_type], tmp_path, layout)
    reference = references(reference_flags)
    assert sorted(run["lm loss"]) == list(range(1, ITERS + 1))
    _assert_same_numbers(run, reference, f"{layout} {comm_type}")
    print(f"{layout} {comm_type}: max |lm loss - one process| = {max_loss_difference(run, reference):.3g}")


def test_one_comm_type_per_layer(references, tmp_path):
    """--cp-comm-type with one value per layer (--num-layers 2): layer i uses value i."""
    per_layer = [COMM_TYPES[0], COMM_TYPES[-1]]
    run = _train(2, ["--context-parallel-size", "2", "--cp-comm-type", *per_layer], tmp_path, "per_layer")
    _assert_same_numbers(run, references(()), f"per layer {per_layer}")


def test_context_parallel_under_fsdp2_matches_one_process(references, tmp_path):
    """--use-torch-fsdp2 shards over the data x context-parallel ranks (Megatron's FSDP2 mesh): CP=2 under
    FSDP2 gives the numbers of one process."""
    fsdp = ["--untie-embeddings-and-output-weights"]
    run = _train(2, ["--context-parallel-size", "2", "--use-torch-fsdp2", "--no-gradient-accumulation-fusion", *fsdp],
                 tmp_path, "cp2_fsdp2")
    _assert_same_numbers(run, references(tuple(fsdp)), "cp2 fsdp2")


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_checkpoint_saved_at_cp2_resumes_at_cp1(ckpt_format, references, tmp_path):
    """torch_dist: keys and shapes do not depend on CP; the distributed optimizer's fragments are over the
    data x context-parallel ranks. The legacy torch format (written by data x context-parallel rank 0,
    the optimizer state gathered over those ranks) resumes too."""
    comm_type = COMM_TYPES[0]
    ckpt = tmp_path / "ckpt"
    fmt = ["--ckpt-format", ckpt_format, "--use-distributed-optimizer"]
    save = ["--save", ckpt, "--save-interval", "5", "--exit-interval", "5", *fmt]
    first = _train(2, ["--context-parallel-size", "2", "--cp-comm-type", comm_type, *save], tmp_path, "cp2")
    assert sorted(first["lm loss"]) == list(range(1, 6))
    second = _train(1, ["--load", ckpt, *fmt], tmp_path, "cp1_resumed")
    assert sorted(second["lm loss"]) == list(range(6, ITERS + 1))
    reference = references(())
    _assert_same_numbers(first, reference, "cp2 before the save", steps=range(1, 6))
    _assert_same_numbers(second, reference, "cp1 after the resume", steps=range(6, ITERS + 1))
    if ckpt_format == "torch_dist":  # and at CP=4
        third = _train(4, ["--load", ckpt, *fmt, "--context-parallel-size", "4", "--cp-comm-type", comm_type],
                       tmp_path, "cp4_resumed")
        _assert_same_numbers(third, reference, "cp4 after the resume", steps=range(6, ITERS + 1))


# --------------------------------------------------------------------------------------- gradients
_GRAD_MODELS = {
    "llama": (dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=64,
                   gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                   add_bias_linear=False), dict(share_embeddings_and_output_weights=False,
                                                 position_embedding_type="rope")),
    "gpt2": (dict(num_layers=2, hidden_size=32, num_attention_heads=4),
             dict(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")),
}
_V, _S, _B = 64, 16, 2


def _grads(rank, world, kind, comm_type):
    """{param name: grad of the mean per-token loss over the whole batch} (summed over the CP ranks)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.training.utils import get_batch_on_this_cp_rank

    ps.initialize_model_parallel(context_parallel_size=world)
    config_kw, model_kw = _GRAD_MODELS[kind]
    config = TransformerConfig(hidden_dropout=0.0, attention_dropout=0.0, context_parallel_size=world,
                               cp_comm_type=comm_type, **config_kw)
    torch.manual_seed(7)
    model = GPTModel(config, vocab_size=_V, max_sequence_length=_S, **model_kw)
    g = torch.Generator().manual_seed(3)
    full = {"tokens": torch.randint(0, _V, (_B, _S), generator=g),
            "labels": torch.randint(0, _V, (_B, _S), generator=g),
            "position_ids": torch.arange(_S).expand(_B, _S), "loss_mask": torch.ones(_B, _S)}
    batch = get_batch_on_this_cp_rank(full)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    (losses * batch["loss_mask"]).sum().div(_B * _S).backward()
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if world > 1:
            dist.all_reduce(grad, group=ps.get_context_parallel_group())
        out[name] = grad
    return out


@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("kind", list(_GRAD_MODELS))
def test_one_step_gradients_match_one_process(kind, comm_type):
    reference = run_distributed(_grads, 1, kind, None)[0]
    cp2 = run_distributed(_grads, 2, kind, comm_type)
    assert sorted(cp2[0]) == sorted(reference)
    worst = max(float((cp2[0][name] - reference[name]).abs().max()) for name in reference)
    assert worst <= 1e-6, f"{kind} {comm_type}: max |grad difference| {worst:.3g}"
    for name in reference:  # every CP rank ends with the same reduced gradient
        torch.testing.assert_close(cp2[1][name], cp2[0][name], rtol=0, atol=0)
    print(f"{kind} {comm_type}: max |grad - one process| = {worst:.3g}")
