"""Golden runs: the logged losses, grad norms and learning rates, the checkpoint's tensors and its saved args
must stay bit-for-bit what they were when recorded (the guard of issue 29 / design note 4.3, items 1 and 2).

Each layout trains the 2-layer fp32 test GPT without dropout on 2 gloo ranks, on --mock-data with the
NullTokenizer (so ../shared is not needed and nothing is skipped for its absence), for an 8-iteration run:
run 1 has --train-iters 8 but stops at iteration 3 (--exit-interval 3) after saving there (--save-interval
3), so its learning-rate schedule is the 8-iteration one; run 2 loads that checkpoint and trains 4..8.
The layouts are tp2, pp2, dp2 with --use-distributed-optimizer (all in the default torch_dist format) and
dp2 with --ckpt-format torch.

What is compared, as strings, for equality (never closeness):
- the TensorBoard scalars ``lm loss``, ``grad-norm`` and ``learning-rate`` of iterations 1..8 (float32 as
  written, stored as ``float.hex()``) -> ``tests/data/golden/losses.json``;
- the SHA-256 of every tensor saved at iteration 3 -> ``tests/data/golden/checkpoints.json``. torch format:
  every tensor of every ``*.pt`` file of the iteration folder, keyed ``file::key/path``. torch_dist: every
  item read back from the DCP checkpoint (its ``.metadata`` plus a load of everything into CPU objects),
  keyed ``dcp::<FQN>/path``, and every tensor of ``common.pt`` and ``rng/*.pt``. A subtree that holds no
  tensor (e.g. Python's RNG state, the optimizer's hyperparameters) is hashed as one item from its JSON
  form with sorted keys. The ``args`` entry is not hashed but compared as a dict (next item);
- the saved ``args`` of that checkpoint as a JSON-able dict, with this test's temporary folder replaced by
  ``<tmp>`` (the --save and --tensorboard-dir paths; mock data has no data paths); values that are not
  JSON types are stored as ``{"repr": repr(value)}``.

Bit equality depends on the CPU kernels torch picks, so the recording stores ``torch.__version__`` and
``torch.backends.cpu.get_cpu_capability()``; where the running machine differs in either, the test
skips, naming both (CI is a machine like the recording one). The ranks run with OMP_NUM_THREADS=1
(``pretrain_utils.run_ranks`` sets it) so reductions do not depend on the thread count.

Re-recording: ``MEGATRON_GOLDEN_RECORD=1 python -m pytest tests/test_golden_run.py`` writes
the files instead of comparing (one pytest process, no xdist: the layouts share the two files). Only do
this at a commit known to be good (e.g. before a refactor, or after a change that is MEANT to change the
numbers, reviewed as such), and say so in the commit: the recording is the reference every later commit
is judged by, so recording at a broken commit would turn the guard into a guard of the bug.
"""
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain_utils import run_ranks, tensorboard_scalars

pytestmark = pytest.mark.timeout(600)

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
RECORD = os.environ.get("MEGATRON_GOLDEN_RECORD") == "1"
SAVE_AT, ITERS = 3, 8
TAGS = ("lm loss", "grad-norm", "learning-rate")
MODEL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo"]
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1",
         "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--train-iters", str(ITERS)]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
    "dp2-torch": ["--ckpt-format", "torch"],
}


def _environment() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _train(layout, tmp_path, name, extra) -> dict:
    """One run of ``layout``; {tag: {step: float.hex()}} read from its TensorBoard events."""
    tb = tmp_path / f"tb_{name}"
    result = run_ranks(2, [*MODEL, *TRAIN, *LAYOUTS[layout], "--tensorboard-dir", tb, *extra], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {tag: {step: float(value).hex() for step, value in tensorboard_scalars(tb, tag).items()} for tag in TAGS}


def _tensor_digest(data: bytes, dtype, shape) -> str:
    return hashlib.sha256(f"{dtype}|{tuple(shape)}|".encode() + data).hexdigest()


def _has_array(obj) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(obj, dict):
        return any(_has_array(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_array(v) for v in obj)
    return False


def _digests(obj, path: str, out: dict) -> None:
    """SHA-256 of each tensor/array under ``obj``, and of each tensor-free subtree as one item."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        out[path] = _tensor_digest(t.reshape(-1).view(torch.uint8).numpy().tobytes(), t.dtype, t.shape)
    elif isinstance(obj, np.ndarray):
        out[path] = _tensor_digest(np.ascontiguousarray(obj).tobytes(), obj.dtype, obj.shape)
    elif _has_array(obj) and isinstance(obj, dict):
        for key, value in obj.items():
            _digests(value, f"{path}/{key}", out)
    elif _has_array(obj):
        for i, value in enumerate(obj):
            _digests(value, f"{path}[{i}]", out)
    else:
        text = json.dumps(obj, sort_keys=True, default=repr)
        out[path] = hashlib.sha256(text.encode()).hexdigest()


def _jsonable(value, tmp: str):
    if isinstance(value, str):
        return value.replace(tmp, "<tmp>")
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, tmp) for v in value]
    return {"repr": repr(value)}


def _args_dict(args, tmp_path) -> dict:
    return {key: _jsonable(value, str(tmp_path)) for key, value in sorted(vars(args).items())}


def _checkpoint_record(iter_dir: Path, tmp_path) -> dict:
    """{"tensors": {key: sha256}, "args": {...}} of one saved iteration folder (either format)."""
    tensors, args = {}, None
    if (iter_dir / ".metadata").is_file():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        reader = FileSystemReader(str(iter_dir))
        fqns = sorted(reader.read_metadata().state_dict_metadata)
        state = {}
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert sorted(state) == fqns  # every item of the metadata was read back
        for fqn in fqns:
            _digests(state[fqn], f"dcp::{fqn}", tensors)
    for file in sorted(iter_dir.rglob("*.pt")):
        name = file.relative_to(iter_dir).as_posix()
        content = torch.load(file, map_location="cpu", weights_only=False)  # this test's own checkpoint
        if isinstance(content, dict) and "args" in content:
            if args is None:
                args = _args_dict(content["args"], tmp_path)
            else:  # every file that carries args carries the same
                assert _args_dict(content["args"], tmp_path) == args, name
            content = {k: v for k, v in content.items() if k != "args"}
        if isinstance(content, dict):  # one item per top-level key at least, so a diff names the key
            for key, value in content.items():
                _digests(value, f"{name}:/{key}", tensors)
        else:
            _digests(content, f"{name}:", tensors)
    assert args is not None, f"no saved args in {sorted(p.name for p in iter_dir.iterdir())}"
    return {"tensors": tensors, "args": args}


def _golden(name: str) -> dict:
    path = GOLDEN / name
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_golden(name: str, layout: str, value) -> None:
    data = _golden(name)
    data["environment"] = _environment()
    data.setdefault("layouts", {})[layout] = value
    data["layouts"] = dict(sorted(data["layouts"].items()))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    (GOLDEN / name).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _skip_unless_same_kernels() -> None:
    recorded = _golden("losses.json").get("environment")
    if recorded is None:
        pytest.fail("no recording in tests/data/golden/losses.json (record with MEGATRON_GOLDEN_RECORD=1)")
    here = _environment()
    if recorded != here:
        pytest.skip(f"bit equality needs the recording's CPU kernels: recorded with torch {recorded['torch']} "
                    f"on CPU capability {recorded['cpu_capability']}, this machine has torch {here['torch']} "
                    f"on CPU capability {here['cpu_capability']}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_golden_run(layout, tmp_path):
    if not RECORD:
        _skip_unless_same_kernels()
    ckpt = tmp_path / "ckpt"
    first = _train(layout, tmp_path, "first", ["--save", ckpt, "--save-interval", str(SAVE_AT),
                                               "--exit-interval", str(SAVE_AT)])
    assert all(sorted(first[tag]) == list(range(1, SAVE_AT + 1)) for tag in TAGS), first
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(SAVE_AT)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == [f"iter_{SAVE_AT:07d}"]
    # Run 1 stopped at 3 of an 8-iteration schedule: cosine from 1e-3 to 1e-4 over iterations 2..8.
    lr3 = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (SAVE_AT - 2) / (ITERS - 2)))
    assert float.fromhex(first["learning-rate"][SAVE_AT]) == pytest.approx(lr3, rel=1e-6)
    record = _checkpoint_record(ckpt / f"iter_{SAVE_AT:07d}", tmp_path)

    second = _train(layout, tmp_path, "second", ["--load", ckpt])
    assert all(sorted(second[tag]) == list(range(SAVE_AT + 1, ITERS + 1)) for tag in TAGS), second
    assert float.fromhex(second["learning-rate"][ITERS]) == pytest.approx(1e-4, rel=1e-6)
    scalars = {tag: {str(step): value for step, value in sorted({**first[tag], **second[tag]}.items())}
               for tag in TAGS}

    if RECORD:
        _write_golden("losses.json", layout, scalars)
        _write_golden("checkpoints.json", layout, record)
        return
    assert scalars == _golden("losses.json")["layouts"][layout]
    golden_ckpt = _golden("checkpoints.json")["layouts"][layout]
    assert record["args"] == golden_ckpt["args"]
    assert sorted(record["tensors"]) == sorted(golden_ckpt["tensors"])  # the same items were saved
    changed = sorted(k for k in record["tensors"] if record["tensors"][k] != golden_ckpt["tensors"][k])
    assert not changed, f"{len(changed)} saved items differ from the recording: {changed[:20]}"
