"""Benchmark (not a test): `--lora_sync merged` against `--lora_sync adapter` on builtin:smollm2-135m (SmolLM2-135M-
Instruct; fp32 on CPU, bf16 on a GPU): what one weight sync into the vLLM engine costs, what the engine holds, and how
fast it generates.

    python scripts/benchmarks/bench_lora_sync.py                           # rank 16, all linear layers (~1.5 min, 2 cores)
    python scripts/benchmarks/bench_lora_sync.py --lora_r 64 --syncs 10

One process, one LoRA policy built as the scripts build it (`shared.lora.add_lora`, all linear layers, small random
B adapters so that they change the model) and two engines built from it as the scripts build them
(`make_generator("vllm", ..., lora_sync=mode)`), one per mode, one after the other:
1. per engine: its build time, the growth of the process's RSS over the build (the engine's weights, its KV cache's
   touched pages and, with `adapter`, vLLM's LoRA buffers), and the bytes of those LoRA buffers (the stacked A and B
   slots of every LoRA layer of vLLM);
2. one warm-up sync per engine, then `--syncs` rounds, each after an untimed change of the B adapters, timing
   `sync_weights(full_named_parameters(policy, info))` as the scripts call it (`merged`: W + BA of every targeted
   layer, every weight reloaded; `adapter`: A and B written in peft format and loaded by vLLM's LoRA);
3. a fixed batch (`--num_prompts` held-out prompts of the built-in task in the chat template x `--num_generations`
   samples, `--max_new_tokens`, temperature 1, seeded as the scripts seed) generated once per engine as warm-up,
   then in `--gen_repeats` rounds; the largest difference between each engine's log-probs of its last batch and the
   trainer's; and the greedy completions of the prompts, compared between the two engines.
Within a round the engines take turns, the order alternating between rounds (scripts/bench_common.py), so a change of
the machine's load falls on both. Times depend on the load (its load average is recorded); memory does not. Not
measured here: multi-GPU runs, where the merged sync moves every weight across devices. JSON summary:
docs/bench/lora_sync/<device>_<time>.json (--out).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))

MODEL = "builtin:smollm2-135m"
MODES = ["merged", "adapter"]


def rss_mb() -> float:
    """This process's resident set size now (Linux /proc), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def lora_buffer_bytes(worker) -> int:
    """Run on the vLLM worker: bytes of the LoRA layers' stacked adapter slots (0 for an engine without LoRA)."""
    import torch

    total = 0
    for module in worker.model_runner.model.modules():
        for name in ("lora_a_stacked", "lora_b_stacked", "lora_bias_stacked"):
            slots = getattr(module, name, None)  # a tensor, or a tuple of them (one per packed projection)
            for t in [slots] if torch.is_tensor(slots) else slots or ():
                if torch.is_tensor(t):
                    total += t.numel() * t.element_size()
    return total


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per engine, after one warm-up sync")
    p.add_argument("--num_prompts", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--gen_repeats", type=int, default=2, help="timed generations of the batch per engine")
    p.add_argument("--max_model_len", type=int, default=256)
    p.add_argument("--out", type=Path, default=bc.ROOT / "docs" / "bench" / "lora_sync")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import importlib

    import torch

    from shared import data
    from shared.distributed import DistInfo, default_dtype, full_named_parameters, load_causal_lm, load_tokenizer
    from shared.generation import make_generator
    from shared.logprobs import forward_logprobs
    from shared.lora import add_lora
    from shared.models import resolve_model_path
    from shared.task import builtin_split

    env = bc.environment()
    importlib.import_module("vllm")  # imported before the engines' RSS is measured: the import is not an engine
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = default_dtype(device)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device, zero_stage=0, ds_base_config={})
    path = resolve_model_path(MODEL)
    tok = load_tokenizer(path)
    torch.manual_seed(0)
    policy = add_lora(load_causal_lm(path, dtype), SimpleNamespace(
        lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, lora_target_modules="all-linear")).to(device)
    policy.eval()
    b_adapters = [p for n, p in policy.named_parameters() if ".lora_B." in n]

    def change_adapters() -> None:
        with torch.no_grad():
            for p in b_adapters:
                p.add_(torch.randn_like(p) * 1e-3)

    change_adapters()
    engines, res = {}, {m: {} for m in MODES}
    for mode in MODES:
        rss = rss_mb()
        t = time.perf_counter()
        engines[mode] = make_generator("vllm", model_path=path, model=policy, tokenizer=tok, dtype=dtype, seed=0,
                                       max_model_len=a.max_model_len, world_size=1, zero_stage=0, lora_sync=mode)
        res[mode].update(engine_build_s=time.perf_counter() - t, engine_rss_growth_mb=rss_mb() - rss,
                         vllm_lora_buffer_bytes=sum(engines[mode].llm.collective_rpc(lora_buffer_bytes)))
        print(f"  {mode}: engine built in {res[mode]['engine_build_s']:.1f} s, RSS "
              f"+{res[mode]['engine_rss_growth_mb']:.0f} MB", flush=True)

    for mode in MODES:
        engines[mode].sync_weights(full_named_parameters(policy, info))  # warm-up
        res[mode]["sync_s"] = []
    for i in range(a.syncs):
        change_adapters()
        for mode in bc.alternating_order(MODES, i):
            t = time.perf_counter()
            engines[mode].sync_weights(full_named_parameters(policy, info))
            res[mode]["sync_s"].append(time.perf_counter() - t)
    res["merged"]["bytes_per_sync"] = sum(p.numel() * p.element_size() for n, p in policy.named_parameters()
                                          if ".lora_" not in n)
    res["adapter"]["bytes_per_sync"] = sum(f.stat().st_size for f in Path(engines["adapter"].adapter_dir).iterdir())
    print("  sync: " + ", ".join(f"{m} {statistics.median(res[m]['sync_s']):.3f} s" for m in MODES), flush=True)

    prompts = [data.encode_prompt(tok, r["prompt"], True) for r in builtin_split("test")[: a.num_prompts]]
    kw = dict(n=a.num_generations, temperature=1.0, top_p=1.0, max_new_tokens=a.max_new_tokens)
    last = {}
    for mode in MODES:
        engines[mode].generate(prompts, seed=0, **kw)  # warm-up
        res[mode].update(generate_s=[], generated_tokens=[])
    for i in range(a.gen_repeats):
        for mode in bc.alternating_order(MODES, i):
            t = time.perf_counter()
            last[mode] = engines[mode].generate(prompts, seed=1 + i, **kw)
            res[mode]["generate_s"].append(time.perf_counter() - t)
            res[mode]["generated_tokens"].append(sum(len(c.token_ids) for g in last[mode] for c in g))
    print("  generation: " + ", ".join(f"{m} {statistics.median(res[m]['generate_s']):.2f} s" for m in MODES),
          flush=True)

    for mode in MODES:
        flat_p = [p for p, g in zip(prompts, last[mode]) for _ in g]
        flat_c = [c for g in last[mode] for c in g]
        ids, attn, resp = data.pad_batch(flat_p, [c.token_ids for c in flat_c], pad_id=tok.pad_token_id)
        with torch.no_grad():
            logp, _ = forward_logprobs(policy, ids.to(device), attn.to(device), resp.to(device), 1.0)
        res[mode]["max_logprob_diff_vs_trainer"] = max(
            (torch.tensor(c.logprobs) - logp[i, len(p) - 1: len(p) - 1 + len(c.token_ids)].float().cpu()).abs().max()
            .item() for i, (p, c) in enumerate(zip(flat_p, flat_c)) if c.token_ids)
        res[mode]["greedy_token_ids"] = [g[0].token_ids for g in engines[mode].generate(
            prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=a.max_new_tokens, seed=0)]
        res[mode].update(sync_median_s=statistics.median(res[mode]["sync_s"]),
                         generate_median_s=statistics.median(res[mode]["generate_s"]))
    greedy = [res[m]["greedy_token_ids"] for m in MODES]
    result = {"benchmark": "lora_sync", "env": env, "model": MODEL, "dtype": str(dtype).replace("torch.", ""),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "command": bc.invocation([str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]),
              "modes": res, "greedy_equal_fraction": sum(x == y for x, y in zip(*greedy)) / len(prompts),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "loadavg_at_end": list(os.getloadavg())}
    path = bc.write_result("lora_sync", result, a.out, latest=False)
    print(f"same greedy completions: {result['greedy_equal_fraction']:.0%}; wrote {path}")
    return result


if __name__ == "__main__":
    main()
