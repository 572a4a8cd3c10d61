"""Benchmark (not a test): VinePPO iteration time vs PPO's at equal batch, and what state dedup / prefix caching save.

    python scripts/benchmarks/bench_vineppo.py              # CPU, built-in tiny model, 3 alternating repeats (~5 min, 2 cores)
    python scripts/benchmarks/bench_vineppo.py --quick      # smoke run (~2 min)
    python scripts/benchmarks/bench_vineppo.py --gpu        # 1 GPU: Qwen/Qwen2.5-0.5B-Instruct, bf16, 256 new tokens

Part 1, iteration time: algorithms/ppo.py and algorithms/vineppo.py with the same prompts per step, samples per
prompt, completion length, epochs x minibatches and micro-batch (each a fresh subprocess per repeat, alternating).
Per iteration (wall time between consecutive step ends, first dropped) and its split from the scripts' own
timers: trajectories (time/generate), rewards, MC values (vineppo: time/value_estimation), critic + old/ref
log-probs (time/logprob), training (time/train), weight sync. Target: VinePPO <= 2x PPO per iteration.

Part 2, the value-estimation phase alone, in a child process per prefix-caching setting (an engine setting):
trajectories are sampled and split into states exactly as vineppo.py does (its own functions), then the
K-rollout Monte Carlo values are computed (generate + grade, as vineppo.py's time/value_estimation) with the
states deduplicated (vineppo.py's behaviour) or not (one request per state occurrence), on the same
trajectories, prefix cache reset and re-warmed by the trajectory call before each, as after a weight sync.
Reported: MC seconds for dedup on/off x prefix caching on/off, rollouts, and the unique-state fraction.
Note: vLLM's CPU backend uses 128-token KV blocks and only caches full blocks, so prefix caching cannot hit on
the built-in task's ~25-token sequences; on GPU (16-token blocks) it can.
JSON summary: runs/bench/vineppo/{cpu,gpu}_<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
PHASES = {"ppo": ("generate", "reward", "logprob", "train", "sync"),
          "vineppo": ("generate", "reward", "value_estimation", "logprob", "train", "sync")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: builtin:tiny-sft (CPU), Qwen/Qwen2.5-0.5B-Instruct (--gpu)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: small batches, 1 repeat")
    p.add_argument("--smollm2", action="store_true", help="the real chat model on CPU: builtin:smollm2-135m, "
                   "4 prompts x 8, 32 new tokens, K = 9, 3 iterations")
    p.add_argument("--parts", default="iteration,mc", help="comma list: iteration (part 1), mc (part 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="iterations per run in part 1; the first is warm-up")
    p.add_argument("--num_prompts", type=int, default=None, help="prompts per iteration (part 1)")
    p.add_argument("--mc_num_prompts", type=int, default=None, help="prompts whose trajectories part 2 values")
    p.add_argument("--num_samples_per_prompt", type=int, default=8)
    p.add_argument("--num_mc_rollouts", type=int, default=9, help="K")
    p.add_argument("--max_new_tokens", type=int, default=None)
    p.add_argument("--micro_batch_size", type=int, default=None)
    p.add_argument("--num_ppo_epochs", type=int, default=2)
    p.add_argument("--num_minibatches", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="JSON summary directory (default runs/bench/vineppo)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "mc": part 2 in a child process
    p.add_argument("--prefix_caching", default="on", help=argparse.SUPPRESS)
    p.add_argument("--child_dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeat_index", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    d = dict(model="Qwen/Qwen2.5-0.5B-Instruct", steps=4, num_prompts=16, mc_num_prompts=8, max_new_tokens=256,
             micro_batch_size=16, learning_rate=1e-6) if a.gpu else \
        dict(model="builtin:tiny-sft", steps=4, num_prompts=64, mc_num_prompts=16, max_new_tokens=16,
             micro_batch_size=256, learning_rate=1e-4)
    if a.smollm2:
        d = dict(model="builtin:smollm2-135m", steps=3, num_prompts=4, mc_num_prompts=2, max_new_tokens=32,
                 micro_batch_size=16, learning_rate=1e-6)
    if a.quick:
        d.update(steps=3, num_prompts=8, mc_num_prompts=4, max_new_tokens=16, micro_batch_size=16)
        a.repeats = 1 if a.repeats == 3 else a.repeats
        if a.num_samples_per_prompt == 8:
            a.num_samples_per_prompt = 4
        if a.num_mc_rollouts == 9:
            a.num_mc_rollouts = 3
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.parts = [x for x in a.parts.split(",") if x]
    if set(a.parts) - {"iteration", "mc"}:
        p.error(f"--parts: expected iteration and/or mc, got {a.parts}")
    return a


# --- part 1 -------------------------------------------------------------------------------------------------------
def algo_argv(a, algo: str, out: Path) -> list[str]:
    argv = [str(ROOT / f"algorithms/{algo}.py"), "--model_name_or_path", a.model, "--output_dir", str(out),
            "--seed", str(a.seed), "--total_episodes", str(a.num_prompts * a.num_samples_per_prompt * a.steps),
            "--local_num_prompts", str(a.num_prompts), "--num_generations", str(a.num_samples_per_prompt),
            "--max_new_tokens", str(a.max_new_tokens), "--num_iterations", str(a.num_ppo_epochs),
            "--num_minibatches", str(a.num_minibatches), "--local_micro_batch_size", str(a.micro_batch_size),
            "--learning_rate", str(a.learning_rate), "--eval_every", "0", "--eval_num_prompts", "8",
            "--sample_every", "0", "--no_save_model", "--no_gradient_checkpointing"]
    if algo == "vineppo":
        argv += ["--num_mc_rollouts", str(a.num_mc_rollouts)]
    return argv


def read_algo(out: Path, algo: str) -> dict:
    rows = bc.read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "time/train" in r]
    times = bc.step_times_from_rows(rows, "time/train")
    timed = steps[1:]
    phases = {ph: [r.get(f"time/{ph}", 0.0) for r in timed] for ph in PHASES[algo]}
    phases["other"] = [s - sum(r.get(f"time/{ph}", 0.0) for ph in PHASES[algo]) for r, s in zip(timed, times)]
    res = {"step_s": times, "phases_s": phases}
    if algo == "vineppo":
        res["unique_state_frac"] = [r.get("val/unique_state_frac") for r in timed]
        res["mc_rollouts"] = [r.get("val/mc_rollouts") for r in timed]
    return res


def part_iteration(a, base: Path) -> dict:
    def run_one(algo: str, rep: int) -> dict:
        out = base / f"{algo}_rep{rep}"
        return {**bc.run_child(algo_argv(a, algo, out), out), **read_algo(out, algo)}

    runs = bc.run_repeats(["ppo", "vineppo"], a.repeats, run_one,
                          lambda res: f"median iteration {statistics.median(res['step_s']):.3f}s")
    for algo, reps in runs.items():
        if any("error" in r for r in reps):
            raise SystemExit(f"[bench_vineppo] {algo} failed: {next(r['error'] for r in reps if 'error' in r)}")
    summary = {}
    for algo, reps in runs.items():
        summary[algo] = {
            "step_s": bc.summarize([x for r in reps for x in r["step_s"]]),
            "repeat_median_step_s": [statistics.median(r["step_s"]) for r in reps],
            "phases_median_s": {ph: statistics.median([x for r in reps for x in r["phases_s"][ph]])
                                for ph in reps[0]["phases_s"]},
            "peak_rss_mb": bc.summarize([r["peak_rss_mb"] for r in reps]),
            "gpu_max_allocated_mb": bc.summarize([r.get("gpu_max_allocated_mb") for r in reps]),
        }
    summary["vineppo"]["unique_state_frac"] = bc.summarize([x for r in runs["vineppo"] for x in r["unique_state_frac"]])
    ratio = bc.summarize(bc.paired_ratios(summary["vineppo"]["repeat_median_step_s"],
                                          summary["ppo"]["repeat_median_step_s"]))
    return {"contenders": summary, "ratio_vineppo_over_ppo": ratio, "runs": runs}


# --- part 2 -------------------------------------------------------------------------------------------------------
def mc_child(a) -> None:
    """Trajectories -> states -> MC values with dedup on and off (same trajectories), one engine setting."""
    import torch

    from algorithms.vineppo import dedup_states
    from shared import data as data_utils
    from shared.distributed import default_dtype, load_tokenizer
    from shared.generation import VLLMGenerator
    from shared.rewards import compute_rewards, load_reward_fn
    from shared.steps import StepSplitError, get_splitter, step_token_starts
    from shared.models import resolve_model_path

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    train = data_utils.load_prompts("builtin", "train", tok)
    reward_fn = load_reward_fn("auto", "builtin")
    split_steps = get_splitter("lines")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    dtype = default_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    gen = VLLMGenerator(path, tok, dtype, seed=a.seed, max_model_len=256 + a.max_new_tokens,
                        enable_prefix_caching=a.prefix_caching == "on")
    G, K = a.num_samples_per_prompt, a.num_mc_rollouts
    sampler = data_utils.PromptSampler(len(train.rows), a.seed + a.repeat_index)
    local_idx = sampler.next_indices(a.mc_num_prompts)
    step_seed = a.seed * 7_919 + a.repeat_index

    def trajectories():
        gen.llm.reset_prefix_cache()  # as after a weight sync; the trajectory call then warms it
        outs = gen.generate([train.prompt_ids[i] for i in local_idx], n=G, temperature=1.0, top_p=1.0,
                            max_new_tokens=a.max_new_tokens, seed=step_seed)
        return [c for group in outs for c in group]

    def requests_for(comps, dedup: bool):
        keys = []
        for i, c in enumerate(comps):  # vineppo.py step 3
            try:
                st = step_token_starts(c.token_ids, split_steps(decode(c.token_ids)), decode)
            except StepSplitError:
                st = []
            keys.append([(local_idx[i // G], tuple(c.token_ids[:k])) for k in st])
        if dedup:
            unique, _ = dedup_states(keys)
        else:
            unique = [k for row in keys for k in row]
        return [(train.prompt_ids[p] + list(prefix), a.max_new_tokens - len(prefix), train.rows[p], list(prefix))
                for p, prefix in unique], sum(len(row) for row in keys)

    def mc(requests):  # vineppo.py step 4
        t = time.perf_counter()
        out = gen.generate([r[0] for r in requests], n=K, temperature=1.0, top_p=1.0,
                           max_new_tokens=[r[1] for r in requests], seed=step_seed + 500_009)
        t_gen = time.perf_counter() - t
        flat = [(r, cont) for r, group in zip(requests, out) for cont in group]
        compute_rewards(reward_fn, [r[2]["prompt"] for r, _ in flat], [decode(r[3] + c.token_ids) for r, c in flat],
                        [r[2]["answer"] for r, _ in flat], [c.finished for _, c in flat], [r[2] for r, _ in flat])
        return {"mc_s": time.perf_counter() - t, "mc_generate_s": t_gen, "rollouts": len(flat)}

    trajectories()  # warm-up of the engine
    mc(requests_for(trajectories(), True)[0][: max(1, a.mc_num_prompts)])
    result = {}
    for dedup in bc.alternating_order([True, False], a.repeat_index):
        reqs, num_states = requests_for(trajectories(), dedup)
        result["dedup" if dedup else "no_dedup"] = {**mc(reqs), "requests": len(reqs), "states": num_states}
    (a.child_dir / "mc.json").write_text(json.dumps(result))


def part_mc(a, base: Path) -> dict:
    runs = []
    for rep in range(a.repeats):
        for pc in bc.alternating_order(["on", "off"], rep):
            out = base / f"mc_prefix_{pc}_rep{rep}"
            argv = [str(Path(__file__).resolve()), "--child", "mc", "--child_dir", str(out), "--prefix_caching", pc,
                    "--repeat_index", str(rep), "--model", a.model, "--seed", str(a.seed),
                    "--mc_num_prompts", str(a.mc_num_prompts), "--num_samples_per_prompt",
                    str(a.num_samples_per_prompt), "--num_mc_rollouts", str(a.num_mc_rollouts), "--max_new_tokens",
                    str(a.max_new_tokens)] + (["--gpu"] if a.gpu else [])
            child = bc.run_child(argv, out)
            res = json.loads((out / "mc.json").read_text())
            print(f"  mc prefix caching {pc} rep {rep}: dedup {res['dedup']['mc_s']:.2f}s "
                  f"({res['dedup']['rollouts']} rollouts), no dedup {res['no_dedup']['mc_s']:.2f}s "
                  f"({res['no_dedup']['rollouts']} rollouts)", flush=True)
            runs.append({"prefix_caching": pc, "repeat": rep, "peak_rss_mb": child["peak_rss_mb"], **res})
    cells = {}
    for pc in ("on", "off"):
        for dd in ("dedup", "no_dedup"):
            rs = [r[dd] for r in runs if r["prefix_caching"] == pc]
            cells[f"prefix_{pc}/{dd}"] = {"mc_s": bc.summarize([r["mc_s"] for r in rs]),
                                          "mc_generate_s": bc.summarize([r["mc_generate_s"] for r in rs]),
                                          "rollouts": bc.summarize([r["rollouts"] for r in rs]),
                                          "unique_state_frac": bc.summarize([r["requests"] / max(r["states"], 1)
                                                                             for r in rs])}
    by = lambda pc, dd: [r[dd]["mc_s"] for r in runs if r["prefix_caching"] == pc]  # noqa: E731
    ratios = {"no_dedup/dedup (prefix caching on)": bc.summarize(bc.paired_ratios(by("on", "no_dedup"), by("on", "dedup"))),
              "no_dedup/dedup (prefix caching off)": bc.summarize(bc.paired_ratios(by("off", "no_dedup"),
                                                                                   by("off", "dedup"))),
              "prefix off/on (dedup)": bc.summarize(bc.paired_ratios(by("off", "dedup"), by("on", "dedup"))),
              "prefix off/on (no dedup)": bc.summarize(bc.paired_ratios(by("off", "no_dedup"), by("on", "no_dedup")))}
    return {"cells": cells, "ratios": ratios, "runs": runs}


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    if a.child == "mc":
        a.child_dir.mkdir(parents=True, exist_ok=True)
        mc_child(a)
        return None
    env = bc.environment(require_gpu=a.gpu)
    print(f"[bench_vineppo] {env['device']}; parts {a.parts}; {a.repeats} repeats", flush=True)
    result = {"benchmark": "vineppo", "env": env,
              "settings": {k: v for k, v in vars(a).items() if k not in ("child", "child_dir", "out",
                                                                          "prefix_caching", "repeat_index")}}
    with tempfile.TemporaryDirectory(prefix="bench_vineppo_") as tmp:
        base = (a.out or ROOT / "runs/bench/vineppo") / "runs" if a.keep else Path(tmp)
        if "iteration" in a.parts:
            result["iteration"] = part_iteration(a, base)
        if "mc" in a.parts:
            result["mc"] = part_mc(a, base)
    path = bc.write_result("vineppo", result, a.out)

    if "iteration" in result:
        it = result["iteration"]
        rows = []
        for algo, s in it["contenders"].items():
            row = {"algo": algo, "iter_s min": s["step_s"]["min"], "iter_s med": s["step_s"]["median"],
                   "iter_s max": s["step_s"]["max"], "peak RSS MB": s["peak_rss_mb"]["max"]}
            row.update({ph: v for ph, v in s["phases_median_s"].items()})
            rows.append(row)
        cols = ["algo", "iter_s min", "iter_s med", "iter_s max", "generate", "reward", "value_estimation", "logprob",
                "train", "sync", "other", "peak RSS MB"]
        print(bc.table(rows, cols))
        r = it["ratio_vineppo_over_ppo"]
        print(f"vineppo/ppo iteration time: min {bc.fmt(r['min'])} median {bc.fmt(r['median'])} max {bc.fmt(r['max'])}"
              f" (target <= 2); unique-state fraction median {bc.fmt(it['contenders']['vineppo']['unique_state_frac']['median'])}")
    if "mc" in result:
        print(bc.table([{"setting": k, "mc_s med": v["mc_s"]["median"], "generate_s med": v["mc_generate_s"]["median"],
                         "rollouts": v["rollouts"]["median"], "unique frac": v["unique_state_frac"]["median"]}
                        for k, v in result["mc"]["cells"].items()],
                       ["setting", "mc_s med", "generate_s med", "rollouts", "unique frac"]))
        print(bc.table([{"ratio": k, **v} for k, v in result["mc"]["ratios"].items()], ["ratio", "min", "median", "max", "n"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
