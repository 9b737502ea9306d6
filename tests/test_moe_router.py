"""TopKRouter and moe_utils against hand-computed formulas: score functions, pre-softmax, scaling, group-limited
routing, capacity policies and padding, aux / seq-aux / z-loss values and gradients, expert bias, the loss tracker."""
import math

import pytest
import torch

from dist_utils import run_distributed
from megatron.core import parallel_state
from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    clear_aux_losses_tracker,
    get_capacity,
    get_moe_layer_wise_logging_tracker,
    get_updated_expert_bias,
    permute,
    save_to_aux_losses_tracker,
    topk_routing_with_score_function,
    track_moe_metrics,
    unpermute,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

E, H = 4, 8
LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0],
                       [0.5, -1.0, 2.5, 2.0],
                       [0.0, 0.1, 0.2, 0.3]], dtype=torch.float64)


def _config(**kw):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E, add_bias_linear=False,
                use_cpu_initialization=True, params_dtype=torch.float64, init_method_std=0.5)
    base.update(kw)
    return TransformerConfig(**base)


def _router(**kw):
    torch.manual_seed(0)
    router = TopKRouter(_config(**kw), ModelCommProcessGroups())
    router.set_layer_number(1)
    return router.train()


@pytest.fixture(autouse=True)
def _fresh_tracker():
    get_moe_layer_wise_logging_tracker().clear()
    yield
    get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def _dense(rows, idx, vals):
    out = torch.zeros(len(idx), E, dtype=torch.float64)
    for r, (i, v) in enumerate(zip(idx, vals)):
        out[r, list(i)] = torch.tensor(v, dtype=torch.float64)
    return out


def test_softmax_post_softmax_topk_then_softmax_over_k():
    probs, rmap = topk_routing_with_score_function(LOGITS, 2)
    idx = [(1, 2), (2, 3), (3, 2)]
    want = _dense(3, idx, [[math.exp(3) / (math.exp(3) + math.exp(2)), math.exp(2) / (math.exp(3) + math.exp(2))],
                           [1 / (1 + math.exp(-0.5)), math.exp(-0.5) / (1 + math.exp(-0.5))],
                           [1 / (1 + math.exp(-0.1)), math.exp(-0.1) / (1 + math.exp(-0.1))]])
    torch.testing.assert_close(probs, want, rtol=0, atol=2e-7)  # softmax/sigmoid run in fp32 (Megatron)
    assert torch.equal(rmap, want > 0)


def test_softmax_pre_softmax_and_scaling_factor():
    probs, rmap = topk_routing_with_score_function(LOGITS, 2, use_pre_softmax=True, scaling_factor=2.5)
    full = torch.softmax(LOGITS, dim=-1)
    want = torch.where(rmap, full * 2.5, torch.zeros_like(full))
    assert rmap.sum(1).tolist() == [2, 2, 2] and rmap[0, 1] and rmap[0, 2] and rmap[1, 2] and rmap[1, 3]
    torch.testing.assert_close(probs, want, rtol=0, atol=2e-7)  # softmax/sigmoid run in fp32 (Megatron)


def test_sigmoid_bias_selects_only_and_scores_normalise_for_topk_above_one():
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)  # forces expert 3 into every selection
    probs, rmap = topk_routing_with_score_function(LOGITS, 2, score_function="sigmoid", expert_bias=bias)
    sig = torch.sigmoid(LOGITS)
    assert rmap[:, 3].all()
    assert rmap[0].tolist() == [False, True, False, True]
    for r in range(3):
        chosen = sig[r][rmap[r]]
        torch.testing.assert_close(probs[r][rmap[r]], chosen / chosen.sum(), rtol=0, atol=2e-7)  # softmax/sigmoid run in fp32 (Megatron)
    probs1, rmap1 = topk_routing_with_score_function(LOGITS, 1, score_function="sigmoid")
    torch.testing.assert_close(probs1[rmap1], sig.max(dim=1).values, rtol=0, atol=2e-7)  # softmax/sigmoid run in fp32 (Megatron)  # topk=1: raw sigmoid


def test_group_limited_routing_ranks_groups_by_their_top_scores():
    # Groups {0,1}, {2,3}; group_topk=1, topk=2: a group scores the sum of its top-2.
    logits = torch.tensor([[5.0, -9.0, 2.0, 2.5]], dtype=torch.float64)  # group 0: -4, group 1: 4.5
    probs, rmap = topk_routing_with_score_function(logits, 2, num_groups=2, group_topk=1)
    assert rmap[0].tolist() == [False, False, True, True]  # expert 0 (best single score) is in the losing group
    e = math.exp(-0.5)
    torch.testing.assert_close(probs[0, 2:], torch.tensor([e / (1 + e), 1 / (1 + e)], dtype=torch.float64))


def test_capacity_probs_and_position_policies_and_padding():
    assert get_capacity(num_tokens=6 * 2, num_experts=4, capacity_factor=1.0) == 3
    assert get_capacity(num_tokens=5 * 2, num_experts=4, capacity_factor=1.0) == 3  # ceil(2.5)
    # 4 tokens, topk 1, E 4, factor 1 -> capacity 1; tokens 0..2 all chose expert 0.
    probs = torch.tensor([[0.2, 0, 0, 0], [0.9, 0, 0, 0], [0.5, 0, 0, 0], [0, 0.7, 0, 0]], dtype=torch.float64)
    rmap = probs > 0
    p, m = apply_router_token_dropping(probs, rmap, router_topk=1, capacity_factor=1.0, drop_policy="probs")
    assert m[:, 0].tolist() == [False, True, False, False] and m[3, 1]  # the highest prob stays
    assert p[1, 0] == 0.9 and p[0, 0] == 0 and m.sum() == 2
    p, m = apply_router_token_dropping(probs, rmap, router_topk=1, capacity_factor=1.0, drop_policy="position")
    assert m[:, 0].sum() == 1 and m[3, 1] and m.sum() == 2  # one of the routed tokens stays, by position
    p, m = apply_router_token_dropping(probs, rmap, router_topk=1, capacity_factor=1.0, drop_policy="probs",
                                       pad_to_capacity=True)
    assert m.sum(0).tolist() == [1, 1, 1, 1]  # every expert gets exactly the capacity
    assert p[1, 0] == 0.9 and p[3, 1] == 0.7 and p.sum() == pytest.approx(1.6)  # padding rows carry prob 0
    with pytest.raises(ValueError, match="moe_token_drop_policy"):
        apply_router_token_dropping(probs, rmap, 1, 1.0, drop_policy="random")


def _aux_formula(logits, topk, coeff):
    scores = torch.softmax(logits, dim=-1)
    top = torch.topk(scores, topk, dim=1).indices
    counts = torch.zeros(logits.shape[1], dtype=torch.float64).scatter_add(
        0, top.reshape(-1), torch.ones(top.numel(), dtype=torch.float64))
    t = logits.shape[0]
    f = counts / (topk * t)
    p = scores.sum(0) / t
    return coeff * logits.shape[1] * (f * p).sum()


def test_aux_loss_value_tracker_and_gradient_match_switch_formula():
    router = _router(moe_aux_loss_coeff=0.3, moe_router_topk=2)
    x = torch.randn(5, 2, H, dtype=torch.float64)
    probs, _ = router(x)
    logits = (x.reshape(-1, H) @ router.weight.t()).detach().requires_grad_(True)
    want = _aux_formula(logits, 2, 0.3)
    tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert tracked.shape == (2,) and tracked[1] == 0
    assert float(tracked[0]) == pytest.approx(float(want.detach()) / 0.3, rel=1e-6)  # the tracker holds fp32, as Megatron's
    # Backward with zero upstream gradient: only the attached loss reaches the gate (scale 1).
    probs.backward(torch.zeros_like(probs))
    want.backward()
    torch.testing.assert_close(router.weight.grad, logits.grad.t() @ x.reshape(-1, H), rtol=1e-5, atol=1e-8)  # fp32 scores


def test_seq_aux_loss_is_the_mean_of_per_sequence_aux_losses():
    router = _router(moe_aux_loss_coeff=0.2, moe_router_load_balancing_type="seq_aux_loss")
    s, b = 6, 3
    x = torch.randn(s, b, H, dtype=torch.float64)
    router(x)
    logits = (x @ router.weight.t()).detach()  # [s, b, E]
    want = sum(_aux_formula(logits[:, j], 2, 0.2) for j in range(b)) / b
    tracked = get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"]["values"][0]
    assert float(tracked) == pytest.approx(float(want) / 0.2, rel=1e-6)  # the tracker holds fp32, as Megatron's
    assert "load_balancing_loss" not in get_moe_layer_wise_logging_tracker()


def test_aux_loss_list_form_pairs_types_and_coefficients():
    router = _router(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.0])
    assert router.get_aux_loss_coeff("aux_loss") == 0.1 and router.get_aux_loss_coeff("seq_aux_loss") == 0.0
    router(torch.randn(4, 2, H, dtype=torch.float64))
    assert set(get_moe_layer_wise_logging_tracker()) == {"load_balancing_loss"}
    assert _router(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.5).is_aux_loss_enabled() is False


def test_z_loss_value_and_gradient():
    router = _router(moe_z_loss_coeff=1e-2, moe_router_load_balancing_type="none")
    x = torch.randn(4, 2, H, dtype=torch.float64)
    probs, _ = router(x)
    logits = (x.reshape(-1, H) @ router.weight.t()).detach().requires_grad_(True)
    want = torch.logsumexp(logits, dim=-1).square().mean()
    tracked = get_moe_layer_wise_logging_tracker()["z_loss"]["values"][0]
    assert float(tracked) == pytest.approx(float(want.detach()), rel=1e-6)  # the tracker holds fp32, as Megatron's
    probs.backward(torch.zeros_like(probs))
    (want * 1e-2).backward()
    torch.testing.assert_close(router.weight.grad, logits.grad.t() @ x.reshape(-1, H), rtol=1e-5, atol=1e-8)  # fp32 scores


def test_no_losses_in_eval_and_router_dtype():
    router = _router(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.1, params_dtype=torch.float32,
                     moe_router_dtype="fp64").eval()
    probs, rmap = router(torch.randn(4, 2, H))
    assert probs.dtype == torch.float64 and rmap.dtype == torch.bool and rmap.shape == (8, E)
    assert get_moe_layer_wise_logging_tracker() == {}


def test_expert_bias_counts_after_dropping_and_update_rule():
    router = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="none")
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
    assert router.expert_bias.dtype == torch.float32
    recorder = routing_stats.install()
    try:
        _, rmap = router(torch.randn(6, 2, H, dtype=torch.float64))
    finally:
        routing_stats.uninstall()
    assert router.local_tokens_per_expert.tolist() == rmap.sum(0).tolist()
    counts, dropped = recorder.take()[1]
    assert sum(counts) == 24 and sum(counts) - dropped == int(rmap.sum())  # counts before dropping
    tokens = torch.tensor([1.0, 5.0, 3.0, 3.0])
    bias = torch.tensor([0.5, 0.5, 0.0, -1.0])
    updated = get_updated_expert_bias(tokens, bias, 1e-3)
    torch.testing.assert_close(updated, torch.tensor([0.501, 0.499, 0.0, -1.0]))  # mean 3: +, -, 0, 0


def test_aux_loss_autoscaler_passes_activations_and_scales_the_loss_gradient():
    a = torch.randn(3, requires_grad=True)
    loss = torch.tensor(2.0, requires_grad=True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    out = MoEAuxLossAutoScaler.apply(a, loss)
    assert torch.equal(out, a)
    out.sum().backward()
    assert loss.grad == 0.25 and torch.equal(a.grad, torch.ones(3))


def test_permute_unpermute_round_trip():
    tokens = torch.arange(12, dtype=torch.float64).view(4, 3)
    rmap = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    permuted, _, idx = permute(tokens, rmap)
    assert idx.tolist() == [0, 2, 1, 2, 0, 3]  # expert-major, token order inside an expert
    assert torch.equal(unpermute(permuted, idx, tokens.shape), tokens * rmap.sum(1, keepdim=True))


def test_track_moe_metrics_averages_over_moe_layers_and_clears():
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(3.0), 1, 4)
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), 1, 4)  # second micro-batch adds
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2.0), 3, 4)
    total = {}

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, name, value, it):
            self.scalars[name] = float(value)

    writer = Writer()
    track_moe_metrics(0.5, 7, writer, total_loss_dict=total, per_layer_logging=True, num_layers=4,
                      moe_layer_freq=2)
    assert float(total["load_balancing_loss"]) == pytest.approx((4.0 + 2.0) * 0.5 / 2)
    assert writer.scalars["moe/load_balancing_loss_layer_0"] == 2.0 and writer.scalars["load_balancing_loss"] == 1.5
    assert float(get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].sum()) == 0
    clear_aux_losses_tracker()


def _tracker_reduce_worker(rank, world):
    from megatron.core.transformer.moe.moe_utils import reduce_aux_losses_tracker_across_ranks

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(float(rank + 1)), 2, 2, reduce_group=tp_cp)
    save_to_aux_losses_tracker("z_loss", torch.tensor(float(rank + 1)), 1, 2)
    reduce_aux_losses_tracker_across_ranks()
    out = {name: tracker[name]["values"].tolist() for name in tracker}
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.timeout(120)
def test_tracker_sums_over_the_reduce_group_and_averages_over_data_parallel():
    # 4 ranks, TP=2: TP groups {0,1} {2,3}, DP groups {0,2} {1,3}. Values rank+1.
    results = run_distributed(_tracker_reduce_worker, 4, timeout=100)
    for out in results:
        assert out["load_balancing_loss"] == [0.0, ((1 + 2) + (3 + 4)) / 2]  # SUM over TP, AVG over DP
    assert [out["z_loss"][0] for out in results] == [2.0, 3.0, 2.0, 3.0]  # no reduce group: AVG over DP only
