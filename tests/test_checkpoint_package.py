"""The checkpoint package's seams: one error base, the user-error rule, the storage seam, the one format detector,
the one torch.load, and the old import paths."""
import errno
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.dist_checkpointing.core import CheckpointingException

REPO = Path(__file__).resolve().parents[1]


def _checkpoint_error_classes():
    from megatron.core import optimizer_param_scheduler
    from megatron.core.dist_checkpointing import safe_loading, serialization
    from megatron.training.checkpointing import errors, legacy_optimizer_state

    return {  # each class and the base it had before it was re-parented on CheckpointingException
        safe_loading.UnsafeCheckpointError: pickle.UnpicklingError,
        safe_loading.CheckpointFileError: RuntimeError,
        safe_loading.CheckpointReadError: safe_loading.CheckpointFileError,
        serialization.CheckpointMismatchError: ValueError,
        serialization.SaveFailedOnAnotherRankError: RuntimeError,
        errors.CheckpointContentError: RuntimeError,
        errors.CheckpointWriteError: OSError,
        errors.CheckpointSaveError: errors.CheckpointWriteError,
        errors.CheckpointIntegrityError: RuntimeError,
        errors.FailedOnAnotherRankError: RuntimeError,
        errors.NotARegularFileError: OSError,
        errors.CheckpointTrackerError: ValueError,
        legacy_optimizer_state.OptimizerStateMismatch: ValueError,
        optimizer_param_scheduler.SchedulerMismatchError: ValueError,
    }


def test_every_checkpoint_error_derives_from_core_and_keeps_its_base():
    for cls, base in _checkpoint_error_classes().items():
        assert issubclass(cls, CheckpointingException), cls
        assert issubclass(cls, base), (cls, base)


def test_the_checkpoint_tools_errors_derive_from_core_and_keep_their_base(monkeypatch):
    """The converter's, exporter's and importer's own errors are checkpoint errors too (issue 29: one base)."""
    monkeypatch.syspath_prepend(str(REPO / "tools" / "checkpoint"))
    import export_hf
    import full_checkpoint
    import hf_conversion
    import import_hf
    import legacy_checkpoint

    for cls, base in {full_checkpoint.ConvertError: ValueError, hf_conversion.UnsupportedModelError: ValueError,
                      legacy_checkpoint.CheckpointLayoutError: ValueError, export_hf.ExportError: Exception,
                      import_hf.HFImportError: Exception}.items():
        assert issubclass(cls, CheckpointingException), cls
        assert issubclass(cls, base), (cls, base)


def test_a_plain_value_error_of_our_code_is_a_bug_and_keeps_its_traceback():
    """Only checkpoint errors (and file-system errors) are reported as the user's one line; a ValueError that
    our own loader code raises by mistake passes through unchanged, traceback and all."""
    from megatron.training.checkpoint_errors import checkpoint_errors_as_user_errors, is_checkpoint_user_error
    from megatron.training.checkpointing.errors import CheckpointTrackerError
    from megatron.training.user_errors import UserInputError

    assert not is_checkpoint_user_error(ValueError("bug"))
    assert is_checkpoint_user_error(CheckpointTrackerError("invalid checkpoint tracker file x"))
    assert is_checkpoint_user_error(FileNotFoundError(errno.ENOENT, "No such file", "x"))

    def buggy_loader():
        raise ValueError("internal: index out of step")

    with pytest.raises(ValueError, match="internal") as info:
        with checkpoint_errors_as_user_errors():
            buggy_loader()
    assert not isinstance(info.value, UserInputError)
    assert any(entry.name == "buggy_loader" for entry in info.traceback)
    with pytest.raises(UserInputError, match="invalid checkpoint tracker"):
        with checkpoint_errors_as_user_errors():
            raise CheckpointTrackerError("invalid checkpoint tracker file x")


def test_detect_format_is_the_one_rule(tmp_path):
    from megatron.training.checkpointing.layout import detect_format

    empty = tmp_path / "empty"
    empty.mkdir()
    assert detect_format(str(empty)) is None
    legacy = tmp_path / "legacy"
    (legacy / "mp_rank_00").mkdir(parents=True)
    assert detect_format(str(legacy)) == "torch"
    for name in ("metadata.json", ".metadata", "common.pt"):
        dist = tmp_path / name.strip(".")
        dist.mkdir()
        (dist / name).write_bytes(b"")
        assert detect_format(str(dist)) == "torch_dist", name


def test_layout_names_and_rank_order():
    from megatron.training.checkpointing import layout

    assert layout.get_checkpoint_name("d", 7, tensor_rank=1, pipeline_rank=2, pipeline_parallel=True) == \
        os.path.join("d", "iter_0000007", "mp_rank_01_002", "model_optim_rng.pt")
    assert layout.get_checkpoint_name("d", 0, release=True, tensor_rank=3, pipeline_parallel=False) == \
        os.path.join("d", "release", "mp_rank_03", "model_optim_rng.pt")
    assert layout.rng_file_name("it", 12) == os.path.join("it", "rng", "rank_00012.pt")
    assert [layout.rank_of(t, p, 2) for p in range(2) for t in range(2)] == [0, 1, 2, 3]
    assert layout.parallel_layout(2, 2) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "data_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None, "world_size": 4}


def test_parallel_layout_records_context_parallelism_only_when_used():
    """A CP=1 record keeps its pre-CP keys (and bytes); a CP run's record names its CP size, so a resume at
    another CP size says why the RNG states are not restored."""
    from megatron.training.checkpointing import layout

    plain = layout.parallel_layout(2, 1, 2)
    assert "context_parallel_size" not in plain and plain["world_size"] == 4
    with_cp = layout.parallel_layout(1, 1, 1, context_parallel_size=2)
    assert with_cp["context_parallel_size"] == 2 and with_cp["world_size"] == 2
    assert with_cp != layout.parallel_layout(1, 1, 1, world_size=2)


def test_durable_writes_go_through_the_replaceable_storage(tmp_path):
    from megatron.training.checkpointing import durable

    class FullDisk(durable.CheckpointStorage):
        def fsync(self, f):
            raise OSError(errno.ENOSPC, "No space left on device")

    previous = durable.set_storage(FullDisk())
    try:
        with pytest.raises(durable.CheckpointWriteError, match="could not write .*x.pt: No space left on device "
                                                               r"\(disk full\)"):
            durable.write_durably({"a": 1}, str(tmp_path / "x.pt"))
    finally:
        assert durable.set_storage(previous).__class__ is FullDisk
    durable.write_durably({"a": 1}, str(tmp_path / "y.pt"))
    from megatron.training.checkpointing import load_state_dict_file

    assert load_state_dict_file(str(tmp_path / "y.pt")) == {"a": 1}


def test_torch_load_is_called_in_one_module_and_no_test_hook_is_left_in_production():
    found = subprocess.run(["grep", "-rln", "torch.load(", "megatron", "tools"], cwd=REPO, capture_output=True,
                           text=True).stdout.split()
    assert found == ["megatron/core/dist_checkpointing/safe_loading.py"], found
    hooks = subprocess.run(["grep", "-rln", "MEGATRON_TEST_", "megatron"], cwd=REPO, capture_output=True,
                           text=True).stdout.split()
    assert hooks == [], hooks


def test_old_import_paths_keep_working():
    from megatron.training import async_checkpointing, checkpoint_errors, checkpoint_integrity, legacy_optimizer_state
    from megatron.training import checkpointing
    from megatron.training.checkpointing import async_save

    for name in ("save_checkpoint", "load_checkpoint", "get_checkpoint_name", "get_checkpoint_tracker_filename",
                 "read_metadata", "finalize_async_save", "load_state_dict_file", "detect_checkpoint_format"):
        assert callable(getattr(checkpointing, name)), name
    assert async_checkpointing is async_save
    assert legacy_optimizer_state.to_named_layout is not None
    assert checkpoint_errors.is_checkpoint_user_error is not None
    for name in ("choose_checkpoint", "publish_iteration", "write_manifest", "read_tracker", "exchange_paths",
                 "CheckpointIntegrityError", "MANIFEST_FILENAME", "NON_PERSISTENT_SUBDIR"):
        assert hasattr(checkpoint_integrity, name), name


def test_no_checkpoint_module_exceeds_400_lines():
    for path in sorted((REPO / "megatron" / "training" / "checkpointing").glob("*.py")):
        assert len(path.read_text().splitlines()) < 400, path.name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
