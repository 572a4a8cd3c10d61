"""Benchmark (not a test): DPO and reward-model step time, algorithms/{dpo,rm}.py vs TRL's DPOTrainer / RewardTrainer.

    python scripts/benchmarks/bench_preference.py              # CPU, built-in tiny model and pairs, 3 alternating repeats (~4 min)
    python scripts/benchmarks/bench_preference.py --quick      # smoke run (~1-2 min)
    python scripts/benchmarks/bench_preference.py --algos dpo  # DPO only
    python scripts/benchmarks/bench_preference.py --gpu        # 1 GPU: Qwen/Qwen2.5-0.5B-Instruct, bf16

Contenders, each a fresh subprocess per repeat, alternating (A B C D, D C B A, ...):
  dpo_ours   algorithms/dpo.py --loss_type sigmoid (reference log-probs precomputed, its default)
  dpo_trl    trl.DPOTrainer, loss_type ["sigmoid"], precompute_ref_log_probs=True
  rm_ours    algorithms/rm.py (Bradley-Terry, a fresh N(0, 1/sqrt(H+1)) head on the SFT backbone)
  rm_trl     trl.RewardTrainer on the same model object (same head init)

Identical settings: same model, the same training pairs (built-in preference pairs, the ones our run draws, as
text: both sides tokenize to BOS + prompt + response + EOS), pairs per step, one micro-batch per step, beta 0.1,
lr (CPU: DPO 1e-4, RM 3e-4; GPU: 5e-7, 1e-5) with 3% linear warm-up and cosine decay to 10%, plain AdamW without weight decay, grad
clip 1.0, no gradient checkpointing, fp32 on CPU. No evaluation inside the timed window; mismatches in
docs/performance.md.

Step time: the scripts log every 10 steps, so both sides are timed per window of 10 optimizer steps (wall time
between the ends of step 10k and 10(k+1), divided by 10; the first window, with the warm-up, is dropped).
Reported: min/median/max per contender, per-repeat ratios ours/TRL of median step times (target <= 0.7 for
both, as for GRPO), peak RSS / GPU memory. JSON summary: runs/bench/preference/{cpu,gpu}_<time>.json.
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
WINDOW = 10  # our dpo.py / rm.py log (and time) every 10 steps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: builtin:tiny-sft (CPU), Qwen/Qwen2.5-0.5B-Instruct (--gpu)")
    p.add_argument("--gpu", action="store_true", help="GPU mode: a hub model in bf16")
    p.add_argument("--quick", action="store_true", help="smoke run: 30 steps of 8 pairs, 1 repeat")
    p.add_argument("--smollm2", action="store_true",
                   help="the real chat model on CPU: builtin:smollm2-135m, 30 steps of 8 pairs")
    p.add_argument("--algos", default="dpo,rm", help="comma list: dpo, rm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (a multiple of 10, >= 30)")
    p.add_argument("--batch_size", type=int, default=None, help="pairs per optimizer step (one micro-batch)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="JSON summary directory (default runs/bench/preference)")
    p.add_argument("--keep", action="store_true", help="keep the contenders' run directories")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_dir", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    d = dict(model="Qwen/Qwen2.5-0.5B-Instruct", steps=60, batch_size=16) if a.gpu else \
        dict(model="builtin:tiny-sft", steps=60, batch_size=64)
    if a.smollm2:
        d = dict(model="builtin:smollm2-135m", steps=30, batch_size=8)
    if a.quick:
        d.update(steps=30, batch_size=8)
        a.repeats = 1 if a.repeats == 3 else a.repeats
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.algos = [x for x in a.algos.split(",") if x]
    if set(a.algos) - {"dpo", "rm"}:
        p.error(f"--algos: expected dpo and/or rm, got {a.algos}")
    if a.steps % WINDOW or a.steps < 3 * WINDOW:
        p.error(f"--steps: a multiple of {WINDOW}, at least {3 * WINDOW}")
    pretrained = a.gpu or not a.model.startswith("builtin:tiny")  # the scripts' CPU defaults are for the tiny model
    a.lr = {"dpo": 5e-7, "rm": 1e-5} if pretrained else {"dpo": 1e-4, "rm": 3e-4}
    return a


# --- ours ---------------------------------------------------------------------------------------------------------
def ours_argv(a, algo: str, out: Path, seed: int) -> list[str]:
    common = ["--model_name_or_path", a.model, "--output_dir", str(out), "--seed", str(seed),
              "--total_episodes", str(a.batch_size * a.steps), "--local_micro_batch_size", str(a.batch_size),
              "--gradient_accumulation_steps", "1", "--learning_rate", str(a.lr[algo]), "--warmup_ratio", "0.03",
              "--weight_decay", "0.0", "--max_grad_norm", "1.0", "--max_seq_length", "512", "--eval_every", "0",
              "--no_gradient_checkpointing"]  # as TRL's contenders (gradient_checkpointing=False)
    if algo == "dpo":
        return [str(ROOT / "algorithms/dpo.py"), *common, "--loss_type", "sigmoid", "--beta", "0.1",
                "--precompute_ref_logps", "--eval_num_prompts", "0", "--eval_num_pairs", "0", "--no_save_model"]
    # rm.py evaluates before and after training (outside the timed window) and always saves its checkpoint
    return [str(ROOT / "algorithms/rm.py"), *common, "--eval_num_pairs", "64", "--num_sample_pairs", "0"]


def read_ours(out: Path) -> dict:
    return {"step_s": bc.step_times_from_rows(bc.read_jsonl(out / "metrics.jsonl"), "time/train")}


# --- TRL ----------------------------------------------------------------------------------------------------------
def trl_argv(a, algo: str, out: Path, seed: int) -> list[str]:
    return [str(Path(__file__).resolve()), "--child", algo, "--child_dir", str(out), "--seed", str(seed),
            "--model", a.model, "--steps", str(a.steps), "--batch_size", str(a.batch_size)] + (["--gpu"] if a.gpu else [])


def read_trl(out: Path) -> dict:
    data = json.loads((out / "trl_times.json").read_text())
    return {"step_s": [t / WINDOW for t in bc.iteration_times(data["step_end_times"], WINDOW)]}


def training_pairs(a, tok) -> list[dict]:
    """The pairs our run trains on, in our sampler's order, as text rows (prompt, chosen, rejected)."""
    from shared import data as data_utils

    train = data_utils.load_preferences("builtin", "train", tok, max_prompt_length=256, max_seq_length=512)
    sampler = data_utils.PromptSampler(len(train), a.seed)
    idx = sampler.next_indices(a.steps * a.batch_size)
    return [{k: str(train.rows[i][k]) for k in ("prompt", "chosen", "rejected")} for i in idx]


def trl_child(a) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from shared.distributed import default_dtype, load_causal_lm, load_tokenizer
    from shared.models import resolve_model_path

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    ds = Dataset.from_list(training_pairs(a, tok))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = default_dtype(device)
    common = dict(output_dir=str(a.child_dir), seed=a.seed, report_to="none", save_strategy="no",
                  logging_steps=WINDOW, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
                  gradient_accumulation_steps=1, learning_rate=a.lr[a.child], lr_scheduler_type="cosine_with_min_lr",
                  lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0.03, weight_decay=0.0, max_grad_norm=1.0,
                  optim="adamw_torch", gradient_checkpointing=False, bf16=device.type == "cuda", disable_dropout=True,
                  max_length=512, dataloader_num_workers=0)
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    if a.child == "dpo":
        from trl import DPOConfig, DPOTrainer

        model = load_causal_lm(path, dtype)
        cfg = DPOConfig(**common, loss_type=["sigmoid"], beta=0.1, precompute_ref_log_probs=True,
                        precompute_ref_batch_size=a.batch_size)
        trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    else:
        from trl import RewardConfig, RewardTrainer

        from algorithms.rm import init_reward_head
        from shared.scalar import load_scalar_model

        model = load_scalar_model(path, dtype)
        init_reward_head(model)
        cfg = RewardConfig(**common, center_rewards_coefficient=None)
        trainer = RewardTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    (a.child_dir / "trl_times.json").write_text(json.dumps({"step_end_times": ends}))


# --- driver -------------------------------------------------------------------------------------------------------
def main(argv=None) -> dict | None:
    a = parse_args(argv)
    if a.child:
        a.child_dir.mkdir(parents=True, exist_ok=True)
        trl_child(a)
        return None
    env = bc.environment(require_gpu=a.gpu)
    contenders = [f"{algo}_{who}" for algo in a.algos for who in ("ours", "trl")]
    print(f"[bench_preference] {env['device']}; {contenders}; {a.repeats} repeats x {a.steps} steps of "
          f"{a.batch_size} pairs", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_pref_") as tmp:
        base = (a.out or ROOT / "runs/bench/preference") / "runs" if a.keep else Path(tmp)

        def run_one(name: str, rep: int) -> dict:
            algo, who = name.split("_")
            out = base / f"{name}_rep{rep}"
            argv = ours_argv(a, algo, out, a.seed) if who == "ours" else trl_argv(a, algo, out, a.seed)
            return {**bc.run_child(argv, out), **(read_ours(out) if who == "ours" else read_trl(out))}

        runs = bc.run_repeats(contenders, a.repeats, run_one,
                              lambda res: f"median step {statistics.median(res['step_s']) * 1e3:.1f} ms")

    summary, ratios = {}, {}
    for name, reps in runs.items():
        ok = [r for r in reps if "error" not in r]
        if not ok:
            summary[name] = {"error": reps[0]["error"] if reps else "not run"}
            continue
        summary[name] = {"step_s": bc.summarize([x for r in ok for x in r["step_s"]]),
                         "repeat_median_step_s": [statistics.median(r["step_s"]) for r in ok],
                         "peak_rss_mb": bc.summarize([r["peak_rss_mb"] for r in ok]),
                         "gpu_max_allocated_mb": bc.summarize([r.get("gpu_max_allocated_mb") for r in ok]),
                         "process_wall_s": bc.summarize([r["wall_s"] for r in ok])}
    for algo in a.algos:
        ours, trl = summary.get(f"{algo}_ours", {}), summary.get(f"{algo}_trl", {})
        if "step_s" in ours and "step_s" in trl and len(ours["repeat_median_step_s"]) == len(trl["repeat_median_step_s"]):
            ratios[f"{algo}: ours/trl step time"] = bc.summarize(
                bc.paired_ratios(ours["repeat_median_step_s"], trl["repeat_median_step_s"]))
    result = {"benchmark": "preference", "env": env,
              "settings": {k: v for k, v in vars(a).items() if k not in ("child", "child_dir", "out")},
              "contenders": summary, "ratios": ratios, "runs": runs}
    path = bc.write_result("preference", result, a.out)
    rows = [{"contender": n, "step_ms min": s["step_s"]["min"] * 1e3, "step_ms med": s["step_s"]["median"] * 1e3,
             "step_ms max": s["step_s"]["max"] * 1e3, "peak RSS MB": s["peak_rss_mb"]["max"],
             "GPU MB": s["gpu_max_allocated_mb"]["max"]} if "error" not in s else {"contender": n, "step_ms med": "FAILED"}
            for n, s in summary.items()]
    print(bc.table(rows, ["contender", "step_ms min", "step_ms med", "step_ms max", "peak RSS MB", "GPU MB"]))
    if ratios:
        print(bc.table([{"ratio": k, **v} for k, v in ratios.items()], ["ratio", "min", "median", "max", "n"]))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
