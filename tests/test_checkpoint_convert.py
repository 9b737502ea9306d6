"""tools/checkpoint/convert.py: a checkpoint converted to another TP/PP layout loads and trains on as
the original does (the losses after loading equal the original run's within 1e-5 relative); a
relayout there and back gives back every tensor bit for bit; bad input is refused naming the flag
or folder; a failed write leaves nothing behind."""
import os
from pathlib import Path

import pytest
import torch

from pretrain_utils import load_checkpoint_tool, losses_from_log, run_pretrain

from megatron.training.checkpointing import durable, layout

REPO = Path(__file__).resolve().parents[1]


_load_tool = load_checkpoint_tool


convert = _load_tool("convert")

# 4 layers so that PP=2 x VP=2 has a layer per block; no dropout, so that the RNG (not carried over
# to another layout) plays no part; --make-vocab-size-divisible-by 64 pads GPT-2's vocabulary to
# 50304 rows at both TP=1 and TP=2 (the padded rows take part in the softmax).
FLAGS = ["--num-layers", "4", "--micro-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
         "--lr-decay-iters", "10", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--make-vocab-size-divisible-by", "64", "--ckpt-format", "torch"]  # convert.py's default target: legacy


@pytest.fixture(scope="module")
def original(shared_data, shakespeare_prefix, tmp_path_factory):
    """A TP=2 run of 4 iterations saving at 2 and 4: (checkpoint dir, {iteration: loss string})."""
    root = tmp_path_factory.mktemp("convert")
    save = root / "tp2"
    out = run_pretrain(2, [*FLAGS, "--tensor-model-parallel-size", "2", "--save-interval", "2", "--save", str(save)],
                       shared_data, shakespeare_prefix, root / "run")
    return save, losses_from_log(out)


def _assert_losses_match(expected, out):
    losses = losses_from_log(out)
    assert "successfully loaded checkpoint" in out and "at iteration 2" in out
    assert sorted(losses) == [3, 4], losses
    for iteration in (3, 4):
        assert float(losses[iteration]) == pytest.approx(float(expected[iteration]), rel=1e-5), (iteration, losses)


@pytest.mark.timeout(300)
def test_tp2_to_tp1_to_pp2_trains_on_like_the_original(original, shared_data, shakespeare_prefix, tmp_path, capsys):
    checkpoint, expected = original
    tp1, pp2 = tmp_path / "tp1", tmp_path / "pp2"
    assert convert.main(["--load-dir", str(checkpoint), "--ckpt-step", "2", "--save-dir", str(tp1),
                         "--target-tensor-parallel-size", "1"]) == 0
    printed = capsys.readouterr().out
    assert "optimizer state: converted" in printed and "--no-load-rng" in printed
    assert convert.main(["--load-dir", str(tp1), "--save-dir", str(pp2), "--target-pipeline-parallel-size", "2"]) == 0
    assert sorted(os.listdir(pp2 / "iter_0000002")) == ["integrity_manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert (pp2 / "latest_checkpointed_iteration.txt").read_text() == "2"
    # Iteration 3's loss checks the weights, iteration 4's also the converted Adam moments and scheduler.
    _assert_losses_match(expected, run_pretrain(1, [*FLAGS, "--load", str(tp1), "--no-load-rng"], shared_data,
                                                shakespeare_prefix, tmp_path / "run_tp1"))
    _assert_losses_match(expected, run_pretrain(2, [*FLAGS, "--pipeline-model-parallel-size", "2", "--load", str(pp2),
                                                    "--no-load-rng"], shared_data, shakespeare_prefix,
                                                tmp_path / "run_pp2"))


@pytest.mark.timeout(300)
def test_bf16_tp2_to_pp2_converts_the_fp32_main_params(shared_data, shakespeare_prefix, tmp_path):
    """The mixed-precision optimizer's fp32 main params and moments follow their params to the new layout
    (iteration 4's loss depends on them; bf16 TP=2 and TP=1 differ by rounding, 2e-6 here)."""
    bf16 = [*FLAGS, "--bf16"]
    out = run_pretrain(2, [*bf16, "--tensor-model-parallel-size", "2", "--save-interval", "2", "--save",
                           str(tmp_path / "tp2")], shared_data, shakespeare_prefix, tmp_path / "run")
    assert convert.main(["--load-dir", str(tmp_path / "tp2"), "--ckpt-step", "2", "--save-dir", str(tmp_path / "pp2"),
                         "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"]) == 0
    stage = _rank_dicts(tmp_path / "pp2")["mp_rank_00_001"]["optimizer"]
    groups = stage["optimizer"]["param_groups"]
    assert [len(g) for g in stage["fp32_from_fp16_params"]] == [len(g["params"]) for g in groups]
    assert all(t.dtype == torch.float32 for g in stage["fp32_from_fp16_params"] for t in g)
    _assert_losses_match(losses_from_log(out), run_pretrain(2, [*bf16, "--pipeline-model-parallel-size", "2", "--load",
                                                                str(tmp_path / "pp2"), "--no-load-rng"], shared_data,
                                                            shakespeare_prefix, tmp_path / "run_pp2"))


@pytest.mark.timeout(300)
def test_distributed_optimizer_dp2_to_pp2(shared_data, shakespeare_prefix, tmp_path):
    """The distributed optimizer's distrib_optim.pt (DP=2) is read per parameter by its param_index_map
    and becomes the non-distributed optimizer's state at PP=2: the losses after loading match."""
    out = run_pretrain(2, [*FLAGS, "--use-distributed-optimizer", "--save-interval", "2", "--save",
                           str(tmp_path / "dp2")], shared_data, shakespeare_prefix, tmp_path / "run")
    assert (tmp_path / "dp2" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    assert convert.main(["--load-dir", str(tmp_path / "dp2"), "--ckpt-step", "2", "--save-dir", str(tmp_path / "pp2"),
                         "--target-pipeline-parallel-size", "2"]) == 0
    _assert_losses_match(losses_from_log(out), run_pretrain(2, [*FLAGS, "--pipeline-model-parallel-size", "2", "--load",
                                                                str(tmp_path / "pp2"), "--no-load-rng"], shared_data,
                                                            shakespeare_prefix, tmp_path / "run_pp2"))


def _rank_dicts(folder):
    from megatron.training.checkpointing import load_state_dict_file

    iteration_dir = convert.find_iteration_dir(str(folder))
    return {name: load_state_dict_file(os.path.join(iteration_dir, name, "model_optim_rng.pt"))
            for name in sorted(os.listdir(iteration_dir)) if name.startswith("mp_rank_")}


def _assert_same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b))[:5])
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):  # numpy RNG state
        assert (a == b).all(), where
    else:
        assert a == b, (where, a, b)


@pytest.mark.timeout(120)
def test_relayout_there_and_back_is_bit_exact(original, tmp_path):
    """TP=2 -> TP=1 x PP=2 x 2 virtual stages (interleaved) -> TP=2: model, optimizer (moments, groups),
    scheduler, counters equal the source's exactly; the RNG states come back only at the same layout."""
    checkpoint, _ = original
    middle, back = tmp_path / "vp", tmp_path / "back"
    assert convert.main(["--load-dir", str(checkpoint), "--ckpt-step", "2", "--save-dir", str(middle),
                         "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2",
                         "--target-num-virtual-stages-per-pipeline-rank", "2"]) == 0
    stage0 = _rank_dicts(middle)["mp_rank_00_000"]
    assert {"model0", "model1"} <= set(stage0) and "rng_state" not in stage0
    assert sorted({k.split(".")[2] for k in stage0["model1"] if k.startswith("decoder.layers.")}) == ["0"]
    assert convert.main(["--load-dir", str(middle), "--save-dir", str(back), "--target-tensor-parallel-size", "2",
                         "--target-pipeline-parallel-size", "1"]) == 0
    source = {name: convert.load_state_dict_file(str(checkpoint / "iter_0000002" / name / "model_optim_rng.pt"))
              for name in ("mp_rank_00", "mp_rank_01")}
    result = _rank_dicts(back)
    assert sorted(result) == sorted(source) == ["mp_rank_00", "mp_rank_01"]
    for name in source:
        for key in ("model", "optimizer", "opt_param_scheduler", "iteration", "num_floating_point_operations_so_far"):
            _assert_same(source[name][key], result[name][key], f"{name}/{key}")
        assert "rng_state" not in result[name]
        assert vars(result[name]["args"])["consumed_train_samples"] == 16


def test_same_layout_keeps_rng_state(original, tmp_path):
    checkpoint, _ = original
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(tmp_path / "same")]) == 0
    source = convert.load_state_dict_file(str(checkpoint / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt"))
    result = _rank_dicts(tmp_path / "same")["mp_rank_01"]
    _assert_same(source["rng_state"], result["rng_state"], "rng_state")


@pytest.mark.parametrize("argv, message", [
    (["--load-dir", "{missing}"], "--load-dir {missing}: no such directory"),
    (["--target-ckpt-format", "zarr"], "--target-ckpt-format 'zarr': choose one of torch, torch_dist"),
    (["--target-tensor-parallel-size", "3"],
     "--target-tensor-parallel-size 3: the checkpoint's --num-attention-heads 4 is not divisible by 3"),
    (["--target-pipeline-parallel-size", "3"], "--target-pipeline-parallel-size 3"),
    (["--load-dir", "{empty}"], "--load-dir {empty}: no latest_checkpointed_iteration.txt"),
    (["--ckpt-step", "3"], "iter_0000003 does not exist"),
])
def test_bad_input_is_refused_naming_the_flag(original, tmp_path, capsys, argv, message):
    checkpoint, _ = original
    (tmp_path / "empty").mkdir()
    names = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty")}
    argv = [arg.format(**names) for arg in argv]
    full = ["--load-dir", str(checkpoint), "--save-dir", str(tmp_path / "out"), *argv]
    assert convert.main(full) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(**names) in err, err
    assert not (tmp_path / "out").exists()


def test_failed_write_leaves_no_partial_output(original, tmp_path, monkeypatch, capsys):
    """A full disk while writing: one error line (no traceback) and nothing left in --save-dir."""
    checkpoint, _ = original
    real_write = durable.write_durably
    calls = []

    def failing_write(state_dict, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_write(state_dict, path)

    monkeypatch.setattr(durable, "write_durably", failing_write)
    save = tmp_path / "out"
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(save), "--target-tensor-parallel-size",
                         "1", "--target-pipeline-parallel-size", "2"]) == 1
    assert capsys.readouterr().err.strip() == "error: [Errno 28] No space left on device"
    assert len(calls) == 2 and os.listdir(save) == []


@pytest.mark.timeout(120)
def test_export_hf_reads_any_layout_through_the_converter(original, tmp_path):
    """export_hf.py reads checkpoints with convert.py's reader: the interleaved PP=2 x VP=2 copy and the
    torch_dist copy of the TP=2 checkpoint export to the same Hugging Face tensors."""
    pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    export_hf = _load_tool("export_hf")
    checkpoint, _ = original
    interleaved = tmp_path / "vp"
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(interleaved), "--target-tensor-parallel-size",
                         "1", "--target-pipeline-parallel-size", "2",
                         "--target-num-virtual-stages-per-pipeline-rank", "2"]) == 0
    folders = [("tp2", checkpoint), ("vp", interleaved)]
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(tmp_path / "dist"),
                         "--target-ckpt-format", "torch_dist"]) == 0
    folders.append(("dist", tmp_path / "dist"))
    exported = {}
    for name, folder in folders:
        assert export_hf.main(["--load", str(folder), "--save", str(tmp_path / f"hf_{name}"), "--vocab-size",
                               "50257", "--no-tokenizer"]) == 0
        exported[name] = safetensors.load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
    for name in exported:
        _assert_same(exported["tp2"], exported[name], f"hf from {name}")
    assert exported["vp"]["transformer.wte.weight"].shape == (50257, 32)


@pytest.mark.timeout(120)
def test_legacy_to_torch_dist_and_back_is_bit_exact(original, tmp_path):
    """torch (TP=2) -> torch_dist -> torch (TP=2): model, Adam moments and step, param groups, scheduler,
    counters and (same layout, one data-parallel rank) RNG states come back bit for bit; the torch_dist
    copy holds global tensors under layout-free keys."""
    checkpoint, _ = original
    dist_dir, back = tmp_path / "dist", tmp_path / "back"
    assert convert.main(["--load-dir", str(checkpoint), "--ckpt-step", "2", "--save-dir", str(dist_dir),
                         "--target-ckpt-format", "torch_dist"]) == 0
    assert layout.detect_format(convert.find_iteration_dir(str(dist_dir))) == "torch_dist"
    full = convert.read_checkpoint(str(dist_dir))
    assert full.model["decoder.layers.3.mlp.linear_fc1.weight"].shape == (128, 32)
    assert full.optimizer.param_state["decoder.layers.3.mlp.linear_fc1.weight"]["exp_avg"].shape == (128, 32)
    assert sorted(os.listdir(dist_dir / "iter_0000002" / "rng")) == ["rank_00000.pt", "rank_00001.pt"]
    assert convert.main(["--load-dir", str(dist_dir), "--save-dir", str(back)]) == 0
    result = _rank_dicts(back)
    assert sorted(result) == ["mp_rank_00", "mp_rank_01"]
    for name in result:
        source = convert.load_state_dict_file(str(checkpoint / "iter_0000002" / name / "model_optim_rng.pt"))
        for key in ("model", "optimizer", "opt_param_scheduler", "rng_state", "iteration",
                    "num_floating_point_operations_so_far"):
            _assert_same(source[key], result[name][key], f"{name}/{key}")
        assert vars(result[name]["args"])["consumed_train_samples"] == 16


def test_damaged_source_file_is_refused_by_name(original, tmp_path, capsys):
    """A byte flipped in a rank file fails the integrity manifest check, naming the file."""
    import shutil

    checkpoint, _ = original
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    damaged = copy / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    assert convert.main(["--load-dir", str(copy), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"--load-dir {copy}" in err and f"{damaged} is corrupt" in err, err
    assert not (tmp_path / "out").exists()


def test_content_breaking_the_layout_rules_is_one_error_line(original, tmp_path, capsys):
    """A torch_dist checkpoint whose saved args do not split its layers (a ValueError deep in the reader) is
    refused with one ``error:`` line and exit status 1, not a traceback."""
    checkpoint, _ = original
    dist_dir = tmp_path / "dist"
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(dist_dir),
                         "--target-ckpt-format", "torch_dist"]) == 0
    common_name = layout.common_file_name(str(dist_dir / "iter_0000004"))
    common = convert.load_state_dict_file(common_name)
    common["args"].decoder_first_pipeline_num_layers = 99  # with pipeline size 1: no split exists
    torch.save(common, common_name)
    capsys.readouterr()
    assert convert.main(["--load-dir", str(dist_dir), "--save-dir", str(tmp_path / "out"),
                         "--no-verify-checkpoint"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "pipeline_model_parallel_size > 1" in err, err
    assert not (tmp_path / "out").exists()


def test_rank_dirnames_parse_back():
    """layout.parse_rank_dirname inverts layout.rank_dirname (the converter reads rank folders with it)."""
    for t, p, pipeline in ((0, 0, False), (3, 0, False), (1, 0, True), (2, 17, True)):
        assert layout.parse_rank_dirname(layout.rank_dirname(t, p, pipeline_parallel=pipeline)) == (t, p)
    for other in ("mp_rank_1", "mp_rank_01_02", "mp_rank_01_002_x", "common.pt", "rng"):
        assert layout.parse_rank_dirname(other) is None


def _saved_moment(optimizer, name, key="exp_avg"):
    """``key`` of param ``name`` in a legacy file's optimizer (Megatron's positional layout, torch's param_names)."""
    for group in optimizer["param_groups"]:
        if name in group["param_names"]:
            return optimizer["state"][group["params"][group["param_names"].index(name)]][key]
    raise KeyError(name)


def test_tp4_pads_the_vocabulary_as_megatron(original, tmp_path):
    """TP=4 pads GPT-2's 50257 tokens to a multiple of 64 x 4 = 50432 rows (50304 at TP=2): the new rows
    repeat the last one (Megatron's converter), their Adam moments are zeros, the saved args say 50432."""
    checkpoint, _ = original
    assert convert.main(["--load-dir", str(checkpoint), "--save-dir", str(tmp_path / "tp4"),
                         "--target-tensor-parallel-size", "4", "--true-vocab-size", "50257"]) == 0
    shards = _rank_dicts(tmp_path / "tp4")
    assert sorted(shards) == [f"mp_rank_{t:02d}" for t in range(4)]
    embedding = torch.cat([shards[f"mp_rank_{t:02d}"]["model"]["embedding.word_embeddings.weight"] for t in range(4)])
    moment = torch.cat([_saved_moment(shards[f"mp_rank_{t:02d}"]["optimizer"], "embedding.word_embeddings.weight")
                        for t in range(4)])
    source = [convert.load_state_dict_file(str(checkpoint / "iter_0000004" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"))
              for t in range(2)]
    original_rows = torch.cat([s["model"]["embedding.word_embeddings.weight"] for s in source])
    assert embedding.shape == (50432, 32) and original_rows.shape == (50304, 32)
    assert torch.equal(embedding[:50304], original_rows)
    assert torch.equal(embedding[50304:], original_rows[-1:].expand(128, 32))
    assert torch.count_nonzero(moment[50304:]) == 0
    assert shards["mp_rank_03"]["args"].padded_vocab_size == 50432


@pytest.mark.timeout(300)
def test_legacy_tp2_to_torch_dist_trains_on_at_pp2(original, shared_data, shakespeare_prefix, tmp_path):
    """A torch (TP=2) checkpoint converted to torch_dist loads at TP=1 x PP=2 (resharded by the training's
    own torch_dist loader, which keeps its seeded RNG at another layout) and trains on like the original."""
    checkpoint, expected = original
    dist_dir = tmp_path / "dist"
    assert convert.main(["--load-dir", str(checkpoint), "--ckpt-step", "2", "--save-dir", str(dist_dir),
                         "--target-ckpt-format", "torch_dist"]) == 0
    flags = FLAGS[:FLAGS.index("--ckpt-format")] + ["--ckpt-format", "torch_dist"]
    _assert_losses_match(expected, run_pretrain(2, [*flags, "--pipeline-model-parallel-size", "2", "--load",
                                                    str(dist_dir)], shared_data, shakespeare_prefix,
                                                tmp_path / "run_pp2"))


@pytest.mark.timeout(300)
def test_torch_dist_dp2_distributed_optimizer_to_legacy_pp2(shared_data, shakespeare_prefix, tmp_path):
    """A torch_dist checkpoint written by training (DP=2, distributed optimizer: flat ranges of each
    parameter under global keys) converts to the legacy format at PP=2, which trains on like the original."""
    flags = FLAGS[:FLAGS.index("--ckpt-format")]
    out = run_pretrain(2, [*flags, "--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--save-interval", "2",
                           "--save", str(tmp_path / "dist")], shared_data, shakespeare_prefix, tmp_path / "run")
    assert layout.detect_format(convert.find_iteration_dir(str(tmp_path / "dist"), 2)) == "torch_dist"
    assert convert.main(["--load-dir", str(tmp_path / "dist"), "--ckpt-step", "2", "--save-dir", str(tmp_path / "pp2"),
                         "--target-pipeline-parallel-size", "2"]) == 0
    _assert_losses_match(losses_from_log(out), run_pretrain(2, [*FLAGS, "--pipeline-model-parallel-size", "2", "--load",
                                                                str(tmp_path / "pp2"), "--no-load-rng"], shared_data,
                                                            shakespeare_prefix, tmp_path / "run_pp2"))
