"""Benchmark (not a test): time of grpo.py's log-prob and training phases per --micro_batching layout (padded,
sorted, packed) on completions of mixed length. Docs: docs/performance.md#micro-batch-layouts-padded-sorted-packed

    python scripts/benchmarks/bench_packing.py              # CPU, 3 layouts x 3 alternating repeats (~10 min on 2 free cores)
    python scripts/benchmarks/bench_packing.py --quick      # smoke run: small batch, 3 steps, 1 repeat (~1-2 min)

Workload (CPU default): the random-init tiny model `builtin:tiny` on the built-in prompts (9 tokens) with
--max_new_tokens 256. Its completions end on EOS at random, so their lengths are spread from 1 to 256 tokens
(geometric-like: a median near 70, about a tenth cut at 256), which is what makes padding expensive: every row of a
`padded` micro-batch is as long as the longest of the whole batch. No completion is correct, so every reward and
advantage is 0, the gradient is exactly 0 and the weights never change: all layouts and repeats train on the same
completions (same seed) with the same compute per step as a learning run (forward, backward, optimizer step).

Contenders, each a fresh `algorithms/grpo.py` subprocess per repeat, alternating (ABC, CBA, ABC): the same flags
but --micro_batching padded | sorted | packed. Per step from metrics.jsonl: time/logprob (old log-probs, no grad),
time/train (every forward/backward/optimizer step of the step), the whole step; the first step of each run is
dropped (warm-up). Reported: min/median/max over the timed steps of all repeats, and per-repeat ratios of the
median phase time of sorted and packed over padded. JSON: docs/bench/packing/<device>_<time>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
LAYOUTS = ("padded", "sorted", "packed")
PHASES = ("generate", "reward", "logprob", "train", "sync")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny", help="policy (random-init tiny model: completions of any length)")
    p.add_argument("--quick", action="store_true", help="smoke run: small batch, 3 steps, 1 repeat")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per layout")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--num_prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--num_generations", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=256, help="completion length limit")
    p.add_argument("--num_minibatches", type=int, default=2, help="optimizer steps per pass over the batch")
    p.add_argument("--num_iterations", type=int, default=2, help="passes over each batch (>1: old log-probs pass)")
    p.add_argument("--micro_batch_size", type=int, default=32, help="completions per forward/backward")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (>0 adds the reference log-prob pass)")
    p.add_argument("--generator", default="vllm", choices=("vllm", "hf"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "docs/bench/packing", help="JSON summary directory")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' directories (metrics, logs) here")
    p.add_argument("--from_runs", type=Path, default=None,
                   help="summarise the finished runs kept by an interrupted `--keep DIR` run (complete repeats only; "
                        "no peak RSS) instead of running")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.num_prompts, a.max_new_tokens = 1, 3, 8, 64
        a.micro_batch_size = 16
        if a.out == ROOT / "docs/bench/packing":
            a.out = ROOT / "runs/bench/packing"
    a.batch = a.num_prompts * a.num_generations
    if a.batch % a.num_minibatches or (a.batch // a.num_minibatches) % a.micro_batch_size:
        p.error(f"batch {a.batch} must split into {a.num_minibatches} minibatches of whole micro-batches of "
                f"{a.micro_batch_size}")
    if a.steps < 2:
        p.error("--steps: need >= 2 (the first step is warm-up)")
    a.gradient_accumulation_steps = a.batch // a.num_minibatches // a.micro_batch_size
    return a


def grpo_argv(a, layout: str, out: Path) -> list[str]:
    return [str(ROOT / "algorithms/grpo.py"), "--micro_batching", layout, "--model_name_or_path", a.model,
            "--output_dir", str(out), "--seed", str(a.seed), "--generator", a.generator,
            "--total_episodes", str(a.batch * a.steps), "--local_num_prompts", str(a.num_prompts),
            "--num_generations", str(a.num_generations), "--max_new_tokens", str(a.max_new_tokens),
            "--num_minibatches", str(a.num_minibatches), "--num_iterations", str(a.num_iterations),
            "--local_micro_batch_size", str(a.micro_batch_size), "--beta", str(a.beta), "--eval_every", "0",
            "--eval_num_prompts", "8", "--eval_num_samples", "1", "--dev_num_prompts", "0", "--sample_every", "0",
            "--save_every", "0", "--no_save_model", "--no_gradient_checkpointing"]


def run_layout(a, layout: str, out: Path) -> dict:
    return read_layout({**bc.run_child(grpo_argv(a, layout, out), out)}, out)


def read_layout(child: dict, out: Path) -> dict:
    rows = bc.read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "time/train" in r]
    timed = steps[1:]  # the first step (warm-up) is only the reference point of the step times
    return {**child, "step_s": bc.step_times_from_rows(rows, "time/train"),
            "phases_s": {ph: [r.get(f"time/{ph}", 0.0) for r in timed] for ph in PHASES},
            "completion_length_mean": [r["val/sequence_lengths"] for r in steps],
            "stop_rate": [r["val/stop_rate"] for r in steps],
            "grad_norm": [r["optim/grad_norm"] for r in steps]}


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        if not ok:
            out[name] = {"error": reps[0]["error"] if reps else "not run"}
            continue
        out[name] = {
            "step_s": bc.summarize([x for r in ok for x in r["step_s"]]),
            **{f"{ph}_s": bc.summarize([x for r in ok for x in r["phases_s"][ph]]) for ph in PHASES},
            "repeat_median_s": {ph: [statistics.median(r["phases_s"][ph]) for r in ok] for ph in ("logprob", "train")},
            "repeat_median_step_s": [statistics.median(r["step_s"]) for r in ok],
            "completion_length_mean": bc.summarize([x for r in ok for x in r["completion_length_mean"]]),
            "stop_rate": bc.summarize([x for r in ok for x in r["stop_rate"]]),
            "peak_rss_mb": bc.summarize([r["peak_rss_mb"] for r in ok]),
        }
    ratios = {}
    base = out.get("padded", {})
    for name in ("sorted", "packed"):
        s = out.get(name, {})
        if "error" in s or "error" in base or not s or not base:
            continue
        for ph in ("logprob", "train"):
            ratios[f"{name}/padded {ph}"] = bc.summarize(bc.paired_ratios(s["repeat_median_s"][ph],
                                                                          base["repeat_median_s"][ph]))
        ratios[f"{name}/padded step"] = bc.summarize(bc.paired_ratios(s["repeat_median_step_s"],
                                                                      base["repeat_median_step_s"]))
    return {"contenders": out, "ratios": ratios}


def main(argv=None) -> dict:
    a = parse_args(argv)
    env = bc.environment()
    print(f"[bench_packing] {env['device']}; {a.repeats} repeats x {a.steps} steps of {a.num_prompts} prompts x "
          f"{a.num_generations}, up to {a.max_new_tokens} new tokens, {a.gradient_accumulation_steps} micro-batches "
          f"of {a.micro_batch_size} per optimizer step; load {env['loadavg_at_start']}", flush=True)
    if a.from_runs:  # the repeats every layout finished (a run is finished when its process wrote final metrics)
        done = lambda d: (d / "metrics.jsonl").exists() and "time/total" in (d / "metrics.jsonl").read_text()  # noqa: E731
        reps = 0
        while all(done(a.from_runs / f"{n}_rep{reps}") for n in LAYOUTS):
            reps += 1
        a.repeats = reps
        runs = {n: [read_layout({"peak_rss_mb": None}, a.from_runs / f"{n}_rep{r}") for r in range(reps)]
                for n in LAYOUTS}
        env["note"] = (f"summarised with --from_runs from the {reps} repeats every layout finished; env is the "
                       "summary's, not the runs'")
    else:
        with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
            base = a.keep or Path(tmp)
            runs = bc.run_repeats(list(LAYOUTS), a.repeats,
                                  lambda name, rep: run_layout(a, name, base / f"{name}_rep{rep}"),
                                  lambda r: f"median train {statistics.median(r['phases_s']['train']):.2f}s, logprob "
                                            f"{statistics.median(r['phases_s']['logprob']):.2f}s")
    import os

    summary = summarize(runs)
    result = {"benchmark": "packing", "env": env, "command": bc.invocation(argv and [sys.argv[0], *argv]),
              "loadavg_at_end": list(os.getloadavg()),
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              **summary, "runs": runs}
    path = bc.write_result("packing", result, a.out, latest=False)
    rows = [{"layout": name, **{f"{ph} med": s.get(f"{ph}_s", {}).get("median") for ph in ("logprob", "train")},
             "step med": s.get("step_s", {}).get("median"), "length": s.get("completion_length_mean", {}).get("median"),
             "peak RSS MB": s.get("peak_rss_mb", {}).get("max")} for name, s in summary["contenders"].items()]
    print(bc.table(rows, ["layout", "logprob med", "train med", "step med", "length", "peak RSS MB"]))
    print(bc.table([{"ratio": k, **v} for k, v in summary["ratios"].items()], ["ratio", "min", "median", "max", "n"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
