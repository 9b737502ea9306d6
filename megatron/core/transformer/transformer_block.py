"""The decoder stack of one pipeline stage: its share of TransformerLayers and the final norm."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts, pipeline_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def _sequence_parallel_rng_context(config: TransformerConfig, training: bool):
    """The model-parallel RNG fork under sequence parallelism when dropout draws, else a no-op context.

    With SP each TP rank holds a different chunk of the sequence, so hidden dropout must draw a
    different mask on each rank (Korthikanti et al. 2022, section 4.2.2); without SP the
    activations are replicated and dropout must agree across TP ranks. Core attention does not fork
    again inside this context (nested forks of one state would replay stale randomness). At TP = 1,
    in eval, or with both dropouts 0 nothing draws, so no fork is taken: swapping RNG states is a
    Python side effect that would break a compiled graph for nothing.
    """
    tracker = tensor_parallel.get_cuda_rng_tracker()
    draws = training and (config.hidden_dropout > 0.0 or config.attention_dropout > 0.0)
    if (config.sequence_parallel and config.tensor_model_parallel_size > 1 and draws
            and "model-parallel-rng" in tracker.states_):
        return tracker.fork()
    return contextlib.nullcontext()


def _layer_counts(config: TransformerConfig):
    return pipeline_layer_counts(
        config.num_layers, parallel_state.get_pipeline_model_parallel_world_size(),
        config.virtual_pipeline_model_parallel_size, config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage, config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split)


def _vp_stage_or_current(config: TransformerConfig, vp_stage: Optional[int]) -> int:
    if config.virtual_pipeline_model_parallel_size is None:
        return 0
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return vp_stage


def get_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Transformer layers held by this pipeline stage (chunk ``vp_stage`` with interleaving).

    Even, uneven (first/last stage counts) and account-for-embedding/loss splits as in Megatron-LM;
    see ``pipeline_layout.pipeline_layer_counts`` (raises ValueError for a split that does not add up).
    """
    counts = _layer_counts(config)
    return counts[parallel_state.get_pipeline_model_parallel_rank()][_vp_stage_or_current(config, vp_stage)]


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Global 0-based index of this stage's (chunk's) first layer.

    Chunk v of stage p is model block ``v * pp + p``; its offset is the number of layers in the
    blocks before it (16 layers, pp=4, vp=2: stage 0 holds layers 1-2 and 9-10, 1-based).
    """
    counts = _layer_counts(config)
    return pipeline_layer_offset(counts, parallel_state.get_pipeline_model_parallel_rank(),
                                 _vp_stage_or_current(config, vp_stage))


class TransformerBlock(MegatronModule):
    """Stack of this stage's TransformerLayers (``layers``) plus ``final_layernorm`` on the last stage.

    forward(hidden [s, b, h] (ignored off the first stage, where ``set_input_tensor`` supplies
    the input), attention_mask [b, 1, s, s] bool or None, rotary_pos_emb) -> hidden [s, b, h].
    ``recompute_granularity='full'`` recomputes layers with ``tensor_parallel.checkpoint``:
    'uniform' checkpoints chunks of ``recompute_num_layers`` layers, 'block' checkpoints the first
    ``recompute_num_layers`` layers one by one. With ``compile_transformer_layers`` each layer's
    forward is compiled in place (``nn.Module.compile``, one compiled region per layer as in
    torchtitan), so parameter and state-dict names stay ``layers.<i>.*`` (no ``_orig_mod.``).
    """

    def __init__(self, config: TransformerConfig, spec=None, post_layer_norm: bool = True,
                 pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                 model_comm_pgs=None):
        super().__init__(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor = None
        num_layers = get_num_layers_to_build(config, vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage)
        layers = []
        for i in range(num_layers):
            with tensor_parallel.model_init_rng(offset + i + 1):  # same weights on any pipeline layout
                layers.append(TransformerLayer(config, layer_number=offset + i + 1, model_comm_pgs=model_comm_pgs))
        self.layers = torch.nn.ModuleList(layers)
        if config.compile_transformer_layers:
            for layer in self.layers:
                layer.compile()
        if post_process and post_layer_norm:
            self.final_layernorm = build_norm(config)
        else:
            self.final_layernorm = None

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Input [s, b, h] received from the previous pipeline stage."""
        self.input_tensor = input_tensor

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        def custom(start: int, end: int):
            def run(hidden, mask, rope):
                for layer in self.layers[start:end]:
                    hidden, _ = layer(hidden, attention_mask=mask, rotary_pos_emb=rope)
                return hidden
            return run

        n = self.config.recompute_num_layers
        distribute = bool(self.config.distribute_saved_activations)
        if self.config.recompute_method == "uniform":
            start = 0
            while start < len(self.layers):
                hidden_states = tensor_parallel.checkpoint(
                    custom(start, start + n), distribute, hidden_states, attention_mask, rotary_pos_emb
                )
                start += n
        else:  # 'block' (validated in TransformerConfig)
            for index in range(len(self.layers)):
                if index < n:
                    hidden_states = tensor_parallel.checkpoint(
                        custom(index, index + 1), distribute, hidden_states, attention_mask, rotary_pos_emb
                    )
                else:
                    hidden_states, _ = self.layers[index](hidden_states, attention_mask=attention_mask,
                                                          rotary_pos_emb=rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_params=None, packed_seq_params=None
                ) -> torch.Tensor:
        """hidden [s, b, h] -> hidden [s, b, h] (normalised on the last stage).

        Raises RuntimeError on a non-first stage whose input tensor was never set.
        """
        if not self.pre_process:
            if self.input_tensor is None:
                raise RuntimeError("TransformerBlock on a non-first pipeline stage needs set_input_tensor() first")
            hidden_states = self.input_tensor
        with _sequence_parallel_rng_context(self.config, self.training):
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, rotary_pos_emb)
            else:
                for layer in self.layers:
                    hidden_states, context = layer(hidden_states, attention_mask=attention_mask, context=context,
                                                   rotary_pos_emb=rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
