"""Benchmark (not a test): what LoRA saves on a real model, builtin:smollm2-135m (SmolLM2-135M-Instruct, fp32 on CPU).

    python scripts/benchmarks/bench_lora_memory.py                       # full fine-tuning vs --lora_r 16, 4 GRPO steps each (~20 min, 2 cores)
    python scripts/benchmarks/bench_lora_memory.py --lora_r 8 --steps 3

Two measurements:
1. In this process, for the model alone: trainable parameters, and the bytes of the AdamW state after one
   optimizer step (the tensors in `optimizer.state`: exp_avg and exp_avg_sq, fp32, one pair per trained tensor),
   and the bytes of the gradients of that step, for full fine-tuning and for LoRA (`shared.lora.add_lora`).
2. A few GRPO steps of `algorithms/grpo.py` per contender (full, lora), each in its own subprocess through
   scripts/bench_common.py: the peak RSS of the whole training process (vLLM engine and its KV cache included,
   which are the same for both), its wall time, the mean `time/sync` (weight sync into vLLM; for LoRA the merge
   W + BA of every targeted layer), and the size of the resumable checkpoint and of final/.
Memory does not depend on machine load; times do (the load average is recorded). Not measured: GPU memory (no GPU
here), bf16, ZeRO sharding, larger models. JSON summary: docs/bench/lora_memory/<device>_<time>.json (--out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))

MODEL = "builtin:smollm2-135m"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def model_alone(lora_r: int, lora_alpha: int) -> dict:
    """Trainable parameters, gradient bytes and AdamW state bytes after one step, full vs LoRA (fp32, CPU)."""
    import torch

    from shared.distributed import load_causal_lm
    from shared.lora import add_lora
    from shared.models import resolve_model_path

    path = resolve_model_path(MODEL)
    out = {}
    for name, r in (("full", 0), ("lora", lora_r)):
        torch.manual_seed(0)
        model = add_lora(load_causal_lm(path, torch.float32), SimpleNamespace(
            lora_r=r, lora_alpha=lora_alpha, lora_dropout=0.0, lora_target_modules="all-linear"))
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)  # as the scripts build it: frozen ones get no state
        ids = torch.randint(0, 49152, (2, 32))
        model(input_ids=ids).logits.float().square().mean().backward()
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        optimizer.step()
        state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t))
        out[name] = {"parameters": sum(p.numel() for p in params), "trainable_parameters": sum(
            p.numel() for p in trainable), "trainable_tensors": len(trainable), "gradient_bytes": grad_bytes,
            "optimizer_state_bytes": state_bytes}
        del model, optimizer
    return out


def grpo_flags(a, out: Path) -> list[str]:
    return ["algorithms/grpo.py", "--output_dir", str(out), "--model_name_or_path", MODEL, "--chat_template",
            "--total_episodes", str(a.steps * a.num_prompts * a.num_generations), "--local_num_prompts",
            str(a.num_prompts), "--num_generations", str(a.num_generations), "--local_micro_batch_size",
            str(a.num_prompts * a.num_generations // 2), "--max_new_tokens", str(a.max_new_tokens),
            "--learning_rate", "1e-5", "--eval_num_prompts", "4", "--eval_num_samples", "1", "--eval_every", "0",
            "--dev_num_prompts", "0", "--best_metric", "", "--save_every", str(a.steps), "--generator", a.generator,
            "--resume", "no", "--no_gradient_checkpointing"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per contender")
    p.add_argument("--num_prompts", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--generator", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--workdir", type=Path, default=bc.ROOT / "runs" / "bench" / "lora_memory_runs")
    p.add_argument("--out", type=Path, default=bc.ROOT / "docs" / "bench" / "lora_memory")
    a = p.parse_args(argv)
    import shutil

    env = bc.environment()
    alone = model_alone(a.lora_r, a.lora_alpha)
    for name, r in alone.items():
        print(f"{name}: {r['trainable_parameters']:,} of {r['parameters']:,} parameters train; gradients "
              f"{r['gradient_bytes'] / 2**20:.1f} MiB, AdamW state {r['optimizer_state_bytes'] / 2**20:.1f} MiB",
              flush=True)

    def run_one(name: str, rep: int) -> dict:
        out = a.workdir / f"{name}_{rep}"
        shutil.rmtree(out, ignore_errors=True)
        extra = ["--lora_r", str(a.lora_r), "--lora_alpha", str(a.lora_alpha)] if name == "lora" else []
        res = bc.run_child([*grpo_flags(a, out), *extra], out / "child", env=bc.child_env())
        rows = bc.read_jsonl(out / "metrics.jsonl")
        syncs = [r["time/sync"] for r in rows if "time/sync" in r]
        ckpts = sorted((out / "checkpoints").glob("step_*"))
        res.update(mean_sync_s=sum(syncs) / len(syncs) if syncs else None, steps=len(syncs),
                   checkpoint_bytes=dir_bytes(ckpts[-1]) if ckpts else None,
                   final_bytes=dir_bytes(out / "final"), adapter_bytes=dir_bytes(out / "final" / "adapter")
                   if (out / "final" / "adapter").exists() else None,
                   final_eval_accuracy=rows[-1].get("eval/accuracy"))
        return res

    runs = bc.run_repeats(["full", "lora"], 1, run_one,
                          lambda r: f"peak RSS {r['peak_rss_mb']:.0f} MiB, {r['wall_s']:.0f} s")
    result = {"benchmark": "lora_memory", "env": env, "model": MODEL,
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "command": ("python scripts/benchmarks/bench_lora_memory.py " + " ".join(argv or sys.argv[1:])).strip(),
              "model_alone": alone, "grpo_runs": runs, "loadavg_at_end": list(__import__("os").getloadavg())}
    path = bc.write_result("lora_memory", result, a.out, latest=False)
    full, lora = runs["full"][0], runs["lora"][0]
    if "error" not in full and "error" not in lora:
        print(f"peak RSS of {a.steps} GRPO steps: full {full['peak_rss_mb']:.0f} MiB, LoRA r={a.lora_r} "
              f"{lora['peak_rss_mb']:.0f} MiB (-{full['peak_rss_mb'] - lora['peak_rss_mb']:.0f} MiB); checkpoint "
              f"{full['checkpoint_bytes'] / 2**20:.0f} vs {lora['checkpoint_bytes'] / 2**20:.1f} MiB; sync "
              f"{full['mean_sync_s']:.3f} vs {lora['mean_sync_s']:.3f} s")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
