"""Count how many of Megatron-LM's GPT functional-test configurations this project's parser accepts.

Reads every ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a Megatron-LM checkout
(or of a bare git directory at ``--ref``), turns its ``MODEL_ARGS`` into an argv the way Megatron's
``tests/functional_tests/shell_test_utils/_run_training.sh`` does (``key: true`` -> the flag alone;
``[a b c]`` -> the words a b c; a value with spaces -> one word; anything else -> ``key value``;
``${VAR}`` -> a placeholder path; ``ENV_VARS`` ignored), and runs ``parse_args`` (with
``pretrain_gpt.py``'s extra defaults) and then ``validate_args`` with WORLD_SIZE 8 (the recipes run on
one node of 8 GPUs, ``tests/test_utils/recipes/gpt.yaml``; a name with ``<n>N<g>G`` gives n*g) and RANK 0.
Prints how many parse and validate, and the first reason of each of the others, grouped and counted::

    python bench/megatron_configs.py --megatron-lm /path/to/Megatron-LM [--ref core_v0.14.0] [--list]
"""
import argparse
import collections
import contextlib
import io
import os
import re
import subprocess
import sys

import yaml

_TEST_CASES = "tests/functional_tests/test_cases/gpt"
_PLACEHOLDER = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def config_texts(megatron_lm: str, ref: str):
    """``[(test name, yaml text)]`` sorted by name, from a checkout or a bare git directory at ``ref``."""
    folder = os.path.join(megatron_lm, _TEST_CASES)
    if os.path.isdir(folder):
        names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n, "model_config.yaml")))
        return [(n, open(os.path.join(folder, n, "model_config.yaml")).read()) for n in names]
    git = ["git", f"--git-dir={megatron_lm}"]
    paths = subprocess.run(git + ["ls-tree", "-r", "--name-only", ref, _TEST_CASES], check=True,
                           capture_output=True, text=True).stdout.split()
    paths = sorted(p for p in paths if p.endswith("/model_config.yaml") and p.count("/") == 5)
    return [(p.split("/")[-2], subprocess.run(git + ["show", f"{ref}:{p}"], check=True, capture_output=True,
                                              text=True).stdout) for p in paths]


def model_args_to_argv(model_args: dict) -> list:
    """Megatron's _run_training.sh rules: MODEL_ARGS (flag -> value) as the words of a command line."""
    argv = []
    for key, value in model_args.items():
        if value == "" or value is None:
            continue
        if value is True:
            argv.append(str(key))
            continue
        text = "false" if value is False else str(value)
        text = _PLACEHOLDER.sub(lambda m: f"/tmp/megatron_configs/{m.group(1)}", text).strip()
        if re.fullmatch(r"\[[^]]+\]", text):
            argv += [str(key)] + text[1:-1].replace(",", " ").split()
        else:
            argv += [str(key), text]
    return argv


def world_size_of(name: str) -> int:
    """GPUs of the test: ``<n>N<g>G`` in its name, else the recipe's one node of 8."""
    match = re.search(r"(\d+)N(\d+)G", name)
    return int(match.group(1)) * int(match.group(2)) if match else 8


def check(argv, world_size):
    """``(stage, reason)``: stage 'ok', 'parse' (parse_args refused) or 'validate' (validate_args refused)."""
    from megatron.training.arguments import parse_args, validate_args

    os.environ.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    err, out = io.StringIO(), io.StringIO()
    try:
        import pretrain_gpt
        provider = getattr(pretrain_gpt, "require_inputs", None)
    except ImportError:
        provider = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            args = parse_args(provider, args=argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return "parse", (lines[-1] if lines else "exit without a message")
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), _no_warnings():
            validate_args(args, {})
    except Exception as error:  # noqa: BLE001 - every refusal is a reason to count
        return "validate", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return "ok", ""


@contextlib.contextmanager
def _no_warnings():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def reason_key(reason: str) -> str:
    """Group reasons: an unrecognized-arguments line by its first flag, others by their text (without the list of
    further unsupported flags; numbers as N)."""
    reason = reason.removeprefix("error: ")
    match = re.match(r"unrecognized arguments: (\S+)", reason)
    if match:
        return f"unrecognized arguments (first: {match.group(1)})"
    reason = re.sub(r" \(also unsupported: [^)]*\)$", "", reason)
    return re.sub(r"(?<![-\w])\d+\b", "N", reason)[:200]


def main(argv=None):
    """Print the counts (and with --list, each configuration's outcome)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, help="Megatron-LM checkout or bare git directory")
    parser.add_argument("--ref", default="core_v0.14.0", help="git ref when --megatron-lm is a bare git directory")
    parser.add_argument("--list", action="store_true", help="print each configuration's outcome")
    options = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    results = []
    for name, text in config_texts(options.megatron_lm, options.ref):
        model_args = (yaml.safe_load(text) or {}).get("MODEL_ARGS") or {}
        stage, reason = check(model_args_to_argv(model_args), world_size_of(name))
        results.append((name, stage, reason))
        if options.list:
            print(f"{stage:8s} {name}: {reason}")
    total = len(results)
    parsed = sum(stage != "parse" for _, stage, _ in results)
    valid = sum(stage == "ok" for _, stage, _ in results)
    print(f"configurations: {total}")
    print(f"parse_args accepts: {parsed}")
    print(f"parse_args + validate_args accept: {valid}")
    for stage in ("parse", "validate"):
        reasons = collections.Counter(reason_key(r) for _, s, r in results if s == stage)
        print(f"first reason, refused by {'parse_args' if stage == 'parse' else 'validate_args'} "
              f"({sum(reasons.values())}):")
        for reason, count in reasons.most_common():
            print(f"  {count:4d}  {reason}")


if __name__ == "__main__":
    main()
