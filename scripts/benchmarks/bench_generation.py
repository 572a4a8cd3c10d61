"""Benchmark (not a test): generation throughput of our backends vs raw vLLM, and the in-place weight sync time.

    python scripts/benchmarks/bench_generation.py            # CPU, built-in tiny model (~3 min on 2 cores)
    python scripts/benchmarks/bench_generation.py --quick    # smoke run (~1 min)
    python scripts/benchmarks/bench_generation.py --gpu      # 1 GPU: Qwen/Qwen2.5-0.5B-Instruct, bf16, 256 new tokens
    python scripts/benchmarks/bench_generation.py --gpu --model Qwen/Qwen2.5-1.5B-Instruct

One process, one vLLM engine (the settings `shared.generation.VLLMGenerator` uses: prefix caching, processed
log-probs, enforce_eager on CPU, gpu_memory_utilization 0.3), the same prompts (built-in task, held-out split),
the same sampling settings (T = 1, top-p 1, n samples per prompt, max_new_tokens). Contenders, called in
alternating order in every repeat after one warm-up call each:

  ours_vllm   shared.generation.VLLMGenerator.generate (seeded per call, log-probs, Completion objects)
  raw_same    vllm.LLM.generate on the same engine with exactly the SamplingParams ours builds (wrapper overhead)
  raw_plain   vllm.LLM.generate with one plain SamplingParams(n, temperature, top_p, max_tokens): no log-probs
              (what log-probs cost; before per-call seeding, files without `per_request_seeds: false`, ours
              and raw_same also gave every prompt its own seed)
  ours_hf     shared.generation.HFGenerator.generate (HF `generate` on the training model)

Reported: tokens/s per contender (generated tokens / wall time of the call), the ratios ours_vllm/raw_same and
ours_vllm/raw_plain (target >= 0.9) and ours_vllm/ours_hf (target >= 5 on the CPU tiny model), a sweep of batch
sizes (where does vLLM overtake HF?), the weight-sync time (`sync_weights(full_named_parameters(...))`), and
peak process RSS / GPU memory. The sync as a fraction of a GRPO step is measured by scripts/benchmarks/bench_grpo.py.
JSON summary: runs/bench/generation/{cpu,gpu}_<time>.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: builtin:tiny-sft (CPU), Qwen/Qwen2.5-0.5B-Instruct (--gpu)")
    p.add_argument("--gpu", action="store_true", help="GPU mode: a hub model in bf16, longer completions")
    p.add_argument("--quick", action="store_true", help="smoke run: small batch, 1 repeat, short sweep")
    p.add_argument("--smollm2", action="store_true",
                   help="the real chat model on CPU: builtin:smollm2-135m, 16 prompts x 8, 64 new tokens, 3 repeats")
    p.add_argument("--num_prompts", type=int, default=None)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per contender (alternating)")
    p.add_argument("--sweep", default=None, help="comma list of num_prompts for the vLLM-vs-HF sweep ('' to skip)")
    p.add_argument("--sync_repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=None, help="JSON summary directory (default runs/bench/generation)")
    a = p.parse_args(argv)
    cpu = dict(model="builtin:tiny-sft", num_prompts=64, max_new_tokens=16, sweep="8,64,256")
    gpu = dict(model="Qwen/Qwen2.5-0.5B-Instruct", num_prompts=64, max_new_tokens=256, sweep="8,64,256")
    d = gpu if a.gpu else cpu
    if a.smollm2:
        d = dict(model="builtin:smollm2-135m", num_prompts=16, max_new_tokens=64, sweep="4,32")
        a.repeats = 3 if a.repeats == 5 else a.repeats
    if a.quick:
        d = {**d, "num_prompts": 8, "max_new_tokens": 8, "sweep": "4,16"}
        a.repeats, a.sync_repeats = 1 if a.repeats == 5 else a.repeats, 2
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.sweep = [int(x) for x in a.sweep.split(",") if x.strip()]
    return a


def count_tokens(out) -> int:
    """Generated tokens in an output of our generators (list of groups of Completion) or of vllm.LLM.generate."""
    total = 0
    for group in out:
        items = group.outputs if hasattr(group, "outputs") else group
        total += sum(len(c.token_ids) for c in items)
    return total


def timed_calls(fns: dict, repeats: int) -> dict[str, list[dict]]:
    """One warm-up call per contender, then `repeats` rounds calling every contender once, the order alternating
    between rounds. Returns {name: [{"s": seconds, "tokens": generated tokens}, ...]}."""
    names = list(fns)
    for name in names:
        fns[name]()
    out = {n: [] for n in names}
    for r in range(repeats):
        for name in bc.alternating_order(names, r):
            t = time.perf_counter()
            res = fns[name]()
            out[name].append({"s": time.perf_counter() - t, "tokens": count_tokens(res)})
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import SamplingParams

    from shared import data
    from shared.distributed import DistInfo, default_dtype, full_named_parameters, load_causal_lm, load_tokenizer
    from shared.generation import HFGenerator, VLLMGenerator
    from shared.task import builtin_split
    from shared.models import resolve_model_path

    env = bc.environment(require_gpu=a.gpu)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(0, 1, 0, device, 0, {})
    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    dtype = default_dtype(device)
    all_prompts = [data.encode_prompt(tok, r["prompt"], False) for r in builtin_split("test")]
    print(f"[bench_generation] {env['device']}; {a.model}; {a.num_prompts} prompts x {a.n} samples, "
          f"{a.max_new_tokens} new tokens; {a.repeats} alternating repeats", flush=True)

    model = load_causal_lm(path, dtype).to(device)
    t = time.perf_counter()
    vllm = VLLMGenerator(path, tok, dtype, seed=0, max_model_len=64 + a.max_new_tokens)
    engine_start_s = time.perf_counter() - t
    hf = HFGenerator(model, tok)
    kw = dict(n=a.n, temperature=a.temperature, top_p=1.0, max_new_tokens=a.max_new_tokens, seed=0)

    def contenders(num_prompts: int, with_raw: bool) -> dict:
        prompts = all_prompts[:num_prompts]
        same = [SamplingParams(n=a.n, temperature=a.temperature, top_p=1.0, max_tokens=a.max_new_tokens, logprobs=0,
                               detokenize=False) for _ in prompts]
        plain = SamplingParams(n=a.n, temperature=a.temperature, top_p=1.0, max_tokens=a.max_new_tokens,
                               detokenize=False)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        fns = {"ours_vllm": lambda: vllm.generate(prompts, **kw)}
        if with_raw:
            fns["raw_same"] = lambda: vllm.llm.generate(inputs, same, use_tqdm=False)
            fns["raw_plain"] = lambda: vllm.llm.generate(inputs, plain, use_tqdm=False)
        fns["ours_hf"] = lambda: hf.generate(prompts, **kw)
        return fns

    calls = timed_calls(contenders(a.num_prompts, True), a.repeats)
    tps = {name: [c["tokens"] / c["s"] for c in cs] for name, cs in calls.items()}
    ratios = {
        "ours_vllm/raw_same tokens/s": bc.summarize(bc.paired_ratios(tps["ours_vllm"], tps["raw_same"])),
        "ours_vllm/raw_plain tokens/s": bc.summarize(bc.paired_ratios(tps["ours_vllm"], tps["raw_plain"])),
        "ours_vllm/ours_hf tokens/s": bc.summarize(bc.paired_ratios(tps["ours_vllm"], tps["ours_hf"])),
    }

    sweep = []  # where does vLLM overtake HF? (per-call overheads vs batch size)
    for num_prompts in a.sweep:
        c = timed_calls(contenders(num_prompts, False), max(1, a.repeats // 2))
        v = [x["tokens"] / x["s"] for x in c["ours_vllm"]]
        h = [x["tokens"] / x["s"] for x in c["ours_hf"]]
        sweep.append({"num_prompts": num_prompts, "sequences": num_prompts * a.n, "vllm_tokens_per_s": bc.summarize(v),
                      "hf_tokens_per_s": bc.summarize(h), "vllm/hf": bc.summarize(bc.paired_ratios(v, h))})

    params = full_named_parameters(model, info)
    vllm.sync_weights(params)  # warm-up
    sync_s = []
    for _ in range(a.sync_repeats):
        t = time.perf_counter()
        vllm.sync_weights(full_named_parameters(model, info))
        sync_s.append(time.perf_counter() - t)

    result = {
        "benchmark": "generation", "env": env, "settings": {**{k: v for k, v in vars(a).items() if k != "out"},
                                                    "per_request_seeds": False},
        "num_parameters": sum(p.numel() for p in model.parameters()), "vllm_engine_start_s": engine_start_s,
        "tokens_per_s": {k: bc.summarize(v) for k, v in tps.items()}, "calls": calls, "ratios": ratios,
        "sweep": sweep, "sync_s": bc.summarize(sync_s),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if torch.cuda.is_available():
        result["gpu_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    path = bc.write_result("generation", result, a.out)

    print(bc.table([bc.stat_row(k, v, "tok/s") for k, v in tps.items()], ["metric", "unit", "min", "median", "max", "n"]))
    print(bc.table([{"ratio": k, **v} for k, v in ratios.items()], ["ratio", "min", "median", "max", "n"]))
    print(bc.table([{"num_prompts": s["num_prompts"], "sequences": s["sequences"],
                     "vllm tok/s": s["vllm_tokens_per_s"]["median"], "hf tok/s": s["hf_tokens_per_s"]["median"],
                     "vllm/hf": s["vllm/hf"]["median"]} for s in sweep],
                   ["num_prompts", "sequences", "vllm tok/s", "hf tok/s", "vllm/hf"]))
    print(f"weight sync: median {result['sync_s']['median'] * 1e3:.1f} ms ({result['num_parameters'] / 1e6:.2f} M "
          f"parameters); vLLM engine start {engine_start_s:.1f} s; peak RSS {result['peak_rss_mb']:.0f} MB")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
