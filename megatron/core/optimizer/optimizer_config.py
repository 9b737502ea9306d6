"""Configuration of the optimizer, its mixed-precision wrapper, loss scaling and grad clipping."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class OptimizerConfig:
    """Optimizer options; names and defaults follow Megatron-LM (``--lr``, ``--adam-beta1``, ...).

    Attributes:
        optimizer: 'adam' (AdamW, decoupled weight decay) or 'sgd'.
        lr / min_lr: peak and final learning rate (the scheduler moves between them).
        decoupled_lr / decoupled_min_lr: lr range for params flagged ``is_embedding_or_output_parameter``.
        weight_decay: L2 coefficient (decoupled) for params with wd_mult 1.
        fp16 / bf16 / params_dtype: model param precision; fp16 and bf16 get fp32 main params.
        loss_scale: constant loss scale; None -> dynamic scaling for fp16, none for bf16.
        initial_loss_scale / min_loss_scale / loss_scale_window / hysteresis: dynamic scaler settings.
        adam_beta1 / adam_beta2 / adam_eps / sgd_momentum: inner optimizer hyper-parameters.
        use_distributed_optimizer: shard optimizer state over data-parallel ranks.
        clip_grad: max global L2 grad norm (0 disables clipping).
        log_num_zeros_in_grad: count zero entries of the grads at every step.
        apply_wd_to_qk_layernorm: keep weight decay on the q/k layernorm weights (which, being 1-D, are
            otherwise exempt like every norm weight and bias).
        timers: Megatron Timers used for the ``optimizer-*`` timers, or None.
    """

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9
    use_distributed_optimizer: bool = False
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    apply_wd_to_qk_layernorm: bool = False
    timers: Optional[Callable] = None

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 cannot both be set")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
