"""Megatron-LM's training flags, one ``_add_*_args(parser)`` per parser group (Megatron's names, dests, defaults).

``megatron.training.arguments`` parses and validates them (and re-exports ``add_megatron_arguments``);
each group's settings land in one slice of the typed configuration (``megatron/training/config``).
"""
import argparse

import torch

from megatron.training.slurm import default_local_rank
from megatron.training.tokenizer import add_tokenizer_args

OPTIMIZERS = ["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"]
CKPT_FORMATS = ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"]
POSITION_EMBEDDING_TYPES = ["learned_absolute", "rope", "yarn", "mrope", "relative", "none"]
# Megatron-LM core_v0.14's StrictHandling values (megatron/core/dist_checkpointing/validation.py).
DIST_CKPT_STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "return_unexpected", "return_all", "ignore_all"]


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
    parser = _add_moe_args(parser)
    return parser


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
                       choices=POSITION_EMBEDDING_TYPES,
                       help="Position embedding type (yarn, mrope and relative are Megatron-LM's, refused here).")
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
    group.add_argument("--deterministic-mode", action="store_true",
                       help="Deterministic execution, as in Megatron-LM: torch.use_deterministic_algorithms(True) at "
                            "initialization; with CUDA, CUBLAS_WORKSPACE_CONFIG=:4096:8 and (NCCL) NCCL_ALGO=Ring "
                            "when unset (NCCL_ALGO must be Tree, Ring, CollnetDirect, CollnetChain or ^NVLS).")
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
    group.add_argument("--optimizer", type=str, default="adam", choices=OPTIMIZERS,
                       help="Optimizer: adam or sgd (Megatron-LM's others are refused).")
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
    group.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                       choices=DIST_CKPT_STRICTNESS,
                       help="torch_dist load: what a key mismatch does (Megatron-LM's StrictHandling). 'Unexpected' "
                            "= a tensor the model needs that the checkpoint lacks, 'missing' = a checkpoint tensor "
                            "no rank reads. assume_ok_unexpected (default) and raise_unexpected: unexpected fails; "
                            "log_unexpected: warned and left as initialized; log_all: the same and missing warned; "
                            "raise_all: either fails; ignore_all: unexpected left as initialized, nothing said. "
                            "return_unexpected/return_all are refused (they hand the keys to an API caller).")
    group.add_argument("--ckpt-format", type=str, default="torch_dist", choices=CKPT_FORMATS,
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
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Context-parallel size: each sequence split over this many ranks (2 chunks each).")
    group.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                       help="How context-parallel attention exchanges K/V: p2p (ring), all_gather or a2a "
                            "(Ulysses); one value for every layer, or one per layer.")
    group.add_argument("--distributed-backend", type=str, choices=["nccl", "gloo"],
                       default="nccl" if torch.cuda.is_available() else "gloo",
                       help="torch.distributed backend (default nccl with CUDA, else gloo).")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout of collective operations in minutes.")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap grad reduction with backward.")
    group.add_argument("--overlap-param-gather", action="store_true", help="Overlap param all-gather with forward.")
    group.add_argument("--use-torch-fsdp2", action="store_true",
                       help="Shard parameters, gradients and optimizer state over the data-parallel (with context-"
                            "parallel) ranks with torch.distributed.fsdp.fully_shard (FSDP2), one unit per "
                            "transformer layer, the embedding, the output layer and the root.")
    group.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                       dest="torch_fsdp2_reshard_after_forward",
                       help="With --use-torch-fsdp2: keep each unit's parameters gathered from forward to "
                            "backward (ZeRO-2 style: more memory, one all-gather less per unit).")
    group.add_argument("--ddp-bucket-size", type=int, default=None, help="Elements per grad-reduction bucket.")
    group.add_argument("--ddp-average-in-collective", action="store_true",
                       help="Average (not sum) gradients inside the collective.")
    group.add_argument("--local-rank", type=int, default=default_local_rank(),
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
    group.add_argument("--logging-level", type=logging_level, default=None,
                       help="Level of the framework's Python logging records: a number (10 = DEBUG, 20 = INFO, "
                            "30 = WARNING, ...) or a level name. Default: env MEGATRON_LOGGING_LEVEL, else INFO "
                            "for the megatron loggers with WARNING and above printed on the console.")
    # Profiling (Megatron-LM core_v0.14's names and defaults; megatron/training/profiling.py).
    group.add_argument("--profile", action="store_true",
                       help="Profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks: "
                            "with --use-pytorch-profiler a torch.profiler trace under --tensorboard-dir, else the "
                            "CUDA profiler range for nsys (nsys profile --capture-range=cudaProfilerApi "
                            "--capture-range-end=stop ...; CUDA only).")
    group.add_argument("--profile-step-start", type=int, default=10, help="Global step to start profiling.")
    group.add_argument("--profile-step-end", type=int, default=12, help="Global step to stop profiling.")
    group.add_argument("--profile-ranks", nargs="+", type=int, default=[0], help="Global ranks to profile.")
    group.add_argument("--use-pytorch-profiler", action="store_true", dest="use_pytorch_profiler",
                       help="With --profile: torch.profiler, its trace viewable in TensorBoard (needs --tensorboard-dir).")
    group.add_argument("--record-memory-history", action="store_true", default=False,
                       help="Record the CUDA allocator's history; the last rank dumps a snapshot every log interval "
                            "(CUDA only).")
    group.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle",
                       help="Where to dump the memory history pickle.")
    # Troubleshooting (docs/observability.md, "Troubleshooting"): hang report and slow-step lines.
    group.add_argument("--hang-report-seconds", type=float, default=600,
                       help="Print a 'hang report:' block (stalled ranks, where each waiting rank is blocked, a "
                            "file with its Python stacks) when a rank's heartbeat in the c10d store has not "
                            "advanced for this many seconds; also at start-up, when the process group has not "
                            "formed after this long. 0 turns it off; otherwise at least 1.")
    group.add_argument("--slow-step-factor", type=float, default=3.0,
                       help="Log one line for a step slower than this factor times the running median step time, "
                            "naming the part of the step that grew and the rank (with the per-rank breakdown: "
                            "--log-straggler or telemetry metrics). 0 turns it off.")
    return parser


def logging_level(value):
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
# Mixture of experts (Megatron-LM core_v0.14 ``_add_moe_args``: names, dests, defaults, choices)
# ---------------------------------------------------------------------------------------------------

MOE_TOKEN_DISPATCHER_TYPES = ["allgather", "alltoall", "flex"]
MOE_LOAD_BALANCING_TYPES = ["aux_loss", "seq_aux_loss", "sinkhorn", "none"]
# Longest --moe-layer-freq pattern accepted (a layer count; keeps "[1]*10**9"-like input from eating memory).
_MOE_PATTERN_MAX_LEN = 100_000


def moe_freq_type(value):
    """``--moe-layer-freq`` value -> an int N (MoE every N-th layer) or a 0/1 list (one entry per layer).

    Accepts Megatron-LM's forms: an int, an int as a string, or a list expression made of non-negative integers,
    ``[...]`` lists, ``+`` (concatenation or addition), ``*`` (repetition or product) and parentheses, e.g.
    ``"([1]*3+[0]*1)*3"``. Megatron evaluates the expression with Python's ``eval`` after a character check; it
    is parsed here by a small recursive-descent parser (no code is run). Raises argparse.ArgumentTypeError.
    """
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is neither an integer nor a list pattern such as "
                                             "'([1]*3+[0]*1)*3'") from None
    try:
        result = _MoePatternParser(text).parse()
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"invalid pattern {value!r}: {error}") from None
    if not isinstance(result, list):
        raise argparse.ArgumentTypeError(f"pattern {value!r} evaluates to {result!r}, not a list")
    return result


class _MoePatternParser:
    """expr := term ('+' term)*; term := atom ('*' atom)*; atom := int | '[' [expr (',' expr)*] ']' | '(' expr ')'.

    Values are ints or lists with Python's meaning of + and * (list + list, list * int, int * list, int op int).
    """

    def __init__(self, text: str):
        self.text = text.replace(" ", "")
        self.pos = 0

    def parse(self):
        result = self._expr()
        if self.pos != len(self.text):
            raise ValueError(f"unexpected {self.text[self.pos]!r} at position {self.pos}")
        return result

    def _peek(self):
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _expect(self, char):
        if self._peek() != char:
            raise ValueError(f"expected {char!r} at position {self.pos}")
        self.pos += 1

    def _expr(self):
        value = self._term()
        while self._peek() == "+":
            self.pos += 1
            right = self._term()
            if isinstance(value, list) != isinstance(right, list):
                raise ValueError("'+' joins two lists or two integers")
            value = value + right
            self._check_size(value)
        return value

    def _term(self):
        value = self._atom()
        while self._peek() == "*":
            self.pos += 1
            right = self._atom()
            if isinstance(value, list) and isinstance(right, list):
                raise ValueError("'*' cannot multiply two lists")
            if isinstance(value, list) or isinstance(right, list):
                count, items = (right, value) if isinstance(value, list) else (value, right)
                if count > _MOE_PATTERN_MAX_LEN:
                    raise ValueError(f"repetition count {count} is too large")
                if len(items) * count > _MOE_PATTERN_MAX_LEN:  # checked before the list is built
                    raise ValueError(f"the list has more than {_MOE_PATTERN_MAX_LEN} entries")
            value = value * right
            self._check_size(value)
        return value

    def _atom(self):
        char = self._peek()
        if char == "(":
            self.pos += 1
            value = self._expr()
            self._expect(")")
            return value
        if char == "[":
            self.pos += 1
            items = []
            if self._peek() != "]":
                items.append(self._expr())
                while self._peek() == ",":
                    self.pos += 1
                    if self._peek() == "]":  # a trailing comma, as Python allows
                        break
                    items.append(self._expr())
            self._expect("]")
            return items
        start = self.pos
        while self._peek().isdigit():
            self.pos += 1
        if start == self.pos:
            raise ValueError(f"expected an integer, '[' or '(' at position {start}")
        return int(self.text[start:self.pos])

    @staticmethod
    def _check_size(value):
        if isinstance(value, list) and len(value) > _MOE_PATTERN_MAX_LEN:
            raise ValueError(f"the list has more than {_MOE_PATTERN_MAX_LEN} entries")
        if isinstance(value, int) and value > 10 ** 9:
            raise ValueError("integer too large")


def _add_moe_args(parser):
    group = parser.add_argument_group(title="moe")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="Expert-parallel size: the experts of each MoE layer are split over this many ranks "
                            "(carved out of the data-parallel x context-parallel ranks).")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size inside the experts (default: --tensor-model-parallel-size).")
    group.add_argument("--num-experts", type=int, default=None,
                       help="Number of experts in each MoE layer (0 or unset: no MoE).")
    group.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                       help="Which layers are MoE: an int N puts MoE at the layers with 0-based index i %% N == 0; a "
                            "list pattern such as '([1]*3+[0]*1)*3' gives one 0/1 per layer.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="FFN hidden size of each expert (default --ffn-hidden-size).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="FFN hidden size of the shared expert (all shared experts together); unset: none.")
    group.add_argument("--moe-shared-expert-overlap", action="store_true",
                       help="Overlap the shared expert with the token dispatch (alltoall dispatcher only).")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="Run the local experts as one grouped matmul (GroupedMLP; a loop with the same results "
                            "where torch has no grouped matmul).")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, choices=MOE_LOAD_BALANCING_TYPES,
                       default="aux_loss",
                       help="Load balancing: aux_loss (GShard/Switch), seq_aux_loss (per sequence, DeepSeek-V2) or "
                            "none; several values combine (with one --moe-aux-loss-coeff each). sinkhorn is "
                            "Megatron-LM's, refused here.")
    group.add_argument("--moe-router-dtype", type=str, choices=["fp32", "fp64"], default=None,
                       help="Data type of the router's logits and probabilities (default: the model dtype).")
    group.add_argument("--moe-router-score-function", type=str, choices=["softmax", "sigmoid"], default="softmax",
                       help="Score function of the router.")
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts before the top-k (default: softmax over the top-k).")
    group.add_argument("--moe-router-num-groups", type=int, default=None,
                       help="Expert groups of group-limited routing (DeepSeek-V3).")
    group.add_argument("--moe-router-group-topk", type=int, default=None,
                       help="Groups each token may pick its experts from (group-limited routing).")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Multiplier of the routing probabilities of the top-k experts.")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="Aux-loss-free load balancing: a per-expert bias on the selection scores, updated once "
                            "per step from the token counts (sigmoid scores only).")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                       help="Step of the expert-bias update (bias += sign(mean count - count) * rate).")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                       help="Coefficient of the load-balancing loss (one per --moe-router-load-balancing-type).")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None,
                       help="Coefficient of the router z-loss (ST-MoE); unset: none.")
    group.add_argument("--moe-input-jitter-eps", type=float, default=None,
                       help="Multiply the router input by uniform noise in [1-eps, 1+eps] in training.")
    group.add_argument("--moe-per-layer-logging", action="store_true",
                       help="Also log each MoE layer's auxiliary losses (moe/<name>_layer_<i>).")
    group.add_argument("--moe-token-dispatcher-type", type=str, choices=MOE_TOKEN_DISPATCHER_TYPES,
                       default="allgather",
                       help="Token dispatcher: allgather or alltoall (flex is Megatron-LM's, refused here).")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Capacity of each expert as a multiple of its even share of tokens; tokens beyond it "
                            "are dropped. Unset (or negative): dropless.")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).")
    group.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                       help="Which tokens an expert over capacity keeps: the highest probabilities or the first.")
    return parser
