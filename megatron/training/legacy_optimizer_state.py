"""Old import path of megatron.training.checkpointing.legacy_optimizer_state (Megatron's positional optimizer layout)."""
import sys

from megatron.training.checkpointing import legacy_optimizer_state

sys.modules[__name__] = legacy_optimizer_state
