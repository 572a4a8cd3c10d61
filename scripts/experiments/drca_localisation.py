"""Experiment (not a test): do DRCA's credits locate the slip? (docs/drca.md)

    python scripts/experiments/drca_localisation.py                      # builtin:tiny-sft + builtin:tiny-rm, both modes (~3 min)
    python scripts/experiments/drca_localisation.py --scorer line_grader # the upper bound: the per-line grader scores them
    python scripts/experiments/drca_localisation.py --reward_model_path builtin:tiny-cf-rm   # an RM trained on counterfactuals

On the built-in task's held-out slip pairs (the rejected response of a pair: one line off by 1-3, later lines
continued from it), drca.py's step-0 evaluation logs `eval/localisation`: the share of slipped responses whose
lowest-credit unit (d_k = R - R~_k, one unit per line) is the slipped line, with the run's unit extraction,
counterfactual mode and reward model; `eval/localisation_chance` is what a line picked at random would score
(1/3 on the 4-term task). This script runs drca.py once per counterfactual mode for a single step (only the
step-0 evaluation is read) on all 1,500 held-out pairs, and writes docs/bench/drca_localisation/<device>_<time>.json
(rendered into docs/drca.md by scripts/tools/docs_tables.py).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))
from shared.models import resolve_model_path  # noqa: E402

ROOT = bc.ROOT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_name_or_path", default="builtin:tiny-sft")
    p.add_argument("--reward_model_path", default="builtin:tiny-rm")
    p.add_argument("--dataset", default="builtin")
    p.add_argument("--counterfactual", nargs="+", default=["truncate", "mask"], choices=["truncate", "mask"])
    p.add_argument("--scorer", default="rm", choices=["rm", "line_grader"],
                   help="what scores responses and counterfactuals (drca.py --scorer)")
    p.add_argument("--num_pairs", type=int, default=1500, help="held-out slip pairs (1,500: all of the 4-term task)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "drca_localisation", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "drca_localisation")
    a = p.parse_args()
    rows = []
    for mode in a.counterfactual:
        out = a.out / mode
        argv = ["algorithms/drca.py", "--model_name_or_path", a.model_name_or_path, "--reward_model_path",
                a.reward_model_path, "--dataset", a.dataset, "--counterfactual", mode, "--scorer", a.scorer,
                "--localisation_num_pairs", str(a.num_pairs), "--eval_num_prompts", "20", "--eval_num_samples", "1",
                "--dev_num_prompts", "0", "--best_metric", "", "--total_episodes", "512", "--save_every", "0",
                "--no_save_model", "--generator", "hf", "--resume", "no", "--output_dir", str(out),
                "--local_micro_batch_size", "256", "--no_gradient_checkpointing"]  # as the stored runs
        print(f"[localisation] python {shlex.join(argv)}", flush=True)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        child = bc.run_child(argv, a.out / f"log_{mode}")
        first = next(r for r in bc.read_jsonl(out / "metrics.jsonl") if "eval/localisation" in r)
        rows.append({"counterfactual": mode, "localisation": first["eval/localisation"],
                     "chance": first["eval/localisation_chance"],
                     "per_slipped_line": {k.removeprefix("eval/localisation_line"): v for k, v in first.items()
                                          if k.startswith("eval/localisation_line")},
                     "minutes": child["wall_s"] / 60,
                     "command": "python " + shlex.join(argv[:-2])})
        print(f"[localisation] {mode}: {first['eval/localisation']:.3f} (chance "
              f"{first['eval/localisation_chance']:.3f})", flush=True)
    rm_dir = Path(resolve_model_path(a.reward_model_path))  # a built-in or local RM: its own held-out pair accuracy
    rm_evals = [r for r in bc.read_jsonl(rm_dir / "metrics.jsonl") if "eval/accuracy" in r] if (
        rm_dir / "metrics.jsonl").exists() else []
    result = {"benchmark": "drca_localisation", "env": bc.environment(),
              "command": shlex.join(["python", "scripts/experiments/drca_localisation.py", *sys.argv[1:]]),
              "settings": {"model": a.model_name_or_path, "reward_model": a.reward_model_path, "dataset": a.dataset,
                           "num_pairs": a.num_pairs, "scorer": a.scorer,
                           "reward_model_heldout_pair_accuracy": rm_evals[-1]["eval/accuracy"] if rm_evals else None},
              "rows": rows}
    path = bc.write_result("drca_localisation", result, a.results, latest=False)
    print(f"[localisation] wrote {path}")


if __name__ == "__main__":
    main()
