"""--ckpt-format torch_dist: checkpoints that reload at another TP/PP/DP layout, exact resume, --async-save,
format detection.

Every run trains the 2-layer test GPT in fp32 without dropout on gloo ranks; losses are read from
TensorBoard (float32). A run saves at iteration 3 and continues to 8 (the reference); a second run
loads iteration 3 at another layout and continues to 8: its losses of iterations 4-8 must equal the
reference within 1e-5 relative (different reduction orders, the same numbers). The vocabulary is
padded to the same size at TP 1 and 2 (--make-vocab-size-divisible-by 64, 50304 rows) where losses
are compared, since the padding rows are part of the softmax; the padding case pads differently.
"""
import os

import pytest
import torch

from pretrain_utils import run_pretrain, tensorboard_scalars

pytestmark = pytest.mark.timeout(600)

SAVE_AT, ITERS = 3, 8
COMMON = ["--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100",
          "--make-vocab-size-divisible-by", "64"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


def _run(layout_flags, tmp_path, name, shared_data, prefix, extra=(), load=None, save=True, iters=ITERS,
         nproc=2, expect_failure=False):
    tb = tmp_path / f"tb_{name}"
    flags = [*COMMON, *layout_flags, "--train-iters", str(iters), "--tensorboard-dir", str(tb), *extra]
    if save:
        flags += ["--save", str(tmp_path / f"ckpt_{name}"), "--save-interval", str(SAVE_AT)]
    if load is not None:
        flags += ["--load", str(load)]
    out = run_pretrain(nproc, flags, shared_data, prefix, tmp_path, expect_failure=expect_failure)
    if expect_failure:
        return out
    return dict(out=out, loss=tensorboard_scalars(tb, "lm loss"), ckpt=tmp_path / f"ckpt_{name}")


def _keep_only_iteration(ckpt, iteration):
    """Point the tracker at ``iteration`` (the reference run saved later iterations too)."""
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.fixture(scope="module")
def reference_runs(shared_data, shakespeare_prefix, tmp_path_factory):
    """Per layout, computed on first use: a run that saves at 3 and continues to 8."""
    cache = {}

    def get(layout):
        if layout not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{layout}")
            run = _run(LAYOUTS[layout], tmp, layout, shared_data, shakespeare_prefix)
            assert sorted(run["loss"]) == list(range(1, ITERS + 1))
            assert os.path.isfile(run["ckpt"] / "iter_0000003" / ".metadata")
            _keep_only_iteration(run["ckpt"], SAVE_AT)
            cache[layout] = run
        return cache[layout]
    return get


@pytest.mark.parametrize("source,target", [("tp2", "pp2"), ("tp2", "dp2-distopt"), ("pp2", "tp2"),
                                           ("dp2-distopt", "tp2")])
def test_resume_at_another_layout_continues_with_the_same_losses(source, target, reference_runs, shared_data,
                                                                 shakespeare_prefix, tmp_path):
    reference = reference_runs(source)
    run = _run(LAYOUTS[target], tmp_path, "resumed", shared_data, shakespeare_prefix, load=reference["ckpt"],
               save=False)
    assert sorted(run["loss"]) == list(range(SAVE_AT + 1, ITERS + 1))
    for iteration in range(SAVE_AT + 1, ITERS + 1):
        assert run["loss"][iteration] == pytest.approx(reference["loss"][iteration], rel=1e-5), iteration
    # It learns, so the comparison means something.
    assert reference["loss"][ITERS] < reference["loss"][1] - 0.05
