"""--fp32_lm_head (shared/logprobs.py fp32_lm_head, make_generator(fp32_lm_head=True)): the output layer's product in
float32 on the trainer's side and on both samplers', against hand-computed numbers and a float64 reference; off,
bit-identical to the model's own layer; one 2-step grpo.py run with the flag."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.logprobs import _fp32_linear, fp32_lm_head, forward_logprobs, packed_forward_logprobs

ROOT = Path(__file__).resolve().parents[1]


def test_fp32_product_hand_computed():
    """1 * 1 + 2^-8 * 1 = 1.00390625 exactly in float32; bf16 (8 significant bits) rounds it to 1 (a tie, to even)."""
    head = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.fill_(1.0)
    hidden = torch.tensor([[1.0, 2.0**-8]], dtype=torch.bfloat16)
    assert head(hidden).item() == 1.0  # the model's dtype: rounded
    out = _fp32_linear(head, hidden)
    assert out.dtype == torch.float32 and out.item() == 1.00390625
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast would run the product in bf16 again: off inside
        assert _fp32_linear(head, hidden).item() == 1.00390625
    assert head.weight.dtype == torch.bfloat16  # the weight keeps its dtype


def _batch(tok, n=3, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tok), (n, length), generator=g)
    attn = torch.ones_like(ids)
    attn[0, -3:] = 0  # one right-padded row
    resp = attn.clone()
    resp[:, :4] = 0  # a 4-token prompt
    return ids, attn, resp


def _float64_logprobs(model, ids, attn, resp):
    """log-softmax in float64 of the model's own final hidden states times its (bf16) head weight, both in float64."""
    with torch.no_grad():
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        hidden = model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True,
                       logits_to_keep=1).hidden_states[-1][:, :-1]
        logits = hidden.double() @ model.lm_head.weight.double().T
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp * resp[:, 1:]


def test_fp32_head_closer_to_float64_and_off_is_identical(tiny_model):
    model, tok = tiny_model
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    ids, attn, resp = _batch(tok)
    keep = resp[:, 1:].bool()
    ref = _float64_logprobs(bf16, ids, attn, resp)
    with torch.no_grad():
        old = forward_logprobs(bf16, ids, attn, resp, 1.0)[0]
        fp32_lm_head([bf16, None], False)  # off: nothing changes
        assert "forward" not in vars(bf16.lm_head)
        assert torch.equal(forward_logprobs(bf16, ids, attn, resp, 1.0)[0], old)
        fp32_lm_head([bf16], True)
        new = forward_logprobs(bf16, ids, attn, resp, 1.0, chunk_size=5)[0]  # several checkpointed chunks
        packed = packed_forward_logprobs(bf16, ids, attn, resp, 1.0, chunk_size=5)[0]
    err_old, err_new = (old - ref)[keep].abs().max().item(), (new - ref)[keep].abs().max().item()
    assert err_new < 1e-5 < 1e-3 < err_old, (err_old, err_new)
    assert (packed - ref)[keep].abs().max().item() < 5e-2  # the packed layout: same head, other attention kernels
    # the gradient reaches the bf16 weight through the checkpointed chunks
    logp = forward_logprobs(bf16, ids, attn, resp, 1.0, chunk_size=5)[0]
    logp[keep].sum().backward()
    grad = bf16.lm_head.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16 and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # a float32 model: the flag computes exactly what the layer did
    fp32 = copy.deepcopy(model)
    with torch.no_grad():
        before = forward_logprobs(fp32, ids, attn, resp, 1.0)[0]
        fp32_lm_head([fp32], True)
        assert torch.equal(forward_logprobs(fp32, ids, attn, resp, 1.0)[0], before)


def test_fp32_head_refuses_an_adapter_on_the_head(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_model[0]), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match="fp32_lm_head: the output layer"):
        fp32_lm_head([model], True)


def test_hf_sampler_runs_the_head_in_fp32(tiny_model):
    """HF generate (the `hf` sampler) calls the same layer: its logits come out float32 from a bf16 model."""
    from shared.generation import HFGenerator

    model, tok = tiny_model
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    fp32_lm_head([bf16], True)
    seen = []
    bf16.lm_head.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    out = HFGenerator(bf16, tok).generate([[tok.bos_token_id, 5, 6]], n=2, temperature=1.0, top_p=1.0,
                                          max_new_tokens=4, seed=0)
    assert len(out[0]) == 2 and seen and all(s == (torch.bfloat16, torch.float32) for s in seen)


def _capture_logits(worker):
    """On the engine's worker: record the LM head's input and output at every logits computation."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    model = worker.model_runner.model
    proc = next(m for m in model.modules() if isinstance(m, LogitsProcessor))
    worker.fp32_seen = []
    proc.register_forward_hook(lambda m, args, out: worker.fp32_seen.append(
        (args[1].detach().clone(), args[0].weight.detach().clone(), out.detach().clone())))
    return str(proc.head_dtype)


def _seen(worker):
    return worker.fp32_seen


def test_vllm_sampler_runs_the_head_in_fp32(tiny_path):
    """The engine, built bf16 with the flag: vLLM's head_dtype is float32 and its logits are the float32 product of
    its bf16 hidden states and weight (not the bf16 product)."""
    from shared.generation import make_generator
    from shared.tiny import build_tokenizer

    tok = build_tokenizer()
    gen = make_generator("vllm", model_path=tiny_path, model=None, tokenizer=tok, dtype=torch.bfloat16, seed=0,
                         max_model_len=64, world_size=1, zero_stage=0, fp32_lm_head=True)
    assert gen.llm.collective_rpc(_capture_logits) == ["torch.float32"]
    out = gen.generate([[tok.bos_token_id, 5, 6]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    assert len(out[0]) == 2
    seen = gen.llm.collective_rpc(_seen)[0]
    assert seen
    for hidden, weight, logits in seen:
        assert hidden.dtype == weight.dtype == torch.bfloat16 and logits.dtype == torch.float32
        fp32 = torch.nn.functional.linear(hidden.float(), weight.float())[..., : logits.shape[-1]]
        bf16 = torch.nn.functional.linear(hidden, weight).float()[..., : logits.shape[-1]]
        assert (logits - fp32).abs().max().item() < 1e-4 < (logits - bf16).abs().max().item()


def test_grpo_runs_two_steps_with_the_flag(tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "algorithms/grpo.py", "--output_dir", str(tmp_path), "--fp32_lm_head",
           "--model_name_or_path", "builtin:tiny", "--total_episodes", "32", "--local_num_prompts", "4",
           "--num_generations", "4", "--local_micro_batch_size", "8", "--max_new_tokens", "8",
           "--eval_num_prompts", "4", "--eval_num_samples", "1", "--eval_every", "0", "--dev_num_prompts", "4",
           "--no_save_model"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("val/sampler_kl" in r for r in rows) == 2


def test_bench_render_names_both_arms_and_the_command():
    sys.path.insert(0, str(ROOT / "scripts" / "experiments"))
    from bench_fp32_lm_head import render

    s = lambda v: {"mean": v, "min": v, "max": v, "n": 1}  # noqa: E731
    arm = lambda kl: {k: s(v) for k, v in {"val/sampler_kl": kl, "val/sampler_logprob_diff": 0.01,  # noqa: E731
                                          "val/tis_ratio_p99": 1.05, "start": 0.5, "final": 0.6, "time/train": 5.0,
                                          "time/generate": 1.0}.items()} | {"seeds": {"1": {}}}
    d = {"arms": {"off": arm(2e-4), "on": arm(1e-4)}, "sampler_kl_on_over_off": {"1": 0.5}, "steps": 10,
         "command": "python scripts/experiments/bench_fp32_lm_head.py", "env": {"device": "CPU x", "vllm": "0.32.0"}}
    text = render(d)
    assert "| off | 0.0002 (0.0002-0.0002)" in text and "| on | 0.0001" in text and "(1): 0.50" in text
    assert "`python scripts/experiments/bench_fp32_lm_head.py`" in text
