"""The training command line: Megatron-LM's flags and their validation (configs are built in argument_utils)."""
import argparse
import difflib
import os
import signal
import warnings

import torch
import torch.nn.functional as F

from megatron.core.console import write_line
from megatron.core.datasets.utils import parse_and_normalize_split
# Re-exported: Megatron-LM callers import it from here (it moved to argument_utils, as in Megatron-LM HEAD).
from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.tokenizer import add_tokenizer_args
from megatron.training.user_errors import UserInputError, report_and_exit

__all__ = ["add_megatron_arguments", "parse_args", "validate_args", "non_directory_ancestor",
           "core_transformer_config_from_args"]

# Position embeddings that need a learned table of size --max-position-embeddings.
_TABLE_POSITION_TYPES = ("learned_absolute", "rope")
_OPTIMIZERS = ["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"]
_AVAILABLE_OPTIMIZERS = ("adam", "sgd")
_CKPT_FORMATS = ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"]


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every training flag group to ``parser`` (Megatron-LM's name); returns it."""
    parser = _add_network_size_args(parser)
    parser = _add_regularization_args(parser)
    parser = _add_training_args(parser)
    parser = _add_initialization_args(parser)
    parser = _add_learning_rate_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_mixed_precision_args(parser)
    parser = _add_distributed_args(parser)
    parser = _add_validation_args(parser)
    parser = _add_data_args(parser)
    parser = add_tokenizer_args(parser)
    parser = _add_logging_args(parser)
    parser = _add_opentelemetry_args(parser)
    return parser


class _MegatronArgumentParser(argparse.ArgumentParser):
    """argparse with Megatron's flags whose errors are one line, printed once (rank 0), not the usage.

    The usage of ~180 flags printed on every rank buries the one line that matters; ``--help`` still
    prints it. Unknown flags get a "did you mean" from the parser's own option strings.
    """

    def error(self, message):
        report_and_exit(UserInputError(message if "did you mean" in message else f"{message} (see --help)",
                                       exit_status=2, same_on_every_rank=True))

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
    only; an unknown flag with a "did you mean") and raises SystemExit(2); a rank variable that is
    not an integer raises ValueError.
    """
    parser = _MegatronArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)

    parsed, unknown = parser.parse_known_args(args)
    if unknown and not ignore_unknown_args:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{parser.suggestions(unknown)}")

    parsed.rank, parsed.world_size = _launcher_rank_and_world_size()
    return parsed


def _env_int(name, default):
    value = os.getenv(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _launcher_rank_and_world_size():
    # torchrun's variables win; plain `srun` only sets SLURM's, so fall back to those.
    if os.getenv("RANK") is None and os.getenv("WORLD_SIZE") is None and os.getenv("SLURM_NTASKS") is not None:
        return _env_int("SLURM_PROCID", 0), _env_int("SLURM_NTASKS", 1)
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def _default_local_rank():
    if os.getenv("LOCAL_RANK") is None and os.getenv("SLURM_LOCALID") is not None and os.getenv("RANK") is None:
        return _env_int("SLURM_LOCALID", 0)
    return _env_int("LOCAL_RANK", 0)


# ---------------------------------------------------------------------------------------------------
# Flag groups (names, dests and defaults are Megatron-LM's)
# ---------------------------------------------------------------------------------------------------

def _add_network_size_args(parser):
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="MLP hidden size; default 4*hidden (SwiGLU: int((4h*2/3)/64)*64).")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    group.add_argument("--attention-backend", type=str, default="auto",
                       choices=["flash", "fused", "unfused", "local", "auto"],
                       help="SDPA kernel of core attention: flash (FlashAttention), fused (cuDNN, else "
                            "memory-efficient), unfused/local (math), auto (PyTorch picks). flash and fused "
                            "need CUDA.")
    group.add_argument("--compile-transformer-layers", action="store_true",
                       help="Compile each transformer layer's forward with torch.compile (per layer; "
                            "state-dict names unchanged).")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Per-head projection size; default hidden-size / num-attention-heads.")
    group.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    group.add_argument("--num-query-groups", type=int, default=1, help="Query groups for GQA.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Largest sequence length the position embedding supports.")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
                       help="Position embedding type.")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Deprecated alias of --position-embedding-type rope.")
    group.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (inv_freq = 1/base^(2i/dim)).")
    group.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of kv_channels rotated.")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="Rotate interleaved pairs instead of halves.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Linear RoPE position interpolation factor.")
    group.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1 style RoPE scaling.")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0, help="RoPE scaling factor.")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="Disable the fused RoPE kernel.")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Deprecated: use --position-embedding-type.")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    group.add_argument("--normalization", type=str, default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="Normalization layer.")
    group.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norm layers.")
    group.add_argument("--apply-layernorm-1p", action="store_true",
                       help="Zero-centered LayerNorm gamma (weight stored as gamma-1).")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="Take the residual from the norm output (original BERT style).")
    group.add_argument("--openai-gelu", action="store_true", help="Use the tanh approximation of GeLU.")
    group.add_argument("--squared-relu", action="store_true", help="Use squared ReLU activation.")
    group.add_argument("--swiglu", action="store_true", help="Use the SiLU-gated linear unit MLP.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Separate output-layer weight instead of reusing the word embedding.")
    group.add_argument("--qk-layernorm", action="store_true", help="Normalize queries and keys per head.")
    group.add_argument("--num-experts", type=int, default=None, help="Number of MoE experts (not available).")
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay coefficient.")
    group.add_argument("--start-weight-decay", type=float, default=None, help="Initial weight decay.")
    group.add_argument("--end-weight-decay", type=float, default=None, help="Final weight decay.")
    group.add_argument("--weight-decay-incr-style", type=str, default="constant",
                       choices=["constant", "linear", "cosine"], help="Weight decay schedule.")
    group.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                       help="Keep weight decay on q/k layernorm weights.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Global L2 grad-norm clip (0 disables).")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-08, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="Samples per microbatch per GPU.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Samples per optimizer step; default micro-batch-size * data-parallel size.")
    group.add_argument("--rampup-batch-size", nargs="*", default=None,
                       help="Ramp the global batch size up over consumed samples: '<start batch size> <batch size "
                            "increment> <ramp-up samples>' (needs --train-samples).")
    group.add_argument("--decrease-batch-size-if-needed", action="store_true",
                       help="Round the global batch down to a multiple of mbs*dp instead of failing.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Selective activation recomputation (= --recompute-granularity selective).")
    group.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                       help="Activation recomputation granularity.")
    group.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                       help="How layers are grouped for full recomputation.")
    group.add_argument("--recompute-num-layers", type=int, default=None, help="Layers per recompute unit.")
    group.add_argument("--distribute-saved-activations", action="store_true",
                       help="Split recomputed checkpoints across the tensor-parallel group.")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad",
                       help="Do not stop on a NaN/Inf gradient: training proceeds (fp32/bf16 steps are applied, as in "
                            "Megatron-LM) and the log line counts such iterations as 'number of nan iterations'.")
    group.add_argument("--train-iters", type=int, default=None, help="Total training iterations.")
    group.add_argument("--train-samples", type=int, default=None, help="Total training samples.")
    group.add_argument("--exit-interval", type=int, default=None, help="Save and exit when iteration %% N == 0.")
    group.add_argument("--exit-duration-in-mins", type=int, default=None, help="Save and exit after N minutes.")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Save and exit when --exit-signal is received.")
    group.add_argument("--exit-signal", type=str, default="SIGTERM",
                       help="Signal name caught by --exit-signal-handler (e.g. SIGTERM, SIGUSR1).")
    group.add_argument("--exit-signal-handler-for-training", action="store_true",
                       help="Graceful SIGINT/SIGTERM shutdown (barrier, destroy groups, flush telemetry).")
    group.add_argument("--optimizer", type=str, default="adam", choices=_OPTIMIZERS, help="Optimizer.")
    group.add_argument("--dataloader-type", type=str, default=None, choices=["single", "cyclic", "external"],
                       help="Data sampler; default single.")
    group.add_argument("--no-persist-layer-norm", action="store_true",
                       help="Disable the persistent fused layer-norm kernel.")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                       dest="gradient_accumulation_fusion", help="Disable fused weight-grad accumulation.")
    group.add_argument("--use-mcore-models", action="store_true", help="Deprecated no-op: core models are the default.")
    group.add_argument("--cross-entropy-loss-fusion", action="store_true", dest="cross_entropy_loss_fusion",
                       help="Accepted for Megatron-LM command lines; no effect: there is one vocab-parallel cross "
                            "entropy here (Megatron's fused variant computes the same loss).")
    group.add_argument("--transformer-impl", type=str, default="local", choices=["local", "transformer_engine"],
                       help="Layer implementation. Default 'local' (Megatron's default transformer_engine is "
                            "not shipped in this version).")
    group.add_argument("--calculate-per-token-loss", action="store_true",
                       help="Scale the loss by the number of non-padded tokens of the global batch.")
    group.add_argument("--manual-gc", action="store_true", help="Run Python GC at a fixed iteration interval.")
    group.add_argument("--manual-gc-interval", type=int, default=0, help="Iterations between manual GC runs.")
    group.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="Do not collect garbage around evaluation with --manual-gc.")
    group.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                       help="Call torch.cuda.empty_cache() each iteration (1) or also after eval (2).")
    group.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                       help="Disable the fused scale-mask-softmax kernel.")
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                       help="Disable bias+GeLU fusion.")
    group.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                       help="Disable bias+SwiGLU fusion.")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                       help="Disable bias+dropout+add fusion.")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                       help="No bias in the linear layers.")
    group.add_argument("--add-qkv-bias", action="store_true", help="Bias in the QKV projection only.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Split norm/dropout activations along the sequence across tensor-parallel ranks.")
    return parser


def _add_initialization_args(parser):
    group = parser.add_argument_group(title="initialization")
    group.add_argument("--seed", type=int, default=1234, help="Random seed (python, numpy, torch).")
    group.add_argument("--data-parallel-random-init", action="store_true",
                       help="Different initial weights on each data-parallel rank.")
    group.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    group.add_argument("--embedding-init-method-std", type=float, default=None,
                       help="Std of the embedding init; default --init-method-std.")
    group.add_argument("--init-method-xavier-uniform", action="store_true", help="Xavier-uniform weight init.")
    group.add_argument("--use-cpu-initialization", action="store_true",
                       help="Initialize full weights on the CPU and split them (TP-invariant init).")
    group.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                       help="Skip weight initialization (e.g. before loading a checkpoint).")
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                       help="Learning rate decay.")
    group.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                       choices=["exponential", "linear", "cosine", "minus_sqrt"], help="Decay inside the WSD window.")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="Iterations to decay over (default train-iters).")
    group.add_argument("--lr-decay-samples", type=int, default=None, help="Samples to decay over.")
    group.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="Iterations of the WSD decay window.")
    group.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="Samples of the WSD decay window.")
    group.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warmup as a fraction of decay.")
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Warmup iterations.")
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup samples.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Floor of the learning rate.")
    # core_v0.14 spells these two with an underscore (--override-opt_param-scheduler); both spellings act.
    group.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                       dest="override_opt_param_scheduler",
                       help="Use the command-line scheduler values instead of the checkpoint's.")
    group.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                       action="store_true", dest="use_checkpoint_opt_param_scheduler",
                       help="Use the checkpoint's scheduler values.")
    group.add_argument("--decoupled-lr", type=float, default=None, help="Learning rate of embedding/output params.")
    group.add_argument("--decoupled-min-lr", type=float, default=None, help="Min learning rate of embedding/output.")
    group.add_argument("--head-lr-mult", type=float, default=1.0,
                       help="Parsed for compatibility: only the default 1.0 is accepted (no effect in GPT "
                            "pretraining).")
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                       dest="save_interval", help="Iterations between checkpoint saves.")
    group.add_argument("--save-retain-interval", type=int, default=None,
                       help="Keep only checkpoints whose iteration is a multiple of this (plus the latest).")
    group.add_argument("--non-persistent-save-interval", type=int, default=None,
                       help="Iterations between non-persistent saves (frequent, only the newest kept; "
                            "--load picks the newer of it and the persistent one). Needs "
                            "--non-persistent-ckpt-type global.")
    group.add_argument("--non-persistent-ckpt-type", type=str, default=None, choices=["global", "local", "in_memory"],
                       help="Kind of non-persistent checkpoint: 'global' (a checkpoint directory on a shared "
                            "file system); 'local' and 'in_memory' are not available in this version.")
    group.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None,
                       help="Directory of 'global' non-persistent checkpoints (default <save>/non_persistent).")
    group.add_argument("--no-verify-checkpoint", action="store_true",
                       help="At load, skip the CRC-32 check of the checkpoint files against the integrity "
                            "manifest written at save (file presence and sizes are still checked).")
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save optimizer state.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory holding the checkpoint to load.")
    group.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load optimizer state.")
    group.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load RNG state.")
    group.add_argument("--finetune", action="store_true",
                       help="Load model weights only; start at iteration 0 with fresh optimizer and RNG.")
    group.add_argument("--pretrained-checkpoint", type=str, default=None, help="Checkpoint to fine-tune from.")
    group.add_argument("--ckpt-step", type=int, default=None, help="Load this iteration instead of the latest.")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="Fail instead of starting from scratch when --load has no checkpoint.")
    group.add_argument("--use-dist-ckpt", action="store_true", dest="deprecated_use_dist_ckpt",
                       help="Deprecated no-op: use --ckpt-format.")
    group.add_argument("--dist-ckpt-format", type=str, default=None, dest="dist_ckpt_format_deprecated",
                       help="Deprecated no-op: use --ckpt-format.")
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="Load a checkpoint in whichever format it is (torch or torch_dist), not only in "
                            "--ckpt-format.")
    group.add_argument("--ckpt-format", type=str, default="torch_dist", choices=_CKPT_FORMATS,
                       help="Checkpoint format: 'torch_dist' (default; torch.distributed.checkpoint, sharded, "
                            "loads at any TP/PP/DP layout) or 'torch' (Megatron's legacy per-rank files, same "
                            "layout only).")
    group.add_argument("--async-save", action="store_true", default=None,
                       help="Write torch_dist checkpoints in the background; training waits only for the copy "
                            "of the state to host memory.")
    group.add_argument("--use-persistent-ckpt-worker", action="store_true",
                       help="Use a persistent background process for async saves.")
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")
    group.add_argument("--fp16", action="store_true", help="fp16 model with fp32 main params.")
    group.add_argument("--bf16", action="store_true", help="bf16 model with fp32 main params.")
    group.add_argument("--loss-scale", type=float, default=None, help="Constant loss scale; default dynamic (fp16).")
    group.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="Initial dynamic loss scale.")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    group.add_argument("--loss-scale-window", type=float, default=1000, help="Clean steps before scaling up.")
    group.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before scaling down.")
    group.add_argument("--fp32-residual-connection", action="store_true", help="Residual stream in fp32.")
    group.add_argument("--apply-query-key-layer-scaling", action="store_true",
                       help="Scale Q*K^T by 1/layer-number (forces softmax in fp32).")
    group.add_argument("--attention-softmax-in-fp32", action="store_true", help="Attention softmax in fp32.")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Accumulate and all-reduce gradients in fp32.")
    group.add_argument("--grad-reduce-in-bf16", action="store_true", help="Reduce gradients in bf16 with --bf16.")
    group.add_argument("--fp16-lm-cross-entropy", action="store_true", help="Unfused cross entropy in fp16.")
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size.")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size.")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                       dest="scatter_gather_tensors_in_pipeline",
                       help="Accepted for Megatron-LM command lines; no effect (Megatron-LM core_v0.14 does not "
                            "use it either).")
    group.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                       help="Layers on the first pipeline stage.")
    group.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                       help="Layers on the last pipeline stage.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual stage (interleaved schedule).")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Virtual stages per pipeline rank (interleaved schedule).")
    group.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                       help="Do not overlap pipeline send/recv with compute.")
    group.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                       help="Count the embedding as one layer when splitting layers over pipeline stages "
                            "(the first stage builds one transformer layer less).")
    group.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                       help="Count the loss as one layer when splitting layers over pipeline stages "
                            "(the last stage builds one transformer layer less).")
    group.add_argument("--context-parallel-size", type=int, default=1, help="Context-parallel size.")
    group.add_argument("--expert-model-parallel-size", type=int, default=1, help="Expert-parallel size.")
    group.add_argument("--distributed-backend", type=str, choices=["nccl", "gloo"],
                       default="nccl" if torch.cuda.is_available() else "gloo",
                       help="torch.distributed backend (default nccl with CUDA, else gloo).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout of collective operations in minutes.")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap grad reduction with backward.")
    group.add_argument("--overlap-param-gather", action="store_true", help="Overlap param all-gather with forward.")
    group.add_argument("--ddp-bucket-size", type=int, default=None, help="Elements per grad-reduction bucket.")
    group.add_argument("--ddp-average-in-collective", action="store_true",
                       help="Average (not sum) gradients inside the collective.")
    group.add_argument("--local-rank", type=int, default=_default_local_rank(),
                       help="Local rank (default env LOCAL_RANK).")
    group.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                       help="Rank order tp-pp-dp instead of tp-dp-pp.")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title="validation")
    group.add_argument("--eval-iters", type=int, default=100, help="Global batches per evaluation.")
    group.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    group.add_argument("--skip-train", action="store_true", help="Only evaluate.")
    group.add_argument("--full-validation", action="store_true", help="Evaluate on the whole validation set.")
    group.add_argument("--eval-global-batch-size", type=int, default=None,
                       help="Global batch of evaluation; default --global-batch-size.")
    group.add_argument("--eval-micro-batch-size", type=int, default=None,
                       help="Micro batch of evaluation; default --micro-batch-size.")
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="Dataset prefixes, optionally weighted: 'w1 p1 w2 p2 ...'.")
    group.add_argument("--split", type=str, default=None, help="Train/valid/test proportions, e.g. '969,30,1'.")
    group.add_argument("--train-data-path", nargs="*", default=None, help="Training dataset prefixes.")
    group.add_argument("--valid-data-path", nargs="*", default=None, help="Validation dataset prefixes.")
    group.add_argument("--test-data-path", nargs="*", default=None, help="Test dataset prefixes.")
    group.add_argument("--data-cache-path", type=str, default=None, help="Where sample-index caches are written.")
    group.add_argument("--mock-data", action="store_true", help="Synthetic data instead of files.")
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per sample.")
    group.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    group.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after EOD.")
    group.add_argument("--reset-attention-mask", action="store_true", help="Block attention across EOD.")
    group.add_argument("--eod-mask-loss", action="store_true", help="Mask the loss at EOD inputs.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader", help="Let the model build the causal mask.")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read .bin files instead of memory-mapping them.")
    group.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                       help="Extra fraction of samples built for blended datasets.")
    group.add_argument("--num-dataset-builder-threads", type=int, default=1, help="Threads building datasets.")
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")
    group.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    group.add_argument("--log-params-norm", action="store_true", help="Log the parameter L2 norm.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zero grads.")
    group.add_argument("--log-throughput", action="store_true", help="Log TFLOP/s per GPU.")
    group.add_argument("--log-progress", action="store_true", help="Append progress lines to <save>/progress.txt.")
    group.add_argument("--log-energy", action="store_true", help="Log GPU energy and power.")
    group.add_argument("--log-straggler", action="store_true",
                       help="Print the slowest/fastest rank's compute time, data wait and TFLOP/s every log interval.")
    group.add_argument("--straggler-minmax-count", type=int, default=1,
                       help="With --log-straggler, also list the N ranks of lowest and highest estimated TFLOP/s.")
    group.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2], help="Timer verbosity.")
    group.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"],
                       help="How timers are reduced across ranks.")
    group.add_argument("--no-barrier-with-L1-time", "--no-barrier-with-level-1-timing", action="store_false",
                       dest="barrier_with_L1_time",
                       help="No barrier before level-1 timers.")
    group.add_argument("--tensorboard-dir", type=str, default=None, help="TensorBoard event directory.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1, help="Iterations between TB writes.")
    group.add_argument("--tensorboard-queue-size", type=int, default=1000, help="TB writer queue size.")
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write timers to TB.")
    group.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                       dest="log_loss_scale_to_tensorboard", help="Do not write the loss scale to TB.")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="Write validation perplexity to TB.")
    group.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write CUDA memory stats to TB.")
    group.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Write the world size to TB.")
    group.add_argument("--wandb-project", type=str, default="",
                       help="Weights & Biases project: the last rank logs the TensorBoard scalars there (needs the "
                            "wandb package; offline when no API key is configured).")
    group.add_argument("--wandb-exp-name", type=str, default="", help="Weights & Biases run name.")
    group.add_argument("--wandb-save-dir", type=str, default="",
                       help="Weights & Biases local directory (default <--save>/wandb).")
    group.add_argument("--logging-level", type=_logging_level, default=None,
                       help="Level of the framework's Python logging records: a number (10 = DEBUG, 20 = INFO, "
                            "30 = WARNING, ...) or a level name. Default: env MEGATRON_LOGGING_LEVEL, else INFO "
                            "for the megatron loggers with WARNING and above printed on the console.")
    return parser


def _logging_level(value):
    """``--logging-level`` value -> a ``logging`` level number; accepts numbers and level names."""
    import logging

    text = str(value).strip()
    if text.lstrip("-").isdigit():
        level = int(text)
        if level < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {level}")
        return level
    level = logging.getLevelName(text.upper())
    if isinstance(level, int):
        return level
    raise argparse.ArgumentTypeError(f"{value!r} is neither a number nor a logging level name "
                                     "(DEBUG, INFO, WARNING, ERROR, CRITICAL)")


def _add_opentelemetry_args(parser):
    group = parser.add_argument_group(title="opentelemetry")
    group.add_argument("--otel-enabled", action="store_true",
                       help="Enable OpenTelemetry (overrides MEGATRON_OTEL_ENABLED).")
    group.add_argument("--otel-service-name", type=str, default=None,
                       help="OTel service name (default OTEL_SERVICE_NAME, else megatron-lm).")
    group.add_argument("--otel-span-groups", type=str, default=None,
                       help="Span-group spec (overrides MEGATRON_OTEL_SPAN_GROUPS).")
    return parser


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
    are not available in this version (context parallelism, the distributed optimizer,
    the torch_dcp and fsdp_dtensor checkpoint formats, Transformer Engine, MoE).
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
    _validate_parallel_sizes(args)
    _validate_data_sources(args)
    _validate_batch_sizes(args)
    _validate_precision(args)
    _validate_schedule(args)
    _validate_model(args)
    _validate_pipeline(args)
    _validate_checkpointing(args)
    _validate_wandb(args)
    _validate_misc(args)

    # The run counters (iteration, consumed samples, FLOPs) are not args: the training loop owns them
    # in a TrainingState (megatron/training/training_state.py) that checkpoints save and restore.
    # Sequence length is constant in GPT pretraining, so pipeline p2p shapes are static.
    args.variable_seq_lengths = False

    _print_args("arguments", args)
    return args


# What each tokenizer type reads: (flag, dest).
_TOKENIZER_FILES = {
    "GPT2BPETokenizer": (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    "SentencePieceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "GPTSentencePieceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "HuggingFaceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "TikTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "NullTokenizer": (("--vocab-size", "vocab_size"),),
}


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
                    for flag, dest in _TOKENIZER_FILES.get(args.tokenizer_type, ()) if getattr(args, dest) is None]
        if not (args.data_path or args.mock_data or args.train_data_path or args.valid_data_path
                or args.test_data_path):
            missing.append("a data source (--data-path, --train-data-path/--valid-data-path/--test-data-path or "
                           "--mock-data)")
    if missing:
        raise ValueError(f"missing required flag{'s' if len(missing) > 1 else ''}: {', '.join(missing)}")


def _validate_features(args):
    if args.context_parallel_size > 1:
        # Accepting it would have every rank of a context-parallel group redo the same work.
        raise ValueError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                         "available in this version yet; use 1")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if args.use_distributed_optimizer and args.optimizer != "adam":
        raise ValueError(f"--use-distributed-optimizer supports --optimizer adam only, got {args.optimizer}")
    if args.ckpt_format not in ("torch", "torch_dist"):
        raise ValueError(f"--ckpt-format {args.ckpt_format} is not available in this version; use torch_dist "
                         "(sharded, the default) or torch (legacy)")
    if args.transformer_impl != "local":
        raise ValueError("--transformer-impl transformer_engine is not available: this version does not ship "
                         "Transformer Engine layers; use --transformer-impl local")
    if args.expert_model_parallel_size != 1 or args.num_experts is not None:
        raise ValueError("mixture of experts (--num-experts / --expert-model-parallel-size) is not available "
                         "in this version")
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
    for flag, dest, default, tokenizer_type in _TOKENIZER_TYPE_FLAGS:
        if getattr(args, dest) != default and args.tokenizer_type != tokenizer_type:
            raise ValueError(f"{flag} applies only to --tokenizer-type {tokenizer_type} (got {args.tokenizer_type}); "
                             "remove it (it would otherwise be silently ignored)")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        # Megatron-LM reads the pattern only when it builds a TikTokenizer: ignore it as it does, but say so.
        _print_rank_0(args, f"WARNING: --tiktoken-pattern {args.tiktoken_pattern} is ignored: it applies only to "
                            f"--tokenizer-type TikTokenizer (got {args.tokenizer_type})")
    if args.vocab_extra_ids and args.tokenizer_type != "SentencePieceTokenizer":
        raise ValueError(f"--vocab-extra-ids only applies to --tokenizer-type SentencePieceTokenizer (got "
                         f"{args.tokenizer_type}); remove it (it would otherwise be silently ignored)")
    if args.use_mcore_models:
        _print_rank_0(args, "WARNING: --use-mcore-models is deprecated and has no effect: the Megatron Core "
                            "models are the only models")


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
# Tokenizer flags that act only with one --tokenizer-type: (flag, dest, default, that type).
_TOKENIZER_TYPE_FLAGS = [
    ("--tokenizer-special-tokens", "tokenizer_special_tokens", None, "TikTokenizer"),
    ("--tiktoken-special-tokens", "tiktoken_special_tokens", None, "TikTokenizer"),
    ("--tiktoken-num-special-tokens", "tiktoken_num_special_tokens", 1000, "TikTokenizer"),
    ("--trust-remote-code", "trust_remote_code", False, "HuggingFaceTokenizer"),
    ("--tokenizer-hf-no-use-fast", "tokenizer_hf_use_fast", True, "HuggingFaceTokenizer"),
    ("--tokenizer-hf-no-include-special-tokens", "tokenizer_hf_include_special_tokens", True, "HuggingFaceTokenizer"),
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
    sources = [name for name, used in (
        ("--data-path", bool(args.data_path)),
        ("--mock-data", bool(args.mock_data)),
        ("--train-data-path/--valid-data-path/--test-data-path",
         any([args.train_data_path, args.valid_data_path, args.test_data_path])),
    ) if used]
    _require(len(sources) <= 1, f"a single data source must be given, got {' and '.join(sources)}")
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
        _print_rank_0(args, "WARNING: Please specify --split when using --data-path. "
                            f'Using legacy default value of "{args.split}"')
    if args.split is not None:
        # Parsed here, once, so that a malformed --split stops the run with one line (rank 0) before any rank
        # builds a dataset; the datasets parse the same string again.
        parse_and_normalize_split(args.split)  # ValueError naming --split and the value
    _require(args.num_dataset_builder_threads > 0,
             f"--num-dataset-builder-threads must be > 0, got {args.num_dataset_builder_threads}")
    if args.dataloader_type is None:
        args.dataloader_type = "single"


def _validate_batch_sizes(args):
    _require(args.micro_batch_size is not None, "--micro-batch-size is required")
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


def _validate_wandb(args):
    """``--wandb-*``: the package must be importable and the run named; the other two need --wandb-project."""
    if not args.wandb_project:
        for flag, value in (("--wandb-exp-name", args.wandb_exp_name), ("--wandb-save-dir", args.wandb_save_dir)):
            _require(not value, f"{flag} needs --wandb-project (without it nothing is logged to Weights & Biases)")
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                         "(or remove --wandb-project/--wandb-exp-name/--wandb-save-dir)") from None
    _require(bool(args.wandb_exp_name), "--wandb-project needs --wandb-exp-name (the Weights & Biases run name)")
    _require(bool(args.wandb_save_dir or args.save),
             "--wandb-project needs --wandb-save-dir or --save (W&B files go to <--save>/wandb by default)")


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
    _require((args.train_iters is None) != (args.train_samples is None),
             "exactly one of --train-iters and --train-samples must be given "
             f"(got --train-iters {args.train_iters}, --train-samples {args.train_samples})")
    if args.train_iters is not None:
        _require(args.lr_decay_samples is None, "--lr-decay-samples needs sample-based training (--train-samples); "
                                                "use --lr-decay-iters with --train-iters")
        _require(args.lr_warmup_samples == 0, "--lr-warmup-samples needs sample-based training (--train-samples); "
                                              "use --lr-warmup-iters with --train-iters")
        _require(args.lr_wsd_decay_samples is None, "--lr-wsd-decay-samples needs sample-based training; "
                                                    "use --lr-wsd-decay-iters with --train-iters")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_iters == 0, "can only specify one of --lr-warmup-fraction and --lr-warmup-iters")
    else:
        _require(args.lr_decay_iters is None, "--lr-decay-iters needs iteration-based training (--train-iters); "
                                              "use --lr-decay-samples with --train-samples")
        _require(args.lr_warmup_iters == 0, "--lr-warmup-iters needs iteration-based training (--train-iters); "
                                            "use --lr-warmup-samples with --train-samples")
        _require(args.lr_wsd_decay_iters is None, "--lr-wsd-decay-iters needs iteration-based training; "
                                                  "use --lr-wsd-decay-samples with --train-samples")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_samples == 0,
                     "can only specify one of --lr-warmup-fraction and --lr-warmup-samples")
    if not args.skip_train:
        _require(args.lr is not None, "--lr is required for training")
        # The scheduler counts in samples; say it in the flags the user gave.
        if args.lr_warmup_fraction is None and args.train_iters is not None and args.lr_warmup_iters > 0:
            decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
            _require(args.lr_warmup_iters < decay,
                     f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --lr-decay-iters ({decay}; "
                     f"it defaults to --train-iters)")
        if args.lr_warmup_fraction is None and args.train_samples is not None and args.lr_warmup_samples > 0:
            decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
            _require(args.lr_warmup_samples < decay,
                     f"--lr-warmup-samples ({args.lr_warmup_samples}) must be smaller than --lr-decay-samples "
                     f"({decay}; it defaults to --train-samples)")
    if args.lr is not None:
        _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    _require(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
             "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive")
    if args.weight_decay_incr_style == "constant":
        _require(args.start_weight_decay is None and args.end_weight_decay is None,
                 "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine")
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                 "and --end-weight-decay")


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
    for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads")):
        _require(getattr(args, dest) is not None, f"{flag} is required ({dest} argument is None)")
        _require(getattr(args, dest) > 0, f"{flag} must be > 0, got {getattr(args, dest)}")
    _require(args.seq_length is not None, "--seq-length is required")
    _require(args.seq_length > 0, f"--seq-length must be > 0, got {args.seq_length}")
    if args.position_embedding_type == "learned_absolute":
        _require(args.max_position_embeddings is not None,
                 "--max-position-embeddings is required with --position-embedding-type learned_absolute")
    elif args.max_position_embeddings is None:
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


def non_directory_ancestor(path):
    """The nearest existing entry on ``path`` (itself or an ancestor) when it is not a directory (a regular
    file, say), else None: no directory can be created at ``path`` then."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def _validate_checkpointing(args):
    if args.save is not None:
        _require(args.save_interval is not None, "--save requires --save-interval")
        # Found now rather than at the first save, after the training it was meant to keep.
        blocker = non_directory_ancestor(args.save)
        _require(blocker is None, f"--save {args.save}: {blocker} is a file, not a directory; no checkpoint "
                                  "directory can be created there")
    if args.save_interval is not None:
        _require(args.save_interval > 0, f"--save-interval must be > 0, got {args.save_interval}")
    _validate_non_persistent(args)
    if args.async_save and args.ckpt_format != "torch_dist":
        raise ValueError(f"--async-save needs --ckpt-format torch_dist (got --ckpt-format {args.ckpt_format})")
    if args.deprecated_use_dist_ckpt or args.dist_ckpt_format_deprecated is not None:
        _print_rank_0(args, "WARNING: --use-dist-ckpt and --dist-ckpt-format are deprecated and ignored; "
                            "use --ckpt-format")
    args.use_dist_ckpt = args.ckpt_format != "torch"


def _validate_non_persistent(args):
    if args.non_persistent_ckpt_type in ("local", "in_memory"):
        raise ValueError(f"--non-persistent-ckpt-type {args.non_persistent_ckpt_type} is not available in this "
                         "version; use --non-persistent-ckpt-type global (a directory on a shared file system, "
                         "see --non-persistent-global-ckpt-dir)")
    if args.non_persistent_save_interval is not None:
        _require(args.non_persistent_save_interval > 0,
                 f"--non-persistent-save-interval must be > 0, got {args.non_persistent_save_interval}")
        _require(args.save is not None, "--non-persistent-save-interval requires --save")
        _require(args.non_persistent_ckpt_type == "global",
                 "--non-persistent-save-interval requires --non-persistent-ckpt-type global (as in Megatron-LM)")
    elif args.non_persistent_global_ckpt_dir is not None and args.non_persistent_ckpt_type != "global":
        raise ValueError("--non-persistent-global-ckpt-dir only applies with --non-persistent-ckpt-type global; "
                         "remove it (it would otherwise be silently ignored)")


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
    if args.seed is not None:
        _require(args.seed > 0, f"--seed must be > 0, got {args.seed}")


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
