"""Checkpoints whose pickles are benign but whose contents are hostile cannot run code or crash a loader.

A weights-only load admits tensors and plain data; what those hold can still do harm:
- saved args that ask for a Hugging Face tokenizer with ``trust_remote_code`` from a folder the
  checkpoint ships (export_hf.py and run_text_generation.py must take that trust from their own command
  line only);
- sparse tensors whose indices point outside their size (written out of bounds when copied into a dense
  tensor) and stride-0 tensors that expand a few bytes to terabytes;
- RNG states of the wrong type, a ``.metadata`` of the wrong shape, a manifest that is not text.
Each is refused with one line naming the file, and nothing the checkpoint ships is imported.
"""
import io
import json
import pickle

import pytest
import torch

from test_checkpoint_security import (ITERATION, MODEL, TRAIN, _assert_one_error_line, _copy, _iteration_dir,
                                      _run_rank, _run_tool, _ship_matching_manifest, checkpoints)  # noqa: F401

pytestmark = pytest.mark.timeout(900)


def _args_file(ckpt, fmt):
    name = "common.pt" if fmt == "torch_dist" else "mp_rank_00/model_optim_rng.pt"
    return _iteration_dir(ckpt) / name


def _rewrite(path, change):
    """Load the torch file ``path`` weights-only, apply ``change(state)``, save it back."""
    from megatron.training.checkpointing import load_state_dict_file

    state = load_state_dict_file(str(path))
    change(state)
    torch.save(state, path)


def _plant_remote_code_tokenizer(ckpt, fmt, marker):
    """Ship a Hugging Face tokenizer folder whose Python file creates ``marker`` when imported, and saved
    args that name it with ``trust_remote_code=True``; the manifest matches. Returns the folder."""
    folder = _iteration_dir(ckpt) / "hf_tokenizer"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
         "tokenizer_class": "EvilTokenizer"}))
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizer\n\n\nclass EvilTokenizer(PreTrainedTokenizer):\n    pass\n")

    def change(state):
        args = state["args"]
        args.tokenizer_type, args.tokenizer_model, args.trust_remote_code = "HuggingFaceTokenizer", str(folder), True

    _rewrite(_args_file(ckpt, fmt), change)
    _ship_matching_manifest(ckpt)
    return folder


@pytest.mark.parametrize("fmt,flags", [
    ("torch_dist", ["--vocab-size", "100"]),  # the tokenizer files alone are written from the saved args
    ("torch", []),  # the tokenizer is also built to learn the vocabulary size
    ("torch_dist", ["--vocab-size", "100", "--trust-remote-code"]),  # trust given, but not for the saved folder
])
def test_export_hf_takes_no_trust_remote_code_from_the_checkpoint(checkpoints, tmp_path, fmt, flags):
    pytest.importorskip("transformers", reason="export_hf and Hugging Face tokenizers need the [hf] extra")
    ckpt = _copy(checkpoints, fmt, tmp_path)
    marker = tmp_path / "MARKER"
    _plant_remote_code_tokenizer(ckpt, fmt, marker)
    status, out = _run_tool(["tools/checkpoint/export_hf.py", "--load", ckpt, "--save", tmp_path / "hf", *flags])
    assert not marker.exists(), out[-3000:]
    line = _assert_one_error_line(status, out)
    if "--trust-remote-code" in flags:
        assert "--tokenizer-model" in line, line


def test_run_text_generation_takes_the_tokenizer_folder_to_trust_from_the_command_line(checkpoints, tmp_path):
    pytest.importorskip("transformers", reason="export_hf and Hugging Face tokenizers need the [hf] extra")
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    marker = tmp_path / "MARKER"
    _plant_remote_code_tokenizer(ckpt, "torch_dist", marker)
    base = ["tools/run_text_generation.py", *MODEL, "--load", ckpt, "--use-checkpoint-args", "--prompt", "1 2",
            "--max-new-tokens", "2", "--greedy", "--trust-remote-code"]
    status, out = _run_rank(base)
    _assert_one_error_line(status, out, "--tokenizer-model", "--use-checkpoint-args")
    mine = tmp_path / "my_tokenizer"  # the user's folder wins over the saved one (here it does not exist)
    status, out = _run_rank([*base, "--tokenizer-model", mine])
    _assert_one_error_line(status, out, mine)
    assert not marker.exists(), out[-3000:]


def _sparse_out_of_bounds(shape):
    """A sparse tensor of ``shape`` whose one index lies far outside it (torch skips the check by default)."""
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return torch.sparse_coo_tensor(torch.tensor([[10 ** 6]] + [[0]] * (len(shape) - 1)), torch.ones(1), shape)


def _repeated(shape):
    return torch.zeros(1).expand(*shape)


@pytest.mark.parametrize("make", [_sparse_out_of_bounds, lambda shape: _sparse_out_of_bounds(shape).coalesce(),
                                  _repeated], ids=["sparse_oob", "sparse_oob_coalesced", "stride0"])
def test_torch_files_refuse_tensors_that_are_not_dense(tmp_path, make):
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, weights_only_load
    from megatron.training.checkpointing import load_state_dict_file

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"weight": make((4, 8))}, "nested": [torch.ones(2)]}, path)
    with pytest.raises(CheckpointFileError, match=str(path)):
        load_state_dict_file(str(path))
    with pytest.raises(CheckpointFileError, match="item x"):
        weights_only_load(io.BytesIO(path.read_bytes()), "item x")
    torch.save({"model": {"weight": torch.ones(4, 8)}, "view": torch.ones(8)[2:6]}, path)  # dense views pass
    assert load_state_dict_file(str(path))["model"]["weight"].shape == (4, 8)


def test_dcp_tensor_items_refuse_sparse_tensors_with_indices_outside(tmp_path):
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, SafeFileSystemReader
    from torch.distributed.checkpoint import FileSystemWriter, load, save
    from torch.distributed.checkpoint.api import CheckpointException

    save({"weight": torch.ones(4, 8)}, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    data_file = next(tmp_path.glob("*.distcp"))
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    info = next(iter(metadata.storage_data.values()))
    buffer = io.BytesIO()
    torch.save(_sparse_out_of_bounds((4, 8)), buffer)
    info.offset, info.length = data_file.stat().st_size, len(buffer.getvalue())
    with open(data_file, "ab") as stream:
        stream.write(buffer.getvalue())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = {"weight": torch.zeros(4, 8)}
    with pytest.raises(CheckpointException) as raised:
        load(target, storage_reader=SafeFileSystemReader(str(tmp_path)), no_dist=True)
    error = raised.value.failures[0][0]
    assert isinstance(error, CheckpointFileError) and data_file.name in str(error), error
    assert torch.count_nonzero(target["weight"]) == 0


def test_sparse_adam_moment_stops_pretrain_gpt_with_one_line(checkpoints, tmp_path):
    ckpt = _copy(checkpoints, "torch", tmp_path)
    path = _args_file(ckpt, "torch")

    def change(state):
        moments = state["optimizer"]["state"]
        first = next(iter(moments.values()))
        first["exp_avg"] = _sparse_out_of_bounds(tuple(first["exp_avg"].shape))

    _rewrite(path, change)
    _ship_matching_manifest(ckpt)
    status, out = _run_rank(["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION + 1), "--load", ckpt,
                             "--ckpt-format", "torch", "--override-opt-param-scheduler"])
    _assert_one_error_line(status, out, path)


def test_rng_state_of_the_wrong_type_is_one_line_naming_no_load_rng(checkpoints, tmp_path):
    ckpt = _copy(checkpoints, "torch", tmp_path)
    path = _args_file(ckpt, "torch")

    def change(state):
        state["rng_state"][0]["torch_rng_state"] = torch.zeros(3)  # a float tensor, not torch's ByteTensor state

    _rewrite(path, change)
    _ship_matching_manifest(ckpt)
    argv = ["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", str(ITERATION + 1), "--load", ckpt, "--ckpt-format",
            "torch", "--override-opt-param-scheduler"]
    status, out = _run_rank(argv)
    _assert_one_error_line(status, out, path, "--no-load-rng")
    status, out = _run_rank([*argv, "--no-load-rng"])
    assert status == 0, out[-3000:]


def test_metadata_whose_storage_data_is_not_a_mapping_is_one_error(tmp_path):
    from megatron.core.dist_checkpointing.safe_loading import CheckpointFileError, read_dcp_metadata
    from torch.distributed.checkpoint import FileSystemWriter, save

    save({"weight": torch.ones(2)}, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    metadata.storage_data = list(metadata.storage_data.values())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFileError, match="storage_data is a list"):
        read_dcp_metadata(str(tmp_path / ".metadata"))


def test_manifest_that_is_not_text_names_the_manifest(tmp_path):
    from megatron.training.checkpoint_integrity import MANIFEST_FILENAME, CheckpointIntegrityError, read_manifest

    (tmp_path / MANIFEST_FILENAME).write_bytes(pickle.dumps({"files": {}}))
    with pytest.raises(CheckpointIntegrityError, match=MANIFEST_FILENAME):
        read_manifest(str(tmp_path))
