"""Experiment (not a test): the mismatch corrections, DPPO and MaxRL against the default runs, on the built-in task.
Docs: docs/mismatch.md

    python scripts/experiments/bench_mismatch.py                                   # every variant, seeds 1 2 3 (hours on 2 cores)
    python scripts/experiments/bench_mismatch.py --variants sync async1 async1_tis_none --seeds 1
    python scripts/experiments/bench_mismatch.py --stop_after_steps 100            # spread over sessions: rerun to continue
    python scripts/experiments/bench_mismatch.py --real_model 6                   # SmolLM2: sync and async diagnostics only
    python scripts/experiments/bench_mismatch.py --variants dppo_kl maxrl --reuse docs/bench/mismatch/<file>.json  # add rows

Every run is a default run (`python algorithms/<script>.py --seed k`, 102,400 trained samples from builtin:tiny-sft)
plus the variant's flags, in one fresh model cache, through scripts/experiments/bench_headline.py's run_one (a finished run is
kept in <out>/<variant>/<script>/seed<k>.json and not rerun). Two groups, each against its own baseline:
  - the corrections of the sampler/trainer mismatch under asynchronous generation (grpo_async.py, one update
    stale: where the mismatch is real), each `--tis` mode against grpo_async.py's default (token_truncate) and
    `--tis none`, with the thresholds the references give (docs/mismatch.md);
  - DPPO and MaxRL in the synchronous loop (grpo.py), against grpo.py's default.
Reported per variant: held-out accuracy at the start and the end and the gain, mean (min-max) over seeds; the
mismatch diagnostics averaged over a run's steps (val/sampler_kl, val/tis_ratio_p99, val/tis_clipfrac,
val/tis_seq_clipfrac) and the gradient norm (optim/grad_norm: how much signal a mask leaves); wall minutes (every
invocation of a run resumed across sessions counted).

`--reuse FILE` takes the variants a stored summary holds from it instead of running them (each marked with the
file, commit and time it was measured in), and refuses a file measured on another start model (the built-in model's
weights hash): rows added to a table in a later session, when the earlier runs' work directories are gone.

`--real_model STEPS` runs instead grpo.py and grpo_async.py on builtin:smollm2-135m (the chat model shipped offline)
with scripts/experiments/bench_real_model_grpo.py's task and settings for STEPS steps, and reports their mismatch diagnostics
step by step, side by side: the mismatch of a real model's sampler in numbers, synchronous and one update stale.

Writes docs/bench/mismatch/<device>_<time>.json (`--results`), rendered into docs/mismatch.md by
scripts/tools/docs_tables.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
import bench_headline as bh  # noqa: E402

ROOT = bc.ROOT
# variant -> (script, flags, its baseline)
VARIANTS = {
    "sync": ("grpo", "", None),
    "async1": ("grpo_async", "", None),  # --tis token_truncate, C = 2
    "async1_tis_none": ("grpo_async", "--tis none", "async1"),
    "async1_icepop": ("grpo_async", "--tis token_mask --tis_mask_low 0.5 --tis_cap 5", "async1"),
    "async1_seq_truncate": ("grpo_async", "--tis sequence_truncate", "async1"),
    "async1_seq_mask": ("grpo_async", "--tis sequence_mask", "async1"),
    "async1_geo_mask": ("grpo_async", "--tis geometric_mask --tis_cap 1.001", "async1"),
    "dppo_tv": ("grpo", "--policy_loss dppo_tv", "sync"),  # bounds 0.2 / 0.28: prime-rl's default TV mask
    # verl's DPPO recipe bounds the binary KL at 0.05 both ways (grpo.py's 0.2 / 0.28 are ratio-clip bounds)
    "dppo_kl": ("grpo", "--policy_loss dppo_kl --epsilon_low 0.05 --epsilon_high 0.05", "sync"),
    "maxrl": ("grpo", "--advantage_estimator maxrl", "sync"),
}
DIAGNOSTICS = ("val/sampler_kl", "val/tis_ratio_p99", "val/tis_clipfrac", "val/tis_seq_clipfrac", "optim/grad_norm")
REAL_MODEL_KEYS = ("val/sampler_kl", "val/sampler_logprob_diff", "val/tis_ratio_min", "val/tis_ratio_max",
                   "val/tis_ratio_p99", "val/tis_clipfrac", "val/tis_seq_clipfrac", "async/staleness")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="which runs (VARIANTS in this file); each is compared with its baseline when that runs too")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--flags", default="", help="extra flags for every run, one string (e.g. a smaller "
                                               "--total_episodes for a smoke run)")
    p.add_argument("--stop_after_steps", type=int, default=0, help="stop (resumable) after this many steps a run")
    p.add_argument("--real_model", type=int, default=0, metavar="STEPS",
                   help="instead: grpo.py and grpo_async.py on builtin:smollm2-135m for STEPS steps, diagnostics only")
    p.add_argument("--reuse", type=Path, help="a stored summary (JSON) whose variants are copied, not run")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "mismatch", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "mismatch", help="JSON summary directory")
    return p.parse_args(argv)


def run_variant(a, name: str, cache: Path) -> dict | None:
    """The variant's runs over the seeds and their summary; None when a run stopped after --stop_after_steps."""
    script, extra, baseline = VARIANTS[name]
    sub = SimpleNamespace(out=a.out / name, flags=f"{extra} {a.flags}".strip(), stop_after_steps=a.stop_after_steps)
    sub.out.mkdir(parents=True, exist_ok=True)
    if not (sub.out / "cache").exists():
        (sub.out / "cache").symlink_to(cache.resolve())
    runs = {}
    for seed in a.seeds:
        r = bh.run_one(sub, script, seed)
        if r is None:
            return None
        rows = bc.read_jsonl(sub.out / script / f"seed{seed}" / "metrics.jsonl")
        for key in DIAGNOSTICS:  # mean over the run's steps
            xs = [row[key] for row in rows if key in row]
            r[f"{key}_mean"] = sum(xs) / len(xs) if xs else None
        runs[str(seed)] = r
    k = bh.METRICS["grpo"][0]
    return {"script": script, "flags": sub.flags, "baseline": baseline,
            "command": f"python algorithms/{script}.py {sub.flags}".strip(),
            "start": bh.spread([r["start"][k] for r in runs.values()]),
            "final": bh.spread([r["final"][k] for r in runs.values()]),
            "gain": bh.spread([r["final"][k] - r["start"][k] for r in runs.values()]),
            **{f"{key}_mean": bh.spread([r[f"{key}_mean"] for r in runs.values()]) for key in DIAGNOSTICS
               if all(r.get(f"{key}_mean") is not None for r in runs.values())},
            "minutes": bh.spread([bh.wall_minutes(r) for r in runs.values()]),
            "seeds": runs}


def versus_baseline(results: dict) -> dict:
    """{variant: {seed: its final held-out accuracy minus its baseline's}} over the seeds both ran."""
    out = {}
    for name, r in results.items():
        base = results.get(r["baseline"] or "")
        if base:
            seeds = sorted(set(r["seeds"]) & set(base["seeds"]))
            out[name] = {s: r["seeds"][s]["final"]["eval/accuracy"] - base["seeds"][s]["final"]["eval/accuracy"]
                         for s in seeds}
    return out


def reused_variants(path: Path | None, names: list[str]) -> dict:
    """The variants of the stored summary `path` not in `names` (those run now), each marked with where it was
    measured: {variant: its summary + "measured_in"}; exit with a one-line error on a file that is not one."""
    if path is None:
        return {}
    variants, where = bc.read_reused(path, "variants", "bench_mismatch")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        bc.reuse_error(path, f"unknown variant {unknown[0]!r} (VARIANTS in this file)")
    where = {k: where[k] for k in ("file", "git_commit", "time", "builtin_models")}
    return {name: {**r, "measured_in": r.get("measured_in", where)} for name, r in variants.items()
            if name not in names}


def check_same_start_model(reused: dict, built: dict) -> None:
    """Exit with a one-line error when a reused variant was measured on another built-in start model."""
    for name, r in reused.items():
        theirs = (r["measured_in"].get("builtin_models") or {}).get("builtin:tiny-sft", {}).get("weights_sha256")
        ours = built.get("builtin:tiny-sft", {}).get("weights_sha256")
        if theirs != ours:
            bc.reuse_error("", f"variant {name} was measured on builtin:tiny-sft {str(theirs)[:12]}, these runs on "
                               f"{str(ours)[:12]}: not one start model")


def real_model(a) -> dict:
    """grpo.py and grpo_async.py on SmolLM2-135M-Instruct (bench_real_model_grpo.py's task and settings, seed 1,
    a short evaluation), a.real_model steps each: {script: {"command", "steps": [{step, diagnostics}]}}."""
    import shlex

    import bench_real_model_grpo as brm

    dataset = brm.write_data(a.out / "real_model" / "data")
    settings = argparse.Namespace(learning_rate=1e-5, total_episodes=128 * a.real_model, eval_every=0,
                                  generator="vllm", stop_after_steps=0)
    out = {}
    for script in ("grpo", "grpo_async"):
        run_dir = a.out / "real_model" / script
        argv = brm.grpo_args(settings, 1, dataset, run_dir)
        argv[0] = f"algorithms/{script}.py"
        for flag, value in (("--eval_num_prompts", "20"), ("--eval_num_samples", "1")):  # a short evaluation
            argv[argv.index(flag) + 1] = value
        argv.append("--no_save_model")
        if not (run_dir / "metrics.jsonl").exists() or not any(
                "time/total" in r for r in bc.read_jsonl(run_dir / "metrics.jsonl")):
            print(f"[bench_mismatch] python {' '.join(shlex.quote(x) for x in argv)}", flush=True)
            bc.run_child(argv, a.out / "real_model" / f"log_{script}")
        rows = [r for r in bc.read_jsonl(run_dir / "metrics.jsonl") if "val/sampler_kl" in r]
        out[script] = {"command": "python " + " ".join(shlex.quote(x) for x in argv),
                       "steps": [{"step": r["step"], **{k: r[k] for k in REAL_MODEL_KEYS if k in r}} for r in rows]}
    return out


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    env = bc.environment()
    if a.real_model:
        result = {"benchmark": "mismatch_real_model", "env": env,
                  "command": bc.invocation(argv and [sys.argv[0], *argv]),
                  "note": "the sampler/trainer mismatch of SmolLM2-135M-Instruct under vLLM on CPU, synchronous "
                          "(grpo.py) and one update stale (grpo_async.py), diagnostics per step",
                  "real_model": real_model(a)}
        path = bc.write_result("mismatch", result, a.results, latest=False)
        print(f"wrote {path}")
        return result
    print(f"[bench_mismatch] {env['device']}; variants {' '.join(a.variants)}; load {env['loadavg_at_start']}",
          flush=True)
    cache = a.out / "cache"  # one start model for every variant
    cache.mkdir(parents=True, exist_ok=True)
    reused = reused_variants(a.reuse, a.variants)
    results = {}
    for name in a.variants:
        r = run_variant(a, name, cache)
        if r is None:
            print("[bench_mismatch] a run stopped after --stop_after_steps; rerun the same command to continue")
            return None
        results[name] = r
        print(f"{name}: eval/accuracy {r['start']['mean']:.3f} -> {r['final']['mean']:.3f} "
              f"({r['minutes']['mean']:.1f} min)", flush=True)
    check_same_start_model(reused, bc.builtin_models(cache))
    results = {name: results.get(name) or reused[name] for name in VARIANTS if name in results or name in reused}
    result = {"benchmark": "mismatch", "env": env, "command": bc.invocation(argv and [sys.argv[0], *argv]),
              "note": "the sampler/trainer mismatch corrections under one update of staleness (grpo_async.py), "
                      "DPPO and MaxRL in the synchronous loop (grpo.py), default runs on the built-in task",
              "variants": results, "final_minus_baseline": versus_baseline(results)}
    path = bc.write_result("mismatch", result, a.results, latest=False, cache=cache)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
