"""Per-expert load of the MoE routers as ``megatron.training.moe.*`` metrics, once per log interval, whole-model counts.

While telemetry metrics are on and the model has MoE layers, a ``routing_stats`` recorder sums on the device,
per layer, the tokens each router sent to each expert and the (token, expert) assignments the capacity factor
dropped (``megatron/core/transformer/moe/routing_stats.py``; the routers call ``record_routing``). Only forward
passes that build a graph count (``torch.is_grad_enabled()``): evaluation runs under ``no_grad``, and with
full activation recompute the checkpointed first forward runs under ``no_grad`` while its recompute in the
backward counts, so every training token counts once (Megatron's routers gate their expert-bias counts the
same way).

Which ranks a point covers: every log iteration the counts of the interval become one small int64 table
``[MoE layers, experts + 1]`` per rank, summed (``all_reduce``) over the tensor x data x context-parallel
group of the pipeline stage, then over the pipeline group when PP > 1 (each stage fills only its own layers).
Data-parallel (expert-parallel ranks are data-parallel ranks) and context-parallel ranks route distinct tokens,
and so do tensor-parallel ranks under ``--sequence-parallel``; without sequence parallelism every TP rank routes
the same tokens and only TP rank 0 contributes. A point is therefore the layer's global load over the interval,
the same on every rank, and the exporting rank(s) record it:

- ``megatron.training.moe.tokens_per_expert`` (``megatron.moe.layer``, ``megatron.moe.expert``): tokens routed
  to the expert (a token counts once per chosen expert, before dropping);
- ``megatron.training.moe.imbalance`` (``megatron.moe.layer``): the most loaded expert's count over the mean
  count per expert (1 = balanced; ``num_experts`` = every token on one expert);
- ``megatron.training.moe.dropped_tokens`` (``megatron.moe.layer``): assignments dropped by
  ``--moe-expert-capacity-factor`` (0 when dropless).

Cost: with telemetry metrics off (or no MoE layer) nothing is installed, no collective runs and the routers pay
one global lookup. On, the counts stay on the device between log lines; the report reads them to the host once
per layer and runs one or two all-reduces of ``layers x (experts + 1)`` int64 values per log interval. Every rank
joins (gated on the run's configuration, never on "this rank exports").
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.core.telemetry import record_training_metrics
from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TrainingRoutingRecorder", "MoERoutingReport", "LAYER_ATTRIBUTE", "EXPERT_ATTRIBUTE"]

LAYER_ATTRIBUTE = "megatron.moe.layer"
EXPERT_ATTRIBUTE = "megatron.moe.expert"


class TrainingRoutingRecorder(routing_stats.RoutingStatsRecorder):
    """A routing-stats recorder that keeps only forward passes building a graph (training, recompute)."""

    def record(self, layer_number, tokens_per_expert, dropped_tokens=None) -> None:
        """Add the counts when ``torch.is_grad_enabled()`` (see the module docstring); else ignore them."""
        if torch.is_grad_enabled():
            super().record(layer_number, tokens_per_expert, dropped_tokens)


def _moe_layer_numbers(config: TransformerConfig) -> List[int]:
    if config.num_moe_experts is None:
        return []
    return [number for number in range(1, config.num_layers + 1) if config.is_moe_layer(number)]


class MoERoutingReport:
    """The routing recorder of one training run and its per-log-interval report.

    Use: ``create(model_config, handle)`` (None when telemetry metrics are off or the model has no MoE layer),
    ``report()`` on every log iteration (collective: every rank calls it), ``close()`` at the end.
    """

    def __init__(self, config: TransformerConfig, exporting_meter, recorder: Optional[TrainingRoutingRecorder] = None):
        self.layers = _moe_layer_numbers(config)
        if not self.layers:
            raise ValueError("MoERoutingReport: the model has no MoE layer (num_moe_experts / moe_layer_freq)")
        self.num_experts = config.num_moe_experts
        self.sequence_parallel = bool(config.sequence_parallel)
        self.meter = exporting_meter
        self.recorder = recorder or TrainingRoutingRecorder()
        self.last_table: Optional[torch.Tensor] = None
        routing_stats.install(self.recorder)

    @classmethod
    def create(cls, config: TransformerConfig, handle) -> Optional["MoERoutingReport"]:
        """The report for the model ``config`` and the telemetry ``handle``, or None when there is nothing to
        record (telemetry or its metrics off, or no MoE layer): then no recorder is installed."""
        metrics_on = handle is not None and handle.config.enabled and handle.config.metrics_enabled
        if not metrics_on or not _moe_layer_numbers(config):
            return None
        meter = handle.meter if handle.is_exporting else None
        return cls(config, meter)

    def close(self) -> None:
        """Stop recording (if this report's recorder is still the installed one)."""
        if routing_stats.active_recorder() is self.recorder:
            routing_stats.uninstall()

    def _contributes(self) -> bool:
        # Without sequence parallelism the TP ranks of a stage route the very same tokens: count them once.
        if self.sequence_parallel or not parallel_state.model_parallel_is_initialized():
            return True
        return parallel_state.get_tensor_model_parallel_rank() == 0

    def local_table(self) -> torch.Tensor:
        """This rank's counts since the last report, ``[layers, experts + 1]`` int64 on the CPU (column E:
        dropped); rows of layers this rank does not hold (or did not route) are 0. Resets the recorder."""
        table = torch.zeros(len(self.layers), self.num_experts + 1, dtype=torch.int64)
        taken = self.recorder.take()
        if not self._contributes():
            return table
        row_of = {layer: row for row, layer in enumerate(self.layers)}
        for layer, (counts, dropped) in taken.items():
            if layer not in row_of or len(counts) != self.num_experts:
                raise ValueError(f"routing_stats: layer {layer} recorded {len(counts)} expert counts; the model has "
                                 f"MoE layers {self.layers} of {self.num_experts} experts (--num-experts)")
            table[row_of[layer], :-1] = torch.tensor(counts, dtype=torch.int64)
            table[row_of[layer], -1] = dropped
        return table

    def gather(self) -> torch.Tensor:
        """Collective: the whole model's counts of the interval, ``[layers, experts + 1]`` int64 on the CPU,
        the same on every rank (summed over TP x DP x CP, then over PP; see the module docstring)."""
        table = self.local_table()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return table
        groups = [parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            groups.append(parallel_state.get_pipeline_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) == 1:
                continue
            on_device = table.to(get_collective_device(group))
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
            table = on_device.cpu()
        return table

    def report(self) -> torch.Tensor:
        """Collective: gather the interval's counts and record them (exporting ranks). Returns the table."""
        table = self.gather()
        self.last_table = table
        if self.meter is not None:
            self._record(table)
        return table

    def _record(self, table: torch.Tensor) -> None:
        for row, layer in enumerate(self.layers):
            counts = table[row, :-1].tolist()
            layer_attrs: Dict[str, int] = {LAYER_ATTRIBUTE: layer}
            for expert, count in enumerate(counts):
                record_training_metrics(self.meter, attributes={**layer_attrs, EXPERT_ATTRIBUTE: expert},
                                        moe_tokens_per_expert=count)
            total = sum(counts)
            imbalance = max(counts) * len(counts) / total if total > 0 else None  # no tokens: no ratio
            record_training_metrics(self.meter, attributes=layer_attrs, moe_imbalance=imbalance,
                                    moe_dropped_tokens=int(table[row, -1]))
