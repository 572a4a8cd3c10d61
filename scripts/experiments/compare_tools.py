"""Experiment (not a test): GRPO with the calculator (grpo_tools.py) against GRPO without it (grpo.py), same task.

    python scripts/experiments/compare_tools.py                                    # seeds 1 2 3, 10,240 episodes per run
    python scripts/experiments/compare_tools.py --seeds 1 --total_episodes 2560    # a quick look

Task: `builtin:sums-10` (10 one-digit terms, 9 running sums; the answer is the last line). Two arms, equal sampled
episodes per run, each from its own SFT start:
  tools:   grpo_tools.py's defaults from `builtin:tiny-tools-sft` (sft.py on the task written with one calculator
           call on the whole sum, the result not trained), --max_new_tokens 64 (the tool's tokens count)
  no tool: grpo.py from sft.py's no-tool start for the task (scripts/experiments/calibrate_sums.py's recipe: sft.py --dataset
           builtin:sums-10 --max_new_tokens 30 --seed 1, built here once), --max_new_tokens 30
Both: --total_episodes N, --seed s, evaluated before and after training on the 500 held-out prompts (4 samples each
at temperature 1, grader accuracy; --eval_every E steps between, 0: none). Also per step: the training reward and,
for the tools arm, the well-formed call rate and calls per episode. Finished runs are reused (their metrics.jsonl has the final evaluation). Writes
docs/bench/tools/<device>_<time>.json (rendered into docs/grpo_tools.md by scripts/tools/docs_tables.py).
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
SFT_NO_TOOL = ["algorithms/sft.py", "--dataset", "builtin:sums-10", "--max_new_tokens", "30", "--dev_num_prompts", "0",
               "--best_metric", "", "--save_every", "0", "--seed", "1"]


def train_argv(arm: str, seed: int, episodes: int, eval_every: int, start: Path, out: Path) -> list[str]:
    common = ["--seed", str(seed), "--total_episodes", str(episodes), "--eval_every", str(eval_every),
              "--sample_every", "0", "--save_every", "0", "--no_save_model", "--dev_num_prompts", "0", "--best_metric",
              "", "--output_dir", str(out)]
    if arm == "tools":
        return ["algorithms/grpo_tools.py", *common]
    return ["algorithms/grpo.py", "--model_name_or_path", str(start), "--dataset", "builtin:sums-10",
            "--max_new_tokens", "30", *common]


def summary(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "per_seed": xs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", default=["tools", "no_tool"], choices=["tools", "no_tool"])
    p.add_argument("--total_episodes", type=int, default=10240)
    p.add_argument("--eval_every", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "tools", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "tools")
    a = p.parse_args()
    start = a.out / "sft_no_tool"
    if "no_tool" in a.arms and not (start / "final" / "config.json").exists():
        print(f"[tools] python {shlex.join(SFT_NO_TOOL)}", flush=True)
        bc.run_child([*SFT_NO_TOOL, "--output_dir", str(start)], a.out / "log_sft_no_tool")
    runs = []
    for seed in a.seeds:
        for arm in a.arms:
            out = a.out / f"{arm}_seed{seed}"
            argv = train_argv(arm, seed, a.total_episodes, a.eval_every, start / "final", out)
            rows = bc.read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            if not any("time/total" in r for r in rows):  # not finished: run it (again)
                print(f"[tools] python {shlex.join(argv)}", flush=True)
                child = bc.run_child(argv, a.out / f"log_{arm}_seed{seed}")
                rows = bc.read_jsonl(out / "metrics.jsonl")
                minutes = child["wall_s"] / 60
            else:
                minutes = None
            evals = [{"step": r["step"], "episodes": r["step"] * a.total_episodes // rows[-1]["step"],
                      "accuracy": r["eval/accuracy"]} for r in rows if "eval/accuracy" in r]
            steps = [r for r in rows if "objective/scores" in r]
            run = {"arm": arm, "seed": seed, "command": "python " + shlex.join(argv[:-2]), "evals": evals,
                   "start_accuracy": evals[0]["accuracy"], "final_accuracy": evals[-1]["accuracy"],
                   "minutes": minutes,
                   "train": [{k: r[k] for k in ("step", "objective/scores", "val/sequence_lengths",
                                                "tools/calls_per_episode", "tools/wellformed_frac",
                                                "tools/turn_limit_frac") if k in r} for r in steps]}
            print(f"[tools] {arm} seed {seed}: held-out accuracy {run['start_accuracy']:.3f} -> "
                  f"{run['final_accuracy']:.3f}", flush=True)
            runs.append(run)
    result = {"benchmark": "tools", "env": bc.environment(), "command": bc.invocation(),
              "task": "builtin:sums-10", "total_episodes": a.total_episodes, "seeds": a.seeds,
              "no_tool_start": "python " + shlex.join(SFT_NO_TOOL), "runs": runs}
    for arm in a.arms:
        mine = [r for r in runs if r["arm"] == arm]
        result[arm] = {k: summary([r[k] for r in mine]) for k in ("start_accuracy", "final_accuracy")}
        if arm == "tools":
            for k in ("tools/wellformed_frac", "tools/calls_per_episode"):
                result[arm][k] = summary([sum(s[k] for s in r["train"]) / len(r["train"]) for r in mine])
    path = bc.write_result("tools", result, a.results, latest=False)
    print(f"[tools] wrote {path}\n{json.dumps({k: result[k] for k in a.arms}, indent=1)}")


if __name__ == "__main__":
    main()
