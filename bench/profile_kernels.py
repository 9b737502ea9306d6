"""Run pretrain_gpt.py under torch.profiler and write its top kernels by device time as one small table.

Used by bench/gpu_check.py's ``profile`` stage: ``KERNEL_TABLE=FILE python bench/profile_kernels.py
<pretrain_gpt.py flags>``. The whole run is profiled (set up, a few iterations): at the kit's
1.3B size the iterations dominate the device time. On a GPU the table lists CUDA kernels (and
copies) sorted by their own device time; without CUDA it lists CPU operators by their own CPU time
(the dry run, which proves the script works). ``KERNEL_TABLE_ROWS`` sets the rows (default 25).
Rank 0 writes the file; the exit status is pretrain_gpt.py's.
"""
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_gpt  # noqa: E402


def kernel_table(prof, rows: int, cuda: bool) -> str:
    """The profiler's table of the ``rows`` entries with the most self time on the device (or CPU)."""
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=80)


def main() -> int:
    target = Path(os.environ["KERNEL_TABLE"])
    rows = int(os.environ.get("KERNEL_TABLE_ROWS", "25"))
    cuda = torch.cuda.is_available()
    status = 0
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
        try:
            pretrain_gpt.main()
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    if os.environ.get("RANK", "0") == "0":
        device = torch.cuda.get_device_name() if cuda else "CPU (operators, not kernels)"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"# top {rows} by self {'device' if cuda else 'CPU'} time: {device}, torch "
                          f"{torch.__version__}\n# pretrain_gpt.py {' '.join(sys.argv[1:])}\n"
                          + kernel_table(prof, rows, cuda) + "\n")
        print(f"kernel table written to {target}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
