"""Learning-rate and weight-decay schedule, with steps counted in samples (Megatron-LM formulas)."""
import logging
import math
from typing import Dict, Optional

from megatron.core.dist_checkpointing.core import CheckpointingException

logger = logging.getLogger(__name__)

_LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
_WD_INCR_STYLES = ("constant", "linear", "cosine")


class SchedulerMismatchError(CheckpointingException, ValueError):
    """A checkpoint's schedule differs from the one the flags describe (the same on every rank)."""


class OptimizerParamScheduler:
    """Sets 'lr' and 'weight_decay' of every optimizer param group as a function of consumed samples.

    lr(n), with n = samples consumed, W = warmup, D = decay steps:
      n <= W (W > 0): ``init_lr + (max_lr - init_lr) * n / W``;
      constant: ``max_lr``; n > D: ``min_lr``;
      inverse-square-root: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``;
      otherwise r = (n - W) / (D - W) and lr = min_lr + coeff * (max_lr - min_lr) with coeff
      linear ``1 - r``, cosine ``0.5 (cos(pi r) + 1)`` (Loshchilov & Hutter, SGDR, ICLR 2017, eq. 5),
      WSD (warmup-stable-decay; Hu et al., MiniCPM, 2024, section 4) ``1`` until
      ``D - wsd_decay_steps`` then, with w the fraction of the WSD window elapsed, linear ``1 - w``,
      cosine ``0.5 (cos(pi w) + 1)``, exponential ``2 * 0.5^w - 1``, minus_sqrt ``1 - sqrt(w)``.
    Per group, ``max_lr`` / ``min_lr`` keys override the scheduler's, and 'lr' = lr(n) * lr_mult.
    Weight decay goes from start_wd to end_wd over ``wd_incr_steps`` (linear ``r``, cosine
    ``0.5 (cos(pi (1 - r)) + 1)``), then 'weight_decay' = wd * wd_mult.

    Args:
        optimizer: anything with ``param_groups`` (a MegatronOptimizer or torch optimizer).
        init_lr, max_lr, min_lr: lr at step 0, peak lr, final lr.
        lr_warmup_steps, lr_decay_steps, wsd_decay_steps, wd_incr_steps: lengths in samples.
        lr_decay_style: constant | linear | cosine | inverse-square-root | WSD.
        lr_wsd_decay_style: exponential | linear | cosine | minus_sqrt (for WSD).
        start_wd, end_wd, wd_incr_style: weight-decay schedule (constant | linear | cosine).
        use_checkpoint_opt_param_scheduler: on load, take the checkpoint's values.
        override_opt_param_scheduler: on load, keep this object's values (only num_steps is loaded).

    Raises:
        ValueError: an inconsistent or unknown setting (each message names the offending value).
    """

    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, wsd_decay_steps: Optional[int] = None,
                 lr_wsd_decay_style: Optional[str] = None):
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        if self.min_lr < 0.0:
            raise ValueError(f"min_lr ({self.min_lr}) must be >= 0")
        if self.max_lr < self.min_lr:
            raise ValueError(f"max_lr ({self.max_lr}) must be >= min_lr ({self.min_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"init_lr ({self.init_lr}) must be <= max_lr ({self.max_lr})")
        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        if not self.lr_decay_steps > 0:
            raise ValueError(f"lr_decay_steps ({self.lr_decay_steps}) must be > 0")
        if not self.lr_warmup_steps < self.lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({self.lr_warmup_steps}) must be < lr_decay_steps "
                             f"({self.lr_decay_steps})")
        if lr_decay_style not in _LR_DECAY_STYLES:
            raise ValueError(f"unknown lr_decay_style {lr_decay_style!r}; choose one of {_LR_DECAY_STYLES}")
        self.lr_decay_style = lr_decay_style
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None or not 0 < wsd_decay_steps <= lr_decay_steps:
                raise ValueError(f"WSD decay needs 0 < wsd_decay_steps ({wsd_decay_steps}) <= lr_decay_steps "
                                 f"({lr_decay_steps})")
            if lr_wsd_decay_style not in _WSD_DECAY_STYLES:
                raise ValueError(f"unknown lr_wsd_decay_style {lr_wsd_decay_style!r}; choose one of "
                                 f"{_WSD_DECAY_STYLES}")
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        if self.start_wd < 0.0:
            raise ValueError(f"start_wd ({self.start_wd}) must be >= 0")
        if self.end_wd < self.start_wd:
            raise ValueError(f"end_wd ({self.end_wd}) must be >= start_wd ({self.start_wd})")
        if wd_incr_style not in _WD_INCR_STYLES:
            raise ValueError(f"unknown wd_incr_style {wd_incr_style!r}; choose one of {_WD_INCR_STYLES}")
        if wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(f"constant weight decay needs start_wd ({self.start_wd}) == end_wd ({self.end_wd})")
        if wd_incr_style != "constant" and not wd_incr_steps > 0:
            raise ValueError(f"wd_incr_steps ({wd_incr_steps}) must be > 0 for {wd_incr_style} weight decay")
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
                             "mutually exclusive")
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.step(0)

    def get_wd(self) -> float:
        """Weight decay at the current step (before wd_mult)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: Dict) -> float:
        """Learning rate of ``param_group`` at the current step (before lr_mult)."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1)))
        decay_ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                w = float(n - anneal_start) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - w
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * w) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, w) - 1.0
                else:
                    coeff = 1.0 - math.sqrt(w)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int):
        """Advance by ``increment`` samples and write 'lr' and 'weight_decay' into every param group."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict:
        """Schedule settings and position (keys as in Megatron-LM checkpoints)."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Pick the value to use after loading (override -> ours, use-checkpoint -> theirs, else must match).

        Raises:
            SchedulerMismatchError: neither flag is set and the values differ (``name`` says the unit).
        """
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", name, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise SchedulerMismatchError(
                f"the checkpoint's learning-rate schedule has {name} {sd_value}, this run's flags give {cls_value}; "
                "pass --override-opt-param-scheduler to follow the flags or --use-checkpoint-opt-param-scheduler "
                "to keep the checkpoint's schedule"
            )
        logger.info(" > using checkpoint value %s for %s", sd_value, name)
        return sd_value

    def load_state_dict(self, state_dict: Dict):
        """Restore the schedule from a checkpoint (older Megatron key names are accepted).

        Raises:
            ValueError: neither override nor use-checkpoint is set and a value differs.
            KeyError: a required key is missing.
        """
        sd = state_dict
        max_lr = sd["start_lr"] if "start_lr" in sd else sd["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate (--lr)")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate (--min-lr)")
        warmup = sd.get("warmup_iter", sd.get("warmup_steps", sd.get("lr_warmup_steps")))
        if warmup is None:
            raise KeyError("scheduler state dict has no 'lr_warmup_steps'")
        self.lr_warmup_steps = self._check_and_set(
            self.lr_warmup_steps, warmup,
            "warmup samples (--lr-warmup-iters x --global-batch-size, or --lr-warmup-samples)")
        decay_steps = sd.get("end_iter", sd.get("decay_steps", sd.get("lr_decay_steps")))
        if decay_steps is None:
            raise KeyError("scheduler state dict has no 'lr_decay_steps'")
        self.lr_decay_steps = self._check_and_set(
            self.lr_decay_steps, decay_steps,
            "decay samples (--lr-decay-iters or --train-iters x --global-batch-size, or --lr-decay-samples)")
        decay_style = sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, decay_style, "decay style (--lr-decay-style)")
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "weight decay samples (--train-iters x --global-batch-size, or "
                                                     "--train-samples)")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        self.num_steps = 0
        self.step(num_steps)
