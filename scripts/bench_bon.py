"""Best-of-N with every verifier on the same policy samples: one table for docs/genrm.md.

    python scripts/bench_bon.py --seeds 1 2 3 --out_dir docs/bench/bon

For each seed the verifiers are trained by their scripts' default runs with that seed (plus --train_flags for
genrm.py): genrm.py direct and `--verifier cot`, rm.py's Bradley-Terry model on its built-in preference pairs, and
implicit_prm.py's implicit PRM (scored as the minimum over lines of its line rewards); then algorithms/evaluate.py
samples --num_samples completions of the policy per held-out prompt (the same samples for every seed: evaluate.py's
--seed stays 1) and scores each with each verifier. Per N in --k: first sample (eval/pass@1, the mean accuracy),
majority vote (maj@N), each verifier's best-of-N (bon/<name>@N) and weighted vote, and pass@N, the ceiling; mean and
min-max over the seeds.
Writes <out_dir>/cpu_<time>.json (docs/genrm.md renders it with scripts/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts.bench_common import child_env, environment, invocation, run_child, write_result  # noqa: E402


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
    p.add_argument("--train_flags", nargs="*", default=[], help="flags added to every verifier's training run")
    p.add_argument("--work_dir", default="runs/bench_bon")
    p.add_argument("--out_dir", default=None, help="where the JSON goes (default runs/bench/bon)")
    p.add_argument("--extra", nargs="*", default=[], help="flags added to every evaluate.py run")
    a = p.parse_args()
    env = environment()
    work = Path(a.work_dir)
    train = {"genrm_direct": ["algorithms/genrm.py", "--model_name_or_path", a.policy],
             "genrm_cot": ["algorithms/genrm.py", "--model_name_or_path", a.policy, "--verifier", "cot"],
             "rm": ["algorithms/rm.py"],
             "implicit_prm": [str(Path(a.implicit_prm_root) / "algorithms" / "implicit_prm.py")]}
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
                flags = a.train_flags if name.startswith("genrm") else []
                root = a.implicit_prm_root if name == "implicit_prm" else str(ROOT)
                run_child([*train[name], "--seed", str(seed), "--output_dir", str(out), "--resume", "no", *flags],
                          work / "logs" / f"{name}_{seed}", env=child_env({"PYTHONPATH": root}))
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            minutes[name] = max(r.get("time", 0.0) for r in rows) / 60  # the run's own clock, start-up excluded
            specs.append(f"{name}={out / 'final'}")
            if name.startswith("genrm"):  # the default run's learning: its first and last held-out evaluations
                evals = [r for r in rows if "eval/auroc" in r]
                learning[name] = {k: [evals[0][k], evals[-1][k]] for k in ("eval/auroc", "eval/p_yes_correct",
                                                                            "eval/p_yes_incorrect", "eval/no_verdict_frac")}
        ev = work / f"evaluate_{seed}"
        run_child(["algorithms/evaluate.py", "--model_name_or_path", a.policy, "--generator", "hf", "--output_dir",
                   str(ev), "--num_prompts", str(a.num_prompts), "--num_samples", str(a.num_samples), "--k", "1",
                   *map(str, a.k), "--num_bootstrap", "0", "--verifiers", *specs, *a.extra],
                  work / "logs" / f"evaluate_{seed}", env=child_env())
        summary = json.loads((ev / "summary.json").read_text())
        seeds[str(seed)] = {"metrics": summary["metrics"], "train_minutes": minutes, "learning": learning}
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["metrics"].items()
                                           if k.endswith(f"@{max(a.k)}")), flush=True)
    result = {"benchmark": "bon", "command": invocation(), "env": env, "policy": a.policy,
              "num_prompts": a.num_prompts, "num_samples": a.num_samples, "k": a.k,
              "verifiers": a.verifiers, "train_flags": a.train_flags,
              "rm_path": a.rm_path,
              "seeds": seeds, "minutes": (time.time() - t0) / 60}
    path = write_result("bon", result, Path(a.out_dir) if a.out_dir else None, latest=a.out_dir is None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
