"""GPTModel: embedding, decoder stack and (tied) output layer with vocab-parallel loss, per pipeline stage."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.collective_device import get_collective_device
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.process_groups_config import ModelCommProcessGroups, check_parallel_config
from megatron.core.telemetry import managed_span
from megatron.core.transformer.context_parallel import local_positions
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


class GPTModel(MegatronModule):
    """Decoder-only transformer language model (Radford et al. 2019) with Megatron's state-dict names.

    Submodules: ``embedding`` (first stage), ``rotary_pos_emb`` (rope), ``decoder``
    (TransformerBlock), ``output_layer`` (last stage; ColumnParallelLinear [V_pad/tp, h], no bias;
    when ``share_embeddings_and_output_weights`` and this stage also has the embedding, it owns no
    weight and forward uses ``embedding.word_embeddings.weight``). ``vocab_size`` is the padded
    vocabulary (divisible by the TP size).

    Raises ValueError for an unknown ``position_embedding_type`` or a vocab not divisible by TP.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec=None,
        vocab_size: int = 0,
        max_sequence_length: int = 0,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        seq_len_interpolation_factor: Optional[float] = None,
        vp_stage: Optional[int] = None,
        model_comm_pgs: Optional[ModelCommProcessGroups] = None,
    ):
        super().__init__(config)
        if model_comm_pgs is None:
            model_comm_pgs = ModelCommProcessGroups.use_mpu_process_groups()
        check_parallel_config(config, model_comm_pgs)
        self.model_comm_pgs = model_comm_pgs
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {_POSITION_EMBEDDING_TYPES}, got {position_embedding_type!r}"
            )
        if vocab_size <= 0 or max_sequence_length <= 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) and max_sequence_length ({max_sequence_length}) must be positive"
            )
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if vocab_size % tp != 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be divisible by tensor_model_parallel_size ({tp}); "
                "pad it (--make-vocab-size-divisible-by)"
            )
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        self.model_type = None  # set by the training code (ModelType.encoder_or_decoder)

        if pre_process:
            with tensor_parallel.model_init_rng(0):  # pieces are seeded by position: same weights at any PP
                self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                        position_embedding_type=position_embedding_type)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
            )
        else:
            self.rotary_pos_emb = None
        self.decoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage, model_comm_pgs=model_comm_pgs)
        if post_process:
            with tensor_parallel.model_init_rng(config.num_layers + 1):
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                    skip_bias_add=False, gather_output=not parallel_output,
                    skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    # ------------------------------------------------------------------------------------------
    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on the first stage, the output weight on the last, else None."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self) -> None:
        """Mark embedding/output params and, with tied weights over pipeline stages, copy the
        first stage's embedding into the last stage's output weight (zero-fill + all-reduce over
        the embedding group), marking it ``shared``."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        if self.pre_process:
            # The embedding lookup's grad arrives through autograd while the output layer's fused
            # wgrad goes straight into main_grad: the dummy wgrad must be zeros so the DDP hook can
            # still add the lookup's part.
            self.embedding.word_embeddings.weight.zero_out_wgrad = True
        if self.pre_process and self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
            return
        if self.post_process and not self.pre_process:
            with torch.no_grad():
                self.output_layer.weight.zero_()
            self.output_layer.weight.shared = True
            self.output_layer.weight.shared_embedding = True
        if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1 \
                and parallel_state.is_rank_in_embedding_group():
            weight = self.shared_embedding_or_output_weight()
            group = parallel_state.get_embedding_group()
            with torch.no_grad():
                # The model may still be on the CPU here while the group is NCCL: reduce on its device.
                summed = weight.data.to(get_collective_device(group))
                dist.all_reduce(summed, group=group)
                weight.data.copy_(summed)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline input [s, b, h] for a non-first stage (a list of one tensor is accepted).

        Raises ValueError for a list of more than one tensor.
        """
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_params=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> torch.Tensor:
        """Run this stage.

        input_ids/position_ids [b, s] (int64), attention_mask [b, 1, s, s] bool (True = masked) or
        None for causal. Returns, on the last stage, the per-token loss [b, s] (fp32) when labels
        [b, s] are given, else logits [b, s, V_pad/tp] ([b, s, V_pad] without parallel_output);
        on other stages the hidden states [s, b, h].
        """
        if decoder_input is None and self.pre_process:
            with managed_span("layer", "megatron.embedding"):
                decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)

        rotary_pos_emb = None
        if self.rotary_pos_emb is not None:
            source = decoder_input if decoder_input is not None else self.decoder.input_tensor
            rotary_seq_len = source.size(0)
            if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
                rotary_seq_len *= parallel_state.get_tensor_model_parallel_world_size()
            cp_group = self.model_comm_pgs.cp
            cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
            if cp_size > 1:  # this rank holds two chunks of the sequence: the angles of their global positions
                positions = local_positions(rotary_seq_len * cp_size, cp_size, dist.get_rank(cp_group),
                                            device=source.device)
                rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len * cp_size, device=source.device)[positions]
            else:
                rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len, device=source.device)

        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     rotary_pos_emb=rotary_pos_emb, **(extra_block_kwargs or {}))
        if not self.post_process:
            return hidden_states

        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else None
        with managed_span("layer", "megatron.output_layer"):
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        with managed_span("layer", "megatron.loss"):
            return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """labels [b, s], logits [s, b, V/tp] in the compute dtype -> per-token loss [b, s] (fp32).

        The logits go to the cross entropy as they are: it does the one fp32 upcast itself (a
        ``logits.float()`` here would be a second fp32 copy of [s, b, V/tp]).

        Raises ValueError if ``fp16_lm_cross_entropy`` is set but the logits are not fp16.
        """
        labels = labels.transpose(0, 1).contiguous()
        if self.fp16_lm_cross_entropy and logits.dtype != torch.half:
            raise ValueError(f"fp16_lm_cross_entropy needs fp16 logits, got {logits.dtype}")
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        return loss.transpose(0, 1).contiguous()
