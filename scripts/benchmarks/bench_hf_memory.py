"""Benchmark (not a test): peak memory of one HF-backend generate call as the vocabulary grows.

    python scripts/benchmarks/bench_hf_memory.py                    # 32k vocabulary, 8 prompts x 8 samples x 64 tokens (~30 s)
    python scripts/benchmarks/bench_hf_memory.py --vocab 151936     # Qwen2.5's vocabulary size

A randomly initialised tiny Llama (hidden 128, 2 layers) with a large vocabulary, so that the logits, not the
model, dominate memory. Reports the growth of the process's peak RSS (`ru_maxrss`) during the first
`HFGenerator.generate` call, and on a GPU `torch.cuda.max_memory_allocated()`. Memory does not depend on
machine load, so this runs anywhere. Keeping every step's logits (`output_scores`) costs B x T x V floats;
`shared.generation` keeps one B x V log-softmax at a time (docs/changelog.md).
JSON summary: runs/bench/hf_memory/{cpu,gpu}_<time>.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.generation import HFGenerator

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().to(device)
    prompts = [[1] + torch.randint(3, a.vocab, (8,)).tolist() for _ in range(a.num_prompts)]
    gen = HFGenerator(model, SimpleNamespace(eos_token_id=2, pad_token_id=0))  # ids only: no text
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated() / 2**20
    t = time.perf_counter()
    out = gen.generate(prompts, n=a.n, temperature=1.0, top_p=1.0, max_new_tokens=a.max_new_tokens, seed=0)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"benchmark": "hf_memory", "env": bc.environment(), "settings": {k: v for k, v in vars(a).items()
                                                                              if k != "out"},
              "generated_tokens": sum(len(c.token_ids) for g in out for c in g), "seconds": seconds,
              "peak_rss_before_mb": before, "peak_rss_mb": peak, "peak_rss_growth_mb": peak - before}
    if device.type == "cuda":
        result["gpu_max_allocated_growth_mb"] = torch.cuda.max_memory_allocated() / 2**20 - gpu_before
    path = bc.write_result("hf_memory", result, a.out)
    print(f"vocab {a.vocab}, {a.num_prompts} x {a.n} sequences x {a.max_new_tokens} tokens: peak RSS "
          f"+{result['peak_rss_growth_mb']:.0f} MB during generate ({peak:.0f} MB peak)"
          + (f", GPU +{result['gpu_max_allocated_growth_mb']:.0f} MB" if device.type == "cuda" else "")
          + f"; wrote {path}")
    return result


if __name__ == "__main__":
    main()
