"""Megatron-LM's public training names (``from megatron.training import get_args, pretrain, ...``).

They are resolved on first access (PEP 562), so importing a submodule such as
``megatron.training.arguments`` does not import the whole training loop, and no import circle forms.
"""
import importlib

_EXPORTS = {
    "get_args": "global_vars",
    "get_config": "global_vars",
    "get_tokenizer": "global_vars",
    "get_tensorboard_writer": "global_vars",
    "get_wandb_writer": "global_vars",
    "get_timers": "global_vars",
    "initialize_megatron": "initialize",
    "pretrain": "training",
    "get_model": "training",
    "get_train_valid_test_num_samples": "training",
    "print_rank_0": "utils",
    "print_rank_last": "utils",
    "is_last_rank": "utils",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
