"""The Python packages that travel as wheels to a GPU machine without a network: fetch them, check them.

A lent GPU machine has its own CUDA build of PyTorch and many packages, but no package registry and no
OpenTelemetry. ``fetch`` downloads, here, the wheels that ``pyproject.toml``'s dependencies need beyond
what that machine's image holds (for CPython 3.12, manylinux x86_64), following every wheel's
``Requires-Dist`` until nothing is missing. There, bench/gpu_check.py installs them into a private
folder on ``PYTHONPATH`` and runs ``check``, which lists requirements of the carried distributions
that the environment does not meet.

    python3 bench/gpu_wheels.py fetch [--dest .whl]      # here, with PyPI reachable
    python3 bench/gpu_wheels.py check [--dest .whl]      # there, after install (bench/gpu_check.py does it)
"""
import argparse
import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The GPU image's packages that pyproject.toml's dependencies lead to (KINDS.md's package list of the
# `cuda` image, read 2026-11-17). They are not carried: they are compiled for that machine's CUDA/ABI
# or are there in a usable version. protobuf is left out of this set on purpose: the carried
# googleapis-common-protos and opentelemetry-proto need a recent protobuf and the image's version is
# not recorded, so a matching (abi3) wheel travels too and shadows it for our processes only.
ON_GPU_IMAGE = {
    "torch", "numpy", "sentencepiece", "regex", "tensorboard", "tiktoken", "transformers", "nvidia-ml-py",
    "grpcio", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "typing-extensions", "wrapt",
    "zipp", "packaging", "pytest", "setuptools", "six", "pyyaml", "filelock",
}

# The target interpreter of the GPU machine (python3 there is CPython 3.12 on Linux x86-64).
TARGET_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "extra": "",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def canonical(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: Path):
    """``(name, version, [Requires-Dist strings])`` read from a wheel's ``*.dist-info/METADATA``.

    Raises ValueError if the file is not a wheel with a METADATA entry.
    """
    with zipfile.ZipFile(path) as wheel:
        entries = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if not entries:
            raise ValueError(f"{path}: no .dist-info/METADATA inside; not a wheel?")
        meta = email.parser.Parser().parsestr(wheel.read(entries[0]).decode("utf-8"))
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def needed_requirements(requires, environment=None):
    """The ``packaging`` Requirements among ``requires`` whose marker holds for ``environment``
    (default: this interpreter, no extra requested)."""
    from packaging.requirements import Requirement

    out = []
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(environment or {"extra": ""}):
            out.append(req)
    return out


def pyproject_roots() -> list:
    """Names of pyproject.toml's dependencies and ``dev`` extras that the GPU image does not hold."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("dev", []))
    from packaging.requirements import Requirement

    roots = [canonical(Requirement(n).name) for n in names]
    return [n for n in dict.fromkeys(roots) if n not in ON_GPU_IMAGE]


def _local_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _download(name: str, dest: Path) -> None:
    """One wheel, without its dependencies, at the version installed here (so CI and the GPU agree)."""
    version = _local_version(name)
    spec = f"{name}=={version}" if version else name
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest), "-q", spec]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)


def fetch(dest: Path) -> list:
    """Download the closure of pyproject's roots (minus the GPU image's packages) into ``dest``.

    Returns the requirements on packages of the GPU image (they must hold there) as strings.
    Raises RuntimeError if two versions of one distribution end up in ``dest``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    # (name, extra) pairs: a requirement like ``pkg[requests]`` also needs what pkg's extra lists.
    pending, done, on_image = [(n, "") for n in pyproject_roots()], set(), []
    while pending:
        name, extra = pending.pop(0)
        if (name, extra) in done:
            continue
        done.add((name, extra))
        if not _have_wheel(dest, name):
            _download(name, dest)
        requires = _wheel_for(dest, name)[2]
        for req in needed_requirements(requires, dict(TARGET_MARKERS, extra=extra)):
            if extra and req.marker is None:
                continue  # already followed with the plain (no-extra) requirements
            dep = canonical(req.name)
            if dep in ON_GPU_IMAGE:
                on_image.append(str(req))
                continue
            pending += [(dep, "")] + [(dep, e) for e in sorted(req.extras)]
    by_name = {}
    for wheel in sorted(dest.glob("*.whl")):
        by_name.setdefault(canonical(wheel_metadata(wheel)[0]), []).append(wheel.name)
    doubles = {n: w for n, w in by_name.items() if len(w) > 1}
    if doubles:
        raise RuntimeError(f"two versions of one package in {dest} (pip would refuse to install them): {doubles}")
    return sorted(set(on_image))


def _have_wheel(dest: Path, name: str) -> bool:
    return any(canonical(wheel_metadata(w)[0]) == name for w in dest.glob("*.whl"))


def _wheel_for(dest: Path, name: str):
    for wheel in dest.glob("*.whl"):
        meta = wheel_metadata(wheel)
        if canonical(meta[0]) == name:
            return meta
    raise FileNotFoundError(f"no wheel for {name} in {dest} after pip download")


def unmet_requirements(dest: Path) -> list:
    """Requirements of the carried wheels' distributions that this interpreter's environment does not meet.

    Each entry reads ``"<dist> needs <requirement>: <what is installed>"``; empty when all hold.
    """
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    for wheel in sorted(dest.glob("*.whl")):
        name, _, requires = wheel_metadata(wheel)
        for req in needed_requirements(requires):
            try:
                have = version(req.name)
            except PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: {have} installed")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["fetch", "check"])
    parser.add_argument("--dest", type=Path, default=REPO / ".whl", help="wheel folder (default: .whl/ in the repo)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        on_image = fetch(args.dest)
        wheels = sorted(args.dest.glob("*.whl"))
        total = sum(w.stat().st_size for w in wheels)
        for wheel in wheels:
            print(f"  {wheel.name}")
        print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
        if on_image:
            print("requirements left to the GPU image's own packages (not carried):")
            for req in on_image:
                print(f"  {req}")
        return 0
    problems = unmet_requirements(args.dest)
    for line in problems:
        print(f"unmet: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
