#!/usr/bin/env bash
# Download, here (PyPI reachable), the wheels a GPU machine without a network needs to run this
# project: pyproject.toml's dependencies that the GPU image lacks (OpenTelemetry and what it requires),
# for CPython 3.12 manylinux x86_64, into .whl/ (ignored by git). Pass it to the device tool with
# carry: [".whl"]; bench/gpu.sh installs them there with pip --no-index --no-deps --target.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu_wheels.py fetch --dest "${1:-.whl}"
