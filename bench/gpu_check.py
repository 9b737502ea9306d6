"""GPU check: one run that proves the GPU path of this project and measures it (called by bench/gpu.sh).

Stages, in order, each with its own time cap inside one overall budget (default 540 s); a failing
stage is reported and the next one runs; the exit status is 1 if any stage failed. The measurements
come first, so a short lease still yields them:

- ``env``: python/PyTorch/GPU facts, the bf16 dense peak from the GPU's name (or ``--peak-tflops``),
  OpenTelemetry from the carried ``.whl/`` folder when the machine lacks it, the parser's flags.
- ``mfu``: tokens/s and MFU of a 1.3B GPT (24 layers, hidden 2048, 16 heads, seq 2048, bf16) at the
  largest micro-batch that fits, from the TFLOP/s Megatron's log line prints (``--log-throughput``),
  and the memory report's theoretical peak against the allocator's.
- ``mfu_fused``: the same with ``--attention-backend fused`` (cuDNN attention on Hopper).
- ``profile``: a few iterations of the MFU run under ``torch.profiler``; the top 25 kernels by device
  time go to ``kernels.txt`` in ``--out``.
- ``gpu_tests``: ``pytest tests/gpu`` (all skipped without CUDA).
- ``resume``: ``pretrain_gpt.py --bf16`` stopped with ``--save``/``--exit-interval`` (a ``torch_dist``
  checkpoint written with ``--async-save``) and resumed with ``--load`` logs the losses of an
  uninterrupted run.
- ``telemetry``: the same run with ``MEGATRON_OTEL_ENABLED=1`` and the console exporter: the spans
  arrive and the losses do not change.
- ``parallel``: with 2+ GPUs, TP=2 over NCCL logs the losses of one GPU in fp32 (1e-5) and bf16
  (2e-3), DP=2 in bf16 (2e-3); the vocabulary pads to the same size at TP=1 and TP=2.
- ``parallel_pp``: with 2+ GPUs, pipeline parallelism (PP=2, 1F1B, p2p over NCCL) logs the losses of
  one GPU (bf16 tolerance).
- ``parallel_cp``: with 2+ GPUs, context parallelism (CP=2) with each ``--cp-comm-type`` (``p2p``,
  ``all_gather``, ``a2a``) logs the bf16 losses of one GPU; its tokens/s against one GPU's.
- ``dp_distopt``: with 2+ GPUs, DP=2 with ``--use-distributed-optimizer --overlap-grad-reduce
  --overlap-param-gather`` (bf16) logs the losses of one GPU; its step time against plain DP=2 and the
  theoretical memory report's figure.
- ``async_save_2gpu``: with 2+ GPUs, DP=2 stopped after a ``--async-save`` checkpoint and resumed logs
  the losses of the uninterrupted DP=2 run (rank 1 stages its copies on cuda:1).
- ``mfu_compile``: the MFU run again with ``--compile-transformer-layers``, if the parser has it.

``--dry-run`` runs the stages on the CPU (tiny models, gloo, a few iterations; tests/gpu are collected
and all skip; no cuDNN or compile measurement; the 2-GPU stages run as 2 CPU processes) so CI keeps this script working. Each figure is printed as ``name: value unit`` and, with ``--out DIR``,
written to ``DIR/gpu_check.json`` (with every run's output in ``DIR/gpu_check.log``).
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' datasheets, matched in order
# against the CUDA device name; the first match wins (so "H100 PCIe" comes before "H100").
PEAK_BF16_TFLOPS = [("H100 PCIE", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0)]
DRY_RUN_PEAK_TFLOPS = 1.0  # a stand-in so the MFU arithmetic runs on the CPU; no claim about any CPU

# Relative loss tolerance between runs that should be equal. On the CPU every kernel is deterministic,
# so resumed and uninterrupted runs agree exactly; on a GPU atomics in some backward kernels (attention,
# index accumulation) reorder fp32 sums, which should move printed losses by about 1e-6 (not yet
# measured), so 1e-4 leaves room while a lost RNG or optimizer state (a different dropout mask, a reset
# Adam moment) moves them far more.
RESUME_RTOL = {"cpu": 0.0, "cuda": 1e-4}
# TP=2/DP=2/PP=2 against one GPU: partial sums are reduced in a different order (and, in bf16, rounded
# to bf16 before the reduction). Both runs have the same padded vocabulary (small_model's vocab), so
# nothing else differs (CP=2 splits each sequence, so attention sums in another order too). fp32 runs without TF32 (initialize.py enables it only with --bf16).
PARALLEL_RTOL = {"fp32": 1e-5, "bf16": 2e-3}
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")  # --cp-comm-type choices, each run by the parallel_cp stage

# Each stage's cap at the default --time-budget of 540 s (scaled with the budget). The caps stop hangs;
# they are sized from estimates (no GPU run yet), with room for 2-3x the expected time per stage.
DEFAULT_BUDGET_S = {"gpu": 540.0, "dry_run": 1500.0}
STAGE_CAPS_S = {"env": 60, "mfu": 180, "mfu_fused": 120, "profile": 90, "gpu_tests": 150, "resume": 120,
                "telemetry": 60, "parallel": 150, "parallel_pp": 90, "parallel_cp": 120, "dp_distopt": 90, "async_save_2gpu": 120,
                "mfu_compile": 180}
STAGES = list(STAGE_CAPS_S)
OTEL_PROBE = ("import opentelemetry.sdk.trace, opentelemetry.sdk.metrics, "
              "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")


class StageFailed(Exception):
    """The stage ran and its check did not hold (the message says which)."""


class StageSkipped(Exception):
    """The stage does not apply here (the message says why)."""


# ---------------------------------------------------------------------------------------------------
# Reading Megatron's output
# ---------------------------------------------------------------------------------------------------

_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*(\d+) \|(.*)$")
_MEMORY_REPORT = re.compile(r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB")
_MEMORY_TOTAL = re.compile(r"Theoretical memory footprints: .*activation=([0-9.]+) MB, total=([0-9.]+) MB")
_MEASURED_PEAK = re.compile(r"max allocated: ([0-9.]+)")
_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank \(\d+, \d+\): (\d+)")


def parse_iterations(text: str) -> dict:
    """``{iteration: {"lm loss": float, "elapsed time per iteration (ms)": float, ...}}`` from log lines.

    Every ``key: value`` field of Megatron's iteration line is kept; numeric values become floats.
    """
    out = {}
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if not match:
            continue
        fields = {}
        for part in match.group(3).split("|"):
            if ":" in part:
                key, value = part.rsplit(":", 1)
                try:
                    fields[key.strip()] = float(value)
                except ValueError:
                    fields[key.strip()] = value.strip()
        out[int(match.group(1))] = fields
    return out


def losses(text: str) -> dict:
    """``{iteration: lm loss}``; raises StageFailed if no iteration line carries a loss."""
    found = {it: f["lm loss"] for it, f in parse_iterations(text).items() if "lm loss" in f}
    if not found:
        raise StageFailed("no Megatron iteration line with 'lm loss' in the output")
    return found


def max_relative_difference(got: dict, ref: dict) -> float:
    """Largest ``|got - ref| / |ref|`` over the iterations of ``got``; StageFailed if ``ref`` lacks one."""
    missing = sorted(set(got) - set(ref))
    if missing:
        raise StageFailed(f"iterations {missing} missing from the reference run")
    return max(abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-30) for i in got)


def peak_tflops_for(name: str):
    """Dense bf16 peak (TFLOP/s) of a GPU from its CUDA name, or None when the name is not known."""
    upper = name.upper()
    for key, peak in PEAK_BF16_TFLOPS:
        if key in upper:
            return peak
    return None


# ---------------------------------------------------------------------------------------------------
# Model configurations (flags of pretrain_gpt.py)
# ---------------------------------------------------------------------------------------------------

def small_model(dry_run: bool) -> dict:
    """The model of the resume, telemetry and TP/DP stages: a few seconds per run.

    ``--vocab-size 1023`` with the NullTokenizer is 1024 ids (its end-of-document id is one more),
    a multiple of 128 x TP for TP = 1 and 2: the one-GPU and TP=2 models have the same padded
    vocabulary, so they are the same model (``--vocab-size 1024`` padded to 1152 and 1280).
    """
    if dry_run:
        return dict(layers=2, hidden=64, heads=4, seq=64, vocab=1023, micro=2, global_batch=8, iters=6, half=3)
    return dict(layers=4, hidden=256, heads=8, seq=256, vocab=1023, micro=4, global_batch=16, iters=8, half=4)


def mfu_model(dry_run: bool) -> dict:
    """GPT-3 XL (1.3B: 24 layers, hidden 2048, 16 heads, seq 2048, GPT-2 vocabulary) or a CPU stand-in.

    ``micro`` lists the micro-batch sizes to try, largest first; 2 micro-batches per iteration.
    """
    if dry_run:
        return dict(layers=2, hidden=64, heads=4, seq=64, vocab=1024, micro=[4, 2], microbatches=2, iters=5,
                    warmup=2)
    return dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, micro=[16, 8, 4, 2, 1], microbatches=2,
                iters=10, warmup=3)


def model_flags(m: dict, micro: int, global_batch: int, precision: str = "bf16") -> list:
    """pretrain_gpt.py flags of model ``m`` on mock data; ``precision`` is ``bf16`` or ``fp32``."""
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
            "--max-position-embeddings", str(m["seq"]), "--micro-batch-size", str(micro),
            "--global-batch-size", str(global_batch), "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(m["vocab"]), *(["--bf16"] if precision == "bf16" else []), "--lr", "1e-3",
            "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1",
            "--eval-iters", "0"]


# ---------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------

class GPUCheck:
    """Runs the stages, keeps figures and stage results, writes them out."""

    def __init__(self, args):
        self.args = args
        self.dry_run = args.dry_run
        self.device = "cpu" if args.dry_run else "cuda"
        self.backend = "gloo" if args.dry_run else "nccl"
        self.figures, self.stages, self.info = {}, {}, {}
        self.flags = set()
        self.pythonpath = [str(REPO)]
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=args.work_dir))
        self.out = Path(args.out) if args.out else None
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = (self.out or Path(tempfile.gettempdir())) / "gpu_check.log"
        self.log_path.write_text("")
        self.budget = args.time_budget or DEFAULT_BUDGET_S["dry_run" if args.dry_run else "gpu"]
        self.deadline = time.monotonic() + self.budget
        self.stage_deadline = self.deadline
        self.reference_losses = None  # the uninterrupted run of the resume stage
        self.mfu_micro = None
        self.parallel_runs = {}  # the parallel stage's one-GPU losses and DP=2 output, reused by dp_distopt

    # -- output ------------------------------------------------------------------------------------

    def figure(self, name: str, value, unit: str) -> None:
        self.figures[name] = {"value": value, "unit": unit}
        print(f"{name}: {value} {unit}", flush=True)

    def note(self, key: str, value) -> None:
        self.info[key] = value
        print(f"{key}: {value}", flush=True)

    def write_json(self) -> None:
        if not self.out:
            return
        failed = [n for n, s in self.stages.items() if s["status"] == "failed"]
        doc = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "host": platform.node(), "dry_run": self.dry_run, "ok": not failed, "info": self.info,
               "stages": self.stages, "figures": self.figures}
        (self.out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")

    # -- processes ---------------------------------------------------------------------------------

    def env(self, extra=None) -> dict:
        """The children's environment: repo (and carried packages) first on PYTHONPATH, telemetry off."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_"))}
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env["PYTHONUNBUFFERED"] = "1"
        if self.dry_run:
            # Tiny models: one thread per rank; several threads per rank on a small shared machine
            # spin against each other (10x slower iterations were seen on 2 busy cores).
            env.setdefault("OMP_NUM_THREADS", "1")
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, even on a machine with GPUs
        else:
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env.update(extra or {})
        return env

    def command(self, label: str, cmd: list, timeout: float = None, env=None):
        """Run ``cmd`` in its own process group, killed with its children at the stage's deadline.

        Returns ``(returncode, output)``; output is stdout+stderr (also appended to the log file).
        Raises StageFailed when it timed out.
        """
        remaining = self.stage_deadline - time.monotonic()
        limit = remaining if timeout is None else min(timeout, remaining)
        if limit < 5:
            raise StageFailed(f"{label}: no time left in this stage's cap or the --time-budget")
        stdout_path = self.work / f"{label}.out"
        started = time.monotonic()
        with open(stdout_path, "w") as sink:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env or self.env(), stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        output = Path(stdout_path).read_text(errors="replace")
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {label} ({time.monotonic() - started:.1f} s, rc={proc.returncode}): "
                      f"{' '.join(cmd)}\n{output}")
        if timed_out:
            raise StageFailed(f"{label}: timed out after {limit:.0f} s; tail:\n{_tail(output)}")
        return proc.returncode, output

    def pretrain(self, label: str, nproc: int, flags: list, env_extra=None, timeout=None, must_pass=True,
                 script="pretrain_gpt.py"):
        """``pretrain_gpt.py`` (or ``script``, which runs it) on ``nproc`` ranks (torchrun; one rank is
        started directly with torchrun's variables, which saves a second interpreter); every flag must
        exist in the parser."""
        unknown = [f for f in flags if f.startswith("--") and f not in self.flags]
        if unknown:
            raise StageFailed(f"{label}: flags not in pretrain_gpt.py's parser: {' '.join(unknown)}")
        env = dict(env_extra or {})
        if nproc == 1:
            cmd = [sys.executable, script]
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   script]
        cmd += ["--distributed-backend", self.backend, *flags]
        rc, output = self.command(label, cmd, timeout, self.env(env))
        if must_pass and rc != 0:
            raise StageFailed(f"{label}: pretrain_gpt.py exited with {rc}; tail:\n{_tail(output)}")
        return rc, output

    # -- driver ------------------------------------------------------------------------------------

    def run(self) -> int:
        wanted = set(self.args.stages.split(",")) if self.args.stages else set(STAGES)
        for name in STAGES:
            if name != "env" and name not in wanted:
                continue
            if name != "env" and self.stages.get("env", {}).get("status") != "passed":
                self._record(name, "failed", 0.0, "not run: the env stage failed")
                continue
            started = time.monotonic()
            cap = STAGE_CAPS_S[name] * self.budget / DEFAULT_BUDGET_S["gpu"]
            self.stage_deadline = min(self.deadline, started + cap)
            print(f"== stage {name}", flush=True)
            try:
                getattr(self, "stage_" + name)()
                status, detail = "passed", ""
            except StageSkipped as exc:
                status, detail = "skipped", str(exc)
            except StageFailed as exc:
                status, detail = "failed", str(exc)
            except Exception as exc:  # a bug in a stage must not stop the others
                status, detail = "failed", f"{type(exc).__name__}: {exc}"
            self._record(name, status, time.monotonic() - started, detail)
        self._summary()
        return 1 if any(s["status"] == "failed" for s in self.stages.values()) else 0

    def _record(self, name, status, seconds, detail):
        self.stages[name] = {"status": status, "seconds": round(seconds, 1), "detail": detail}
        print(f"stage {name}: {status} ({seconds:.0f} s){': ' + detail if detail else ''}", flush=True)
        self.write_json()

    def _summary(self):
        print("== figures")
        for name, f in self.figures.items():
            print(f"{name}: {f['value']} {f['unit']}")
        print("== stages")
        for name, s in self.stages.items():
            first_line = s["detail"].splitlines()[0] if s["detail"] else ""
            print(f"{name}: {s['status']} ({s['seconds']} s)" + (f" - {first_line}" if first_line else ""))
        print(f"log: {self.log_path}" + (f"; json: {self.out / 'gpu_check.json'}" if self.out else ""), flush=True)

    # -- stages ------------------------------------------------------------------------------------

    def stage_env(self):
        probe = ("import json, sys, torch\n"
                 "ok = torch.cuda.is_available()\n"
                 "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__,\n"
                 "  'cuda': torch.version.cuda, 'cuda_available': ok, 'gpus': torch.cuda.device_count() if ok else 0,\n"
                 "  'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else [],\n"
                 "  'capability': list(torch.cuda.get_device_capability(0)) if ok else None,\n"
                 "  'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if ok else None}))\n")
        probe += f"try:\n    {OTEL_PROBE}\nexcept Exception:\n    sys.exit(3)\n"  # 3: OpenTelemetry missing
        rc, out = self.command("env_probe", [sys.executable, "-c", probe], timeout=60)
        otel_present = rc == 0
        if rc not in (0, 3):
            raise StageFailed(f"python3 could not import torch:\n{_tail(out)}")
        facts = json.loads(out.strip().splitlines()[-1])
        for key in ("python", "torch", "cuda", "nccl"):
            self.note(key, facts[key])
        if not self.dry_run:
            if not facts["cuda_available"]:
                raise StageFailed("no CUDA GPU visible to PyTorch; on a machine without one use --dry-run")
            self.note("gpu", f"{facts['names'][0]} x{facts['gpus']} (compute capability "
                             f"{'.'.join(map(str, facts['capability']))})")
        self.gpus = facts["gpus"]
        self.figure("gpu_count", facts["gpus"], "GPUs")
        if self.args.peak_tflops:
            self.peak = self.args.peak_tflops
        elif self.dry_run:
            self.peak = DRY_RUN_PEAK_TFLOPS
        else:
            self.peak = peak_tflops_for(facts["names"][0])
            if self.peak is None:
                raise StageFailed(f"unknown dense bf16 peak for {facts['names'][0]!r}: pass --peak-tflops N")
        self.figure("peak_bf16_tflops", self.peak, "TFLOP/s")
        self._ensure_opentelemetry(otel_present)
        rc, out = self.command("help", [sys.executable, "pretrain_gpt.py", "--help"], timeout=60)
        if rc != 0:
            raise StageFailed(f"pretrain_gpt.py --help failed:\n{_tail(out)}")
        self.flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*[a-z0-9])", out))

    def _otel_importable(self) -> bool:
        return self.command("otel_probe", [sys.executable, "-c", OTEL_PROBE], timeout=60)[0] == 0

    def _ensure_opentelemetry(self, present: bool):
        """Install the carried wheels into a private folder on PYTHONPATH when OpenTelemetry is missing."""
        if present:
            self.note("opentelemetry", "installed")
            return
        wheels = sorted(Path(self.args.wheels).glob("*.whl"))
        if not wheels:
            self.note("opentelemetry", f"MISSING and no wheels in {self.args.wheels} "
                                       "(run bash bench/fetch_gpu_wheels.sh where PyPI is reachable and carry .whl)")
            return
        site = Path(self.args.site)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        rc, out = self.command("pip_install_wheels", cmd, timeout=120)
        if rc != 0:
            self.note("opentelemetry", f"MISSING: installing {len(wheels)} carried wheels failed: {_tail(out, 5)}")
            return
        self.pythonpath.append(str(site))
        if not self._otel_importable():
            self.note("opentelemetry", f"MISSING: carried wheels installed to {site} but do not import")
            return
        self.note("opentelemetry", f"from {len(wheels)} carried wheels in {site}")
        rc, out = self.command("wheel_requirements", [sys.executable, "bench/gpu_wheels.py", "check",
                                                      "--dest", str(self.args.wheels)], timeout=60)
        if rc != 0:
            self.note("wheel_requirements_unmet", out.strip().replace("\n", "; "))

    def stage_gpu_tests(self):
        report = self.work / "gpu_tests.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={report}",
               "tests/gpu"]
        rc, out = self.command("gpu_tests", cmd)
        if not report.exists():
            raise StageFailed(f"pytest wrote no report (exit {rc}):\n{_tail(out)}")
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
        failed = int(suite.get("failures")) + int(suite.get("errors"))
        passed = total - skipped - failed
        self.figure("gpu_tests_passed", passed, "tests")
        self.figure("gpu_tests_skipped", skipped, "tests")
        self.figure("gpu_tests_failed", failed, "tests")
        if total == 0:
            raise StageFailed("pytest collected no test under tests/gpu")
        if failed or rc != 0:
            raise StageFailed(f"{failed} GPU test(s) failed (pytest exit {rc}):\n{_tail(out, 40)}")
        if self.dry_run and passed:
            raise StageFailed(f"{passed} test(s) of tests/gpu ran without CUDA; they must skip")
        if not self.dry_run and not passed:
            raise StageFailed("every GPU test was skipped on a CUDA machine:\n" + _tail(out, 20))

    def _small_flags(self, m, iters, *extra, dropout=True, precision="bf16"):
        flags = model_flags(m, m["micro"], m["global_batch"], precision) + [
            "--train-iters", str(iters), "--num-workers", "0"]
        if not dropout:
            flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
        return flags + list(extra)

    def stage_resume(self):
        """Dropout on, so the restored CUDA RNG states matter as much as weights, Adam and data order. The
        checkpoint is torch_dist written with --async-save (host copy on a side CUDA stream, background
        write, finalised before the exit)."""
        m = small_model(self.dry_run)
        full = losses(self.pretrain("resume_full", 1, self._small_flags(m, m["iters"]))[1])
        self.reference_losses = full
        self._stop_and_resume("resume", 1, m, full, dropout=True)

    def _stop_and_resume(self, prefix, nproc, m, full, dropout):
        """Train ``m`` on ``nproc`` ranks to its ``half`` iteration with a torch_dist ``--async-save``
        checkpoint and exit, resume it to ``iters``; the resumed losses must be those of ``full``.
        Figures ``{prefix}_iterations_compared`` and ``{prefix}_max_rel_diff``."""
        n, half = m["iters"], m["half"]
        ckpt = self.work / f"ckpt_{prefix}"
        _, first = self.pretrain(f"{prefix}_first", nproc, self._small_flags(
            m, n, "--save", str(ckpt), "--save-interval", str(half), "--exit-interval", str(half),
            "--ckpt-format", "torch_dist", "--async-save", dropout=dropout))
        if f"exiting program at iteration {half}" not in first:
            raise StageFailed(f"the first run did not stop at iteration {half}")
        _, second = self.pretrain(f"{prefix}_second", nproc, self._small_flags(m, n, "--load", str(ckpt),
                                                                               dropout=dropout))
        resumed = losses(second)
        if sorted(resumed) != list(range(half + 1, n + 1)):
            raise StageFailed(f"resumed run logged iterations {sorted(resumed)}, expected {half + 1}..{n}")
        diff = max_relative_difference(resumed, full)
        self.figure(f"{prefix}_iterations_compared", len(resumed), "iterations")
        self.figure(f"{prefix}_max_rel_diff", float(f"{diff:.3g}"), "relative")
        if diff > RESUME_RTOL[self.device]:
            raise StageFailed(f"resumed losses {resumed} differ from the uninterrupted {full} by {diff:.3g} "
                              f"(tolerance {RESUME_RTOL[self.device]})")

    def stage_telemetry(self):
        if str(self.info.get("opentelemetry", "")).startswith("MISSING"):
            raise StageFailed(f"OpenTelemetry is not importable here: {self.info['opentelemetry']}")
        m = small_model(self.dry_run)
        n = m["iters"]
        env = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORTER": "console",
               "MEGATRON_OTEL_SPAN_GROUPS": "per_step,microbatch"}
        _, out = self.pretrain("telemetry", 1, self._small_flags(m, n), env_extra=env)
        records = []
        for line in out.splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        spans = [r for r in records if "name" in r and "context" in r]
        names = [s["name"] for s in spans]
        self.figure("telemetry_spans", len(spans), "spans")
        self.figure("telemetry_train_step_spans", names.count("megatron.train_step"), "spans")
        metric_text = json.dumps([r for r in records if "resource_metrics" in r])
        missing = [s for s in ("megatron.pretrain", "megatron.train", "megatron.forward_backward",
                               "megatron.optimizer_step") if s not in names]
        if missing:
            raise StageFailed(f"spans {missing} did not arrive ({len(spans)} spans in the output)")
        if names.count("megatron.train_step") != n:
            raise StageFailed(f"{names.count('megatron.train_step')} megatron.train_step spans for {n} iterations")
        if "megatron.training.loss" not in metric_text:
            raise StageFailed("metric megatron.training.loss did not arrive")
        if self.reference_losses is not None:  # telemetry must not change the numbers
            diff = max_relative_difference(losses(out), self.reference_losses)
            self.figure("telemetry_max_rel_loss_diff", float(f"{diff:.3g}"), "relative")
            if diff > RESUME_RTOL[self.device]:
                raise StageFailed(f"losses with telemetry on differ from the run without it by {diff:.3g}")

    def _mfu_flags(self, m, micro, extra=()):
        return model_flags(m, micro, micro * m["microbatches"]) + [
            "--train-iters", str(m["iters"]), "--log-throughput", "--hidden-dropout", "0",
            "--attention-dropout", "0", *extra]

    def _mfu_run(self, label, m, micro, extra=(), timeout=None):
        return self.pretrain(label, 1, self._mfu_flags(m, micro, extra), timeout=timeout, must_pass=False)

    def _mfu_figures(self, prefix, m, output):
        lines = parse_iterations(output)
        measured = [f for it, f in sorted(lines.items()) if it > m["warmup"]]
        if len(measured) < 2:
            raise StageFailed(f"only {len(measured)} iterations after the {m['warmup']} warm-up ones were logged")
        key = "throughput per GPU (TFLOP/s/GPU)"
        if any(key not in f for f in measured):
            raise StageFailed(f"the log line has no '{key}' field (is --log-throughput honoured?)")
        step_ms = statistics.median(f["elapsed time per iteration (ms)"] for f in measured)
        tokens = statistics.median(f["global batch size"] * m["seq"] / (f["elapsed time per iteration (ms)"] / 1e3)
                                   for f in measured)
        tflops = statistics.median(f[key] for f in measured)
        self.figure(f"{prefix}_step_time_ms", round(step_ms, 1), "ms")
        self.figure(f"{prefix}_tokens_per_sec", round(tokens), "tokens/s")
        self.figure(f"{prefix}_tflops_per_gpu", round(tflops, 1), "TFLOP/s")
        self.figure(prefix, round(100.0 * tflops / self.peak, 1), "%")

    def _largest_fitting(self, label, m, candidates, extra=()):
        """Run the MFU model at each micro-batch size of ``candidates`` until one does not run out of
        memory. Returns ``(micro_batch_size, output)``; StageFailed on any other failure."""
        for micro in candidates:
            rc, out = self._mfu_run(f"{label}_mbs{micro}", m, micro, extra)
            if rc == 0:
                return micro, out
            if "out of memory" not in out.lower() and "OutOfMemoryError" not in out:
                raise StageFailed(f"micro-batch {micro}: pretrain_gpt.py exited with {rc}; tail:\n{_tail(out)}")
            print(f"micro-batch {micro}: out of memory, trying a smaller one", flush=True)
        raise StageFailed(f"every micro-batch size ran out of memory: {list(candidates)}")

    def stage_mfu(self):
        m = mfu_model(self.dry_run)
        micro, out = self._largest_fitting("mfu", m, m["micro"])
        self.mfu_micro = micro
        params = _PARAMS.search(out)
        self.figure("mfu_model_params", int(params.group(1)) if params else None, "parameters")
        self.figure("mfu_micro_batch_size", micro, "samples")
        self.figure("mfu_global_batch_size", micro * m["microbatches"], "samples")
        self._mfu_figures("mfu", m, out)
        # The memory report's prediction (weights, optimizer and activations) and, on CUDA, the
        # allocator's peak as printed after the first iteration (before Adam's states exist).
        theory = _MEMORY_TOTAL.search(out)
        self.figure("mfu_theoretical_activation_mb", float(theory.group(1)) if theory else None, "MB")
        self.figure("mfu_theoretical_total_mb", float(theory.group(2)) if theory else None, "MB")
        if not self.dry_run:
            peak = _MEASURED_PEAK.search(out)
            self.figure("mfu_max_allocated_first_iteration_mb", float(peak.group(1)) if peak else None, "MB")
        if theory is None:
            raise StageFailed("the memory report printed no activation figure")

    def stage_mfu_fused(self):
        """The MFU run with cuDNN fused attention (``--attention-backend fused``) at the mfu stage's size."""
        if self.dry_run:
            raise StageSkipped("dry-run: --attention-backend fused is a CUDA kernel")
        m = mfu_model(False)
        candidates = [self.mfu_micro] if self.mfu_micro else m["micro"]
        micro, out = self._largest_fitting("mfu_fused", m, candidates, ["--attention-backend", "fused"])
        self.figure("mfu_fused_micro_batch_size", micro, "samples")
        self._mfu_figures("mfu_fused", m, out)

    def stage_profile(self):
        """A few iterations of the MFU model under torch.profiler: the top 25 kernels by device time."""
        m = dict(mfu_model(self.dry_run), iters=4)
        micro = self.mfu_micro or m["micro"][-1]
        table = (self.out or self.work) / "kernels.txt"
        _, out = self.pretrain("profile", 1, self._mfu_flags(m, micro), env_extra={"KERNEL_TABLE": str(table)},
                               script="bench/profile_kernels.py")
        if not table.is_file():
            raise StageFailed(f"bench/profile_kernels.py wrote no {table}:\n{_tail(out)}")
        # Under the two comment lines and the header: the rows, between dashed rules, then "Self ... total".
        rows = [line for line in table.read_text().splitlines()[5:]
                if line.strip() and not line.startswith(("-", "Self "))]
        self.note("kernel_table", str(table))
        self.figure("profile_table_rows", len(rows), "rows")
        self.figure("profile_table_bytes", table.stat().st_size, "bytes")

    def stage_parallel(self):
        if not self.dry_run and self.gpus < 2:
            raise StageSkipped(f"TP=2 and DP=2 need 2 GPUs; this machine has {self.gpus}")
        m = small_model(self.dry_run)
        n = m["iters"]
        diffs = {}
        for precision in ("fp32", "bf16"):
            base_out = self.pretrain(f"parallel_1gpu_{precision}", 1,
                                     self._small_flags(m, n, dropout=False, precision=precision))[1]
            base = losses(base_out)
            runs = {"tp2": losses(self.pretrain(f"parallel_tp2_{precision}", 2, self._small_flags(
                m, n, "--tensor-model-parallel-size", "2", dropout=False, precision=precision))[1])}
            if precision == "bf16":
                self.parallel_runs["base"] = base
                self.parallel_runs["base_out"] = base_out
                self.parallel_runs["dp2"] = self.pretrain("parallel_dp2", 2, self._small_flags(m, n, dropout=False))[1]
                runs["dp2"] = losses(self.parallel_runs["dp2"])
            for name, got in runs.items():
                if sorted(got) != list(range(1, n + 1)):
                    raise StageFailed(f"{name} ({precision}) logged iterations {sorted(got)}, expected 1..{n}")
                diffs[f"{name}_{precision}"] = max_relative_difference(got, base)
        self.figure("parallel_iterations_compared", n, "iterations")
        for key, diff in diffs.items():
            self.figure(f"{key}_max_rel_loss_diff", float(f"{diff:.3g}"), "relative")
        failed = [f"{key} {diff:.3g} > {PARALLEL_RTOL[key.rsplit('_', 1)[1]]}" for key, diff in diffs.items()
                  if diff > PARALLEL_RTOL[key.rsplit("_", 1)[1]]]
        if failed:
            raise StageFailed(f"losses differ from one GPU: {'; '.join(failed)}")

    def stage_parallel_pp(self):
        """PP=2 (1F1B, p2p over NCCL): bf16 losses of one GPU."""
        if not self.dry_run and self.gpus < 2:
            raise StageSkipped(f"PP=2 needs 2 GPUs; this machine has {self.gpus}")
        m = small_model(self.dry_run)
        n = m["iters"]
        base = self.parallel_runs.get("base") or losses(
            self.pretrain("parallel_pp_1gpu", 1, self._small_flags(m, n, dropout=False))[1])
        pp2 = losses(self.pretrain("parallel_pp2", 2, self._small_flags(
            m, n, "--pipeline-model-parallel-size", "2", dropout=False))[1])
        if sorted(pp2) != list(range(1, n + 1)):
            raise StageFailed(f"pp2 logged iterations {sorted(pp2)}, expected 1..{n}")
        diff = max_relative_difference(pp2, base)
        self.figure("parallel_pp_iterations_compared", n, "iterations")
        self.figure("pp2_max_rel_loss_diff", float(f"{diff:.3g}"), "relative")
        if diff > PARALLEL_RTOL["bf16"]:
            raise StageFailed(f"PP=2 losses differ from one GPU by {diff:.3g} (bf16 tolerance {PARALLEL_RTOL['bf16']})")

    def stage_parallel_cp(self):
        """Context parallelism (CP=2, each sequence split in 4 load-balanced chunks) with each
        --cp-comm-type: bf16 losses of one GPU and tokens/s against one GPU (same model and batch)."""
        if not self.dry_run and self.gpus < 2:
            raise StageSkipped(f"CP=2 needs 2 GPUs; this machine has {self.gpus}")
        m = small_model(self.dry_run)
        n = m["iters"]
        base_out = self.parallel_runs.get("base_out") or self.pretrain(
            "parallel_cp_1gpu", 1, self._small_flags(m, n, dropout=False))[1]
        base = losses(base_out)
        base_tokens = m["global_batch"] * m["seq"] / (_median_step_ms(base_out) / 1e3)
        failed = []
        for comm_type in CP_COMM_TYPES:
            _, out = self.pretrain(f"parallel_cp2_{comm_type}", 2, self._small_flags(
                m, n, "--context-parallel-size", "2", "--cp-comm-type", comm_type, dropout=False))
            got = losses(out)
            if sorted(got) != list(range(1, n + 1)):
                raise StageFailed(f"cp2 {comm_type} logged iterations {sorted(got)}, expected 1..{n}")
            diff = max_relative_difference(got, base)
            tokens = m["global_batch"] * m["seq"] / (_median_step_ms(out) / 1e3)
            self.figure(f"cp2_{comm_type}_max_rel_loss_diff", float(f"{diff:.3g}"), "relative")
            self.figure(f"cp2_{comm_type}_tokens_per_sec", round(tokens), "tokens/s")
            self.figure(f"cp2_{comm_type}_tokens_per_sec_ratio_to_1gpu", round(tokens / base_tokens, 3), "ratio")
            if diff > PARALLEL_RTOL["bf16"]:
                failed.append(f"{comm_type} {diff:.3g}")
        self.figure("parallel_cp_iterations_compared", n, "iterations")
        if failed:
            raise StageFailed(f"CP=2 losses differ from one GPU by more than {PARALLEL_RTOL['bf16']} (bf16): "
                              f"{'; '.join(failed)}")

    def stage_dp_distopt(self):
        """The distributed optimizer with both overlaps: bf16 losses of one GPU, step time against plain DP=2."""
        if not self.dry_run and self.gpus < 2:
            raise StageSkipped(f"DP=2 needs 2 GPUs; this machine has {self.gpus}")
        m = small_model(self.dry_run)
        n = m["iters"]
        base = self.parallel_runs.get("base") or losses(
            self.pretrain("dp_distopt_1gpu", 1, self._small_flags(m, n, dropout=False))[1])
        _, out = self.pretrain("dp_distopt", 2, self._small_flags(
            m, n, "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", dropout=False))
        got = losses(out)
        if sorted(got) != list(range(1, n + 1)):
            raise StageFailed(f"dp_distopt logged iterations {sorted(got)}, expected 1..{n}")
        diff = max_relative_difference(got, base)
        self.figure("dp_distopt_max_rel_loss_diff", float(f"{diff:.3g}"), "relative")
        report = _MEMORY_REPORT.search(out)
        self.figure("dp_distopt_weight_and_optimizer_mb", float(report.group(1)) if report else None, "MB")
        step_ms = _median_step_ms(out)
        self.figure("dp_distopt_step_time_ms", round(step_ms, 1), "ms")
        if "dp2" in self.parallel_runs:
            ratio = step_ms / _median_step_ms(self.parallel_runs["dp2"])
            self.figure("dp_distopt_step_time_ratio_to_dp2", round(ratio, 3), "ratio")
        if diff > PARALLEL_RTOL["bf16"]:
            raise StageFailed(f"DP=2 distributed-optimizer losses differ from one GPU by {diff:.3g} "
                              f"(bf16 tolerance {PARALLEL_RTOL['bf16']})")
        if report is None:
            raise StageFailed("no 'Theoretical memory footprints' line in the output")

    def stage_async_save_2gpu(self):
        """DP=2 stopped at a --async-save torch_dist checkpoint and resumed: the losses of the uninterrupted
        DP=2 run. Rank 1's background copy runs on cuda:1, where a staging thread on the wrong device
        let the files be written before the copies landed."""
        if not self.dry_run and self.gpus < 2:
            raise StageSkipped(f"a 2-GPU --async-save needs 2 GPUs; this machine has {self.gpus}")
        m = small_model(self.dry_run)
        full_out = self.parallel_runs.get("dp2") or self.pretrain(
            "async_save_2gpu_full", 2, self._small_flags(m, m["iters"], dropout=False))[1]
        self._stop_and_resume("async_save_2gpu", 2, m, losses(full_out), dropout=False)

    def stage_mfu_compile(self):
        if "--compile-transformer-layers" not in self.flags:
            raise StageSkipped("pretrain_gpt.py has no --compile-transformer-layers flag")
        if self.dry_run:
            raise StageSkipped("dry-run: torch.compile on the CPU takes minutes on a small machine")
        m = dict(mfu_model(False), iters=12, warmup=4)  # the first iterations compile
        # The micro-batch the mfu stage chose (the same work, so the two figures compare), or a search
        # of its own when the mfu stage did not run (--stages mfu_compile).
        candidates = [self.mfu_micro] if self.mfu_micro else m["micro"]
        micro, out = self._largest_fitting("mfu_compile", m, candidates, ["--compile-transformer-layers"])
        self.figure("mfu_compile_micro_batch_size", micro, "samples")
        self._mfu_figures("mfu_compile", m, out)


def _kill_group(proc) -> None:
    """SIGTERM the child's process group (torchrun and its workers), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _median_step_ms(text: str) -> float:
    """Median ``elapsed time per iteration (ms)`` of the log lines after the first (which compiles kernels)."""
    times = [f["elapsed time per iteration (ms)"] for it, f in sorted(parse_iterations(text).items()) if it > 1]
    if not times:
        raise StageFailed("no log line after the first iteration")
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU only: tiny models over gloo, tests/gpu skipped; proves the script works")
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--peak-tflops", type=float,
                        help="dense bf16 peak of one GPU in TFLOP/s (default: from the GPU name; H100/H200 989, "
                             "A100 312); required for other GPUs")
    parser.add_argument("--time-budget", type=float,
                        help="seconds for all stages together (default 540, 1500 with --dry-run); each stage "
                             "also has its own cap, scaled with this budget")
    parser.add_argument("--stages", help=f"comma-separated subset of {','.join(STAGES[1:])} (env always runs)")
    parser.add_argument("--wheels", default=str(REPO / ".whl"),
                        help="folder of carried wheels installed when OpenTelemetry is missing (default .whl/)")
    parser.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "megatron_gpu_site"),
                        help="where the carried wheels are installed (pip --target)")
    parser.add_argument("--work-dir", help="parent folder of the scratch folder (checkpoints, outputs)")
    parser.add_argument("--keep-work-dir", action="store_true", help="keep the scratch folder for inspection")
    args = parser.parse_args(argv)
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.stages and set(args.stages.split(",")) - set(STAGES):
        parser.error(f"--stages: unknown stage(s) {sorted(set(args.stages.split(',')) - set(STAGES))}; "
                     f"stages are {','.join(STAGES[1:])}")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget must be positive, got {args.time_budget}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    check = GPUCheck(args)
    try:
        return check.run()
    finally:
        if args.keep_work_dir:
            print(f"scratch folder kept: {check.work}")
        else:
            shutil.rmtree(check.work, ignore_errors=True)

if __name__ == "__main__":
    sys.exit(main())
