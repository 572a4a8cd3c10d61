"""Experiment (not a test): grpo.py's variants against its default run on the built-in task, equal samples, 3 seeds.

    python scripts/experiments/bench_grpo_variants.py                                  # all variants, seeds 1 2 3 (~1.7 h, 2 cores)
    python scripts/experiments/bench_grpo_variants.py --variants default gspo --seeds 1  # a subset
    python scripts/experiments/bench_grpo_variants.py --stop_after_steps 100             # spread over sessions: rerun to continue

Every run is `python algorithms/grpo.py --seed k` plus the variant's flags (dynamic sampling: `algorithms/dapo.py`; VARIANTS below: each paper's own
settings where it gives them, e.g. GSPO's clip range and minibatches), so all of them train on 102,400 samples (200 steps of
64 prompts x 8 completions) from the same start model (builtin:tiny-sft, the committed weights, copied into <out>/cache). Dynamic sampling trains on
as many batches but samples more to fill them: the table gives its generated samples, and its held-out accuracy at
the last evaluation before it had generated the other variants' 102,400 (equal generated samples) beside the final.
Runs go variant by variant, seeds inside (a finished run is cached in <out>/<variant>/seed<k>.json and not rerun).
Writes docs/bench/grpo_variants/<device>_<time>.json, rendered into docs/grpo.md by scripts/tools/docs_tables.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
import bench_headline as bh  # noqa: E402

ROOT = bc.ROOT
VARIANTS = {
    "default": "",
    "rloo": "--advantage_estimator rloo",
    "reinforce_pp_baseline": "--advantage_estimator reinforce_pp_baseline",
    # no lower bound on the weight (MiniMax-M1, and grpo.py's cispo), truncated at 5 (ScaleRL)
    "cispo": "--policy_loss cispo --epsilon_high 4",
    # the GSPO paper: its clip range, the sequence-mean objective, one pass over each batch in 4 minibatches
    "gspo": "--importance_level sequence --epsilon_low 3e-4 --epsilon_high 4e-4 --loss_aggregation seq_mean "
            "--num_iterations 1 --num_minibatches 4",
    "sapo": "--policy_loss sapo",  # TRL's temperatures (1.0 positive, 1.05 negative)
    # the investigation of sapo's result: temperatures at which the gate's weight 4 sigmoid (1 - sigmoid) halves at
    # |rho - 1| = 0.2, grpo.py's clip bound (tau = ln((1 + sqrt(1/2)) / (1 - sqrt(1/2))) / 0.2 = 8.81), TRL's ratio
    # of the negative to the positive temperature (1.05) kept
    "sapo_tau_at_clip": "--policy_loss sapo --sapo_temperature_pos 8.81 --sapo_temperature_neg 9.25",
    "dynamic_sampling": "",  # algorithms/dapo.py with its defaults
}
SCRIPT = {"dynamic_sampling": "dapo"}  # variants that are their own file; the others are grpo.py's flags


def generated_samples(run_dir: Path, batch_size: int) -> dict[int, int]:
    """Completions generated before each step's end, all rounds included: {step: cumulative samples}."""
    total, out = 0, {0: 0}
    for row in bc.read_jsonl(run_dir / "metrics.jsonl"):
        if "objective/scores" in row:  # one row per training step
            total += batch_size * (1 + int(row.get("dynamic_sampling/extra_rounds", 0)))
            out[row["step"]] = total
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "grpo_variants", help="work directory")
    p.add_argument("--stop_after_steps", type=int, default=0, help="stop (resumable) after this many steps a run")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "grpo_variants")
    a = p.parse_args()
    env = bc.environment()  # at the start: env.time is the start time
    results = {}
    for name in a.variants:
        runs = {}
        sub = SimpleNamespace(out=a.out / name, flags=VARIANTS[name], stop_after_steps=a.stop_after_steps)
        sub.out.mkdir(parents=True, exist_ok=True)
        cache = a.out / "cache"  # one start model for all variants (bench_headline.run_one uses <out>/cache)
        if not (sub.out / "cache").exists():
            cache.mkdir(parents=True, exist_ok=True)
            (sub.out / "cache").symlink_to(cache.resolve())
        for seed in a.seeds:
            script = SCRIPT.get(name, "grpo")
            r = bh.run_one(sub, script, seed)
            if r is None:
                return
            run_dir = sub.out / script / f"seed{seed}"
            args = json.loads((run_dir / "args.json").read_text())
            gen = generated_samples(run_dir, args["batch_size"])
            for point in r["curve"]:
                point["generated_samples"] = gen.get(point["step"])
            budget = args["total_episodes"]
            equal = [pt for pt in r["curve"] if pt["generated_samples"] is not None
                     and pt["generated_samples"] <= budget]
            r["generated_samples"] = max(gen.values())
            r["at_equal_generated"] = {"step": equal[-1]["step"], "generated_samples": equal[-1]["generated_samples"],
                                       "eval/accuracy": equal[-1]["eval/accuracy"]}
            runs[str(seed)] = r
        keys = bh.METRICS["grpo"]
        results[name] = {
            "flags": VARIANTS[name], "command": f"python algorithms/{SCRIPT.get(name, 'grpo')}.py {VARIANTS[name]}".strip(),
            "start": {k: bh.spread([r["start"][k] for r in runs.values()]) for k in keys},
            "final": {k: bh.spread([r["final"][k] for r in runs.values()]) for k in keys},
            "at_equal_generated": bh.spread([r["at_equal_generated"]["eval/accuracy"] for r in runs.values()]),
            "generated_samples": bh.spread([r["generated_samples"] for r in runs.values()]),
            "minutes": bh.spread([bh.wall_minutes(r) for r in runs.values()]),
            "seeds": runs,
        }
    out = {"benchmark": "grpo_variants", "env": env, "command": bc.invocation(),
           "note": "grpo.py's default run (102,400 samples) with each variant's flags, same start model; "
                   "at_equal_generated: held-out accuracy at the last evaluation before 102,400 generated samples",
           "results": results}
    path = bc.write_result("grpo_variants", out, a.results, latest=False, cache=a.out / "cache")
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
