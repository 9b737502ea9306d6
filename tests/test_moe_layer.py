"""MoELayer: built into TransformerLayer, and at EP=2, EP=2 x TP=2 (sequence parallel) and ETP=1 with TP=2 it gives
the outputs and gradients of one process holding all experts (both dispatchers, dropless and with a capacity factor).

fp64, weights drawn with std 0.5 (O(1) activations). The reference runs in every rank first, with parallel_state at size 1 and the same seed: each data-parallel
replica's batch through one full layer. Then the parallel layer (same seed: expert shards are cut from the same
masters, ``moe/experts.py``) runs this rank's shard. Compared within 1e-6: the parameters at init, this
rank's output and input gradient, and the weight gradients summed over the ranks that hold the same shard
(router: all ranks, as DP + the SP all-reduce would; experts: the expert-data-parallel group) against the
reference's gradients summed over the replicas. Objective per rank: ``(output * G).sum()`` plus the attached
aux loss (scale 1). With a capacity factor under sequence parallelism each SP shard drops on its own tokens
(Megatron's semantics), so that reference routes each shard separately, with the aux loss off (its token
count T would then differ from the TP-summed one).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import run_distributed
from megatron.core import parallel_state
from megatron.core.process_groups_config import ModelCommProcessGroups
from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.moe.experts import _grouped_mm_applies, grouped_matmul
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

S, B, H, E = 8, 2, 16, 4
TOL = 1e-6


def _config(**kw):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, num_moe_experts=E, ffn_hidden_size=32,
                moe_ffn_hidden_size=8, add_bias_linear=False, use_cpu_initialization=True, moe_router_topk=2,
                moe_aux_loss_coeff=0.1, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.5, params_dtype=torch.float64)  # O(1) activations in fp64: 1e-6 means something
    base.update(kw)
    return TransformerConfig(**base)


def _layer(config, seed=1234):
    torch.manual_seed(seed)
    layer = MoELayer(config, layer_number=1, model_comm_pgs=ModelCommProcessGroups.use_mpu_process_groups())
    layer.train()
    return layer


def _run(layer, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    (out * grad_out).sum().backward()
    return out.detach(), x.grad.detach()


def _expert_tensors(layer, use_grad):
    """{(global expert, 'fc1'|'fc2'): local shard [rows, cols]} of SequentialMLP or GroupedMLP (as fc1 [F', H])."""
    out = {}
    experts = layer.experts
    first = layer.local_expert_indices[0]
    if hasattr(experts, "local_experts"):
        for j, mlp in enumerate(experts.local_experts):
            for name in ("fc1", "fc2"):
                w = getattr(mlp, f"linear_{name}").weight
                out[(first + j, name)] = (w.grad if use_grad else w).detach().clone()
    else:
        n = layer.num_local_experts
        w1 = experts.weight1.grad if use_grad else experts.weight1
        w2 = experts.weight2.grad if use_grad else experts.weight2
        for j, (a, b) in enumerate(zip(w1.detach().chunk(n, dim=1), w2.detach().chunk(n, dim=0))):
            out[(first + j, "fc1")] = a.t().contiguous()
            out[(first + j, "fc2")] = b.t().contiguous()
    return out


def _shard(full, name, glu, etp, etp_rank):
    """This expert-TP rank's shard of a full expert weight (fc1 rows [gate_r; up_r] with GLU, fc2 columns)."""
    if name == "fc2":
        return full.chunk(etp, dim=1)[etp_rank]
    parts = full.chunk(2, dim=0) if glu else (full,)
    return torch.cat([p.chunk(etp, dim=0)[etp_rank] for p in parts], dim=0)


def _close(a, b, what):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= TOL, f"{what}: max abs diff {err}"
    return err


def _case_worker(rank, world, case):
    torch.use_deterministic_algorithms(False)
    tp, ep, etp, sp = case["tp"], case["ep"], case.get("etp"), case.get("sp", False)
    kw = dict(case.get("kw", {}))
    glu = kw.get("gated_linear_unit", False)
    if glu:
        kw["activation_func"] = F.silu
    dp = world // tp
    gen = torch.Generator().manual_seed(99)
    xs = [torch.randn(S, B, H, generator=gen, dtype=torch.float64) for _ in range(dp)]
    gs = [torch.randn(S, B, H, generator=gen, dtype=torch.float64) for _ in range(dp)]
    per_shard_ref = sp and tp > 1 and kw.get("moe_expert_capacity_factor") is not None
    if per_shard_ref:
        kw["moe_aux_loss_coeff"] = 0.0

    # Reference: one process, all experts, one data-parallel replica's batch at a time.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    ref = _layer(_config(**kw))
    ref_init = _expert_tensors(ref, False)
    ref_router_init = ref.router.weight.detach().clone()
    ref_out, ref_dx, ref_aux = [], [], []
    for d in range(dp):
        tracker = get_moe_layer_wise_logging_tracker()
        tracker.clear()
        if per_shard_ref:
            outs, dxs = zip(*[_run(ref, xc, gc) for xc, gc in zip(xs[d].chunk(tp), gs[d].chunk(tp))])
            out, dx = torch.cat(outs), torch.cat(dxs)
        else:
            out, dx = _run(ref, xs[d], gs[d])
        ref_out.append(out)
        ref_dx.append(dx)
        ref_aux.append(float(tracker["load_balancing_loss"]["values"][0]) if "load_balancing_loss" in tracker
                       else None)
    ref_router_grad = ref.router.weight.grad.detach().clone()
    ref_expert_grad = _expert_tensors(ref, True)

    # The parallel layer.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    layer = _layer(_config(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                           expert_tensor_parallel_size=etp, sequence_parallel=sp, **kw))
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    d = parallel_state.get_data_parallel_rank()
    checked = {}
    # Same weights as the reference at init (the masters of every expert drawn in global order).
    _close(layer.router.weight.detach(), ref_router_init, "router init")
    for (g, name), w in _expert_tensors(layer, False).items():
        checked["init"] = _close(w, _shard(ref_init[(g, name)], name, glu, etp_size, etp_rank), f"init {g} {name}")

    x, g_out = xs[d], gs[d]
    if sp:
        x, g_out = x.chunk(tp)[tp_rank], g_out.chunk(tp)[tp_rank]
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    recorder = routing_stats.install()
    try:
        out, dx = _run(layer, x, g_out)
    finally:
        routing_stats.uninstall()
    counts, dropped = recorder.take()[1]
    # The router's counts (before dropping) cover this rank's tokens, topk each; drops only with a capacity.
    assert sum(counts) == x.shape[0] * B * 2 and len(counts) == E, counts
    checked["dropped"] = dropped
    if kw.get("moe_expert_capacity_factor") is None:
        assert dropped == 0
    want_out, want_dx = ref_out[d], ref_dx[d]
    if sp:
        want_out, want_dx = want_out.chunk(tp)[tp_rank], want_dx.chunk(tp)[tp_rank]
    checked["out"] = _close(out, want_out, "output")
    checked["dx"] = _close(dx, want_dx, "input grad")
    if ref_aux[d] is not None:
        aux = tracker["load_balancing_loss"]["values"].clone()
        group = tracker["load_balancing_loss"]["reduce_group"]
        if group is not None:
            dist.all_reduce(aux, group=group)
        checked["aux"] = abs(float(aux[0]) - ref_aux[d])
        assert checked["aux"] <= TOL, f"aux loss {float(aux[0])} vs {ref_aux[d]}"

    router_grad = layer.router.weight.grad.detach().clone()
    dist.all_reduce(router_grad)  # what DP + the sequence-parallel all-reduce sum
    checked["router_grad"] = _close(router_grad, ref_router_grad, "router grad")
    edp = parallel_state.get_expert_data_parallel_group()
    for (g, name), grad in _expert_tensors(layer, True).items():
        if dist.get_world_size(edp) > 1:
            dist.all_reduce(grad, group=edp)
        checked[f"grad {g} {name}"] = _close(grad, _shard(ref_expert_grad[(g, name)], name, glu, etp_size, etp_rank),
                                             f"expert {g} {name} grad")
    parallel_state.destroy_model_parallel()
    return checked


_DROP = dict(moe_expert_capacity_factor=1.0)
CASES = {
    # 2 ranks: EP=2 (DP=2), both dispatchers, dropless and with capacity (each policy, padding), SwiGLU,
    # shared expert, sigmoid + expert bias, grouped GEMM, groups, z-loss, seq-aux loss.
    "ep2_allgather": dict(world=2, tp=1, ep=2, kw=dict(moe_token_dispatcher_type="allgather")),
    "ep2_alltoall": dict(world=2, tp=1, ep=2, kw=dict(moe_token_dispatcher_type="alltoall")),
    "ep2_allgather_drop_probs": dict(world=2, tp=1, ep=2, kw=dict(moe_token_dispatcher_type="allgather", **_DROP)),
    "ep2_alltoall_drop_position": dict(world=2, tp=1, ep=2, kw=dict(
        moe_token_dispatcher_type="alltoall", moe_token_drop_policy="position", **_DROP)),
    "ep2_alltoall_pad": dict(world=2, tp=1, ep=2, kw=dict(
        moe_token_dispatcher_type="alltoall", moe_pad_expert_input_to_capacity=True, **_DROP)),
    "ep2_alltoall_swiglu_shared_grouped": dict(world=2, tp=1, ep=2, kw=dict(
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True, moe_shared_expert_intermediate_size=8,
        moe_grouped_gemm=True)),
    "ep2_allgather_sigmoid_bias_groups_z": dict(world=2, tp=1, ep=2, kw=dict(
        moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
        moe_z_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss")),
    # 4 ranks: EP=2 x TP=2 with sequence parallel (ETP=2), and ETP=1 with TP=2.
    "ep2_tp2_sp_allgather": dict(world=4, tp=2, ep=2, sp=True, kw=dict(
        moe_token_dispatcher_type="allgather", gated_linear_unit=True, moe_shared_expert_intermediate_size=8)),
    "ep2_tp2_sp_alltoall": dict(world=4, tp=2, ep=2, sp=True, kw=dict(
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True)),
    "ep2_tp2_sp_alltoall_grouped_pad": dict(world=4, tp=2, ep=2, sp=True, kw=dict(
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True, moe_grouped_gemm=True,
        moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="position", **_DROP)),
    "ep2_tp2_sp_allgather_sigmoid_z": dict(world=4, tp=2, ep=2, sp=True, kw=dict(
        moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_z_loss_coeff=1e-2)),
    "ep2_tp2_sp_alltoall_drop": dict(world=4, tp=2, ep=2, sp=True, kw=dict(
        moe_token_dispatcher_type="alltoall", **_DROP)),
    "ep2_etp1_tp2_sp_alltoall": dict(world=4, tp=2, ep=2, etp=1, sp=True, kw=dict(
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)),
    "ep2_etp1_tp2_sp_allgather_drop": dict(world=4, tp=2, ep=2, etp=1, sp=True, kw=dict(
        moe_token_dispatcher_type="allgather", **_DROP)),
    "ep1_tp2_sp_alltoall": dict(world=2, tp=2, ep=1, sp=True, kw=dict(moe_token_dispatcher_type="alltoall")),
}


def _cases_worker(rank, world, names):
    return {name: _case_worker(rank, world, CASES[name]) for name in names}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_parallel_matches_one_process(world):
    names = [n for n, c in CASES.items() if c["world"] == world]
    results = run_distributed(_cases_worker, world, names, timeout=280)
    for rank, checked in enumerate(results):
        assert set(checked) == set(names), rank
        for name in names:
            assert "out" in checked[name] and "router_grad" in checked[name] and "init" in checked[name], name
            assert any(k.startswith("grad ") for k in checked[name]), name
    for name in names:  # a capacity factor of 1.0 drops some (token, expert) pairs on some rank
        if "moe_expert_capacity_factor" in CASES[name]["kw"]:
            assert sum(checked[name]["dropped"] for checked in results) > 0, name


def test_transformer_layer_builds_moe_where_config_says():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = _config(moe_layer_freq=[1, 0])
    assert isinstance(TransformerLayer(config, layer_number=1).mlp, MoELayer)
    assert isinstance(TransformerLayer(config, layer_number=2).mlp, MLP)
    layer = TransformerLayer(config, layer_number=1)
    names = {n for n, _ in layer.state_dict().items()}
    assert {"mlp.router.weight", "mlp.experts.local_experts.3.linear_fc1.weight",
            "mlp.experts.local_experts.0.linear_fc2.weight"} <= names
    assert all(not getattr(p, "allreduce", True) for n, p in layer.named_parameters() if ".experts." in n)
    out, _ = layer(torch.randn(S, B, H, dtype=torch.float64))
    assert out.shape == (S, B, H)


def test_moe_layer_refuses_expert_sizes_its_groups_do_not_have():
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 but the expert-parallel group has 1"):
        MoELayer(_config(expert_model_parallel_size=2), 1, ModelCommProcessGroups())


def test_moe_layer_refuses_tp_without_sequence_parallel_in_training(monkeypatch):
    layer = _layer(_config())
    monkeypatch.setattr(layer, "attn_tp_group", object())
    monkeypatch.setattr("megatron.core.transformer.moe.moe_layer.group_size", lambda g: 2 if g is not None else 1)
    with pytest.raises(ValueError, match="sequence parallelism"):
        layer(torch.randn(S, B, H, dtype=torch.float64))
    layer.eval()
    layer(torch.randn(S, B, H, dtype=torch.float64))  # inference is allowed


def test_grouped_matmul_loop_matches_per_expert_matmuls_and_grouped_mm_where_it_applies():
    torch.manual_seed(0)
    counts = [3, 0, 5, 8]
    x = torch.randn(sum(counts), 16, dtype=torch.float64)
    w = torch.randn(4, 16, 8, dtype=torch.float64)
    want = torch.cat([x[sum(counts[:i]):sum(counts[:i + 1])] @ w[i] for i in range(4)])
    assert torch.equal(grouped_matmul(x, w, counts, use_grouped_mm=False), want)
    assert not _grouped_mm_applies(x, w)  # no grouped GEMM in fp64: the loop serves
    cases = [("cpu", torch.float32, 1e-5)]
    if torch.cuda.is_available():
        cases.append(("cuda", torch.bfloat16, 2e-2))
    ran = []
    for device, dtype, tol in cases:
        xd = x.to(device, dtype).requires_grad_(True)
        wd = w.to(device, dtype).requires_grad_(True)
        if not _grouped_mm_applies(xd, wd):
            continue  # this torch has no grouped GEMM for the device/dtype
        ran.append(device)
        grads = []
        for use in (True, False):
            xd.grad = wd.grad = None
            out = grouped_matmul(xd, wd, counts, use_grouped_mm=use)
            out.sum().backward()  # a stride-0 gradient, which the grouped GEMM's backward needs contiguous
            grads.append((out.detach().float(), xd.grad.float(), wd.grad.float()))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if hasattr(F, "grouped_mm"):
        assert ran, "torch has grouped_mm but it ran nowhere"


def test_sequential_and_grouped_mlp_agree_with_same_seed():
    # fp64: GroupedMLP loops; fp32: GroupedMLP runs torch's grouped GEMM where this torch has one on CPU.
    for dtype, tol in ((torch.float64, TOL), (torch.float32, 1e-5)):
        x = torch.randn(S, B, H, dtype=dtype)
        outs, grads = [], []
        for grouped in (False, True):
            layer = _layer(_config(moe_grouped_gemm=grouped, gated_linear_unit=True, activation_func=F.silu,
                                   params_dtype=dtype))
            outs.append(_run(layer, x, torch.ones(S, B, H, dtype=dtype)))
            grads.append(_expert_tensors(layer, True))
        for a, b in zip(outs[0], outs[1]):
            assert (a - b).abs().max() <= tol
        for key in grads[0]:
            assert (grads[0][key] - grads[1][key]).abs().max() <= tol, key


def test_aux_loss_backward_uses_the_class_scale():
    layer = _layer(_config())
    x = torch.randn(S, B, H, dtype=torch.float64)
    grads = []
    try:
        for scale in (1.0, 0.0):
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
            layer.zero_grad()
            _run(layer, x, torch.zeros(S, B, H, dtype=torch.float64))  # only the aux loss reaches the router
            grads.append(layer.router.weight.grad.abs().sum().item())
    finally:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    assert grads[0] > 0 and grads[1] == 0


def _gpt_moe_step(recompute):
    from megatron.core.models.gpt import GPTModel

    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    config = _config(moe_layer_freq=[1, 1], **kw)
    torch.manual_seed(3)
    model = GPTModel(config, vocab_size=32, max_sequence_length=S).train()
    tokens = torch.randint(0, 32, (B, S))
    position_ids = torch.arange(S).unsqueeze(0).expand(B, -1)
    recorder = routing_stats.install()
    try:
        get_moe_layer_wise_logging_tracker().clear()
        loss = model(tokens, position_ids, None, labels=tokens)
        loss.sum().backward()
    finally:
        routing_stats.uninstall()
    tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()
    return recorder.take(), tracked, model.decoder.layers[0].mlp.router.weight.grad.clone()


def test_gpt_model_with_moe_records_and_logs_each_layer_once_even_with_full_recompute():
    stats, tracked, grad = _gpt_moe_step(recompute=False)
    assert sorted(stats) == [1, 2] and all(sum(counts) == S * B * 2 for counts, _ in stats.values())
    assert (tracked > 0).all()
    # Full recompute runs each layer twice (no-grad forward, replay in backward): still one record and one loss.
    stats_rc, tracked_rc, grad_rc = _gpt_moe_step(recompute=True)
    assert stats_rc == stats
    assert torch.equal(tracked_rc, tracked)
    torch.testing.assert_close(grad_rc, grad, rtol=0, atol=1e-12)


def test_expert_parallel_overrides_build_another_ranks_experts_with_the_same_weights():
    # Converters build the model of EP rank 1 of 2 in one process (parallel_state's set_* overrides).
    full = _expert_tensors(_layer(_config()), False)
    parallel_state.set_expert_model_parallel_world_size(2)
    parallel_state.set_expert_model_parallel_rank(1)
    try:
        for grouped in (False, True):
            layer = _layer(_config(expert_model_parallel_size=2, moe_grouped_gemm=grouped))
            assert layer.local_expert_indices == [2, 3]
            shard = _expert_tensors(layer, False)
            assert sorted(shard) == [(2, "fc1"), (2, "fc2"), (3, "fc1"), (3, "fc2")]
            assert all(torch.equal(shard[key], full[key]) for key in shard)
    finally:
        parallel_state.set_expert_model_parallel_world_size(None)
        parallel_state.set_expert_model_parallel_rank(None)
