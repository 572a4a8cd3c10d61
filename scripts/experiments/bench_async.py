"""Experiment (not a test): grpo_async.py against grpo.py (synchronous), for speed and for learning.
Docs: docs/grpo_async.md

    python scripts/experiments/bench_async.py                          # speed (3 alternating repeats) + learning (3 seeds each)
    python scripts/experiments/bench_async.py --parts speed            # step time only (~10 min on 2 free cores)
    python scripts/experiments/bench_async.py --parts learning --stop_after_steps 100   # spread over sessions: rerun to continue
    python scripts/experiments/bench_async.py --parts learning --variants sync async1 sync_iter1 async1_iter1 async1_tis_mask
    python scripts/experiments/bench_async.py --parts speed learning --steps 3 --repeats 1 --seeds 1 \\
        --flags "--total_episodes 1024" --cache ~/.cache/cleanrlhf --out /tmp/ba --results /tmp/ba   # smoke run

(a) speed: `algorithms/grpo.py` and `algorithms/grpo_async.py` with the default run's batch (64 prompts x 8, 16 new
tokens, builtin:tiny-sft) for `--steps` steps, no evaluation, a fresh subprocess per
repeat, alternating (AB, BA, AB). Per step from metrics.jsonl: the wall time between consecutive step rows (the first
step is warm-up, never counted) and each phase: `time/generate` (async: the generation's own time, overlapped
with training), `time/generate_wait` (the trainer's wait for it), `time/train`, `time/logprob`, `time/sync`.
Reported: min/median/max over the timed steps of all repeats, and the per-repeat ratio of async's median step time
to sync's. On one device (this CPU) generation and training share the cores, so expect a ratio near 1
(docs/grpo_async.md says why); the gain is for an engine on its own GPU.

(b) learning: the default run (`python algorithms/grpo.py --seed k`, 102,400 samples) and the same run of
`algorithms/grpo_async.py`, seeds 1 2 3, equal samples, same start model, through scripts/experiments/bench_headline.py's run_one (a
finished run is cached in <out>/<variant>/<script>/seed<k>.json and not rerun). `--variants` adds the runs that test why
async may learn less: one pass over each batch instead of two (`--num_iterations 1`, sync and async: half the
updates per batch, so one step of staleness is 2 updates instead of 4) and async with `--tis token_mask` (tokens
whose pi_old / mu lies outside [1/C, C] dropped, instead of the weights above C lowered to C); and DeepSeek-V3.2's
corrections on async's stale batches (`async1_opsm`, `async1_kl`, `async1_kl_unbiased`; LEARNING says why these
settings). Reported: held-out accuracy at start, at the end and its gain per seed, the mean staleness, the share of
completions the off-policy mask dropped, wall minutes, and each variant's gain minus its pair's (PAIRS).

    python scripts/experiments/bench_async.py --parts learning --variants async1 async1_opsm async1_kl async1_kl_unbiased

Writes docs/bench/async/<device>_<time>.json (`--results`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
import bench_headline as bh  # noqa: E402

ROOT = bc.ROOT
PHASES = ("generate", "generate_wait", "reward", "logprob", "train", "sync")
SPEED = {"sync": "grpo", "async1": "grpo_async"}  # contender -> script
# learning: variant -> (script, extra flags of the default run); each variant is compared with its pair (PAIRS)
# at the same settings (--variants picks which run; a pair's missing side is left out of the differences)
LEARNING = {"sync": ("grpo", ""), "async1": ("grpo_async", ""),
            "sync_iter1": ("grpo", "--num_iterations 1"), "async1_iter1": ("grpo_async", "--num_iterations 1"),
            "async1_tis_mask": ("grpo_async", "--tis token_mask"),
            # DeepSeek-V3.2's corrections on stale batches: delta = 0.1, as TRL's example value 0.5 drops almost no
            # completion on this task (12-step runs of grpo_async.py), so that the mask acts at all (the share it drops
            # is logged, policy/off_policy_masked); the KL pair at DeepSeekMath's beta = 0.04, with and without the
            # importance-weighted (unbiased) estimate
            "async1_opsm": ("grpo_async", "--off_policy_mask_threshold 0.1"),
            "async1_kl": ("grpo_async", "--beta 0.04"),
            "async1_kl_unbiased": ("grpo_async", "--beta 0.04 --use_bias_correction_kl")}
# variant -> the run it is compared with: the synchronous pair at the same settings, or the async run a flag is added to
PAIRS = {"async1": "sync", "async1_iter1": "sync_iter1", "async1_tis_mask": "sync", "async1_opsm": "async1",
         "async1_kl": "async1", "async1_kl_unbiased": "async1_kl"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["speed", "learning"], choices=["speed", "learning"])
    p.add_argument("--steps", type=int, default=6, help="speed: steps per run; the first is warm-up")
    p.add_argument("--repeats", type=int, default=3, help="speed: alternating repeats per contender")
    p.add_argument("--num_prompts", type=int, default=64, help="speed: prompts per step (the default run's)")
    p.add_argument("--max_new_tokens", type=int, default=16, help="speed: completion length limit")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="learning: seeds per variant")
    p.add_argument("--variants", nargs="+", default=["sync", "async1"], choices=list(LEARNING),
                   help="learning: which runs (flags: LEARNING in this file); each is compared with its pair (PAIRS), "
                        "when that runs too")
    p.add_argument("--flags", default="", help="learning: extra flags for every run, one string (e.g. a smaller "
                                               "--total_episodes for a smoke run; equal for both variants)")
    p.add_argument("--stop_after_steps", type=int, default=0, help="learning: stop (resumable) after this many steps")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "async", help="work directory")
    p.add_argument("--cache", type=Path, default=None,
                   help="learning: reuse this built-in model cache (default: a fresh one in <out>/cache, the warm "
                        "start built by sft.py first, as bench_headline.py does)")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "async", help="JSON summary directory")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps: need >= 2 (the first step is warm-up)")
    return a


# --- (a) speed ----------------------------------------------------------------------------------------------------
def grpo_argv(a, script: str, out: Path) -> list[str]:
    return [f"algorithms/{script}.py", "--output_dir", str(out), "--seed", "1",
            "--total_episodes", str(a.num_prompts * 8 * a.steps), "--local_num_prompts", str(a.num_prompts),
            "--local_micro_batch_size", str(min(256, a.num_prompts * 4)),  # the default's, or a half-batch minibatch
            "--max_new_tokens", str(a.max_new_tokens), "--eval_every", "0", "--eval_num_prompts", "8",
            "--eval_num_samples", "1", "--dev_num_prompts", "0", "--sample_every", "0", "--save_every", "0",
            "--no_save_model", "--no_gradient_checkpointing"]


def run_speed(a, name: str, out: Path, env: dict) -> dict:
    child = bc.run_child(grpo_argv(a, SPEED[name], out), out, env=env)
    rows = bc.read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "time/train" in r]
    return {"wall_s": child["wall_s"], "peak_rss_mb": child["peak_rss_mb"],
            "step_s": bc.step_times_from_rows(rows, "time/train"),
            "phases_s": {ph: [r.get(f"time/{ph}", 0.0) for r in steps[1:]] for ph in PHASES},
            "staleness": [r.get("async/staleness", 0) for r in steps]}


def speed(a) -> dict:
    env = bc.child_env({"CLEANRLHF_CACHE": str(a.cache)} if a.cache else None)
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        runs = bc.run_repeats(list(SPEED), a.repeats, lambda name, rep: run_speed(a, name, Path(tmp) / f"{name}_{rep}",
                                                                                   env),
                              lambda r: f"median step {statistics.median(r['step_s']):.2f}s")
    out = {}
    for name, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        out[name] = {"error": reps[0]["error"]} if not ok else {
            "script": SPEED[name], "async_steps": int(SPEED[name] == "grpo_async"),
            "step_s": bc.summarize([x for r in ok for x in r["step_s"]]),
            **{f"{ph}_s": bc.summarize([x for r in ok for x in r["phases_s"][ph]]) for ph in PHASES},
            "repeat_median_step_s": [statistics.median(r["step_s"]) for r in ok],
            "staleness": sorted({s for r in ok for s in r["staleness"]}),
            "peak_rss_mb": bc.summarize([r["peak_rss_mb"] for r in ok])}
    ratio = None
    if all("error" not in out[n] for n in SPEED):
        ratio = bc.summarize(bc.paired_ratios(out["async1"]["repeat_median_step_s"], out["sync"]["repeat_median_step_s"]))
    return {"settings": {"steps": a.steps, "repeats": a.repeats, "num_prompts": a.num_prompts, "num_generations": 8,
                         "max_new_tokens": a.max_new_tokens},
            "contenders": out, "async1/sync step": ratio, "runs": runs}


# --- (b) learning -------------------------------------------------------------------------------------------------
def learning(a) -> dict | None:
    cache = a.out / "cache"  # one start model for both variants (run_one uses <variant out>/cache)
    if a.cache and not cache.exists():
        a.out.mkdir(parents=True, exist_ok=True)
        cache.symlink_to(a.cache.expanduser().resolve())
    cache.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.variants:
        script, extra = LEARNING[name]
        sub = SimpleNamespace(out=a.out / name, flags=f"{extra} {a.flags}".strip(), stop_after_steps=a.stop_after_steps)
        sub.out.mkdir(parents=True, exist_ok=True)
        if not (sub.out / "cache").exists():
            (sub.out / "cache").symlink_to(cache.resolve())
        runs = {}
        for seed in a.seeds:
            r = bh.run_one(sub, script, seed)
            if r is None:  # stopped after --stop_after_steps: rerun the same command
                return None
            rows = bc.read_jsonl(sub.out / script / f"seed{seed}" / "metrics.jsonl")
            stale = [row["async/staleness"] for row in rows if "async/staleness" in row]
            r["staleness_mean"] = sum(stale) / len(stale) if stale else 0.0
            for key in ("val/tis_clipfrac", "val/sampler_logprob_diff", "policy/off_policy_masked"):  # mean over steps
                xs = [row[key] for row in rows if key in row]
                r[f"{key.split('/')[1]}_mean"] = sum(xs) / len(xs) if xs else None
            runs[str(seed)] = r
        keys = bh.METRICS["grpo"]
        results[name] = {
            "flags": sub.flags, "command": f"python algorithms/{script}.py {sub.flags}".strip(),
            "start": {k: bh.spread([r["start"][k] for r in runs.values()]) for k in keys},
            "final": {k: bh.spread([r["final"][k] for r in runs.values()]) for k in keys},
            "gain": bh.spread([r["final"][keys[0]] - r["start"][keys[0]] for r in runs.values()]),
            "staleness_mean": bh.spread([r["staleness_mean"] for r in runs.values()]),
            **{k: bh.spread([r[k] for r in runs.values()]) for k in ("tis_clipfrac_mean", "sampler_logprob_diff_mean",
                                                                      "off_policy_masked_mean")
               if all(r.get(k) is not None for r in runs.values())},
            "minutes": bh.spread([bh.wall_minutes(r) for r in runs.values()]),
            "seeds": runs,
        }
    return {**results, **gain_differences(results)}


def gain_differences(results: dict) -> dict:
    """For each async variant whose sync pair (PAIRS) ran too, "<variant>_minus_<pair>_gain": {seed: the variant's
    held-out accuracy gain (final - start) minus the pair's}, over the seeds both ran."""
    gain = lambda r: r["final"]["eval/accuracy"] - r["start"]["eval/accuracy"]  # noqa: E731
    out = {}
    for name, pair in PAIRS.items():
        if name in results and pair in results:
            s, x = results[pair]["seeds"], results[name]["seeds"]
            out[f"{name}_minus_{pair}_gain"] = {seed: gain(x[seed]) - gain(s[seed]) for seed in sorted(set(s) & set(x))}
    return out


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    env = bc.environment()
    print(f"[bench_async] {env['device']}; parts {' '.join(a.parts)}; load {env['loadavg_at_start']}", flush=True)
    result = {"benchmark": "async", "env": env, "command": bc.invocation(argv and [sys.argv[0], *argv]),
              "note": "grpo_async.py vs grpo.py (synchronous) on the built-in task; speed on one device "
                      "(generation and training share it), learning at equal samples"}
    if "speed" in a.parts:
        result["speed"] = speed(a)
        c = result["speed"]["contenders"]
        print(bc.table([{"contender": n, **{f"{ph} med": v.get(f"{ph}_s", {}).get("median") for ph in
                                             ("generate", "generate_wait", "train")},
                         "step med": v.get("step_s", {}).get("median")} for n, v in c.items()],
                       ["contender", "generate med", "generate_wait med", "train med", "step med"]))
        print(f"async1/sync step time: {result['speed']['async1/sync step']}")
    if "learning" in a.parts:
        learned = learning(a)
        if learned is None:
            print("[bench_async] a learning run stopped after --stop_after_steps; rerun the same command to continue")
            return None
        result["learning"] = learned
        for name in a.variants:
            r = learned[name]
            print(f"{name}: eval/accuracy {r['start']['eval/accuracy']['mean']:.3f} -> "
                  f"{r['final']['eval/accuracy']['mean']:.3f} (gain {r['gain']['mean']:+.3f}, "
                  f"{r['minutes']['mean']:.1f} min, staleness {r['staleness_mean']['mean']:.2f})")
    path = bc.write_result("async", result, a.results, latest=False, cache=a.out / "cache" if "learning" in a.parts
                           else a.cache)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
