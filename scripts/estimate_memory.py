"""Estimate (not a measurement): peak GPU memory of one GRPO training process, from a model's config. Issue #22.

    python scripts/estimate_memory.py                                   # Qwen2.5 0.5B / 1.5B / 7B, grpo.py's batch
    python scripts/estimate_memory.py --config path/to/config.json --micro_batch 16 --seq_len 2048

Every number is arithmetic on the config (no GPU, no download): the presets are the `config.json` fields of
Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct (copied below; `--config` reads any local HF config instead). For one GPU
holding everything (ZeRO-0; ZeRO-2/3 over G GPUs divide the optimizer terms, and ZeRO-3 the weights, by G), with
DeepSpeed's bf16 mode as grpo.py configures it on GPU:

  weights        2 P                  bf16 parameters of the policy
  optimizer      (4 + 8) P            fp32 master weights + Adam's two fp32 moments
  gradients      2 P (4 P in fp32)    bf16 gradients (fp32 accumulation, if configured, doubles them)
  reference      2 P if beta > 0      a frozen bf16 copy (grpo.py loads it only with --beta > 0; LoRA: 0, the
                                      base with adapters disabled is the reference)
  vLLM weights   2 P                  the colocated engine's own bf16 copy
  KV cache       the batch at once    num_completions x seq_len x layers x 2 (K, V) x kv_heads x head_dim x 2 B
                                      (vLLM reserves --vllm_gpu_memory_utilization of the GPU regardless)
  activations    per micro-batch      saved bf16 tensors per layer ~ 2 B x b x s x (9 h + 3 i) (norm in/out,
                                      q/k/v/o, residuals, SwiGLU gate/up/product; fused attention keeps no s x s);
                                      with gradient checkpointing only each layer's input, 2 B x b x s x h, plus
                                      one layer recomputed
  logits         per micro-batch      full: fp32 [b, s, V] logits, their log-softmax and the logits' gradient,
                                      3 x 4 B x b x s x V; lean (completion positions only, computed in chunks of
                                      c tokens, each recomputed in the backward): 3 x 4 B x min(c, b x completion) x V
With LoRA (rank r on every linear layer of the blocks): the adapters' parameters R = r x sum(in + out) train; the
optimizer and gradient terms use R instead of P, the base weights stay 2 P.

These are estimates: allocator fragmentation, CUDA context (~0.5-1 GB), temporary buffers and the framework's own
copies are not counted. Writes docs/bench/memory_estimate/<device>_<time>.json (the machine that did the arithmetic) (rendered into docs/performance.md
by scripts/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
GB = 1e9

# config.json fields of the Qwen2.5 instruct models (hub revisions of 2024-09; the base models share them)
PRESETS = {
    "Qwen2.5-0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "Qwen2.5-1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "Qwen2.5-7B": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
}


def shapes(cfg: dict) -> dict:
    """Parameter counts of a Llama/Qwen2-style decoder (q/k/v biases as Qwen2 has them; norms counted)."""
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o, gate up down: (in, out)
    per_layer = sum(a * b for a, b in linears) + (h + 2 * kv) + 2 * h  # + q/k/v biases + two RMSNorms
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return {"params": n * per_layer + embed + h, "layers": n, "hidden": h, "intermediate": i, "vocab": v,
            "kv_dim": kv, "lora_in_out_per_layer": sum(a + b for a, b in linears)}


def estimate(cfg: dict, a, b: int, lora_r: int, lean: bool) -> dict:
    s = shapes(cfg)
    P, n, h, i, V = s["params"], s["layers"], s["hidden"], s["intermediate"], s["vocab"]
    trained = lora_r * s["lora_in_out_per_layer"] * n if lora_r else P
    seq = a.seq_len
    act_layer = 2 * b * seq * (9 * h + 3 * i)
    activations = (2 * b * seq * h * n + act_layer) if a.gradient_checkpointing else act_layer * n
    tokens = min(a.logits_chunk, b * a.completion_len) if lean else b * seq
    terms = {
        "weights": 2 * P,
        "optimizer": 12 * trained,
        "gradients": (4 if a.fp32_grads else 2) * trained,
        "reference": 2 * P if (a.beta > 0 and not lora_r) else 0,
        "vllm_weights": 2 * P,
        "kv_cache": a.num_completions * seq * n * 2 * s["kv_dim"] * 2,
        "activations": activations,
        "logits": 3 * 4 * tokens * V,
    }
    return {"params": P, "trained_params": trained, "terms_gb": {k: v / GB for k, v in terms.items()},
            "total_gb": sum(terms.values()) / GB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--config", type=Path, help="a local HF config.json instead of the presets")
    p.add_argument("--micro_batch", type=int, nargs="+", default=[256, 16],
                   help="sequences per training forward: grpo.py's default --local_micro_batch_size, and a GPU size")
    p.add_argument("--seq_len", type=int, default=1024, help="prompt + completion tokens")
    p.add_argument("--completion_len", type=int, default=768)
    p.add_argument("--num_completions", type=int, default=512, help="sequences generated at once (the batch)")
    p.add_argument("--logits_chunk", type=int, default=4096, help="lean log-probs: tokens per chunk")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference copy)")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--fp32_grads", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "memory_estimate")
    a = p.parse_args()
    configs = {a.config.parent.name: json.loads(a.config.read_text())} if a.config else \
        {m: PRESETS[m] for m in a.models}
    rows = []
    for name, cfg in configs.items():
        for b in a.micro_batch:
            for lora_r in (0, a.lora_r):
                for lean in (False, True):
                    e = estimate(cfg, a, b, lora_r, lean)
                    rows.append({"model": name, "micro_batch": b, "lora_r": lora_r, "lean_logprobs": lean, **e})
                    print(f"{name:14s} b={b:<4d} {'LoRA r=' + str(lora_r) if lora_r else 'full':9s} "
                          f"{'lean' if lean else 'full-logits':11s} {e['total_gb']:8.1f} GB  "
                          + " ".join(f"{k}={v:.1f}" for k, v in e["terms_gb"].items()), flush=True)
    settings = {k: getattr(a, k) for k in ("micro_batch", "seq_len", "completion_len", "num_completions",
                                           "logits_chunk", "lora_r", "beta", "gradient_checkpointing", "fp32_grads")}
    result = {"benchmark": "memory_estimate", "estimate": True, "env": bc.environment(),
              "command": "python scripts/estimate_memory.py " + " ".join(sys.argv[1:]), "settings": settings,
              "configs": configs, "rows": rows}
    path = bc.write_result("memory_estimate", result, a.results, latest=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
