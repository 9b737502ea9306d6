"""Compare the `lm loss` values of Megatron log lines between runs (used by the example scripts).

    python examples/compare_logs.py same A.log B.log [--rtol 1e-5] [--from-iteration N]
    python examples/compare_logs.py final-loss A.log --iteration 300 --below 5.6
Exits 1 with the first disagreeing iteration when a check fails.
"""
import argparse
import re
import sys

# Searched in the whole text, not line by line, and never across a line break: a log line still counts
# when another process's output shares its line (several ranks, one stdout).
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|[^\n]*? lm loss: ([0-9.Ee+-]+) \|")


def read_losses(path):
    """{iteration: lm loss} from the periodic log lines of a training log."""
    with open(path, encoding="utf-8", errors="replace") as f:
        losses = {int(match.group(1)): float(match.group(2)) for match in _LINE.finditer(f.read())}
    if not losses:
        sys.exit(f"{path}: no 'iteration ... lm loss' log lines found")
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    same = sub.add_parser("same")
    same.add_argument("a")
    same.add_argument("b")
    same.add_argument("--rtol", type=float, default=1e-5)
    same.add_argument("--from-iteration", type=int, default=0)
    final = sub.add_parser("final-loss")
    final.add_argument("log")
    final.add_argument("--iteration", type=int, required=True)
    final.add_argument("--below", type=float, required=True)
    args = parser.parse_args()

    if args.command == "final-loss":
        losses = read_losses(args.log)
        if args.iteration not in losses:
            sys.exit(f"{args.log}: iteration {args.iteration} was not logged")
        value = losses[args.iteration]
        print(f"lm loss at iteration {args.iteration}: {value:.6f} (target < {args.below})")
        sys.exit(0 if value < args.below else 1)

    a, b = read_losses(args.a), read_losses(args.b)
    common = sorted(i for i in set(a) & set(b) if i >= args.from_iteration)
    if not common:
        sys.exit("no common logged iterations to compare")
    worst = 0.0
    for it in common:
        rel = abs(a[it] - b[it]) / max(abs(a[it]), 1e-30)
        worst = max(worst, rel)
        if rel > args.rtol:
            print(f"iteration {it}: {a[it]!r} vs {b[it]!r} (relative difference {rel:.3e} > {args.rtol})")
            sys.exit(1)
    print(f"{len(common)} logged iterations agree (max relative difference {worst:.3e}, rtol {args.rtol})")


if __name__ == "__main__":
    main()
