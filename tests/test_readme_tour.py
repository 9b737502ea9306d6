"""The README's five-minute tour, run as written on CPU (fewer iterations), in a scratch folder.

The commands come from README.md itself, so the tour cannot drift from the code. Three kinds of line are
not run: the TensorBoard server (it never exits), the `pip install` of the [hf] and [report] extras (a test
must not change the environment; the [dev] extra that runs the tests already holds them) and the line that
opens the report in a browser. A command's leading ``NAME=value`` words are its environment, and ``> FILE``
its stdout, as in the shell.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The README's iteration counts, and the smaller ones the test trains with (the rest is verbatim).
FEWER_ITERATIONS = {"--train-iters": {"200": "6", "40": "6"}, "--save-interval": {"200": "6"},
                    "--eval-interval": {"100": "3", "20": "3"}, "--lr-warmup-iters": {"20": "2"},
                    "--log-interval": {"20": "2", "1": "1"}}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


def tour_commands(readme_text: str) -> list:
    """The tour's commands as argv lists, in order (continuation lines joined, comments dropped)."""
    section = readme_text.split("## Five-minute tour", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [words for words in (shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines())
            if words]


def _split_command(words):
    """(environment assignments {NAME: value}, argv, stdout file or None) of one tour line."""
    count = next((i for i, w in enumerate(words) if not _ASSIGNMENT.fullmatch(w)), len(words))
    env = dict(w.split("=", 1) for w in words[:count])
    words = words[count:]
    stdout = None
    if ">" in words:
        at = words.index(">")
        words, stdout = words[:at], words[at + 1]
    return env, words, stdout


def _runnable(words):
    """argv for this interpreter, or None for the lines the test does not run (see the module docstring)."""
    if words[0] == "tensorboard" or words[1:4] == ["-m", "pip", "install"] or words[1:3] == ["-m", "webbrowser"]:
        return None
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    assert words[0] == "python", f"unexpected tour command: {shlex.join(words)}"
    return [sys.executable, *words[1:]]


def _fewer_iterations(argv):
    out = list(argv)
    for flag, values in FEWER_ITERATIONS.items():
        if flag in out:
            at = out.index(flag) + 1
            assert out[at] in values, f"the README's {flag} changed to {out[at]}: update FEWER_ITERATIONS"
            out[at] = values[out[at]]
    return out


def test_tour_commands_are_the_expected_ones():
    commands = [_split_command(words)[1] for words in tour_commands((REPO / "README.md").read_text())]
    skipped = [shlex.join(words) for words in commands if _runnable(words) is None]
    assert skipped == ["tensorboard --logdir runs/tour/tensorboard --port 6006",
                       "python -m pip install -e '.[hf]'", "python -m pip install -e '.[report]'",
                       "python -m webbrowser -t 'file://$PWD/runs/tour/report.html'"], skipped
    kinds = [Path(w[1]).name if w[0] == "python" and not w[1].startswith("-") else w[0] for w in commands]
    assert kinds == ["make_tour_data.py", "preprocess_data.py", "torchrun", "tensorboard", "python",
                     "export_hf.py", "python", "run_text_generation.py", "torchrun", "python",
                     "telemetry_report.py", "python"], kinds


@pytest.mark.timeout(600)
def test_readme_tour_runs_as_written(tmp_path):
    pytest.importorskip("transformers")  # step 4 needs the [hf] extra
    pytest.importorskip("matplotlib", reason="the tour's step 6 (the report) needs the [report] extra: matplotlib")
    # The scratch folder sees the code through links, so the tour writes its runs/ there, not in the checkout.
    for name in ("pretrain_gpt.py", "tools", "examples", "megatron"):
        (tmp_path / name).symlink_to(REPO / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    outputs = []
    for words in tour_commands((REPO / "README.md").read_text()):
        assignments, words, stdout = _split_command(words)
        argv = _runnable(words)
        if argv is None:
            continue
        result = subprocess.run(_fewer_iterations(argv), cwd=tmp_path, env=dict(env, **assignments),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{shlex.join(words)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if stdout is not None:
            (tmp_path / stdout).write_text(result.stdout)
        outputs.append(result.stdout)
    make_data, preprocess, train, export, hf_generate, generate, telemetry_train, report = outputs
    assert (tmp_path / "runs/tour/pydocs_text_document.bin").stat().st_size > 100_000
    iterations = re.findall(r"iteration\s+(\d+)/\s+6 \| consumed samples:\s+(\d+)", train)
    assert iterations[-1] == ("6", "48"), train[-3000:]
    assert (tmp_path / "runs/tour/ckpt/latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "runs/tour/hf").iterdir()}
    assert hf_generate.startswith("The for statement") and len(hf_generate.split()) > 5, hf_generate
    text = generate.split("===== generated =====\n", 1)[1]
    assert text.startswith("The for statement") and len(text) > len("The for statement") + 20, generate[-2000:]
    # Step 6: the telemetry run's log holds both ranks' JSON lines; the report shows both ranks' breakdowns.
    assert '"resource_metrics"' in (tmp_path / "runs/tour/telemetry.log").read_text()
    assert report.startswith("wrote runs/tour/report.html"), report
    page = (tmp_path / "runs/tour/report.html").read_text()
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S).group(1))
    assert [row["iteration"] for row in data["iterations"]] == [1, 2, 3, 4, 5, 6]
    assert sorted(data["breakdown"]) == ["0", "1"]
