"""Loss scalers for mixed-precision training: constant and dynamic (with hysteresis)."""
from abc import ABC, abstractmethod
from typing import Dict

import torch


class MegatronGradScaler(ABC):
    """Holds the loss scale as a ``[1]`` fp32 tensor; the loss is multiplied by it before backward.

    The scale starts on the CPU; the mixed-precision optimizer moves it next to the model with
    :meth:`to` (it is a compute operand, never a collective's tensor).

    Raises:
        ValueError: ``initial_scale`` is not positive.
    """

    def __init__(self, initial_scale: float):
        if not initial_scale > 0.0:
            raise ValueError(f"loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float)

    def to(self, device: torch.device) -> "MegatronGradScaler":
        """Move every tensor of the scaler to ``device`` (the model's); returns self."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    @property
    def scale(self) -> torch.Tensor:
        """Current loss scale, ``[1]`` fp32."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale computed in fp64 then rounded to fp32, ``[1]``."""
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool):
        """Adapt the scale after a step that did (``found_inf``) or did not overflow."""

    @abstractmethod
    def state_dict(self) -> Dict:
        """Checkpointable state."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict):
        """Restore :meth:`state_dict` output."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (``--loss-scale X``); overflowing steps are still skipped by the optimizer."""

    def update(self, found_inf: bool):
        """The scale never changes."""

    def state_dict(self) -> Dict:
        """Nothing to save: the scale comes from the command line."""
        return {}

    def load_state_dict(self, state_dict: Dict):
        """Nothing to restore."""


class DynamicGradScaler(MegatronGradScaler):
    """Loss scale that backs off on overflow and grows after a window of clean steps (Megatron-LM rules).

    On an overflow the growth tracker resets and the hysteresis tracker drops by one; once it is
    <= 0 every further overflow multiplies the scale by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` consecutive clean steps the scale is multiplied by
    ``growth_factor`` and the hysteresis tracker is refilled. (Mixed-precision loss scaling:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2.)

    Raises:
        ValueError: a setting is outside its valid range.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, initial loss scale {initial_scale}], got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff factor must be in (0, 1), got {backoff_factor}")
        if not growth_interval > 0:
            raise ValueError(f"--loss-scale-window must be positive, got {growth_interval}")
        if not hysteresis > 0:
            raise ValueError(f"--hysteresis must be positive, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float, device=self._scale.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float, device=self._scale.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float, device=self._scale.device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool):
        """Apply the backoff / growth rules for one step."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict:
        """``{'scale': [1] tensor, 'growth_tracker': int, 'hysteresis_tracker': int}``."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict):
        """Restore scale and trackers.

        Raises:
            KeyError: a key of :meth:`state_dict` is missing.
        """
        self._scale = torch.as_tensor(state_dict["scale"], dtype=torch.float).reshape(1).to(self._scale.device)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
