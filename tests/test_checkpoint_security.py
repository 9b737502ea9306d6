"""A crafted checkpoint cannot run code on load, and checkpoint errors are one line (issue 21 items 1 and 5).

One small torch_dist checkpoint is saved by pretrain_gpt.py (and converted to the legacy torch format);
copies get a payload that creates a marker file: in ``.metadata`` (a bare payload, and one that goes on
to return the real metadata, which plain ``pickle`` runs and accepts), in a ``.distcp`` tensor item, in
``common.pt``, in an RNG file and in ``model_optim_rng.pt``. pretrain_gpt.py --load, tools/checkpoint/
convert.py, tools/checkpoint/export_hf.py and tools/run_text_generation.py, run as processes, must
never create the marker, exit non-zero and print one ``error:`` line naming the file, no traceback,
with the integrity check on (the attacker ships a matching manifest) and off.
"""
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dist_utils import fork_ranks, free_port, rank_env, use_torchrun
from pretrain_utils import REPO, load_checkpoint_tool, run_python, run_ranks

pytestmark = pytest.mark.timeout(900)

ITERATION = 2
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--use-cpu-initialization", "--distributed-backend", "gloo"]
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--eval-iters", "0",
         "--seed", "1234", "--log-interval", "1"]


class _Payload:
    """Pickles as a call of ``os.system`` that creates ``marker`` (what an attacker ships)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _PayloadThenMetadata:
    """Pickles as an ``eval`` that creates ``marker`` and then returns the real metadata unpickled from
    ``data``: a load that runs it goes on as if nothing happened."""

    def __init__(self, marker, data):
        self.marker, self.data = str(marker), data

    def __reduce__(self):
        return eval, (f"__import__('pathlib').Path({self.marker!r}).touch() or "
                      f"__import__('pickle').loads({self.data!r})",)


def _iteration_dir(ckpt):
    return Path(ckpt) / f"iter_{ITERATION:07d}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{'torch_dist': dir, 'torch': dir}: 2 iterations of a tiny GPT saved by pretrain_gpt.py, and the same
    converted to the legacy format by tools/checkpoint/convert.py."""
    root = tmp_path_factory.mktemp("security")
    dist_dir = root / "torch_dist"
    result = run_ranks(1, ["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION), "--save", dist_dir,
                           "--save-interval", str(ITERATION), "--ckpt-format", "torch_dist"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    legacy_dir = root / "torch"
    convert = load_checkpoint_tool("convert")
    assert convert.main(["--load-dir", str(dist_dir), "--save-dir", str(legacy_dir),
                         "--target-ckpt-format", "torch"]) == 0
    return {"torch_dist": dist_dir, "torch": legacy_dir}


def _copy(checkpoints, fmt, tmp_path):
    target = tmp_path / f"ckpt_{fmt}"
    shutil.copytree(checkpoints[fmt], target)
    return target


def _torch_save_with_payload(path, marker):
    """Rewrite the torch-saved dict ``path`` with a payload entry beside its contents."""
    from megatron.training.checkpointing import load_state_dict_file

    state = load_state_dict_file(str(path))
    state["payload"] = _Payload(marker)
    torch.save(state, path)


def _plant(kind, ckpt, marker):
    """Put the ``kind`` payload into the checkpoint folder ``ckpt``; returns the file it is in."""
    from megatron.core.dist_checkpointing.serialization import read_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    iteration_dir = _iteration_dir(ckpt)
    if kind == "metadata":
        target = iteration_dir / ".metadata"
        target.write_bytes(pickle.dumps(_Payload(marker)))
    elif kind == "metadata_then_real":
        target = iteration_dir / ".metadata"
        target.write_bytes(pickle.dumps(_PayloadThenMetadata(marker, target.read_bytes())))
    elif kind == "distcp":  # one tensor item of the data file replaced (the .metadata stays benign)
        metadata = read_metadata(str(iteration_dir))
        # A small tensor (32 elements): an item smaller than its chunk's bytes is refused before any read.
        index = next(index for index in metadata.storage_data if index.fqn == "decoder.final_layernorm.bias"
                     and isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata))
        info = metadata.storage_data[index]
        target = iteration_dir / info.relative_path
        buffer = io.BytesIO()
        torch.save(_Payload(marker), buffer)
        offset = target.stat().st_size
        with open(target, "ab") as stream:
            stream.write(buffer.getvalue())
        info.offset, info.length = offset, len(buffer.getvalue())
        (iteration_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    elif kind == "common":
        target = iteration_dir / "common.pt"
        _torch_save_with_payload(target, marker)
    elif kind == "rng":
        target = iteration_dir / "rng" / "rank_00000.pt"
        _torch_save_with_payload(target, marker)
    elif kind == "model_optim_rng":
        target = iteration_dir / "mp_rank_00" / "model_optim_rng.pt"
        _torch_save_with_payload(target, marker)
    else:
        raise AssertionError(kind)
    return target


def _ship_matching_manifest(ckpt):
    """What an attacker does against the integrity check: write a manifest that matches the files."""
    from megatron.training import checkpoint_integrity

    checkpoint_integrity.write_manifest(str(_iteration_dir(ckpt)), ITERATION)


def _run_tool(argv):
    """``python argv`` (forked from the fork server): ``(exit status, stdout + stderr)``."""
    try:
        result = run_python(argv, timeout=300)
        return result.returncode, result.stdout + result.stderr
    except subprocess.CalledProcessError as error:
        return error.returncode, (error.output or "") + (error.stderr or "")


def _run_ranks_without_launcher(nproc, argv):
    """``python argv`` as ``nproc`` ranks with torchrun's environment but no torchrun (whose own failure report
    is a traceback of the launcher), each run to its end: ``(non-zero if any rank failed, all outputs)``."""
    port = free_port()
    envs = [rank_env(dict(os.environ, OMP_NUM_THREADS="1"), rank, nproc, port) for rank in range(nproc)]
    logs = [Path(tempfile.mkdtemp(prefix="rank_")) / "log" for _ in range(nproc)]
    if use_torchrun():  # fresh interpreters instead of the fork server
        procs = []
        for rank in range(nproc):
            with open(logs[rank], "w") as log:
                procs.append(subprocess.Popen([sys.executable, *map(str, argv)], cwd=REPO, env=envs[rank],
                                              stdout=log, stderr=subprocess.STDOUT))
        statuses = [proc.wait(timeout=300) for proc in procs]
    else:
        statuses = fork_ranks(nproc, argv, envs, REPO, logs, logs, 300, stop_others_on_failure=False)
    out = "".join(log.read_text(errors="replace") for log in logs)
    for log in logs:
        shutil.rmtree(log.parent, ignore_errors=True)
    return max(abs(status) for status in statuses), out


def _run_rank(argv):
    return _run_ranks_without_launcher(1, argv)


def _loader_command(loader, ckpt, fmt, tmp_path, verify):
    no_verify = [] if verify else ["--no-verify-checkpoint"]
    if loader == "pretrain_gpt":
        return _run_rank, ["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION + 1), "--load", ckpt,
                           "--ckpt-format", fmt, "--override-opt-param-scheduler", *no_verify]
    if loader == "convert":
        return _run_tool, ["tools/checkpoint/convert.py", "--load-dir", ckpt, "--save-dir", tmp_path / "converted",
                           *no_verify]
    if loader == "export_hf":
        return _run_tool, ["tools/checkpoint/export_hf.py", "--load", ckpt, "--save", tmp_path / "hf",
                           "--vocab-size", "100", "--no-tokenizer", *no_verify]
    if loader == "run_text_generation":
        return _run_rank, ["tools/run_text_generation.py", *MODEL, "--load", ckpt, "--use-checkpoint-args",
                           "--prompt", "1 2 3", "--max-new-tokens", "2", "--greedy", *no_verify]
    raise AssertionError(loader)


def _assert_one_error_line(status, out, *names):
    assert status != 0, out[-3000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("error: ") or line.startswith("[rank 0] error: ")]
    assert len(lines) == 1, out[-3000:]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


# (loader, payload kind, checkpoint format, verify): every file each loader reads, each loader and both
# --no-verify-checkpoint settings on the metadata payloads.
CASES = [
    *[(loader, kind, "torch_dist", verify)
      for loader in ("pretrain_gpt", "convert", "export_hf", "run_text_generation")
      for kind, verify in (("metadata", False), ("metadata_then_real", True))],
    ("pretrain_gpt", "metadata", "torch_dist", True),
    ("pretrain_gpt", "distcp", "torch_dist", False),
    ("pretrain_gpt", "common", "torch_dist", True),
    ("pretrain_gpt", "rng", "torch_dist", False),
    ("pretrain_gpt", "model_optim_rng", "torch", False),
    ("convert", "distcp", "torch_dist", True),
    ("convert", "common", "torch_dist", False),
    ("convert", "rng", "torch_dist", False),
    ("convert", "model_optim_rng", "torch", True),
    ("export_hf", "distcp", "torch_dist", False),
    ("export_hf", "common", "torch_dist", False),
    ("export_hf", "model_optim_rng", "torch", False),
    ("run_text_generation", "distcp", "torch_dist", False),
    ("run_text_generation", "common", "torch_dist", False),
    ("run_text_generation", "model_optim_rng", "torch", True),
]


@pytest.mark.parametrize("loader,kind,fmt,verify", CASES, ids=lambda v: str(v))
def test_payload_is_refused_by_every_loader(checkpoints, tmp_path, loader, kind, fmt, verify):
    ckpt = _copy(checkpoints, fmt, tmp_path)
    marker = tmp_path / "PAYLOAD_RAN"
    target = _plant(kind, ckpt, marker)
    if verify:
        _ship_matching_manifest(ckpt)
    else:  # or ships none: --no-verify-checkpoint would still compare the sizes of a stale one
        (_iteration_dir(ckpt) / "integrity_manifest.json").unlink()
    run, argv = _loader_command(loader, ckpt, fmt, tmp_path, verify)
    status, out = run(argv)
    assert not marker.exists(), f"the payload in {target} ran: {out[-3000:]}"
    line = _assert_one_error_line(status, out, target)
    assert "refusing to load" in line, line
    assert "system" in line or "eval" in line, line  # the refused global is named


def test_the_payloads_run_under_plain_pickle_and_torch(tmp_path):
    """The reference: torch's own FileSystemReader runs the ``.metadata`` payload and, for the second kind,
    returns the real metadata (a load would go on with rc 0); the project's reader refuses both."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    from megatron.core.dist_checkpointing.safe_loading import SafeFileSystemReader, UnsafeCheckpointError

    ckpt = tmp_path / "ckpt"
    (ckpt / f"iter_{ITERATION:07d}").mkdir(parents=True)
    state = {"weight": torch.arange(6.0).view(2, 3)}
    torch.distributed.checkpoint.save(state, storage_writer=torch.distributed.checkpoint.FileSystemWriter(
        str(_iteration_dir(ckpt))), no_dist=True)
    marker = tmp_path / "PAYLOAD_RAN"
    _plant("metadata_then_real", ckpt, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load checkpoint metadata .*\.metadata: .*"
                                                     r"\(builtins\.eval\)"):
        SafeFileSystemReader(str(_iteration_dir(ckpt))).read_metadata()
    assert not marker.exists()
    metadata = FileSystemReader(str(_iteration_dir(ckpt))).read_metadata()
    assert marker.exists() and isinstance(metadata, Metadata) and "weight" in metadata.state_dict_metadata


def test_megatron_core_metadata_classes_are_admitted(tmp_path):
    """What Megatron-LM core_v0.14 writes into ``.metadata`` beyond torch's own classes (its ranks' save
    plans: MCoreSavePlan of WriteItems) is admitted and read back with the values written."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from megatron.core.dist_checkpointing import safe_loading

    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    properties = TensorProperties(dtype=torch.bfloat16)
    item = WriteItem(index=MetadataIndex("w", torch.Size([0, 0])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=torch.Size([2, 3])))
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(properties, torch.Size([2, 3]), [chunk])})
    metadata.all_local_plans = [safe_loading.MCoreSavePlan(items=[item], mcore_data={"w": {"shape": (2, 3)}})]
    data = pickle.dumps(metadata, protocol=2)  # globals as text lines, so the module path can be swapped
    # As Megatron-LM writes it: the plan class under its module path there.
    data = data.replace(b"megatron.core.dist_checkpointing.safe_loading",
                        b"megatron.core.dist_checkpointing.strategies.torch")
    assert b"strategies.torch" in data
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    loaded = safe_loading.read_dcp_metadata(str(path))
    assert loaded.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    plan = loaded.all_local_plans[0]
    assert plan.items[0].tensor_data.chunk.sizes == torch.Size([2, 3]) and plan.mcore_data == {"w": {"shape": (2, 3)}}


def test_bytes_items_are_loaded_weights_only(tmp_path):
    """A pickled-object item (DCP BytesStorage, as Megatron-LM's ShardedObjects) reaches the planner's
    load_bytes: plain data loads, a payload is refused naming the .distcp file, and nothing runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

    from megatron.core.dist_checkpointing.safe_loading import UnsafeCheckpointError
    from megatron.core.dist_checkpointing.serialization import ShardedLoadPlanner, load_with_planner

    class ObjectsPlanner(ShardedLoadPlanner):
        def create_local_plan(self):
            items = [ReadItem(type=md_type, storage_index=index, dest_index=index, storage_offsets=torch.Size([0]),
                              dest_offsets=torch.Size([0]), lengths=torch.Size([0]))
                     for index, md_type in self._wanted(self.metadata)]
            return LoadPlan(items)

        @staticmethod
        def _wanted(metadata):
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata
            from torch.distributed.checkpoint.planner import LoadItemType

            return [(index, LoadItemType.BYTE_IO) for index in metadata.storage_data
                    if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)]

    marker = tmp_path / "PAYLOAD_RAN"
    for name, value in (("plain", {"step": 3, "names": ["a", "b"]}), ("payload", {"x": _Payload(marker)})):
        path = tmp_path / name
        dcp.save({"obj": value, "t": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
        planner = ObjectsPlanner({}, [])
        if name == "plain":
            load_with_planner(str(path), planner, no_dist=True)
            assert planner.objects == {f"obj.{key}": item for key, item in value.items()}  # DCP flattens dicts
        else:
            with pytest.raises(UnsafeCheckpointError, match=r"refusing to load checkpoint file .*__0_0\.distcp: "
                                                             r".*\(posix\.system\)"):
                load_with_planner(str(path), planner, no_dist=True)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------------------
# Every other checkpoint error: one line naming the file or flag (issue 21 item 5)
# ----------------------------------------------------------------------------------------------------------

def _damage(kind, ckpt):
    """Break the checkpoint folder ``ckpt`` as ``kind`` says; returns what the error line must name."""
    iteration_dir = _iteration_dir(ckpt)
    tracker = Path(ckpt) / "latest_checkpointed_iteration.txt"
    manifest = iteration_dir / "integrity_manifest.json"
    if kind.startswith("tracker_"):
        tracker.write_bytes({"tracker_garbage": b"iter_two\n", "tracker_empty": b"", "tracker_negative": b"-3\n",
                             "tracker_binary": b"\xff\xfe\x00\x01"}[kind])
        return tracker
    if kind == "metadata_damaged":  # same size, a string no longer UTF-8 (pickle's UnicodeDecodeError); the
        target = iteration_dir / ".metadata"  # manifest stays: only --no-verify-checkpoint lets it through
        data = target.read_bytes()
        at = data.index(b"embedding")
        target.write_bytes(data[:at] + b"\xff\xfe" + data[at + 2:])
        return target
    if kind == "common_truncated":
        target = iteration_dir / "common.pt"
        target.write_bytes(target.read_bytes()[:100])
        manifest.unlink()
        return target
    if kind == "missing_dir":
        return Path(ckpt) / "nowhere"
    if kind in ("missing_iteration", "wrong_format", "other_shape"):
        return iteration_dir
    raise AssertionError(kind)


ONE_LINE_CASES = [
    *[("pretrain_gpt", kind) for kind in ("tracker_garbage", "tracker_empty", "tracker_negative", "tracker_binary",
                                          "metadata_damaged", "common_truncated", "missing_dir", "missing_iteration",
                                          "wrong_format", "other_shape")],
    *[(loader, kind) for loader in ("convert", "export_hf", "run_text_generation")
      for kind in ("tracker_garbage", "metadata_damaged", "common_truncated", "missing_dir")],
    ("convert", "missing_iteration"), ("export_hf", "missing_iteration"),
]


@pytest.mark.parametrize("loader,kind", ONE_LINE_CASES, ids=lambda v: str(v))
def test_checkpoint_errors_are_one_line_naming_the_file(checkpoints, tmp_path, loader, kind):
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    named = _damage(kind, ckpt)
    load_dir = named if kind == "missing_dir" else ckpt
    run, argv = _loader_command(loader, load_dir, "torch_dist", tmp_path, verify=kind != "metadata_damaged")
    if kind == "missing_dir" and loader == "pretrain_gpt":
        argv.append("--exit-on-missing-checkpoint")
    if kind == "missing_iteration":
        argv += {"pretrain_gpt": ["--ckpt-step", "7"], "convert": ["--ckpt-step", "7"],
                 "export_hf": ["--iteration", "7"]}[loader]
        named = Path(ckpt) / "iter_0000007"
    if kind == "wrong_format":
        argv[argv.index("--ckpt-format") + 1] = "torch"
    if kind == "other_shape":  # named by the flag that differs
        argv[argv.index("--hidden-size") + 1] = "48"
        named = "--hidden-size"
    status, out = run(argv)
    line = _assert_one_error_line(status, out, named)
    if kind == "wrong_format":
        assert "--ckpt-format" in line, line
    if kind == "other_shape":
        assert "hidden_size" in line and "(32)" in line and "(48)" in line, line


def test_other_vocabulary_padding_warns_once_naming_both_sizes(checkpoints, tmp_path):
    """Saved at the default padding (100 -> 128 rows at TP=1), resumed with --make-vocab-size-divisible-by
    256 (256 rows), as a TP=2 checkpoint resumed at TP=1 pads differently: the load goes on (the rows both
    have) and rank 0 warns once, naming both sizes and the flag that matches them."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    status, out = _run_rank(["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION + 1), "--load", ckpt,
                             "--ckpt-format", "torch_dist", "--make-vocab-size-divisible-by", "256",
                             "--override-opt-param-scheduler"])
    assert status == 0, out[-3000:]
    warnings = [line for line in out.splitlines() if "padded vocabulary" in line]
    assert len(warnings) == 1, out[-3000:]
    assert "of 128 rows" in warnings[0] and "pads to 256" in warnings[0], warnings[0]
    assert "pass --make-vocab-size-divisible-by 128 to pad as the checkpoint does" in warnings[0], warnings[0]
    assert str(_iteration_dir(ckpt)) in warnings[0]
    status, out = _run_rank(["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION + 1), "--load", ckpt,
                             "--ckpt-format", "torch_dist", "--override-opt-param-scheduler"])
    assert status == 0 and "padded vocabulary" not in out, out[-3000:]  # the same padding: no warning


@pytest.mark.parametrize("basename", ["model_optim_rng.pt", "distrib_optim.pt", "common.pt", "rank_00000.pt"])
def test_every_torch_file_refuses_a_payload_naming_the_global(tmp_path, basename):
    """The one reader of every torch-saved checkpoint file (legacy rank files, the distributed-optimizer
    state, torch_dist's common and RNG files) says "refusing to load", not "is corrupt", for a payload."""
    from megatron.core.dist_checkpointing.safe_loading import UnsafeCheckpointError
    from megatron.training.checkpointing import load_state_dict_file

    marker = tmp_path / "PAYLOAD_RAN"
    path = tmp_path / basename
    torch.save({"iteration": 3, "weight": torch.ones(2), "payload": [_Payload(marker)]}, path)
    with pytest.raises(UnsafeCheckpointError, match=rf"^refusing to load checkpoint {path} \(iteration 3\): it holds "
                                                    r"objects other than tensors and plain data \(posix\.system\)"):
        load_state_dict_file(str(path), "iteration 3")
    assert not marker.exists()


def test_two_ranks_both_refuse_the_metadata_payload(checkpoints, tmp_path):
    """Every rank reads ``.metadata``; the ranks agree on the failure, so none waits in a collective: the
    run ends (non-zero) without running the payload, with no traceback, naming the file."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    marker = tmp_path / "PAYLOAD_RAN"
    target = _plant("metadata_then_real", ckpt, marker)
    (_iteration_dir(ckpt) / "integrity_manifest.json").unlink()
    status, out = _run_ranks_without_launcher(2, ["pretrain_gpt.py", *MODEL, *TRAIN, "--global-batch-size", "4",
                                                  "--train-iters", str(ITERATION + 1), "--load", ckpt,
                                                  "--ckpt-format", "torch_dist", "--no-verify-checkpoint"])
    assert status != 0 and not marker.exists(), out[-3000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [line for line in out.splitlines() if "error: " in line]
    assert len(lines) == 2 and all(str(target) in line and "(builtins.eval)" in line for line in lines), out[-3000:]
    assert sorted(line.split(" error: ")[0] for line in lines) == ["[rank 0]", "[rank 1]"], lines


class _Calls:
    """Pickles as a call of ``func(*args)``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("payload,refused", [
    (_Calls(torch.load, "x"), "torch.serialization.load"),
    (_Calls(getattr, Path("x"), "touch"), "builtins.getattr"),
    (_Calls(subprocess.Popen, ["true"]), "subprocess.Popen"),
    (_Calls(Path.touch, Path("x")), "pathlib.Path.touch"),
    (_Calls(torch.Size, [2]), None),  # admitted: the call builds a torch.Size
], ids=["torch.load", "getattr", "Popen", "Path.touch", "torch.Size"])
def test_metadata_allow_list(tmp_path, payload, refused):
    """Only the classes DCP writes into .metadata are admitted: a call of anything else is refused before it
    is made, naming it (a dotted name is refused whole, not looked up step by step)."""
    from megatron.core.dist_checkpointing import safe_loading

    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(payload))
    if refused is None:
        with pytest.raises(safe_loading.CheckpointFileError, match="holds a Size, not the Metadata"):
            safe_loading.read_dcp_metadata(str(path))
        return
    with pytest.raises(safe_loading.UnsafeCheckpointError) as info:
        safe_loading.read_dcp_metadata(str(path))
    assert info.value.refused == refused and str(path) in str(info.value)


def test_import_hf_names_a_damaged_safetensors_file(tmp_path, capsys):
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    import_hf = load_checkpoint_tool("import_hf")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "gpt2"}')
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    assert import_hf.main(["--load", str(hf_dir), "--save", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot read {hf_dir / 'model.safetensors'}: "), err


def test_only_the_loaders_own_errors_are_the_users():
    """A checkpoint that lacks a part is the user's to fix (one line); torch's own RuntimeError raised while
    loading (a shape error, out of memory) is internal and keeps its traceback, wherever it was raised."""
    from megatron.training.checkpoint_errors import CheckpointContentError, is_checkpoint_user_error
    from megatron.training.checkpoint_integrity import FailedOnAnotherRankError

    assert is_checkpoint_user_error(CheckpointContentError("checkpoint x has no 'iteration' entry"))
    assert is_checkpoint_user_error(FailedOnAnotherRankError("checkpoint step failed on rank 0: ..."))
    from megatron.core.dist_checkpointing import model_and_optimizer as mo

    try:  # torch raises it, but its innermost Python frame is the checkpoint code that called torch
        mo.stack_layers({"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(2),
                         "decoder.layers.1.mlp.linear_fc1.weight": torch.zeros(3)})
    except RuntimeError as error:
        assert not is_checkpoint_user_error(error)
    else:
        raise AssertionError("stacking layers of different sizes did not fail")
