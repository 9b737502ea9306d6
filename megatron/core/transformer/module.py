"""MegatronModule base class and Float16Module, the fp16/bf16 wrapper of a model chunk."""
from __future__ import annotations

from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

_FLOAT_TYPES = (torch.float32,)
_HALF_TYPES = (torch.float16, torch.bfloat16)


class MegatronModule(torch.nn.Module):
    """Base class of Megatron modules: keeps the config and provides checkpoint/pipeline hooks."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """State dict written to legacy checkpoints (the plain ``state_dict``)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self) -> None:
        """Mark the next forward as the first microbatch (modules caching weights may refresh them)."""
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True


def conversion_helper(val: Any, conversion):
    """Apply ``conversion`` to every tensor inside nested tuples/lists ``val``."""
    if isinstance(val, (tuple, list)):
        converted = [conversion_helper(v, conversion) for v in val]
        return tuple(converted) if isinstance(val, tuple) else converted
    return conversion(val)


def fp32_to_float16(val: Any, float16_convertor):
    """Convert fp32 tensors in ``val`` with ``float16_convertor``; other tensors/values pass through."""

    def half_conversion(v):
        if torch.is_tensor(v) and v.dtype in _FLOAT_TYPES:
            return float16_convertor(v)
        return v

    return conversion_helper(val, half_conversion)


def float16_to_fp32(val: Any):
    """Convert fp16/bf16 tensors in ``val`` to fp32; other tensors/values pass through."""

    def float_conversion(v):
        if torch.is_tensor(v) and v.dtype in _HALF_TYPES:
            return v.float()
        return v

    return conversion_helper(val, float_conversion)


class Float16Module(MegatronModule):
    """Cast a model chunk to fp16 or bf16; fp32 inputs are cast on the first pipeline stage and
    half outputs cast back to fp32 on the last one. ``state_dict`` keys are the wrapped module's.

    Raises ValueError unless exactly one of ``config.fp16``/``config.bf16`` is set.
    """

    def __init__(self, config: ModelParallelConfig, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16 == config.bf16:
            raise ValueError("Float16Module needs exactly one of config.fp16 / config.bf16 set")
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        if self.fp16:
            self.add_module("module", module.half())
            self.float16_convertor = lambda t: t.half()
        else:
            self.add_module("module", module.bfloat16())
            self.float16_convertor = lambda t: t.bfloat16()
        self.vp_stage = getattr(module, "vp_stage", None)

    def set_input_tensor(self, input_tensor) -> None:
        """Forward the pipeline input tensor to the wrapped module."""
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        if parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=self.vp_stage):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=self.vp_stage):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
