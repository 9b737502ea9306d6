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

from pretrain_utils import console_objects, run_pretrain, tensorboard_scalars

pytestmark = pytest.mark.timeout(600)

SAVE_AT, ITERS = 3, 8
COMMON = ["--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100",
          "--make-vocab-size-divisible-by", "64"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
    # interleaved: 4 layers, chunk v of stage p holds layer 2v + p (local index 0 in every chunk)
    "pp2-vp2-4layers": ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1"],
    "tp2-4layers": ["--num-layers", "4", "--tensor-model-parallel-size", "2"],
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
                                           ("dp2-distopt", "tp2"), ("pp2-vp2-4layers", "tp2-4layers")])
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


def test_same_layout_resume_is_bit_exact(reference_runs, shared_data, shakespeare_prefix, tmp_path):
    reference = reference_runs("tp2")
    run = _run(LAYOUTS["tp2"], tmp_path, "resumed", shared_data, shakespeare_prefix, load=reference["ckpt"],
               save=False)
    assert {i: run["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)} == \
        {i: reference["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)}


def test_async_save_trains_the_same_and_resumes_bit_exactly(reference_runs, shared_data, shakespeare_prefix,
                                                           tmp_path):
    reference = reference_runs("dp2-distopt")
    run = _run(LAYOUTS["dp2-distopt"], tmp_path, "async", shared_data, shakespeare_prefix, extra=["--async-save"])
    assert run["loss"] == reference["loss"]  # saving in the background does not change training
    ckpt = run["ckpt"]
    # Every save was published (3, 6 and the final 8), the tracker last; no temporary directory is left.
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "iter_0000008",
                                        "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8"
    _keep_only_iteration(ckpt, SAVE_AT)
    resumed = _run(LAYOUTS["dp2-distopt"], tmp_path, "resumed", shared_data, shakespeare_prefix, load=ckpt,
                   save=False)
    # The checkpoint holds the state of iteration 3, not one the next optimizer steps changed during the copy.
    assert {i: resumed["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)} == \
        {i: reference["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)}


def test_auto_detect_loads_either_format_and_a_mismatch_is_refused(reference_runs, shared_data, shakespeare_prefix,
                                                                   tmp_path):
    # A legacy checkpoint, loaded by a run whose --ckpt-format is the default torch_dist.
    legacy = _run([], tmp_path, "legacy", shared_data, shakespeare_prefix, extra=["--ckpt-format", "torch"],
                  iters=5, nproc=1)
    assert os.path.isfile(legacy["ckpt"] / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    _keep_only_iteration(legacy["ckpt"], SAVE_AT)
    out = _run([], tmp_path, "refused", shared_data, shakespeare_prefix, load=legacy["ckpt"], save=False, iters=5,
               nproc=1, expect_failure=True)
    assert "is in the torch format but --ckpt-format is torch_dist; pass --ckpt-format torch or " \
           "--auto-detect-ckpt-format" in out
    detected = _run([], tmp_path, "detected", shared_data, shakespeare_prefix, load=legacy["ckpt"], save=False,
                    iters=5, nproc=1, extra=["--auto-detect-ckpt-format"])
    assert detected["loss"] == {i: legacy["loss"][i] for i in (4, 5)}

    # A torch_dist checkpoint, loaded by a run that asks for the legacy format.
    reference = reference_runs("tp2")
    out = _run(LAYOUTS["tp2"], tmp_path, "refused2", shared_data, shakespeare_prefix, load=reference["ckpt"],
               save=False, extra=["--ckpt-format", "torch"], expect_failure=True)
    assert "is in the torch_dist format but --ckpt-format is torch; pass --ckpt-format torch_dist or " \
           "--auto-detect-ckpt-format" in out
    detected = _run(LAYOUTS["tp2"], tmp_path, "detected2", shared_data, shakespeare_prefix, load=reference["ckpt"],
                    save=False, extra=["--ckpt-format", "torch", "--auto-detect-ckpt-format"])
    assert {i: detected["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)} == \
        {i: reference["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)}


def test_async_save_needs_torch_dist(shared_data, shakespeare_prefix, tmp_path):
    out = _run([], tmp_path, "x", shared_data, shakespeare_prefix, extra=["--ckpt-format", "torch", "--async-save"],
               nproc=1, expect_failure=True)
    assert "--async-save needs --ckpt-format torch_dist (got --ckpt-format torch)" in out


# ---------------------------------------------------------------------------------------------------
# In-process: a gated-MLP, grouped-query model whose vocabulary padding differs between TP sizes
# ---------------------------------------------------------------------------------------------------

def _llama(tp, vocab, seed):
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                               ffn_hidden_size=64, gated_linear_unit=True, activation_func=F.silu,
                               normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                               attention_dropout=0.0, tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return GPTModel(config, vocab_size=vocab, max_sequence_length=8, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def _full(param):
    """The whole tensor of a TP-split parameter (all-gathered, stride pieces put back in order)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return param.detach().clone()
    tp = ps.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, param.partition_stride
    pieces = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([pieces[rank][k] for k in range(stride) for rank in range(tp)], dim)


def _save_only(rank, world, ckpt_dir, vocab):
    """Save a TP=world model with ``vocab`` (padded) rows; returns its whole tensors."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import save
    from megatron.core.dist_checkpointing.model_and_optimizer import model_sharded_state

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = _llama(world, vocab, seed=1)
    save(model_sharded_state([model]), ckpt_dir)
    return {name: _full(p) for name, p in model.named_parameters()}


def _load_only(rank, world, ckpt_dir, load_vocab):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import load
    from megatron.core.dist_checkpointing.model_and_optimizer import model_sharded_state

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    model = _llama(world, load_vocab, seed=3)
    before = {name: _full(p) for name, p in model.named_parameters()}
    load(model_sharded_state([model]), ckpt_dir)
    return before, {name: _full(p) for name, p in model.named_parameters()}


@pytest.mark.parametrize("save_tp,save_vocab,load_tp,load_vocab", [(2, 68, 1, 66), (1, 66, 2, 68)],
                         ids=["tp2-pad68-to-tp1-pad66", "tp1-pad66-to-tp2-pad68"])
def test_gated_mlp_gqa_model_reloads_at_another_tp_size_and_vocab_padding(save_tp, save_vocab, load_tp, load_vocab,
                                                                          tmp_path):
    from dist_utils import run_distributed

    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_only, save_tp, ckpt, save_vocab)[0]
    before, loaded = run_distributed(_load_only, load_tp, ckpt, load_vocab)[0]
    rows = min(save_vocab, load_vocab)
    for name, value in loaded.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(value[:rows], saved[name][:rows]), name
            # Padding rows the checkpoint does not have keep the loading model's values.
            assert torch.equal(value[rows:], before[name][rows:]), name
        else:
            assert torch.equal(value, saved[name]), name
    assert not torch.equal(before["decoder.layers.0.mlp.linear_fc1.weight"],
                           loaded["decoder.layers.0.mlp.linear_fc1.weight"])  # the load changed something


def test_async_save_spans_show_the_blocking_background_and_finalize_parts(shared_data, shakespeare_prefix, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step")
    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "3", "--eval-iters", "0", "--async-save",
                           "--save", str(tmp_path / "ckpt"), "--save-interval", "2"], shared_data, shakespeare_prefix,
                       tmp_path)
    spans = console_objects(out)
    spans = [s for s in spans if "name" in s]
    saves = {s["context"]["span_id"]: s for s in spans if s["name"] == "megatron.save_checkpoint"}
    assert sorted(s["attributes"]["megatron.iteration"] for s in saves.values()) == [2, 3]
    for part in ("megatron.save_checkpoint.background", "megatron.save_checkpoint.finalize"):
        found = [s for s in spans if s["name"] == part]
        assert sorted(s["attributes"]["megatron.iteration"] for s in found) == [2, 3], part
        for span in found:  # children of the save that started them, with the writer's identity
            assert saves[span["parent_id"]]["attributes"]["megatron.iteration"] == span["attributes"]["megatron.iteration"]
            assert span["attributes"]["megatron.worker"] == "async_checkpoint_writer"
            assert span["attributes"]["megatron.rank"] == 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"


@pytest.mark.parametrize("layout", ["dp2-distopt", "dp2"])
def test_bf16_resume_restores_the_fp32_main_params_bit_exactly(layout, shared_data, shakespeare_prefix, tmp_path):
    """The fp32 main copies of bf16 params (distributed optimizer: flat ranges per DP rank in Megatron's
    fragment form; else parameter-shaped, with the fp16 wrapper's common state) are saved and restored:
    rebuilt from the bf16 weights instead, the resumed losses would drift from the uninterrupted run's."""
    flags = [*LAYOUTS.get(layout, []), "--bf16"]
    reference = _run(flags, tmp_path, "bf16", shared_data, shakespeare_prefix)
    _keep_only_iteration(reference["ckpt"], SAVE_AT)
    resumed = _run(flags, tmp_path, "resumed", shared_data, shakespeare_prefix, load=reference["ckpt"], save=False)
    assert {i: resumed["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)} == \
        {i: reference["loss"][i] for i in range(SAVE_AT + 1, ITERS + 1)}
