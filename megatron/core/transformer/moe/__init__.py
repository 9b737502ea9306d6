"""Mixture of experts (Megatron core_v0.14's MoE layer): router, token dispatchers, experts, shared experts."""
