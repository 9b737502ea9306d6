"""TransformerConfig's MoE fields: Megatron's rules, which layers are MoE, and the routing-stats recorder."""
import pytest
import torch

from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.transformer_config import TransformerConfig


def _config(**kw):
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=2, num_moe_experts=4, add_bias_linear=False)
    base.update(kw)
    return TransformerConfig(**base)


def test_moe_layer_freq_int_and_list():
    assert [_config(moe_layer_freq=2).is_moe_layer(i) for i in range(1, 5)] == [True, False, True, False]
    assert [_config(moe_layer_freq=[0, 1, 1, 0]).is_moe_layer(i) for i in range(1, 5)] == [False, True, True, False]
    assert not TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2).is_moe_layer(1)


def test_moe_defaults_follow_megatron():
    c = _config(ffn_hidden_size=24, tensor_model_parallel_size=1)
    assert c.moe_ffn_hidden_size == 24 and c.expert_tensor_parallel_size == 1
    assert c.moe_router_topk == 2 and c.moe_token_dispatcher_type == "allgather"
    assert _config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None


@pytest.mark.parametrize("kw, match", [
    (dict(add_bias_linear=True), "add_bias_linear"),
    (dict(expert_model_parallel_size=3), "multiple of expert_model_parallel_size"),
    (dict(moe_router_enable_expert_bias=True), "sigmoid"),
    (dict(moe_router_topk=1), "pre-softmax"),
    (dict(moe_router_group_topk=2), "moe_router_num_groups must be specified"),
    (dict(moe_router_group_topk=3, moe_router_num_groups=2), "smaller than"),
    (dict(moe_pad_expert_input_to_capacity=True), "capacity_factor"),
    (dict(moe_layer_freq=[1, 0]), "one 0/1 entry per layer"),
    (dict(moe_token_dispatcher_type="flex"), "allgather"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1), "one value per"),
])
def test_moe_rules_raise_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_routing_stats_recorder_sums_and_resets():
    assert routing_stats.active_recorder() is None
    routing_stats.record_routing(1, torch.tensor([1, 2]))  # no recorder: nothing kept, no error
    rec = routing_stats.install()
    try:
        routing_stats.record_routing(1, torch.tensor([1, 2, 0, 3]), torch.tensor(2))
        routing_stats.record_routing(1, torch.tensor([0, 1, 1, 0]))
        routing_stats.record_routing(3, torch.tensor([4, 0, 0, 0]))
        assert rec.take() == {1: ([1, 3, 1, 3], 2), 3: ([4, 0, 0, 0], 0)}
        assert rec.take() == {}
    finally:
        routing_stats.uninstall()
