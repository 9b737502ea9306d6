"""Token + position embeddings of language models."""
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

__all__ = ["LanguageModelEmbedding"]
