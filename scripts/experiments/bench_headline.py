"""Experiment (not a test): the headline results of README.md, i.e. each script's default run, over several seeds.

    python scripts/experiments/bench_headline.py                                # grpo sft dpo rm, seeds 1 2 3 (~30 min, 2 cores)
    python scripts/experiments/bench_headline.py --algorithms grpo --seeds 1   # one run
    python scripts/experiments/bench_headline.py --stop_after_steps 50         # spread over sessions: rerun to continue
    python scripts/experiments/bench_headline.py --algorithms ppo --seeds 1 2 3 --reuse docs/bench/headline/<file>.json
        # the seeds that file stores are copied, the others run: finished runs carried from session to session
    python scripts/experiments/bench_headline.py --algorithms grpo --flags "--lora_r 16 --learning_rate 1e-3" \
        --out runs/bench/lora_learning --results docs/bench/lora_learning   # a variant: the default run + flags
    python scripts/experiments/bench_headline.py --algorithms implicit_prm --seeds 1 2 3   # implicit PRM: slip localisation
    python scripts/experiments/bench_headline.py --algorithms restem --flags "--total_episodes 12800 --local_num_prompts 800" \
        --out runs/bench/restem --results docs/bench/restem   # RestEM at GRPO's first evaluation (12,800 samples)

Every run is the script with no flags but `--seed` and `--output_dir` (and `--flags`, if given), i.e. exactly
`python algorithms/<name>.py`
on the built-in task, in a fresh model cache (CLEANRLHF_CACHE=<out>/cache), into which the built-in models
(`builtin:tiny-sft`, which grpo.py and dpo.py start from) are copied from their committed weights
(shared/builtin_models/), as on a fresh clone.
A finished run is kept in <out>/<name>/seed<k>.json and not run again; `--stop_after_steps` leaves a resumable
checkpoint (rerun the same command to continue).

Reported per run, from its metrics.jsonl: the held-out metric at step 0 and at the end (`eval/accuracy`: grader
accuracy for sft/grpo/dpo/restem, pairwise accuracy for rm; dpo also `eval/rewards/accuracies`; for grpo and restem
the training samples drawn before each evaluation, from the run's args.json), the step that the dev
slice selected for output_dir/best and the held-out value at that step, the process's wall time, peak RSS.
Rerunning the same command after all runs finished only re-aggregates their stored results. `--reuse FILE` copies
the seeds a stored summary holds for the algorithms asked for (each marked with the file, commit and time it was
measured in; refused when that file's built-in start models differ from the ones built now). Over seeds: mean,
min, max. Writes docs/bench/headline/<device>_<time>.json, rendered into README.md and docs/*.md by
scripts/tools/docs_tables.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
# the held-out metrics reported per script (the first is the headline); all are higher-is-better
METRICS = {"sft": ["eval/accuracy"], "grpo": ["eval/accuracy", "eval/pass@4"],
           "dpo": ["eval/accuracy", "eval/rewards/accuracies"], "rm": ["eval/accuracy"],
           "restem": ["eval/accuracy", "eval/pass@4"], "drca": ["eval/accuracy", "eval/reward"]}
METRICS.update(dapo=METRICS["grpo"], grpo_async=METRICS["grpo"])  # grpo's variant files
METRICS.update(ppo=METRICS["grpo"], ppo_async=METRICS["grpo"])
METRICS["ppo_rlhf"] = ["eval/reward", "eval/accuracy"]  # the reward model's held-out score first: what it trains on
METRICS["prime"] = METRICS["grpo"]
METRICS["kto"] = METRICS["dpo"]  # dpo.py's held-out metrics: task accuracy, then the held-out pairs' reward accuracy
METRICS["opd"] = METRICS["grpo"]  # scripts/experiments/bench_opd.py runs it (and its control) through run_one
# implicit_prm.py: slip localisation on held-out slip pairs, then its held-out rows' pair ordering and accuracy
METRICS["implicit_prm"] = ["prm/localisation", "prm/localisation_chance", "eval/dpo_acc", "eval/acc"]


def samples_before(name: str, row: dict, args: dict) -> int | None:
    """Completions the run had sampled for training when it logged this evaluation row (RL scripts; else None):
    grpo: step * batch_size; restem: its evaluations follow whole iterations of num_prompts * K samples."""
    if name in ("grpo", "dapo", "grpo_async", "opd"):  # dapo: trained samples (its generated ones: bench_grpo_variants.py)
        return row["step"] * args["batch_size"]
    if name == "prime":  # every generated sample, the groups the accuracy filter dropped included
        return row["step"] * args["generated_batch_size"]
    if name == "restem":
        done = row["restem/iteration"] + 1 if "restem/iteration" in row else 0  # step 0: the base, none sampled
        return done * args["num_prompts"] * args.get("num_generations", args.get("num_samples_per_prompt"))
    return None


def spread(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_run(rows: list[dict], keys: list[str], name: str = "", args: dict | None = None) -> dict:
    """Start / final / best-selected values of the held-out metrics of one run's metrics.jsonl rows (with the run's
    args.json, each evaluation also records the training samples drawn before it, for grpo and restem)."""
    evals = [r for r in rows if keys[0] in r]
    samples = {r["step"]: samples_before(name, r, args) for r in evals} if args else {}
    best = next((r for r in reversed(rows) if "best/step" in r), None)
    at_best = next((r for r in evals if best and r["step"] == best["best/step"]), None)
    return {
        "steps": max(r["step"] for r in rows),
        "curve": [{"step": r["step"], **({"samples": samples[r["step"]]} if samples.get(r["step"]) is not None
                                         else {}), **{k: r.get(k) for k in keys}} for r in evals],
        "start": {k: evals[0].get(k) for k in keys}, "final": {k: evals[-1].get(k) for k in keys},
        "best_step": best["best/step"] if best else None,
        "at_best": {k: at_best.get(k) for k in keys} if at_best else None,
        "dev_at_best": {k.replace("eval/", "dev/"): at_best.get(k.replace("eval/", "dev/")) for k in keys}
        if at_best else None,
        "tracker_minutes": rows[-1]["time"] / 60 if "time" in rows[-1] else None,  # from the tracker's start
    }


def earlier_invocations_s(rows: list[dict]) -> float:
    """Seconds a resumed run spent in its earlier invocations: its metrics' `time` (seconds from the tracker's start)
    restarts at each resume, so each drop closes an invocation whose last `time` counts. 0 for a straight run."""
    times = [r["time"] for r in rows if "time" in r]
    return sum(t for t, nxt in zip(times, times[1:]) if nxt < t)


def wall_minutes(r: dict) -> float:
    """A run's wall minutes over all its invocations (a run spread over sessions with --stop_after_steps)."""
    return (r["wall_s_this_invocation"] + r.get("wall_s_earlier_invocations", 0.0)) / 60


def run_one(a, name: str, seed: int) -> dict | None:
    cache = a.out / name / f"seed{seed}.json"
    run_dir = a.out / name / f"seed{seed}"
    if cache.exists():
        result = json.loads(cache.read_text())
        if "wall_s_earlier_invocations" not in result and (run_dir / "metrics.jsonl").exists():  # kept before it
            result["wall_s_earlier_invocations"] = earlier_invocations_s(bc.read_jsonl(run_dir / "metrics.jsonl"))
        return result
    argv = [f"algorithms/{name}.py", "--seed", str(seed), "--output_dir", str(run_dir), *shlex.split(a.flags)]
    if a.stop_after_steps:
        argv += ["--stop_after_steps", str(a.stop_after_steps)]
    print(f"[bench] {name} seed {seed}: python {' '.join(shlex.quote(x) for x in argv)}", flush=True)
    child = bc.run_child(argv, a.out / name / f"log_seed{seed}",
                         env=bc.child_env({"CLEANRLHF_CACHE": str(a.out / "cache")}))
    if not (run_dir / "final" / "config.json").exists():
        print(f"[bench] {name} seed {seed} stopped after a slice; rerun the same command to continue", flush=True)
        return None
    result = {"seed": seed, "command": f"python algorithms/{name}.py --seed {seed} {a.flags}".strip(),
              **summarize_run(bc.read_jsonl(run_dir / "metrics.jsonl"), METRICS[name], name,
                              json.loads((run_dir / "args.json").read_text())),
              "peak_rss_mb": child["peak_rss_mb"], "wall_s_this_invocation": child["wall_s"],
              "wall_s_earlier_invocations": earlier_invocations_s(bc.read_jsonl(run_dir / "metrics.jsonl")),
              "loadavg_at_end": list(os.getloadavg())}  # other jobs on the machine stretch the wall time
    cache.write_text(json.dumps(result, indent=1))
    k = METRICS[name][0]
    print(f"[bench] {name} seed {seed}: {k} {result['start'][k]:.3f} -> {result['final'][k]:.3f} "
          f"({wall_minutes(result):.1f} min)", flush=True)
    return result


def summarize(name: str, runs: dict, flags: str) -> dict:
    """One algorithm's runs {seed: run} over seeds: start, end and dev-selected values, minutes, peak RSS."""
    keys = METRICS[name]
    return {
        "command": f"python algorithms/{name}.py {flags}".strip(), "metrics": keys,
        "start": {k: spread([r["start"][k] for r in runs.values()]) for k in keys},
        "final": {k: spread([r["final"][k] for r in runs.values()]) for k in keys},
        "at_best": {k: spread([r["at_best"][k] for r in runs.values()]) for k in keys}
        if all(r["at_best"] for r in runs.values()) else None,
        # wall time of the whole process: start-up, evaluations and saving included (and, for the first seed in
        # a fresh cache, copying the built-in models it loads)
        "minutes": spread([wall_minutes(r) for r in runs.values()]),
        "peak_rss_mb": spread([r["peak_rss_mb"] for r in runs.values()]),
        "seeds": runs,
    }


def reused_runs(path: Path | None, algorithms: list[str], flags: str) -> tuple[dict, dict]:
    """The runs of the stored summary `path` for `algorithms`, {name: {seed: run + "measured_in"}}, and the built-in
    models that file was measured on; a one-line error (exit 2) for a file that is not one, or ran other flags."""
    if path is None:
        return {}, {}
    results, where = bc.read_reused(path, "results", "bench_headline")
    if where["flags"] != flags:
        bc.reuse_error(path, f"its runs had --flags {where['flags']!r}, these {flags!r}")
    mark = {k: where[k] for k in ("file", "git_commit", "time")}
    runs = {name: {seed: {**r, "measured_in": r.get("measured_in", mark)}
                   for seed, r in results[name]["seeds"].items()} for name in algorithms if name in results}
    return runs, where["builtin_models"]


def check_same_start_models(theirs: dict, ours: dict) -> None:
    """Exit with a one-line error when a built-in model both files record was built differently (another start)."""
    for name in sorted(set(theirs) & set(ours)):
        if theirs[name]["weights_sha256"] != ours[name]["weights_sha256"]:
            bc.reuse_error("", f"the reused runs started from {name} {theirs[name]['weights_sha256'][:12]}, these "
                               f"from {ours[name]['weights_sha256'][:12]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="+", default=["sft", "grpo", "dpo", "rm"], choices=sorted(METRICS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "headline", help="work directory")
    p.add_argument("--stop_after_steps", type=int, default=0, help="stop (resumable) after this many steps a run")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "headline")
    p.add_argument("--flags", default="", help="extra flags for every run (a variant of the default run), one string")
    p.add_argument("--reuse", type=Path, help="a stored summary (JSON) whose runs of these algorithms are copied")
    a = p.parse_args()
    reused, their_models = reused_runs(a.reuse, a.algorithms, a.flags)
    results = {}
    for name in a.algorithms:
        runs = {}
        for seed in a.seeds:
            r = reused.get(name, {}).get(str(seed)) or run_one(a, name, seed)
            if r is None:
                return
            runs[str(seed)] = r
        results[name] = summarize(name, runs, a.flags)
    check_same_start_models(their_models, bc.builtin_models(a.out / "cache"))
    out = {"benchmark": "headline", "env": bc.environment(), "command": bc.invocation(),
           "flags": a.flags,
           "note": "default flags on the built-in task" + (f", plus {a.flags}" if a.flags else "")
                   + ", fresh model cache (the built-in models copied from their committed weights)",
           "results": results}
    path = bc.write_result("headline", out, a.results, latest=False, cache=a.out / "cache")
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
