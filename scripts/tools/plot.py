"""Plot any run's metrics.jsonl to a PNG.

    python scripts/tools/plot.py runs/grpo                               # default keys, runs/grpo/curves.png
    python scripts/tools/plot.py runs/a runs/b --keys eval/accuracy objective/scores --x time -o cmp.png

Each key gets a panel; each run directory (or metrics.jsonl path) a line. --x is `step`, `episode` or `time`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_KEYS = ["eval/accuracy", "objective/scores", "objective/entropy", "val/sequence_lengths"]


def read(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories or metrics.jsonl files")
    p.add_argument("--keys", nargs="+", default=DEFAULT_KEYS, help="metrics to plot, one panel each")
    p.add_argument("--x", default="step", help="x axis: step, episode or time")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: <first run>/curves.png)")
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {str(r): read(r) for r in args.runs}
    keys = [k for k in args.keys if any(k in row for rows in data.values() for row in rows)]
    if not keys:
        raise SystemExit(f"none of {args.keys} is in the given runs")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, rows in data.items():
            pts = [(row[args.x], row[key]) for row in rows if key in row and args.x in row and row[key] is not None]
            if pts:
                ax.plot(*zip(*pts), label=Path(name).name, marker="." if len(pts) < 40 else None)
        ax.set_title(key)
        ax.set_xlabel(args.x)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out = args.output or (args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent) / "curves.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
