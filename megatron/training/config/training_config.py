"""The training run's settings as typed records (Megatron-LM HEAD's megatron/training/config/training_config.py names).

Each class holds the flags of one parser group of ``megatron/training/arguments.py`` under the flag's
``dest`` (Megatron's field names), plus the values ``validate_args`` derives for it. A setting whose typed
home is ``TransformerConfig``, ``OptimizerConfig`` or ``DistributedDataParallelConfig`` is not repeated
here: there is one home per setting. ``megatron/training/argument_utils.py`` builds them from ``args``.
"""
import os
from dataclasses import dataclass
from typing import Any, Optional


def _require(condition, message):
    if not condition:
        raise ValueError(message)


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

    def validate(self, train: "TrainingConfig", lr: Optional[float], min_lr: float, skip_train: bool) -> None:
        """The schedule's flags against each other and the run's length (``train``), peak ``lr`` and
        ``min_lr``, as ``validate_args`` checks them; ValueError naming the flags."""
        train_iters, train_samples = train.train_iters, train.train_samples
        _require((train_iters is None) != (train_samples is None),
                 "exactly one of --train-iters and --train-samples must be given "
                 f"(got --train-iters {train_iters}, --train-samples {train_samples})")
        if train_iters is not None:
            _require(self.lr_decay_samples is None, "--lr-decay-samples needs sample-based training "
                                                    "(--train-samples); use --lr-decay-iters with --train-iters")
            _require(self.lr_warmup_samples == 0, "--lr-warmup-samples needs sample-based training "
                                                  "(--train-samples); use --lr-warmup-iters with --train-iters")
            _require(self.lr_wsd_decay_samples is None, "--lr-wsd-decay-samples needs sample-based training; "
                                                        "use --lr-wsd-decay-iters with --train-iters")
            if self.lr_warmup_fraction is not None:
                _require(self.lr_warmup_iters == 0,
                         "can only specify one of --lr-warmup-fraction and --lr-warmup-iters")
        else:
            _require(self.lr_decay_iters is None, "--lr-decay-iters needs iteration-based training "
                                                  "(--train-iters); use --lr-decay-samples with --train-samples")
            _require(self.lr_warmup_iters == 0, "--lr-warmup-iters needs iteration-based training (--train-iters); "
                                                "use --lr-warmup-samples with --train-samples")
            _require(self.lr_wsd_decay_iters is None, "--lr-wsd-decay-iters needs iteration-based training; "
                                                      "use --lr-wsd-decay-samples with --train-samples")
            if self.lr_warmup_fraction is not None:
                _require(self.lr_warmup_samples == 0,
                         "can only specify one of --lr-warmup-fraction and --lr-warmup-samples")
        if not skip_train:
            _require(lr is not None, "--lr is required for training")
            # The scheduler counts in samples; say it in the flags the user gave.
            if self.lr_warmup_fraction is None and train_iters is not None and self.lr_warmup_iters > 0:
                decay = self.lr_decay_iters if self.lr_decay_iters is not None else train_iters
                _require(self.lr_warmup_iters < decay,
                         f"--lr-warmup-iters ({self.lr_warmup_iters}) must be smaller than --lr-decay-iters "
                         f"({decay}; it defaults to --train-iters)")
            if self.lr_warmup_fraction is None and train_samples is not None and self.lr_warmup_samples > 0:
                decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
                _require(self.lr_warmup_samples < decay,
                         f"--lr-warmup-samples ({self.lr_warmup_samples}) must be smaller than --lr-decay-samples "
                         f"({decay}; it defaults to --train-samples)")
        if lr is not None:
            _require(min_lr <= lr, f"--min-lr ({min_lr}) must be <= --lr ({lr})")
        _require(not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
                 "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive")
        if self.weight_decay_incr_style == "constant":
            _require(self.start_weight_decay is None and self.end_weight_decay is None,
                     "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine")
        else:
            _require(self.start_weight_decay is not None and self.end_weight_decay is not None,
                     f"--weight-decay-incr-style {self.weight_decay_incr_style} needs --start-weight-decay "
                     "and --end-weight-decay")


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
    # Troubleshooting (docs/observability.md): heartbeat threshold of the hang report (s, 0 = off) and the
    # factor over the running median step time that makes a step "slow" (0 = off).
    hang_report_seconds: float = 600
    slow_step_factor: float = 3.0

    def validate(self, save: Optional[str] = None) -> None:
        """``--wandb-*``: the package must be importable and the run named; the other two need
        --wandb-project; files need a directory (``save``: the checkpoint directory). ``--hang-report-seconds``
        must be 0 or in [1, inf) and ``--slow-step-factor`` 0 or in (1, inf). ValueError naming them."""
        _require(self.hang_report_seconds >= 0,
                 f"--hang-report-seconds must be >= 0 (0 turns the hang report off), got {self.hang_report_seconds:g}")
        # Peers beat every N/5 s but at least every 0.2 s: below 1 s a live rank between two beats looks stopped.
        _require(self.hang_report_seconds == 0 or 1 <= self.hang_report_seconds < float("inf"),
                 "--hang-report-seconds must be 0 (off) or a finite number of seconds >= 1 (heartbeats come at most "
                 f"every 0.2 s, so a shorter threshold reports live ranks), got {self.hang_report_seconds:g}")
        _require(self.slow_step_factor == 0 or 1 < self.slow_step_factor < float("inf"),
                 f"--slow-step-factor must be > 1 (or 0 to turn slow-step lines off), got {self.slow_step_factor:g}")
        if not self.wandb_project:
            for flag, value in (("--wandb-exp-name", self.wandb_exp_name), ("--wandb-save-dir", self.wandb_save_dir)):
                _require(not value, f"{flag} needs --wandb-project (without it nothing is logged to Weights & Biases)")
            return
        try:
            import wandb

            del wandb  # only whether it imports matters here
        except ImportError:
            raise ValueError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                             "(or remove --wandb-project/--wandb-exp-name/--wandb-save-dir)") from None
        _require(bool(self.wandb_exp_name), "--wandb-project needs --wandb-exp-name (the Weights & Biases run name)")
        _require(bool(self.wandb_save_dir or save),
                 "--wandb-project needs --wandb-save-dir or --save (W&B files go to <--save>/wandb by default)")


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
    dist_ckpt_strictness: str = "assume_ok_unexpected"
    auto_detect_ckpt_format: bool = False
    async_save: Optional[bool] = None
    use_persistent_ckpt_worker: bool = False
    non_persistent_save_interval: Optional[int] = None
    non_persistent_ckpt_type: Optional[str] = None
    non_persistent_global_ckpt_dir: Optional[str] = None
    verify_checkpoint: bool = True

    def validate(self) -> None:
        """The checkpoint flags against each other (and ``--save`` against the file system, found now rather
        than at the first save, after the training it was meant to keep). ValueError naming the flags."""
        if self.save is not None:
            _require(self.save_interval is not None, "--save requires --save-interval")
            blocker = non_directory_ancestor(self.save)
            _require(blocker is None, f"--save {self.save}: {blocker} is a file, not a directory; no checkpoint "
                                      "directory can be created there")
        if self.save_interval is not None:
            _require(self.save_interval > 0, f"--save-interval must be > 0, got {self.save_interval}")
        if self.non_persistent_ckpt_type in ("local", "in_memory"):
            raise ValueError(f"--non-persistent-ckpt-type {self.non_persistent_ckpt_type} is not available in this "
                             "version; use --non-persistent-ckpt-type global (a directory on a shared file system, "
                             "see --non-persistent-global-ckpt-dir)")
        if self.non_persistent_save_interval is not None:
            _require(self.non_persistent_save_interval > 0,
                     f"--non-persistent-save-interval must be > 0, got {self.non_persistent_save_interval}")
            _require(self.save is not None, "--non-persistent-save-interval requires --save")
            _require(self.non_persistent_ckpt_type == "global",
                     "--non-persistent-save-interval requires --non-persistent-ckpt-type global (as in Megatron-LM)")
        elif self.non_persistent_global_ckpt_dir is not None and self.non_persistent_ckpt_type != "global":
            raise ValueError("--non-persistent-global-ckpt-dir only applies with --non-persistent-ckpt-type global; "
                             "remove it (it would otherwise be silently ignored)")
        if self.dist_ckpt_strictness in ("return_unexpected", "return_all"):
            raise ValueError(f"--dist-ckpt-strictness {self.dist_ckpt_strictness} is not available: it returns the "
                             "mismatched keys to a caller of dist_checkpointing.load, and the training loop has none "
                             "(Megatron-LM's fails on it at load); use log_unexpected, log_all, raise_unexpected, "
                             "raise_all, ignore_all or assume_ok_unexpected")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError(f"--async-save needs --ckpt-format torch_dist (got --ckpt-format {self.ckpt_format})")


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

    def validate(self) -> None:
        """A flag that acts only with another ``--tokenizer-type`` than the one given is refused (ValueError
        naming it) rather than silently ignored."""
        for flag, field, default, tokenizer_type in _TOKENIZER_TYPE_FLAGS:
            if getattr(self, field) != default and self.tokenizer_type != tokenizer_type:
                raise ValueError(f"{flag} applies only to --tokenizer-type {tokenizer_type} "
                                 f"(got {self.tokenizer_type}); remove it (it would otherwise be silently ignored)")
        if self.vocab_extra_ids and self.tokenizer_type != "SentencePieceTokenizer":
            raise ValueError(f"--vocab-extra-ids only applies to --tokenizer-type SentencePieceTokenizer (got "
                             f"{self.tokenizer_type}); remove it (it would otherwise be silently ignored)")


# Tokenizer flags that act only with one --tokenizer-type: (flag, field, default, that type).
_TOKENIZER_TYPE_FLAGS = [
    ("--tokenizer-special-tokens", "tokenizer_special_tokens", None, "TikTokenizer"),
    ("--tiktoken-special-tokens", "tiktoken_special_tokens", None, "TikTokenizer"),
    ("--tiktoken-num-special-tokens", "tiktoken_num_special_tokens", 1000, "TikTokenizer"),
    ("--trust-remote-code", "trust_remote_code", False, "HuggingFaceTokenizer"),
    ("--tokenizer-hf-no-use-fast", "tokenizer_hf_use_fast", True, "HuggingFaceTokenizer"),
    ("--tokenizer-hf-no-include-special-tokens", "tokenizer_hf_include_special_tokens", True, "HuggingFaceTokenizer"),
]
