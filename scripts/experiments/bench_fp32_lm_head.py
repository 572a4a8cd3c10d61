"""Experiment (not a test): the sampler/trainer mismatch (val/sampler_kl) of grpo.py in bf16 with and without
--fp32_lm_head, on the built-in task. Docs: docs/mismatch.md

    python scripts/experiments/bench_fp32_lm_head.py                        # seeds 1 2 3, 10 steps a run (~20 min on 2 cores)
    python scripts/experiments/bench_fp32_lm_head.py --seeds 1 --steps 3    # a smoke run
    python scripts/experiments/bench_fp32_lm_head.py --real_model 4         # SmolLM2-135M (vocabulary 49,152), seed 1

The scripts train in fp32 on CPU (bf16 on GPU: shared/distributed.py default_dtype), where the flag computes exactly
what the layer did; so each run here is grpo.py with default_dtype replaced by bf16 in its own process (`--child`):
the policy, its LM head and the vLLM engine run in bf16, as on a GPU. Each seed runs both arms (`off`: grpo.py's
default, `on`: --fp32_lm_head), in alternating order, from builtin:tiny-sft, `--steps` steps of grpo.py's default
batch, held-out accuracy at the start and the end. Reported per arm: the mismatch diagnostics averaged over a run's
steps (val/sampler_kl, val/sampler_logprob_diff, val/tis_ratio_p99), per seed and mean (min-max) over seeds, the
ratio on / off of val/sampler_kl per seed, the accuracy, and the mean seconds of a step's training and generation
(on a machine shared with other jobs: indicative only).

`--real_model STEPS` runs instead grpo.py on builtin:smollm2-135m (the chat model shipped offline, a vocabulary of
49,152 where the tiny model has 100) with scripts/experiments/bench_real_model_grpo.py's task and settings (a short
evaluation: 20 prompts, 1 sample), both arms, seed 1, STEPS steps, in bf16 likewise; the diagnostics step by step.

Writes docs/bench/fp32_lm_head/<device>_<time>.json (`--results`); `render(d)` gives its markdown table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
ARMS = {"off": [], "on": ["--fp32_lm_head"]}
DIAGNOSTICS = ("val/sampler_kl", "val/sampler_logprob_diff", "val/tis_ratio_p99", "time/train", "time/generate")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=10, help="training steps a run (grpo.py's batch: 64 prompts x 8)")
    p.add_argument("--eval_num_prompts", type=int, default=100, help="held-out prompts at the start and the end")
    p.add_argument("--real_model", type=int, default=0, metavar="STEPS",
                   help="instead: grpo.py on builtin:smollm2-135m for STEPS steps, both arms, seed 1")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "fp32_lm_head", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "fp32_lm_head",
                   help="JSON summary directory")
    return p.parse_args(argv)


def child(argv: list[str]) -> None:
    """`--child ARGS`: grpo.py ARGS with the models in bf16 (default_dtype replaced before grpo.py imports it)."""
    import runpy

    import torch

    import shared.distributed

    shared.distributed.default_dtype = lambda device: torch.bfloat16
    sys.argv = ["algorithms/grpo.py", *argv]
    runpy.run_path(str(ROOT / "algorithms" / "grpo.py"), run_name="__main__")


def grpo_argv(a, arm: str, seed: int, out: Path) -> list[str]:
    return ["--output_dir", str(out), "--seed", str(seed), "--total_episodes", str(a.steps * 512),
            "--eval_every", "0", "--eval_num_prompts", str(a.eval_num_prompts), "--no_save_model", *ARMS[arm]]


def run_one(a, arm: str, seed: int) -> dict:
    """One run (kept when its metrics are complete): its diagnostics averaged over its steps and its accuracy."""
    out = a.out / arm / f"seed{seed}"
    argv = grpo_argv(a, arm, seed, out)
    metrics = out / "metrics.jsonl"
    wall = None
    if not metrics.exists() or not any("time/total" in r for r in bc.read_jsonl(metrics)):
        print(f"[bench_fp32_lm_head] {arm} seed {seed}: grpo.py (bf16) {shlex.join(argv)}", flush=True)
        wall = bc.run_child([str(Path(__file__).resolve()), "--child", *argv], a.out / arm / f"log_seed{seed}")["wall_s"]
    rows = bc.read_jsonl(metrics)
    evals = [r for r in rows if "eval/accuracy" in r]
    r = {"start": evals[0]["eval/accuracy"], "final": evals[-1]["eval/accuracy"], "wall_s": wall,
         "steps": sum("val/sampler_kl" in row for row in rows)}
    for key in DIAGNOSTICS:
        xs = [row[key] for row in rows if key in row]
        r[key] = sum(xs) / len(xs) if xs else None
    return r


def real_model(a) -> dict:
    """Both arms of grpo.py on SmolLM2-135M-Instruct (bench_real_model_grpo.py's task and settings, seed 1, a short
    evaluation) in bf16, a.real_model steps each: {arm: {"command", "steps": [{step, diagnostics}], means}}."""
    import bench_real_model_grpo as brm

    dataset = brm.write_data(a.out / "real_model" / "data")
    settings = argparse.Namespace(learning_rate=1e-5, total_episodes=128 * a.real_model, eval_every=0,
                                  generator="vllm", stop_after_steps=0)
    out = {}
    for arm in ARMS:
        run_dir = a.out / "real_model" / arm
        argv = brm.grpo_args(settings, 1, dataset, run_dir)[1:]
        for flag, value in (("--eval_num_prompts", "20"), ("--eval_num_samples", "1")):  # a short evaluation
            argv[argv.index(flag) + 1] = value
        argv += ["--no_save_model", *ARMS[arm]]
        metrics = run_dir / "metrics.jsonl"
        if not metrics.exists() or not any("time/total" in r for r in bc.read_jsonl(metrics)):
            print(f"[bench_fp32_lm_head] real model, {arm}: grpo.py (bf16) {shlex.join(argv)}", flush=True)
            bc.run_child([str(Path(__file__).resolve()), "--child", *argv], a.out / "real_model" / f"log_{arm}")
        rows = [r for r in bc.read_jsonl(metrics) if "val/sampler_kl" in r]
        out[arm] = {"command": "python algorithms/grpo.py " + shlex.join(argv),
                    "steps": [{"step": r["step"], **{k: r[k] for k in DIAGNOSTICS if k in r}} for r in rows],
                    **{k: sum(r[k] for r in rows) / len(rows) for k in DIAGNOSTICS}}
    return out


def spread(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None) -> dict:
    a = parse_args(argv)
    env = bc.environment()
    print(f"[bench_fp32_lm_head] {env['device']}; ATen {env['aten_cpu_capability']}; load {env['loadavg_at_start']}",
          flush=True)
    if a.real_model:
        arms = real_model(a)
        result = {"benchmark": "fp32_lm_head_real_model", "env": env,
                  "command": bc.invocation(argv and [sys.argv[0], *argv]),
                  "note": "grpo.py in bf16 on SmolLM2-135M-Instruct (default_dtype replaced in the child), with and "
                          "without --fp32_lm_head, seed 1; diagnostics per step and their means",
                  "steps": a.real_model, "arms": arms,
                  "sampler_kl_on_over_off": arms["on"]["val/sampler_kl"] / arms["off"]["val/sampler_kl"]}
        path = bc.write_result("fp32_lm_head", result, a.results, latest=False)
        print(render(result))
        print(f"wrote {path}")
        return result
    runs = {arm: {} for arm in ARMS}
    for i, seed in enumerate(a.seeds):
        for arm in bc.alternating_order(list(ARMS), i):
            runs[arm][str(seed)] = r = run_one(a, arm, seed)
            print(f"  {arm} seed {seed}: val/sampler_kl {r['val/sampler_kl']:.3g}, eval/accuracy "
                  f"{r['start']:.3f} -> {r['final']:.3f}", flush=True)
    arms = {}
    for arm, seeds in runs.items():
        arms[arm] = {"command": "python algorithms/grpo.py " + shlex.join(grpo_argv(a, arm, 0, Path("OUT"))[4:]),
                     **{k: spread([r[k] for r in seeds.values()]) for k in ("start", "final", *DIAGNOSTICS)},
                     "seeds": seeds}
    ratio = {s: runs["on"][s]["val/sampler_kl"] / runs["off"][s]["val/sampler_kl"] for s in runs["on"]}
    result = {"benchmark": "fp32_lm_head", "env": env, "command": bc.invocation(argv and [sys.argv[0], *argv]),
              "note": "grpo.py in bf16 on the built-in task (default_dtype replaced in the child), with and without "
                      "--fp32_lm_head; diagnostics: means over a run's steps",
              "steps": a.steps, "arms": arms, "sampler_kl_on_over_off": ratio}
    path = bc.write_result("fp32_lm_head", result, a.results, latest=False)
    print(render(result))
    print(f"wrote {path}")
    return result


def render(d: dict) -> str:
    """The markdown table of one stored summary: per arm, mean (min-max) over seeds, and the command (a
    --real_model summary: per arm, each step's val/sampler_kl and the means)."""
    env = d["env"]
    if d.get("benchmark") == "fp32_lm_head_real_model":
        steps = [s["step"] for s in d["arms"]["off"]["steps"]]
        lines = ["| --fp32_lm_head | val/sampler_kl at steps " + ", ".join(map(str, steps)) + " | mean val/sampler_kl "
                 "| mean val/sampler_logprob_diff | mean val/tis_ratio_p99 |", "| --- | --- | --- | --- | --- |"]
        for arm, r in d["arms"].items():
            kls = ", ".join(f"{s['val/sampler_kl']:.3g}" for s in r["steps"])
            lines.append(f"| {arm} | {kls} | "
                         f"{r['val/sampler_kl']:.3g} | {r['val/sampler_logprob_diff']:.3g} | "
                         f"{r['val/tis_ratio_p99']:.4g} |")
        lines += ["", f"val/sampler_kl on / off: {d['sampler_kl_on_over_off']:.2f}. grpo.py in bf16 on "
                  f"builtin:smollm2-135m, seed 1, {d['steps']} steps, vLLM {env.get('vllm')} on {env['device']} "
                  f"(ATen {env.get('aten_cpu_capability')}). Command: `"
                  + d["command"] + "`"]
        return "\n".join(lines)

    def cell(s: dict, digits: int = 3) -> str:
        return f"{s['mean']:.{digits}g} ({s['min']:.{digits}g}-{s['max']:.{digits}g})"

    seeds = sorted(next(iter(d["arms"].values()))["seeds"])
    lines = ["| --fp32_lm_head | val/sampler_kl | val/sampler_logprob_diff | val/tis_ratio_p99 | eval/accuracy start "
             "-> end | train s/step | generate s/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, r in d["arms"].items():
        lines.append(f"| {arm} | {cell(r['val/sampler_kl'])} | {cell(r['val/sampler_logprob_diff'])} | "
                     f"{cell(r['val/tis_ratio_p99'], 4)} | {r['start']['mean']:.3f} -> {r['final']['mean']:.3f} | "
                     f"{r['time/train']['mean']:.1f} | {r['time/generate']['mean']:.1f} |")
    ratios = ", ".join(f"{d['sampler_kl_on_over_off'][s]:.2f}" for s in seeds)
    lines += ["", f"val/sampler_kl on / off per seed ({', '.join(seeds)}): {ratios}. grpo.py in bf16 (the GPU's dtype; "
              f"the scripts use fp32 on CPU), {d['steps']} steps a run from builtin:tiny-sft, vLLM "
              f"{env.get('vllm')} on {env['device']} (ATen {env.get('aten_cpu_capability')}); means over a run's "
              "steps, then mean (min-max) over seeds; step times on a "
              "shared machine. Command: `" + d["command"] + "`"]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
