"""Mixture-of-experts flags: Megatron-LM core_v0.14's names and defaults, their TransformerConfig fields, the
validate_args rules (spec section 3.2), the flags refused by name, and Megatron's Mixtral example command line."""
import os
import subprocess
from pathlib import Path

import pytest

from megatron.training.argument_groups import moe_freq_type
from megatron.training.arguments import parse_args, validate_args
from megatron.training.argument_utils import core_transformer_config_from_args

MIRROR = Path(os.environ.get("MEGATRON_LM_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo"))
SMALL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
         "--disable-bias-linear"]

# The pretrain_gpt.py argv of Megatron-LM core_v0.14.0's examples/mixtral/train_mixtral_8x7b_distributed.sh, as
# the script builds it (MODEL_ARGS, MOE_ARGS, DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS; WANDB_API_KEY
# unset) when run as `train_mixtral_8x7b_distributed.sh /ckpt /tok/tokenizer.model /data/mixtral_text_document`.
# Recorded here so the test needs no Megatron-LM checkout; test_recorded_mixtral_argv_is_the_scripts checks it
# against the script when the mirror is present.
MIXTRAL_8X7B_ARGV = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "32768",
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding",
    "--rotary-base", "1000000",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
    "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/tok/tokenizer.model", "--data-path",
    "/data/mixtral_text_document", "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
    "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
    "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--save",
    "/ckpt", "--load", "/ckpt", "--tensorboard-dir", "/ckpt/tensorboard", "--no-load-optim", "--no-load-rng",
]


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID",
                 "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)


def _validated(argv, world_size=1, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=[str(a) for a in argv]))


# ------------------------------------------------------------------------------------------- Megatron's Mixtral

def test_mixtral_8x7b_example_parses_and_validates_unchanged(monkeypatch):
    """64 ranks (8 nodes of 8): PP 4 x EP 8 expert groups need world % 32 == 0 (one node of 8 fails in Megatron too)."""
    args = _validated(MIXTRAL_8X7B_ARGV, 64, monkeypatch)
    assert (args.num_experts, args.moe_router_topk, args.moe_aux_loss_coeff) == (8, 2, 0.01)
    assert args.moe_router_load_balancing_type == "aux_loss"  # a one-element list becomes its value (Megatron)
    assert args.moe_token_dispatcher_type == "alltoall" and args.moe_grouped_gemm
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (8, 1)
    assert args.moe_ffn_hidden_size == 14336 and args.data_parallel_size == 16
    config = core_transformer_config_from_args(args)
    assert (config.num_moe_experts, config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (8, 8, 1)
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm
    assert all(config.is_moe_layer(n) for n in range(1, 33))


def test_mixtral_example_on_one_node_is_refused_naming_the_expert_sizes(monkeypatch):
    with pytest.raises(ValueError, match=r"world size \(8\) is not divisible by --expert-tensor-parallel-size \(1\) x "
                                         r"--expert-model-parallel-size \(8\) x --pipeline-model-parallel-size \(4\)"):
        _validated(MIXTRAL_8X7B_ARGV, 8, monkeypatch)


def test_recorded_mixtral_argv_is_the_scripts(tmp_path):
    """The recorded argv is what the script at core_v0.14.0 launches (stub torchrun records it)."""
    if not (MIRROR / "HEAD").exists():
        pytest.skip(f"no Megatron-LM mirror at {MIRROR} (set MEGATRON_LM_MIRROR); the recorded argv is used as is")
    script = subprocess.run(["git", "-C", str(MIRROR), "show",
                             "core_v0.14.0:examples/mixtral/train_mixtral_8x7b_distributed.sh"],
                            capture_output=True, text=True, check=True).stdout
    (tmp_path / "bin").mkdir()
    stub = tmp_path / "bin" / "torchrun"
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGV_LOG"\n')
    stub.chmod(0o755)
    (tmp_path / "run.sh").write_text(script)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "ARGV_LOG": str(tmp_path / "argv")}
    subprocess.run(["bash", str(tmp_path / "run.sh"), "/ckpt", "/tok/tokenizer.model", "/data/mixtral_text_document"],
                   env=env, check=True, cwd=tmp_path)
    words = (tmp_path / "argv").read_text().splitlines()
    assert words[words.index("pretrain_gpt.py") + 1:] == MIXTRAL_8X7B_ARGV


# ------------------------------------------------------------------------------------------- flags -> config

def test_defaults_are_megatrons():
    args = parse_args(args=SMALL)
    assert args.num_experts is None and args.moe_layer_freq == 1 and args.moe_router_topk == 2
    assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.0
    assert args.moe_token_dispatcher_type == "allgather" and args.moe_router_score_function == "softmax"
    assert args.moe_router_bias_update_rate == 1e-3 and args.moe_token_drop_policy == "probs"
    assert args.expert_model_parallel_size == 1 and args.expert_tensor_parallel_size is None
    for dest in ("moe_ffn_hidden_size", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_expert_capacity_factor",
                 "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor", "moe_router_num_groups",
                 "moe_router_group_topk", "moe_router_dtype"):
        assert getattr(args, dest) is None, dest


def test_every_moe_flag_reaches_its_transformer_config_field(monkeypatch):
    argv = [*SMALL, "--num-experts", "8", "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "[1,0,1,1]",
            "--moe-router-topk", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
            "--moe-aux-loss-coeff", "1e-2", "1e-3", "--moe-z-loss-coeff", "1e-3", "--moe-input-jitter-eps", "0.01",
            "--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor", "1.5",
            "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position",
            "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-overlap", "--moe-grouped-gemm",
            "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "4",
            "--moe-router-group-topk", "2", "--moe-router-dtype", "fp32", "--moe-per-layer-logging",
            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    config = core_transformer_config_from_args(_validated(argv, 2, monkeypatch))
    assert config.num_moe_experts == 8 and config.moe_ffn_hidden_size == 24 and config.moe_layer_freq == [1, 0, 1, 1]
    assert [config.is_moe_layer(n) for n in range(1, 5)] == [True, False, True, True]
    assert config.moe_router_topk == 4
    assert config.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert config.moe_aux_loss_coeff == [1e-2, 1e-3] and config.moe_z_loss_coeff == 1e-3
    assert config.moe_input_jitter_eps == 0.01 and config.moe_token_dispatcher_type == "alltoall"
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_drop_policy == "position" and config.moe_shared_expert_intermediate_size == 16
    assert config.moe_shared_expert_overlap and config.moe_grouped_gemm
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_router_enable_expert_bias and config.moe_router_bias_update_rate == 0.01
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    assert config.moe_router_dtype == "fp32" and config.moe_per_layer_logging
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)


def test_derived_values(monkeypatch):
    args = _validated([*SMALL, "--num-experts", "0"], 1, monkeypatch)
    assert args.num_experts is None and args.expert_tensor_parallel_size == 1
    args = _validated([*SMALL, "--num-experts", "4", "--ffn-hidden-size", "48", "--moe-expert-capacity-factor", "-1",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, monkeypatch)
    assert args.moe_ffn_hidden_size == 48 and args.expert_tensor_parallel_size == 2
    assert core_transformer_config_from_args(args).moe_expert_capacity_factor is None  # negative: dropless


@pytest.mark.parametrize("text,expected", [
    ("2", 2), ("[1,0,1]", [1, 0, 1]), ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3), ("([0]+[1]*23)", [0] + [1] * 23),
    ("[1, 0,]", [1, 0]), ("([1]*3+[0]*2)*2", [1, 1, 1, 0, 0] * 2), ("2*[1,0]", [1, 0, 1, 0]),
])
def test_moe_layer_freq_patterns_as_megatron_evaluates_them(text, expected):
    assert moe_freq_type(text) == expected


@pytest.mark.parametrize("text", ["__import__('os')", "[1]*[2]", "[1]+2", "[1,", "1.5", "[1]*10**9", "[1]*99999999",
                                  "([1]*99999)*99999", "99999*[0]*99999"])
def test_moe_layer_freq_rejects_what_is_not_a_pattern(text, capsys):
    with pytest.raises(SystemExit):
        parse_args(args=[*SMALL, "--moe-layer-freq", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--moe-layer-freq" in err[0]


# ------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("extra,world,message", [
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     r"--num-experts \(3\) must be a multiple of --expert-model-parallel-size \(2\)"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--fp16"], 2,
     "--expert-model-parallel-size > 1 is not supported with --fp16"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2,
     r"world size \(2\) is not divisible by --expert-tensor-parallel-size \(1\) x --expert-model-parallel-size \(4\)"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--use-torch-fsdp2", "--ckpt-format", "torch_dist",
      "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"], 2,
     "--use-torch-fsdp2 is not supported with expert parallelism"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--ckpt-format",
      "torch"], 2, "--ckpt-format torch with --use-distributed-optimizer cannot save expert parameters"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], 1,
     "--moe-router-load-balancing-type sinkhorn is a Megatron-LM choice"),
    (["--num-experts", "4", "--moe-router-topk", "1"], 1, "Please use --moe-router-pre-softmax when topk is 1"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1, "only supports sigmoid score function"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], 1, "moe_expert_capacity_factor must be set"),
    (["--num-experts", "4", "--moe-router-group-topk", "2"], 1, "moe_router_num_groups must be specified"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "none"], 1,
     "moe_aux_loss_coeff needs one value per moe_router_load_balancing_type entry"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], 1, "--moe-ffn-hidden-size must be > 0, got 0"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "nan"], 1,
     "--moe-expert-capacity-factor must be a finite number, got nan"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"], 1,
     "--moe-expert-capacity-factor must be a finite number, got inf"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "0.1", "nan"], 1, "--moe-aux-loss-coeff must be a finite number, got nan"),
    (["--num-experts", "4", "--moe-z-loss-coeff", "nan"], 1, "--moe-z-loss-coeff must be a finite number"),
    (["--num-experts", "4", "--moe-router-topk-scaling-factor", "inf"], 1,
     "--moe-router-topk-scaling-factor must be a finite number"),
])
def test_validation_names_the_flags(extra, world, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        _validated([*SMALL, *extra], world, monkeypatch)


def test_add_bias_linear_is_refused_for_moe(monkeypatch):
    argv = [a for a in SMALL if a != "--disable-bias-linear"]
    with pytest.raises(ValueError, match="invalid mixture-of-experts flags: Bias is not supported for MoE"):
        _validated([*argv, "--num-experts", "4"], 1, monkeypatch)


def _refused_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args=argv)
    assert exit_info.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_flex_dispatcher_refused_in_one_line(capsys):
    assert _refused_line([*SMALL, "--num-experts", "4", "--moe-token-dispatcher-type", "flex"], capsys) == [
        "error: --moe-token-dispatcher-type flex is a Megatron-LM choice that this project does not support: the flex "
        "dispatcher needs DeepEP, which is not available; choose one of allgather, alltoall"]


@pytest.mark.parametrize("flag,reason", [
    ("--moe-use-legacy-grouped-gemm", "GroupedMLP"), ("--moe-router-padding-for-fp8", "FP8 needs Transformer Engine"),
    ("--moe-permute-fusion", "Transformer Engine"), ("--overlap-moe-expert-parallel-comm", "not available"),
    ("--moe-enable-deepep", "DeepEP"),
])
def test_unbuilt_moe_flags_refused_by_name(flag, reason, capsys):
    lines = _refused_line([*SMALL, "--num-experts", "4", flag], capsys)
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} is a Megatron-LM flag that this project does not "
                                                   "support: ") and reason in lines[0]
