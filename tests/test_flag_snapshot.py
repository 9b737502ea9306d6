"""Flag snapshot: what the README's commands and the example scripts' flags parse and validate to must stay
what was recorded in ``tests/data/golden/flags.json`` (the guard of issue 29 / design note 4.3, item 3).

Which commands: every ``pretrain_gpt.py`` and ``tools/run_text_generation.py`` command of README.md's
bash blocks (the five-minute tour and the sections after it), every ``pretrain_gpt.py`` launch of
``examples/*.sh`` and ``examples/slurm/pretrain_gpt.sbatch`` with the scripts' default settings, and the
one ``examples/quickstart.py`` builds. ``examples/run_simple_mcore_train_loop.py`` builds no Megatron
argv (it uses megatron.core alone) and ``examples/compare_logs.py`` is not a training script.

How the argv are found, at test time (so a changed README or script is caught, not only changed code):
the README's bash blocks are split with shlex (continuation lines joined, comments and everything from
a ``|`` on dropped); each script is run by bash with stub ``torchrun``, ``python`` and ``srun`` first
on PATH that only record their argv (nothing trains, no data is read), in a scratch output folder;
quickstart.py is imported and run with its corpus, tokenizer and subprocess steps replaced by stubs.

What is compared, for equality: ``vars(parse_args([]))`` (the defaults), and per command the argv (with
the values), what ``vars(parse_args(argv))`` changes against the defaults (``tools/run_text_generation.py``
with its own ``add_text_generation_args``; stored as a difference to keep the file readable), and, for
``pretrain_gpt.py``, what ``validate_args`` then adds or changes (or the error it raises, which is
behaviour too). Values that are not JSON types are stored as ``{"repr": repr(value)}``.

Normalized, so the snapshot does not depend on where or how the test runs:
- the launcher's environment: RANK, LOCAL_RANK, WORLD_SIZE and the SLURM_* variables are removed, then
  WORLD_SIZE is set to the world the command's launcher would start (torchrun's --nproc_per_node x
  --nnodes; the sbatch file's --nodes x --ntasks-per-node; 1 for python), so ``rank`` is 0 and
  ``world_size`` is that world;
- paths: the scratch output folder becomes ``<out>`` and the checkout's path ``<repo>``.

Re-record with ``MEGATRON_GOLDEN_RECORD=1 python -m pytest tests/test_flag_snapshot.py``, only at a commit
known to be good (a flag change that is meant, reviewed as such): the recording is the reference every
later commit is judged by.
"""
import contextlib
import copy
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "data" / "golden" / "flags.json"
RECORD = os.environ.get("MEGATRON_GOLDEN_RECORD") == "1"
SCRIPTS = ["examples/gpt2_shakespeare.sh", "examples/gpt2_shakespeare_pp.sh", "examples/gpt2_shakespeare_tp.sh",
           "examples/pretrain_gpt3_small.sh", "examples/pretrain_gpt3_small_multinode.sh",
           "examples/slurm/pretrain_gpt.sbatch"]
ENTRY_POINTS = ("pretrain_gpt.py", "tools/run_text_generation.py")
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
# The scripts' settings that the environment may override: cleared so their defaults are what is recorded.
SCRIPT_SETTINGS = re.compile(r"^(\w+)=\$\{\1[:-]", re.M)
STUB = """#!{python}
import json, os, sys
with open(os.environ["FLAG_SNAPSHOT_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""


def _readme_commands() -> list:
    """[(name, launcher words, entry point, argv)] of README.md's commands of the entry points."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            cut = next((i for i, w in enumerate(words) if w in SHELL_OPERATORS), len(words))
            words = words[:cut]
            entry = next((i for i, w in enumerate(words) if w in ENTRY_POINTS), None)
            if entry is not None:
                found.append((f"README.md[{len(found)}] {Path(words[entry]).name}", words[:entry], words[entry],
                              words[entry + 1:]))
    return found


def _script_commands(tmp_path) -> list:
    """[(name, launcher words, entry point, argv)] of the scripts' launches, recorded by stub launchers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "python", "srun"):
        (bin_dir / name).write_text(STUB.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    found = []
    for script in SCRIPTS:
        log, out = tmp_path / f"{Path(script).stem}.log", tmp_path / "out"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
        for setting in SCRIPT_SETTINGS.findall((REPO / script).read_text()):
            env.pop(setting, None)
        env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", FLAG_SNAPSHOT_LOG=str(log))
        args = [str(out)] if "shakespeare" in script else []
        result = subprocess.run(["bash", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"{script}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
        launches = [json.loads(line) for line in log.read_text().splitlines()]
        runs = [words for words in launches if "pretrain_gpt.py" in words]
        assert runs, f"{script} launched no pretrain_gpt.py: {launches}"
        for i, words in enumerate(runs):
            at = words.index("pretrain_gpt.py")
            launcher = words[:at]
            if launcher[0] == "srun":  # one task per GPU: the world is the sbatch file's nodes x tasks per node
                text = (REPO / script).read_text()
                nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
                tasks = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
                launcher = [*launcher, "--nproc_per_node", str(tasks), "--nnodes", str(nodes)]
            found.append((f"{script}[{i}]", launcher, "pretrain_gpt.py", words[at + 1:]))
    return found


def _quickstart_command(tmp_path, monkeypatch) -> tuple:
    """quickstart.py's pretrain_gpt.py launch (its default settings), with nothing run."""
    spec = importlib.util.spec_from_file_location("_quickstart_snapshot", REPO / "examples" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    launched = []

    def build_corpus(path, max_bytes):
        Path(path).write_text("")
        return 0

    monkeypatch.setattr(quickstart, "build_corpus", build_corpus)
    monkeypatch.setattr(quickstart, "train_tokenizer", lambda corpus, prefix, size: Path(f"{prefix}.model"))
    monkeypatch.setattr(quickstart, "run", lambda cmd: launched.append([str(c) for c in cmd]))
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--out", str(tmp_path / "out")])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # it sets this for its children: undone after the test
    with contextlib.redirect_stdout(io.StringIO()):
        quickstart.main()
    [words] = [w for w in launched if "pretrain_gpt.py" in w]
    at = words.index("pretrain_gpt.py")
    return ("examples/quickstart.py[0]", ["torchrun", *words[3:at]], "pretrain_gpt.py", words[at + 1:])


def _world_size(launcher) -> int:
    def option(*names, default=1):
        for name in names:
            if name in launcher:
                return int(launcher[launcher.index(name) + 1])
        return default
    launcher = [w for w in launcher if not re.fullmatch(r"[A-Za-z_]\w*=.*", w)]  # NAME=value: the environment
    if not launcher or launcher[0] not in ("torchrun", "srun"):
        return 1
    return option("--nproc_per_node", "--nproc-per-node") * option("--nnodes")


def _jsonable(value, paths):
    if isinstance(value, str):
        for path, name in paths:
            value = value.replace(path, name)
        return value
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, paths) for v in value]
    return {"repr": repr(value)}


def _parse(launcher, entry, argv, paths, monkeypatch, validate=True) -> tuple:
    """(vars of parse_args, vars after validate_args or None, validate_args's error or None), JSON-able."""
    from megatron.training.arguments import parse_args, validate_args

    provider = None
    if entry.endswith("run_text_generation.py"):
        spec = importlib.util.spec_from_file_location("_run_text_generation_snapshot", REPO / entry)
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        provider = tool.add_text_generation_args
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("WORLD_SIZE", str(_world_size(launcher)))
    validated, error = None, None
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        parsed = parse_args(provider, args=argv)
        if validate:
            validated = copy.deepcopy(parsed)
            try:
                validate_args(validated)
            except (Exception, SystemExit) as exc:  # a refusal is behaviour too: record its message
                validated, error = None, _jsonable(f"{type(exc).__name__}: {exc}", paths)

    def as_dict(namespace):
        return None if namespace is None else {k: _jsonable(v, paths) for k, v in sorted(vars(namespace).items())}
    return as_dict(parsed), as_dict(validated), error


def _changes(before: dict, after: dict) -> dict:
    """What ``after`` adds or changes against ``before``, and which keys of ``before`` it lacks."""
    return {"changed": {k: v for k, v in after.items() if k not in before or before[k] != v},
            "removed": sorted(k for k in before if k not in after)}


def _snapshot(launcher, entry, argv, paths, defaults, monkeypatch) -> dict:
    # Only pretrain_gpt.py validates its flags as given: run_text_generation.py's --use-checkpoint-args
    # first fills the model flags from the checkpoint.
    validate = entry == "pretrain_gpt.py"
    parsed, validated, error = _parse(launcher, entry, argv, paths, monkeypatch, validate)
    record = {"argv": [_jsonable(w, paths) for w in argv], "world_size": _world_size(launcher),
              "parsed_vs_defaults": _changes(defaults, parsed)}
    if error is not None:
        record["validate_error"] = error
    elif validate:
        record["validated_vs_parsed"] = _changes(parsed, validated)
    return record


def test_flag_snapshot(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    paths = [(str(tmp_path / "out"), "<out>"), (str(REPO), "<repo>")]
    commands = [*_readme_commands(), *_script_commands(tmp_path), _quickstart_command(tmp_path, monkeypatch)]
    defaults = _parse(["python"], "pretrain_gpt.py", [], paths, monkeypatch, validate=False)[0]
    snapshot = {name: _snapshot(launcher, entry, argv, paths, defaults, monkeypatch)
                for name, launcher, entry, argv in commands}
    if RECORD:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"defaults": defaults, "commands": snapshot}, indent=1, sort_keys=True) + "\n")
        return
    recorded = json.loads(GOLDEN.read_text())
    assert defaults == recorded["defaults"], "vars(parse_args([])) differs from the recording"
    golden = recorded["commands"]
    assert sorted(snapshot) == sorted(golden), "the set of commands changed (re-record only if that is meant)"
    for name in golden:
        for part in golden[name]:
            assert snapshot[name].get(part) == golden[name][part], f"{name}: {part} differs from the recording"
        assert sorted(snapshot[name]) == sorted(golden[name]), name
