"""The RePULSe toy experiment (paper Sec. 4.2 in small): REINFORCE, reward-transformed REINFORCE and RePULSe
at equal numbers of samples, several seeds, exact log P(bad) of p_theta after every step.

    python scripts/repulse_toy.py                                   # 3 methods x seeds 1 2 3, CPU
    python scripts/repulse_toy.py --methods reinforce repulse p_proposal --seeds 1 2 3 4 5
    python scripts/repulse_toy.py --extra --total_episodes 100000   # flags passed to every run

Every run is `algorithms/repulse.py` with the method's flags (below) plus the common ones; "samples" counts
every completion drawn for training (RePULSe draws N from p and N from q per step, so it makes half as many
p updates: the paper's compute matching). Writes `<out>/<method>_seed<k>/metrics.jsonl`, a PNG with exact
log P(bad) and average training reward against samples (mean over seeds, min-max band), and a summary JSON
(final exact log P(bad) and held-out mean reward per seed and method, and the paper's target: RePULSe's
final log P(bad) at least 1 nat below REINFORCE's with average reward within 5%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "reinforce": ["--loss_type", "reinforce", "--alpha", "0"],
    "reward_transform": ["--loss_type", "reinforce", "--reward_transform", "minus_alpha_exp_beta_r", "--alpha", "1",
                         "--target_dist_beta", "-1"],  # r - e^{-r}, as the paper's toy
    "repulse": [],  # the script's defaults: beta -10, alpha as set there, q and p learning rates
    "p_proposal": ["--use_base_as_proposal"],
}
COMMON = ["--total_episodes", "15000", "--eval_every", "0", "--sample_every", "0", "--no_save_model"]
LABELS = {"reinforce": "REINFORCE (RLOO)", "reward_transform": "REINFORCE, r - exp(-r)", "repulse": "RePULSe",
          "p_proposal": "RePULSe, p as proposal"}


def read(run: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "exact/log_p_bad" in r and "episode" in r], rows[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["reinforce", "reward_transform", "repulse"], choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=Path("runs/repulse_toy"))
    p.add_argument("--png", type=Path, default=ROOT / "docs/img/repulse_toy_cpu.png")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to every run")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    provenance = {"env": bc.environment(), "command": bc.invocation()}  # at the start: env.time is the start time
    args.out.mkdir(parents=True, exist_ok=True)

    for seed in args.seeds:
        for method in args.methods:  # alternate methods so that machine load affects all alike
            run = args.out / f"{method}_seed{seed}"
            if (run / "metrics.jsonl").exists() and '"time/total"' in (run / "metrics.jsonl").read_text():
                continue  # finished earlier: reuse
            cmd = [sys.executable, str(ROOT / "algorithms/repulse.py"), "--seed", str(seed), "--output_dir", str(run),
                   "--exp_name", method, *COMMON, *METHODS[method], *args.extra]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)

    curves, summary = {}, {**provenance, "methods": {}, "common_flags": COMMON + args.extra,
                           "method_flags": {m: METHODS[m] for m in args.methods}}
    for method in args.methods:
        runs = [read(args.out / f"{method}_seed{s}") for s in args.seeds]
        curves[method] = runs
        final_lpb = [steps[-1]["exact/log_p_bad"] for steps, _ in runs]
        final_reward = [last["eval/mean_reward"] for _, last in runs]
        k = max(1, len(runs[0][0]) // 10)  # the training batches' reward over the last 10% of steps
        train_reward = [statistics.mean(r["objective/scores"] for r in steps[-k:]) for steps, _ in runs]
        summary["methods"][method] = {
            "seeds": args.seeds, "samples": runs[0][0][-1]["episode"], "p_updates": runs[0][0][-1]["step"],
            "initial_log_p_bad": runs[0][0][0]["exact/log_p_bad"],
            "final_log_p_bad": final_lpb, "final_log_p_bad_mean": statistics.mean(final_lpb),
            "heldout_mean_reward": final_reward, "heldout_mean_reward_mean": statistics.mean(final_reward),
            "train_reward_last10pct": train_reward, "train_reward_last10pct_mean": statistics.mean(train_reward),
            "heldout_p_bad": [last["eval/p_bad"] for _, last in runs],
            "seconds": [last["time/total"] for _, last in runs],
        }
    if "reinforce" in summary["methods"] and "repulse" in summary["methods"]:
        rf, rp = summary["methods"]["reinforce"], summary["methods"]["repulse"]
        gap = rf["final_log_p_bad_mean"] - rp["final_log_p_bad_mean"]
        rel = abs(rp["heldout_mean_reward_mean"] - rf["heldout_mean_reward_mean"]) / abs(rf["heldout_mean_reward_mean"])
        summary["target"] = {"log_p_bad_gap_nats (reinforce - repulse)": gap,
                             "relative_reward_difference": rel, "met": bool(gap >= 1.0 and rel <= 0.05)}
    json_path = args.png.with_name(args.png.stem + "_summary.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary.get("target", {}), indent=2))
    for m, s in summary["methods"].items():
        print(f"{m:18s} final log P(bad) {s['final_log_p_bad_mean']:.2f} {[round(x, 2) for x in s['final_log_p_bad']]}"
              f"  held-out reward {s['heldout_mean_reward_mean']:.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method, runs in curves.items():
        for ax, key in zip(axes, ("exact/log_p_bad", "objective/scores")):
            n = min(len(steps) for steps, _ in runs)
            xs = [runs[0][0][i]["episode"] for i in range(n)]
            vals = [[steps[i].get(key) for steps, _ in runs] for i in range(n)]
            ok = [i for i in range(n) if all(v is not None for v in vals[i])]
            mean = [statistics.mean(vals[i]) for i in ok]
            ax.plot([xs[i] for i in ok], mean, label=LABELS[method])
            ax.fill_between([xs[i] for i in ok], [min(vals[i]) for i in ok], [max(vals[i]) for i in ok], alpha=0.2)
    axes[0].set(xlabel="samples", ylabel="exact log P(bad) of p_theta", title="Probability of a bad output")
    axes[1].set(xlabel="samples", ylabel="mean reward of the training batch", title="Average reward")
    axes[0].legend()
    fig.suptitle(f"RePULSe toy on CPU (tiny model, 2 tokens; mean and min-max over seeds {args.seeds})")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png} and {json_path}")


if __name__ == "__main__":
    main()
