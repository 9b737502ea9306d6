"""The training loop's own progress, owned by the loop and saved in (restored from) every checkpoint.

Megatron-LM keeps these counters as attributes set on ``args`` at run time; here they live in one
object that the loop advances, passes to ``save_checkpoint`` and gets back from ``load_checkpoint``.
Everything else a resume needs has its own owner and its own ``state_dict``: the learning-rate
scheduler, the optimizer (with its grad scaler) and the RNGs (``checkpointing.get_rng_state``).
The position of the training data iterator is ``consumed_train_samples``: the samplers of
``data_samplers.py`` restart from it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict


@dataclasses.dataclass
class TrainingState:
    """Counters of a pretraining run.

    Attributes:
        iteration: optimizer steps taken (skipped fp16 steps included), the checkpoint's iteration.
        consumed_train_samples: training samples read so far (the data iterator's position).
        skipped_train_samples: samples skipped without training on them (Megatron's counter; stays 0
            in this version, which skips no batches).
        consumed_valid_samples: validation samples read so far (the validation iterator's position).
        num_floating_point_operations_so_far: model FLOPs done so far (for throughput logs).
    """

    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    num_floating_point_operations_so_far: int = 0

    def state_dict(self) -> Dict[str, int]:
        """The counters as a dict of ints (what a weights-only ``torch.load`` reads back)."""
        return {field.name: int(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Set the counters from :meth:`state_dict` output; absent keys keep their value.

        Raises TypeError for a value that is not an int (a checkpoint written by something else).
        """
        for field in dataclasses.fields(self):
            if field.name in state:
                value = state[field.name]
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"training state {field.name} must be an int, got {type(value).__name__}")
                setattr(self, field.name, value)

    @classmethod
    def from_args(cls, args) -> "TrainingState":
        """The counters a caller left on ``args`` (Megatron's legacy place for them), 0 where absent.

        Only for callers of ``save_checkpoint`` with Megatron's signature, which passes no state.
        """
        return cls(**{field.name: int(getattr(args, field.name, 0) or 0) for field in dataclasses.fields(cls)})

    def copy_to_args(self, args) -> None:
        """Write the counters onto ``args`` (for ``load_checkpoint`` callers with Megatron's signature)."""
        for field in dataclasses.fields(self):
            setattr(args, field.name, getattr(self, field.name))
