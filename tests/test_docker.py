"""docker/Dockerfile without a Docker engine: base image and tag argument, install step with every extra, entry
point, every COPY source present and not excluded by .dockerignore; docker/README.md's run lines."""
import fnmatch
import json
import re
import shlex

import pytest

from pretrain_utils import REPO

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")

DOCKERFILE = REPO / "docker" / "Dockerfile"


def _instructions():
    """[(INSTRUCTION, arguments)] with comments dropped and continuation lines joined."""
    text = re.sub(r"^\s*#.*\n", "", DOCKERFILE.read_text(), flags=re.M)
    text = text.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _args_before_from():
    values = {}
    for keyword, rest in _instructions():
        if keyword == "FROM":
            return values
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            values[name] = default
    raise AssertionError("the Dockerfile has no FROM")


def test_base_image_is_nvidia_pytorch_with_the_tag_as_a_build_argument():
    first = [(k, r) for k, r in _instructions() if k == "FROM"]
    assert len(first) == 1, first
    args = _args_before_from()
    assert "BASE_TAG" in args and args["BASE_TAG"], "the base tag must be a build argument with a default"
    assert re.fullmatch(r"\$\{BASE_IMAGE\}:\$\{BASE_TAG\}", first[0][1]), first[0][1]
    assert args["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch"
    assert re.fullmatch(r"\d\d\.\d\d-py3", args["BASE_TAG"]), args["BASE_TAG"]


def test_package_is_installed_with_every_extra_of_pyproject():
    extras_arg = dict(rest.partition("=")[::2] for k, rest in _instructions() if k == "ARG")["EXTRAS"]
    installs = [rest for k, rest in _instructions() if k == "RUN" and "pip install" in rest]
    assert len(installs) == 1, installs
    assert '-e ".[${EXTRAS}]"' in installs[0]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = set(declared) - set(extras_arg.split(","))
    assert not missing, f"docker/Dockerfile's ARG EXTRAS lacks the pyproject extras {sorted(missing)}"
    # the install sees the package: pyproject.toml and megatron/ are copied before it
    order = [(k, rest) for k, rest in _instructions() if k in ("COPY", "RUN")]
    before = " ".join(rest for k, rest in order[:order.index(("RUN", installs[0]))] if k == "COPY")
    assert "pyproject.toml" in before and "megatron" in before


def _dockerignore_patterns():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _ignored(path: str) -> bool:
    for pattern in _dockerignore_patterns():
        pattern = pattern.lstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.replace("**/", "")):
            return True
        if path.startswith(pattern.rstrip("/") + "/"):
            return True
    return False


def test_every_copied_path_exists_and_is_not_dockerignored():
    copies = [shlex.split(rest) for k, rest in _instructions() if k in ("COPY", "ADD")]
    assert copies
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        assert sources, words
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the build context (the repository root)"
            assert not _ignored(source), f"COPY {source}: excluded by .dockerignore"
    copied = {s for words in copies for s in words[:-1]}
    for needed in ("pyproject.toml", "megatron", "pretrain_gpt.py", "tools", "examples"):
        assert needed in copied, f"the image lacks {needed}"


def test_outputs_and_git_are_dockerignored():
    for path in (".git", "runs", "megatron/__pycache__", "quickstart_out", ".whl"):
        assert _ignored(path), path
    for path in ("megatron", "pretrain_gpt.py", "tools", "examples/slurm/pretrain_gpt.sbatch"):
        assert not _ignored(path), path


def test_entry_point_and_command_are_exec_form_and_exist():
    entry = [rest for k, rest in _instructions() if k == "ENTRYPOINT"]
    command = [rest for k, rest in _instructions() if k == "CMD"]
    assert len(entry) == 1 and len(command) == 1
    assert json.loads(entry[0]) == ["/opt/nvidia/nvidia_entrypoint.sh"]  # NGC's: banner and driver check
    argv = json.loads(command[0])
    assert argv[0] == "python" and (REPO / argv[1]).is_file(), argv
    workdir = [rest for k, rest in _instructions() if k == "WORKDIR"]
    assert workdir == ["/workspace/megatron-otel"]


def test_docker_readme_run_lines():
    readme = (REPO / "docker" / "README.md").read_text()
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", readme, re.S)]
    runs = [line for b in blocks for line in b.splitlines() if line.strip().startswith("docker run")]
    gpu_runs = [r for r in runs if "--gpus all" in r]
    assert len(gpu_runs) >= 2, "a single-node and a multi-node run line"
    for run in gpu_runs:
        for flag in ("--ipc=host", "--ulimit memlock=-1", "--ulimit stack=67108864", ":/data", ":/checkpoints"):
            assert flag in run, f"{flag} missing from: {run}"
        script = next(w for w in shlex.split(run) if w.startswith("examples/"))
        assert (REPO / script).is_file(), script
    assert any("NODE_RANK" in r and "MASTER_ADDR" in r and "--network=host" in r for r in gpu_runs)
    builds = [line for b in blocks for line in b.splitlines() if line.startswith("docker build")]
    assert builds and all("-f docker/Dockerfile" in b and b.endswith(" .") for b in builds)
    assert any("--build-arg BASE_TAG=" in b for b in builds)
