"""pretrain_gpt.py with tensor (and sequence) parallelism on gloo ranks gives the numbers of one process.

Each run trains 20 iterations in fp32 on the same data with the same seed; losses and grad norms
are read from TensorBoard (float32, unlike the rounded log line). The vocabulary is padded to the
same size at every TP size (--make-vocab-size-divisible-by), since padding is part of the model.
"""
import re

import pytest

from pretrain_utils import losses_from_log, run_pretrain, run_ranks_without_launcher, tensorboard_scalars

ITERS = 20
TRAIN = ["--train-iters", str(ITERS), "--micro-batch-size", "4", "--eval-interval", "10"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
MODELS = {
    "gpt2": [],
    "llama": ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--position-embedding-type", "rope",
              "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
              "--qk-layernorm"],
}
# GPT-2's 50257 tokens are padded to a multiple of 128 * tp (50432 at TP=2, 50688 at TP=4); the TP=1
# reference pads to the same size with --make-vocab-size-divisible-by 128 * tp.
PAD = ["--make-vocab-size-divisible-by", "128"]
_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), 0\): (\d+)")


def _padded_vocab(tp):
    multiple = 128 * tp
    return -(-50257 // multiple) * multiple


def _train(nproc, flags, shared_data, prefix, tmp_path, padded_vocab=50432):
    tb = tmp_path / "tb"
    out = run_pretrain(nproc, [*TRAIN, *flags, "--tensorboard-dir", str(tb)], shared_data, prefix, tmp_path)
    assert f"new size: {padded_vocab})" in out
    counts = {int(rank): int(n) for rank, n in _PARAMS.findall(out)}
    return dict(out=out, loss=tensorboard_scalars(tb, "lm loss"), grad_norm=tensorboard_scalars(tb, "grad-norm"),
                params=counts)


@pytest.fixture(scope="module")
def tp1_runs(shared_data, shakespeare_prefix, tmp_path_factory):
    """One single-process reference run per (model, TP size to compare with), computed on first use."""
    cache = {}

    def get(model, tp):
        if (model, tp) not in cache:
            pad = ["--make-vocab-size-divisible-by", str(128 * tp)]
            cache[model, tp] = _train(1, [*MODELS[model], *NO_DROPOUT, *pad], shared_data, shakespeare_prefix,
                                      tmp_path_factory.mktemp(f"tp1_{model}"), padded_vocab=_padded_vocab(tp))
        return cache[model, tp]
    return get


def _assert_same_numbers(run, reference, what):
    assert sorted(run["loss"]) == sorted(reference["loss"]) == list(range(1, ITERS + 1)), what
    for metric in ("loss", "grad_norm"):
        for it, expected in reference[metric].items():
            assert run[metric][it] == pytest.approx(expected, rel=1e-5), f"{what}: {metric} at iteration {it}"
    # It learns, so the comparison means something. The margin is a fraction of a nat: the Llama-style
    # model (per-layer initial weights from (seed, layer number)) falls by about 0.19 in 20 iterations.
    assert reference["loss"][ITERS] < reference["loss"][1] - 0.1


def _replicated_params(model):
    """Parameters every TP rank holds whole: position embeddings, norms, row-parallel biases."""
    h, s, layers = 32, 32, 2
    if model == "gpt2":  # learned positions; LayerNorm weight+bias x2 and proj/fc2 biases per layer; final LN
        return s * h + layers * (2 * 2 * h + 2 * h) + 2 * h
    kv_channels = h // 4
    # RMSNorm weights (2 per layer, final) and the q/k norms over kv_channels; no biases; RoPE has none.
    return layers * (2 * h + 2 * kv_channels) + h


@pytest.mark.parametrize("model,tp,sp", [("gpt2", 2, False), ("gpt2", 2, True), ("llama", 2, True), ("gpt2", 4, True)],
                         ids=["gpt2-tp2", "gpt2-tp2-sp", "llama-gqa-swiglu-qknorm-tp2-sp", "gpt2-tp4-sp"])
def test_tp_matches_tp1_for_20_iterations(model, tp, sp, tp1_runs, shared_data, shakespeare_prefix, tmp_path):
    flags = [*MODELS[model], *NO_DROPOUT, *PAD, "--tensor-model-parallel-size", str(tp)]
    run = _train(tp, flags + (["--sequence-parallel"] if sp else []), shared_data, shakespeare_prefix, tmp_path,
                 padded_vocab=_padded_vocab(tp))
    reference = tp1_runs(model, tp)
    _assert_same_numbers(run, reference, f"{model} TP={tp} sp={sp}")
    # Each rank holds 1/tp of every split weight and all of the replicated ones.
    replicated = _replicated_params(model)
    total = reference["params"][0]
    assert run["params"] == {rank: (total - replicated) // tp + replicated for rank in range(tp)}


def test_tp2_dp2_on_four_ranks_matches_tp1_dp1(tp1_runs, shared_data, shakespeare_prefix, tmp_path):
    """Global batch 8: TP=1 x DP=1 runs 2 micro batches of 4; TP=2 x DP=2 runs 1 per data-parallel rank."""
    flags = [*NO_DROPOUT, *PAD, "--tensor-model-parallel-size", "2"]
    run = _train(4, flags, shared_data, shakespeare_prefix, tmp_path)
    assert "data-parallel size: 2" in run["out"] and "tensor-model-parallel size: 2" in run["out"]
    _assert_same_numbers(run, tp1_runs("gpt2", 2), "TP=2 x DP=2")


def test_tp2_sp_checkpoint_resumes_exactly(shared_data, shakespeare_prefix, tmp_path):
    """Dropout on (per-rank RNG states matter): a 20-iteration run saving at 10 (and 20); resumed from 10
    (--ckpt-step) it prints the run's own numbers for 11..20."""
    flags = [*PAD, "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ckpt = tmp_path / "ckpt"
    full = _train(2, flags + ["--ckpt-format", "torch", "--save", str(ckpt), "--save-interval", "10"], shared_data, shakespeare_prefix,
                  tmp_path / "full")
    assert sorted(full["loss"]) == list(range(1, 21))
    assert sorted(p.name for p in (ckpt / "iter_0000010").iterdir()) == ["integrity_manifest.json", "mp_rank_00", "mp_rank_01"]
    resumed = _train(2, flags + ["--ckpt-format", "torch", "--load", str(ckpt), "--ckpt-step", "10"], shared_data, shakespeare_prefix,
                     tmp_path / "resumed")
    assert sorted(resumed["loss"]) == list(range(11, 21))
    for metric in ("loss", "grad_norm"):
        assert resumed[metric] == {it: full[metric][it] for it in range(11, 21)}, metric
    full_log, resumed_log = losses_from_log(full["out"]), losses_from_log(resumed["out"])
    assert resumed_log == {it: full_log[it] for it in range(11, 21)}


def test_tp2_evaluates_at_another_micro_batch_size(shared_data, shakespeare_prefix, tmp_path):
    """TP ranks other than 0 learn the broadcast batch shape once; evaluation at --eval-micro-batch-size 2
    after training at 4 learns it anew (it used to stop TP rank 0 and leave rank 1 waiting) and gives the
    validation loss of evaluating at 4."""
    flags = ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--tensor-model-parallel-size", "2",
             *PAD, *NO_DROPOUT]
    printed = {}
    for eval_mbs in ("2", "4"):
        out = run_pretrain(2, [*TRAIN, *flags, "--eval-micro-batch-size", eval_mbs], shared_data, shakespeare_prefix,
                           tmp_path / eval_mbs)
        found = re.findall(r"validation loss at iteration 2 \| lm loss value: (\S+) \|", out)
        assert len(found) == 1, out[-3000:]
        printed[eval_mbs] = float(found[0])
    assert printed["2"] == pytest.approx(printed["4"], rel=1e-5)


def test_indivisible_query_groups_fail_every_rank_at_start_up(shared_data, shakespeare_prefix, tmp_path):
    """Each rank stops on its own before the process group exists (run without torchrun, which would kill
    the slower rank as soon as the first one fails); the flags are the same everywhere, so rank 0 alone
    names them."""
    ranks = run_ranks_without_launcher(2, [*TRAIN, "--tensor-model-parallel-size", "2", "--group-query-attention",
                                           "--num-query-groups", "1"], shared_data, shakespeare_prefix, tmp_path)
    message = "--num-query-groups (1) is not divisible by --tensor-model-parallel-size (2)"
    for rank, (status, out) in enumerate(ranks):
        assert status == 2, f"rank {rank}: {out[-2000:]}"
        assert "building GPT model" not in out
        assert (message in out) == (rank == 0), f"rank {rank}: {out[-2000:]}"
