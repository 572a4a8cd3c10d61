"""Experiment (not a test): opd.py and its fixed-negative-advantage control from the same start (builtin:tiny-sft),
with the teacher's own held-out accuracy measured the same way; rendered on docs/opd.md against grpo.py's stored
default run (docs/bench/grpo_variants, the same evaluation).

    python scripts/experiments/bench_opd.py                              # seeds 1 2 3 (~20 min on 2 cores)
    python scripts/experiments/bench_opd.py --seeds 1 --total_episodes 3072

Three arms, each seed k, every run the script with the flags shown and --seed k (scripts/experiments/bench_headline.py's run_one:
a fresh model cache, finished runs kept in <out>/<arm>/ and not run again):
  teacher  python algorithms/evaluate.py --model_name_or_path builtin:tiny-grpo --eval_num_prompts 500 --seed k: the
           training scripts' held-out evaluation (500 prompts, 4 samples each, the seed's sampling seed)
  opd      python algorithms/opd.py --total_episodes N --eval_every E
  control  the same with --control_adv c: A_t = -c on every generated token, no teacher signal; c = the mean |A_t|
           of the opd runs' first step (opd/adv_abs_mean at step 1, mean over the seeds, 3 decimals), unless given
Writes docs/bench/opd/<device>_<time>.json, rendered by scripts/tools/docs_tables.py.
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
TEACHER = "builtin:tiny-grpo"


def teacher_accuracy(out: Path, seed: int) -> dict:
    """The teacher's held-out accuracy and pass@4 with the evaluation of a training run of seed `seed`."""
    run_dir = out / "teacher" / f"seed{seed}"
    if not (run_dir / "summary.json").exists():
        argv = ["algorithms/evaluate.py", "--model_name_or_path", TEACHER, "--eval_num_prompts", "500",
                "--num_samples", "4",
                "--seed", str(seed), "--num_bootstrap", "0", "--output_dir", str(run_dir)]
        print(f"[bench] teacher seed {seed}: python {' '.join(argv)}", flush=True)
        env = bc.child_env({"CLEANRLHF_CACHE": str(out / "cache")})
        bc.run_child(argv, out / "teacher" / f"log_seed{seed}", env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, **{k: summary["metrics"][k] for k in ("eval/accuracy", "eval/pass@4")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--total_episodes", type=int, default=10240, help="samples per run (20 steps of 512)")
    p.add_argument("--eval_every", type=int, default=2, help="held-out evaluation every this many steps")
    p.add_argument("--control_adv", type=float, help="c of the control arm (default: measured, see above)")
    p.add_argument("--only", choices=["teacher", "opd", "control"], help="run this arm's seeds and stop (no summary): "
                   "one run per invocation, e.g. under a shared lock; the full command then reads them back")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "opd", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "opd")
    a = p.parse_args()
    flags = f"--total_episodes {a.total_episodes} --eval_every {a.eval_every}"
    if a.only == "teacher":
        return print([teacher_accuracy(a.out, s) for s in a.seeds])
    teacher = {str(s): teacher_accuracy(a.out, s) for s in a.seeds} if not a.only else {}
    arm = lambda name, extra: SimpleNamespace(out=a.out / name, flags=f"{flags} {extra}".strip(),  # noqa: E731
                                              stop_after_steps=0)
    opd = {str(s): bh.run_one(arm("opd", ""), "opd", s) for s in a.seeds} if a.only != "control" else {}
    if a.only == "opd":
        return
    c = a.control_adv
    if c is None:
        firsts = [bc.read_jsonl(p) for p in sorted((a.out / "opd" / "opd").glob("seed*/metrics.jsonl"))]
        c = round(sum(next(r["opd/adv_abs_mean"] for r in rows if r.get("step") == 1) for rows in firsts)
                  / len(firsts), 3)
    control = {str(s): bh.run_one(arm("control", f"--control_adv {c}"), "opd", s) for s in a.seeds}
    if a.only == "control":
        return
    k = "eval/accuracy"
    out = {"benchmark": "opd", "env": bc.environment(), "command": bc.invocation(),
           "note": f"opd.py from builtin:tiny-sft with teacher {TEACHER}, {a.total_episodes} samples a run, held-out "
                   f"evaluation every {a.eval_every} steps; the control replaces the teacher's advantage by -c",
           "teacher": {"model": TEACHER, "seeds": teacher,
                       **{m: bh.spread([t[m] for t in teacher.values()]) for m in (k, "eval/pass@4")}},
           "control_adv": c,
           "results": {"opd": bh.summarize("opd", opd, flags),
                       "control": bh.summarize("opd", control, f"{flags} --control_adv {c}")}}
    path = bc.write_result("opd", out, a.results, latest=False, cache=a.out / "opd" / "cache")
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
