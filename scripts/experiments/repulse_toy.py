"""Experiment (not a test): the RePULSe toy experiment (paper Sec. 4.2 in small): REINFORCE, reward-transformed
REINFORCE, RePULSe and its p-proposal ablation at equal numbers of samples, several seeds, exact log P(bad) of p_theta
after every step.

Two modes:

    python scripts/experiments/repulse_toy.py                       # quick: 3 methods x seeds 1 2 3, 15k samples, N = 250, CPU
    python scripts/experiments/repulse_toy.py --paper               # the paper's settings (below), resumable, hours on CPU
    python scripts/experiments/repulse_toy.py --paper --hours 2     # work for 2 hours, checkpoint the running run, stop; rerun
                                                        # the same command to go on (finished runs are reused)
    python scripts/experiments/repulse_toy.py --paper --hours 2 --drain   # ... but let the running run finish, start no other
    python scripts/experiments/repulse_toy.py --paper --seeds 1 2 3 4 5 --alphas 0.01 0.1

--paper: the paper's toy settings: 250k samples per run, N = 500 samples per step from p
(and 500 from q for RePULSe), c_KL = 0, beta (code) -10, p LR 1e-4, q LR 3e-4, RePULSe and the p-proposal ablation
at each alpha of --alphas (default 0.01 0.1 1 10), against REINFORCE (RLOO) and r - e^{-r}, with the toy's
classifier-like reward (`--reward_fn toy_classifier`, shared/toy.py). Every run saves a checkpoint every 25 steps
and on SIGTERM / Ctrl-C, and `algorithms/repulse.py --resume auto` continues it, so the sweep can be spread over
sessions. Writes docs/results/repulse_toy.json after every finished run: provenance (machine, commit, built-in
model hashes, command), per run the final exact log P(bad), the held-out and training mean reward and the curves
(every 5,000 samples, the paper's evaluation points), and the goal per alpha: RePULSe's final
log P(bad) at least 1 nat below REINFORCE's with held-out mean reward within 5%, on every seed (seed-paired).
Finished runs stored in that file are reused too (its flags, and the built-in models it ran on, must equal this
invocation's), so the sweep goes on in a fresh clone without the run directories; the plot is drawn from it.

The quick mode keeps the older stored experiment (docs/img/repulse_toy_cpu_summary.json: the indicator reward
`--reward_fn toy`, the script's other defaults).

Every run is `algorithms/repulse.py` with the method's flags plus the common ones; "samples" counts every
completion drawn for training (RePULSe draws N from p and N from q per step, so it makes half as many p updates:
the paper's compute matching).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = {
    "reinforce": ["--objective", "reinforce", "--alpha", "0"],
    "reward_transform": ["--objective", "reinforce", "--reward_transform", "minus_alpha_exp_beta_r", "--alpha", "1",
                         "--target_dist_beta", "-1"],  # r - e^{-r}, as the paper's toy
    "repulse": [],  # the script's defaults: beta -10, alpha as set there, q and p learning rates
    "p_proposal": ["--use_base_as_proposal"],
}
SWEPT = ("repulse", "p_proposal")  # --paper: run at every alpha of --alphas
COMMON = ["--total_episodes", "15000", "--eval_every", "0", "--sample_every", "0", "--no_save_model", "--reward_fn",
          "toy"]
PAPER = ["--total_episodes", "250000", "--num_generations", "500", "--local_micro_batch_size", "500", "--beta", "0",
         "--target_dist_beta", "-10", "--learning_rate", "1e-4", "--proposal_learning_rate", "3e-4",
         "--reward_fn", "toy_classifier", "--eval_every", "0", "--sample_every", "0", "--no_save_model",
         "--save_every", "25", "--best_metric", ""]
LABELS = {"reinforce": "REINFORCE (RLOO)", "reward_transform": "REINFORCE, r - exp(-r)", "repulse": "RePULSe",
          "p_proposal": "RePULSe, p as proposal"}
FINISHED_UNDER = "finished_under.json"  # --paper: in a run's directory, the invocation that finished it (commit, time,
# machine), so that runs finished by several invocations at once, or on another machine, are each credited to theirs
CURVE_EVERY = 5000  # samples between the paper's evaluation points (50 over 250k)
START_MODEL = "builtin:tiny-sft"  # repulse.py's default policy: the toy's start model


def read(run: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "exact/log_p_bad" in r and "episode" in r], rows[-1]


def finished(run: Path) -> bool:
    return (run / "metrics.jsonl").exists() and '"time/total"' in (run / "metrics.jsonl").read_text()


def configs(methods: list[str], alphas: list[float], paper: bool) -> dict[str, list[str]]:
    """{name: flags}: in --paper mode, RePULSe and the p-proposal ablation once per alpha (`repulse_a0.01`)."""
    out = {}
    for m in methods:
        if paper and m in SWEPT:
            out |= {f"{m}_a{a:g}": METHODS[m] + ["--alpha", f"{a:g}"] for a in alphas}
        else:
            out[m] = METHODS[m]
    return out


def method_of(name: str) -> str:
    return name.split("_a")[0] if name.split("_a")[0] in SWEPT else name


def run_summary(run: Path) -> dict:
    """Final exact log P(bad), rewards and the curves of one finished run (--paper)."""
    steps, last = read(run)
    k = max(1, len(steps) // 10)  # the training batches' reward over the last 10% of steps
    curve = []
    for i, r in enumerate(steps):
        if r["episode"] % CURVE_EVERY == 0:
            window = [s["objective/scores"] for s in steps[1 : i + 1] if s["episode"] > r["episode"] - CURVE_EVERY]
            curve.append([r["episode"], r["exact/log_p_bad"], statistics.mean(window) if window else None])
    return {"samples": steps[-1]["episode"], "p_updates": steps[-1]["step"],
            "initial_log_p_bad": steps[0]["exact/log_p_bad"], "final_log_p_bad": steps[-1]["exact/log_p_bad"],
            "final_log_q_bad": steps[-1].get("exact/log_q_bad"),
            "heldout_mean_reward": last["eval/mean_reward"], "heldout_p_bad": last["eval/p_bad"],
            "train_reward_last10pct": statistics.mean(r["objective/scores"] for r in steps[-k:]),
            "seconds_last_invocation": last["time/total"],  # a resumed run: its last invocation only
            "curve_columns": ["samples", "exact_log_p_bad", "mean_train_reward_since_previous_point"], "curve": curve}


def goal(runs: dict[str, dict[str, dict]], name: str, margin_nats: float = 1.0, reward_tol: float = 0.05) -> dict:
    """Issue #19's goal for config `name` against REINFORCE, seed by seed (the seeds both have finished):
    final log P(bad) at least `margin_nats` below REINFORCE's, held-out mean reward within `reward_tol` of it."""
    per_seed = {}
    for seed, rp in runs.get(name, {}).items():
        rf = runs.get("reinforce", {}).get(seed)
        if rf is None:
            continue
        gap = rf["final_log_p_bad"] - rp["final_log_p_bad"]
        rel = abs(rp["heldout_mean_reward"] - rf["heldout_mean_reward"]) / abs(rf["heldout_mean_reward"])
        per_seed[seed] = {"log_p_bad_gap_nats (reinforce - this)": gap, "relative_reward_difference": rel,
                          "met": bool(gap >= margin_nats and rel <= reward_tol)}
    return {"seeds_compared": sorted(per_seed, key=int), "per_seed": per_seed,
            "met_on_every_seed": bool(per_seed) and all(v["met"] for v in per_seed.values())}


def stored_runs(path: Path, common: list[str], names: dict[str, list[str]], models: dict) -> dict[str, dict]:
    """Finished runs of an earlier --paper summary that this invocation can reuse: same common flags, same flags per
    config, and every earlier invocation on this one's start model (builtin:tiny-sft, the same weights; the start
    model is part of a result) and on the same builds of the other built-in models both name."""
    if not path.exists():
        return {}
    d = json.loads(path.read_text())

    def agree(earlier: dict) -> bool:
        shared = set(earlier) & set(models)
        return START_MODEL in shared and all(earlier[k]["weights_sha256"] == models[k]["weights_sha256"]
                                             for k in shared)

    same_models = all(agree((inv.get("env") or {}).get("builtin_models") or {}) for inv in d.get("invocations", []))
    if d.get("settings", {}).get("common_flags") != common or not same_models:
        print(f"{path}: other flags or built-in models; its runs are not reused", flush=True)
        return {}
    return {n: runs for n, runs in d.get("runs", {}).items() if d["settings"]["config_flags"].get(n) == names.get(n)}


def paper_summary(out: Path, names: dict[str, list[str]], seeds: list[int], provenance: dict,
                  stored: dict[str, dict] | None = None) -> dict:
    """The sweep's summary over `seeds`: runs finished in `out`, else stored ones (`stored_runs`) of the same seed."""
    stored = stored or {}
    env = provenance.get("env") or {}
    runs = {n: {} for n in names}
    for n in names:
        for s in map(str, seeds):
            earlier = stored.get(n, {}).get(s)
            run = out / f"{n}_seed{s}"
            if finished(run):  # the invocation that finished it: the one its directory names (FINISHED_UNDER), else
                by = run / FINISHED_UNDER  # an earlier one if stored, else this one
                runs[n][s] = {**run_summary(run), "finished_under": json.loads(by.read_text()) if by.exists() else (
                    earlier or {}).get("finished_under", {"git_commit": env.get("git_commit"),
                                                          "invocation_time": env.get("time")})}
            elif earlier is not None:
                runs[n][s] = earlier
    pending = [f"{n}_seed{s}" for s in seeds for n in names if str(s) not in runs[n]]
    return {**provenance, "settings": {"common_flags": PAPER, "config_flags": names, "seeds": seeds,
                                       "curve_every_samples": CURVE_EVERY},
            "complete": not pending, "pending": pending, "runs": runs,
            "goal": {n: goal(runs, n) for n in names if method_of(n) in ("repulse", "p_proposal")},
            "goal_definition": "per seed: final exact log P(bad) >= 1 nat below REINFORCE's (same seed) and held-out "
                               "mean reward (1000 samples after training) within 5% of REINFORCE's"}


class Deadline:
    """--hours: at the deadline the running child gets SIGTERM (it checkpoints at the end of its step, exit 143)."""

    def __init__(self, hours: float | None, drain: bool = False):
        self.end = time.time() + hours * 3600 if hours else None
        self.drain = drain  # at the deadline, let the running child finish (start no other)

    def passed(self) -> bool:
        return self.end is not None and time.time() >= self.end

    def run(self, cmd: list[str], log: Path) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:  # the run's console output (progress bar), appended over resumed invocations
            child = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
            return self._wait(child)

    def _wait(self, child: subprocess.Popen) -> int:
        try:
            while child.poll() is None:
                if self.passed() and not self.drain:
                    child.send_signal(signal.SIGTERM)
                    return child.wait()
                time.sleep(5)
        except KeyboardInterrupt:  # Ctrl-C reached the child too (same process group): it checkpoints and exits
            child.wait()
            raise
        return child.returncode


def paper_curves(summary: dict) -> dict[str, list[list[dict]]]:
    """The stored curves of a --paper summary as `plot` takes them (one point every 5,000 samples)."""
    return {n: [[{"episode": c[0], "exact/log_p_bad": c[1], "objective/scores": c[2]} for c in r["curve"]]
                for r in runs.values()] for n, runs in summary["runs"].items()}


def plot(curves: dict[str, list[list[dict]]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in curves.items():
        if not runs:
            continue
        for ax, key in zip(axes, ("exact/log_p_bad", "objective/scores")):
            n = min(len(steps) for steps in runs)
            xs = [runs[0][i]["episode"] for i in range(n)]
            vals = [[steps[i].get(key) for steps in runs] for i in range(n)]
            ok = [i for i in range(n) if all(v is not None for v in vals[i])]
            mean = [statistics.mean(vals[i]) for i in ok]
            label = LABELS[method_of(name)] + (f", alpha {name.split('_a')[1]}" if "_a" in name else "")
            ax.plot([xs[i] for i in ok], mean, label=label)
            ax.fill_between([xs[i] for i in ok], [min(vals[i]) for i in ok], [max(vals[i]) for i in ok], alpha=0.2)
    axes[0].set(xlabel="samples", ylabel="exact log P(bad) of p_theta", title="Probability of a bad output")
    axes[1].set(xlabel="samples", ylabel="mean reward of the training batch", title="Average reward")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="the paper's toy settings and alpha sweep (see above)")
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                   help="default: reinforce reward_transform repulse (quick); all four (--paper)")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0],
                   help="--paper: the alphas of RePULSe and the p-proposal ablation")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--hours", type=float, default=None,
                   help="--paper: stop after this many hours (the running run checkpoints; rerun to go on)")
    p.add_argument("--drain", action="store_true",
                   help="--paper, with --hours: at the deadline let the running run finish and start no other")
    p.add_argument("--out", type=Path, default=None, help="run directories (default runs/repulse_toy[_paper])")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None,
                   help="--paper: the summary (default docs/results/repulse_toy.json)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags passed to every run")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    methods = args.methods or (list(METHODS) if args.paper else ["reinforce", "reward_transform", "repulse"])
    out = args.out or Path("runs/repulse_toy_paper" if args.paper else "runs/repulse_toy")
    png = args.png or ROOT / ("docs/img/repulse_toy_paper.png" if args.paper else "docs/img/repulse_toy_cpu.png")
    names = configs(methods, args.alphas, args.paper)
    common = (PAPER if args.paper else COMMON) + args.extra
    provenance = {"env": bc.environment(), "command": bc.invocation()}  # at the start: env.time is the start time
    provenance["env"]["builtin_models"] = bc.builtin_models()
    invocations = out / "invocations.jsonl"  # --paper: every invocation's machine, commit and models (resumed sweeps)
    out.mkdir(parents=True, exist_ok=True)
    if args.paper:
        with open(invocations, "a") as f:
            f.write(json.dumps(provenance) + "\n")
    deadline = Deadline(args.hours if args.paper else None, args.drain)
    json_path = args.json or ROOT / "docs/results/repulse_toy.json"
    stored, earlier = {}, []
    if args.paper:
        stored = stored_runs(json_path, common, names, provenance["env"]["builtin_models"])
        if stored:
            earlier = json.loads(json_path.read_text()).get("invocations", [])
            print(f"reusing {sum(map(len, stored.values()))} finished runs stored in {json_path}", flush=True)

    def done(name: str, seed: int) -> bool:
        return finished(out / f"{name}_seed{seed}") or str(seed) in stored.get(name, {})

    def write_paper_summary() -> dict:
        summary = paper_summary(out, names, args.seeds, provenance, stored)
        summary["settings"]["common_flags"] = common
        now = [json.loads(x) for x in invocations.read_text().splitlines()]
        summary["invocations"] = earlier + [x for x in now if x not in earlier]  # every invocation, oldest first
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=2))
        return summary

    try:
        for seed in args.seeds:
            for name, flags in names.items():  # alternate methods so that machine load affects all alike
                run = out / f"{name}_seed{seed}"
                if done(name, seed):
                    continue  # finished earlier: reuse
                if deadline.passed():
                    break
                cmd = [sys.executable, str(ROOT / "algorithms/repulse.py"), "--seed", str(seed), "--output_dir",
                       str(run), "--exp_name", name, *common, *flags]
                print(" ".join(cmd), flush=True)
                rc = deadline.run(cmd, out / f"{name}_seed{seed}.log")
                if deadline.passed() and not (deadline.drain and rc == 0):  # stopped at the deadline (checkpointed)
                    print(f"deadline: {run} checkpointed; rerun the same command to go on", flush=True)
                    break
                if rc != 0:
                    raise SystemExit(f"{run}: exit status {rc} (console output: {run}.log)")
                print(f"finished {run}", flush=True)
                if args.paper:
                    env = provenance["env"]
                    (run / FINISHED_UNDER).write_text(json.dumps({"git_commit": env.get("git_commit"), "invocation_time":
                                                                  env.get("time"), "device": env.get("device")}))
                    write_paper_summary()
    except KeyboardInterrupt:
        print("interrupted: the running run checkpointed; rerun the same command to go on", flush=True)

    if args.paper:
        summary = write_paper_summary()
        for n, g in summary["goal"].items():
            print(f"{n:20s} goal met on every seed: {g['met_on_every_seed']} (seeds {g['seeds_compared']})")
        print(f"{len(summary['pending'])} runs pending; wrote {json_path}")
        curves = paper_curves(summary)
        if any(curves.values()):
            plot(curves, png, "RePULSe toy, paper settings (250k samples, N = 500; mean and min-max over seeds)")
        return
    curves = {n: [read(out / f"{n}_seed{s}")[0] for s in args.seeds] for n in names}

    summary = {**provenance, "methods": {}, "common_flags": common, "method_flags": {m: METHODS[m] for m in methods}}
    for method in methods:
        runs = [read(out / f"{method}_seed{s}") for s in args.seeds]
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
    json_path = png.with_name(png.stem + "_summary.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary.get("target", {}), indent=2))
    for m, s in summary["methods"].items():
        print(f"{m:18s} final log P(bad) {s['final_log_p_bad_mean']:.2f} {[round(x, 2) for x in s['final_log_p_bad']]}"
              f"  held-out reward {s['heldout_mean_reward_mean']:.4f}")
    plot(curves, png, f"RePULSe toy on CPU (tiny model, 2 tokens; mean and min-max over seeds {args.seeds})")
    print(f"wrote {png} and {json_path}")


if __name__ == "__main__":
    main()
