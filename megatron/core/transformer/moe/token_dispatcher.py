"""MoE token dispatchers (Megatron core_v0.14's ``token_dispatcher.py``): all-gather and all-to-all.

A dispatcher moves this rank's routed tokens to the ranks holding their experts and the expert outputs
back: ``dispatch(hidden [T, H], probs [T, E], routing_map [T, E]) -> (tokens [N, H] grouped by local
expert, tokens_per_expert [E_loc] list, probs [N])``, then ``combine(expert_output [N, H]) -> [T, H]``
(the probabilities are applied by the experts, after the activation). Every expert-parallel collective
runs inside ``ep_comm_section`` (step-breakdown part ``ep_comm``); token counts are exchanged before the
tokens, and every collective is differentiable (``moe/collectives.py``).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.transformer.moe.collectives import (
    all_to_all,
    gather_along_first_dim,
    group_rank,
    group_size,
    reduce_scatter_along_first_dim,
)
from megatron.core.transformer.moe.ep_comm import ep_comm_section
from megatron.core.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["MoETokenDispatcher", "MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher"]


class MoETokenDispatcher:
    """Common state: the expert-parallel group ``ep``, the expert-TP group ``expt_tp`` and their product ``tp_ep``."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        if model_comm_pgs is None:
            model_comm_pgs = ModelCommProcessGroups.use_mpu_process_groups(["ep", "expt_tp", "tp_ep"])
        if num_local_experts < 1 or len(local_expert_indices) != num_local_experts:
            raise ValueError(f"a token dispatcher needs its local experts, got {local_expert_indices}")
        if any(b - a != 1 for a, b in zip(local_expert_indices, local_expert_indices[1:])):
            raise ValueError(f"local_expert_indices must be consecutive, got {local_expert_indices}")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.ep_group = model_comm_pgs.ep
        self.tp_group = model_comm_pgs.expt_tp
        self.tp_ep_group = model_comm_pgs.tp_ep
        self.ep_size = group_size(self.ep_group)
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.tp_ep_size = group_size(self.tp_ep_group)


def _counts(t: torch.Tensor) -> List[int]:
    return [int(c) for c in t.tolist()]


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather over the expert-TP x EP group: every rank sees every token of the group, runs its local
    experts on those routed to them, and a reduce-scatter sums the partial outputs back to each token's rank
    (expert-TP partial sums included)."""

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        """hidden [T, H], probs/map [T, E] -> (tokens [N, H], tokens_per_expert [E_loc], probs [N])."""
        if self.tp_ep_size > 1:
            with ep_comm_section("dispatch_all_gather"):
                with torch.no_grad():
                    routing_map = gather_along_first_dim(routing_map.to(torch.uint8), self.tp_ep_group).bool()
                probs = gather_along_first_dim(probs, self.tp_ep_group)
                hidden_states = gather_along_first_dim(hidden_states, self.tp_ep_group)
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        tokens_per_expert = _counts(self.local_map.sum(dim=0))
        permuted, permuted_probs, self.reversed_mapping = permute(hidden_states, self.local_map, local_probs)
        return permuted, tokens_per_expert, permuted_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """expert output [N, H] -> this rank's tokens [T, H] (summed over experts, EP and expert TP)."""
        output = unpermute(expert_output, self.reversed_mapping, self.hidden_shape_before_permute)
        if self.tp_ep_size > 1:
            with ep_comm_section("combine_reduce_scatter"):
                output = reduce_scatter_along_first_dim(output, self.tp_ep_group)
        self.local_map = self.reversed_mapping = None
        return output


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Permute by expert, exchange counts (all-gather over expert-TP x EP), all-to-all the tokens over EP,
    all-gather them over expert TP (ETP > 1), sort by local expert; combine reverses each step (sort back,
    reduce-scatter over expert TP, all-to-all over EP, unpermute)."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config: TransformerConfig,
                 model_comm_pgs: Optional[ModelCommProcessGroups] = None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config, model_comm_pgs)
        chunks = list(range(self.num_experts * self.tp_size))  # (etp rank, ep rank, local expert) chunks
        self.sort_input_by_local_experts = [c for j in range(num_local_experts) for c in chunks[j::num_local_experts]]
        self.restore_output_by_local_experts = [
            c for i in range(len(chunks) // num_local_experts)
            for c in chunks[i::len(chunks) // num_local_experts]]

    def _preprocess(self, routing_map: torch.Tensor) -> List[int]:
        """Token counts: this rank's per destination EP rank (input splits), the ones it will receive
        (output splits, per expert-TP rank), and per local expert after the exchange."""
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()
        if self.tp_ep_size == 1:
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self.num_global_tokens_per_local_expert = _counts(num_local_tokens_per_expert)
            return self.num_global_tokens_per_local_expert
        self.input_splits = _counts(num_local_tokens_per_expert.view(self.ep_size, self.num_local_experts).sum(1))
        with ep_comm_section("dispatch_counts"):
            gathered = gather_along_first_dim(num_local_tokens_per_expert.unsqueeze(0), self.tp_ep_group)
        # tp_ep ranks vary expert-TP fastest: [ep, etp, E] -> [etp, ep, E].
        per_expert = gathered.view(self.ep_size, self.tp_size, self.num_experts).transpose(0, 1)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        per_local_expert = per_expert[:, :, first:last].contiguous()  # [etp, ep, E_loc]
        per_rank = per_local_expert.sum(dim=2)  # [etp, ep]
        self.output_splits = _counts(per_rank[self.tp_rank])
        self.output_splits_tp = _counts(per_rank.sum(dim=1))
        self.num_global_tokens_per_local_expert = _counts(per_local_expert.reshape(-1))
        return _counts(per_local_expert.sum(dim=(0, 1)))

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
                 ) -> Tuple[torch.Tensor, List[int], torch.Tensor]:
        """hidden [T, H], probs/map [T, E] -> (tokens [N, H], tokens_per_expert [E_loc], probs [N])."""
        self.hidden_shape_before_permute = hidden_states.shape
        self.routing_map = routing_map
        tokens_per_expert = self._preprocess(routing_map)
        tokens, permuted_probs, self.reversed_mapping = permute(hidden_states, routing_map, probs)
        if self.ep_size > 1:
            with ep_comm_section("dispatch_all_to_all"):
                tokens = all_to_all(self.ep_group, tokens, self.output_splits, self.input_splits)
                permuted_probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        if self.tp_size > 1:
            with ep_comm_section("dispatch_expert_tp_all_gather"):
                tokens = gather_along_first_dim(tokens, self.tp_group, self.output_splits_tp)
                permuted_probs = gather_along_first_dim(permuted_probs, self.tp_group, self.output_splits_tp)
        if self.num_local_experts > 1 and self.tp_ep_size > 1:
            tokens, permuted_probs = sort_chunks_by_idxs(tokens, self.num_global_tokens_per_local_expert,
                                                         self.sort_input_by_local_experts, permuted_probs)
        return tokens, tokens_per_expert, permuted_probs

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """expert output [N, H] -> this rank's tokens [T, H]."""
        hidden = expert_output
        if self.num_local_experts > 1 and self.tp_ep_size > 1:
            # Chunk sizes in the sorted (local expert, etp, ep) order.
            sizes = self.num_global_tokens_per_local_expert
            sorted_sizes = [sizes[c] for c in self.sort_input_by_local_experts]
            hidden, _ = sort_chunks_by_idxs(hidden, sorted_sizes, self.restore_output_by_local_experts)
        if self.tp_size > 1:
            with ep_comm_section("combine_expert_tp_reduce_scatter"):
                hidden = reduce_scatter_along_first_dim(hidden, self.tp_group, self.output_splits_tp)
        if self.ep_size > 1:
            with ep_comm_section("combine_all_to_all"):
                hidden = all_to_all(self.ep_group, hidden, self.input_splits, self.output_splits)
        output = unpermute(hidden, self.reversed_mapping, self.hidden_shape_before_permute)
        self.routing_map = self.reversed_mapping = None
        return output
