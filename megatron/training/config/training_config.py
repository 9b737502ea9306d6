"""The training run's settings as typed records (Megatron-LM HEAD's megatron/training/config/training_config.py names).

Each class holds the flags of one parser group of ``megatron/training/arguments.py`` under the flag's
``dest`` (Megatron's field names), plus the values ``validate_args`` derives for it. A setting whose typed
home is ``TransformerConfig``, ``OptimizerConfig`` or ``DistributedDataParallelConfig`` is not repeated
here: there is one home per setting. ``megatron/training/argument_utils.py`` builds them from ``args``.
"""
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, run length, exit conditions and memory housekeeping of the training loop."""

    micro_batch_size: Optional[int] = None
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; ``validate_args`` derives it (micro batch x data-parallel size) when absent."""
    rampup_batch_size: Optional[list] = None
    """``[start, increment, ramp-up samples]`` as integers once validated."""
    decrease_batch_size_if_needed: bool = False
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[int] = None
    exit_signal_handler: bool = False
    exit_signal: Any = "SIGTERM"
    """A ``signal.Signals`` once validated (the flag's name before)."""
    exit_signal_handler_for_training: bool = False
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    empty_unused_memory_level: int = 0


@dataclass(kw_only=True)
class ValidationConfig:
    """When and how much to evaluate."""

    eval_iters: int = 100
    eval_interval: int = 1000
    skip_train: bool = False
    full_validation: bool = False
    eval_global_batch_size: Optional[int] = None
    """Derived: ``--global-batch-size`` when not given."""
    eval_micro_batch_size: Optional[int] = None
    """Derived: ``--micro-batch-size`` when not given."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (peak/min lr live in OptimizerConfig).

    The ``*_steps`` fields are derived once by the builder, in samples, as the scheduler counts them
    (``iterations x --global-batch-size`` for iteration-based runs); the ``lr_decay_iters`` /
    ``lr_decay_samples`` defaults (``--train-iters`` / ``--train-samples``) are filled in too.
    """

    lr_decay_style: str = "linear"
    lr_wsd_decay_style: str = "exponential"
    lr_decay_iters: Optional[int] = None
    lr_decay_samples: Optional[int] = None
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    start_weight_decay: Optional[float] = None
    """Derived: ``--weight-decay`` with ``--weight-decay-incr-style constant``."""
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    lr_warmup_steps: Optional[float] = None
    lr_decay_steps: Optional[int] = None
    wd_incr_steps: Optional[int] = None
    wsd_decay_steps: Optional[int] = None


@dataclass(kw_only=True)
class LoggerConfig:
    """Console log lines, timers, TensorBoard, Weights & Biases and the Python logging level."""

    log_interval: int = 100
    log_params_norm: bool = False
    log_throughput: bool = False
    log_progress: bool = False
    log_energy: bool = False
    log_straggler: bool = False
    straggler_minmax_count: int = 1
    timing_log_level: int = 0
    timing_log_option: str = "minmax"
    tensorboard_dir: Optional[str] = None
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    wandb_project: str = ""
    wandb_exp_name: str = ""
    wandb_save_dir: str = ""
    logging_level: Optional[int] = None


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often to save, what to load, and the format.

    Megatron's positive names: ``save_optim`` is ``not --no-save-optim`` (and so on for the rng and the
    load side); ``verify_checkpoint`` is ``not --no-verify-checkpoint``.
    """

    save: Optional[str] = None
    save_interval: Optional[int] = None
    save_retain_interval: Optional[int] = None
    save_optim: bool = True
    save_rng: bool = True
    load: Optional[str] = None
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False
    pretrained_checkpoint: Optional[str] = None
    ckpt_step: Optional[int] = None
    exit_on_missing_checkpoint: bool = False
    ckpt_format: str = "torch_dist"
    auto_detect_ckpt_format: bool = False
    async_save: Optional[bool] = None
    use_persistent_ckpt_worker: bool = False
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[str] = None
    non_persistent_global_ckpt_dir: Optional[str] = None
    verify_checkpoint: bool = True


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer to build from which files, and the padded vocabulary the model gets.

    ``padded_vocab_size`` is known once the tokenizer is built (``build_tokenizer``), unless given.
    """

    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    vocab_extra_ids: int = 0
    make_vocab_size_divisible_by: int = 128
    padded_vocab_size: Optional[int] = None
    tokenizer_special_tokens: Optional[list] = None
    tiktoken_pattern: Optional[str] = None
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: Optional[list] = None
    null_tokenizer_eod_id: Optional[int] = None
    null_tokenizer_pad_id: int = -1
    trust_remote_code: bool = False
    tokenizer_hf_use_fast: bool = True
    tokenizer_hf_include_special_tokens: bool = True
