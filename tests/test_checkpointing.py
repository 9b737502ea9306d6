"""Tests of legacy 'torch' checkpoints: layout, atomic save, full round trip, weights-only load, load flags."""
import argparse
import multiprocessing
import os
import pickle
import random
import signal

import numpy as np
import pytest
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.training import checkpoint_integrity, checkpointing
from megatron.training.checkpointing import (
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from megatron.training.global_vars import get_args, set_args

from dist_utils import run_distributed


class _Scheduler:
    """Stand-in for OptimizerParamScheduler: only its state_dict round trip matters here."""

    def __init__(self, num_steps=0):
        self.num_steps = num_steps
        self.max_lr = 1e-3

    def state_dict(self):
        return {"num_steps": self.num_steps, "max_lr": self.max_lr}

    def load_state_dict(self, state):
        self.num_steps, self.max_lr = state["num_steps"], state["max_lr"]


class _Wrapper(torch.nn.Module):
    """Mimics DDP / Float16Module: the real model sits in ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def _make_args(tmp_path, **overrides):
    values = dict(
        save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"), ckpt_format="torch", no_save_optim=None,
        no_save_rng=None, no_load_optim=None, no_load_rng=None, finetune=False, ckpt_step=None,
        exit_on_missing_checkpoint=False, data_parallel_random_init=False, fp16=False, bf16=False,
        consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
        num_floating_point_operations_so_far=0, num_layers=2, hidden_size=8, num_attention_heads=2,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, save_retain_interval=None,
        params_dtype=torch.float32, exit_signal=signal.SIGTERM, activation_func=torch.nn.functional.gelu,
    )
    values.update(overrides)
    args = argparse.Namespace(**values)
    set_args(args)
    return args


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))


def _trained(seed=0, steps=2):
    """A model chunk list, an AdamW optimizer with state, and a scheduler after ``steps`` steps."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
    return [_Wrapper(model)], optimizer, _Scheduler(num_steps=steps * 16)


def _fresh(seed=100):
    model = _model(seed)
    return [model], torch.optim.AdamW(model.parameters(), lr=1e-2), _Scheduler()


def _next_random_values():
    return torch.rand(4), np.random.rand(4), random.random()


def _assert_same_params(a, b):
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


@pytest.fixture(autouse=True)
def _seeded_tracker():
    model_parallel_cuda_manual_seed(1234)
    yield
    get_cuda_rng_tracker().reset()


# ---------------------------------------------------------------------------------------------------
# Names and tracker
# ---------------------------------------------------------------------------------------------------

def test_checkpoint_names_follow_megatron_layout(tmp_path):
    root = str(tmp_path)
    assert get_checkpoint_name(root, 100) == os.path.join(root, "iter_0000100", "mp_rank_00", "model_optim_rng.pt")
    assert get_checkpoint_name(root, 5, pipeline_parallel=True, tensor_rank=3, pipeline_rank=2) == \
        os.path.join(root, "iter_0000005", "mp_rank_03_002", "model_optim_rng.pt")
    assert get_checkpoint_name(root, 5, release=True, tensor_rank=1) == \
        os.path.join(root, "release", "mp_rank_01", "model_optim_rng.pt")
    assert get_checkpoint_tracker_filename(root) == os.path.join(root, "latest_checkpointed_iteration.txt")


def test_read_metadata_values_and_errors(tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("120\n")
    assert read_metadata(str(tracker)) == (120, False)
    tracker.write_text("release")
    assert read_metadata(str(tracker)) == (0, True)
    for bad in ("garbage", "0", "-4", ""):
        tracker.write_text(bad)
        with pytest.raises(ValueError, match="invalid checkpoint tracker file .*latest_checkpointed_iteration.txt"):
            read_metadata(str(tracker))


# ---------------------------------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------------------------------

def test_round_trip_restores_model_optimizer_scheduler_rng_and_counters(tmp_path, capsys):
    args = _make_args(tmp_path, consumed_train_samples=640, consumed_valid_samples=32, skipped_train_samples=3)
    model, optimizer, scheduler = _trained()
    with get_cuda_rng_tracker().fork():
        torch.rand(3)  # advance the model-parallel state away from its seed
    tracker_states = get_cuda_rng_tracker().get_states()
    rng_before_save = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    save_checkpoint(10, model, optimizer, scheduler, num_floating_point_operations_so_far=12345)
    out = capsys.readouterr().out
    assert f"saving checkpoint at iteration      10 to {args.save} in torch format" in out
    assert f"  successfully saved checkpoint from iteration      10 to {args.save}" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000010", "latest_checkpointed_iteration.txt"]

    random.setstate(rng_before_save[0])
    np.random.set_state(rng_before_save[1])
    torch.set_rng_state(rng_before_save[2])
    expected = _next_random_values()

    # Disturb everything the load must restore.
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    model_parallel_cuda_manual_seed(999)
    args.consumed_train_samples = args.consumed_valid_samples = args.skipped_train_samples = 0
    new_model, new_optimizer, new_scheduler = _fresh()

    iteration, flops = load_checkpoint([_Wrapper(new_model[0])], new_optimizer, new_scheduler)
    assert (iteration, flops) == (10, 12345)
    assert f"  successfully loaded checkpoint from {args.load} [ t 1/1, p 1/1 ] at iteration 10" in capsys.readouterr().out
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.skipped_train_samples) == (640, 32, 3)
    assert args.num_floating_point_operations_so_far == 12345
    _assert_same_params(model[0].module, new_model[0])
    for group_old, group_new in zip(optimizer.state_dict()["state"].values(),
                                    new_optimizer.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(group_old[key], group_new[key]), key
    assert new_scheduler.state_dict() == scheduler.state_dict()
    restored = get_cuda_rng_tracker().get_states()
    assert restored.keys() == tracker_states.keys()
    assert all(torch.equal(restored[k], tracker_states[k]) for k in restored)

    got = _next_random_values()
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]


def test_saved_dict_keys_and_sanitized_args(tmp_path):
    _make_args(tmp_path, weird=object())
    model, optimizer, scheduler = _trained()
    save_checkpoint(3, model, optimizer, scheduler, 7)
    state = checkpointing.load_state_dict_file(get_checkpoint_name(str(tmp_path / "ckpt"), 3))
    assert set(state) == {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler",
                          "rng_state", "num_floating_point_operations_so_far"}
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 3
    assert list(state["model"]) == list(model[0].module.state_dict())  # unwrapped: no "module." prefix
    assert isinstance(state["args"], argparse.Namespace)
    assert state["args"].exit_signal == "SIGTERM" and state["args"].params_dtype == torch.float32
    assert not hasattr(state["args"], "weird") and not hasattr(state["args"], "activation_func")
    rng = state["rng_state"]
    assert isinstance(rng, list) and len(rng) == 1
    expected_rng_keys = {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states", "cuda_rng_state"}
    if not torch.cuda.is_available():
        # Megatron-LM's loader needs CUDA states: those of the seeds (1234), the CPU ones kept beside them.
        expected_rng_keys.add("cpu_rng_tracker_states")
        assert torch.equal(rng[0]["cuda_rng_state"],
                           torch.tensor([210, 4] + [0] * 14, dtype=torch.uint8))  # uint64 1234, int64 offset 0
        assert {name: state.tolist()[:2] for name, state in rng[0]["rng_tracker_states"].items()} == \
            {"data-parallel-rng": [210, 4], "model-parallel-rng": [112, 15], "expert-parallel-rng": [210, 8]}
        assert {state.numel() for state in rng[0]["rng_tracker_states"].values()} == {16}
        assert rng[0]["cpu_rng_tracker_states"].keys() == rng[0]["rng_tracker_states"].keys()
    assert set(rng[0]) == expected_rng_keys


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds the CPU case: tracker states of a GPU run read on a CPU")
def test_tracker_states_of_another_devices_generator_keep_the_seeded_ones(tmp_path, capsys):
    # A GPU run's file holds only CUDA-format tracker states (16 bytes); a CPU tracker given them would fail
    # at its first fork, so the load keeps the seeded states and says so. The CPU-written ones restore.
    args = _make_args(tmp_path)
    model, optimizer, scheduler = _trained()
    save_checkpoint(3, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
    name = get_checkpoint_name(args.save, 3)
    state = checkpointing.load_state_dict_file(name, "test")
    saved_cpu_states = state["rng_state"][0]["cpu_rng_tracker_states"]
    del state["rng_state"][0]["cpu_rng_tracker_states"]  # as a CUDA run writes it
    torch.save(state, name)
    os.remove(os.path.join(args.save, "iter_0000003", checkpoint_integrity.MANIFEST_FILENAME))  # edited on purpose
    model_parallel_cuda_manual_seed(999)
    seeded = get_cuda_rng_tracker().get_states()
    capsys.readouterr()
    load_checkpoint(*_fresh())
    assert "holds RNG tracker states of another device's generator" in capsys.readouterr().out
    restored = get_cuda_rng_tracker().get_states()
    assert all(torch.equal(restored[k], seeded[k]) for k in seeded)
    with get_cuda_rng_tracker().fork():
        torch.rand(2)
    assert not any(torch.equal(seeded[k], saved_cpu_states[k]) for k in seeded)


def test_no_save_optim_and_rng(tmp_path):
    args = _make_args(tmp_path, no_save_optim=True, no_save_rng=True)
    model, optimizer, scheduler = _trained()
    save_checkpoint(4, model, optimizer, scheduler, 0)
    state = checkpointing.load_state_dict_file(get_checkpoint_name(args.save, 4))
    assert "optimizer" not in state and "opt_param_scheduler" not in state and "rng_state" not in state
    with pytest.raises(RuntimeError, match="specify --no-load-optim or --finetune"):
        load_checkpoint(*_fresh())
    args.no_load_optim = True
    with pytest.raises(RuntimeError, match="specify --no-load-rng or --finetune"):
        load_checkpoint(*_fresh())
    args.no_load_rng = True
    assert load_checkpoint(*_fresh()) == (4, 0)


# ---------------------------------------------------------------------------------------------------
# Atomicity
# ---------------------------------------------------------------------------------------------------

def _partial_torch_save(real_save):
    def save(obj, f, *a, **kw):
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer, *a, **kw)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        raise OSError(28, "No space left on device")
    return save


def test_failed_save_keeps_previous_checkpoint_and_tracker(tmp_path, monkeypatch):
    args = _make_args(tmp_path)
    model, optimizer, scheduler = _trained()
    save_checkpoint(1, model, optimizer, scheduler, 11)
    monkeypatch.setattr(torch, "save", _partial_torch_save(torch.save))
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(2, model, optimizer, scheduler, 22)
    monkeypatch.undo()
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (1, 11)
    _assert_same_params(model[0].module, fresh[0][0])
    assert args.num_floating_point_operations_so_far == 11


def _save_then_die(tmp_path):
    # Runs in a child process: dies hard (no cleanup, no exception handling) mid-write.
    _make_args(tmp_path)
    torch.save = _crashing_save
    model, optimizer, scheduler = _trained(seed=5)
    save_checkpoint(2, model, optimizer, scheduler, 22)


def _crashing_save(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04 truncated")
    f.flush()
    os._exit(17)


def test_hard_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    _make_args(tmp_path)
    model, optimizer, scheduler = _trained()
    save_checkpoint(1, model, optimizer, scheduler, 11)

    # spawn, not fork: a forked child of a process that already ran torch ops can deadlock.
    child = multiprocessing.get_context("spawn").Process(target=_save_then_die, args=(tmp_path,))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 17
    ckpt = tmp_path / "ckpt"
    leftovers = [e for e in os.listdir(ckpt) if e.startswith(".iter_0000002.tmp-")]
    assert len(leftovers) == 1  # the half-written directory is hidden, never named iter_0000002
    assert not (ckpt / "iter_0000002").exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert load_checkpoint(*_fresh()) == (1, 11)

    # The next save of that iteration clears the leftover and completes.
    save_checkpoint(2, model, optimizer, scheduler, 22)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    assert load_checkpoint(*_fresh()) == (2, 22)


def test_resaving_an_iteration_replaces_it(tmp_path):
    _make_args(tmp_path)
    first, optimizer, scheduler = _trained(seed=1)
    save_checkpoint(3, first, optimizer, scheduler, 1)
    second, optimizer2, scheduler2 = _trained(seed=2)
    save_checkpoint(3, second, optimizer2, scheduler2, 2)
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (3, 2)
    _assert_same_params(second[0].module, fresh[0][0])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_save_retain_interval_prunes_older_checkpoints(tmp_path):
    _make_args(tmp_path, save_retain_interval=4)
    model, optimizer, scheduler = _trained()
    for iteration in (2, 4, 6, 8, 10):
        save_checkpoint(iteration, model, optimizer, scheduler, 0)
    kept = sorted(e for e in os.listdir(tmp_path / "ckpt") if e.startswith("iter_"))
    assert kept == ["iter_0000004", "iter_0000008", "iter_0000010"]


# ---------------------------------------------------------------------------------------------------
# Weights-only loading
# ---------------------------------------------------------------------------------------------------

class _Payload:
    """An object whose unpickling would run code (create a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_arbitrary_pickled_object_is_refused(tmp_path):
    args = _make_args(tmp_path)
    marker = tmp_path / "pwned"
    name = get_checkpoint_name(args.load, 5)
    os.makedirs(os.path.dirname(name))
    torch.save({"iteration": 5, "model": _model(0).state_dict(), "evil": _Payload(str(marker))}, name)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(pickle.UnpicklingError, match="refusing to load checkpoint .*model_optim_rng.pt"):
        load_checkpoint(*_fresh())
    assert not marker.exists()


def test_truncated_file_error_names_it(tmp_path):
    args = _make_args(tmp_path)
    name = get_checkpoint_name(args.load, 5)
    os.makedirs(os.path.dirname(name))
    with open(name, "wb") as f:
        f.write(b"PK\x03\x04 not a whole zip")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(RuntimeError, match="cannot read checkpoint file .*iter_0000005"):
        load_checkpoint(*_fresh())


def _prefix_lengths(size):
    """0 bytes, every length up to 64, a spread through the middle, half, and the last 64 (all-but-one too)."""
    lengths = set(range(0, 65)) | set(range(65, size, max(1, size // 97))) | {size // 2}
    return sorted(lengths | set(range(max(0, size - 64), size)))


def _unreadable_error(tmp_path, content, iteration=8):
    """Write ``content`` as the iteration's checkpoint file and load it; returns (file name, error text)."""
    name = get_checkpoint_name(str(tmp_path / "ckpt"), iteration)
    with open(name, "wb") as f:
        f.write(content)
    with pytest.raises(RuntimeError) as info:
        load_checkpoint(*_fresh())
    return name, str(info.value)


def test_every_truncation_of_a_real_checkpoint_names_the_file(tmp_path):
    """A real checkpoint cut at any length: the error names the file, the iteration, --load and what is wrong."""
    args, _ = _save_trained(tmp_path, manifest=False)
    name = get_checkpoint_name(args.load, 8)
    with open(name, "rb") as f:
        whole = f.read()
    lengths = _prefix_lengths(len(whole))
    assert 0 in lengths and len(whole) // 2 in lengths and len(whole) - 1 in lengths and len(lengths) > 150
    for length in lengths:
        _, message = _unreadable_error(tmp_path, whole[:length])
        assert f"checkpoint file {name}" in message, (length, message)
        assert f"iteration 8 of --load {args.load}" in message, (length, message)
        expected = "is empty (0 bytes)" if length == 0 else f"is truncated ({length} bytes"
        assert expected in message, (length, message)
    with open(name, "wb") as f:
        f.write(whole)
    assert load_checkpoint(*_fresh())[0] == 8  # the untouched file still loads


@pytest.mark.parametrize("content,reason", [
    pytest.param(bytes(range(256)) * 20, "is not a checkpoint", id="binary"),
    pytest.param(b"iteration: 8\nmodel: weights\n" * 40, "is not a checkpoint", id="text"),
    pytest.param(b"\x80\x02" + bytes(range(2, 200)), "is truncated or corrupt", id="pickle-like"),
])
def test_garbage_checkpoint_file_is_named(tmp_path, content, reason):
    args, _ = _save_trained(tmp_path, manifest=False)
    name, message = _unreadable_error(tmp_path, content)
    assert f"checkpoint file {name}" in message and f"iteration 8 of --load {args.load}" in message
    assert reason in message, message


def test_checkpoint_file_holding_no_state_dict_is_not_a_checkpoint(tmp_path):
    args, _ = _save_trained(tmp_path, manifest=False)
    name = get_checkpoint_name(args.load, 8)
    torch.save(torch.zeros(3), name)
    with pytest.raises(RuntimeError, match=r"checkpoint file .*iter_0000008.* is not a checkpoint: it holds a Tensor"):
        load_checkpoint(*_fresh())


def test_complete_zip_with_damaged_contents_is_corrupt(tmp_path):
    """The archive is whole but its pickled record is overwritten (same length): corrupt, named."""
    import zipfile

    args, _ = _save_trained(tmp_path, manifest=False)
    name = get_checkpoint_name(args.load, 8)
    with zipfile.ZipFile(name) as archive:
        record = next(info for info in archive.infolist() if info.filename.endswith("/data.pkl"))
    with open(name, "rb") as f:
        whole = bytearray(f.read())
    name_length, extra_length = (int.from_bytes(whole[record.header_offset + i:record.header_offset + i + 2], "little")
                                 for i in (26, 28))
    start = record.header_offset + 30 + name_length + extra_length
    whole[start:start + 16] = b"\xff" * 16
    with open(name, "wb") as f:
        f.write(bytes(whole))
    assert zipfile.is_zipfile(name)
    with pytest.raises(RuntimeError) as info:
        load_checkpoint(*_fresh())
    message = str(info.value)
    assert f"checkpoint file {name} (iteration 8 of --load {args.load}): it is corrupt" in message, message


# ---------------------------------------------------------------------------------------------------
# Load flags and errors
# ---------------------------------------------------------------------------------------------------

def _save_trained(tmp_path, iteration=8, manifest=True, **arg_overrides):
    """Save a trained model at ``iteration``; without ``manifest`` its integrity manifest is removed, as in a
    checkpoint written by Megatron-LM or an earlier version (then the loader itself must name damage)."""
    args = _make_args(tmp_path, consumed_train_samples=128, consumed_valid_samples=16, **arg_overrides)
    model, optimizer, scheduler = _trained()
    save_checkpoint(iteration, model, optimizer, scheduler, 999)
    if not manifest:
        os.remove(os.path.join(args.save, f"iter_{iteration:07d}", "integrity_manifest.json"))
    args.consumed_train_samples = args.consumed_valid_samples = 0
    return args, model


def test_finetune_loads_weights_only(tmp_path):
    args, model = _save_trained(tmp_path)
    args.finetune = True
    torch.manual_seed(42)
    expected = torch.rand(4)
    new_model, new_optimizer, new_scheduler = _fresh()
    torch.manual_seed(42)  # _fresh seeds its own init
    assert load_checkpoint(new_model, new_optimizer, new_scheduler) == (0, 0)
    _assert_same_params(model[0].module, new_model[0])
    assert new_optimizer.state_dict()["state"] == {} and new_scheduler.num_steps == 0
    assert (args.consumed_train_samples, args.consumed_valid_samples) == (0, 0)
    assert torch.equal(torch.rand(4), expected)  # RNG untouched


def test_no_load_optim_keeps_fresh_optimizer(tmp_path):
    args, model = _save_trained(tmp_path)
    args.no_load_optim = True
    new_model, new_optimizer, new_scheduler = _fresh()
    assert load_checkpoint(new_model, new_optimizer, new_scheduler) == (8, 999)
    assert new_optimizer.state_dict()["state"] == {} and new_scheduler.num_steps == 0
    assert args.consumed_train_samples == 128
    _assert_same_params(model[0].module, new_model[0])


def test_no_load_rng_keeps_current_rng(tmp_path):
    args, _ = _save_trained(tmp_path)
    args.no_load_rng = True
    torch.manual_seed(7)
    expected = torch.rand(4)
    new_model, new_optimizer, new_scheduler = _fresh()
    torch.manual_seed(7)  # _fresh seeds its own init
    assert load_checkpoint(new_model, new_optimizer, new_scheduler) == (8, 999)
    assert torch.equal(torch.rand(4), expected)
    assert new_optimizer.state_dict()["state"] != {}


def test_missing_tracker_starts_from_scratch(tmp_path, capsys):
    args = _make_args(tmp_path)
    assert load_checkpoint(*_fresh()) == (0, 0)
    assert "WARNING: could not find the metadata file" in capsys.readouterr().out
    args.exit_on_missing_checkpoint = True
    with pytest.raises(FileNotFoundError, match="--exit-on-missing-checkpoint"):
        load_checkpoint(*_fresh())


def test_tracker_naming_missing_directory(tmp_path):
    _make_args(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(checkpoint_integrity.CheckpointIntegrityError,
                       match="iteration 7 .*iter_0000007, named by latest_checkpointed_iteration.txt.*"
                             "iter_0000007 does not exist"):
        load_checkpoint(*_fresh())


def test_ckpt_step_selects_iteration(tmp_path):
    args = _make_args(tmp_path)
    first, optimizer, scheduler = _trained(seed=1)
    save_checkpoint(1, first, optimizer, scheduler, 100)
    second, optimizer, scheduler = _trained(seed=2)
    save_checkpoint(2, second, optimizer, scheduler, 200)
    args.ckpt_step = 1
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (1, 100)
    _assert_same_params(first[0].module, fresh[0][0])


def test_strict_and_non_strict_model_loading(tmp_path):
    _save_trained(tmp_path)
    bigger = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(bigger.parameters())
    with pytest.raises(RuntimeError, match="(?s)does not match the model.*Missing key"):
        load_checkpoint([bigger], optimizer, _Scheduler())
    get_args_ns = get_args()
    get_args_ns.no_load_optim = True
    assert load_checkpoint([bigger], optimizer, _Scheduler(), strict=False) == (8, 999)


@pytest.fixture
def _tp_override():
    yield
    parallel_state.set_tensor_model_parallel_world_size(None)
    parallel_state.set_tensor_model_parallel_rank(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)
    parallel_state.set_pipeline_model_parallel_rank(None)


def test_different_parallel_layout_is_named(tmp_path, _tp_override):
    # Saved as tensor-parallel rank 1 of 2: only mp_rank_01 exists.
    args = _make_args(tmp_path, tensor_model_parallel_size=2)
    parallel_state.set_tensor_model_parallel_world_size(2)
    parallel_state.set_tensor_model_parallel_rank(1)
    model, optimizer, scheduler = _trained()
    save_checkpoint(6, model, optimizer, scheduler, 0)
    assert sorted(os.listdir(tmp_path / "ckpt" / "iter_0000006")) == ["integrity_manifest.json", "mp_rank_01"]

    parallel_state.set_tensor_model_parallel_rank(0)
    with pytest.raises(FileNotFoundError, match=r"mp_rank_00/model_optim_rng.pt does not exist.*holds mp_rank_01"):
        load_checkpoint(*_fresh())

    # Same file name, different layout: the stored args catch it.
    parallel_state.set_tensor_model_parallel_world_size(1)
    parallel_state.set_tensor_model_parallel_rank(None)
    os.remove(tmp_path / "ckpt" / "iter_0000006" / "integrity_manifest.json")  # it would refuse the moved file
    os.rename(tmp_path / "ckpt" / "iter_0000006" / "mp_rank_01", tmp_path / "ckpt" / "iter_0000006" / "mp_rank_00")
    args.tensor_model_parallel_size = 1
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 but this run uses 1"):
        load_checkpoint(*_fresh())


def test_pipeline_layout_expects_pp_suffix(tmp_path, _tp_override):
    _save_trained(tmp_path)
    parallel_state.set_pipeline_model_parallel_world_size(2)
    parallel_state.set_pipeline_model_parallel_rank(0)
    with pytest.raises(FileNotFoundError, match=r"mp_rank_00_000/model_optim_rng.pt does not exist"):
        load_checkpoint(*_fresh())


def test_model_shape_mismatch_is_named(tmp_path):
    args, _ = _save_trained(tmp_path)
    args.hidden_size = 16
    with pytest.raises(ValueError, match=r"hidden_size value from checkpoint \(8\) is not equal to the input "
                                         r"argument value \(16\)"):
        load_checkpoint(*_fresh())


# ---------------------------------------------------------------------------------------------------
# Two ranks writing into one iteration directory (tp = 2)
# ---------------------------------------------------------------------------------------------------

def _tp2_save_and_load(rank, world_size, root):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    _make_args_dir(root, tensor_model_parallel_size=2)
    model = _model(seed=rank)  # each TP rank holds different weights
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(5, [model], optimizer, _Scheduler(3), 50)
    listing = sorted(os.listdir(os.path.join(root, "ckpt", "iter_0000005")))
    fresh = _model(seed=100 + rank)
    result = load_checkpoint([fresh], torch.optim.AdamW(fresh.parameters()), _Scheduler())
    same = all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), fresh.state_dict().values()))
    return listing, result, same


def _make_args_dir(root, **overrides):
    import pathlib

    return _make_args(pathlib.Path(root), **overrides)


def test_two_tensor_parallel_ranks_share_one_iteration_directory(tmp_path):
    results = run_distributed(_tp2_save_and_load, 2, str(tmp_path))
    for listing, result, same in results:
        assert listing == ["integrity_manifest.json", "mp_rank_00", "mp_rank_01"]
        assert result == (5, 50)
        assert same
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not [e for e in os.listdir(tmp_path / "ckpt") if e.startswith(".")]
