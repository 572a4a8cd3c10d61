"""Experiment (not a test): on-policy self-distillation (opd.py --self_distillation --teacher_context reference: the
teacher is a frozen copy of the start model reading the row's gold answer in its prompt) against grpo.py, at equal
training samples from the same start (builtin:tiny-sft), held-out accuracy against samples, 3 seeds. Rendered on
docs/opd.md by render() below (registered in scripts/tools/docs_tables.py).

    python scripts/experiments/bench_opd_self_distillation.py                  # seeds 1 2 3, 5,120 samples a run
    python scripts/experiments/bench_opd_self_distillation.py --seeds 1 --total_episodes 2048 --eval_every 2

Two arms, each seed k, every run the script with the flags shown and --seed k (scripts/experiments/bench_headline.py's
run_one: a fresh model cache, finished runs kept in <out>/<arm>/ and not run again):
  grpo  python algorithms/grpo.py --total_episodes N --eval_every E
  opsd  python algorithms/opd.py --total_episodes N --eval_every E --self_distillation --teacher_context reference
Both arms sample 512 completions a step (their default batch), so step s is s x 512 training samples in each.
Writes docs/bench/opd_self_distillation/<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
import bench_headline as bh  # noqa: E402

ROOT = bc.ROOT
ARMS = {"grpo": ("grpo", ""), "opsd": ("opd", "--self_distillation --teacher_context reference")}


def spread3(xs: list[float]) -> str:
    """mean (min-max) over seeds, 3 decimals."""
    return f"{sum(xs) / len(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def render(d: dict) -> str:
    """docs/opd.md: held-out accuracy against training samples of both arms, mean (min-max) over seeds, and the
    commands, machine and minutes per run."""
    k = "eval/accuracy"
    res = d["results"]
    curves = {arm: {s: {pt["samples"]: pt[k] for pt in run["curve"]} for s, run in r["seeds"].items()}
              for arm, r in res.items()}
    counts = sorted({n for c in curves.values() for run in c.values() for n in run})
    names = {"grpo": "grpo.py", "opsd": "opd.py --self_distillation --teacher_context reference"}
    lines = ["| training samples | " + " | ".join(f"{names[a]}: held-out accuracy" for a in curves) + " |",
             "|---" * (len(curves) + 1) + "|"]
    for n in counts:
        cells = [spread3([run[n] for run in c.values()]) if all(n in run for run in c.values()) else ""
                 for c in curves.values()]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    e = d["env"]
    first = {a: re.sub(r" --seed [0-9]+", "", next(iter(r["seeds"].values()))["command"]) + " --seed <k>"
             for a, r in res.items()}
    kl = d.get("opsd_teacher_kl_step1")
    lines += ["", f"Seeds {', '.join(next(iter(res.values()))['seeds'])}, one start model (builtin:tiny-sft), 500 "
                  f"held-out prompts, 4 samples each; training samples: completions sampled for training. "
                  + "; ".join(f"{names[a]}: `{c}`" for a, c in first.items())
                  + f" (`{d['command']}`, {e['device']}"
                  + (f" (ATen kernels {e['aten_cpu_capability']})" if e.get("aten_cpu_capability") else "")
                  + "); minutes per run: "
                  + ", ".join(f"{a} {r['minutes']['mean']:.1f}" for a, r in res.items())
                  + " (other jobs shared the cores)."
                  + (f" The self-teacher's single-sample reverse KL to the student on the first batch "
                     f"(`opd/teacher_kl` at step 1): {spread3(kl)} nats per token." if kl else "")]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--total_episodes", type=int, default=5120, help="samples per run (10 steps of 512)")
    p.add_argument("--eval_every", type=int, default=2, help="held-out evaluation every this many steps")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "opd_self_distillation",
                   help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "opd_self_distillation")
    a = p.parse_args()
    flags = f"--total_episodes {a.total_episodes} --eval_every {a.eval_every}"
    results = {}
    for arm, (script, extra) in ARMS.items():
        run = SimpleNamespace(out=a.out / arm, flags=f"{flags} {extra}".strip(), stop_after_steps=0)
        runs = {str(s): bh.run_one(run, script, s) for s in a.seeds}
        results[arm] = bh.summarize(script, runs, run.flags)
    first_kl = []
    for s in a.seeds:
        rows = bc.read_jsonl(a.out / "opsd" / "opd" / f"seed{s}" / "metrics.jsonl")
        first_kl.append(next(r["opd/teacher_kl"] for r in rows if r.get("step") == 1 and "opd/teacher_kl" in r))
    out = {"benchmark": "opd_self_distillation", "env": bc.environment(), "command": bc.invocation(),
           "note": f"from builtin:tiny-sft, {a.total_episodes} samples a run (512 a step in both arms), held-out "
                   f"evaluation every {a.eval_every} steps; opsd: the teacher is a frozen copy of the start model "
                   f"reading opd.py's default --teacher_template with the row's gold answer",
           "opsd_teacher_kl_step1": first_kl, "results": results}
    path = bc.write_result("opd_self_distillation", out, a.results, latest=False, cache=a.out / "grpo" / "cache")
    print(f"[bench] wrote {path}")
    print(render(out))


if __name__ == "__main__":
    main()
