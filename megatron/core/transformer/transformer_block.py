"""The decoder stack of one pipeline stage: its share of TransformerLayers and the final norm."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import build_norm
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


def get_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Layers held by this pipeline stage (and virtual stage): num_layers / pp (/ vp)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    per_stage = config.num_layers // pp
    vp = config.virtual_pipeline_model_parallel_size
    if vp is not None:
        return per_stage // vp
    return per_stage


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Global index of this stage's first layer (0-based).

    Without interleaving stage r owns layers [r*L/pp, (r+1)*L/pp). With vp chunks, chunk v of
    stage r owns a block of L/(pp*vp) layers starting at ``v*L/vp + r*L/(pp*vp)``.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    per_stage = config.num_layers // pp
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        return pp_rank * per_stage
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    per_virtual = per_stage // vp
    return vp_stage * (config.num_layers // vp) + pp_rank * per_virtual


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
                 pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
        super().__init__(config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor = None
        num_layers = get_num_layers_to_build(config, vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage)
        self.layers = torch.nn.ModuleList(
            [TransformerLayer(config, layer_number=offset + i + 1) for i in range(num_layers)]
        )
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
