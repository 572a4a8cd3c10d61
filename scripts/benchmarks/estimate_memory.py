"""Estimate, not a measurement: peak GPU memory of one GRPO training process, from a model's config. Issue #22.

    python scripts/benchmarks/estimate_memory.py                                   # Qwen2.5 0.5B / 1.5B / 7B, grpo.py's batch
    python scripts/benchmarks/estimate_memory.py --config path/to/config.json --micro_batch 16 --seq_len 2048

Every number is arithmetic on the config (no GPU, no download): the presets are the `config.json` fields of
Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct (copied below; `--config` reads any local HF config instead). For one GPU
holding everything (ZeRO-0; ZeRO-2/3 over G GPUs divide the optimizer terms, and ZeRO-3 the weights, by G), with
DeepSpeed's bf16 mode as the scripts configure it on GPU (P parameters, T of them trained: T = P in full fine-tuning):

  weights        2 P                  bf16 parameters of the policy
  optimizer      (4 + 8) T            fp32 master weights + Adam's two fp32 moments
  gradients      (2 + 4) T            bf16 gradients of the backward and their fp32 accumulation (DeepSpeed's bf16
                                      optimizer accumulates and steps in fp32)
  step buffers   4 T                  at the optimizer step only: PyTorch's multi-tensor (foreach) AdamW computes the
                                      square root of the second moments of all parameters at once, one fp32 copy
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
The step buffers exist at the optimizer step, the activations and logits during the forward and backward, so the
peak counts the larger of the two. With LoRA (rank r on every linear layer of the blocks): the adapters' parameters
R = r x sum(in + out) train; the optimizer, gradient and step terms use R instead of P, the base weights stay 2 P.

Checked against a GPU: `--compare docs/bench/gpu/<file>.json` (scripts/benchmarks/gpu_bench.py's measured peaks of the trainer
alone on an H100) estimates each measured configuration the same way, without the reference, the vLLM copy and the
KV cache, and stores both. There the training state (weights, optimizer, gradients, step buffers: 24 bytes per
parameter) was the measured peak to within 4% for all three models, and the activation term is an upper bound
(docs/performance.md). Allocator fragmentation, the CUDA context (~0.5-1 GB) and the framework's other temporary
buffers are not counted. Writes docs/bench/memory_estimate/<device>_<time>.json (the machine that did the arithmetic),
rendered into docs/performance.md by scripts/tools/docs_tables.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
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


def estimate(cfg: dict, a, b: int, lora_r: int, lean: bool, engine: bool = True) -> dict:
    """Peak bytes of one GRPO training process (terms in GB); engine=False: the trainer alone (no reference, no vLLM
    copy, no KV cache), as scripts/benchmarks/gpu_bench.py measures it."""
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
        "gradients": 6 * trained,
        "step_buffers": 4 * trained,
        "reference": 2 * P if (a.beta > 0 and not lora_r and engine) else 0,
        "vllm_weights": 2 * P if engine else 0,
        "kv_cache": a.num_completions * seq * n * 2 * s["kv_dim"] * 2 if engine else 0,
        "activations": activations,
        "logits": 3 * 4 * tokens * V,
    }
    # the step buffers (optimizer step) and the activations + logits (forward / backward) are never alive together
    transient = max(terms["step_buffers"], terms["activations"] + terms["logits"])
    total = sum(v for k, v in terms.items() if k not in ("step_buffers", "activations", "logits")) + transient
    return {"params": P, "trained_params": trained, "terms_gb": {k: v / GB for k, v in terms.items()},
            "total_gb": total / GB}


def compare(a, path: Path) -> list[dict]:
    """Trainer-only estimates of every training row that scripts/benchmarks/gpu_bench.py measured, beside the measured peak."""
    from types import SimpleNamespace

    measured = json.loads(path.read_text())
    rows = []
    for res in measured["results"]:
        if "train" not in res:
            continue
        cfg = {k: v for k, v in res["config"].items() if k != "architecture"}
        for t in res["train"]:
            if "oom" in t:
                continue
            ns = SimpleNamespace(**{**vars(a), "seq_len": t["seq_len"], "completion_len": t["seq_len"] - t["prompt_len"],
                                    "gradient_checkpointing": True, "beta": 0.0})
            e = estimate(cfg, ns, t["micro_batch"], 0, True, engine=False)
            rows.append({"model": res["model"], "micro_batch": t["micro_batch"], "seq_len": t["seq_len"],
                         "measured_gib": t["peak_allocated_gib"], "estimate_gib": e["total_gb"] * GB / 2**30,
                         "training_state_gib": sum(e["terms_gb"][k] for k in ("weights", "optimizer", "gradients",
                                                                               "step_buffers")) * GB / 2**30,
                         "terms_gb": e["terms_gb"]})
            r = rows[-1]
            print(f"{r['model']:14s} b={r['micro_batch']:<3d} measured {r['measured_gib']:6.2f} GiB, estimate "
                  f"{r['estimate_gib']:6.2f} GiB (training state {r['training_state_gib']:.2f})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--config", type=Path, help="a local HF config.json instead of the presets")
    p.add_argument("--micro_batch", type=int, nargs="+", default=[256, 64],
                   help="sequences per training forward: grpo.py's former and current default --local_micro_batch_size")
    p.add_argument("--seq_len", type=int, default=1024, help="prompt + completion tokens")
    p.add_argument("--completion_len", type=int, default=768)
    p.add_argument("--num_completions", type=int, default=512, help="sequences generated at once (the batch)")
    p.add_argument("--logits_chunk", type=int, default=512, help="lean log-probs: tokens per chunk (the scripts' 512)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference copy)")
    p.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compare", type=Path, default=None,
                   help="a scripts/benchmarks/gpu_bench.py JSON: estimate its measured configurations (trainer alone) beside them")
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
                                           "logits_chunk", "lora_r", "beta", "gradient_checkpointing")}
    result = {"benchmark": "memory_estimate", "estimate": True, "env": bc.environment(),
              "command": " ".join(["python scripts/benchmarks/estimate_memory.py", *sys.argv[1:]]), "settings": settings,
              "configs": configs, "rows": rows}
    if a.compare:
        result["compare"] = {"file": str(a.compare), "rows": compare(a, a.compare)}
    path = bc.write_result("memory_estimate", result, a.results, latest=False)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
