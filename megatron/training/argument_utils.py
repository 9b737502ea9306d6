"""The one adapter from parsed ``args`` to the typed configs (Megatron-LM HEAD's module name).

``pretrain_cfg_container_from_args`` turns the validated ``argparse.Namespace`` into a
``PretrainConfigContainer`` once; the other builders here make each core config (TransformerConfig,
OptimizerConfig, the DDP config, GPTDatasetConfig, TelemetryConfig). No other module reads ``args`` to
configure the run: code below the Megatron-signature entry points takes its slice of the container.

Fields are copied by name (``dataclasses.fields``) where the flag's dest is the field's name;
``RENAMED_FLAGS`` lists, explicitly, every flag that reaches a config under another name, and
``ARGUMENTS_ONLY_FLAGS`` every flag that reaches no config (with why), so that a new flag cannot be
forgotten (``tests/test_config_container.py`` checks that every parser dest is accounted for).
"""
import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
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
    "num_experts": "refused by validate_args (no mixture of experts in this version)",
    "no_persist_layer_norm": "no effect: there is no persistent layer-norm kernel (Megatron compatibility)",
    "use_mcore_models": "deprecated no-op; validate_args warns",
    "cross_entropy_loss_fusion": "no effect: one vocab-parallel cross entropy (Megatron compatibility)",
    "transformer_impl": "validate_args accepts only 'local'",
    "head_lr_mult": "validate_args accepts only the default 1.0",
    "scatter_gather_tensors_in_pipeline": "no effect (Megatron-LM core_v0.14 does not use it either)",
    "deprecated_use_dist_ckpt": "deprecated no-op; validate_args warns",
    "dist_ckpt_format_deprecated": "deprecated no-op; validate_args warns",
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
    """The DistributedDataParallelConfig of the run (Megatron's flag -> field translations)."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )


def telemetry_config_from_args(args):
    """``TelemetryConfig.from_env(MEGATRON_OTEL, fallback NEMO_LENS)`` with the CLI overrides
    ``--otel-enabled`` (only turns on), ``--otel-service-name`` and ``--otel-span-groups``, validated.
    Raises ``ValueError`` naming the variable or flag for any bad value."""
    from megatron.core.telemetry.args_integration import load_config_from_args

    return load_config_from_args(args)


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


def _checkpoint_config_from_args(args) -> CheckpointConfig:
    return _fields_from_args(
        CheckpointConfig, args,
        save_optim=not getattr(args, "no_save_optim", None),
        save_rng=not getattr(args, "no_save_rng", None),
        load_optim=not getattr(args, "no_load_optim", None),
        load_rng=not getattr(args, "no_load_rng", None),
        verify_checkpoint=not getattr(args, "no_verify_checkpoint", False),
    )


def pretrain_cfg_container_from_args(args) -> PretrainConfigContainer:
    """The run's PretrainConfigContainer from ``args`` after ``validate_args`` (and, for
    ``tokenizer.padded_vocab_size``, after the tokenizer is built).

    Reads ``args`` and nothing else (the telemetry slice also reads the MEGATRON_OTEL_* environment);
    writes nothing to it. Derived values (data-parallel size, dtypes, eval batch sizes, the scheduler's
    lengths) are taken from what ``validate_args`` derived or computed here once.
    """
    return PretrainConfigContainer(
        train=_fields_from_args(TrainingConfig, args),
        validation=_fields_from_args(ValidationConfig, args),
        model=core_transformer_config_from_args(args),
        gpt=_fields_from_args(GPTModelProviderConfig, args),
        optimizer=optimizer_config_from_args(args),
        scheduler=_fields_from_args(SchedulerConfig, args, **_scheduler_steps(args)),
        ddp=ddp_config_from_args(args),
        dist=_fields_from_args(DistributedInitConfig, args),
        rng=_fields_from_args(RNGConfig, args),
        logger=_fields_from_args(LoggerConfig, args),
        checkpoint=_checkpoint_config_from_args(args),
        tokenizer=_fields_from_args(TokenizerConfig, args),
        data=data_config_from_args(args),
        telemetry=telemetry_config_from_args(args),
    )
