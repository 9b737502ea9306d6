"""The training command line: parse Megatron-LM's flags (defined in argument_groups) and validate them across groups."""
import argparse
import difflib
import math
import os
import signal
import warnings

import torch
import torch.nn.functional as F

from megatron.core.console import write_line
from megatron.training.argument_groups import add_megatron_arguments
# core_transformer_config_from_args is re-exported: Megatron-LM callers import it from here (it moved to
# argument_utils, as in Megatron-LM HEAD); the per-config rules live in the configs' validate().
from megatron.training.argument_utils import (
    checkpoint_config_from_args,
    core_transformer_config_from_args,
    data_config_from_args,
    logger_config_from_args,
    profiling_config_from_args,
    rng_config_from_args,
    scheduler_config_from_args,
    tokenizer_config_from_args,
    training_config_from_args,
)
from megatron.training.config.training_config import non_directory_ancestor
from megatron.training.slurm import launcher_rank_and_world_size
from megatron.training.tokenizer import TOKENIZER_FILES
from megatron.training.unsupported_flags import unsupported_choice_line, unsupported_flag_line
from megatron.training.user_errors import UserInputError, report_and_exit

__all__ = ["add_megatron_arguments", "parse_args", "validate_args", "non_directory_ancestor",
           "core_transformer_config_from_args"]

# Position embeddings that need a learned table of size --max-position-embeddings.
_TABLE_POSITION_TYPES = ("learned_absolute", "rope")
_AVAILABLE_OPTIMIZERS = ("adam", "sgd")


class _MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with Megatron's flags whose errors are one line, printed once (rank 0), not the usage.

    The usage of ~180 flags printed on every rank buries the one line that matters; ``--help`` still
    prints it. Unknown flags get a "did you mean" from the parser's own option strings.
    """

    def error(self, message):
        report_and_exit(UserInputError(message if "did you mean" in message else f"{message} (see --help)",
                                       exit_status=2, same_on_every_rank=True))

    def refuse(self, line):
        """Exit with ``line`` as the one error line (a Megatron-LM flag or choice this project lacks)."""
        report_and_exit(UserInputError(line, exit_status=2, same_on_every_rank=True))

    def suggestions(self, unknown):
        """`` (did you mean --x?)`` for the unknown ``--flag`` / ``--flag=value`` words with a close match."""
        options = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        flags = [word.split("=", 1)[0] for word in unknown if word.startswith("--")]
        pairs = [(flag, difflib.get_close_matches(flag, options, n=1, cutoff=0.75)) for flag in flags]
        hints = [(flag, close[0]) for flag, close in pairs if close]
        if not hints:
            return ""
        if len(flags) == 1:
            return f" (did you mean {hints[0][1]}?)"
        return f" (did you mean {', '.join(f'{close} for {flag}' for flag, close in hints)}?)"


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args=None):
    """Parse Megatron-LM's training flags into an argparse.Namespace.

    Args:
        extra_args_provider: optional ``fn(parser) -> parser`` adding script-specific flags.
        ignore_unknown_args: when True unknown flags are dropped instead of being an error.
        args: list of strings to parse instead of ``sys.argv[1:]``.

    Besides the flags, sets ``rank`` and ``world_size`` from the launcher's environment
    (torchrun's RANK/WORLD_SIZE, else SLURM's SLURM_PROCID/SLURM_NTASKS) and ``local_rank``
    defaults to LOCAL_RANK (else SLURM_LOCALID). A bad flag prints one ``error: ...`` line (rank 0
    only; an unknown flag with a "did you mean", a flag or choice of Megatron-LM's that this project lacks with
    the reason) and raises SystemExit(2); a rank variable that is not an integer raises ValueError.
    """
    parser = _MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)

    parsed, unknown = parser.parse_known_args(args)
    if unknown and not ignore_unknown_args:
        # A flag of Megatron-LM's that this project lacks is named as such, not "corrected" to a neighbour.
        line = unsupported_flag_line(unknown)
        if line is not None:
            parser.refuse(line)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{parser.suggestions(unknown)}")
    # Megatron-LM's choices this project cannot act on are refused now, not when the model is built.
    line = unsupported_choice_line(parsed)
    if line is not None:
        parser.refuse(line)

    parsed.rank, parsed.world_size = launcher_rank_and_world_size()
    return parsed


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------

def _print_rank_0(args, message):
    if args.rank == 0:
        write_line(message)


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def validate_args(args, defaults={}):
    """Check flag combinations and fill derived values in place (Megatron-LM's validate_args).

    Derives ``data_parallel_size``, ``global_batch_size``, ``ffn_hidden_size``, ``kv_channels``,
    ``params_dtype``, ``eval_*_batch_size``, ``exit_signal`` (a signal.Signals), applies ``defaults`` to flags
    left at None, and prints the arguments on rank 0. Returns ``args``.

    Raises ValueError naming the offending flag(s) and values, including for features that
    are not available in this version (the distributed optimizer with another optimizer than adam,
    the torch_dcp and fsdp_dtensor checkpoint formats, Transformer Engine).
    """
    # Applied first so that script defaults take part in every check below; a flag given on
    # the command line wins over the script default.
    for key, value in defaults.items():
        if getattr(args, key, None) == value:
            continue
        if getattr(args, key, None) is not None:
            _print_rank_0(args, f"WARNING: overriding default arguments for {key}:{value} "
                                f"with {key}:{getattr(args, key)}")
        else:
            setattr(args, key, value)

    _validate_required(args)
    _validate_features(args)
    _validate_torch_fsdp2(args)
    _validate_parallel_sizes(args)
    _validate_data_sources(args)
    _validate_batch_sizes(args)
    _validate_precision(args)
    _validate_schedule(args)
    _validate_model(args)
    _validate_pipeline(args)
    _validate_moe(args)
    _validate_checkpointing(args)
    logger_config_from_args(args).validate(save=args.save)  # --wandb-*
    profiling_config_from_args(args).validate(args.tensorboard_dir, args.world_size)  # --profile*
    _validate_misc(args)

    # The run counters (iteration, consumed samples, FLOPs) are not args: the training loop owns them
    # in a TrainingState (megatron/training/training_state.py) that checkpoints save and restore.
    # Sequence length is constant in GPT pretraining, so pipeline p2p shapes are static.
    args.variable_seq_lengths = False

    _print_args("arguments", args)
    return args


def _validate_required(args):
    """All missing required flags in one message (a bare ``pretrain_gpt.py`` names them at once).

    The tokenizer's files and a data source are required only where ``args.require_inputs`` is set
    (``pretrain_gpt.py`` sets it with ``parser.set_defaults``; library callers may build neither).
    """
    missing = [flag for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                                       ("--num-attention-heads", "num_attention_heads"),
                                       ("--seq-length", "seq_length"), ("--micro-batch-size", "micro_batch_size"))
               if getattr(args, dest) is None]
    if (args.max_position_embeddings is None and args.position_embedding_type == "learned_absolute"
            and not args.use_rotary_position_embeddings):
        missing.insert(4, "--max-position-embeddings")
    if args.train_iters is None and args.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if args.lr is None and not args.skip_train:
        missing.append("--lr")
    if getattr(args, "require_inputs", False):  # set by scripts that read a tokenizer and a dataset
        missing += [f"{flag} (for --tokenizer-type {args.tokenizer_type})"
                    for flag, dest in TOKENIZER_FILES.get(args.tokenizer_type, ()) if getattr(args, dest) is None]
        if not (args.data_path or args.mock_data or args.train_data_path or args.valid_data_path
                or args.test_data_path):
            missing.append("a data source (--data-path, --train-data-path/--valid-data-path/--test-data-path or "
                           "--mock-data)")
    if missing:
        raise ValueError(f"missing required flag{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")


def _validate_features(args):
    _validate_context_parallel(args)
    if args.overlap_param_gather and not args.use_torch_fsdp2 and not (args.use_distributed_optimizer
                                                                      and args.overlap_grad_reduce):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ValueError(f"--use-distributed-optimizer supports --optimizer adam only, got {args.optimizer}")
    if args.ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"--ckpt-format {args.ckpt_format} is not available in this version; use torch_dist "
                         "(sharded, the default) or torch (legacy)")
    if args.transformer_impl != "local":
        raise ValueError("--transformer-impl transformer_engine is not available: this version does not ship "
                         "Transformer Engine layers; use --transformer-impl local")
    if args.optimizer not in _AVAILABLE_OPTIMIZERS:
        raise ValueError(f"--optimizer {args.optimizer} is not available in this version; "
                         f"choose one of {', '.join(_AVAILABLE_OPTIMIZERS)}")
    # Parsed so Megatron command lines are accepted, but not acted on yet: refuse rather than ignore.
    for dest, default in _NOT_YET_AVAILABLE.items():
        if getattr(args, dest) != default:
            raise ValueError(f"--{dest.replace('_', '-')} is not available in this version yet; remove it "
                             "(it would otherwise be silently ignored)")
    for flag, dest, default, reason in _NO_EFFECT_HERE:
        if getattr(args, dest) != default:
            raise ValueError(f"{flag} {reason}; remove it (it would otherwise be silently ignored)")
    tokenizer_config_from_args(args).validate()  # flags of another --tokenizer-type than the one given
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        # Megatron-LM reads the pattern only when it builds a TikTokenizer: ignore it as it does, but say so.
        _print_rank_0(args, f"WARNING: --tiktoken-pattern {args.tiktoken_pattern} is ignored: it applies only to "
                            f"--tokenizer-type TikTokenizer (got {args.tokenizer_type})")
    if args.deterministic_mode:
        _validate_deterministic_mode(args)
    if args.use_mcore_models:
        _print_rank_0(args, "WARNING: --use-mcore-models is deprecated and has no effect: the Megatron Core "
                            "models are the only models")


# NCCL all-reduce algorithms Megatron-LM's --deterministic-mode accepts in env NCCL_ALGO (validate_args).
DETERMINISTIC_NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")


def _validate_deterministic_mode(args):
    """Megatron-LM's --deterministic-mode rules (initialize.py applies the mode): no flash attention (its backward
    accumulates in a nondeterministic order), and NCCL_ALGO, when set, one with a fixed reduction order."""
    _require(args.attention_backend != "flash",
             "--deterministic-mode cannot be combined with --attention-backend flash (flash attention's backward is "
             "not deterministic); use --attention-backend unfused, fused or auto")
    algo = os.environ.get("NCCL_ALGO")
    _require(algo is None or algo in DETERMINISTIC_NCCL_ALGOS,
             f"--deterministic-mode needs env NCCL_ALGO to be one of {', '.join(DETERMINISTIC_NCCL_ALGOS)} (got "
             f"{algo!r}); unset, it is set to Ring")


def _validate_context_parallel(args):
    """--cp-comm-type values (always), and what --context-parallel-size > 1 cannot be combined with."""
    from megatron.core.transformer.context_parallel import CP_COMM_TYPES

    for value in args.cp_comm_type:
        if value == "a2a+p2p":
            raise ValueError("--cp-comm-type a2a+p2p (hierarchical context parallelism) is not supported in this "
                             "version; use p2p, all_gather or a2a")
        _require(value in CP_COMM_TYPES,
                 f"--cp-comm-type {value!r}: choose from {', '.join(CP_COMM_TYPES)}")
    _require(len(args.cp_comm_type) in (1, args.num_layers),
             f"--cp-comm-type takes one value or one per layer (--num-layers {args.num_layers}), "
             f"got {len(args.cp_comm_type)}")
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.sequence_parallel:
        _require(args.seq_length // cp % args.tensor_model_parallel_size == 0,
                 f"--seq-length ({args.seq_length}) / --context-parallel-size ({cp}) is not divisible by "
                 f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}), which --sequence-parallel needs")
    _require(not args.reset_attention_mask,
             "--reset-attention-mask cannot be combined with --context-parallel-size > 1 in this version "
             "(the context-parallel attention is causal over the whole sequence)")
    _require(args.attention_dropout == 0.0,
             f"--attention-dropout ({args.attention_dropout}) must be 0 with --context-parallel-size > 1: the "
             "context-parallel attention kernels have no dropout in this version")
    if "a2a" in args.cp_comm_type:
        # Ulysses gives each CP rank whole query heads (K/V groups are repeated when they do not split).
        heads = args.num_attention_heads // args.tensor_model_parallel_size
        _require(heads % cp == 0,
                 f"--cp-comm-type a2a splits the attention heads over the CP ranks: --num-attention-heads "
                 f"({heads} per tensor-parallel rank) is not divisible by --context-parallel-size ({cp}); "
                 f"use p2p or all_gather, or another head count")


# Flags accepted by the parser (Megatron compatibility) whose behaviour is not implemented yet.
_NOT_YET_AVAILABLE = {
    "full_validation": False, "log_progress": False, "exit_signal_handler_for_training": False,
    "log_energy": False,
    "pretrained_checkpoint": None,
    "use_tp_pp_dp_mapping": False,
}


# (flag, dest, default, why a non-default value cannot act in this version).
_NO_EFFECT_HERE = [
    ("--head-lr-mult", "head_lr_mult", 1.0, "has no effect in GPT pretraining (Megatron-LM applies it only through "
                                            "a scale_lr_cond, which pretrain_gpt does not set)"),
    ("--use-persistent-ckpt-worker", "use_persistent_ckpt_worker", False,
     "has no effect here: the --async-save writer is a background thread in each rank (no worker process to "
     "keep alive between saves)"),
]


def _validate_parallel_sizes(args):
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                        ("--context-parallel-size", args.context_parallel_size)):
        _require(value >= 1, f"{flag} must be >= 1, got {value}")
    _require(args.world_size >= 1, f"world size must be >= 1, got {args.world_size} (env WORLD_SIZE)")
    _require(0 <= args.rank < args.world_size,
             f"rank {args.rank} is outside the world size {args.world_size} (env RANK/WORLD_SIZE)")
    total_model_size = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                        * args.context_parallel_size)
    _require(args.tensor_model_parallel_size <= args.world_size,
             f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) is larger than the world size "
             f"({args.world_size}, env WORLD_SIZE)")
    _require(args.world_size % total_model_size == 0,
             f"world size ({args.world_size}) is not divisible by total_model_size ({total_model_size}) = "
             f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
             f"({args.pipeline_model_parallel_size}) x --context-parallel-size ({args.context_parallel_size})")
    args.data_parallel_size = args.world_size // total_model_size
    _print_rank_0(args, f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, "
                        f"context-parallel size: {args.context_parallel_size}, "
                        f"tensor-model-parallel size: {args.tensor_model_parallel_size}, "
                        f"pipeline-model-parallel size: {args.pipeline_model_parallel_size}")
    # Sequence parallelism only changes numerics (not memory) when tp == 1, so Megatron drops it.
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        warnings.warn("Disabling sequence parallelism (--sequence-parallel) because tensor model parallelism "
                      "is disabled (--tensor-model-parallel-size 1)")
        args.sequence_parallel = False


def _validate_data_sources(args):
    data_config_from_args(args).validate()  # one source, a --split that parses, builder threads > 0
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
        _print_rank_0(args, "WARNING: Please specify --split when using --data-path. "
                            f'Using legacy default value of "{args.split}"')
    if args.dataloader_type is None:
        args.dataloader_type = "single"


def _validate_batch_sizes(args):
    _require(args.micro_batch_size > 0, f"--micro-batch-size must be > 0, got {args.micro_batch_size}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
        _print_rank_0(args, f"setting global batch size to {args.global_batch_size}")
    _require(args.global_batch_size > 0, f"--global-batch-size must be > 0, got {args.global_batch_size}")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step != 0:
        if args.decrease_batch_size_if_needed and args.global_batch_size >= per_step:
            rounded = args.global_batch_size // per_step * per_step
            _print_rank_0(args, f"WARNING: decreasing global batch size from {args.global_batch_size} to {rounded} "
                                "(--decrease-batch-size-if-needed)")
            args.global_batch_size = rounded
        else:
            raise ValueError(
                f"global batch size ({args.global_batch_size}) is not divisible by micro batch size "
                f"({args.micro_batch_size}) times data parallel size ({args.data_parallel_size})")
    if args.rampup_batch_size is not None:
        _validate_rampup_batch_size(args)

    if args.eval_micro_batch_size is None:
        args.eval_micro_batch_size = args.micro_batch_size
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size
    _require(args.eval_micro_batch_size > 0, f"--eval-micro-batch-size must be > 0, got {args.eval_micro_batch_size}")
    _require(args.eval_global_batch_size % (args.eval_micro_batch_size * args.data_parallel_size) == 0,
             f"eval global batch size ({args.eval_global_batch_size}) is not divisible by eval micro batch size "
             f"({args.eval_micro_batch_size}) times data parallel size ({args.data_parallel_size})")


def _validate_rampup_batch_size(args):
    """``--rampup-batch-size start incr samples``: integers, sample-based training, and every batch of
    the ramp a multiple of micro batch x data-parallel size (checked now, on every rank)."""
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator,
        parse_rampup_batch_size,
    )

    args.rampup_batch_size = parse_rampup_batch_size(args.rampup_batch_size)
    # The iteration of a batch change depends on consumed samples, so an iteration count cannot
    # say where training or the LR schedule ends (Megatron-LM refuses the combination too).
    _require(args.train_iters is None,
             "--rampup-batch-size needs sample-based training: use --train-samples (and --lr-decay-samples, "
             "--lr-warmup-samples) instead of --train-iters")
    start, increment, samples = args.rampup_batch_size
    RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
        args.decrease_batch_size_if_needed, -1, start, increment, samples)


def _validate_torch_fsdp2(args):
    """``--use-torch-fsdp2``: Megatron-LM core_v0.14's requirements, each refused in one line naming the flags."""
    if not args.use_torch_fsdp2:
        return
    _require(not args.use_distributed_optimizer,
             "--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive: FSDP2 shards the optimizer "
             "state itself")
    _require(args.ckpt_format == "torch_dist",
             f"--use-torch-fsdp2 requires --ckpt-format torch_dist (got {args.ckpt_format}): each rank saves its "
             "parameter shard into the global tensors")
    _require(args.untie_embeddings_and_output_weights,
             "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights (a tied weight would be one "
             "parameter in two FSDP units)")
    _require(not args.fp16, "--use-torch-fsdp2 is not supported with --fp16 (use --bf16)")
    _require(args.pipeline_model_parallel_size == 1,
             f"--use-torch-fsdp2 is not supported with pipeline parallelism (--pipeline-model-parallel-size "
             f"{args.pipeline_model_parallel_size}); use 1, as Megatron-LM requires")
    _require(not args.gradient_accumulation_fusion,
             "--use-torch-fsdp2 requires --no-gradient-accumulation-fusion (FSDP2 owns the gradients; there is "
             "no main_grad buffer to fuse into)")


def _validate_precision(args):
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive; give at most one")
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
        # With dynamic loss scaling an Inf/NaN grad is the scaler's signal, not an error.
        if not args.loss_scale:
            args.check_for_nan_in_loss_and_grad = False
            _print_rank_0(args, "WARNING: Setting args.check_for_nan_in_loss_and_grad to False since dynamic "
                                "loss scaling is being used")
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bf16 has too few mantissa bits to accumulate gradients in place.
        if not args.accumulate_allreduce_grads_in_fp32 and not args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = True
            _print_rank_0(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    _print_rank_0(args, f"using {args.params_dtype} for parameters ...")
    if args.fp16_lm_cross_entropy:
        _require(args.fp16, "--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection:
        _require(args.fp16 or args.bf16, "--fp32-residual-connection needs --fp16 or --bf16")
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True


def _validate_schedule(args):
    scheduler_config_from_args(args).validate(training_config_from_args(args), args.lr, args.min_lr, args.skip_train)
    if args.weight_decay_incr_style == "constant":
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay


def _validate_pipeline(args):
    """Pipeline split and interleaving: sets ``virtual_pipeline_model_parallel_size``; refuses, with
    the numbers, a layer split that does not add up and interleaving's impossible microbatch counts."""
    from megatron.core.transformer.pipeline_layout import pipeline_layer_counts

    pp = args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    per_vp_layers, vp_stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last),
                        ("--num-layers-per-virtual-pipeline-stage", per_vp_layers),
                        ("--num-virtual-stages-per-pipeline-rank", vp_stages)):
        if value is not None:
            _require(pp > 1, f"{flag} needs pipeline parallelism (--pipeline-model-parallel-size > 1, got {pp})")
            _require(value >= (0 if flag.startswith("--decoder") else 1), f"{flag} must be positive, got {value}")
    for flag, value in (("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
                        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split)):
        if value:
            _require(pp > 1, f"{flag} needs pipeline parallelism (--pipeline-model-parallel-size > 1, got {pp})")
            _require(first is None and last is None,
                     f"{flag} cannot be combined with --decoder-first-pipeline-num-layers / "
                     "--decoder-last-pipeline-num-layers (an uneven split already says where each layer goes)")

    args.virtual_pipeline_model_parallel_size = None
    if per_vp_layers is not None or vp_stages is not None:
        _require(per_vp_layers is None or vp_stages is None,
                 "only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                 "should be set")
        if not args.overlap_p2p_comm:
            # Batched send/recv would pair two transfers between the same two ranks (Megatron-LM's rule).
            _require(pp > 2, "pipeline-model-parallel size should be greater than 2 with the interleaved schedule "
                             f"and --no-overlap-p2p-communication (got --pipeline-model-parallel-size {pp})")
        if per_vp_layers is not None:
            _require(first is None and last is None,
                     "--num-layers-per-virtual-pipeline-stage is not supported with an uneven split "
                     "(--decoder-first/last-pipeline-num-layers); use --num-virtual-stages-per-pipeline-rank")
            stage_layers = (args.num_layers + int(args.account_for_embedding_in_pipeline_split)
                            + int(args.account_for_loss_in_pipeline_split)) // pp
            _require(stage_layers % per_vp_layers == 0,
                     f"layers per pipeline stage ({stage_layers} = --num-layers {args.num_layers} / "
                     f"--pipeline-model-parallel-size {pp}) must be divisible by "
                     f"--num-layers-per-virtual-pipeline-stage ({per_vp_layers})")
            vp = stage_layers // per_vp_layers
        else:
            vp = vp_stages
        args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # p2p overlap only exists in the interleaved schedule

    try:
        pipeline_layer_counts(args.num_layers, pp, args.virtual_pipeline_model_parallel_size, first, last,
                              args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split)
    except ValueError as error:
        raise ValueError(
            f"the layers do not split over the pipeline stages (--num-layers {args.num_layers}, "
            f"--pipeline-model-parallel-size {pp}, virtual stages per rank "
            f"{args.virtual_pipeline_model_parallel_size or 1}, --decoder-first-pipeline-num-layers {first}, "
            f"--decoder-last-pipeline-num-layers {last}, --account-for-embedding-in-pipeline-split "
            f"{args.account_for_embedding_in_pipeline_split}, --account-for-loss-in-pipeline-split "
            f"{args.account_for_loss_in_pipeline_split}): {error}") from None

    if args.reset_attention_mask:
        # Only the first and last blocks read batches; activations, not masks, travel between stages.
        _require(pp <= 2 and args.virtual_pipeline_model_parallel_size is None,
                 f"--reset-attention-mask needs every pipeline block to read the batch, but with "
                 f"--pipeline-model-parallel-size {pp} and {args.virtual_pipeline_model_parallel_size or 1} virtual "
                 "stage(s) per rank the middle blocks do not; use at most 2 stages without interleaving")
    if args.virtual_pipeline_model_parallel_size is not None:
        # Interleaving runs microbatches in groups of pp per virtual stage (spec section 5).
        checks = [("--global-batch-size", args.global_batch_size, args.micro_batch_size),
                  ("--eval-global-batch-size", args.eval_global_batch_size, args.eval_micro_batch_size)]
        if args.rampup_batch_size is not None:
            start, increment, _ = args.rampup_batch_size
            checks += [("--rampup-batch-size", size, args.micro_batch_size)
                       for size in range(start, args.global_batch_size, increment)]
        for flag, batch, micro in checks:
            microbatches = batch // (micro * args.data_parallel_size)
            _require(microbatches % pp == 0,
                     f"number of microbatches ({microbatches} = {flag} {batch} / (micro batch size {micro} x "
                     f"data-parallel size {args.data_parallel_size})) is not divisible by "
                     f"--pipeline-model-parallel-size ({pp}) when using the interleaved schedule")


def _validate_model(args):
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ValueError("--no-position-embedding is deprecated, use --position-embedding-type none")
    # (None for a required flag was refused by _validate_required, which runs first.)
    for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"), ("--seq-length", "seq_length")):
        _require(getattr(args, dest) > 0, f"{flag} must be > 0, got {getattr(args, dest)}")
    if args.position_embedding_type != "learned_absolute" and args.max_position_embeddings is None:
        # Table-free position encodings have no length limit of their own.
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type in _TABLE_POSITION_TYPES:
        _require(args.max_position_embeddings >= args.seq_length,
                 f"--max-position-embeddings ({args.max_position_embeddings}) must be greater than or equal to "
                 f"--seq-length ({args.seq_length})")
    if args.context_parallel_size > 1:
        _require(args.seq_length % (args.context_parallel_size * 2) == 0,
                 f"--seq-length ({args.seq_length}) must be divisible by 2 x --context-parallel-size "
                 f"({args.context_parallel_size}) for load balancing")

    tp = args.tensor_model_parallel_size
    _require(args.num_attention_heads % tp == 0,
             f"num_attention_heads ({args.num_attention_heads}) must be a multiple of "
             f"tensor_model_parallel_size ({tp}) (--num-attention-heads, --tensor-model-parallel-size).")
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(groups is not None and groups > 0, f"--num-query-groups must be > 0, got {groups}")
        _require(args.num_attention_heads % groups == 0,
                 f"--num-attention-heads ({args.num_attention_heads}) is not divisible by "
                 f"--num-query-groups ({groups})")
        _require(groups % tp == 0,
                 f"--num-query-groups ({groups}) is not divisible by --tensor-model-parallel-size ({tp})")

    activations = [flag for flag, on in (("--swiglu", args.swiglu), ("--squared-relu", args.squared_relu),
                                         ("--openai-gelu", args.openai_gelu)) if on]
    _require(len(activations) <= 1, f"{' and '.join(activations)} are mutually exclusive activations")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Two input projections: shrink to keep ~the parameter count of 4h, rounded to 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by --tensor-model-parallel-size ({tp}): "
             f"each rank holds ffn_hidden_size / tp columns of linear_fc1")
    if args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"--seq-length ({args.seq_length}) is not divisible by --tensor-model-parallel-size ({tp}), "
                 f"which --sequence-parallel needs to split the sequence across ranks")
        _require(not args.distribute_saved_activations,
                 "--distribute-saved-activations cannot be combined with --sequence-parallel "
                 "(the saved activations are already split along the sequence)")
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
                 f"({args.num_attention_heads}); give --kv-channels explicitly")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.swiglu:
        args.gated_linear_unit = True
        args.activation_func = F.silu
    if args.add_bias_linear:
        args.add_qkv_bias = True
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "selective":
        _require(args.recompute_method is None,
                 "--recompute-method is not supported with --recompute-granularity selective")
    # Refused here, naming the flag, rather than at the first forward (e.g. flash/fused without CUDA).
    from megatron.core.transformer.attention_backend import check_attention_backend
    check_attention_backend(args.attention_backend)


def _validate_moe(args):
    """Megatron-LM's mixture-of-experts rules (``validate_args``, spec section 3.2) plus the expert process-group
    arithmetic of ``initialize_model_parallel``, checked now with the flags named; sets ``num_experts`` (0 -> None),
    ``expert_tensor_parallel_size`` (None -> TP), ``moe_ffn_hidden_size`` (None -> --ffn-hidden-size) and turns
    one-element --moe-router-load-balancing-type / --moe-aux-loss-coeff lists into scalars (as Megatron-LM)."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if args.num_experts == 0:
        args.num_experts = None
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    _require(ep >= 1, f"--expert-model-parallel-size must be >= 1, got {ep}")
    _require(etp >= 1, f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    if ep > 1:
        _require(args.num_experts is not None,
                 f"--expert-model-parallel-size {ep} needs --num-experts (expert parallelism splits the experts)")
        _require(args.num_experts % ep == 0,
                 f"--num-experts ({args.num_experts}) must be a multiple of --expert-model-parallel-size ({ep})")
        _require(not args.fp16, "--expert-model-parallel-size > 1 is not supported with --fp16 (use --bf16)")
    if args.use_torch_fsdp2:
        _require(ep == 1, f"--use-torch-fsdp2 is not supported with expert parallelism (--expert-model-parallel-size "
                          f"{ep}); use 1, as Megatron-LM requires")
    _require(args.world_size % (etp * ep * pp) == 0,
             f"world size ({args.world_size}) is not divisible by --expert-tensor-parallel-size ({etp}) x "
             f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp}), which the expert "
             "process groups need")
    if isinstance(args.moe_router_load_balancing_type, list) and len(args.moe_router_load_balancing_type) == 1:
        args.moe_router_load_balancing_type = args.moe_router_load_balancing_type[0]
    if isinstance(args.moe_aux_loss_coeff, list) and len(args.moe_aux_loss_coeff) == 1:
        args.moe_aux_loss_coeff = args.moe_aux_loss_coeff[0]
    if args.num_experts is None:
        return
    # DistributedOptimizer.get_parameter_state_dp_zero gathers to data-parallel rank 0 only; refused now rather
    # than at the first save (the same rule, checked there too).
    _require(not (args.use_distributed_optimizer and args.ckpt_format == "torch" and (ep > 1 or etp != tp)),
             f"--ckpt-format torch with --use-distributed-optimizer cannot save expert parameters sharded over the "
             f"expert-data-parallel group yet (--expert-model-parallel-size {ep}, --expert-tensor-parallel-size "
             f"{etp}); use --ckpt-format torch_dist")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
        _print_rank_0(args, "WARNING: --moe-ffn-hidden-size is not set, using --ffn-hidden-size "
                            f"({args.ffn_hidden_size}) for the experts")
    _require(args.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be > 0, got {args.moe_ffn_hidden_size}")
    # nan/inf would pass the range checks below (comparisons with nan are False) and fail mid-step.
    coeffs = args.moe_aux_loss_coeff if isinstance(args.moe_aux_loss_coeff, list) else [args.moe_aux_loss_coeff]
    for flag, values in (("--moe-expert-capacity-factor", [args.moe_expert_capacity_factor]),
                         ("--moe-aux-loss-coeff", coeffs), ("--moe-z-loss-coeff", [args.moe_z_loss_coeff]),
                         ("--moe-router-topk-scaling-factor", [args.moe_router_topk_scaling_factor]),
                         ("--moe-router-bias-update-rate", [args.moe_router_bias_update_rate]),
                         ("--moe-input-jitter-eps", [args.moe_input_jitter_eps])):
        bad = [value for value in values if value is not None and not math.isfinite(value)]
        _require(not bad, f"{flag} must be a finite number, got {bad[0] if bad else None}")
    kinds = args.moe_router_load_balancing_type
    _require("sinkhorn" not in (kinds if isinstance(kinds, list) else [kinds]),
             "--moe-router-load-balancing-type sinkhorn is a Megatron-LM choice that this project does not support; "
             "use aux_loss, seq_aux_loss or none")
    # Megatron-LM raises this in MoELayer.forward at the first training step; refused here, before any work.
    _require(tp == 1 or args.sequence_parallel,
             f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (Megatron-LM refuses "
             "MoE with tensor parallelism but without sequence parallelism in training)")
    # TransformerConfig's MoE rules (topk, groups, capacity, expert bias, ...), reported now in one line.
    try:
        core_transformer_config_from_args(args)
    except ValueError as error:
        raise ValueError(f"invalid mixture-of-experts flags: {error}") from None


def _validate_checkpointing(args):
    checkpoint_config_from_args(args).validate()
    if args.deprecated_use_dist_ckpt or args.dist_ckpt_format_deprecated is not None:
        _print_rank_0(args, "WARNING: --use-dist-ckpt and --dist-ckpt-format are deprecated and ignored; "
                            "use --ckpt-format")
    args.use_dist_ckpt = args.ckpt_format != "torch"


def _validate_misc(args):
    try:
        args.exit_signal = signal.Signals[args.exit_signal] if isinstance(args.exit_signal, str) \
            else signal.Signals(args.exit_signal)
    except (KeyError, ValueError):
        names = ", ".join(sorted(s.name for s in signal.Signals))
        raise ValueError(f"--exit-signal {args.exit_signal!r} is not a signal name; choose one of {names}") from None
    # SIGKILL/SIGSTOP cannot be caught; SIGCHLD is how the DataLoader learns that a worker died.
    _require(args.exit_signal not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD),
             f"--exit-signal {args.exit_signal.name} cannot be handled; use SIGTERM, SIGINT, SIGUSR1 or SIGUSR2")
    rng_config_from_args(args).validate()


def _print_args(title, args):
    """Print every argument, sorted by name, in Megatron-LM's dotted layout on rank 0."""
    if args.rank != 0:
        return
    lines = []
    for name, value in vars(args).items():
        dots = "." * (48 - len(name))
        lines.append(f"  {name} {dots} {value}")
    write_line(f"------------------------ {title} ------------------------")
    for line in sorted(lines, key=lambda x: x.lower()):
        write_line(line)
    write_line(f"-------------------- end of {title} ---------------------")
