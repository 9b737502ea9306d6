"""In-rank harness of the peak-memory benchmark: runs a training script here; peak RSS, heap held between steps.

Run as a torchrun rank by ``bench_peak_memory.py`` (``python bench/peak_rank.py SCRIPT <flags>``). SCRIPT
(``pretrain_gpt.py`` of this checkout or of an older one, whose folder comes first on ``sys.path`` and
so provides the ``megatron`` package) runs under ``runpy`` as ``__main__``. Nothing of the project is
imported here before the script, so the same harness measures any commit.

Recorded, written at exit to ``$PEAK_OUT/rank<R>.json`` (ranks share stdout, where lines interleave):

* ``vm_hwm_mib``: the kernel's high-water mark of this process's resident set (``VmHWM`` of
  ``/proc/self/status``), i.e. the peak RSS; ``ru_maxrss_mib`` the same from ``getrusage`` as a check;
* ``held_mib``: after each ``train_step`` returns (between two steps), the bytes glibc's malloc has
  handed out and not had back (``mallinfo2``: ``uordblks + hblkhd``). Whatever a step leaves alive
  for the next (a loss still holding its graph, logits, saved activations) shows here as a step
  up from the plain loop's figure; unlike RSS it does not count freed memory the allocator keeps.
  ``hwm_after_step_mib``: the peak RSS so far, after each step (where the peak was reached).
  Both empty where ``megatron.training.training.train_step`` does not exist; NaN without ``mallinfo2``.
* with ``PEAK_TRACE_OPS=1``, ``op_peaks``: per step, the peak heap in use and peak RSS seen after each
  aten op (:class:`OpPeakTracer`), with the op and project frames where the heap peaked.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import resource
import runpy
import sys
from pathlib import Path


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's ``mallinfo2`` (glibc >= 2.33) as a callable, or None."""
    try:
        libc = ctypes.CDLL(None)
        func = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    func.restype = _Mallinfo2
    return func


_MALLINFO2 = _mallinfo2()


def heap_in_use_mib() -> float:
    """Bytes malloc has handed out and not had back (all arenas and mmapped blocks), MiB; NaN without mallinfo2."""
    if _MALLINFO2 is None:
        return float("nan")
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / 2**20


def peak_rss_mib() -> dict:
    """``{"vm_hwm_mib", "vm_rss_mib", "ru_maxrss_mib"}`` of this process (Linux: kB in both sources)."""
    out = {"ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[f"{key.lower()[:2]}_{key.lower()[2:]}_mib"] = int(value.split()[0]) / 1024
    return out


class OpPeakTracer:
    """Heap in use and RSS after every aten op of a step (a ``TorchDispatchMode``): the step's peaks and where.

    Diagnostic (``PEAK_TRACE_OPS=1``; a step runs several times slower). Unlike the peak RSS, the
    peak of the heap in use does not depend on what the allocator keeps of freed memory, so two
    commits that hold the same tensors at the same moments give the same figure. The peak inside one
    op (its temporaries) is not seen, the same for every run.
    """

    def __init__(self):
        import torch.utils._python_dispatch as dispatch

        tracer = self

        class Mode(dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracer.sample(str(func))
                return out

        self.mode = Mode()
        self.peak = {}

    def sample(self, op: str) -> None:
        in_use = heap_in_use_mib()
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        if rss > self.peak["rss_mib"]:
            self.peak.update(rss_mib=rss, in_use_at_rss_peak_mib=in_use)
        if in_use > self.peak["in_use_mib"]:
            import traceback

            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-2]
                      if "megatron" in f.filename or "pretrain_gpt" in f.filename or "bench_peak" in f.filename]
            self.peak.update(in_use_mib=in_use, op=op, frames=frames[-4:])

    def step(self, run):
        """``(run(), {"in_use_mib", "op", "frames", "rss_mib", "in_use_at_rss_peak_mib"})`` of one step."""
        self.peak = {"in_use_mib": 0.0, "op": "", "frames": [], "rss_mib": 0.0, "in_use_at_rss_peak_mib": 0.0}
        with self.mode:
            result = run()
        return result, self.peak


def main(argv) -> None:
    script = Path(argv[0]).resolve()
    sys.path.insert(0, str(script.parent))
    record = {"rank": int(os.environ.get("RANK", "0")), "held_mib": [], "hwm_after_step_mib": [], "op_peaks": []}

    import megatron.training.training as training  # the script's checkout (first on sys.path)

    inner = getattr(training, "train_step", None)
    tracer = OpPeakTracer() if os.environ.get("PEAK_TRACE_OPS", "0") == "1" else None
    if inner is not None:
        def measured_train_step(*args, **kwargs):
            if tracer is None:
                result = inner(*args, **kwargs)
            else:
                result, peak = tracer.step(lambda: inner(*args, **kwargs))
                record["op_peaks"].append(peak)
            record["held_mib"].append(heap_in_use_mib())
            record["hwm_after_step_mib"].append(peak_rss_mib()["vm_hwm_mib"])
            return result

        training.train_step = measured_train_step  # train() looks the name up at each call

    def report():
        record.update(peak_rss_mib())
        Path(os.environ["PEAK_OUT"], f"rank{record['rank']}.json").write_text(json.dumps(record))

    atexit.register(report)
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
