"""Benchmark (not a test): generation throughput of the two backends, weight-sync time, GRPO step breakdown.

    python scripts/bench_generation.py                       # built-in tiny model, CPU, ~2 minutes
    python scripts/bench_generation.py --model Qwen/Qwen2.5-0.5B-Instruct --max_new_tokens 256   # on a GPU

Reports, as a JSON line and a table:
  - tokens/s of `shared.generation` with vLLM and with HF `generate` on the same prompts and settings
    (median of --repeats timed calls after one warm-up call);
  - the in-place weight sync (`sync_weights(full_named_parameters(...))`) time;
  - the per-step time split of grpo.py (generate / reward / logprob / train / sync) from a short run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import data  # noqa: E402
from shared.distributed import DistInfo, default_dtype, full_named_parameters, load_causal_lm, load_tokenizer  # noqa: E402
from shared.generation import HFGenerator, VLLMGenerator  # noqa: E402
from shared.task import builtin_split  # noqa: E402
from shared.tiny import resolve_model_path  # noqa: E402


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:tiny-sft")
    p.add_argument("--num_prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--grpo_steps", type=int, default=20, help="steps of grpo.py for the step breakdown (0: skip)")
    p.add_argument("--output", type=Path, default=None, help="append the JSON result to this file")
    args = p.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(0, 1, 0, device, 0, {})
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    dtype = default_dtype(device)
    rows = builtin_split("test")[: args.num_prompts]
    prompts = [data.encode_prompt(tok, r["prompt"], False) for r in rows]
    kw = dict(n=args.n, temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=0)

    model = load_causal_lm(path, dtype).to(device)
    count = lambda out: sum(len(c.token_ids) for g in out for c in g)  # noqa: E731
    result = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else
              f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}", "torch_threads": torch.get_num_threads(),
              "num_prompts": args.num_prompts, "n": args.n, "max_new_tokens": args.max_new_tokens}

    t = time.perf_counter()
    vllm = VLLMGenerator(path, tok.eos_token_id, dtype, seed=0, max_model_len=256)
    result["vllm_engine_start_s"] = time.perf_counter() - t
    tokens = count(vllm.generate(prompts, **kw))
    secs = timed(lambda: vllm.generate(prompts, **kw), args.repeats)
    result["vllm_tokens_per_s"] = tokens / statistics.median(secs)

    hf = HFGenerator(model, tok.eos_token_id, tok.pad_token_id)
    tokens_hf = count(hf.generate(prompts, **kw))
    secs_hf = timed(lambda: hf.generate(prompts, **kw), args.repeats)
    result["hf_tokens_per_s"] = tokens_hf / statistics.median(secs_hf)
    result["vllm_over_hf"] = result["vllm_tokens_per_s"] / result["hf_tokens_per_s"]

    sync = timed(lambda: vllm.sync_weights(full_named_parameters(model, info)), args.repeats)
    result["sync_s"] = statistics.median(sync)

    if args.grpo_steps:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(ROOT / "algorithms/grpo.py"), "--model_name_or_path", path, "--output_dir", out,
                   "--total_episodes", str(512 * (args.grpo_steps + 1)), "--eval_every", "0", "--eval_num_prompts", "8",
                   "--no_save_model", "--max_new_tokens", str(args.max_new_tokens)]
            subprocess.run(cmd, check=True, capture_output=True, env={**os.environ})
            steps = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()]
            steps = [s for s in steps if "time/train" in s][1:]  # drop the first (warm-up) step
        for phase in ("generate", "reward", "logprob", "train", "sync"):
            result[f"grpo_step_{phase}_s"] = statistics.median(s.get(f"time/{phase}", 0.0) for s in steps)
        total = sum(result[f"grpo_step_{ph}_s"] for ph in ("generate", "reward", "logprob", "train", "sync"))
        result["grpo_step_total_s"] = total
        result["sync_fraction_of_step"] = result["grpo_step_sync_s"] / total

    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.output:
        with open(args.output, "a") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
