"""Experiment (not a test): how hard is `builtin:sums-N` after the usual SFT warm start?

    python scripts/experiments/calibrate_sums.py                       # N = 4 6 8 10, seed 1 (~10 min on 2 cores)
    python scripts/experiments/calibrate_sums.py --terms 6 7 --seeds 1 2

For each N: `algorithms/sft.py` with its default flags (the same recipe that builds `builtin:tiny-sft` from
`builtin:tiny`), on `--dataset builtin:sums-N`, with room for the longer responses (`--max_new_tokens 3N`) and
all 500 held-out problems evaluated at the end (`--eval_num_prompts 500`, 1 sample at temperature 1, as sft.py
evaluates): the sampled held-out accuracy a policy-gradient run would start from. The goal of the calibration is
an N whose accuracy is about 20-40%: room to learn, and many chances to slip mid-chain (the grader accepts only
a whole chain ending on the right sum). Also reported: the run's minutes and peak RSS.

Writes docs/bench/sums_calibration/<device>_<time>.json (rendered into docs/vineppo.md by scripts/tools/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT


def sft_argv(terms: int, seed: int, out: Path) -> list[str]:
    return ["algorithms/sft.py", "--dataset", f"builtin:sums-{terms}", "--max_new_tokens", str(3 * terms),
            "--eval_num_prompts", "500", "--dev_num_prompts", "0", "--best_metric", "", "--save_every", "0",
            "--seed", str(seed), "--output_dir", str(out)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--terms", type=int, nargs="+", default=[4, 6, 8, 10])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "sums_calibration", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "sums_calibration")
    a = p.parse_args()
    runs = []
    for terms in a.terms:
        for seed in a.seeds:
            cache = a.out / f"sums{terms}_seed{seed}.json"
            if cache.exists():  # a finished run is not run again
                runs.append(json.loads(cache.read_text()))
                continue
            out = a.out / f"sums{terms}_seed{seed}"
            argv = sft_argv(terms, seed, out)
            print(f"[calibrate] python {shlex.join(argv)}", flush=True)
            child = bc.run_child(argv, a.out / f"log_sums{terms}_seed{seed}")
            rows = [r for r in bc.read_jsonl(out / "metrics.jsonl") if "eval/accuracy" in r]
            run = {"terms": terms, "seed": seed, "command": "python " + shlex.join(argv[:-2]),
                   # sft.py first evaluates after eval_every steps, not at step 0
                   "first_eval": {"step": rows[0]["step"], "accuracy": rows[0]["eval/accuracy"]},
                   "final_accuracy": rows[-1]["eval/accuracy"],
                   "steps": rows[-1]["step"], "minutes": child["wall_s"] / 60, "peak_rss_mb": child["peak_rss_mb"]}
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(run, indent=1))
            print(f"[calibrate] N={terms} seed {seed}: held-out accuracy after SFT {run['final_accuracy']:.3f} "
                  f"({run['minutes']:.1f} min)", flush=True)
            runs.append(run)
    result = {"benchmark": "sums_calibration", "env": bc.environment(),
              "command": f"python scripts/experiments/calibrate_sums.py --terms {' '.join(map(str, a.terms))} --seeds "
                         f"{' '.join(map(str, a.seeds))}",
              "note": "sft.py default recipe from builtin:tiny on builtin:sums-N; sampled (T=1) held-out accuracy "
                      "on the 500 test problems, 1 sample each", "runs": runs}
    path = bc.write_result("sums_calibration", result, a.results, latest=False)
    print(f"[calibrate] wrote {path}")


if __name__ == "__main__":
    main()
