"""The one adapter from parsed ``args`` to the typed configs (Megatron-LM HEAD's module name).

``pretrain_cfg_container_from_args`` turns the validated ``argparse.Namespace`` into a
``PretrainConfigContainer`` once; the other builders here make each core config (TransformerConfig,
OptimizerConfig, the DDP config, GPTDatasetConfig, TelemetryConfig). No other module reads ``args`` to
configure the run: code below the Megatron-signature entry points takes its slice of the container.

Fields are copied by name (``dataclasses.fields``) where the flag's dest is the field's name;
``RENAMED_FLAGS`` lists, explicitly, every flag that reaches a config under another name, and
``ARGUMENTS_ONLY_FLAGS`` every flag that reaches no config (with why), so that a new flag cannot be
forgotten (``tests/test_config_container.py`` checks that every parser dest is accounted for).

Also here, because they read ``args``: the per-slice builders ``validate_args`` uses to apply each
config's ``validate()`` rules, and the telemetry glue moved out of core (resource attributes, the
async-checkpoint worker's bootstrap, ``setup_telemetry_from_args``).
"""
import dataclasses
import os
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallelConfig
from megatron.core.num_microbatches_calculator import build_num_microbatches_calculator
from megatron.core.optimizer import OptimizerConfig
from megatron.core.telemetry.config import TelemetryConfig
from megatron.core.telemetry.groups import SpanGroup
from megatron.core.telemetry.resources import compute_job_uuids, detect_gpu_identity, slurm_identity_attributes
from megatron.core.telemetry.setup import parallel_rank_attributes, setup_telemetry_from_config
from megatron.core.telemetry.span_groups import MegatronSpanGroup
from megatron.training.config.common_config import DistributedInitConfig, RNGConfig
from megatron.training.config.container import PretrainConfigContainer
from megatron.training.config.data_config import DataConfig
from megatron.training.config.model_config import GPTModelProviderConfig
from megatron.training.config.training_config import (
    CheckpointConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)

# Flags whose value reaches a config field of another name: {dest: "slice.field"}.
RENAMED_FLAGS = {
    "num_experts": "model.num_moe_experts",
    "norm_epsilon": "model.layernorm_epsilon",
    "apply_layernorm_1p": "model.layernorm_zero_centered_gamma",
    "swiglu": "model.gated_linear_unit",  # and model.activation_func = F.silu
    "squared_relu": "model.activation_func",
    "openai_gelu": "model.activation_func",
    "bias_gelu_fusion": "model.bias_activation_fusion",
    "bias_swiglu_fusion": "model.bias_activation_fusion",
    "group_query_attention": "model.num_query_groups",  # None without it
    "decoder_first_pipeline_num_layers": "model.num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "model.num_layers_in_last_pipeline_stage",
    "num_layers_per_virtual_pipeline_stage": "model.virtual_pipeline_model_parallel_size",
    "num_virtual_stages_per_pipeline_rank": "model.virtual_pipeline_model_parallel_size",
    "recompute_activations": "model.recompute_granularity",  # validate_args: "selective"
    "use_rotary_position_embeddings": "gpt.position_embedding_type",  # validate_args: "rope"
    "add_position_embedding": "gpt.position_embedding_type",  # --no-position-embedding: refused unless rope
    "accumulate_allreduce_grads_in_fp32": "ddp.grad_reduce_in_fp32",
    "grad_reduce_in_bf16": "ddp.grad_reduce_in_fp32",  # keeps validate_args from turning fp32 reduction on
    "check_for_nan_in_loss_and_grad": "ddp.check_for_nan_in_grad",
    "ddp_bucket_size": "ddp.bucket_size",
    "ddp_average_in_collective": "ddp.average_in_collective",
    "no_save_optim": "checkpoint.save_optim",
    "no_save_rng": "checkpoint.save_rng",
    "no_load_optim": "checkpoint.load_optim",
    "no_load_rng": "checkpoint.load_rng",
    "no_verify_checkpoint": "checkpoint.verify_checkpoint",
    "otel_enabled": "telemetry.enabled",
    "otel_service_name": "telemetry.service_name",
    "otel_span_groups": "telemetry.span_groups",
}

# Flags that reach no config: read only by arguments.py (validation) or here. {dest: why}.
ARGUMENTS_ONLY_FLAGS = {
    "no_persist_layer_norm": "no effect: there is no persistent layer-norm kernel (Megatron compatibility)",
    "use_mcore_models": "deprecated no-op; validate_args warns",
    "cross_entropy_loss_fusion": "no effect: one vocab-parallel cross entropy (Megatron compatibility)",
    "transformer_impl": "validate_args accepts only 'local'",
    "head_lr_mult": "validate_args accepts only the default 1.0",
    "scatter_gather_tensors_in_pipeline": "no effect (Megatron-LM core_v0.14 does not use it either)",
    "deprecated_use_dist_ckpt": "deprecated no-op; validate_args warns",
    "dist_ckpt_format_deprecated": "deprecated no-op; validate_args warns",
    "use_torch_fsdp2": "makes the ddp slice a TorchFullyShardedDataParallelConfig (get_model wraps with FSDP2)",
    "torch_fsdp2_reshard_after_forward": "ddp.reshard_after_forward of the TorchFullyShardedDataParallelConfig "
                                         "(--use-torch-fsdp2 only)",
}


def _fields_from_args(config_class, args, **explicit):
    """``config_class(**kwargs)`` from every args attribute named like one of its init fields, then ``explicit``."""
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
    kwargs.update(explicit)
    return config_class(**kwargs)


# ---------------------------------------------------------------------------------------------------
# args -> TransformerConfig (moved here from arguments.py, which re-exports it)
# ---------------------------------------------------------------------------------------------------

def _squared_relu(x):
    """ReLU(x)^2 (Primer, So et al. 2021, section 2)."""
    return torch.pow(F.relu(x), 2)


def _openai_gelu(x):
    """GeLU with the tanh approximation used by OpenAI GPT (Hendrycks & Gimpel 2016, section 2)."""
    return F.gelu(x, approximate="tanh")


def core_transformer_config_from_args(args, config_class=None):
    """Build a TransformerConfig from validated args.

    Every args attribute whose name is a field of ``config_class`` is copied; then Megatron's
    translations are applied (only for fields the class has): persist_layer_norm,
    layernorm_zero_centered_gamma (--apply-layernorm-1p), layernorm_epsilon (--norm-epsilon),
    deallocate_pipeline_outputs, pipeline_dtype (= params_dtype), batch_p2p_comm, the activation
    (SiLU + gated for --swiglu, squared ReLU, tanh GeLU), num_query_groups (None without
    --group-query-attention) and the xavier-uniform init methods.

    Args:
        args: the Namespace returned by validate_args.
        config_class: a dataclass; default megatron.core.transformer.transformer_config.TransformerConfig.
    Raises TypeError if ``config_class`` is not a dataclass.
    """
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    if not dataclasses.is_dataclass(config_class):
        raise TypeError(f"config_class {config_class!r} is not a dataclass")
    fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    kw_args = {name: getattr(args, name) for name in fields if hasattr(args, name)}

    special = {
        "persist_layer_norm": not getattr(args, "no_persist_layer_norm", False),
        "layernorm_zero_centered_gamma": getattr(args, "apply_layernorm_1p", False),
        "layernorm_epsilon": getattr(args, "norm_epsilon", 1e-5),
        "deallocate_pipeline_outputs": True,
        "pipeline_dtype": getattr(args, "params_dtype", torch.float),
        "batch_p2p_comm": not getattr(args, "overlap_p2p_comm", True),
        "num_moe_experts": getattr(args, "num_experts", None),
        "num_layers_in_first_pipeline_stage": getattr(args, "decoder_first_pipeline_num_layers", None),
        "num_layers_in_last_pipeline_stage": getattr(args, "decoder_last_pipeline_num_layers", None),
        "num_query_groups": args.num_query_groups if getattr(args, "group_query_attention", False) else None,
    }
    cp_comm_type = getattr(args, "cp_comm_type", None)
    if isinstance(cp_comm_type, (list, tuple)):
        # Megatron: one value applies to every layer (a str); several are one per layer (a list).
        special["cp_comm_type"] = cp_comm_type[0] if len(cp_comm_type) == 1 else list(cp_comm_type)
    if getattr(args, "swiglu", False):
        special["activation_func"] = F.silu
        special["gated_linear_unit"] = True
        special["bias_activation_fusion"] = getattr(args, "bias_swiglu_fusion", True)
    else:
        special["bias_activation_fusion"] = getattr(args, "bias_gelu_fusion", True)
    if getattr(args, "squared_relu", False):
        special["activation_func"] = _squared_relu
    if getattr(args, "openai_gelu", False):
        special["activation_func"] = _openai_gelu
    # A config that knows init_method_xavier_uniform builds its own (TP-aware) xavier init.
    if getattr(args, "init_method_xavier_uniform", False) and "init_method_xavier_uniform" not in fields:
        special["init_method"] = torch.nn.init.xavier_uniform_
        special["output_layer_init_method"] = torch.nn.init.xavier_uniform_
        special["scaled_init_method"] = torch.nn.init.xavier_uniform_
    kw_args.update({name: value for name, value in special.items() if name in fields})
    return config_class(**kw_args)


# ---------------------------------------------------------------------------------------------------
# The other core configs
# ---------------------------------------------------------------------------------------------------

def optimizer_config_from_args(args) -> OptimizerConfig:
    """OptimizerConfig from every args attribute that names one of its fields."""
    return _fields_from_args(OptimizerConfig, args)


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig of the run (Megatron's flag -> field translations); with
    ``--use-torch-fsdp2`` its subclass TorchFullyShardedDataParallelConfig (``reshard_after_forward``).

    A flag missing from ``args`` (a checkpoint's args from an older version) keeps the field's default.
    """
    renamed = {"accumulate_allreduce_grads_in_fp32": "grad_reduce_in_fp32",
               "check_for_nan_in_loss_and_grad": "check_for_nan_in_grad",
               "ddp_bucket_size": "bucket_size", "ddp_average_in_collective": "average_in_collective"}
    explicit = {field: getattr(args, dest) for dest, field in renamed.items() if hasattr(args, dest)}
    if getattr(args, "use_torch_fsdp2", False):
        explicit["reshard_after_forward"] = getattr(args, "torch_fsdp2_reshard_after_forward", True)
        return _fields_from_args(TorchFullyShardedDataParallelConfig, args, **explicit)
    return _fields_from_args(DistributedDataParallelConfig, args, **explicit)


# ---------------------------------------------------------------------------------------------------
# Telemetry (moved here from megatron/core/telemetry/args_integration.py: core reads no args)
# ---------------------------------------------------------------------------------------------------

def telemetry_config_from_args(args) -> TelemetryConfig:
    """``TelemetryConfig.from_env(MEGATRON_OTEL, fallback NEMO_LENS)`` with the CLI overrides
    ``--otel-enabled`` (only turns on), ``--otel-service-name`` and ``--otel-span-groups``, validated.
    Raises ``ValueError`` naming the variable or flag for any bad value."""
    config = TelemetryConfig.from_env(prefix="MEGATRON_OTEL", fallback_prefix="NEMO_LENS",
                                      span_group_cls=MegatronSpanGroup)
    config = config.with_overrides(
        enabled=True if getattr(args, "otel_enabled", False) else None,
        service_name=getattr(args, "otel_service_name", None),
        span_groups=getattr(args, "otel_span_groups", None),
    )
    return config.validate()


load_config_from_args = telemetry_config_from_args  # its name in megatron.core.telemetry before the move


def _precision(args) -> str:
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32"


def _data_parallel_size(args) -> Optional[int]:
    dp = getattr(args, "data_parallel_size", None)
    if dp is not None:
        return int(dp)
    world = getattr(args, "world_size", None)
    if world is None:
        return None
    model_parallel = (int(getattr(args, "tensor_model_parallel_size", 1) or 1)
                      * int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
                      * int(getattr(args, "context_parallel_size", 1) or 1))
    return int(world) // model_parallel


def build_telemetry_resource_attrs(args, local_rank: Optional[int] = None) -> Dict[str, Any]:
    """Resource attributes derived from the training arguments, keys in the order of spec appendix
    A.1: ``dl.local_rank``, parallel sizes, ``dl.batch_size`` (global), ``dl.sequence_length``, the
    ``megatron.*`` model/run settings (skipped when ``None``), ``megatron.precision``, this rank's
    NVML GPU identity, SLURM/NVRx identity, and ``nemo.lens.job_uuid``/``run_uuid``.

    Shared by the training process and the async-checkpoint worker so the two cannot drift.
    ``local_rank`` overrides ``args.local_rank`` (else ``LOCAL_RANK``, else 0). Never raises for a
    missing optional argument; a missing GPU or driver just omits ``dl.gpu.*``.
    """
    if local_rank is None:
        local_rank = getattr(args, "local_rank", None)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    attrs: Dict[str, Any] = {"dl.local_rank": int(local_rank)}
    for key, value in (
        ("dl.tensor_parallel.size", getattr(args, "tensor_model_parallel_size", None)),
        ("dl.pipeline_parallel.size", getattr(args, "pipeline_model_parallel_size", None)),
        ("dl.data_parallel.size", _data_parallel_size(args)),
        ("dl.batch_size", getattr(args, "global_batch_size", None)),
        ("dl.sequence_length", getattr(args, "seq_length", None)),
    ):
        if value is not None:
            attrs[key] = int(value)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "train_iters", "micro_batch_size", "ckpt_format"):
        value = getattr(args, name, None)
        if value is not None:
            attrs[f"megatron.{name}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    attrs["megatron.precision"] = _precision(args)
    attrs.update(detect_gpu_identity(int(local_rank)))
    attrs.update(slurm_identity_attributes())
    job_uuid, run_uuid = compute_job_uuids()
    attrs["nemo.lens.job_uuid"] = job_uuid
    attrs["nemo.lens.run_uuid"] = run_uuid
    return attrs


def build_otel_worker_bootstrap(args) -> Dict[str, Any]:
    """Plain, picklable dict from which a persistent async-checkpoint worker rebuilds the same
    telemetry identity (spec appendix A.2): ``enabled``, ``service_name``, ``span_groups`` (only
    base-``SpanGroup`` names, ``default`` if none remain, ``per_step`` if the spec cannot be
    resolved), ``resolved_span_groups`` (sorted, or ``None``), ``rank``, ``world_size`` and
    ``resource_attrs`` (empty when disabled)."""
    enabled = bool(getattr(args, "otel_enabled", False))
    service_name = getattr(args, "otel_service_name", None)
    if not service_name:
        service_name = "megatron-lm" if not os.environ.get("OTEL_SERVICE_NAME") else None
    spec = getattr(args, "otel_span_groups", None)
    if spec is None:
        spec = (os.environ.get("MEGATRON_OTEL_SPAN_GROUPS", "").strip()
                or os.environ.get("NEMO_LENS_SPAN_GROUPS", "").strip() or "default")
    try:
        resolved = MegatronSpanGroup.resolve(spec)
        base = sorted(resolved & SpanGroup.groups())
        span_groups = ",".join(base) if base else "default"
        resolved_list = sorted(resolved)
    except Exception:
        span_groups, resolved_list = "per_step", None
    return {
        "enabled": enabled,
        "service_name": service_name,
        "span_groups": span_groups,
        "resolved_span_groups": resolved_list,
        "rank": getattr(args, "rank", None),
        "world_size": getattr(args, "world_size", None),
        "resource_attrs": build_telemetry_resource_attrs(args) if enabled else {},
    }


def setup_telemetry_from_args(args, rank: int, world_size: int, local_rank: Optional[int] = None,
                              config: Optional[TelemetryConfig] = None):
    """What ``global_vars.set_telemetry()`` does (spec section 1): load and validate the config on
    every rank (``ValueError`` on bad settings, before any model is built; ``config`` when it is built
    already), build resource attributes only when enabled and this rank exports (no NVML probe
    otherwise), call ``setup_telemetry``, and start the logging bridge when enabled, logs on, and this
    rank exports.

    Returns the ``TelemetryHandle``, or ``None`` after one warning when OpenTelemetry cannot be
    imported (training then runs unchanged).
    """
    if config is None:
        config = telemetry_config_from_args(args)

    def resource_attributes():
        # Looked up at call time: tests replace build_telemetry_resource_attrs to see whether it runs.
        attrs = build_telemetry_resource_attrs(args, local_rank=local_rank)
        attrs.update(parallel_rank_attributes())
        return attrs

    return setup_telemetry_from_config(config, rank, world_size, resource_attributes)


def data_config_from_args(args) -> DataConfig:
    """The data flags as a DataConfig (``DataConfig.to_gpt_dataset_config`` builds the core dataset config)."""
    return _fields_from_args(DataConfig, args)


def core_gpt_dataset_config_from_args(args, tokenizer):
    """GPTDatasetConfig from the data flags, the seed, ``tokenizer`` and the padded vocabulary.

    ``pretrain_gpt.core_gpt_dataset_config_from_args(args)`` passes the global tokenizer.
    """
    return data_config_from_args(args).to_gpt_dataset_config(
        tokenizer, seed=args.seed, vocab_size=getattr(args, "padded_vocab_size", None))


# ---------------------------------------------------------------------------------------------------
# The training configs
# ---------------------------------------------------------------------------------------------------

def _scheduler_steps(args):
    """The scheduler's lengths in samples (what training.get_optimizer_param_scheduler computes):
    ``lr_decay_iters/samples`` with their defaults, warmup, decay, weight-decay and WSD steps."""
    gbs = getattr(args, "global_batch_size", None)
    train_iters, train_samples = getattr(args, "train_iters", None), getattr(args, "train_samples", None)
    fraction = getattr(args, "lr_warmup_fraction", None)
    out = {}
    if train_samples is None:
        decay_iters = args.lr_decay_iters if getattr(args, "lr_decay_iters", None) is not None else train_iters
        out["lr_decay_iters"] = decay_iters
        if gbs is None or train_iters is None:
            return out
        out["lr_decay_steps"] = decay_iters * gbs
        out["wd_incr_steps"] = train_iters * gbs
        wsd_iters = getattr(args, "lr_wsd_decay_iters", None)
        out["wsd_decay_steps"] = wsd_iters * gbs if wsd_iters else None
        out["lr_warmup_steps"] = (fraction * out["lr_decay_steps"] if fraction is not None
                                  else getattr(args, "lr_warmup_iters", 0) * gbs)
    else:
        decay_samples = args.lr_decay_samples if getattr(args, "lr_decay_samples", None) is not None \
            else train_samples
        out["lr_decay_samples"] = decay_samples
        out["lr_decay_steps"] = decay_samples
        out["wd_incr_steps"] = train_samples
        out["wsd_decay_steps"] = getattr(args, "lr_wsd_decay_samples", None)
        out["lr_warmup_steps"] = (fraction * decay_samples if fraction is not None
                                  else getattr(args, "lr_warmup_samples", 0))
    return out


def train_iters_for_samples(args) -> int:
    """Iterations that ``--train-samples`` allows: each iteration consumes the global batch of the
    batch-size schedule at that point (``--rampup-batch-size``), and only whole batches that fit in
    ``--train-samples`` run (a partial last batch is dropped, as Megatron-LM does for a constant batch).
    """
    calculator = build_num_microbatches_calculator(
        -1, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
        args.decrease_batch_size_if_needed)
    rampup_samples = args.rampup_batch_size[2] if args.rampup_batch_size is not None else -1
    iterations = consumed = 0
    while consumed <= rampup_samples:  # the ramp: batch sizes change, count iteration by iteration
        calculator.update(consumed)
        batch = calculator.get_current_running_global_batch_size()
        if consumed + batch > args.train_samples:
            return iterations
        consumed += batch
        iterations += 1
    calculator.update(consumed)
    return iterations + (args.train_samples - consumed) // calculator.get_current_running_global_batch_size()


def _train_iters(args):
    """A ``--train-samples`` run counts iterations too: ``train_iters`` derived once, here."""
    if getattr(args, "train_iters", None) is None and getattr(args, "train_samples", None) is not None:
        return {"train_iters": train_iters_for_samples(args)}
    return {}


def tokenizer_config_from_args(args) -> TokenizerConfig:
    """The TokenizerConfig of ``args`` (every field copied by name)."""
    return _fields_from_args(TokenizerConfig, args)


def tokenizer_settings_from_args(args):
    """``(TokenizerConfig, tensor-parallel size, rank)`` from ``args`` for Megatron-style callers of the
    tokenizer factory (a flag missing from ``args`` keeps its default: tp 1, rank 0)."""
    return (tokenizer_config_from_args(args), getattr(args, "tensor_model_parallel_size", 1),
            getattr(args, "rank", 0))


def training_config_from_args(args) -> TrainingConfig:
    """The TrainingConfig of ``args`` (every field copied by name)."""
    return _fields_from_args(TrainingConfig, args)


def scheduler_config_from_args(args) -> SchedulerConfig:
    """The SchedulerConfig of ``args``, with the lengths in samples derived once (``_scheduler_steps``)."""
    return _fields_from_args(SchedulerConfig, args, **_scheduler_steps(args))


def logger_config_from_args(args) -> LoggerConfig:
    """The LoggerConfig of ``args`` (every field copied by name)."""
    return _fields_from_args(LoggerConfig, args)


def rng_config_from_args(args) -> RNGConfig:
    """The RNGConfig of ``args`` (every field copied by name)."""
    return _fields_from_args(RNGConfig, args)


def checkpoint_config_from_args(args) -> CheckpointConfig:
    """The CheckpointConfig of ``args``: Megatron's positive names for the ``--no-*`` flags."""
    return _fields_from_args(
        CheckpointConfig, args,
        save_optim=not getattr(args, "no_save_optim", None),
        save_rng=not getattr(args, "no_save_rng", None),
        load_optim=not getattr(args, "no_load_optim", None),
        load_rng=not getattr(args, "no_load_rng", None),
        verify_checkpoint=not getattr(args, "no_verify_checkpoint", False),
    )


def pretrain_cfg_container_from_args(args, with_telemetry: bool = True) -> PretrainConfigContainer:
    """The run's PretrainConfigContainer from ``args`` after ``validate_args`` (and, for
    ``tokenizer.padded_vocab_size``, after the tokenizer is built).

    Reads ``args`` and nothing else (the telemetry slice also reads the MEGATRON_OTEL_* environment and
    is validated first, so a bad variable fails before anything else; ``with_telemetry=False`` leaves
    the default, disabled TelemetryConfig, for callers that only want the model's shape, such as the
    memory estimate of a checkpoint's args); writes nothing to it. Derived values (data-parallel size,
    dtypes, eval batch sizes, the scheduler's lengths) are taken from what ``validate_args`` derived or
    computed here once.
    """
    telemetry = telemetry_config_from_args(args) if with_telemetry else TelemetryConfig()
    return PretrainConfigContainer(
        train=dataclasses.replace(training_config_from_args(args), **_train_iters(args)),
        validation=_fields_from_args(ValidationConfig, args),
        model=core_transformer_config_from_args(args),
        gpt=_fields_from_args(GPTModelProviderConfig, args),
        optimizer=optimizer_config_from_args(args),
        scheduler=scheduler_config_from_args(args),
        ddp=ddp_config_from_args(args),
        dist=_fields_from_args(DistributedInitConfig, args),
        rng=rng_config_from_args(args),
        logger=logger_config_from_args(args),
        checkpoint=checkpoint_config_from_args(args),
        tokenizer=tokenizer_config_from_args(args),
        data=data_config_from_args(args),
        telemetry=telemetry,
    )
