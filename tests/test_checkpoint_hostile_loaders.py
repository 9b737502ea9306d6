"""Hostile checkpoints cannot hang a loader, read outside the checkpoint, change process-wide classes or load
wrong weights with exit status 0 (issue 28 items 1-4, and the MemoryError / allocation tracebacks of item 5).

Each case starts from the small torch_dist checkpoint pretrain_gpt.py saves in test_checkpoint_security.py's
module fixture, breaks a copy the way an attacker or a damaged disk would, and runs a loader
(pretrain_gpt.py --load, tools/checkpoint/convert.py, export_hf.py, tools/run_text_generation.py) as a
process with a 30 s limit: it must end, exit non-zero, print exactly one ``error:`` line naming the file or
entry and no traceback, and never print what it read outside the checkpoint. The four loaders share the
manifest check and the ``.metadata`` reader, so each case runs on the loaders whose code paths differ.
"""
import json
import os
import pathlib
import pickle
import shutil
import struct
import subprocess
import sys
import zlib

import pytest
import torch

from dist_utils import fork_ranks, free_port, rank_env, use_torchrun
from pretrain_utils import REPO, run_python
from test_checkpoint_security import (_assert_one_error_line, _copy, _iteration_dir,  # noqa: F401
                                      _loader_command, _ship_matching_manifest, checkpoints)

pytestmark = pytest.mark.timeout(300)

LIMIT_S = 30  # every loader must end within this, whatever the checkpoint holds
MANIFEST = "integrity_manifest.json"


def _run(loader, argv):
    """Run ``argv`` as the ``loader`` runs (pretrain_gpt and run_text_generation as one rank with torchrun's
    environment, the tools as plain processes), killed after LIMIT_S: ``(exit status, stdout + stderr)``.
    A loader still running then fails the test."""
    try:
        if loader in ("convert", "export_hf"):
            result = run_python(argv, timeout=LIMIT_S)
            return result.returncode, result.stdout + result.stderr
        log = pathlib.Path(argv[argv.index("--load") + 1]).parent / f"{loader}.log"
        env = rank_env(dict(os.environ, OMP_NUM_THREADS="1"), 0, 1, free_port())
        if use_torchrun():
            with open(log, "w") as out:
                status = subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, timeout=LIMIT_S).returncode
        else:
            status, = fork_ranks(1, argv, [env], REPO, [log], [log], LIMIT_S)
        return status, log.read_text(errors="replace")
    except subprocess.CalledProcessError as error:
        return error.returncode, (error.output or "") + (error.stderr or "")
    except subprocess.TimeoutExpired:
        pytest.fail(f"{loader} did not end within {LIMIT_S} s")


def _metadata(ckpt):
    """The ``.metadata`` of the copy ``ckpt``, unpickled plainly (the test's own file, before any change)."""
    return pickle.loads((_iteration_dir(ckpt) / ".metadata").read_bytes())


def _write_metadata(ckpt, metadata):
    (_iteration_dir(ckpt) / ".metadata").write_bytes(pickle.dumps(metadata))


def _manifest_entry(ckpt, rel, size, crc="00000000"):
    """Add ``rel`` to the copy's manifest with the given size and CRC-32."""
    path = _iteration_dir(ckpt) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][rel] = {"size": size, "crc32": crc}
    path.write_text(json.dumps(manifest))


def _passwd_digest():
    data = pathlib.Path("/etc/passwd").read_bytes()
    return len(data), f"{zlib.crc32(data) & 0xFFFFFFFF:08x}", data


# --------------------------------------------------------------------------------------------------------
# Hostile pickles for .metadata: pickle's BUILD aimed at a class or a function admitted by the allow-list
# --------------------------------------------------------------------------------------------------------

def _global(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _unicode(text):
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


# BUILD's state: ``(None, {name: value})`` sets the attribute with setattr (works on a class);
# ``{name: value}`` updates the object's __dict__ (works on a function).
BUILD_TARGETS = {
    "PurePosixPath": (("pathlib", "PurePosixPath"), "__truediv__", True),
    "_get_layout": (("torch.serialization", "_get_layout"), "cache", False),
    "Metadata": (("torch.distributed.checkpoint.metadata", "Metadata"), "__post_init__", True),
}


def _attribute(target):
    (module, name), attribute, _ = BUILD_TARGETS[target]
    obj = getattr(__import__(module, fromlist=[name]), name)
    return obj.__dict__.get(attribute)


def _build_on(target, rest):
    """Pickle bytes that BUILD on the admitted ``target`` (setting one attribute to an admitted class), pop it,
    then go on with the protocol-2 pickle ``rest`` (its PROTO opcode dropped): plain pickle changes the
    class or function for the whole process and returns what ``rest`` holds."""
    (module, name), attribute, by_setattr = BUILD_TARGETS[target]
    state = b"}" + _unicode(attribute) + _global("builtins", "frozenset") + b"s"  # {attribute: frozenset}
    if by_setattr:
        state = b"N" + state + b"\x86"  # (None, {...})
    assert rest[:2] == b"\x80\x02"
    return b"\x80\x02" + _global(module, name) + state + b"b0" + rest[2:]


@pytest.mark.parametrize("target", sorted(BUILD_TARGETS))
@pytest.mark.parametrize("then", ["real_metadata", "refused_global"])
def test_build_on_an_admitted_class_or_function_is_refused_and_changes_nothing(checkpoints, tmp_path, target, then):
    """In-process: the project's reader refuses the BUILD naming the file, and the class or function is the
    same object with the same attribute afterwards, also when the rest of the file would be refused anyway
    (a refused global after the BUILD). Plain pickle does change it (the reference)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.safe_loading import UnsafeCheckpointError

    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    path = _iteration_dir(ckpt) / ".metadata"
    rest = pickle.dumps(_metadata(ckpt), protocol=2) if then == "real_metadata" else \
        b"\x80\x02" + _global("posix", "system") + _unicode("true") + b"\x85R."
    path.write_bytes(_build_on(target, rest))
    (module, name), attribute, _ = BUILD_TARGETS[target]
    owner = getattr(__import__(module, fromlist=[name]), name)
    before = _attribute(target)
    try:
        with pytest.raises(UnsafeCheckpointError) as raised:
            serialization.read_metadata(str(_iteration_dir(ckpt)))
        assert str(path) in str(raised.value) and "BUILD" in str(raised.value), raised.value
        assert f"{module}.{name}" in str(raised.value), raised.value
        assert getattr(__import__(module, fromlist=[name]), name) is owner
        assert _attribute(target) is before
        if then == "real_metadata":  # the reference: plain pickle changes it for the whole process
            assert pickle.loads(path.read_bytes()).state_dict_metadata
            assert _attribute(target) is frozenset
    finally:  # whatever happened, the rest of this process sees the original
        if _attribute(target) is not before:
            if before is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, before)
    assert _attribute(target) is before


_METADATA_INSTANCE = b"\x80\x02" + _global("torch.distributed.checkpoint.metadata", "Metadata") + b")\x81"


@pytest.mark.parametrize("data,refused", [
    (_METADATA_INSTANCE + b"}" + _unicode("__class__") + _global("torch.distributed.checkpoint.metadata",
                                                                   "StorageMeta") + b"sb.", "with a dict state"),
    (_METADATA_INSTANCE + b"N}" + _unicode("x") + b"K\x01s\x86b.", "with a tuple state"),
    (b"\x80\x02\x82\x01.", "copyreg extension code"),
    (b"\x80\x02" + _global("collections", "OrderedDict") + b"(" + _unicode("a") + b"K\x01u.",
     "SETITEMS on class collections.OrderedDict"),
    (b"\x80\x02" + _global("builtins", "set") + b"(K\x01e.", "APPENDS on class builtins.set"),
    (b"\x80\x04" + _global("builtins", "frozenset") + b"(K\x01\x90.", "ADDITEMS on class builtins.frozenset"),
], ids=["dunder_state", "slot_state", "EXT1", "SETITEMS_on_class", "APPENDS_on_class", "ADDITEMS_on_class"])
def test_other_changes_to_objects_the_unpickler_did_not_build_are_refused(tmp_path, data, refused):
    """Besides BUILD on a class: BUILD that would set ``__class__`` or slots of a built object, copyreg
    extension codes (looked up in a process-wide cache) and container opcodes aimed at an admitted class."""
    from megatron.core.dist_checkpointing.safe_loading import UnsafeCheckpointError, read_dcp_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        read_dcp_metadata(str(path))


@pytest.mark.parametrize("loader,target", [
    ("pretrain_gpt", "PurePosixPath"), ("convert", "PurePosixPath"), ("export_hf", "PurePosixPath"),
    ("run_text_generation", "PurePosixPath"), ("pretrain_gpt", "_get_layout"), ("convert", "Metadata"),
])
def test_build_on_an_admitted_class_stops_every_loader_with_one_line(checkpoints, tmp_path, loader, target):
    if loader == "export_hf":
        pytest.importorskip("transformers", reason="export_hf needs the [hf] extra")
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    path = _iteration_dir(ckpt) / ".metadata"
    path.write_bytes(_build_on(target, pickle.dumps(_metadata(ckpt), protocol=2)))
    _ship_matching_manifest(ckpt)
    status, out = _run(loader, _loader_command(loader, ckpt, "torch_dist", tmp_path, True)[1])
    line = _assert_one_error_line(status, out, path)
    assert "BUILD" in line and "refusing to load" in line, line


# --------------------------------------------------------------------------------------------------------
# The manifest: entries outside the checkpoint, FIFOs, devices
# --------------------------------------------------------------------------------------------------------

def _hostile_manifest(kind, ckpt):
    """Break the manifest (or a data file it lists) of the copy ``ckpt``; returns what the error must name."""
    iteration_dir = _iteration_dir(ckpt)
    if kind == "dev_zero":
        _manifest_entry(ckpt, "/dev/zero", 0)
        return "/dev/zero"
    if kind == "fifo":
        os.mkfifo(iteration_dir / "fifo")
        _manifest_entry(ckpt, "fifo", 0)
        return "fifo"
    if kind == "data_symlink_dev_zero":  # the size the manifest gives matches what stat says of /dev/zero
        data = iteration_dir / "__0_0.distcp"
        data.unlink()
        data.symlink_to("/dev/zero")
        _manifest_entry(ckpt, "__0_0.distcp", 0)
        return "__0_0.distcp"
    if kind == "parent_hostname":
        rel = "../../" * 8 + "etc/hostname"
        _manifest_entry(ckpt, rel, os.path.getsize("/etc/hostname"))
        return rel
    if kind == "etc_passwd":
        size, _, _ = _passwd_digest()
        _manifest_entry(ckpt, "/etc/passwd", size)
        return "/etc/passwd"
    if kind == "manifest_fifo":
        manifest = iteration_dir / MANIFEST
        manifest.unlink()
        os.mkfifo(manifest)
        return MANIFEST
    raise AssertionError(kind)


MANIFEST_CASES = [
    *[(loader, "dev_zero") for loader in ("pretrain_gpt", "convert", "export_hf", "run_text_generation")],
    ("pretrain_gpt", "fifo"), ("convert", "fifo"), ("pretrain_gpt", "data_symlink_dev_zero"),
    ("export_hf", "data_symlink_dev_zero"), ("pretrain_gpt", "parent_hostname"), ("convert", "etc_passwd"),
    ("run_text_generation", "etc_passwd"), ("pretrain_gpt", "manifest_fifo"),
]


@pytest.mark.parametrize("loader,kind", MANIFEST_CASES, ids=lambda v: str(v))
def test_manifest_entries_stay_inside_the_checkpoint(checkpoints, tmp_path, loader, kind):
    if loader == "export_hf":
        pytest.importorskip("transformers", reason="export_hf needs the [hf] extra")
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    named = _hostile_manifest(kind, ckpt)
    status, out = _run(loader, _loader_command(loader, ckpt, "torch_dist", tmp_path, True)[1])
    line = _assert_one_error_line(status, out, named)
    _, crc, passwd = _passwd_digest()
    assert crc not in out and passwd.splitlines()[0].decode(errors="replace") not in out, out[-3000:]
    if os.path.exists("/etc/hostname"):
        hostname = pathlib.Path("/etc/hostname").read_text().strip()
        hostname_crc = f"{zlib.crc32(pathlib.Path('/etc/hostname').read_bytes()) & 0xFFFFFFFF:08x}"
        assert hostname_crc not in out and (not hostname or hostname not in line), line


def test_data_file_linked_to_a_device_is_refused_without_the_manifest(checkpoints, tmp_path):
    """--no-verify-checkpoint (no manifest to compare with): the data file is still checked before a read."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    data = _iteration_dir(ckpt) / "__0_0.distcp"
    data.unlink()
    data.symlink_to("/dev/zero")
    (_iteration_dir(ckpt) / MANIFEST).unlink()
    status, out = _run("convert", _loader_command("convert", ckpt, "torch_dist", tmp_path, False)[1])
    line = _assert_one_error_line(status, out, data)
    assert "outside the checkpoint directory" in line, line


@pytest.mark.parametrize("loader,kind", [("run_text_generation", "common_fifo"), ("pretrain_gpt", "rng_dev_zero")])
def test_torch_files_that_are_not_regular_files_are_refused_without_the_manifest(checkpoints, tmp_path, loader,
                                                                                 kind):
    """--no-verify-checkpoint: ``common.pt`` replaced by a FIFO (an open would wait for a writer for ever) or
    an RNG file linked to /dev/zero (a read would never end) ends the loader with one line naming it."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    iteration_dir = _iteration_dir(ckpt)
    if kind == "common_fifo":
        target = iteration_dir / "common.pt"
        target.unlink()
        os.mkfifo(target)
    else:
        target = iteration_dir / "rng" / "rank_00000.pt"
        target.unlink()
        target.symlink_to("/dev/zero")
    (iteration_dir / MANIFEST).unlink()
    status, out = _run(loader, _loader_command(loader, ckpt, "torch_dist", tmp_path, False)[1])
    line = _assert_one_error_line(status, out, target)
    if kind == "common_fifo":  # the RNG reader looks for a regular file first and calls it missing
        assert "not a regular file" in line, line


def test_metadata_linked_out_of_the_checkpoint_is_not_read(checkpoints, tmp_path):
    """Without a manifest: a ``.metadata`` that is a link to a file elsewhere (here a valid one) is refused
    before it is read."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError

    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    path = _iteration_dir(ckpt) / ".metadata"
    outside = tmp_path / "elsewhere"
    shutil.move(path, outside)
    path.symlink_to(outside)
    with pytest.raises(CheckpointFileError, match=f"{path}: it is a link to {outside}, outside"):
        serialization.read_metadata(str(_iteration_dir(ckpt)))


def test_file_digest_refuses_what_is_not_a_regular_file(tmp_path):
    from megatron.training.checkpoint_integrity import NotARegularFileError, file_digest, manifest_entry_path

    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", "/dev/zero", tmp_path):
        with pytest.raises(NotARegularFileError):
            file_digest(str(path))
    (tmp_path / "inside").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "inside")  # a link that stays inside is fine
    assert file_digest(str(tmp_path / "link")) == (3, f"{zlib.crc32(b'abc'):08x}")
    assert manifest_entry_path(str(tmp_path), "link") == (str(tmp_path / "link"), None)
    for rel in ("/etc/passwd", "../x", "a/../../x", "", "fifo", "."):
        path, reason = manifest_entry_path(str(tmp_path), rel)
        assert path is None and MANIFEST in reason, (rel, reason)


# --------------------------------------------------------------------------------------------------------
# .metadata contents: chunks, entry types, transforms, declared sizes
# --------------------------------------------------------------------------------------------------------

KEY = "decoder.final_layernorm.weight"  # one chunk, [32]
LAYER_KEY = "decoder.layers.mlp.linear_fc1.weight"  # two chunks, one per layer


def _hostile_metadata(kind, ckpt):
    """Change the copy's ``.metadata`` as ``kind`` says (the attacker ships a matching manifest); returns
    what the error must name besides the file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex

    path = _iteration_dir(ckpt) / ".metadata"
    if kind == "declared_2_62":  # 25 bytes: a bytes object of 2**62 bytes
        path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 62) + b"\x00" * 14)
        assert path.stat().st_size == 25
        return None
    metadata = _metadata(ckpt)
    entries = metadata.state_dict_metadata
    if kind == "uncovered":  # every chunk of a tensor moved to offset 10**9 (its storage moved with it)
        md = entries[LAYER_KEY]
        for chunk in md.chunks:
            old = MetadataIndex(LAYER_KEY, chunk.offsets)
            chunk.offsets = torch.Size([10 ** 9] + list(chunk.offsets[1:]))
            metadata.storage_data[MetadataIndex(LAYER_KEY, chunk.offsets)] = metadata.storage_data.pop(old)
        named = LAYER_KEY
    elif kind == "gap":  # the second layer's chunk dropped
        entries[LAYER_KEY].chunks.pop()
        named = LAYER_KEY
    elif kind == "non_tensor":
        entries[KEY] = BytesStorageMetadata()
        named = KEY
    elif kind == "zstd":
        info = metadata.storage_data[MetadataIndex(KEY, torch.Size([0]))]
        info.transform_descriptors = ["stream.zstd/1"]
        named = KEY
    elif kind in ("size_2_40", "size_negative"):
        size = 2 ** 40 if kind == "size_2_40" else -5
        md = entries[KEY]
        md.size = torch.Size([size])
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([size]))]
        named = KEY
    else:
        raise AssertionError(kind)
    _write_metadata(ckpt, metadata)
    return named


METADATA_CASES = [
    *[(loader, "declared_2_62") for loader in ("pretrain_gpt", "convert", "export_hf", "run_text_generation")],
    ("pretrain_gpt", "uncovered"), ("convert", "uncovered"), ("export_hf", "gap"), ("run_text_generation", "gap"),
    ("pretrain_gpt", "non_tensor"), ("convert", "non_tensor"), ("export_hf", "non_tensor"),
    ("pretrain_gpt", "zstd"), ("convert", "zstd"),
    ("convert", "size_2_40"), ("export_hf", "size_2_40"), ("pretrain_gpt", "size_2_40"),
    ("convert", "size_negative"), ("export_hf", "size_negative"),
]


@pytest.mark.parametrize("loader,kind", METADATA_CASES, ids=lambda v: str(v))
def test_hostile_metadata_is_one_line_naming_the_file(checkpoints, tmp_path, loader, kind):
    if loader == "export_hf":
        pytest.importorskip("transformers", reason="export_hf needs the [hf] extra")
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    named = _hostile_metadata(kind, ckpt)
    _ship_matching_manifest(ckpt)
    status, out = _run(loader, _loader_command(loader, ckpt, "torch_dist", tmp_path, True)[1])
    iteration_dir = _iteration_dir(ckpt)
    # The structural refusals name .metadata; a model that finds no tensor names the checkpoint it loads.
    file_named = iteration_dir if (loader, kind) in (("pretrain_gpt", "non_tensor"),) else iteration_dir / ".metadata"
    line = _assert_one_error_line(status, out, file_named, *([named] if named else []))
    assert "MemoryError" not in out and "successfully loaded" not in out, out[-3000:]
    assert not (tmp_path / "converted").exists() and not (tmp_path / "hf" / "model.safetensors").exists()
    if kind == "declared_2_62":
        assert "declares" in line, line


def test_chunk_checks(tmp_path):
    """check_metadata on hand-made entries: exact tilings pass (any dimension, several chunks, empty tensors);
    a gap, an overlap, a chunk outside, wrong ranks, a negative size or a non-dtype are refused naming the key."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, check_metadata

    def entry(size, *chunks, dtype=torch.float32):
        return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks])

    good = {
        "whole": entry([4, 6], ([0, 0], [4, 6])),
        "columns": entry([4, 6], ([0, 0], [4, 2]), ([0, 2], [4, 4])),
        "grid": entry([4, 6], ([0, 0], [2, 3]), ([0, 3], [2, 3]), ([2, 0], [2, 3]), ([2, 3], [2, 3])),
        "scalar": entry([], ([], [])),
        "empty": entry([0, 5]),
    }
    check_metadata(Metadata(state_dict_metadata=good), "m")
    bad = {
        "gap": entry([4, 6], ([0, 0], [4, 2]), ([0, 3], [4, 3])),
        "overlap": entry([4, 6], ([0, 0], [4, 4]), ([0, 2], [4, 2]), ([0, 4], [4, 2])),  # count matches, overlaps
        "outside": entry([4, 6], ([0, 0], [4, 6]), ([10 ** 9, 0], [4, 6])),
        "rank": entry([4, 6], ([0], [24],)),
        "negative": entry([-5], ([0], [-5])),
        "dtype": entry([2], ([0], [2]), dtype=None),
        "twice_scalar": entry([], ([], []), ([], [])),
    }
    for key, md in bad.items():
        with pytest.raises(CheckpointFileError, match=f"cannot read m: .*tensor {key} "):
            check_metadata(Metadata(state_dict_metadata={key: md}), "m")


@pytest.mark.parametrize("data", [
    b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 62) + b"\x00" * 14,  # bytes of 2**62
    b"\x80\x04\x95" + struct.pack("<Q", 2 ** 62) + b"N.",  # a frame of 2**62
    b"\x80\x04\x8d" + struct.pack("<Q", 2 ** 62) + b"abc",  # a string of 2**62
], ids=["BINBYTES8", "FRAME", "BINUNICODE8"])
def test_declared_lengths_beyond_the_file_are_refused_before_allocating(tmp_path, data):
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, read_dcp_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(CheckpointFileError, match=str(path)):
        read_dcp_metadata(str(path))


def test_metadata_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, read_dcp_metadata

    os.mkfifo(tmp_path / ".metadata")
    with pytest.raises(CheckpointFileError, match="not a regular file"):
        read_dcp_metadata(str(tmp_path / ".metadata"))


def test_what_our_saves_write_passes_the_checks(checkpoints, tmp_path):
    """The reference: the fixture's own checkpoint (as pretrain_gpt.py saved it) passes every check, holds no
    transform descriptors, and copies of it load again with exit status 0 in the tools."""
    from megatron.core.dist_checkpointing import serialization

    metadata = serialization.read_metadata(str(_iteration_dir(checkpoints["torch_dist"])))
    assert all(not info.transform_descriptors for info in metadata.storage_data.values())
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    status, out = _run("convert", _loader_command("convert", ckpt, "torch_dist", tmp_path, True)[1])
    assert status == 0, out[-3000:]
    shutil.rmtree(tmp_path / "converted")
