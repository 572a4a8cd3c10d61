"""repulse.py: the loss math as pure functions (spec "Tests this implementation should have"), the exact
P(bad) of the toy against Monte Carlo, and end-to-end runs as users launch them (1 process, and 2 processes
under ZeRO-2 with the three models)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from algorithms.repulse import (ctl_loss, ctl_weights, exact_log_prob_bad, forward_logprobs, kl_return, masked_mean,
                                neg_loss, neg_weight_logp_sum, rl_loss, rloo_baseline, snis_weights, tail_metrics,
                                transform_reward)
from shared import toy

ROOT = Path(__file__).resolve().parents[1]


def test_rloo_baseline_closed_form():
    R = torch.tensor([[1.0, 2.0, 4.0, 7.0]])
    expected = torch.tensor([[(2 + 4 + 7) / 3, (1 + 4 + 7) / 3, (1 + 2 + 7) / 3, (1 + 2 + 4) / 3]])
    assert torch.allclose(rloo_baseline(R), expected)
    assert not torch.allclose(rloo_baseline(R), R.mean(-1, keepdim=True).expand_as(R))  # not the mean with self
    with pytest.raises(ValueError, match="num_generations"):
        rloo_baseline(torch.ones(3, 1))


def test_snis_weights_sum_to_one_per_prompt_and_favour_low_reward():
    torch.manual_seed(0)
    lp, lq = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    r = torch.randn(3, 5)
    w = snis_weights(lp, -10.0 * r, lq)
    assert torch.allclose(w.sum(-1), torch.ones(3)) and not w.requires_grad
    # beta < 0 (code sign) puts the weight on the lowest-reward sample when p = q
    w_eq = snis_weights(torch.zeros(3, 5), -10.0 * r, torch.zeros(3, 5))
    assert torch.equal(w_eq.argmax(-1), r.argmin(-1))
    expected = torch.softmax(lp.detach() - 10.0 * r - lq, -1)
    assert torch.allclose(w, expected)


def test_reward_transform_and_kl_return():
    r = torch.tensor([-2.0, 0.0, 1.5])
    assert torch.allclose(transform_reward(r, 1.0, -1.0), r - torch.exp(-r))
    assert torch.allclose(transform_reward(r, 3.0, -0.3), r - 3.0 * torch.exp(-0.3 * r))
    lp, l0 = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert torch.allclose(kl_return(torch.tensor([2.0]), lp, l0, mask, 0.5), torch.tensor([2.0 - 0.5 * (0.5 - 1.0)]))
    assert torch.allclose(kl_return(torch.tensor([2.0]), lp, lp, mask, 10.0), torch.tensor([2.0]))  # p = p_0


def test_masked_sums_ignore_padding_unless_code_compat():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -4.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])  # second response is 1 token long
    assert torch.allclose(neg_weight_logp_sum(lp, mask, unmasked=False), torch.tensor([-7.0, -3.0]))
    assert torch.allclose(masked_mean(lp, mask), torch.tensor([-3.5, -3.0]))
    # changing padded positions does not change the masked quantities
    lp2 = lp.clone()
    lp2[1, 3] = -100.0
    lp2[:, 0] = -50.0
    assert torch.allclose(neg_weight_logp_sum(lp2, mask, unmasked=False), torch.tensor([-7.0, -3.0]))
    # the reference code sums the last A = 2 positions ending at each response's end: the shorter response
    # also counts its last prompt token (-2)
    assert torch.allclose(neg_weight_logp_sum(lp, mask, unmasked=True), torch.tensor([-7.0, -5.0]))
    w_masked = snis_weights(neg_weight_logp_sum(lp, mask, False).view(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    w_code = snis_weights(neg_weight_logp_sum(lp, mask, True).view(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
    assert w_code[0, 1] < w_masked[0, 1]  # the quirk gives the shorter response a smaller weight


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def _batch(tok, prompt, completions):
    from shared.data import pad_batch

    ids = tok(prompt).input_ids
    input_ids, attn, resp = pad_batch([ids] * len(completions), completions, tok.pad_token_id)
    return input_ids, attn, resp[:, 1:].float()


def test_alpha_zero_gives_exactly_the_reinforce_gradient(tiny_model):
    model, tok = tiny_model
    torch.manual_seed(1)
    ids_p, attn_p, mask_p = _batch(tok, toy.PROMPT, [torch.randint(5, 100, (2,)).tolist() for _ in range(6)])
    ids_q, attn_q, mask_q = _batch(tok, toy.PROMPT, [torch.randint(5, 100, (2,)).tolist() for _ in range(6)])
    adv = torch.randn(6)
    w = torch.softmax(torch.randn(2, 3), -1).view(-1)

    def repulse_loss(alpha):
        lp = forward_logprobs(model, ids_p, attn_p, mask_p)
        lpn = forward_logprobs(model, ids_q, attn_q, mask_q)
        return rl_loss(lp, mask_p, adv, 6) + alpha * neg_loss(lpn, mask_q, w, 6)

    g0 = _grads(model, repulse_loss(0.0))
    g_rl = _grads(model, rl_loss(forward_logprobs(model, ids_p, attn_p, mask_p), mask_p, adv, 6))
    assert torch.equal(g0, g_rl)
    assert not torch.allclose(_grads(model, repulse_loss(0.5)), g_rl)  # alpha > 0 changes it
    # the RL gradient is REINFORCE's: sum_i A_i grad(-mean_t log p_i) / B
    lp = forward_logprobs(model, ids_p, attn_p, mask_p)
    manual = sum(adv[i] * -(lp[i] * mask_p[i]).sum() / mask_p[i].sum() for i in range(6)) / 6
    assert torch.allclose(_grads(model, manual), g_rl, atol=1e-6)


def test_neg_term_is_one_over_n_times_the_snis_estimate(tiny_model):
    """alpha_eff = alpha / N: the neg term over J*N samples is (1/N) sum_j sum_i w_ji mean_t log p (spec §2.4)."""
    model, tok = tiny_model
    torch.manual_seed(2)
    ids, attn, mask = _batch(tok, toy.PROMPT, [torch.randint(5, 100, (2,)).tolist() for _ in range(8)])
    w = torch.softmax(torch.randn(2, 4), -1).view(-1)
    lp = forward_logprobs(model, ids, attn, mask)
    snis = [(w.view(2, 4)[j] * masked_mean(lp, mask).view(2, 4)[j]).sum() for j in range(2)]
    assert torch.allclose(neg_loss(lp, mask, w, 8), sum(snis) / 4 / 2)


def test_ctl_second_term_has_zero_expected_gradient_when_q_equals_p(tiny_model):
    """Under the proposal-centric twist E_{pi_t}[grad log psi_t] = 0 (P App. B.2); with q = p and samples from q
    the w_pi term's gradient is a Monte-Carlo estimate of 0, so it shrinks like 1/sqrt(N)."""
    from shared.generation import HFGenerator

    model, tok = tiny_model
    n = 4000
    gen = HFGenerator(model, tok)
    comps = gen.generate([tok(toy.PROMPT).input_ids], n=n, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=3)[0]
    ids, attn, mask = _batch(tok, toy.PROMPT, [c.token_ids for c in comps])
    with torch.no_grad():
        lp = forward_logprobs(model, ids, attn, mask)
    log_phi = -10.0 * torch.rand(n)
    w_sigma, w_pi = ctl_weights(lp, lp, log_phi, mask, n)
    assert torch.allclose(w_pi.sum(0)[mask.sum(0) > 0], torch.ones(int((mask.sum(0) > 0).sum())))
    lq = forward_logprobs(model, ids, attn, mask)
    second = _grads(model, ctl_loss(lq, lp, torch.zeros_like(w_sigma), w_pi, mask, 1))
    # one sample's gradient sets the scale: the mean of n zero-mean terms has norm ~ scale / sqrt(n)
    single = _grads(model, -masked_mean(forward_logprobs(model, ids[:1], attn[:1], mask[:1]), mask[:1]).sum())
    assert second.norm() < 4 * single.norm() / math.sqrt(n), (second.norm(), single.norm())


def test_exact_p_bad_matches_monte_carlo(tiny_model):
    """Enumeration over the ~100-token vocabulary vs the frequency of bad tokens in 20,000 samples."""
    from shared.generation import HFGenerator

    model, tok = tiny_model
    model.eval()
    prompt = tok(toy.PROMPT).input_ids
    bad = toy.bad_token_ids(tok)
    exact = math.exp(exact_log_prob_bad(model, prompt, bad, tok.eos_token_id, 2))
    n = 20000
    comps = HFGenerator(model, tok).generate([prompt], n=n, temperature=1.0,
                                                                            top_p=1.0, max_new_tokens=2, seed=5)[0]
    mc = sum(any(t in bad for t in c.token_ids) for c in comps) / n
    se = math.sqrt(exact * (1 - exact) / n)
    assert 0.02 < exact < 0.5 and abs(mc - exact) < 4 * se, (exact, mc, se)
    # and the toy reward marks exactly these samples as bad (r < eta)
    r = toy.make_toy_reward(tok)([toy.PROMPT] * 200, [tok.decode(c.token_ids, skip_special_tokens=True)
                                                       for c in comps[:200]])
    assert [x < -1 for x in r] == [any(t in bad for t in c.token_ids) for c in comps[:200]]
    one = math.exp(exact_log_prob_bad(model, prompt, bad, tok.eos_token_id, 1))
    assert one < exact


def test_tail_metrics():
    r = torch.tensor([-6.0, -5.5, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    m = tail_metrics(r, eta=-5.0, level=0.2)
    assert m["p_bad"] == pytest.approx(0.2) and m["cvar"] == pytest.approx(-5.75)
    assert tail_metrics(r, eta=-5.0, level=0.0001)["cvar"] == pytest.approx(-6.0)  # k = max(1, floor(aM))


def run(cmd: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--total_episodes", "256", "--num_generations", "32", "--local_micro_batch_size", "16",
         "--eval_every", "2", "--eval_num_samples", "64", "--sample_every", "2"]


def test_repulse_toy_end_to_end(tmp_path):
    """The script as users launch it, with every model (KL > 0 loads p_0) and micro-batching."""
    run([sys.executable, "algorithms/repulse.py", "--output_dir", str(tmp_path), *SMALL, "--kl_coef", "0.1"])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "loss/proposal_avg" in r]
    assert len(steps) == 256 // 64  # p and q samples both count towards total_episodes
    assert steps[-1]["episode"] == 256
    for key in ("exact/log_p_bad", "exact/log_q_bad", "proposal/ess_frac", "objective/kl", "optim/grad_norm_q"):
        assert all(r.get(key) is not None for r in steps), key
    assert steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # p == p_0 at the first rollout
    assert rows[0]["exact/log_p_bad"] == pytest.approx(rows[0]["exact/log_q_bad"])
    assert steps[-1]["exact/log_q_bad"] != pytest.approx(steps[-1]["exact/log_p_bad"])  # q and p moved apart
    last = rows[-1]
    assert {"eval/p_bad", "eval/cvar", "eval/mean_return"} <= set(last) and last["check/ranks_identical_weights"] == 1
    assert (tmp_path / "final" / "config.json").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_repulse_two_processes_deepspeed(tmp_path, stage):
    """accelerate launch, 2 CPU processes, three models under DeepSpeed ZeRO-2 / ZeRO-3: ranks end identical. Under
    ZeRO-3 the toy's single held-out prompt leaves rank 1 without one: it must still run the same generate calls and
    forwards (it used to skip them, and the partitioned models hung)."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"scripts/accelerate/zero{stage}.yaml",
         "algorithms/repulse.py", "--output_dir", str(tmp_path), "--total_episodes", "256", "--num_generations",
         "16", "--local_micro_batch_size", "8", "--eval_every", "0", "--eval_num_samples", "32", "--kl_coef", "0.1",
         "--no_save_model"])
    rows = metrics(tmp_path)
    assert rows[-1]["check/world_size"] == 2
    assert rows[-1]["check/ranks_identical_weights"] == 1
    assert rows[-1]["check/proposal_ranks_identical_weights"] == 1
    assert [r["episode"] for r in rows if "loss/proposal_avg" in r][-1] == 256
