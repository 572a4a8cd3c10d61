"""Benchmark (not a test): the optimizer-side cost of one training step on a real model, and what the scripts save.

    python scripts/benchmarks/bench_optimizer.py                  # builtin:smollm2-135m, fp32, CPU (~1 min on 2 cores)
    python scripts/benchmarks/bench_optimizer.py --repeats 9 --model builtin:tiny-sft

Found profiling rm.py against TRL's RewardTrainer (an RM step measured at 1.27x TRL's), two costs that TRL's
step does not pay, both measured here in one process on the same model with the same (random, fixed) gradients:

1. The AdamW update: `torch.optim.AdamW` with its three implementations, `foreach=False` (a Python loop over the
   parameters: PyTorch's CPU default), `foreach=True` (multi-tensor ops) and `fused=True` (one kernel per parameter
   group; what transformers' Trainer, hence TRL, uses by default: `optim="adamw_torch_fused"`, and so does
   every script here). Time of one `optimizer.step()` after a warm-up step that creates the state.
2. DeepSpeed's backward all-reduce in one process without ZeRO: `engine.allreduce_gradients()` at a gradient
   accumulation boundary flattens every gradient into buckets, reduces them over a group of one, divides by 1 and
   copies back. `shared/distributed.py::prepare` now switches it off there (`enable_backward_allreduce = False`);
   timed here by calling it directly.

Each repeat times every contender once, in alternating order; medians and spreads over the repeats. JSON:
docs/bench/optimizer/<device>_<time>.json (--out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=bc.ROOT / "docs" / "bench" / "optimizer")
    a = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from shared.console import muted
    from shared.distributed import init_distributed, load_causal_lm, prepare
    from shared.models import resolve_model_path

    env = bc.environment()
    info = init_distributed()
    torch.manual_seed(0)
    model = load_causal_lm(resolve_model_path(a.model), torch.float32)
    num_parameters = sum(p.numel() for p in model.parameters())
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]

    def set_grads(m):
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()

    set_grads(model)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-6, **kw) for name, kw in (
        ("adamw_for_loop", {"foreach": False}), ("adamw_foreach", {"foreach": True}), ("adamw_fused", {"fused": True}))}
    for opt in optimizers.values():
        opt.step()  # creates the state (exp_avg, exp_avg_sq)

    with muted():
        engine, *_ = prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True), None, info, 1, 1, 0.0,
                             torch.float32)
    assert engine.is_gradient_accumulation_boundary()

    def all_reduce():
        engine.allreduce_gradients()

    fns = {name: opt.step for name, opt in optimizers.items()}
    fns["deepspeed_all_reduce_world_1"] = all_reduce
    times: dict[str, list[float]] = {name: [] for name in fns}
    print(f"[bench_optimizer] {env['device']}; {a.model} ({num_parameters / 1e6:.1f} M parameters); "
          f"{a.repeats} alternating repeats", flush=True)
    for rep in range(a.repeats):
        for name in bc.alternating_order(list(fns), rep):
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
        print(f"  repeat {rep + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in fns), flush=True)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    result = {
        "benchmark": "optimizer", "env": env, "model": a.model, "num_parameters": num_parameters,
        "settings": {"model": a.model, "repeats": a.repeats},
        "command": bc.invocation(None if argv is None else [__file__, *argv]),
        "seconds": {name: bc.summarize(ts) for name, ts in times.items()},
        "ratios": {"adamw_for_loop/adamw_fused": bc.summarize(bc.paired_ratios(times["adamw_for_loop"],
                                                                               times["adamw_fused"])),
                   "adamw_foreach/adamw_fused": bc.summarize(bc.paired_ratios(times["adamw_foreach"],
                                                                              times["adamw_fused"]))},
        "saved_per_optimizer_step_s": med["adamw_for_loop"] - med["adamw_fused"] + med["deepspeed_all_reduce_world_1"],
    }
    path = bc.write_result("optimizer", result, a.out, latest=False)
    print("medians: " + ", ".join(f"{n} {m:.3f} s" for n, m in med.items()) + f"\nwrote {path}", flush=True)
    return result


if __name__ == "__main__":
    main()
