"""Benchmark (not a test): peak memory of one micro-step of opd.py's full-distribution losses (--loss jsd, fkl_topk),
the whole [B, L-1, V] distributions of both models against opd.py's chunks on the completion positions.

    python scripts/benchmarks/bench_opd_memory.py --out docs/bench/opd_memory     # builtin:smollm2-135m as student and teacher
                                                                        # (vocabulary 49,152), 4 x (64 + 128) tokens
    python scripts/benchmarks/bench_opd_memory.py --prompt_len 128 --completion_len 384 --gradient_checkpointing on \
        --out docs/bench/opd_memory                                     # longer rows, opd.py's checkpointing
    python scripts/benchmarks/bench_opd_memory.py --gpu --model Qwen/Qwen2.5-0.5B-Instruct --batch 8 --prompt_len 256

A micro-step: the student's and the teacher's forward, the divergence (generalised JSD at jsd_beta 0.5, or the
top-32 forward KL with its tail) at temperature 1 averaged over the completion tokens, and the backward pass into
the student (the student: the model with every weight scaled by 1 + 5% noise, so that the divergence is not 0), without
gradient checkpointing (--gradient_checkpointing on: with it, opd.py's default; the layers then keep only their
inputs, and the distributions are a larger share of the step). Two contenders, each in its own
subprocess per loss:
  - `whole`: opd.py's code before the chunks (kept below as `whole_distribution_losses`): both models' logits at
    every position, prompt included, float32 log_softmax over the vocabulary, [B, L-1, V] each, then the loss;
  - `chunked`: algorithms/opd.py::distribution_losses (both LM heads on the completion positions only, 512 at a
    time, each chunk recomputed in the backward pass).
Rows: a prompt of --prompt_len and a completion of --completion_len random token ids (memory does not depend on the
text). Measured per child, as scripts/benchmarks/bench_logprob_memory.py does: the peak total size of the tensors torch ops
created during the step (forward and backward, parameter gradients included, weights and inputs not), the peak RSS
growth (ru_maxrss after minus before) and, on a GPU, torch.cuda.max_memory_allocated() growth; also the loss value,
which the two contenders must agree on.
JSON summary: runs/bench/opd_memory/{cpu,gpu}_<time>.json (or --out DIR).
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
from bench_logprob_memory import peak_tensor_probe  # noqa: E402

sys.path.insert(0, str(bc.ROOT))


def whole_distribution_losses(policy, teacher, input_ids, attention_mask, response_mask, temperature, loss, jsd_beta,
                              topk, topk_tail):
    """The reference: opd.py's full-distribution path before the chunks (distribution_logprobs of both models at
    every position, float32, [B, L-1, V]); (divergence, log pi) [B, L-1] at the completion positions."""
    import torch

    from algorithms.opd import generalized_jsd, topk_forward_kl

    def distribution_logprobs(model):
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return torch.log_softmax(out.logits[:, :-1].float() / temperature, -1)

    student_lp = distribution_logprobs(policy)
    with torch.no_grad():
        teacher_lp = distribution_logprobs(teacher)
    keep = response_mask[:, 1:].float()
    logp = student_lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1) * keep
    if loss == "jsd":
        divergence = generalized_jsd(student_lp, teacher_lp, jsd_beta)
    else:
        divergence = topk_forward_kl(student_lp, teacher_lp, topk, topk_tail)[0]
    return divergence * keep, logp


def child(a) -> dict:
    """One micro-step of one contender with one loss, in this process; returns its measurements."""
    import torch

    from algorithms.opd import distribution_losses
    from shared.distributed import default_dtype, load_causal_lm, prepare_frozen, DistInfo
    from shared.models import resolve_model_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = default_dtype(device)
    path = resolve_model_path(a.model)
    policy = load_causal_lm(path, dtype, a.gradient_checkpointing == "on").to(device)
    policy.train()
    teacher = prepare_frozen(load_causal_lm(path, dtype).to(device), DistInfo(0, 1, 0, device, 0, {}), dtype)
    V = policy.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a student 5% off the teacher, weight by weight: a divergence that is not 0
        for param in policy.parameters():
            param.mul_(1 + 0.05 * torch.randn(param.shape, generator=g).to(param))
    seq_len = a.prompt_len + a.completion_len
    ids = torch.randint(0, V, (a.batch, seq_len), generator=g).to(device)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, a.prompt_len :] = 1
    mask = resp[:, 1:].float()

    def step() -> float:
        if a.impl == "whole":
            divergence, _ = whole_distribution_losses(policy, teacher, ids, attn, resp, 1.0, a.loss, 0.5, 32, True)
        else:
            one_teacher = torch.zeros(len(ids), dtype=torch.long)  # every row learns from the one teacher
            divergence = distribution_losses(policy, [teacher], one_teacher, ids, attn, resp, 1.0, None, a.loss, 0.5,
                                             32, True)[0]
        total = (divergence * mask).sum() / mask.sum()
        total.backward()
        policy.zero_grad(set_to_none=True)
        return total.item()

    out = {"impl": a.impl, "loss": a.loss, "gradient_checkpointing": a.gradient_checkpointing == "on", "batch": a.batch,
           "prompt_len": a.prompt_len,
           "completion_len": a.completion_len, "vocab": V, "dtype": str(dtype).replace("torch.", ""),
           "one_distribution_fp32_mb": a.batch * (seq_len - 1) * V * 4 / 2**20}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated() / 2**20
    with peak_tensor_probe() as probe:
        out["loss_value"] = step()
    out["peak_tensor_mb"] = probe.peak / 2**20
    out["peak_rss_growth_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before
    if device.type == "cuda":
        out["gpu_max_allocated_growth_mb"] = torch.cuda.max_memory_allocated() / 2**20 - gpu_before
    return out


def run_child(a, impl: str, loss: str) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--child_loss", loss, "--model", a.model,
           "--gradient_checkpointing", a.gradient_checkpointing, "--prompt_len",
           str(a.prompt_len), "--completion_len", str(a.completion_len), "--batch", str(a.batch)]
    proc = subprocess.run(cmd, cwd=bc.ROOT, env=bc.child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} {loss} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    row = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"{impl:7s} --loss {loss:8s} {a.batch} x ({a.prompt_len} + {a.completion_len}) tokens: peak tensors "
          f"{row['peak_tensor_mb']:.0f} MB, peak RSS +{row['peak_rss_growth_mb']:.0f} MB, loss {row['loss_value']:.6f}"
          + (f", GPU +{row['gpu_max_allocated_growth_mb']:.0f} MB" if "gpu_max_allocated_growth_mb" in row else ""),
          flush=True)
    return row


def render(d: dict) -> str:
    """The stored JSON as a markdown table: peak memory of the micro-step, whole distributions against the chunks."""
    rows = {(r["loss"], r["impl"]): r for r in d["results"]}
    r0 = d["results"][0]
    lines = ["| loss | whole [B, L-1, V]: peak tensors | chunked: peak tensors | ratio | whole: peak RSS growth | "
             "chunked: peak RSS growth | loss value (whole / chunked) |", "|---|---|---|---|---|---|---|"]
    for loss in dict.fromkeys(r["loss"] for r in d["results"]):
        w, c = rows[(loss, "whole")], rows[(loss, "chunked")]
        lines.append(f"| `--loss {loss}` | {w['peak_tensor_mb']:,.0f} MB | {c['peak_tensor_mb']:,.0f} MB | "
                     f"{w['peak_tensor_mb'] / c['peak_tensor_mb']:.1f}x | {w['peak_rss_growth_mb']:,.0f} MB | "
                     f"{c['peak_rss_growth_mb']:,.0f} MB | {w['loss_value']:.6f} / {c['loss_value']:.6f} |")
    env = d["env"]
    machine = env.get("device", "")
    lines.append("")
    lines.append(f"One micro-step (both forwards, the loss over the completion tokens, the backward into the student) "
                 f"of {d['settings']['model']} as teacher and, perturbed, student, {r0['batch']} rows of "
                 f"{r0['prompt_len']} prompt "
                 f"+ {r0['completion_len']} completion tokens, vocabulary {r0['vocab']:,}, {r0['dtype']}, gradient "
                 f"checkpointing {'on' if r0.get('gradient_checkpointing') else 'off'}; one "
                 f"[B, L-1, V] float32 distribution is {r0['one_distribution_fp32_mb']:,.0f} MB. `{d['command']}`, "
                 f"{machine}.")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--completion_len", type=int, default=128)
    p.add_argument("--gradient_checkpointing", choices=["on", "off"], default="off",
                   help="the student's (opd.py's --gradient_checkpointing is on by default)")
    p.add_argument("--batch", type=int, default=4, help="rows in the micro-batch")
    p.add_argument("--losses", nargs="+", choices=["jsd", "fkl_topk"], default=["jsd", "fkl_topk"])
    p.add_argument("--gpu", action="store_true", help="require a CUDA device")
    p.add_argument("--out", type=Path, default=None, help="directory of the JSON summary")
    p.add_argument("--child", choices=["whole", "chunked"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--child_loss", choices=["jsd", "fkl_topk"], default="jsd", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:  # child mode: one measurement, printed as JSON
        a.impl, a.loss = a.child, a.child_loss
        print("RESULT " + json.dumps(child(a)), flush=True)
        return {}
    env = bc.environment(require_gpu=a.gpu)
    from shared.models import resolve_model_path

    resolve_model_path(a.model)  # a built-in model is converted once here, not inside a measured child
    rows = [run_child(a, impl, loss) for loss in a.losses for impl in ("whole", "chunked")]
    command = " ".join(["python scripts/benchmarks/bench_opd_memory.py", *(sys.argv[1:] if argv is None else argv)])
    result = {"benchmark": "opd_memory", "command": command, "env": env,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                           if not k.startswith("child")}, "results": rows}
    path = bc.write_result("opd_memory", result, a.out, latest=a.out is None)
    print(f"wrote {path}")
    print(render(result))
    return result


if __name__ == "__main__":
    main()
