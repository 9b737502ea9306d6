"""Hardening found by using the product (issue 9): silent no-ops and misleading reports in training refused or reported."""
import pytest

from megatron.training.arguments import parse_args, validate_args

VALID = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)


def test_context_parallelism_flags_are_validated_naming_the_flag(single_process, monkeypatch):
    """--context-parallel-size 2 used to be accepted and ignored; now it acts (tests/test_context_parallel_training.py)
    and what it cannot be combined with is refused by name."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cp2 = [*VALID, "--context-parallel-size", "2"]
    args = validate_args(parse_args(args=[*cp2, "--attention-dropout", "0"]))
    assert args.context_parallel_size == 2 and args.data_parallel_size == 1 and args.cp_comm_type == ["p2p"]
    refusals = {
        ("--attention-dropout", "0.1"): "--attention-dropout",
        ("--attention-dropout", "0", "--reset-attention-mask"): "--reset-attention-mask",
        ("--attention-dropout", "0", "--seq-length", "30", "--max-position-embeddings", "30"):
            r"2 x --context-parallel-size",
        ("--attention-dropout", "0", "--cp-comm-type", "a2a+p2p"): r"--cp-comm-type a2a\+p2p .*not supported",
        ("--attention-dropout", "0", "--cp-comm-type", "ring"): "--cp-comm-type 'ring'",
        ("--attention-dropout", "0", "--cp-comm-type", "p2p", "a2a", "p2p"): "--cp-comm-type takes one value or one",
        ("--attention-dropout", "0", "--cp-comm-type", "a2a", "--num-attention-heads", "3", "--hidden-size", "48"):
            r"--cp-comm-type a2a splits the attention heads .*\(3 per tensor-parallel rank\) is not divisible by "
            r"--context-parallel-size \(2\)",
    }
    for extra, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(args=[*cp2, *extra]))
    per_layer = validate_args(parse_args(args=[*cp2, "--attention-dropout", "0", "--cp-comm-type", "p2p", "a2a"]))
    assert per_layer.cp_comm_type == ["p2p", "a2a"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"--seq-length \(32\) / --context-parallel-size \(2\) is not divisible by "
                                         r"--tensor-model-parallel-size \(32\)"):
        validate_args(parse_args(args=[*cp2, "--attention-dropout", "0", "--tensor-model-parallel-size", "32",
                                       "--sequence-parallel", "--num-attention-heads", "32"]))
    assert validate_args(parse_args(args=[*VALID, "--context-parallel-size", "1"])).context_parallel_size == 1


def test_negative_split_weight_is_refused_naming_the_flag():
    """'-1,2,3' used to be read as '1,2,3'."""
    from megatron.core.datasets.utils import parse_and_normalize_split

    for split in ("-1,2,3", "98, -2, 0", "1/ -1"):
        with pytest.raises(ValueError, match=r"--split .*negative"):
            parse_and_normalize_split(split)
    assert parse_and_normalize_split("98,2,0") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_and_normalize_split("98-2") == pytest.approx([0.98, 0.02, 0.0])  # '-' as a separator


def test_empty_training_split_stops_the_run_naming_split_and_data(shared_data, shakespeare_prefix, tmp_path):
    """--split 0,0,100 with --train-iters used to train nothing, save nothing and exit 0."""
    from pretrain_utils import run_pretrain

    ckpt = tmp_path / "ckpt"
    out = run_pretrain(1, ["--micro-batch-size", "2", "--train-iters", "3", "--split", "0,0,100", "--save", str(ckpt),
                        "--save-interval", "3"],
                       shared_data, shakespeare_prefix, tmp_path, expect_failure=True)
    errors = [line for line in out.splitlines() if "training split is empty" in line]
    assert errors, out[-3000:]
    assert "--split '0,0,100'" in errors[0] and shakespeare_prefix in errors[0], errors[0]
    assert not ckpt.exists()


def test_validation_metrics_record_the_split(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    """The test-set loss after training used to land in the same megatron.validation.* series as the
    validation loss (no attribute), so the "validation" series ended on the test value."""
    import re

    from pretrain_utils import console_objects, run_pretrain

    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    out = run_pretrain(1, ["--micro-batch-size", "2", "--train-iters", "3", "--split", "90,5,5"],
                       shared_data, shakespeare_prefix, tmp_path)
    printed = {}
    for line in out.splitlines():
        match = re.search(r"validation loss at iteration 3 on (validation|test) set \| lm loss value: (\S+) \|", line)
        if match:
            printed[match.group(1)] = float(match.group(2))
    assert set(printed) == {"validation", "test"} and printed["validation"] != printed["test"], printed
    points = {}
    for record in console_objects(out):
        for rm in record.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for metric in sm["metrics"]:
                    if metric["name"] in ("megatron.validation.loss", "megatron.validation.ppl"):
                        for point in metric["data"]["data_points"]:
                            split = point["attributes"].get("megatron.split")
                            points[(metric["name"], split)] = point["value"]
    assert points[("megatron.validation.loss", "validation")] == pytest.approx(printed["validation"], rel=1e-5)
    assert points[("megatron.validation.loss", "test")] == pytest.approx(printed["test"], rel=1e-5)
    assert set(points) == {(name, split) for name in ("megatron.validation.loss", "megatron.validation.ppl")
                           for split in ("validation", "test")}, points


def _write_tokens(prefix, sequences):
    import numpy

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for seq in sequences:
        builder.add_item(seq)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def test_token_id_beyond_the_vocabulary_names_the_data_file(tmp_path):
    """A sample holding an id >= the model's vocabulary used to crash inside the embedding with a bare
    'IndexError: index out of range in self'."""
    from collections import OrderedDict

    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import Split

    class _Tokenizer:
        eod, pad, vocab_size = 0, -1, 64
        unique_identifiers = OrderedDict([("class", "StandIn"), ("vocab_size", 64)])

    prefix = _write_tokens(str(tmp_path / "bad"), [[1, 2, 3, 4, 5, 0], [6, 7, 70, 8, 9, 0], [10, 11, 12, 13, 0]])
    config = GPTDatasetConfig(random_seed=1, sequence_length=4, split="1,0,0", tokenizer=_Tokenizer(),
                              blend=([prefix], None), path_to_cache=str(tmp_path / "cache"), vocab_size=64)
    low = GPTDataset.build_low_level_dataset(prefix, config)
    dataset = GPTDataset(low, prefix, numpy_indices(low), 10, Split.train, config)
    messages = set()
    for i in range(len(dataset)):
        try:
            dataset[i]
        except ValueError as error:
            messages.add(str(error))
    assert messages, "no sample reported the token id 70 of a 64-token vocabulary"
    for message in messages:
        assert f"{prefix}.bin" in message and "token id 70" in message and "vocabulary of 64" in message, message
        assert "\n" not in message
    ok = GPTDatasetConfig(random_seed=1, sequence_length=4, split="1,0,0", tokenizer=_Tokenizer(),
                          blend=([prefix], None), path_to_cache=str(tmp_path / "cache"), vocab_size=71)
    dataset = GPTDataset(low, prefix, numpy_indices(low), 10, Split.train, ok)
    assert all(int(dataset[i]["tokens"].max()) <= 70 for i in range(len(dataset)))


def numpy_indices(low):
    import numpy

    return numpy.arange(len(low), dtype=numpy.int32)


def test_out_of_vocabulary_data_stops_training_with_one_clear_line(shared_data, tmp_path):
    """End to end: every document holds an id beyond GPT-2's padded vocabulary (50304)."""
    from pretrain_utils import run_pretrain

    prefix = _write_tokens(str(tmp_path / "oov_text_document"), [[100, 200, 60000 + i, 300] * 20 + [50256]
                                                                 for i in range(40)])
    out = run_pretrain(1, ["--micro-batch-size", "2", "--train-iters", "3", "--split", "100,0,0"],
                       shared_data, prefix, tmp_path, expect_failure=True)
    assert "index out of range in self" not in out
    lines = [line for line in out.splitlines() if "outside the model's vocabulary" in line]
    assert lines, out[-3000:]
    assert f"{prefix}.bin" in lines[0] and "vocabulary of 50304" in lines[0], lines[0]


def test_nan_iterations_are_counted_whether_or_not_the_step_was_skipped():
    """fp32/bf16 steps are never skipped, so a NaN loss or grad norm used to count as nothing."""
    import torch

    from megatron.training.training_log import LogAccumulator

    acc = LogAccumulator()
    acc.add({"lm loss": torch.tensor(2.0)}, 0, grad_norm=1.0)
    acc.add({"lm loss": torch.tensor(float("nan"))}, 0, grad_norm=float("nan"))  # applied step, NaN loss
    acc.add({"lm loss": torch.tensor(3.0)}, 0, grad_norm=float("inf"))  # finite loss, non-finite grads
    acc.add({"lm loss": torch.tensor(float("inf"))}, 1, grad_norm=None)  # fp16 overflow skip
    assert (acc.advanced, acc.skipped, acc.nan) == (3, 1, 3)
    acc.reset()
    assert acc.nan == 0


def test_no_nan_check_run_counts_nan_iterations_and_keeps_the_loss_in_the_log(shared_data, shakespeare_prefix,
                                                                                tmp_path):
    """--no-check-for-nan-in-loss-and-grad with a diverging --lr: training proceeds (as the flag says)
    and the log line shows the non-finite loss and counts the iteration as a nan iteration."""
    import re

    from pretrain_utils import run_pretrain

    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "5", "--lr", "1e6", "--min-lr", "0",
                           "--lr-decay-style", "constant", "--no-check-for-nan-in-loss-and-grad"], shared_data, shakespeare_prefix, tmp_path)
    lines = [line for line in out.splitlines() if "elapsed time per iteration" in line]
    assert len(lines) == 5, out[-3000:]
    assert all(" lm loss: " in line for line in lines), lines
    nan_counts = [int(re.search(r"number of nan iterations:\s+(\d+)", line).group(1)) for line in lines]
    non_finite = [line for line in lines if re.search(r"(lm loss|grad norm): (NAN|INF|nan|inf)", line)]
    assert non_finite, "the run did not diverge; the test needs a NaN/inf iteration"
    assert sum(nan_counts) == len(non_finite) and sum(nan_counts) >= 1, lines
