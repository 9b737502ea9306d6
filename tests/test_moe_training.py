"""Mixture of experts through pretrain_gpt.py gives the numbers of one process (issue 31, "Done means").

Every run: a 2-layer hidden-32 GPT with 4 experts per layer (SwiGLU-free, no biases), top-2 routing with the
aux loss (coefficient 1e-2), fp32, no dropout, --mock-data, 10 iterations, global batch 8 in micro-batches of 2,
on gloo ranks; compared with the same model on one process: ``lm loss`` within 1e-5, grad norm within 1e-5
relative and the logged ``load_balancing_loss`` within 1e-5 (all from TensorBoard, float32 as written).

Layouts: EP=2; EP=2 x TP=2 with --sequence-parallel; EP=2 x PP=2; EP=2 with --use-distributed-optimizer; each
with both token dispatchers (allgather, alltoall), dropless. On a subset: a capacity factor (EP=2 with alltoall; EP=2
with the distributed optimizer and allgather, with --moe-pad-expert-input-to-capacity),
a shared expert (EP=2 x TP=2, alltoall) and sigmoid routing with the aux-loss-free expert bias (EP=2, both
dispatchers). Beyond the issue's list, one dispatcher each: expert TP 1 under TP=2 (SP), with and without the
distributed optimizer (the expert-data-parallel group differs from the dense one), EP=2 x CP=2, EP=2 with the
distributed optimizer overlapping a bucketed grad reduce-scatter and param all-gather, and EP=2 x PP=2 with
--moe-layer-freq [0,1] (a pipeline stage without expert parameters), EP=2 with --calculate-per-token-loss (the
aux-loss scale without 1/num_microbatches), EP=2 x TP=2 (SP) with the per-sequence aux loss (seq_aux_loss), and
FSDP2 (EP=1, which FSDP2 requires).

Context parallelism follows Megatron core_v0.14: each CP rank's aux loss is its part of the whole (the token
counts are summed over TP x CP) while the gradients are averaged over DP x CP, so under CP the aux loss trains
with 1/CP of its coefficient (the same holds for the z-loss). EP=2 x CP=2 is therefore compared with one process
run at --moe-aux-loss-coeff 1e-2 / 2; the logged load_balancing_loss (the loss without its coefficient) is equal.

Not compared with one process, by design (Megatron's semantics): a capacity factor under sequence parallelism,
where each TP rank routes only its sequence shard and the capacity is computed per shard (``get_capacity`` on the
router's local tokens), so EP=2 x TP=2 drops other tokens than TP=1. What does hold there is that expert
parallelism changes nothing: EP=2 x TP=2 with a capacity factor equals EP=1 x TP=2 with the same factor.
"""
import re

import pytest

from pretrain_utils import one_process_references, run_ranks, tensorboard_scalars

pytestmark = pytest.mark.timeout(300)

ITERS = 10
MODEL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo",
         "--disable-bias-linear", "--ffn-hidden-size", "64",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-ffn-hidden-size", "32"]
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1",
         "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--train-iters", str(ITERS)]
# NullTokenizer's 100 ids pad to 128 at TP=1 and 256 at TP=2; the TP=1 reference pads as TP=2 does.
PAD_TP2 = ["--make-vocab-size-divisible-by", "256"]
TAGS = ("lm loss", "grad-norm", "load_balancing_loss")
LAYOUTS = {  # name: (ranks, flags, flags of the one-process reference)
    "ep2": (2, ["--expert-model-parallel-size", "2"], []),
    "ep2-tp2-sp": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"], PAD_TP2),
    "ep2-pp2": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], []),
    "ep2-distopt": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"], []),
    # Overlapped, bucketed grad reduce-scatter and param all-gather (several buckets in each buffer).
    "ep2-distopt-overlap": (2, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "2000"], []),
    "fsdp2": (2, ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"],
              ["--untie-embeddings-and-output-weights"]),
    # Expert TP 1 under TP 2: the experts' data-parallel group (2 ranks, the EP peers' TP ranks) is not the dense one.
    "ep2-tp2-etp1-distopt": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                 "--use-distributed-optimizer"], PAD_TP2),
    # Megatron's CP semantics: each CP rank's aux loss is its part of the whole (tokens_per_expert summed over
    # TP x CP) and the gradients are averaged over DP x CP, so the aux loss trains with 1/CP of its coefficient:
    # the one-process run to compare with has --moe-aux-loss-coeff 1e-2 / 2.
    "ep2-tp2-etp1": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                         "--sequence-parallel", "--expert-tensor-parallel-size", "1"], PAD_TP2),
    "ep2-cp2": (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"],
                ["--moe-aux-loss-coeff", "5e-3"]),
}
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
SHARED = ["--moe-shared-expert-intermediate-size", "48"]
SIGMOID_BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", "1e-2"]
# (layout, dispatcher, variant flags): every layout with both dispatchers dropless, then the variants.
CASES = [(layout, dispatcher, ()) for layout in list(LAYOUTS)[:4] for dispatcher in ("allgather", "alltoall")] + [
    ("ep2-tp2-etp1-distopt", "allgather", ()),
    ("ep2-tp2-etp1", "alltoall", ()),
    ("ep2-cp2", "alltoall", ()),
    ("ep2-distopt-overlap", "alltoall", ()),
    ("fsdp2", "alltoall", ()),
    ("ep2", "alltoall", ("--calculate-per-token-loss",)),
    ("ep2-tp2-sp", "allgather", ("--moe-router-load-balancing-type", "seq_aux_loss")),
    ("ep2", "alltoall", tuple(CAPACITY)),
    ("ep2-pp2", "alltoall", tuple(CAPACITY)),
    ("ep2-pp2", "allgather", ("--moe-layer-freq", "[0,1]")),  # the first stage has no MoE layer
    ("ep2-distopt", "allgather", (*CAPACITY, "--moe-pad-expert-input-to-capacity")),
    ("ep2-tp2-sp", "alltoall", tuple(SHARED)),
    ("ep2", "allgather", tuple(SIGMOID_BIAS)),
    ("ep2", "alltoall", tuple(SIGMOID_BIAS)),
]


def _train(nproc, flags, tmp_path, name):
    tb = tmp_path / f"tb_{name}"
    result = run_ranks(nproc, [*MODEL, *TRAIN, *flags, "--tensorboard-dir", tb], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tags = [tag.replace("load_balancing", "seq_load_balancing") if "seq_aux_loss" in flags else tag for tag in TAGS]
    return {tag: tensorboard_scalars(tb, tag) for tag in tags}, result.stdout


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs, computed on first use: {reference flags (tuple): (scalars, stdout)}."""
    return one_process_references(_train, tmp_path_factory, "moe1")


def _assert_same_numbers(run, reference, what):
    """lm loss and the logged load_balancing_loss (the loss without its coefficient) within 1e-5, grad norm 1e-5
    relative, at every iteration."""
    assert sorted(run["lm loss"]) == list(range(1, ITERS + 1)), what
    for step in range(1, ITERS + 1):
        assert abs(run["lm loss"][step] - reference["lm loss"][step]) <= 1e-5, f"{what}: lm loss at {step}"
        assert run["grad-norm"][step] == pytest.approx(reference["grad-norm"][step], rel=1e-5), \
            f"{what}: grad norm at {step}"
        for tag in set(reference) - {"lm loss", "grad-norm"}:  # the logged (seq_)load_balancing_loss
            assert abs(run[tag][step] - reference[tag][step]) <= 1e-5, f"{what}: {tag} at {step}"


@pytest.mark.parametrize("layout,dispatcher,variant", CASES,
                         ids=[f"{l}-{d}{'-' + v[0].lstrip('-') if v else ''}" for l, d, v in CASES])
def test_moe_training_matches_one_process(layout, dispatcher, variant, references, tmp_path):
    nproc, flags, reference_flags = LAYOUTS[layout]
    run, _ = _train(nproc, [*flags, "--moe-token-dispatcher-type", dispatcher, *variant], tmp_path, layout)
    reference, _ = references((*reference_flags, *variant))
    _assert_same_numbers(run, reference, f"{layout} {dispatcher} {' '.join(variant)}")
    difference = max(abs(run["lm loss"][s] - reference["lm loss"][s]) for s in reference["lm loss"])
    print(f"{layout} {dispatcher} {' '.join(variant)}: max |lm loss - one process| = {difference:.3g}")


def test_capacity_under_sequence_parallel_is_per_shard_and_expert_parallelism_changes_nothing(tmp_path):
    """EP=2 x TP=2 (SP) with a capacity factor drops per sequence shard (not what TP=1 drops); EP=1 x TP=2 with
    the same factor drops the same tokens, so the two give the same numbers."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall",
           *CAPACITY]
    with_ep, _ = _train(4, [*tp2, "--expert-model-parallel-size", "2"], tmp_path, "ep2_tp2_cap")
    without_ep, _ = _train(2, tp2, tmp_path, "ep1_tp2_cap")
    _assert_same_numbers(with_ep, without_ep, "EP=2 x TP=2 vs EP=1 x TP=2 with a capacity factor")


_BALANCING = re.compile(r"iteration\s+(\d+)/\s+\d+ \|.*?\| lm loss: [0-9.]+E[+-]\d+ \| "
                        r"load_balancing_loss: ([0-9.]+E[+-]\d+) \| loss scale:")


def test_log_line_carries_load_balancing_loss_as_one_process_logs_it(references, tmp_path):
    """Megatron's position: `` lm loss: ... | load_balancing_loss: %.6E | loss scale: ...``; at EP=2 the printed
    value is the one process's (averaged over the layers and the micro-batches of the step)."""
    _, stdout = _train(2, ["--expert-model-parallel-size", "2"], tmp_path, "ep2_log")
    _, reference_stdout = references(())
    printed = {int(i): float(v) for i, v in _BALANCING.findall(stdout)}
    expected = {int(i): float(v) for i, v in _BALANCING.findall(reference_stdout)}
    assert sorted(printed) == sorted(expected) == list(range(1, ITERS + 1))
    for step, value in expected.items():
        assert value > 0 and printed[step] == pytest.approx(value, rel=1e-5, abs=1e-7), step


def test_per_layer_logging_and_z_loss_reach_tensorboard(tmp_path):
    """--moe-per-layer-logging adds ``moe/{name}_layer_{i}``; --moe-z-loss-coeff adds ``z_loss`` to the line, before
    ``load_balancing_loss`` as in Megatron (the tracker's order: the router saves the z-loss first)."""
    run, stdout = _train(1, ["--moe-per-layer-logging", "--moe-z-loss-coeff", "1e-3"], tmp_path, "per_layer")
    tb = tmp_path / "tb_per_layer"
    layers = [tensorboard_scalars(tb, f"moe/load_balancing_loss_layer_{i}") for i in range(2)]
    for step in range(1, ITERS + 1):
        mean = (layers[0][step] + layers[1][step]) / 2
        assert run["load_balancing_loss"][step] == pytest.approx(mean, rel=1e-5)
    assert sorted(tensorboard_scalars(tb, "z_loss")) == list(range(1, ITERS + 1))
    assert len(re.findall(r"\| lm loss: [0-9.]+E[+-]\d+ \| z_loss: [0-9.]+E[+-]\d+ \| "
                          r"load_balancing_loss: [0-9.]+E[+-]\d+ \| loss scale:", stdout)) == ITERS


def test_aux_loss_with_coefficient_zero_is_left_out_of_the_line(tmp_path):
    """Megatron's default --moe-aux-loss-coeff 0: TensorBoard gets load_balancing_loss 0 (track_moe_metrics zero-fills
    the tracked names), the line leaves it out (Megatron prints a loss only when its average is above 0)."""
    run, stdout = _train(1, ["--moe-aux-loss-coeff", "0"], tmp_path, "coeff0")
    assert set(run["load_balancing_loss"].values()) == {0.0}
    lines = [line for line in stdout.splitlines() if "| lm loss: " in line]
    assert len(lines) == ITERS and not any("load_balancing_loss" in line for line in lines)
