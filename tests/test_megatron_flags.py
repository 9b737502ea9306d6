"""Megatron-LM's own flags: one line for those this project lacks, --deterministic-mode and --dist-ckpt-strictness act,
Megatron's unsupported choices refused at parse time, and Megatron's GPT functional-test command lines parse."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from megatron.training.megatron_lm_flags import MEGATRON_LM_FLAGS, MEGATRON_LM_VERSION
from megatron.training.unsupported_flags import UNSUPPORTED_CHOICES, megatron_flag_reason

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "NCCL_ALGO",
                 "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)


def _refused(argv, capsys):
    """The stderr lines and the exit status of parse_args(argv), which must exit."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args=argv)
    captured = capsys.readouterr()
    assert "usage:" not in captured.out + captured.err
    return [line for line in captured.err.splitlines() if line.strip()], exit_info.value.code


# ------------------------------------------------------------------------------------------------- flags as data

def test_the_flag_list_is_megatron_core_v0_14():
    assert MEGATRON_LM_VERSION == "core_v0.14.0"
    assert len(MEGATRON_LM_FLAGS) == 514
    assert {"--fp8-format", "--moe-router-topk", "--use-megatron-fsdp", "--num-layers", "--deterministic-mode",
            "--dist-ckpt-strictness"} <= MEGATRON_LM_FLAGS


def test_megatron_only_flag_gets_one_line_with_the_reason(capsys):
    lines, status = _refused([*SMALL, "--fp8-format", "hybrid"], capsys)
    assert status == 2
    assert lines == ["error: --fp8-format is a Megatron-LM flag that this project does not support: "
                     "FP8 needs Transformer Engine"]


def test_several_megatron_only_flags_one_line_naming_them(capsys):
    lines, status = _refused([*SMALL, "--moe-enable-deepep", "--use-megatron-fsdp", "--fp8-param-gather"], capsys)
    assert status == 2 and len(lines) == 1
    assert lines[0] == ("error: --moe-enable-deepep is a Megatron-LM flag that this project does not support: DeepEP and "
                        "the flex token dispatcher are not available (use --moe-token-dispatcher-type allgather or "
                        "alltoall) (also unsupported: --use-megatron-fsdp, --fp8-param-gather)")


def test_megatron_only_flag_with_equals_and_no_neighbour_suggestion(capsys):
    # --ckpt-fully-parallel-load used to be "corrected" to a neighbour flag.
    lines, _ = _refused([*SMALL, "--ckpt-fully-parallel-load"], capsys)
    assert "did you mean" not in lines[0] and lines[0].startswith(
        "error: --ckpt-fully-parallel-load is a Megatron-LM flag that this project does not support: ")


def test_no_refusal_reason_names_a_flag_this_project_has():
    """A flag that lands here (FSDP2, --cp-comm-type) must leave the list of refusal reasons, which would
    otherwise describe it as missing."""
    import fnmatch

    from megatron.training.arguments import _MegatronArgumentParser, add_megatron_arguments
    from megatron.training.unsupported_flags import UNSUPPORTED_REASONS

    ours = {option for action in add_megatron_arguments(_MegatronArgumentParser())._actions
            for option in action.option_strings}
    assert [pattern for pattern, _ in UNSUPPORTED_REASONS
            if any(fnmatch.fnmatch(option, pattern) for option in ours)] == []


def test_megatron_only_flag_printed_by_rank_0_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    lines, status = _refused([*SMALL, "--fp8-format", "hybrid"], capsys)
    assert status == 2 and lines == []


def test_typo_still_gets_did_you_mean(capsys):
    lines, status = _refused([*SMALL, "--num-layer", "2"], capsys)
    assert status == 2
    assert lines == ["error: unrecognized arguments: --num-layer 2 (did you mean --num-layers?)"]


def test_every_megatron_flag_we_lack_has_a_reason():
    from megatron.training.arguments import add_megatron_arguments
    import argparse

    ours = {option for action in add_megatron_arguments(argparse.ArgumentParser())._actions
            for option in action.option_strings}
    lacking = MEGATRON_LM_FLAGS - ours
    assert lacking and all(megatron_flag_reason(flag) for flag in lacking)
    assert megatron_flag_reason("--num-layer") is None


# ------------------------------------------------------------------------------------------ choices at parse time

@pytest.mark.parametrize("value", ["yarn", "mrope", "relative"])
def test_position_embedding_type_refused_at_parse_time(value, capsys):
    lines, status = _refused([*SMALL, "--position-embedding-type", value], capsys)
    assert status == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: --position-embedding-type {value} is a Megatron-LM choice that this project "
                               "does not support: ")
    assert lines[0].endswith("choose one of learned_absolute, rope, none")


@pytest.mark.parametrize("value", sorted(UNSUPPORTED_CHOICES["optimizer"][1]))
def test_unsupported_optimizer_refused_at_parse_time(value, capsys):
    lines, status = _refused([*SMALL, "--optimizer", value], capsys)
    assert status == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: --optimizer {value} is a Megatron-LM choice that this project does not "
                               "support: ") and lines[0].endswith("choose one of adam, sgd")


def test_supported_choices_still_parse():
    assert parse_args(args=[*SMALL, "--position-embedding-type", "rope", "--optimizer", "sgd"]).optimizer == "sgd"


# ------------------------------------------------------------------------------------------------ deterministic mode

def test_deterministic_mode_reaches_the_model_config():
    from megatron.training.argument_utils import core_transformer_config_from_args

    args = validate_args(parse_args(args=[*SMALL, "--deterministic-mode"]))
    assert core_transformer_config_from_args(args).deterministic_mode is True
    assert core_transformer_config_from_args(validate_args(parse_args(args=SMALL))).deterministic_mode is False


def test_deterministic_mode_refuses_flash_attention_and_a_bad_nccl_algo(monkeypatch):
    with pytest.raises(ValueError, match="--deterministic-mode cannot be combined with --attention-backend flash"):
        validate_args(parse_args(args=[*SMALL, "--deterministic-mode", "--attention-backend", "flash"]))
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(ValueError, match="--deterministic-mode needs env NCCL_ALGO to be one of Tree, Ring"):
        validate_args(parse_args(args=[*SMALL, "--deterministic-mode"]))
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    validate_args(parse_args(args=[*SMALL, "--deterministic-mode"]))


_INIT_SCRIPT = """
import sys, torch
from megatron.training.initialize import initialize_megatron
initialize_megatron(argv=sys.argv[1:])
print("deterministic:", torch.are_deterministic_algorithms_enabled())
"""


@pytest.mark.parametrize("flag,expected", [(["--deterministic-mode"], "True"), ([], "False")])
def test_deterministic_mode_is_on_after_initialization(flag, expected, tmp_path):
    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "NCCL_ALGO"):
        env.pop(name, None)
    argv = [*SMALL, "--distributed-backend", "gloo", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--mock-data", *flag]
    result = subprocess.run([sys.executable, "-c", _INIT_SCRIPT, *argv], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"deterministic: {expected}" in result.stdout


# -------------------------------------------------------------------------------------------- dist-ckpt-strictness

def _save(tmp_path, **tensors):
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    serialization.save([ShardedTensor(key, t, tuple(t.shape), (0,) * t.dim()) for key, t in tensors.items()],
                       str(tmp_path))
    return str(tmp_path)


def _load(ckpt, strict, **targets):
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return serialization.load([ShardedTensor(key, t, tuple(t.shape), (0,) * t.dim()) for key, t in targets.items()],
                              ckpt, strict=strict)


@pytest.fixture
def ckpt(tmp_path):
    """A torch_dist checkpoint holding tensors ``a`` and ``b``."""
    return _save(tmp_path / "ckpt", a=torch.full((2, 3), 1.0), b=torch.full((4,), 2.0))


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_unexpected_key_fails_the_load_in_one_line(ckpt, strict):
    """``c`` is requested but not in the checkpoint: the strict modes fail naming it, before reading."""
    from megatron.core.dist_checkpointing.serialization import CheckpointMismatchError

    a = torch.zeros(2, 3)
    with pytest.raises(CheckpointMismatchError) as error:
        _load(ckpt, strict, a=a, b=torch.zeros(4), c=torch.zeros(5))
    assert "1 tensor(s) missing, e.g. c" in str(error.value) and "\n" not in str(error.value)
    assert a.eq(0).all()


@pytest.mark.parametrize("strict,warns", [("log_unexpected", True), ("log_all", True), ("ignore_all", False)])
def test_unexpected_key_is_skipped_by_the_lenient_modes(ckpt, strict, warns, caplog):
    a, c = torch.zeros(2, 3), torch.full((5,), 7.0)
    with caplog.at_level("WARNING", logger="megatron.core.dist_checkpointing.serialization"):
        skipped = _load(ckpt, strict, a=a, b=torch.zeros(4), c=c)
    assert skipped == ["c"] and a.eq(1).all() and c.eq(7).all()
    lacks = [r.message for r in caplog.records if "lacks 1 requested tensor(s)" in r.message]
    assert (len(lacks) == 1 and lacks[0].endswith(": c")) if warns else not lacks


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "log_unexpected", "raise_unexpected", "ignore_all"])
def test_a_checkpoint_tensor_nobody_reads_is_ignored_by_the_unexpected_modes(ckpt, strict, caplog):
    a = torch.zeros(2, 3)
    with caplog.at_level("WARNING", logger="megatron.core.dist_checkpointing.serialization"):
        assert _load(ckpt, strict, a=a) == []
    assert a.eq(1).all() and not caplog.records


def test_a_checkpoint_tensor_nobody_reads_is_warned_by_log_all(ckpt, caplog):
    a = torch.zeros(2, 3)
    with caplog.at_level("WARNING", logger="megatron.core.dist_checkpointing.serialization"):
        _load(ckpt, "log_all", a=a)
    assert a.eq(1).all()
    assert [r.message.split(": ")[-1] for r in caplog.records if "does not read" in r.message] == ["b"]


def test_a_checkpoint_tensor_nobody_reads_fails_raise_all(ckpt):
    from megatron.core.dist_checkpointing.serialization import CheckpointMismatchError

    with pytest.raises(CheckpointMismatchError, match=r"1 checkpoint tensor\(s\) not read by this model "
                                                      r"\(--dist-ckpt-strictness raise_all\), e.g. b"):
        _load(ckpt, "raise_all", a=torch.zeros(2, 3))


def test_strictness_choices_and_config(capsys):
    from megatron.training.argument_utils import checkpoint_config_from_args

    assert parse_args(args=SMALL).dist_ckpt_strictness == "assume_ok_unexpected"  # Megatron's default
    args = validate_args(parse_args(args=[*SMALL, "--dist-ckpt-strictness", "log_all"]))
    assert checkpoint_config_from_args(args).dist_ckpt_strictness == "log_all"
    for mode in ("return_unexpected", "return_all"):
        with pytest.raises(ValueError, match=f"--dist-ckpt-strictness {mode} is not available"):
            validate_args(parse_args(args=[*SMALL, "--dist-ckpt-strictness", mode]))
    lines, status = _refused([*SMALL, "--dist-ckpt-strictness", "lenient"], capsys)
    assert status == 2 and len(lines) == 1 and "invalid choice: 'lenient'" in lines[0]


def test_training_resume_follows_the_strictness(shared_data, shakespeare_prefix, tmp_path):
    """A checkpoint saved with an untied output layer, loaded (--finetune) by a tied model: its
    output_layer.weight is read by nobody. The default loads; raise_all fails in one line naming it."""
    from pretrain_utils import run_pretrain

    save = ["--micro-batch-size", "2", "--train-iters", "3", "--eval-iters", "0", "--lr-warmup-iters", "0", "--no-save-optim", "--no-save-rng"]
    run_pretrain(1, [*save, "--untie-embeddings-and-output-weights", "--save", tmp_path / "ck", "--save-interval",
                     "2"], shared_data, shakespeare_prefix, tmp_path)
    load = ["--micro-batch-size", "2", "--train-iters", "1", "--eval-iters", "0", "--lr-warmup-iters", "0", "--load", tmp_path / "ck",
            "--finetune", "--no-load-optim", "--no-load-rng"]
    out = run_pretrain(1, load, shared_data, shakespeare_prefix, tmp_path)
    assert "successfully loaded checkpoint" in out
    out = run_pretrain(1, [*load, "--dist-ckpt-strictness", "raise_all"], shared_data, shakespeare_prefix, tmp_path,
                       expect_failure=True)
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1 and "not read by this model (--dist-ckpt-strictness raise_all), e.g. output_layer.weight" \
        in errors[0], out[-3000:]


def test_a_normal_resume_reads_every_checkpoint_tensor(shared_data, shakespeare_prefix, tmp_path):
    """raise_all on the resume of an unchanged run (DP=2, distributed optimizer, fp32): nothing is unread (the fp32
    main-param copies are the weights), so the strictest mode loads; the ranks agree on the requested keys."""
    from pretrain_utils import run_pretrain

    base = ["--micro-batch-size", "2", "--eval-iters", "0", "--lr-warmup-iters", "0", "--train-iters", "3",
            "--use-distributed-optimizer"]
    run_pretrain(2, [*base, "--exit-interval", "2", "--save", tmp_path / "ck", "--save-interval", "2"], shared_data,
                 shakespeare_prefix, tmp_path)
    out = run_pretrain(2, [*base, "--load", tmp_path / "ck", "--dist-ckpt-strictness", "raise_all"], shared_data,
                       shakespeare_prefix, tmp_path)
    assert "successfully loaded checkpoint" in out


# ------------------------------------------------------------------------------ Megatron's GPT test configurations

# MODEL_ARGS of three of Megatron-LM core_v0.14.0's tests/functional_tests/test_cases/gpt/*/model_config.yaml,
# written as the argv its _run_training.sh builds (${...} replaced by paths).
_COMMON = ["--num-layers", "12", "--hidden-size", "512", "--num-attention-heads", "8", "--log-params-norm",
           "--log-num-zeros-in-grad", "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard",
           "--tensorboard-dir", "/tmp/tb", "--micro-batch-size", "4", "--global-batch-size", "32", "--seq-length",
           "1024", "--max-position-embeddings", "1024", "--train-iters", "50", "--timing-log-level", "2",
           "--lr-decay-iters", "320000", "--save", "/tmp/ckpt", "--load", "/tmp/ckpt", "--data-path",
           "/tmp/data/my-gpt3_00_text_document", "--vocab-file", "/tmp/data/bpe/vocab.json", "--merge-file",
           "/tmp/data/bpe/merges.txt", "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "0.00015",
           "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--clip-grad", "1.0",
           "--lr-warmup-fraction", ".01", "--log-interval", "1", "--save-interval", "10000", "--eval-interval",
           "1000", "--eval-iters", "10"]
MEGATRON_CONFIGS = {
    "gpt3_mr_mcore_tp2_pp2_uninstall_te_dgx_a100_1N8G": [
        *_COMMON, "--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
        "2", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--deterministic-mode",
        "--no-gradient-accumulation-fusion", "--use-mcore-models", "--ckpt-format", "torch_dist",
        "--dist-ckpt-strictness", "log_all", "--data-cache-path", "/tmp/cache", "--fp16",
        "--apply-query-key-layer-scaling", "--log-memory-to-tensorboard"],
    "gpt3_345m_nightly_dgx_a100_1N8G_mcore_tp1_pp1_dist_optimizer_overlap_grad_reduce_param_gather": [
        *_COMMON, "--transformer-impl", "local", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
        "1", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--deterministic-mode",
        "--no-gradient-accumulation-fusion", "--use-mcore-models", "--ckpt-format", "torch_dist",
        "--dist-ckpt-strictness", "log_all", "--data-cache-path", "/tmp/cache", "--bf16",
        "--apply-query-key-layer-scaling", "--log-memory-to-tensorboard"],
    "gpt3_mr_mcore_te_tp2_pp2_dgx_a100_1N8G": [
        *_COMMON, "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--deterministic-mode", "--no-gradient-accumulation-fusion",
        "--attention-softmax-in-fp32", "--use-mcore-models", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness",
        "log_all", "--data-cache-path", "/tmp/cache", "--bf16", "--attention-backend", "unfused",
        "--log-memory-to-tensorboard"],
}


@pytest.mark.parametrize("name", sorted(MEGATRON_CONFIGS))
def test_megatron_gpt_test_configurations_parse(name, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # the recipes' one node of 8 GPUs
    monkeypatch.setenv("RANK", "0")
    args = parse_args(args=MEGATRON_CONFIGS[name])
    assert args.deterministic_mode and args.dist_ckpt_strictness == "log_all"
    if args.transformer_impl == "local":
        validate_args(args)
        assert args.data_parallel_size == 8 // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    else:  # parses; this project has no Transformer Engine layers, which validate_args says
        with pytest.raises(ValueError, match="--transformer-impl transformer_engine is not available"):
            validate_args(args)
