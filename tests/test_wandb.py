"""--wandb-project/-exp-name/-save-dir: refused clearly without the package, offline W&B logging with it."""
import glob
import struct
import sys
import types

import pytest

from megatron.training import global_vars
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_args, validate_args
from pretrain_utils import run_pretrain, tensorboard_scalars

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10",
         "--lr", "1e-3"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)


def _validate(*flags):
    return validate_args(parse_args(args=[*MODEL, *flags]))


def test_refused_with_install_hint_when_wandb_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ValueError) as info:
        _validate("--wandb-project", "p", "--wandb-exp-name", "n", "--wandb-save-dir", "/tmp/w")
    assert str(info.value) == ("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                               "(or remove --wandb-project/--wandb-exp-name/--wandb-save-dir)")


@pytest.mark.parametrize("flags,message", [
    (["--wandb-exp-name", "n"], "--wandb-exp-name needs --wandb-project"),
    (["--wandb-save-dir", "/tmp/w"], "--wandb-save-dir needs --wandb-project"),
    (["--wandb-project", "p", "--wandb-save-dir", "/tmp/w"], "--wandb-project needs --wandb-exp-name"),
    (["--wandb-project", "p", "--wandb-exp-name", "n"], "--wandb-project needs --wandb-save-dir or --save"),
])
def test_incomplete_wandb_flags_are_refused(monkeypatch, flags, message):
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))  # installed or not, same checks
    with pytest.raises(ValueError, match=message):
        _validate(*flags)


class _FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs = kwargs
        self.logged = []
        self.finished = False

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


@pytest.mark.parametrize("rank,env,mode", [(1, {}, "offline"), (1, {"WANDB_API_KEY": "k"}, None),
                                           (1, {"WANDB_MODE": "disabled"}, None), (0, {}, "no run")])
def test_run_started_on_the_last_rank_offline_without_credentials(monkeypatch, tmp_path, rank, env, mode):
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: _FakeRun(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _validate("--wandb-project", "proj", "--wandb-exp-name", "exp", "--save", str(tmp_path / "ckpt"),
                     "--save-interval", "5")
    args.rank, args.world_size = rank, 2
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", None)
    cfg = pretrain_cfg_container_from_args(args)
    run = global_vars._set_wandb_writer(cfg.logger, cfg.dist, cfg.checkpoint.save, vars(args))
    if mode == "no run":
        assert run is None and global_vars.get_wandb_writer() is None
        return
    assert global_vars.get_wandb_writer() is run
    kwargs = run.init_kwargs
    assert (kwargs["project"], kwargs["name"], kwargs["mode"]) == ("proj", "exp", mode)
    assert kwargs["dir"] == str(tmp_path / "ckpt" / "wandb") and (tmp_path / "ckpt" / "wandb").is_dir()
    assert kwargs["config"]["micro_batch_size"] == 2 and kwargs["config"]["params_dtype"] == "torch.float32"
    global_vars.destroy_global_variables()
    assert run.finished


# ---------------------------------------------------------------------------------------------------
# End to end with the real package (skipped where it is not installed)
# ---------------------------------------------------------------------------------------------------

def _wandb_records(path):
    """Protobuf ``Record``s of an offline ``.wandb`` file.

    The file is a 7-byte W&B header followed by a LevelDB-style log: 32 KiB blocks of chunks, each
    with a 7-byte header (CRC32 4, little-endian length 2, type 1: full/first/middle/last = 1/2/3/4).
    """
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero fill up to the next block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    parsed = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def _history(records):
    """{step: {key: value}} of the history rows."""
    import json

    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                     for item in record.history.item}
            rows[items["_step"]] = items
    return rows


def test_offline_run_logs_the_tensorboard_scalars(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no credentials: offline, no network
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    tb, wb = tmp_path / "tb", tmp_path / "wb"
    out = run_pretrain(2, ["--micro-batch-size", "2", "--train-iters", "4", "--wandb-project", "megatron-test",
                           "--wandb-exp-name", "offline-e2e", "--wandb-save-dir", str(wb), "--tensorboard-dir", str(tb),
                           "--log-validation-ppl-to-tensorboard"],
                       shared_data, shakespeare_prefix, tmp_path, stderr_too=True)
    assert "W&B: no API key configured" in out and "logging offline to" in out
    files = glob.glob(str(wb / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, f"expected one offline run (the last rank's), found {files}"
    records = _wandb_records(files[0])
    run = [r.run for r in records if r.WhichOneof("record_type") == "run"][0]
    assert (run.project, run.display_name) == ("megatron-test", "offline-e2e")
    history = _history(records)
    assert sorted(history) == [1, 2, 3, 4]
    for tag in ("lm loss", "learning-rate", "batch-size", "grad-norm", "loss-scale"):
        tb_values = tensorboard_scalars(tb, tag)
        for step in range(1, 5):
            assert history[step][tag] == pytest.approx(tb_values[step], rel=1e-6), (tag, step)
    assert history[4]["lm loss validation"] == pytest.approx(tensorboard_scalars(tb, "lm loss validation")[4],
                                                             rel=1e-6)
    assert "lm loss validation ppl" in history[4]
    assert not any(key.endswith("vs samples") for row in history.values() for key in row)
