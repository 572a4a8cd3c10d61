"""Experiment (not a test): PPO vs VinePPO head to head: same warm start, seeds and episode budget.

    python scripts/experiments/compare_ppo_vineppo.py --seeds 1 2 3                      # built-in task on CPU
    python scripts/experiments/compare_ppo_vineppo.py --seeds 1 2 3 --extra --total_episodes 51200   # flags for both scripts

Runs alternate (ppo seed 1, vineppo seed 1, ppo seed 2, ...) so that machine load affects both alike. Writes
`<out>/{ppo,vineppo}_seed<k>/metrics.jsonl`, a PNG of held-out accuracy against gradient steps and against
wall-clock time (mean over seeds, min-max band), and `<out>/summary.json` with, per seed, PPO's final
accuracy and the number of optimizer steps each method needed to first reach it (the VinePPO paper's
"fewer gradient updates" claim: target VinePPO <= 1/3 of PPO's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the micro-batch and checkpointing of the stored runs (the scripts' defaults until 2026-11-26); --extra overrides them
PINNED = ["--local_micro_batch_size", "256", "--no_gradient_checkpointing"]


def read(run: Path) -> tuple[list[tuple[int, float, float]], dict]:
    """[(step, seconds since start, eval/accuracy)] and the run's args."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    args = json.loads((run / "args.json").read_text())
    return [(r["step"], r["time"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r], args


def optimizer_steps(step: int, args: dict) -> int:
    """Gradient updates after `step` rollout steps: epochs x minibatches per step."""
    return step * args.get("num_iterations", args.get("num_ppo_epochs")) * args["num_minibatches"]


def steps_to_reach(curve, target: float, args: dict) -> int | None:
    for step, _, acc in curve:
        if acc >= target:
            return optimizer_steps(step, args)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=Path("runs/compare_ppo_vineppo"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to both scripts")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    provenance = {"env": bc.environment(), "command": bc.invocation()}  # at the start: env.time is the start time
    args.out.mkdir(parents=True, exist_ok=True)

    for seed in args.seeds:
        for algo in ("ppo", "vineppo"):
            run = args.out / f"{algo}_seed{seed}"
            if (run / "metrics.jsonl").exists() and any('"time/total"' in x for x in open(run / "metrics.jsonl")):
                continue  # finished earlier: reuse
            cmd = [sys.executable, str(ROOT / f"algorithms/{algo}.py"), "--seed", str(seed), "--output_dir", str(run),
                   *PINNED, *args.extra]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)

    summary = {**provenance, "seeds": args.seeds, "per_seed": []}
    curves = {algo: [read(args.out / f"{algo}_seed{s}") for s in args.seeds] for algo in ("ppo", "vineppo")}
    for i, seed in enumerate(args.seeds):
        (ppo, ppo_args), (vine, vine_args) = curves["ppo"][i], curves["vineppo"][i]
        target = ppo[-1][2]
        row = {"seed": seed, "ppo_final_accuracy": target, "vineppo_final_accuracy": vine[-1][2],
               "initial_accuracy": ppo[0][2], "ppo_steps_to_target": steps_to_reach(ppo, target, ppo_args),
               "vineppo_steps_to_target": steps_to_reach(vine, target, vine_args),
               "ppo_seconds": ppo[-1][1], "vineppo_seconds": vine[-1][1]}
        if row["vineppo_steps_to_target"] is not None:
            row["step_ratio"] = row["vineppo_steps_to_target"] / row["ppo_steps_to_target"]
        summary["per_seed"].append(row)
    ratios = [r["step_ratio"] for r in summary["per_seed"] if "step_ratio" in r]
    summary["median_step_ratio"] = statistics.median(ratios) if ratios else None
    summary["seeds_where_vineppo_reached_ppo_final"] = len(ratios)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for algo, color in (("ppo", "tab:blue"), ("vineppo", "tab:orange")):
        runs = curves[algo]
        n = min(len(c) for c, _ in runs)
        xs_steps = [optimizer_steps(runs[0][0][k][0], runs[0][1]) for k in range(n)]
        xs_time = [statistics.mean(c[k][1] for c, _ in runs) / 60 for k in range(n)]
        accs = [[c[k][2] for c, _ in runs] for k in range(n)]
        mean = [statistics.mean(a) for a in accs]
        for ax, xs in ((axes[0], xs_steps), (axes[1], xs_time)):
            ax.plot(xs, mean, color=color, label=f"{algo} ({len(runs)} seeds)")
            ax.fill_between(xs, [min(a) for a in accs], [max(a) for a in accs], color=color, alpha=0.2)
    axes[0].set_xlabel("gradient steps")
    axes[1].set_xlabel("wall-clock minutes (mean over seeds)")
    for ax in axes:
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(args.out / "ppo_vs_vineppo.png", dpi=120)
    print(args.out / "ppo_vs_vineppo.png")


if __name__ == "__main__":
    main()
