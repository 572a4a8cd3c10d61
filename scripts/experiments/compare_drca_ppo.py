"""Experiment (not a test): DRCA vs PPO head to head: same warm start, same reward model, same seeds and budget.

    python scripts/experiments/compare_drca_ppo.py --seeds 1 2 3                          # built-in task on CPU
    python scripts/experiments/compare_drca_ppo.py --seeds 1 2 3 --extra --total_episodes 51200   # flags for both arms
    python scripts/experiments/compare_drca_ppo.py --out runs/drca_cf_rm --results docs/results/drca_vs_ppo.json \
        --plot docs/img/drca_vs_ppo_cf_rm.png --extra --reward_model_path builtin:tiny-cf-rm --counterfactual mask

The PPO arm is `algorithms/drca.py --drca_beta 0`: with beta = 0 the per-token reward is exactly ppo_rlhf.py's
reward (R on the last token, minus eta * k1; tests/test_drca.py checks it against ppo_rlhf.py), and no
counterfactual RM call is made. Everything else (critic initialised from the RM, clipping, GAE, whitening,
learning rates, sampling seeds) is identical, so the comparison isolates the credit assignment.
Runs alternate (ppo seed 1, drca seed 1, ppo seed 2, ...) so that machine load affects both alike. Writes
`<out>/{ppo,drca}_seed<k>/metrics.jsonl`, `<out>/drca_vs_ppo.png` (held-out grader accuracy and held-out RM reward
against steps, mean over seeds with a min-max band) and `<out>/summary.json` (also to --plot and --results if given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {"ppo": ["--drca_beta", "0"], "drca": []}
# the micro-batch and checkpointing of the stored runs (drca.py's defaults until 2026-11-26), and their scorer, the
# reward model (drca.py's default until --scorer auto made the per-line grader score the built-in task); --extra
# overrides them (`--extra --scorer line_grader`)
PINNED = ["--local_micro_batch_size", "256", "--no_gradient_checkpointing", "--scorer", "rm"]


def read(run: Path) -> list[dict]:
    """The evaluation rows of a run: step, seconds since start, eval/accuracy, eval/reward."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/reward" in r]


def finished(run: Path) -> bool:
    return (run / "metrics.jsonl").exists() and any('"time/total"' in x for x in open(run / "metrics.jsonl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=Path("runs/compare_drca_ppo"))
    p.add_argument("--results", type=Path, default=None, help="also write the summary here (e.g. docs/results/...)")
    p.add_argument("--plot", type=Path, default=None, help="also write the plot here (e.g. docs/img/...)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to both arms")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    provenance = {"env": bc.environment(), "command": bc.invocation()}  # at the start: env.time is the start time
    args.out.mkdir(parents=True, exist_ok=True)

    for seed in args.seeds:
        for arm, flags in ARMS.items():
            run = args.out / f"{arm}_seed{seed}"
            if finished(run):
                continue  # finished earlier: reuse
            cmd = [sys.executable, str(ROOT / "algorithms/drca.py"), "--seed", str(seed), "--output_dir", str(run),
                   "--exp_name", arm, "--no_save_model", *PINNED, *flags, *args.extra]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)

    curves = {arm: [read(args.out / f"{arm}_seed{s}") for s in args.seeds] for arm in ARMS}
    provenance["env"]["builtin_models"] = bc.builtin_models()  # the start model and RMs the runs used
    summary: dict = {**provenance, "seeds": args.seeds, "pinned": PINNED, "extra": args.extra, "per_seed": []}
    for i, seed in enumerate(args.seeds):
        row = {"seed": seed}
        for arm in ARMS:
            c = curves[arm][i]
            row.update({f"{arm}_initial_accuracy": c[0]["eval/accuracy"], f"{arm}_final_accuracy": c[-1]["eval/accuracy"],
                        f"{arm}_initial_reward": c[0]["eval/reward"], f"{arm}_final_reward": c[-1]["eval/reward"],
                        f"{arm}_minutes": c[-1]["time/total"] / 60})
        summary["per_seed"].append(row)
    for arm in ARMS:
        for key in ("final_accuracy", "final_reward", "minutes"):
            vals = [r[f"{arm}_{key}"] for r in summary["per_seed"]]
            summary[f"{arm}_{key}"] = {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals)}
    diffs = [r["drca_final_accuracy"] - r["ppo_final_accuracy"] for r in summary["per_seed"]]
    summary["drca_minus_ppo_final_accuracy"] = {"mean": statistics.mean(diffs), "per_seed": diffs}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, color in (("ppo", "tab:blue"), ("drca", "tab:red")):
        runs = curves[arm]
        n = min(len(c) for c in runs)
        xs = [runs[0][k]["step"] for k in range(n)]
        for ax, key in ((axes[0], "eval/accuracy"), (axes[1], "eval/reward")):
            vals = [[c[k][key] for c in runs] for k in range(n)]
            label = "PPO (drca.py --drca_beta 0)" if arm == "ppo" else "DRCA (beta 0.8)"
            ax.plot(xs, [statistics.mean(v) for v in vals], color=color, label=f"{label}, {len(runs)} seeds")
            ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.2)
    axes[0].set_ylabel("held-out grader accuracy")
    axes[1].set_ylabel("held-out RM reward (normalised)")
    for ax in axes:
        ax.set_xlabel("rollout steps")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    for png in [args.out / "drca_vs_ppo.png"] + ([args.plot] if args.plot else []):
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=120)
        print(png)


if __name__ == "__main__":
    main()
