"""Word (vocab-parallel) + learned absolute position embeddings with embedding dropout, output [s, b, h]."""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_tensor_model_parallel_world_size
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class LanguageModelEmbedding(MegatronModule):
    """``word_embeddings`` (VocabParallelEmbedding [V/tp, h]) plus ``position_embeddings``
    (nn.Embedding [max_sequence_length, h], learned_absolute only), then dropout(hidden_dropout).

    forward(input_ids [b, s], position_ids [b, s]) -> [s, b, h] ([s/tp, b, h] with sequence
    parallel; fp32 with ``fp32_residual_connection``).

    Raises ValueError for an unknown ``position_embedding_type`` and, in forward, when
    position_ids are missing for learned absolute positions.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: str = "learned_absolute", num_tokentypes: int = 0,
                 scatter_to_sequence_parallel: bool = True):
        super().__init__(config)
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {_POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}"
            )
        if num_tokentypes:
            raise ValueError(f"num_tokentypes must be 0 for GPT models, got {num_tokentypes}")
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.sequence_parallel = config.sequence_parallel and get_tensor_model_parallel_world_size() > 1
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        # Without position embeddings the reduce over TP and the seq-scatter fuse into one reduce-scatter.
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding and self.sequence_parallel and scatter_to_sequence_parallel
        )
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings, config=config,
        )
        if self.add_position_embedding:
            device = self.word_embeddings.weight.device
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          device=device, dtype=config.params_dtype)
            if config.perform_initialization:
                if config.use_cpu_initialization or not torch.cuda.is_available():
                    # Same draw as a TP=1 run: use the default CPU generator on an fp32 master.
                    master = torch.empty(max_sequence_length, config.hidden_size, dtype=torch.float32)
                    config.embedding_init_method(master)
                    with torch.no_grad():
                        self.position_embeddings.weight.copy_(master)
                else:
                    config.embedding_init_method(self.position_embeddings.weight)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [b, s], position_ids [b, s] -> embeddings [s, b, h]."""
        word_embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("position_ids [b, s] are required with position_embedding_type='learned_absolute'")
            embeddings = word_embeddings + self.position_embeddings(position_ids)
        else:
            embeddings = word_embeddings
        if not self.reduce_scatter_embeddings:
            embeddings = embeddings.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.sequence_parallel:
            if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
                embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings)
        if self.sequence_parallel and self.training and self.embedding_dropout.p > 0.0:
            # Each TP rank holds a different sequence chunk, so masks may (and should) differ.
            with get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        else:
            embeddings = self.embedding_dropout(embeddings)
        return embeddings
