"""Tests of the training command line: Megatron's flag names/defaults, validation errors, args -> config."""
import dataclasses
import signal
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

from megatron.training.arguments import (
    _print_args,
    core_transformer_config_from_args,
    parse_args,
    validate_args,
)

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3"]


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch):
    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def _parse(*extra, world_size=None, monkeypatch=None):
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return parse_args(args=[*MODEL, *TRAIN, *extra])


def _valid(*extra, world_size=None, monkeypatch=None, defaults=None):
    return validate_args(_parse(*extra, world_size=world_size, monkeypatch=monkeypatch), defaults or {})


# ---------------------------------------------------------------------------------------------------
# Parsing: names, dests, defaults
# ---------------------------------------------------------------------------------------------------

EXPECTED_DEFAULTS = {
    # network size (spec §7.1)
    "num_layers": None, "hidden_size": None, "num_attention_heads": None, "max_position_embeddings": None,
    "ffn_hidden_size": None, "kv_channels": None, "group_query_attention": False, "num_query_groups": 1,
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "apply_layernorm_1p": False,
    "position_embedding_type": "learned_absolute", "rotary_percent": 1.0, "rotary_base": 10000,
    "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False,
    "rope_scaling_factor": 8.0, "swiglu": False, "untie_embeddings_and_output_weights": False,
    "apply_residual_connection_post_layernorm": False, "qk_layernorm": False, "add_bias_linear": True,
    "add_qkv_bias": False, "make_vocab_size_divisible_by": 128, "attention_backend": "auto",
    "masked_softmax_fusion": True, "transformer_impl": "local", "seq_length": None,
    # regularization
    "weight_decay": 0.01, "start_weight_decay": None, "end_weight_decay": None,
    "weight_decay_incr_style": "constant", "clip_grad": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
    "adam_eps": 1e-8, "sgd_momentum": 0.9, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    # training
    "micro_batch_size": None, "global_batch_size": None, "train_iters": None, "train_samples": None,
    "exit_interval": None, "exit_duration_in_mins": None, "exit_signal_handler": False,
    "exit_signal": "SIGTERM", "optimizer": "adam", "dataloader_type": None,
    "check_for_nan_in_loss_and_grad": True, "calculate_per_token_loss": False,
    "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
    "manual_gc": False, "empty_unused_memory_level": 0, "gradient_accumulation_fusion": True,
    # initialization
    "seed": 1234, "data_parallel_random_init": False, "init_method_std": 0.02,
    "init_method_xavier_uniform": False, "use_cpu_initialization": False, "perform_initialization": True,
    # learning rate (spec §6.6)
    "lr": None, "min_lr": 0.0, "lr_decay_style": "linear", "lr_decay_iters": None, "lr_decay_samples": None,
    "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0, "lr_warmup_init": 0.0,
    "lr_wsd_decay_style": "exponential", "lr_wsd_decay_iters": None, "lr_wsd_decay_samples": None,
    "decoupled_lr": None, "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
    # checkpointing
    "save": None, "save_interval": None, "no_save_optim": None, "no_save_rng": None, "load": None,
    "no_load_optim": None, "no_load_rng": None, "finetune": False, "ckpt_format": "torch_dist", "ckpt_step": None,
    "async_save": None, "pretrained_checkpoint": None, "save_retain_interval": None,
    "non_persistent_save_interval": None, "exit_on_missing_checkpoint": False,
    # mixed precision (spec §6.3)
    "fp16": False, "bf16": False, "loss_scale": None, "initial_loss_scale": 4294967296, "min_loss_scale": 1.0,
    "loss_scale_window": 1000, "hysteresis": 2, "fp32_residual_connection": False,
    "attention_softmax_in_fp32": False, "accumulate_allreduce_grads_in_fp32": False,
    "grad_reduce_in_bf16": False, "fp16_lm_cross_entropy": False,
    # distributed
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
    "expert_model_parallel_size": 1, "sequence_parallel": False, "distributed_timeout_minutes": 10,
    "use_distributed_optimizer": False, "overlap_grad_reduce": False, "overlap_param_gather": False,
    "ddp_bucket_size": None, "ddp_average_in_collective": False, "local_rank": 0,
    "num_layers_per_virtual_pipeline_stage": None, "use_tp_pp_dp_mapping": False,
    # validation
    "eval_iters": 100, "eval_interval": 1000, "skip_train": False, "eval_global_batch_size": None,
    "eval_micro_batch_size": None,
    # data
    "data_path": None, "split": None, "train_data_path": None, "data_cache_path": None, "mock_data": False,
    "num_workers": 2, "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
    "create_attention_mask_in_dataloader": True, "mmap_bin_files": True, "mid_level_dataset_surplus": 0.005,
    "num_dataset_builder_threads": 1, "tokenizer_type": None, "vocab_file": None,
    # logging (spec §8.4/§8.5)
    "log_interval": 100, "log_throughput": False, "log_params_norm": False, "timing_log_level": 0,
    "timing_log_option": "minmax", "tensorboard_dir": None, "tensorboard_log_interval": 1,
    "tensorboard_queue_size": 1000, "log_timers_to_tensorboard": False, "log_loss_scale_to_tensorboard": True,
    "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False,
    "log_world_size_to_tensorboard": False, "log_progress": False, "log_energy": False,
    "wandb_project": "",
    # opentelemetry (observability.md §1)
    "otel_enabled": False, "otel_service_name": None, "otel_span_groups": None,
}


def test_parse_defaults_match_megatron():
    args = parse_args(args=[])
    mismatched = {name: (getattr(args, name, "<missing>"), want) for name, want in EXPECTED_DEFAULTS.items()
                  if getattr(args, name, "<missing>") != want}
    assert mismatched == {}
    assert args.rank == 0 and args.world_size == 1
    assert args.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.parametrize("flag,dest,value", [
    ("--disable-bias-linear", "add_bias_linear", False),
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", False),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    ("--no-rope-fusion", "apply_rope_fusion", False),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--no-check-for-nan-in-loss-and-grad", "check_for_nan_in_loss_and_grad", False),
    ("--no-initialization", "perform_initialization", False),
    ("--no-create-attention-mask-in-dataloader", "create_attention_mask_in_dataloader", False),
    ("--no-mmap-bin-files", "mmap_bin_files", False),
    ("--no-log-loss-scale-to-tensorboard", "log_loss_scale_to_tensorboard", False),
    ("--no-load-optim", "no_load_optim", True),
    ("--no-load-rng", "no_load_rng", True),
    ("--no-save-optim", "no_save_optim", True),
    ("--no-save-rng", "no_save_rng", True),
    ("--no-persist-layer-norm", "no_persist_layer_norm", True),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", True),
    ("--otel-enabled", "otel_enabled", True),
])
def test_boolean_flags_use_megatron_dests(flag, dest, value):
    assert getattr(parse_args(args=[flag]), dest) is value


def test_valued_flags_and_alias():
    args = parse_args(args=["--persistent-save-interval", "7", "--norm-epsilon", "1e-6", "--exit-signal", "SIGUSR1",
                            "--otel-service-name", "svc", "--otel-span-groups", "default,-data",
                            "--data-path", "0.3", "a", "0.7", "b", "--ckpt-format", "torch_dist"])
    assert args.save_interval == 7 and args.norm_epsilon == 1e-6 and args.exit_signal == "SIGUSR1"
    assert args.otel_service_name == "svc" and args.otel_span_groups == "default,-data"
    assert args.data_path == ["0.3", "a", "0.7", "b"] and args.ckpt_format == "torch_dist"


def test_bad_choice_and_unknown_flag_exit():
    with pytest.raises(SystemExit):
        parse_args(args=["--transformer-impl", "apex"])
    with pytest.raises(SystemExit):
        parse_args(args=["--not-a-flag"])
    assert parse_args(ignore_unknown_args=True, args=["--not-a-flag", "--seed", "5"]).seed == 5


def test_extra_args_provider():
    def provider(parser):
        parser.add_argument_group(title="mine").add_argument("--my-flag", type=int, default=3)
        return parser

    assert parse_args(provider, args=["--my-flag", "9"]).my_flag == 9


def test_rank_world_size_from_torchrun_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    args = parse_args(args=[])
    assert (args.rank, args.world_size, args.local_rank) == (3, 8, 1)


def test_rank_world_size_from_slurm_env(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    args = parse_args(args=[])
    assert (args.rank, args.world_size, args.local_rank) == (5, 16, 2)
    assert parse_args(args=["--local-rank", "0"]).local_rank == 0


def test_bad_rank_env_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero'"):
        parse_args(args=[])


# ---------------------------------------------------------------------------------------------------
# Validation: derived values
# ---------------------------------------------------------------------------------------------------

def test_validate_derives_megatron_values(monkeypatch, capsys):
    args = _valid("--data-path", "prefix", world_size=4, monkeypatch=monkeypatch)
    assert args.data_parallel_size == 4
    assert args.global_batch_size == args.micro_batch_size * args.data_parallel_size
    assert args.ffn_hidden_size == 4 * args.hidden_size
    assert args.kv_channels == args.hidden_size // args.num_attention_heads
    assert args.params_dtype == torch.float32
    assert args.split == "969, 30, 1"
    assert 'Please specify --split when using --data-path' in capsys.readouterr().out
    assert args.eval_micro_batch_size == args.micro_batch_size
    assert args.eval_global_batch_size == args.global_batch_size
    assert args.exit_signal is signal.SIGTERM and isinstance(args.exit_signal, signal.Signals)
    # The run counters belong to the training loop's TrainingState, not to args.
    assert not any(hasattr(args, name) for name in ("consumed_train_samples", "consumed_valid_samples", "iteration"))
    assert args.variable_seq_lengths is False
    assert args.dataloader_type == "single"
    assert args.start_weight_decay == args.end_weight_decay == args.weight_decay
    assert args.add_qkv_bias is True  # forced by the default bias on linear layers
    assert args.use_dist_ckpt is True  # Megatron: --ckpt-format other than torch (the default torch_dist)


@pytest.mark.parametrize("hidden", [64, 768, 4096, 5120])
def test_swiglu_ffn_size_and_activation(hidden):
    args = validate_args(parse_args(args=["--num-layers", "2", "--hidden-size", str(hidden),
                                          "--num-attention-heads", "4", "--seq-length", "32",
                                          "--max-position-embeddings", "32", *TRAIN, "--swiglu"]))
    # Reference: 2/3 of 4h, rounded down to a multiple of 64, computed in exact integer arithmetic.
    assert args.ffn_hidden_size == (8 * hidden // 3) // 64 * 64
    assert args.gated_linear_unit is True and args.activation_func is F.silu


def test_precision_dtypes_and_side_effects(capsys):
    fp16 = _valid("--fp16")
    assert fp16.params_dtype == torch.float16 and fp16.check_for_nan_in_loss_and_grad is False
    fp16_const = _valid("--fp16", "--loss-scale", "128")
    assert fp16_const.check_for_nan_in_loss_and_grad is True
    bf16 = _valid("--bf16")
    assert bf16.params_dtype == torch.bfloat16 and bf16.accumulate_allreduce_grads_in_fp32 is True
    assert _valid("--bf16", "--grad-reduce-in-bf16").accumulate_allreduce_grads_in_fp32 is False


def test_position_embedding_types():
    rope = validate_args(parse_args(args=["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                          "--seq-length", "48", "--position-embedding-type", "rope", *TRAIN]))
    assert rope.max_position_embeddings == 48
    assert _valid("--use-rotary-position-embeddings").position_embedding_type == "rope"
    none = validate_args(parse_args(args=["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                          "--seq-length", "48", "--position-embedding-type", "none", *TRAIN]))
    assert none.max_position_embeddings == 48


def test_sequence_parallel_dropped_with_tp1():
    with pytest.warns(UserWarning, match="Disabling sequence parallelism"):
        args = _valid("--sequence-parallel")
    assert args.sequence_parallel is False


def test_sequence_parallel_kept_with_tp2(monkeypatch):
    args = _valid("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2, monkeypatch=monkeypatch)
    assert args.sequence_parallel is True and args.data_parallel_size == 1


def test_defaults_dict_fills_only_unset_flags(capsys):
    args = _valid("--seed", "7", defaults={"seed": 99, "tokenizer_type": "NullTokenizer"})
    assert args.seed == 7 and args.tokenizer_type == "NullTokenizer"
    assert "overriding default arguments for seed:99 with seed:7" in capsys.readouterr().out


def test_sample_based_and_skip_train():
    args = validate_args(parse_args(args=[*MODEL, "--micro-batch-size", "2", "--train-samples", "100",
                                          "--lr-decay-samples", "80", "--lr-warmup-samples", "10", "--lr", "1"]))
    assert args.train_iters is None and args.train_samples == 100
    evaluation_only = validate_args(parse_args(args=[*MODEL, "--micro-batch-size", "2", "--train-iters", "1",
                                                     "--skip-train"]))
    assert evaluation_only.lr is None


def test_print_args_megatron_layout(capsys):
    import argparse

    _print_args("arguments", argparse.Namespace(rank=0, b_flag=2, A_flag="x"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "------------------------ arguments ------------------------"
    assert lines[1] == "  A_flag " + "." * (48 - len("A_flag")) + " x"
    assert lines[2].startswith("  b_flag ....") and lines[2].endswith(" 2")
    assert lines[-1] == "-------------------- end of arguments ---------------------"
    _print_args("arguments", argparse.Namespace(rank=1, b_flag=2))
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------------
# Validation: each error
# ---------------------------------------------------------------------------------------------------

def _drop(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


@pytest.mark.parametrize("argv,world_size,message", [
    (_drop(MODEL, "--num-layers") + TRAIN, 1, "missing required flag: --num-layers"),
    (_drop(MODEL, "--hidden-size") + TRAIN, 1, "missing required flag: --hidden-size"),
    (_drop(MODEL, "--num-attention-heads") + TRAIN, 1, "missing required flag: --num-attention-heads"),
    (_drop(MODEL, "--max-position-embeddings") + TRAIN, 1, "missing required flag: --max-position-embeddings"),
    (_drop(MODEL, "--seq-length") + TRAIN, 1, "missing required flag: --seq-length"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "2"], 3,
     r"world size \(3\) is not divisible by total_model_size \(2\)"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "4"], 6,
     r"world size \(6\) is not divisible by total_model_size \(4\)"),
    (MODEL + TRAIN + ["--global-batch-size", "6"], 4,
     r"global batch size \(6\) is not divisible by micro batch size \(2\) times data parallel size \(4\)"),
    (MODEL + TRAIN + ["--eval-global-batch-size", "3"], 1,
     r"eval global batch size \(3\) is not divisible by eval micro batch size \(2\)"),
    (_drop(TRAIN, "--micro-batch-size") + MODEL, 1, "missing required flag: --micro-batch-size"),
    (_drop(TRAIN, "--train-iters") + MODEL, 1, r"missing required flag: --train-iters \(or --train-samples\)"),
    (MODEL + TRAIN + ["--train-samples", "5"], 1, "exactly one of --train-iters and --train-samples"),
    (_drop(TRAIN, "--lr") + MODEL, 1, "missing required flag: --lr"),
    (MODEL + TRAIN + ["--lr-warmup-iters", "20"], 1,
     r"--lr-warmup-iters \(20\) must be smaller than --lr-decay-iters \(10; it defaults to --train-iters\)"),
    (_drop(TRAIN, "--train-iters") + MODEL + ["--train-samples", "64", "--lr-warmup-samples", "64"], 1,
     r"--lr-warmup-samples \(64\) must be smaller than --lr-decay-samples \(64; it defaults to --train-samples\)"),
    (MODEL + TRAIN + ["--min-lr", "0.5"], 1, r"--min-lr \(0.5\) must be <= --lr \(0.001\)"),
    (MODEL + TRAIN + ["--lr-decay-samples", "5"], 1, "--lr-decay-samples needs sample-based training"),
    (MODEL + TRAIN + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], 1,
     "only specify one of --lr-warmup-fraction and --lr-warmup-iters"),
    (_drop(MODEL, "--max-position-embeddings") + TRAIN + ["--max-position-embeddings", "16"], 1,
     r"--max-position-embeddings \(16\) must be greater than or equal to --seq-length \(32\)"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "3"], 3,
     r"num_attention_heads \(4\) must be a multiple of tensor_model_parallel_size \(3\)"),
    (MODEL + TRAIN + ["--group-query-attention", "--num-query-groups", "3"], 1,
     r"--num-attention-heads \(4\) is not divisible by --num-query-groups \(3\)"),
    (MODEL + TRAIN + ["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
     r"--num-query-groups \(1\) is not divisible by --tensor-model-parallel-size \(2\)"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "4"], 2,
     r"--tensor-model-parallel-size \(4\) is larger than the world size \(2"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"], 2,
     r"--ffn-hidden-size \(33\) is not divisible by --tensor-model-parallel-size \(2\)"),
    (_drop(MODEL, "--seq-length") + TRAIN + ["--seq-length", "30", "--tensor-model-parallel-size", "4",
                                             "--sequence-parallel"], 4,
     r"--seq-length \(30\) is not divisible by --tensor-model-parallel-size \(4\), which --sequence-parallel"),
    (MODEL + TRAIN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
                      "--recompute-method", "uniform", "--distribute-saved-activations"], 2,
     "--distribute-saved-activations cannot be combined with --sequence-parallel"),
    (_drop(MODEL, "--hidden-size") + TRAIN + ["--hidden-size", "66"], 1,
     r"--hidden-size \(66\) is not divisible by --num-attention-heads \(4\)"),
    (MODEL + TRAIN + ["--fp16", "--bf16"], 1, "--fp16 and --bf16 are mutually exclusive"),
    (MODEL + TRAIN + ["--save", "/tmp/x"], 1, "--save requires --save-interval"),
    (MODEL + TRAIN + ["--data-path", "p", "--mock-data"], 1, "a single data source must be given, got --data-path "
                                                             "and --mock-data"),
    (MODEL + TRAIN + ["--mock-data", "--train-data-path", "p"], 1, "a single data source"),
    (MODEL + TRAIN + ["--overlap-param-gather", "--overlap-grad-reduce"], 1,
     "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (MODEL + TRAIN + ["--use-distributed-optimizer", "--optimizer", "sgd"], 1,
     "--use-distributed-optimizer supports --optimizer adam only"),
    (MODEL + TRAIN + ["--ckpt-format", "torch_dcp"], 1, "--ckpt-format torch_dcp is not available in this version"),
    (MODEL + TRAIN + ["--transformer-impl", "transformer_engine"], 1, "use --transformer-impl local"),
    (MODEL + TRAIN + ["--exit-signal", "SIGNOPE"], 1, "--exit-signal 'SIGNOPE' is not a signal name"),
    (MODEL + TRAIN + ["--fp32-residual-connection"], 1, "--fp32-residual-connection needs --fp16 or --bf16"),
    (MODEL + TRAIN + ["--swiglu", "--squared-relu"], 1, "--swiglu and --squared-relu are mutually exclusive"),
    (MODEL + TRAIN + ["--weight-decay-incr-style", "linear"], 1, "needs --start-weight-decay and --end-weight-decay"),
    # (--optimizer lion is refused by parse_args: tests/test_megatron_flags.py)
    (MODEL + TRAIN + ["--async-save", "--ckpt-format", "torch"], 1,
     r"--async-save needs --ckpt-format torch_dist \(got --ckpt-format torch\)"),
    (MODEL + TRAIN + ["--recompute-activations", "--recompute-method", "uniform"], 1,
     "--recompute-method is not supported with --recompute-granularity selective"),
])
def test_validation_errors_name_the_flags(monkeypatch, argv, world_size, message):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse_args(args=argv)
    with pytest.raises(ValueError, match=message):
        validate_args(args)


# ---------------------------------------------------------------------------------------------------
# args -> TransformerConfig
# ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _StandInConfig:
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    persist_layer_norm: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    add_bias_linear: bool = True
    params_dtype: torch.dtype = torch.float32
    pipeline_dtype: Optional[torch.dtype] = None
    deallocate_pipeline_outputs: bool = False
    batch_p2p_comm: bool = False
    init_method: Optional[Callable] = None
    rotary_interleaved: bool = False
    tensor_model_parallel_size: int = 1


def test_config_from_args_copies_fields_and_special_cases():
    args = _valid("--swiglu", "--bf16", "--apply-layernorm-1p", "--norm-epsilon", "1e-6", "--group-query-attention",
                  "--num-query-groups", "2", "--disable-bias-linear", "--init-method-xavier-uniform",
                  "--hidden-dropout", "0.25", "--rotary-interleaved")
    config = core_transformer_config_from_args(args, config_class=_StandInConfig)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert config.ffn_hidden_size == args.ffn_hidden_size and config.kv_channels == 16
    assert config.hidden_dropout == 0.25 and config.layernorm_epsilon == 1e-6
    assert config.layernorm_zero_centered_gamma is True and config.persist_layer_norm is True
    assert config.gated_linear_unit is True and config.activation_func is F.silu
    assert config.add_bias_linear is False and config.num_query_groups == 2
    assert config.params_dtype == config.pipeline_dtype == torch.bfloat16
    assert config.deallocate_pipeline_outputs is True and config.batch_p2p_comm is True
    assert config.init_method is torch.nn.init.xavier_uniform_ and config.rotary_interleaved is True


def test_config_activation_variants_match_reference():
    x = torch.linspace(-3, 3, 13)
    relu2 = core_transformer_config_from_args(_valid("--squared-relu"), config_class=_StandInConfig)
    assert torch.equal(relu2.activation_func(x), torch.clamp(x, min=0) * torch.clamp(x, min=0))
    tanh_gelu = core_transformer_config_from_args(_valid("--openai-gelu"), config_class=_StandInConfig)
    reference = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    torch.testing.assert_close(tanh_gelu.activation_func(x), reference)
    plain = core_transformer_config_from_args(_valid(), config_class=_StandInConfig)
    assert plain.num_query_groups is None and plain.activation_func is F.gelu


def test_config_from_args_real_transformer_config():
    args = _valid("--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm")
    config = core_transformer_config_from_args(args)
    assert config.num_query_groups == 2 and config.normalization == "RMSNorm"
    assert config.ffn_hidden_size == 256 and config.params_dtype == torch.float32
    assert config.batch_p2p_comm is True and config.overlap_p2p_comm is False


def test_config_class_must_be_dataclass():
    with pytest.raises(TypeError, match="not a dataclass"):
        core_transformer_config_from_args(_valid(), config_class=dict)


def test_help_text_renders(capsys):
    """Every flag's help string formats (argparse treats a lone % as a format code)."""
    import pytest as _pytest

    with _pytest.raises(SystemExit) as exit_info:
        parse_args(args=["--help"])
    assert exit_info.value.code == 0
    assert "--micro-batch-size" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--full-validation"], ["--log-progress"], ["--log-energy"],
                                  ["--pretrained-checkpoint", "x"]])
def test_flags_without_behaviour_yet_are_refused_not_ignored(flag):
    with pytest.raises(ValueError, match="not available in this version"):
        validate_args(_parse(*flag))


SAMPLES = ["--micro-batch-size", "2", "--train-samples", "64", "--lr", "1e-3"]


def test_rampup_batch_size_validated_and_parsed():
    args = validate_args(parse_args(args=[*MODEL, *SAMPLES, "--global-batch-size", "12",
                                          "--rampup-batch-size", "4", "4", "24"]))
    assert args.rampup_batch_size == [4, 4, 24]


@pytest.mark.parametrize("extra,world_size,message", [
    (["--rampup-batch-size", "4", "4"], 1, "expected --rampup-batch-size <start batch size> <batch size increment>"),
    (["--rampup-batch-size", "4", "4", "x"], 1, "as integers"),
    (["--rampup-batch-size", "2", "2", "24"], 2,
     r"--rampup-batch-size: global batch size \(2\) is not divisible by micro batch size \(2\) times data parallel "
     r"size \(2\)"),
    (["--rampup-batch-size", "16", "4", "24"], 1, r"start batch size \(16\) must not exceed the global batch size"),
])
def test_rampup_batch_size_errors_at_start_up(monkeypatch, extra, world_size, message):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(args=[*MODEL, *SAMPLES, "--global-batch-size", "12", *extra]))
    with pytest.raises(ValueError, match="--rampup-batch-size needs sample-based training"):
        validate_args(parse_args(args=[*MODEL, *TRAIN, "--global-batch-size", "12",
                                       "--rampup-batch-size", "4", "4", "24"]))


# ---------------------------------------------------------------------------------------------------
# Pipeline parallelism: split of the layers, virtual stages, interleaving's microbatch constraint
# ---------------------------------------------------------------------------------------------------

def _pp(*extra, layers="4", world_size=2, monkeypatch=None):
    argv = _drop(MODEL, "--num-layers") + TRAIN + ["--num-layers", layers, *extra]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return validate_args(parse_args(args=argv))


@pytest.mark.parametrize("extra,layers,world,vp", [
    (["--pipeline-model-parallel-size", "2"], "4", 2, None),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "4"], "4", 2, 2),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "8"], "4", 2, 2),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "1"], "4", 2, None),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"], "3", 2, None),
    (["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"], "6", 4, None),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split",
      "--account-for-loss-in-pipeline-split"], "4", 2, None),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"], "3", 2, None),
])
def test_pipeline_splits_that_add_up_are_accepted(monkeypatch, extra, layers, world, vp):
    args = _pp(*extra, layers=layers, world_size=world, monkeypatch=monkeypatch)
    assert args.virtual_pipeline_model_parallel_size == vp
    assert args.data_parallel_size == 1
    config = core_transformer_config_from_args(args)
    assert config.virtual_pipeline_model_parallel_size == vp
    assert config.num_layers_in_first_pipeline_stage == args.decoder_first_pipeline_num_layers
    assert config.account_for_loss_in_pipeline_split == args.account_for_loss_in_pipeline_split
    assert config.batch_p2p_comm is (vp is None or not args.overlap_p2p_comm)


@pytest.mark.parametrize("extra,layers,world,message", [
    (["--pipeline-model-parallel-size", "2"], "3", 2,
     r"--num-layers 3, --pipeline-model-parallel-size 2.*num_layers \(3\) must be divisible by "
     r"pipeline_model_parallel_size \(2\)"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"], "3", 2,
     r"--decoder-first-pipeline-num-layers 1.*= 2 must equal num_layers \(3\)"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "2"], "5", 3,
     r"the 3 layers left for the 2 middle pipeline stage\(s\).*not divisible by 2"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
      "--decoder-last-pipeline-num-layers", "3"], "4", 2, r"= 6 exceeds num_layers \(4\)"),
    (["--pipeline-model-parallel-size", "2", "--account-for-embedding-in-pipeline-split"], "4", 2,
     r"embedding \(1\) \+ loss \(0\) = 5 must be divisible by pipeline_model_parallel_size \(2\)"),
    (["--pipeline-model-parallel-size", "2", "--account-for-loss-in-pipeline-split",
      "--decoder-last-pipeline-num-layers", "1"], "3", 2,
     "--account-for-loss-in-pipeline-split cannot be combined with --decoder-first-pipeline-num-layers"),
    (["--decoder-first-pipeline-num-layers", "1"], "4", 1,
     r"--decoder-first-pipeline-num-layers needs pipeline parallelism \(--pipeline-model-parallel-size > 1, got 1\)"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "4", 1,
     "--num-virtual-stages-per-pipeline-rank needs pipeline parallelism"),
    (["--account-for-embedding-in-pipeline-split"], "4", 1,
     "--account-for-embedding-in-pipeline-split needs pipeline parallelism"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-virtual-stages-per-pipeline-rank", "2"], "4", 2, "only one of --num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], "4", 2,
     r"layers per pipeline stage \(2 = --num-layers 4 / --pipeline-model-parallel-size 2\) must be divisible by "
     r"--num-layers-per-virtual-pipeline-stage \(3\)"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"], "4", 2,
     r"pipeline stage 0 has 2 layers, which is not divisible by virtual_pipeline_model_parallel_size \(3\)"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "1"], "3", 2,
     r"pipeline stage 0 has 1 layers, which is not divisible by virtual_pipeline_model_parallel_size \(2\)"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "6"], "4", 2,
     r"number of microbatches \(3 = --global-batch-size 6 / \(micro batch size 2 x data-parallel size 1\)\) "
     r"is not divisible by --pipeline-model-parallel-size \(2\) when using the interleaved schedule"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "8", "--eval-global-batch-size", "2"], "4", 2,
     r"number of microbatches \(1 = --eval-global-batch-size 2"),
    (["--pipeline-model-parallel-size", "4", "--reset-attention-mask"], "4", 4,
     "--reset-attention-mask needs every pipeline block to read the batch"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "8", "--no-overlap-p2p-communication"], "4", 2,
     "greater than 2 with the interleaved schedule and --no-overlap-p2p-communication"),
])
def test_pipeline_splits_that_do_not_add_up_are_refused_with_the_numbers(monkeypatch, extra, layers, world, message):
    with pytest.raises(ValueError, match=message):
        _pp(*extra, layers=layers, world_size=world, monkeypatch=monkeypatch)


# ---------------------------------------------------------------------------------------------------
# Megatron-LM command-line compatibility (issue 23)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling, dest", [
    ("--override-opt_param-scheduler", "override_opt_param_scheduler"),
    ("--use-checkpoint-opt_param-scheduler", "use_checkpoint_opt_param_scheduler"),
])
def test_core_v0_14_scheduler_spellings_set_the_same_flag(spelling, dest):
    dashed = spelling.replace("opt_param", "opt-param")
    assert getattr(_parse(spelling), dest) is True and getattr(_parse(dashed), dest) is True
    assert getattr(_parse(), dest) is False


def test_core_v0_14_barrier_spelling():
    assert _parse().barrier_with_L1_time is True
    assert _parse("--no-barrier-with-level-1-timing").barrier_with_L1_time is False
    assert _parse("--no-barrier-with-L1-time").barrier_with_L1_time is False


def test_eval_interval_defaults_to_megatrons_1000():
    assert _valid(*MODEL, *TRAIN).eval_interval == 1000


def test_pretrain_gpt_defaults_the_tokenizer_to_gpt2_bpe():
    """As Megatron-LM's pretrain_gpt.py: args_defaults={'tokenizer_type': 'GPT2BPETokenizer'} (the script itself
    is checked end to end by tests/test_user_errors.py::test_bare_pretrain_gpt_lists_every_missing_required_flag)."""
    assert _valid(*MODEL, *TRAIN, defaults={"tokenizer_type": "GPT2BPETokenizer"}).tokenizer_type == "GPT2BPETokenizer"
    given = _valid(*MODEL, *TRAIN, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                   defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert given.tokenizer_type == "NullTokenizer"
