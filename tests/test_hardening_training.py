"""Hardening found by using the product (issue 9): silent no-ops and misleading reports in training refused or reported."""
import pytest

from megatron.training.arguments import parse_args, validate_args

VALID = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)


def test_context_parallelism_is_refused_until_it_exists(single_process, monkeypatch):
    """--context-parallel-size 2 used to be accepted and ignored (two ranks doing the same work)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--context-parallel-size 2: context parallelism is not available"):
        validate_args(parse_args(args=[*VALID, "--context-parallel-size", "2"]))
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
    import json
    import re

    from pretrain_utils import run_pretrain

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
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        for rm in json.loads(line).get("resource_metrics", []):
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
