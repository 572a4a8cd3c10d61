"""Benchmark (not a test): training and generation throughput, MFU and peak memory on one CUDA GPU, in bf16.

    python scripts/benchmarks/gpu_bench.py --out docs/bench/gpu                        # scripts/benchmarks/gpu_check.sh runs this
    python scripts/benchmarks/gpu_bench.py --models qwen2.5-1.5b --micro_batches 8 16 32 --seq_len 2048

Models: the architectures of SmolLM2-135M-Instruct, Qwen2.5-0.5B-Instruct and Qwen2.5-1.5B-Instruct (configs written
out below, from the models' published config.json), random weights built on the GPU, so nothing is downloaded: time
and memory do not depend on the weights' values. Each model runs in its own subprocess (its peak memory is its own;
running out of memory ends that model's sweep, not the benchmark).

1. train: GRPO optimizer steps through the scripts' own code: `shared.distributed.prepare` (a DeepSpeed engine,
   ZeRO-0, bf16 weights with fp32 master weights and fp32 gradients, torch AdamW), shared/logprobs.py's `forward_logprobs`
   (lean log-probs, temperature 0.7, with entropy), `clipped_surrogate` and `aggregate_loss`, gradient checkpointing
   on (grpo.py `--gradient_checkpointing`), one micro-batch of B rows of --seq_len tokens (the first --prompt_len of
   them prompt, the rest response) per optimizer step. For each B of --micro_batches (ascending, until one runs out
   of memory): 2 warm-up steps, then the median of --steps timed steps (CUDA synchronised). Reported: step time,
   tokens/s (all tokens of the micro-batch), MFU and peak memory (`torch.cuda.max_memory_allocated`, weights and
   optimizer state included).
   MFU = model FLOPs per second / the GPU's dense bf16 peak (datasheet: H100/H200 SXM 989 TFLOP/s), where model FLOPs
   = 6 x (matmul parameters of the layers) x tokens + 6 x (LM head parameters) x response tokens (the lean log-probs
   run the head on response positions only) + 6 x layers x hidden x seq_len x tokens (causal attention, forward and
   backward); gradient checkpointing's recomputed forward is not counted (as in PaLM's MFU). The achievable rate is
   measured too (a bf16 8192^3 matmul), and MFU against it is reported beside.
2. generate: the scripts' HF backend (`shared.generation.HFGenerator`, the training model itself), P prompts of
   --prompt_len random tokens x n samples, --gen_tokens new tokens each (no stop token can end them early), sampling at
   T = 1; tokens/s and peak memory over the call (after a warm-up call).
JSON: <out>/gpu_<time>.json (default runs/bench/gpu/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))

# The published configs (config.json of each hub repository), the fields that set the architecture's size
CONFIGS = {
    "smollm2-135m": dict(architecture="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.1, "A10": 125.0}


def datasheet_peak(name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops
    return None


def build_model(name: str, attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(CONFIGS[name])
    arch = spec.pop("architecture")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**spec, attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16)
    return model


def model_flops_per_step(model, batch: int, seq_len: int, prompt_len: int) -> float:
    cfg = model.config
    head = model.get_output_embeddings().weight.numel()
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    tokens = batch * seq_len
    response = batch * (seq_len - prompt_len)
    return 6 * layers * tokens + 6 * head * response + 6 * cfg.num_hidden_layers * cfg.hidden_size * seq_len * tokens


def matmul_tflops() -> float:
    """Measured bf16 matmul rate (8192^3, median of 10 after 3 warm-ups): what this GPU reaches on a large product."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def child(a) -> dict:
    """All measurements of one model, in this process."""
    import torch

    from algorithms.grpo import aggregate_loss, clipped_surrogate
    from shared.logprobs import forward_logprobs
    from shared.distributed import init_distributed, prepare
    from shared.generation import HFGenerator

    info = init_distributed()
    attn = "flash_attention_2" if _has_flash_attn() else "sdpa"
    model = build_model(a.child, attn)
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    engine, optimizer, _ = prepare(model, optimizer, None, info, max(a.micro_batches), 1, 1.0, torch.bfloat16)
    V = model.config.vocab_size
    out = {"model": a.child, "parameters": n_params, "attention": attn, "config": CONFIGS[a.child], "train": [],
           "generate": None}
    peak = datasheet_peak(torch.cuda.get_device_name())

    for B in sorted(a.micro_batches):
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(0, V, (B, a.seq_len), generator=g).cuda()
        attn_mask = torch.ones_like(ids)
        resp = torch.zeros_like(ids)
        resp[:, a.prompt_len:] = 1
        mask = resp[:, 1:].float()
        adv = torch.randn(B, 1, generator=g).cuda().expand_as(mask)
        n_tokens = int(mask.sum())

        def step():
            logp, _ = forward_logprobs(engine, ids, attn_mask, resp, 0.7, True)
            pg, _, _ = clipped_surrogate(logp, logp.detach() + 0.01, adv, 0.2, 0.28, mask)
            loss = aggregate_loss(pg, mask, "token_mean", B, n_tokens, n_tokens, 1, a.seq_len - a.prompt_len)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"micro_batch": B, "seq_len": a.seq_len, "prompt_len": a.prompt_len}
        try:
            times = []
            for i in range(2 + a.steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t)
        except torch.cuda.OutOfMemoryError as e:
            row["oom"] = str(e).splitlines()[0][:200]
            out["train"].append(row)
            print(f"{a.child}: micro-batch {B} x {a.seq_len}: out of memory", flush=True)
            break
        step_s = statistics.median(times)
        flops = model_flops_per_step(model, B, a.seq_len, a.prompt_len)
        row.update({"step_s": step_s, "step_s_all": times, "tokens_per_s": B * a.seq_len / step_s,
                    "model_tflops_per_s": flops / step_s / 1e12,
                    "mfu_datasheet": flops / step_s / 1e12 / peak if peak else None,
                    "mfu_measured_matmul": flops / step_s / 1e12 / a.matmul_tflops,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30})
        out["train"].append(row)
        print(f"{a.child}: micro-batch {B} x {a.seq_len}: {step_s * 1000:.0f} ms/step, "
              f"{row['tokens_per_s']:,.0f} tok/s, MFU {100 * (row['mfu_datasheet'] or 0):.1f}%, "
              f"peak {row['peak_allocated_gib']:.1f} GiB", flush=True)

    if a.profile and out["train"] and "oom" not in out["train"][0]:
        B = out["train"][0]["micro_batch"]
        ids = torch.randint(0, V, (B, a.seq_len)).cuda()
        attn_mask, resp = torch.ones_like(ids), torch.zeros_like(ids)
        resp[:, a.prompt_len:] = 1
        mask = resp[:, 1:].float()
        adv = torch.randn(B, 1).cuda().expand_as(mask)
        n_tokens = int(mask.sum())

        def train_step():
            logp, _ = forward_logprobs(engine, ids, attn_mask, resp, 0.7, True)
            pg, _, _ = clipped_surrogate(logp, logp.detach() + 0.01, adv, 0.2, 0.28, mask)
            engine.backward(aggregate_loss(pg, mask, "token_mean", B, n_tokens, n_tokens, 1, a.seq_len - a.prompt_len),
                            scale_wrt_gas=False)
            engine.step()

        out["profile_train"] = profile(train_step, f"one training step, micro-batch {B} x {a.seq_len}")

    # generation with the HF backend on the same (trained) weights
    engine.module.eval()
    engine.module.config.use_cache = True
    gen = HFGenerator(engine, _NoTokenizer(V), stop_token_ids=[V + 1])  # an id never sampled: every row runs to the end
    prompts = [torch.randint(0, V, (a.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(a.gen_prompts)]
    try:
        gen.generate(prompts[:2], n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=0)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        outs = gen.generate(prompts, n=a.gen_samples, temperature=1.0, top_p=1.0, max_new_tokens=a.gen_tokens,
                            seed=1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for group in outs for c in group)
        out["generate"] = {"prompts": a.gen_prompts, "samples": a.gen_samples, "new_tokens": a.gen_tokens,
                           "prompt_len": a.prompt_len, "seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt,
                           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
        print(f"{a.child}: HF generate {a.gen_prompts} x {a.gen_samples} x {a.gen_tokens} tokens: {dt:.1f} s, "
              f"{tokens / dt:,.0f} tok/s", flush=True)
    except torch.cuda.OutOfMemoryError as e:
        out["generate"] = {"oom": str(e).splitlines()[0][:200]}
    if a.profile:
        out["profile_generate"] = profile(
            lambda: gen.generate(prompts, n=a.gen_samples, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=2),
            f"HF generate {a.gen_prompts} x {a.gen_samples} x 16 tokens")
    return out


def profile(fn, what: str, top: int = 15) -> dict:
    """torch.profiler over one call of fn: wall time, GPU busy time (the sum of kernel times), and the ops with the
    most self time on the CPU and on the GPU: where the time goes."""
    import torch
    from torch.profiler import ProfilerActivity

    fn()  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    events = prof.key_averages()

    def dev_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    def rows(key):
        return [{"op": e.key[:80], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000,
                 "self_gpu_ms": dev_us(e) / 1000} for e in sorted(events, key=key, reverse=True)[:top]]

    gpu_busy = sum(dev_us(e) for e in events) / 1000
    print(f"profile, {what}: wall {wall * 1000:.0f} ms (profiled), GPU busy {gpu_busy:.0f} ms", flush=True)
    return {"what": what, "wall_ms_profiled": wall * 1000, "gpu_busy_ms": gpu_busy,
            "top_by_self_gpu": rows(dev_us), "top_by_self_cpu": rows(lambda e: e.self_cpu_time_total)}


class _NoTokenizer:
    """What HFGenerator needs of a tokenizer when there is no text: a pad id (random-weight models have no tokenizer)."""

    def __init__(self, vocab: int):
        self.pad_token_id, self.eos_token_id = 0, vocab + 1


def junit_summary(path: Path) -> dict:
    """Counts and failing test names of a pytest --junitxml report."""
    import xml.etree.ElementTree as ET

    if not Path(path).exists():
        return {"error": f"{path} not found (the tests did not run)"}
    cases = list(ET.parse(path).getroot().iter("testcase"))
    outcome = {}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    return {**counts, "failed_tests": sorted(n for n, v in outcome.items() if v == "failed"),
            "passed_tests": sorted(n for n, v in outcome.items() if v == "passed")}


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--micro_batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per row (prompt + response)")
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per micro-batch size")
    p.add_argument("--gen_prompts", type=int, default=64)
    p.add_argument("--gen_samples", type=int, default=8)
    p.add_argument("--gen_tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=None, help="directory of the JSON summary")
    p.add_argument("--profile", action="store_true",
                   help="also profile one training step and one generate call per model (torch.profiler)")
    p.add_argument("--tests_junit", type=Path, default=None,
                   help="a pytest --junitxml report (scripts/benchmarks/gpu_check.sh: the GPU tests) to summarise into the JSON")
    p.add_argument("--child", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--matmul_tflops", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return {}
    env = bc.environment(require_gpu=True)
    import torch

    env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    env["flash_attn"] = bc._version("flash-attn")
    env["matmul_bf16_tflops"] = matmul_tflops()
    env["datasheet_bf16_tflops"] = datasheet_peak(env["gpu"])
    print(f"{env['gpu']}: bf16 matmul {env['matmul_bf16_tflops']:.0f} TFLOP/s measured "
          f"(datasheet {env['datasheet_bf16_tflops']})", flush=True)
    torch.cuda.empty_cache()
    results = []
    for name in a.models:
        cmd = [sys.executable, __file__, "--child", name, "--matmul_tflops", str(env["matmul_bf16_tflops"]),
               "--micro_batches", *map(str, a.micro_batches), "--seq_len", str(a.seq_len), "--prompt_len",
               str(a.prompt_len), "--steps", str(a.steps), "--gen_prompts", str(a.gen_prompts), "--gen_samples",
               str(a.gen_samples), "--gen_tokens", str(a.gen_tokens), *(["--profile"] if a.profile else [])]
        proc = subprocess.run(cmd, cwd=bc.ROOT, env=bc.child_env(), capture_output=True, text=True)
        sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if not line.startswith("RESULT ")))
        if proc.returncode != 0 or "RESULT " not in proc.stdout:
            tail = (proc.stdout + proc.stderr)[-3000:]
            print(f"{name}: failed (rc {proc.returncode}):\n{tail}", flush=True)
            results.append({"model": name, "error": tail})
            continue
        results.append(json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0]))
    result = {"benchmark": "gpu", "command": bc.invocation(None if argv is None else ["scripts/benchmarks/gpu_bench.py", *argv]),
              "env": env, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                       if k not in ("child", "matmul_tflops", "tests_junit")}, "results": results}
    if a.tests_junit:
        result["tests"] = junit_summary(a.tests_junit)
    path = bc.write_result("gpu", result, a.out, latest=a.out is None)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
