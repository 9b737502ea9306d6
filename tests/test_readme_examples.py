"""README and docs/ examples run verbatim and do not damage each other's output (issue 9 item 12; the deep sections
moved from the README to docs/ pages in issue 23)."""
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The README and the pages its deep sections moved to.
PAGES = [REPO / "README.md", *(REPO / "docs" / f"{name}.md" for name in ("training", "launch", "checkpoints",
                                                                        "telemetry", "testing"))]


def _commands():
    """The bash commands of the README and the docs/ pages, continuation lines joined and ``"${NAME[@]}"``
    arrays expanded."""
    commands = []
    blocks = [block for page in PAGES for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]
    for block in blocks:
        text = block.replace("\\\n", " ")
        arrays = {name: shlex.split(body, comments=True)
                  for name, body in re.findall(r"^(\w+)=\((.*?)\)", text, re.S | re.M)}
        text = re.sub(r"^\w+=\(.*?\)", "", text, flags=re.S | re.M)
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            expanded = []
            for word in words:
                match = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
                expanded.extend(arrays[match.group(1)] if match else [word])
            if expanded:
                commands.append(expanded)
    return commands


def _flag(words, name):
    return words[words.index(name) + 1] if name in words else None


def test_readme_commands_have_no_placeholders():
    for words in _commands():
        assert "..." not in words, f"placeholder in a README command: {' '.join(words)}"


def test_readme_training_commands_train_past_their_warmup():
    runs = [w for w in _commands() if "pretrain_gpt.py" in w]
    assert len(runs) >= 4
    for words in runs:
        warmup, train = _flag(words, "--lr-warmup-iters"), _flag(words, "--train-iters")
        if warmup is not None and train is not None:
            assert int(warmup) < int(train), f"--lr-warmup-iters {warmup} >= --train-iters {train}: {' '.join(words)}"


def test_readme_examples_write_distinct_outputs():
    """No two README commands save to the same checkpoint directory or write the same log file."""
    seen = {}
    for words in _commands():
        outputs = [_flag(words, "--save")] if "--save" in words else []
        outputs += [words[i + 1] for i, word in enumerate(words[:-1]) if word in (">", "tee")]
        for output in outputs:
            assert output not in seen, f"{output} written by two README examples:\n{seen[output]}\n{' '.join(words)}"
            seen[output] = " ".join(words)


def test_readme_keeps_the_two_set_up_commands_ci_relies_on():
    """The main job and the test command; .ci/run runs the same test command."""
    set_up = (REPO / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", set_up, re.S)
    assert blocks[0] == "python3 -m venv .venv && . .venv/bin/activate\n"
    assert blocks[1].splitlines() == [
        'python3 -m pip install torch==2.13.0 -e . && python3 examples/quickstart.py',
        'python3 -m pip install torch==2.13.0 -e ".[dev]" && python3 -m pytest -q tests',
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.rstrip().splitlines()[-1] == "python3 -m pytest -q tests"
    assert 'python3 -m pip install -q torch==2.13.0 -e ".[dev]"' in ci


# What the README's status calls "not available", and a flag of each: the program must refuse that flag.
_UNAVAILABLE_FLAGS = {"MoE": ["--num-experts", "4", "--disable-bias-linear"], "FP8": ["--fp8-format", "hybrid"],
                      "Transformer Engine": ["--transformer-impl", "transformer_engine"]}


def test_readme_status_calls_unavailable_only_what_the_program_refuses(monkeypatch, capsys):
    """The status line "Not available: ..." names only features whose flags stop the run (MoE, once refused, now
    trains: the line must not keep naming it), and every feature it names is one this test knows a flag of."""
    from megatron.training.arguments import parse_args, validate_args

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    line = re.search(r"Not available: ([^(]*)\(", (REPO / "README.md").read_text()).group(1)
    named = [part.strip() for part in line.replace("\n>", " ").split(",") if part.strip()]
    assert named and set(named) <= set(_UNAVAILABLE_FLAGS), named
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]
    for feature, flags in _UNAVAILABLE_FLAGS.items():
        try:
            validate_args(parse_args(args=[*model, *flags]))
            refused = False
        except (SystemExit, ValueError):
            refused = True
        capsys.readouterr()
        assert refused == (feature in named), f"README says {feature} is {'' if feature in named else 'not '}" \
                                              f"unavailable, but {' '.join(flags)} is {'' if refused else 'not '}refused"
