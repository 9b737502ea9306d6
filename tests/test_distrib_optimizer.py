"""Data parallelism at scale: --overlap-grad-reduce, --use-distributed-optimizer, --overlap-param-gather.

Every layout trains the same tiny GPT on the same global batches in fp32 on gloo ranks and must give
the losses and grad norms of one process within 1e-6 (relative) for 20 iterations; the distributed
optimizer must hold 1/DP of the optimizer state; its checkpoint (Megatron's distrib_optim.pt)
must resume exactly. Several layouts run inside one launch of the ranks (tests/dp_harness.py).
"""
import io

import pytest
import torch

from dist_utils import run_distributed
from dp_harness import distopt_shard_checks, train_layouts
from pretrain_utils import run_pretrain, tensorboard_scalars

ITERS = 20
BUCKET = 2000  # elements: several buckets per buffer when overlapping (the model has ~30k params)
DP_LAYOUTS = {
    "ddp": dict(),
    "ddp-overlap": dict(overlap_grad_reduce=True, bucket_size=BUCKET),
    "distopt": dict(distopt=True),
    "distopt-overlap": dict(distopt=True, overlap_grad_reduce=True, bucket_size=BUCKET),
    "distopt-overlap-param-gather": dict(distopt=True, overlap_grad_reduce=True, overlap_param_gather=True,
                                         bucket_size=BUCKET),
}
TP2_LAYOUTS = {
    "tp2-distopt": dict(tp=2, distopt=True),
    "tp2-distopt-overlap-param-gather": dict(tp=2, distopt=True, overlap_grad_reduce=True, overlap_param_gather=True,
                                             bucket_size=BUCKET),
}


@pytest.fixture(scope="module")
def dp1():
    """The single-process reference: plain DDP wrapper, FP32Optimizer."""
    return run_distributed(train_layouts, 1, [dict()], ITERS, timeout=600)[0][0]


def _assert_matches(run, reference, what, rel=1e-6):
    assert len(run["loss"]) == len(reference["loss"]) == ITERS
    for metric in ("loss", "grad_norm"):
        for it, (got, expected) in enumerate(zip(run[metric], reference[metric]), start=1):
            assert got == pytest.approx(expected, rel=rel), f"{what}: {metric} at iteration {it}"


def _assert_state_bytes(per_rank, reference, dp, distopt, what):
    if not distopt:
        assert all(r["state_bytes"] == reference["state_bytes"] for r in per_rank), what
        return
    # Adam's moments of the whole model are split exactly over the data-parallel ranks ...
    assert sum(r["moment_bytes"] for r in per_rank) == reference["moment_bytes"], what
    # ... and each rank holds 1/dp of the state, up to the buffer padding (8 bytes per padded element
    # for the two fp32 moments) and Adam's 4-byte step per param piece.
    step_bytes = reference["state_bytes"] - reference["moment_bytes"]
    for rank, r in enumerate(per_rank):
        tolerance = 8 * r["padding"] + 2 * step_bytes
        assert abs(r["state_bytes"] - reference["state_bytes"] / dp) <= tolerance, f"{what}: rank {rank}"
        assert r["state_bytes"] < 0.6 * reference["state_bytes"], f"{what}: rank {rank}"


def _check_launch(results, names, layouts, reference, dp):
    for index, name in enumerate(names):
        per_rank = [results[rank][index] for rank in range(len(results))]
        _assert_matches(per_rank[0], reference, name)
        layout = layouts[name]
        if layout.get("overlap_grad_reduce"):
            assert per_rank[0]["num_buckets"] > 1, f"{name}: the overlap layouts must exercise several buckets"
        _assert_state_bytes(per_rank, reference, dp, layout.get("distopt", False), name)
    assert reference["loss"][-1] < reference["loss"][0] - 0.3  # it learns: the comparison is not vacuous


@pytest.fixture(scope="module")
def dp2_launch():
    """One launch of 2 ranks: the DP=2 layouts, the TP=2 x DP=1 reference, the fp16 shard checks."""
    layouts = [DP_LAYOUTS[n] for n in DP_LAYOUTS] + [dict(tp=2), distopt_shard_checks]
    return run_distributed(train_layouts, 2, layouts, ITERS, timeout=800)


@pytest.mark.timeout(900)
def test_dp2_layouts_match_dp1(dp1, dp2_launch):
    """Also (same launch) the fp16 distributed optimizer: grad norm over shards counted once, an Inf in
    one rank's shard skips the step on every rank, and gather_reduced_grads makes reduced grads whole."""
    _check_launch(dp2_launch, list(DP_LAYOUTS), DP_LAYOUTS, dp1, 2)
    for rank, checks in enumerate(result[-1] for result in dp2_launch):
        assert checks["ok"] and checks["same_params"], rank
        assert checks["whole_grads"], rank  # gather_reduced_grads
        assert checks["stale_after_step"] and checks["gathered_by_forward"], rank  # --overlap-param-gather
        assert checks["grad_norm"] == pytest.approx(checks["expected_norm"], rel=1e-6), rank
        assert checks["skipped_ok"] is False and checks["skipped_norm"] is None, rank
        assert checks["scale_after"] == checks["scale_before"] / 2, rank


@pytest.mark.timeout(1500)
def test_dp4_and_tp2_dp2_layouts_match_dp1(dp1, dp2_launch):
    """DP=4 against one process; TP=2 x DP=2 against TP=2 x DP=1 within 1e-6 (the data-parallel part),
    and against one process within 1e-5 (TP's own summation order, as in test_tensor_parallel_training)."""
    names = list(DP_LAYOUTS) + list(TP2_LAYOUTS)
    layouts = {**DP_LAYOUTS, **TP2_LAYOUTS}
    results = run_distributed(train_layouts, 4, [layouts[n] for n in names], ITERS, timeout=1400)
    _check_launch(results, list(DP_LAYOUTS), DP_LAYOUTS, dp1, 4)
    tp2_dp1 = dp2_launch[0][len(DP_LAYOUTS)]
    for index, name in enumerate(TP2_LAYOUTS, start=len(DP_LAYOUTS)):
        per_rank = [results[rank][index] for rank in range(4)]
        _assert_matches(per_rank[0], tp2_dp1, name)
        _assert_matches(per_rank[0], dp1, name, rel=1e-5)
        # Each rank holds 1/2 (DP) of its TP rank's half of the model's optimizer state; ranks are
        # ordered tp-dp, so ranks 0 and 2 are the data-parallel pair of TP rank 0.
        assert per_rank[0]["moment_bytes"] + per_rank[2]["moment_bytes"] == tp2_dp1["moment_bytes"], name
        assert all(r["state_bytes"] < 0.6 * tp2_dp1["state_bytes"] for r in per_rank), name


def test_optimizer_state_is_keyed_by_parameter_name():
    """Saved state names each param; loading matches names even when a group lists them in another order."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    config = OptimizerConfig(lr=0.1)
    first = model()
    optimizer = get_megatron_optimizer(config, [first])
    for p in first.parameters():
        p.main_grad = torch.randn(p.shape)
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert state["param_groups"][0]["params"] == ["0.weight", "1.weight"]
    # Reorder the saved group: the names, not the positions, decide where each state goes.
    state["param_groups"][0]["params"].reverse()
    fresh_model = model()
    fresh = get_megatron_optimizer(config, [fresh_model])
    fresh.load_state_dict(state)
    for name, param in fresh_model.named_parameters():
        assert torch.equal(fresh.state[param]["exp_avg"], state["state"][name]["exp_avg"]), name
    state["param_groups"][0]["params"][0] = "2.weight"
    with pytest.raises(ValueError, match="unexpected \\['2.weight'\\]"):
        fresh.load_state_dict(state)


# ---------------------------------------------------------------------------------------------------
# pretrain_gpt.py end to end
# ---------------------------------------------------------------------------------------------------

E2E = ["--train-iters", str(ITERS), "--micro-batch-size", "2", "--eval-interval", "10", "--hidden-dropout", "0",
       "--attention-dropout", "0"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "400000"]


def _train(nproc, flags, shared_data, prefix, tmp_path):
    tb = tmp_path / "tb"
    out = run_pretrain(nproc, [*E2E, *flags, "--tensorboard-dir", str(tb)], shared_data, prefix, tmp_path)
    return dict(out=out, loss=tensorboard_scalars(tb, "lm loss"), grad_norm=tensorboard_scalars(tb, "grad-norm"))


@pytest.mark.timeout(1200)
def test_pretrain_dp2_distributed_optimizer_matches_dp1_and_resumes_exactly(shared_data, shakespeare_prefix,
                                                                            tmp_path):
    """DP=2 with the distributed optimizer and both overlaps against DP=1; then resumed from its checkpoint
    at 10 (--ckpt-step; it saves at 10 and 20)."""
    ckpt = tmp_path / "ckpt"
    full = _train(2, DISTOPT + ["--ckpt-format", "torch", "--save", str(ckpt), "--save-interval", "10"], shared_data, shakespeare_prefix,
                  tmp_path / "full")
    reference = _train(1, [], shared_data, shakespeare_prefix, tmp_path / "dp1")
    assert sorted(full["loss"]) == list(range(1, ITERS + 1))
    for metric in ("loss", "grad_norm"):
        for it, expected in reference[metric].items():
            assert full[metric][it] == pytest.approx(expected, rel=1e-6), f"{metric} at iteration {it}"
    assert reference["loss"][ITERS] < reference["loss"][1] - 0.2

    rank_dir = ckpt / "iter_0000010" / "mp_rank_00"
    assert sorted(p.name for p in rank_dir.iterdir()) == ["distrib_optim.pt", "model_optim_rng.pt"]
    param_state = torch.load(rank_dir / "distrib_optim.pt", weights_only=True)
    assert param_state["buckets_coalesced"] is True
    (dtypes, world), = param_state[0].items()
    assert dtypes == (torch.float32, torch.float32)
    assert {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"} <= set(world)
    assert world["exp_avg"].numel() == world["numel_unpadded"] and world["exp_avg_sq"].abs().sum() > 0
    model_state = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
    assert "state" not in model_state["optimizer"]["optimizer"]
    assert model_state["optimizer"]["optimizer"]["param_groups"][0]["step"] == 10

    resumed = _train(2, DISTOPT + ["--ckpt-format", "torch", "--load", str(ckpt), "--ckpt-step", "10"], shared_data, shakespeare_prefix,
                     tmp_path / "resumed")
    assert sorted(resumed["loss"]) == list(range(11, ITERS + 1))
    for metric in ("loss", "grad_norm"):
        assert resumed[metric] == {it: full[metric][it] for it in range(11, ITERS + 1)}, metric
