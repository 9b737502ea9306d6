"""Why a Megatron-LM flag or choice this project lacks is refused: one line naming it, instead of a "did you mean".

The flag names are data (``megatron_lm_flags.MEGATRON_LM_FLAGS``, generated from Megatron-LM core_v0.14.0's
parser by ``tools/megatron_lm_flag_list.py``); the reasons are grouped by name pattern below. A flag that
this project's parser defines never reaches these rules (argparse accepts it first).
"""
import fnmatch
from typing import Optional

from megatron.training.argument_groups import MOE_TOKEN_DISPATCHER_TYPES, OPTIMIZERS, POSITION_EMBEDDING_TYPES
from megatron.training.megatron_lm_flags import MEGATRON_LM_FLAGS

_FP8 = "FP8 needs Transformer Engine"
_TE = "it configures Transformer Engine, which this project does not ship (--transformer-impl local only)"
_MOE_TE = "it configures Transformer Engine's MoE kernels, which this project does not ship (local experts only)"
_DEEPEP = "DeepEP and the flex token dispatcher are not available (use --moe-token-dispatcher-type allgather or alltoall)"
_MLA = "multi-latent attention (DeepSeek) is not available"
_OTHER_MODELS = "this project pretrains GPT models only (no BERT, T5, retro, vision, Mamba/hybrid or SFT)"
_CKPT_STRATEGY = ("Megatron's dist_checkpointing save/load strategy wrappers are not available (each rank "
                  "already reads and writes only its own shards of a torch_dist checkpoint)")

# (fnmatch pattern of the option string, reason); the first match wins.
UNSUPPORTED_REASONS = (
    ("--fp8-*", _FP8), ("--no-fp8-wgrad", _FP8), ("--keep-fp8-transpose-cache", _FP8),
    ("--first-last-layers-bf16", _FP8), ("--num-layers-at-*-in-bf16", _FP8),
    ("--reuse-grad-buf-for-mxfp8-param-ag", _FP8), ("--kitchen-*", "NVIDIA Kitchen quantization is not available"),
    ("--tp-comm-*", _TE), ("--disable-tp-comm-*", _TE), ("--te-rng-tracker", _TE),
    ("--moe-router-padding-for-fp8", _FP8), ("--moe-router-fusion", _MOE_TE), ("--moe-permute-fusion", _MOE_TE),
    ("--moe-use-legacy-grouped-gemm", "it picks GroupedMLP over Transformer Engine's grouped linear; without Transformer "
                                      "Engine --moe-grouped-gemm is already GroupedMLP"),
    ("--moe-enable-deepep", _DEEPEP), ("--moe-deepep-num-sms", _DEEPEP),
    ("--overlap-moe-expert-parallel-comm", "overlapping the expert-parallel all-to-all with another micro-batch's "
                                           "compute (combined 1F1B) is not available"),
    ("--moe-layer-recompute", "MoE layer recomputation is not available (use --recompute-granularity full)"),
    ("--moe-extended-tp", "extended tensor parallelism for experts is deprecated in Megatron-LM (use "
                          "--expert-tensor-parallel-size)"),
    ("--moe-use-upcycling", "upcycling a dense checkpoint to MoE is not available"),
    ("--moe-upcycling-granularity", "upcycling a dense checkpoint to MoE is not available"),
    ("--moe-router-force-load-balancing", "forced (random) load balancing for benchmarking is not available"),
    ("--moe-apply-probs-on-input", "applying the routing probabilities on the expert input is not available"),
    ("--use-fused-weighted-squared-relu", "the fused weighted squared-ReLU MoE kernel is not available"),
    ("--multi-latent-attention", _MLA), ("--*-lora-rank", _MLA), ("--qk-head-dim", _MLA),
    ("--qk-pos-emb-head-dim", _MLA), ("--v-head-dim", _MLA), ("--cache-mla-latents", _MLA),
    ("--rope-type", _MLA), ("--mscale", _MLA), ("--mscale-all-dim", _MLA), ("--rotary-scaling-factor", _MLA),
    ("--mtp-*", "multi-token prediction is not available"),
    ("--mrope-section", "multimodal RoPE (mrope) is not available"),
    ("--relative-attention-*", "relative position embeddings are not available"),
    ("--no-rope-freq", "per-layer RoPE skipping is not available"),
    ("--qk-l2-norm", "L2-normalized queries and keys are not available (use --qk-layernorm)"),
    ("--use-megatron-fsdp", "Megatron-FSDP is not available"),
    ("--data-parallel-sharding-strategy", "Megatron-FSDP is not available"),
    ("--fsdp-double-buffer", "Megatron-FSDP is not available"),
    ("--no-strict-fsdp-dtensor-load", "Megatron-FSDP is not available"),
    ("--enable-full-sharding-in-hsdp", "Megatron-FSDP is not available"),
    ("--use-nccl-ub", "Megatron-FSDP is not available"),
    ("--suggested-communication-unit-size", "Megatron-FSDP is not available"),
    ("--hierarchical-context-parallel-sizes", "hierarchical context parallelism is not available"),
    ("--ckpt-fully-parallel-*", _CKPT_STRATEGY), ("--no-ckpt-fully-parallel-save", _CKPT_STRATEGY),
    ("--ckpt-assume-constant-structure", _CKPT_STRATEGY),
    ("--ckpt-convert-*", "checkpoint conversion is a separate tool here: tools/checkpoint/convert.py"),
    ("--non-persistent-local-ckpt-*", "local (node-storage) checkpoints are not available"),
    ("--load-model-opt-format", "NVIDIA ModelOpt checkpoints are not available"),
    ("--use-checkpoint-args", "adopting the model flags from a checkpoint is not available"),
    ("--use-mp-args-from-checkpoint-args", "adopting the model flags from a checkpoint is not available"),
    ("--no-use-tokenizer-model-from-checkpoint-args", "adopting the model flags from a checkpoint is not available"),
    ("--optimizer-cpu-offload", "optimizer CPU offload is not available"),
    ("--optimizer-offload-fraction", "optimizer CPU offload is not available"),
    ("--overlap-cpu-optimizer-d2h-h2d", "optimizer CPU offload is not available"),
    ("--use-torch-optimizer-for-cpu-offload", "optimizer CPU offload is not available"),
    ("--no-pin-cpu-*", "optimizer CPU offload is not available"),
    ("--use-precision-aware-optimizer", "the precision-aware optimizer is not available"),
    ("--main-grads-dtype", "the precision-aware optimizer is not available"),
    ("--main-params-dtype", "the precision-aware optimizer is not available"),
    ("--exp-avg-dtype", "the precision-aware optimizer is not available"),
    ("--exp-avg-sq-dtype", "the precision-aware optimizer is not available"),
    ("--num-distributed-optimizer-instances", "several distributed-optimizer instances are not available"),
    ("--overlap-param-gather-with-optimizer-step", "overlapping the parameter gather with the optimizer step "
                                                   "is not available"),
    ("--defer-embedding-wgrad-compute", "deferred weight-gradient computation is not available"),
    ("--wgrad-deferral-limit", "deferred weight-gradient computation is not available"),
    ("--delay-wgrad-compute", "deferred weight-gradient computation is not available"),
    ("--overlap-p2p-communication-warmup-flush", "this pipeline-schedule variant is not available"),
    ("--microbatch-group-size-per-virtual-pipeline-stage", "this pipeline-schedule variant is not available"),
    ("--pipeline-model-parallel-layout", "explicit pipeline layouts are not available (use "
                                         "--decoder-first/last-pipeline-num-layers)"),
    ("--use-ring-exchange-p2p", "this pipeline-schedule variant is not available"),
    ("--pipeline-model-parallel-comm-backend", "NCCL communicator tuning is not available"),
    ("--nccl-communicator-config-path", "NCCL communicator tuning is not available"),
    ("--high-priority-stream-groups", "NCCL communicator tuning is not available"),
    ("--sharp-enabled-group", "NCCL communicator tuning is not available"),
    ("--use-sharp", "NCCL communicator tuning is not available"),
    ("--symmetric-ar-type", "NCCL communicator tuning is not available"),
    ("--disable-gloo-process-groups", "NCCL communicator tuning is not available"),
    ("--ddp-num-buckets", "this DDP bucketing option is not available (use --ddp-bucket-size)"),
    ("--ddp-pad-buckets-for-high-nccl-busbw", "this DDP bucketing option is not available (use --ddp-bucket-size)"),
    ("--no-align-grad-reduce", "this DDP option is not available"),
    ("--no-align-param-gather", "this DDP option is not available"),
    ("--no-gradient-reduce-div-fusion", "this DDP option is not available"),
    ("--enable-cuda-graph", "CUDA graphs are not available"), ("--cuda-graph-*", "CUDA graphs are not available"),
    ("--external-cuda-graph", "CUDA graphs are not available"),
    ("--inference-*", "Megatron's inference engine is not available (see tools/run_text_generation.py)"),
    ("--flash-decode", "Megatron's inference engine is not available"),
    ("--mlp-chunks-for-prefill", "Megatron's inference engine is not available"),
    ("--nccl-all-reduce-for-prefill", "Megatron's inference engine is not available"),
    ("--max-tokens-to-oom", "Megatron's inference engine is not available"),
    ("--inprocess-*", "in-process restart (nvidia-resiliency-ext) is not available"),
    ("--enable-ft-package", "fault tolerance (nvidia-resiliency-ext) is not available"),
    ("--calc-ft-timeouts", "fault tolerance (nvidia-resiliency-ext) is not available"),
    ("--straggler-ctrlr-port", "Megatron's straggler detector is not available (see --log-straggler)"),
    ("--disable-straggler-on-startup", "Megatron's straggler detector is not available (see --log-straggler)"),
    ("--rerun-mode", "the rerun state machine is not available"),
    ("--error-injection-*", "the rerun state machine is not available"),
    ("--result-rejected-tracker-filename", "the rerun state machine is not available"),
    ("--check-for-large-grads", "the rerun state machine is not available"),
    ("--check-for-spiky-loss", "the rerun state machine is not available"),
    ("--check-weight-hash-across-dp-replicas-interval", "the cross-replica weight-hash check is not available"),
    ("--profile*", "the profiler hooks are not available"), ("--use-pytorch-profiler", "the profiler hooks are "
                                                                                       "not available"),
    ("--record-memory-history", "memory snapshots are not available"),
    ("--memory-snapshot-path", "memory snapshots are not available"),
    ("--one-logger-*", "NVIDIA one-logger is not available"), ("--no-one-logger", "NVIDIA one-logger is not available"),
    ("--app-tag-*", "NVIDIA one-logger is not available"),
    ("--config-logger-dir", "the config logger is not available"),
    ("--use-flash-attn", "use --attention-backend flash"),
    ("--use-legacy-models", "only the Megatron Core models exist here"),
    ("--checkpoint-activations", "deprecated in Megatron-LM: use --recompute-activations"),
    ("--batch-size", "deprecated in Megatron-LM: use --micro-batch-size"),
    ("--warmup", "deprecated in Megatron-LM: use --lr-warmup-fraction"),
    ("--model-parallel-size", "deprecated in Megatron-LM: use --tensor-model-parallel-size"),
    ("--heterogeneous-layers-config-*", "heterogeneous layer configurations are not available"),
    ("--mamba-*", _OTHER_MODELS), ("--is-hybrid-model", _OTHER_MODELS), ("--hybrid-*", _OTHER_MODELS),
    ("--disable-mamba-mem-eff-path", _OTHER_MODELS), ("--retro-*", _OTHER_MODELS), ("--bert-*", _OTHER_MODELS),
    ("--ict-*", _OTHER_MODELS), ("--dino-*", _OTHER_MODELS), ("--biencoder-*", _OTHER_MODELS),
    ("--retriever-*", _OTHER_MODELS), ("--vision-*", _OTHER_MODELS), ("--swin-backbone-type", _OTHER_MODELS),
    ("--img-h", _OTHER_MODELS), ("--img-w", _OTHER_MODELS), ("--num-channels", _OTHER_MODELS),
    ("--patch-dim", _OTHER_MODELS), ("--num-classes", _OTHER_MODELS), ("--classes-fraction", _OTHER_MODELS),
    ("--data-per-class-fraction", _OTHER_MODELS), ("--mask-*", _OTHER_MODELS), ("--sft*", _OTHER_MODELS),
    ("--encoder-*", _OTHER_MODELS), ("--decoder-num-layers", _OTHER_MODELS), ("--decoder-seq-length", _OTHER_MODELS),
    ("--short-seq-prob", _OTHER_MODELS), ("--use-one-sent-docs", _OTHER_MODELS), ("--titles-data-path", _OTHER_MODELS),
    ("--evidence-data-path", _OTHER_MODELS), ("--block-data-path", _OTHER_MODELS), ("--embedding-path", _OTHER_MODELS),
    ("--query-in-block-prob", _OTHER_MODELS), ("--output-bert-embeddings", _OTHER_MODELS),
    ("--indexer-*", _OTHER_MODELS), ("--iter-per-epoch", _OTHER_MODELS),
    ("--test-mode", "Megatron-LM's functional-test mode is not available"),
)
_DEFAULT_REASON = "not available in this version"

# Choices of Megatron-LM core_v0.14.0 that the parser lists (so Megatron command lines read the same) but
# this project cannot act on: {dest: (flag, {value: reason})}; refused by parse_args, one line.
UNSUPPORTED_CHOICES = {
    "position_embedding_type": ("--position-embedding-type", {
        "yarn": "YaRN RoPE scaling is not available",
        "mrope": "multimodal RoPE is not available",
        "relative": "relative position embeddings are not available",
    }),
    "optimizer": ("--optimizer", {
        "muon": "Muon is not available", "dist_muon": "Muon is not available",
        "adaptive_muon": "Muon is not available", "lion": "Lion is not available", "soap": "SOAP is not available",
    }),
    "moe_token_dispatcher_type": ("--moe-token-dispatcher-type", {
        "flex": "the flex dispatcher needs DeepEP, which is not available",
    }),
}


def megatron_flag_reason(flag: str) -> Optional[str]:
    """The reason this project refuses ``flag`` (an option string, ``--x`` or ``--x=value``) when it is one of
    Megatron-LM's flags; None when Megatron-LM does not have it (a typo, another program's flag)."""
    name = flag.split("=", 1)[0]
    if name not in MEGATRON_LM_FLAGS:
        return None
    for pattern, reason in UNSUPPORTED_REASONS:
        if fnmatch.fnmatchcase(name, pattern):
            return reason
    return _DEFAULT_REASON


def unsupported_flag_line(unknown) -> Optional[str]:
    """One line for the first Megatron-LM flag among the unknown argv words (the others counted), or None."""
    flags = [word.split("=", 1)[0] for word in unknown if word.startswith("--")]
    known = [flag for flag in flags if megatron_flag_reason(flag) is not None]
    if not known:
        return None
    line = f"{known[0]} is a Megatron-LM flag that this project does not support: {megatron_flag_reason(known[0])}"
    if len(known) > 1:
        line += f" (also unsupported: {', '.join(known[1:])})"
    return line


def unsupported_choice_line(args, choices=None) -> Optional[str]:
    """One line for the first flag of ``args`` set to a Megatron-LM choice this project lacks, or None."""
    for dest, (flag, refused) in (choices or UNSUPPORTED_CHOICES).items():
        value = getattr(args, dest, None)
        if value in refused:
            return (f"{flag} {value} is a Megatron-LM choice that this project does not support: {refused[value]}; "
                    f"choose one of {', '.join(_supported(args, dest, refused))}")
    return None


def _supported(args, dest, refused):
    listed = {"optimizer": OPTIMIZERS, "position_embedding_type": POSITION_EMBEDDING_TYPES,
              "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER_TYPES}.get(dest, ())
    return [value for value in listed if value not in refused]
