"""Experiment (not a test): Best-of-N with every verifier on the same policy samples: one table for docs/genrm.md.

    python scripts/experiments/bench_bon.py --seeds 1 2 3 --out_dir docs/bench/bon

For each seed the verifiers are trained by their scripts' default runs with that seed (plus --train_flags for
genrm.py): genrm.py direct and `--verifier cot`, rm.py's Bradley-Terry model on its built-in preference pairs, and
implicit_prm.py's implicit PRM (scored as the minimum over lines of its line rewards); then algorithms/evaluate.py
samples --num_samples completions of the policy per held-out prompt (the same samples for every seed: evaluate.py's
--seed stays 1) and scores each with each verifier. Per N in --k: first sample (eval/pass@1, the mean accuracy),
majority vote (maj@N), each verifier's best-of-N (bon/<name>@N) and weighted vote, and pass@N, the ceiling; mean and
min-max over the seeds.
With --labelled_prompts P the verifiers train on one shared set of the policy's graded samples instead of sampling
their own: evaluate.py samples --labelled_samples completions of P training prompts (--eval_split train, seed 1, the
--extra flags) and grades them; genrm.py and implicit_prm.py read the rows as --data_path, rm.py the pairs (a correct
and an incorrect completion of the same prompt, every such combination) as --dataset. This is how a dataset without
preference pairs (the SmolLM2 chat-sums data, docs/real_models.md) gets the Bradley-Terry verifier too, and how
every verifier is compared on the same data (docs/genrm.md's second table). Each of --extra, --train_flags, --rm_flags, --implicit_prm_flags is split like a shell
line, so one quoted value holds several flags. --one_evaluation scores every seed's verifiers in one evaluate.py run:
the samples are the same for every seed, so they are generated once (every verifier is in memory at once).
Writes <out_dir>/cpu_<time>.json (docs/genrm.md renders it with scripts/tools/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts.bench_common import child_env, environment, invocation, run_child, write_result  # noqa: E402


# each verifier's held-out metrics kept from its run's first and last evaluation (rm.py evaluates at the end only)
HELD_OUT = {"genrm": ("eval/auroc", "eval/p_yes_correct", "eval/p_yes_incorrect", "eval/no_verdict_frac"),
            "rm": ("eval/accuracy",),
            "implicit_prm": ("eval/loss", "eval/acc", "eval/dpo_acc", "eval/reward_correct", "eval/reward_incorrect")}


def evaluate(work: Path, a, name: str, specs: list[str], extra: list[str]) -> dict:
    """evaluate.py's metrics for the policy's --num_samples samples of --num_prompts held-out prompts, every verifier
    of specs scoring them (a finished run is read back)."""
    ev = work / name
    if not (ev / "summary.json").exists():
        run_child(["algorithms/evaluate.py", "--model_name_or_path", a.policy, "--generator", a.generator,
                   "--output_dir", str(ev), "--eval_num_prompts", str(a.num_prompts),
                   "--num_samples", str(a.num_samples),
                   "--k", "1", *map(str, a.k), "--num_bootstrap", "0", "--verifiers", *specs, *extra],
                  work / "logs" / name, env=child_env())
    return json.loads((ev / "summary.json").read_text())["metrics"]


def labelled_data(work: Path, a, extra: list[str]) -> dict:
    """The policy's graded samples of --labelled_prompts training prompts (evaluate.py --eval_split train, seed 1),
    written as labelled rows {prompt, completion, response, label} (genrm.py, implicit_prm.py) and as preference
    pairs {prompt, chosen, rejected}: every (correct, incorrect) combination of one prompt's samples (rm.py)."""
    out = work / "labelled"
    if not (out / "summary.json").exists():
        run_child(["algorithms/evaluate.py", "--model_name_or_path", a.policy, "--generator", a.generator,
                   "--output_dir", str(out), "--eval_split", "train", "--eval_num_prompts", str(a.labelled_prompts),
                   "--num_samples", str(a.labelled_samples), "--k", "1", "--no_greedy", "--num_bootstrap", "0",
                   *extra], work / "logs" / "labelled", env=child_env())
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines() if line.strip()]
    rows, pairs = [], []
    for rec in sorted(records, key=lambda r: r["index"]):
        good = [s["completion"] for s in rec["samples"] if s["grade"] > 0.5]
        bad = [s["completion"] for s in rec["samples"] if s["grade"] <= 0.5]
        rows += [{"prompt": rec["prompt"], "completion": s["completion"], "response": s["completion"],
                  "label": int(s["grade"] > 0.5)} for s in rec["samples"]]
        pairs += [{"prompt": rec["prompt"], "chosen": g, "rejected": b} for g in good for b in bad]
    paths = {"rows": work / "labelled_rows.jsonl", "pairs": work / "labelled_pairs.jsonl"}
    for key, items in (("rows", rows), ("pairs", pairs)):
        paths[key].write_text("".join(json.dumps(x) + "\n" for x in items))
    return {**paths, "prompts": len(records), "num_rows": len(rows), "num_correct": sum(r["label"] for r in rows),
            "num_pairs": len(pairs),
            "prompts_with_pairs": sum(1 for rec in records if 0 < sum(s["grade"] > 0.5 for s in rec["samples"])
                                      < len(rec["samples"]))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--policy", default="builtin:tiny-sft", help="the policy whose samples are selected from")
    p.add_argument("--num_prompts", type=int, default=200, help="held-out prompts (a fixed-seed sample)")
    p.add_argument("--num_samples", type=int, default=16)
    p.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--verifiers", nargs="+", default=["genrm_direct", "genrm_cot", "rm", "implicit_prm"],
                   choices=["genrm_direct", "genrm_cot", "rm", "implicit_prm"])
    p.add_argument("--implicit_prm_root", default=str(ROOT),
                   help="the checkout whose algorithms/implicit_prm.py trains the implicit PRM (default: this one)")
    p.add_argument("--rm_path", default="", help="a trained rm.py checkpoint used for every seed instead of training one")
    p.add_argument("--train_flags", nargs="*", default=[], help="flags added to genrm.py's runs (both forms); each "
                   "value is split like a shell line, so one quoted value may hold several flags")
    p.add_argument("--rm_flags", nargs="*", default=[], help="flags added to rm.py's runs")
    p.add_argument("--implicit_prm_flags", nargs="*", default=[], help="flags added to implicit_prm.py's runs")
    p.add_argument("--labelled_prompts", type=int, default=0,
                   help="train every verifier on the policy's graded samples of this many training prompts (0: each "
                        "script samples its own, and rm.py trains on its --dataset's pairs)")
    p.add_argument("--labelled_samples", type=int, default=8, help="samples per prompt for --labelled_prompts")
    p.add_argument("--generator", choices=["hf", "vllm"], default="hf", help="evaluate.py's generator")
    p.add_argument("--one_evaluation", action="store_true",
                   help="one evaluate.py run scores every seed's verifiers (the same samples, generated once)")
    p.add_argument("--work_dir", default="runs/bench_bon")
    p.add_argument("--out_dir", default=None, help="where the JSON goes (default runs/bench/bon)")
    p.add_argument("--extra", nargs="*", default=[], help="flags added to every evaluate.py run (the task's data flags)")
    a = p.parse_args()
    env = environment()
    work = Path(a.work_dir)
    split = lambda flags: [x for f in flags for x in shlex.split(f)]  # noqa: E731
    extra = split(a.extra)
    model = ["--model_name_or_path", a.policy]
    train = {"genrm_direct": ["algorithms/genrm.py", *model, *split(a.train_flags)],
             "genrm_cot": ["algorithms/genrm.py", *model, "--verifier", "cot", *split(a.train_flags)],
             "rm": ["algorithms/rm.py", *model, *split(a.rm_flags)],
             "implicit_prm": [str(Path(a.implicit_prm_root) / "algorithms" / "implicit_prm.py"), *model,
                              *split(a.implicit_prm_flags)]}
    labelled = None
    if a.labelled_prompts and "genrm_cot" in a.verifiers:
        raise SystemExit("--labelled_prompts: the shared samples have no rationales; leave genrm_cot out of --verifiers")
    if a.labelled_prompts:
        labelled = labelled_data(work, a, extra)
        train["genrm_direct"] += ["--data_path", str(labelled["rows"])]
        train["genrm_cot"] += ["--data_path", str(labelled["rows"])]
        train["implicit_prm"] += ["--data_path", str(labelled["rows"])]
        train["rm"] += ["--dataset", str(labelled["pairs"])]
    if "implicit_prm" in a.verifiers and not Path(train["implicit_prm"][0]).exists():
        raise SystemExit(f"--verifiers implicit_prm: no {train['implicit_prm'][0]} (pass --implicit_prm_root)")
    seeds, t0 = {}, time.time()
    for seed in a.seeds:
        specs, minutes, learning = [], {}, {}
        for name in a.verifiers:
            out = work / f"{name}_{seed}"
            if name == "rm" and a.rm_path:
                specs.append(f"rm={a.rm_path}")
                continue
            if not (out / "final" / "config.json").exists():
                root = a.implicit_prm_root if name == "implicit_prm" else str(ROOT)
                run_child([*train[name], "--seed", str(seed), "--output_dir", str(out), "--resume", "no"],
                          work / "logs" / f"{name}_{seed}", env=child_env({"PYTHONPATH": root}))
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            minutes[name] = max(r.get("time", 0.0) for r in rows) / 60  # the run's own clock, start-up excluded
            specs.append(f"{name}={out / 'final'}")
            keys = HELD_OUT["genrm" if name.startswith("genrm") else name]
            evals = [r for r in rows if keys[0] in r]
            if evals:  # the run's learning: its first and last held-out evaluations
                learning[name] = {k: [evals[0][k], evals[-1][k]] for k in keys}
        seeds[str(seed)] = {"specs": specs, "train_minutes": minutes, "learning": learning}
        if not a.one_evaluation:
            seeds[str(seed)]["metrics"] = evaluate(work, a, f"evaluate_{seed}", specs, extra)
    if a.one_evaluation:  # every seed's verifiers score the same samples in one run, named <verifier>.s<seed>
        specs = [f"{spec.split('=', 1)[0]}.s{seed}={spec.split('=', 1)[1]}" for seed, r in seeds.items()
                 for spec in r["specs"]]
        metrics = evaluate(work, a, "evaluate", specs, extra)
        for seed, r in seeds.items():
            r["metrics"] = {k: v for k, v in metrics.items() if "." not in k.split("/")[-1].split("@")[0]}
            r["metrics"].update({k.replace(f".s{seed}@", "@"): v for k, v in metrics.items() if f".s{seed}@" in k})
    for seed, r in seeds.items():
        del r["specs"]
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["metrics"].items()
                                           if k.endswith(f"@{max(a.k)}")), flush=True)
    result = {"benchmark": "bon", "command": invocation(), "env": env, "policy": a.policy,
              "num_prompts": a.num_prompts, "num_samples": a.num_samples, "k": a.k,
              "verifiers": a.verifiers, "train_flags": a.train_flags, "rm_flags": a.rm_flags,
              "implicit_prm_flags": a.implicit_prm_flags, "extra": a.extra, "generator": a.generator,
              "rm_path": a.rm_path, "labelled": labelled and {k: v for k, v in labelled.items() if k not in ("rows", "pairs")},
              "seeds": seeds, "minutes": (time.time() - t0) / 60}
    path = write_result("bon", result, Path(a.out_dir) if a.out_dir else None, latest=a.out_dir is None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
