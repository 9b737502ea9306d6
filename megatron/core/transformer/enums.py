"""Enums naming layer types, attention masks and model types (Megatron names)."""
import enum


class ModelType(enum.Enum):
    """Model families the pipeline schedules distinguish."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2


class LayerType(enum.Enum):
    """Transformer layer roles."""

    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    """Self- or cross-attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How the attention mask is supplied: explicit ``padding`` mask or implicit ``causal``."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Core-attention kernel choice (``--attention-backend``; Megatron's names and order).

    ``flash``: FlashAttention-2 (CUDA); ``fused``: cuDNN fused attention, with the memory-efficient
    kernel when cuDNN cannot take the inputs (CUDA); ``unfused``: the explicit softmax(QK^T)V math;
    ``local``: this project's own attention, which is the same math; ``auto``: PyTorch decides.
    See ``attention_backend.py`` for the mapping to SDPA kernels.
    """

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
