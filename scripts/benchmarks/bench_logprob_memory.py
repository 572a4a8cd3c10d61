"""Benchmark (not a test): peak memory of one GRPO training micro-step, full-logits log-probs vs the lean ones.

    python scripts/benchmarks/bench_logprob_memory.py     # builtin:smollm2-135m, 2 x 512 and 2 x 1,024 tokens, gradient
                                               # checkpointing off and on (~8 min on 2 CPU cores)
    python scripts/benchmarks/bench_logprob_memory.py --gpu --model Qwen/Qwen2.5-1.5B-Instruct --batch 8

A micro-step: the policy's forward, log-probs at temperature 0.7 (with the entropy, as grpo.py's update computes
it), grpo.py's clipped surrogate aggregated over the response tokens, and the backward pass. Two contenders, each in
its own subprocess per sequence length and gradient-checkpointing setting (the scripts'
`--gradient_checkpointing`: with it, the layers keep only their inputs, so the logits are a larger share):
  - `full`: the log-prob code every script had before (kept below as `full_logits_logprobs`): float32 logits of every
    position, prompt included, [B, L-1, V], then a full-vocabulary log-softmax and entropy;
  - `lean`: `shared/logprobs.py::forward_logprobs` (LM head on response positions only, in chunks recomputed in the
    backward pass).
Each row has a prompt of --prompt_len tokens and a response filling the rest of the sequence (random token ids:
memory does not depend on the text, nor on machine load, so this runs anywhere). Measured per child:
  - peak tensor memory: the largest total size of the tensors that torch ops created during the step (forward and
    backward, parameter gradients included, weights and inputs not), tracked op by op from the tensors' storages
    (on CPU torch keeps no allocator statistics; the tracking slows the step, so no time is reported);
  - peak RSS growth during the same step (`ru_maxrss` after minus before), which also counts allocator caching;
  - on a GPU, `torch.cuda.max_memory_allocated()` growth during the step.
JSON summary: runs/bench/logprob_memory/{cpu,gpu}_<time>.json (or --out DIR).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))


def full_logits_logprobs(model, input_ids, attention_mask, temperature: float, with_entropy: bool = False):
    """The reference: grpo.py's forward_logprobs before the lean version (float32 logits of every position)."""
    import torch

    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    logp = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            p = torch.softmax(logits, -1)
            entropy = torch.logsumexp(logits, -1) - (p * logits).sum(-1)
    return logp, entropy


def peak_tensor_probe():
    """A TorchDispatchMode that records the peak total size of the live tensors created by torch ops while active
    (the same probe as tests/test_lean_logprobs.py)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class PeakBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak = {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.live.setdefault((storage.device, storage.data_ptr()), (StorageWeakRef(storage),
                                                                                  storage.nbytes()))
            self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
            self.peak = max(self.peak, sum(n for _, n in self.live.values()))
            return out

    return PeakBytes()


def child(a) -> dict:
    """One micro-step of one contender at one length, in this process; returns its measurements."""
    import torch

    from algorithms.grpo import aggregate_loss, clipped_surrogate
    from shared.logprobs import forward_logprobs
    from shared.distributed import default_dtype, load_causal_lm
    from shared.models import resolve_model_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(resolve_model_path(a.model), default_dtype(device), a.gc == "on").to(device)
    model.train()  # as the scripts train (dropout is off); HF applies gradient checkpointing in training mode only
    V = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (a.batch, a.seq_len), generator=g).to(device)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, a.prompt_len :] = 1
    mask = resp[:, 1:].float()
    adv = torch.randn(a.batch, 1, generator=g).to(device).expand_as(mask)
    T = 0.7

    def step():
        if a.impl == "full":
            logp, entropy = full_logits_logprobs(model, ids, attn, T, True)
        else:
            logp, entropy = forward_logprobs(model, ids, attn, resp, T, True)
        pg, _, _ = clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.28, mask)
        n = int(mask.sum())
        aggregate_loss(pg, mask, "token_mean", a.batch, n, n, 1, a.seq_len - a.prompt_len).backward()
        model.zero_grad(set_to_none=True)

    out = {"impl": a.impl, "gradient_checkpointing": a.gc == "on", "seq_len": a.seq_len, "prompt_len": a.prompt_len, "batch": a.batch, "vocab": V,
           "full_logits_fp32_mb": a.batch * (a.seq_len - 1) * V * 4 / 2**20}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated() / 2**20
    with peak_tensor_probe() as probe:
        step()
    out["peak_tensor_mb"] = probe.peak / 2**20
    out["peak_rss_growth_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before
    if device.type == "cuda":
        out["gpu_max_allocated_growth_mb"] = torch.cuda.max_memory_allocated() / 2**20 - gpu_before
    return out


def run_child(a, impl: str, seq_len: int, gc: str) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--child_seq_len", str(seq_len), "--child_gc", gc, "--model",
           a.model, "--prompt_len", str(a.prompt_len), "--batch", str(a.batch)]
    proc = subprocess.run(cmd, cwd=bc.ROOT, env=bc.child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} at {seq_len} tokens failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    row = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"{impl:4s} {a.batch} x {seq_len} tokens, gradient checkpointing {gc}: peak tensors "
          f"{row['peak_tensor_mb']:.0f} MB, peak RSS +{row['peak_rss_growth_mb']:.0f} MB"
          + (f", GPU +{row['gpu_max_allocated_growth_mb']:.0f} MB" if "gpu_max_allocated_growth_mb" in row else ""),
          flush=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--seq_lens", type=int, nargs="+", default=[512, 1024], help="total tokens per row")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="rows in the micro-batch")
    p.add_argument("--gradient_checkpointing", choices=["off", "on", "both"], default="both")
    p.add_argument("--gpu", action="store_true", help="require a CUDA device")
    p.add_argument("--out", type=Path, default=None, help="directory of the JSON summary")
    p.add_argument("--child", choices=["full", "lean"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_seq_len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_gc", choices=["off", "on"], default="off", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:  # child mode: one measurement, printed as JSON
        a.impl, a.seq_len, a.gc = a.child, a.child_seq_len, a.child_gc
        print("RESULT " + json.dumps(child(a)), flush=True)
        return {}
    env = bc.environment(require_gpu=a.gpu)
    from shared.models import resolve_model_path

    resolve_model_path(a.model)  # a built-in model is converted once here, not inside a measured child
    rows = []
    gcs = ["off", "on"] if a.gradient_checkpointing == "both" else [a.gradient_checkpointing]
    for gc in gcs:
        for seq_len in a.seq_lens:
            for impl in ("full", "lean"):
                rows.append(run_child(a, impl, seq_len, gc))
    command = " ".join(["python scripts/benchmarks/bench_logprob_memory.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"benchmark": "logprob_memory", "command": command, "env": env,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                           if not k.startswith("child")}, "results": rows}
    path = bc.write_result("logprob_memory", result, a.out, latest=a.out is None)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
