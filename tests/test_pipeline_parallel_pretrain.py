"""pretrain_gpt.py with pipeline parallelism (2 stages, 2 virtual stages each) end to end on gloo ranks:
the losses of one process, Megatron's per-stage checkpoint layout, and an exact resume.

Three launches of a 4-layer GPT for 20 iterations (fp32, dropout off, same seed, data and global batch):
one process; PP=2 interleaved, saving at iterations 10 and 20; and resumed from its checkpoint at 10.
Losses and grad norms are read from TensorBoard (float32), which the last rank (last stage) writes.
The other layouts (1F1B at PP=2/4, untied embeddings, uneven split, PP x TP, PP x DP) are compared in
tests/test_pipeline_parallel_training.py.
"""
import pytest
import torch

from pretrain_utils import losses_from_log, run_pretrain, tensorboard_scalars

ITERS = 20
FLAGS = ["--num-layers", "4", "--train-iters", str(ITERS), "--micro-batch-size", "4", "--eval-interval", "10",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
PP2_VP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _train(nproc, flags, shared_data, prefix, tmp_path):
    tb = tmp_path / "tb"
    out = run_pretrain(nproc, [*FLAGS, *flags, "--tensorboard-dir", str(tb)], shared_data, prefix, tmp_path)
    return dict(out=out, loss=tensorboard_scalars(tb, "lm loss"), grad_norm=tensorboard_scalars(tb, "grad-norm"))


@pytest.fixture(scope="module")
def pp2_vp2_run(shared_data, shakespeare_prefix, tmp_path_factory):
    """The PP=2 interleaved run, with its checkpoints (iterations 10 and 20) under ``run["ckpt"]``."""
    tmp = tmp_path_factory.mktemp("pp2_vp2")
    run = _train(2, PP2_VP2 + ["--ckpt-format", "torch", "--save", str(tmp / "ckpt"), "--save-interval", "10"], shared_data,
                 shakespeare_prefix, tmp)
    return dict(run, ckpt=tmp / "ckpt")


@pytest.mark.timeout(600)
def test_pp2_interleaved_matches_one_process_for_20_iterations(pp2_vp2_run, shared_data, shakespeare_prefix,
                                                                tmp_path):
    reference = _train(1, [], shared_data, shakespeare_prefix, tmp_path)
    run = pp2_vp2_run
    assert "pipeline-model-parallel size: 2" in run["out"]
    # Both stages built their chunks; the last stage's log line and validation block are printed.
    assert "model parallel rank (0, 0)" in run["out"] and "model parallel rank (0, 1)" in run["out"]
    assert " validation loss at iteration 10 " in run["out"]
    assert sorted(run["loss"]) == sorted(reference["loss"]) == list(range(1, ITERS + 1))
    for metric in ("loss", "grad_norm"):
        for iteration, expected in reference[metric].items():
            assert run[metric][iteration] == pytest.approx(expected, rel=1e-5), f"{metric} at iteration {iteration}"
    assert sorted(losses_from_log(run["out"])) == list(range(1, ITERS + 1))
    assert reference["loss"][ITERS] < reference["loss"][1] - 0.2  # it learns, so the comparison means something


@pytest.mark.timeout(600)
def test_pp2_checkpoint_per_stage_resumes_exactly(pp2_vp2_run, shared_data, shakespeare_prefix, tmp_path):
    """The run's checkpoint at 10 (mp_rank_00_000, mp_rank_00_001, chunks model0/model1); resumed from it
    (--ckpt-step 10) to 20: the numbers of the uninterrupted run."""
    ckpt = pp2_vp2_run["ckpt"]
    stages = sorted(p.name for p in (ckpt / "iter_0000010").iterdir() if p.name != "integrity_manifest.json")
    assert stages == ["mp_rank_00_000", "mp_rank_00_001"]
    for stage, has_embedding in (("mp_rank_00_000", True), ("mp_rank_00_001", False)):
        state = torch.load(ckpt / "iter_0000010" / stage / "model_optim_rng.pt", weights_only=False)
        assert "model" not in state and sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]
        names = [name for chunk in ("model0", "model1") for name in state[chunk]]
        assert any("embedding.word_embeddings.weight" in name for name in names) is has_embedding
        assert any("output_layer.weight" in name for name in names) is not has_embedding  # tied: a copy
        # legacy format: local layer indices per chunk (one layer per chunk here)
        assert {name.split(".")[2] for name in names if name.startswith("decoder.layers.")} == {"0"}
    resumed = _train(2, PP2_VP2 + ["--ckpt-format", "torch", "--load", str(ckpt), "--ckpt-step", "10"], shared_data, shakespeare_prefix,
                     tmp_path / "resumed")
    full = pp2_vp2_run
    assert sorted(resumed["loss"]) == list(range(11, 21))
    for metric in ("loss", "grad_norm"):
        assert resumed[metric] == {it: full[metric][it] for it in range(11, 21)}, metric
    full_log, resumed_log = losses_from_log(full["out"]), losses_from_log(resumed["out"])
    assert resumed_log == {it: full_log[it] for it in range(11, 21)}
