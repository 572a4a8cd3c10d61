"""repulse.py: the loss math as pure functions (docs/repulse.md, "The math, as implemented"), the exact
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
from conftest import assert_clean_exit
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
    """alpha_eff = alpha / N: the neg term over J*N samples is (1/N) sum_j sum_i w_ji mean_t log p."""
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
    # the second-token forwards in chunks (a real vocabulary would not fit at once): the same value, any chunk size
    for chunk in (1, 7, 64):
        assert math.exp(exact_log_prob_bad(model, prompt, bad, tok.eos_token_id, 2, chunk)) == pytest.approx(
            exact, rel=1e-5)


@pytest.mark.real_model
@pytest.mark.slow
def test_bad_set_of_a_bpe_tokenizer_is_every_token_holding_a_bad_character():
    """On SmolLM2's BPE vocabulary the bad set is every token whose text holds a bad digit, so a completion holds a
    bad character exactly when one of its tokens is in the set (the exact log P(bad)'s premise)."""
    from shared.distributed import load_tokenizer
    from shared.models import resolve_model_path

    tok = load_tokenizer(resolve_model_path("builtin:smollm2-135m"))
    bad = set(toy.bad_token_ids(tok))
    assert bad == {t for t in range(len(tok)) if set(tok.decode([t])) & set(toy.BAD_CHARS)}
    assert {tok.decode([t]) for t in bad} == set(toy.BAD_CHARS)  # SmolLM2 splits numbers into single digits
    for text in [" 2024 was", " a 1990s", " fine man", " 4", " ninety"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert any(t in bad for t in ids) == any(c in text for c in toy.BAD_CHARS), text


def test_ctl_gradient_moves_q_towards_the_higher_sigma_weight_sample_hand_computed():
    """Two 1-token samples from a uniform q = p over 2 outputs, rewards (1, -1), beta = -10: by hand,
    w_sigma = softmax(beta r) = (sigmoid(-20), sigmoid(20)), w_pi = (1/2, 1/2) (an empty prefix), so
    L_q = sum_i -(w_sigma_i - 1/2) log q_i / 2 and, as sum_i (w_sigma_i - 1/2) = 0, dL/dlogits_i = -(w_sigma_i - 1/2)/2:
    gradient descent raises q's logit of the low-reward sample. A flipped sign of the main (w_sigma) term fails."""
    logits = torch.zeros(2, requires_grad=True)  # q over 2 outputs; sample i is output i
    lq = torch.log_softmax(logits, -1)[:, None]  # [2, T=1]
    lp = torch.full((2, 1), math.log(0.5))
    mask = torch.ones(2, 1)
    log_phi = -10.0 * torch.tensor([1.0, -1.0])
    w_sigma, w_pi = ctl_weights(lp, lq.detach(), log_phi, mask, 2)
    w_hand = torch.tensor([torch.sigmoid(torch.tensor(-20.0)), torch.sigmoid(torch.tensor(20.0))])
    assert torch.allclose(w_sigma, w_hand) and torch.allclose(w_pi, torch.full((2, 1), 0.5))
    ctl_loss(lq, lp, w_sigma, w_pi, mask, 2).backward()
    assert torch.allclose(logits.grad, -(w_hand - 0.5) / 2, atol=1e-7), logits.grad
    assert logits.grad[1] < 0 < logits.grad[0]  # a descent step moves q towards the low-reward sample


def _exact_log_prob_set(model, prompt_ids, end_ids, member, weight=None):
    """Exact log P_sigma(member) for 2-token completions by enumeration, sigma ∝ model * weight(completion) (weight
    None: sigma = model). member/weight take the token-id list of a completion (one token if it ended at once)."""
    with torch.no_grad():
        x = torch.tensor([prompt_ids])
        lp1 = torch.log_softmax(model(input_ids=x).logits[0, -1].float(), -1)
        V = lp1.shape[0]
        x2 = torch.cat([x.expand(V, -1), torch.arange(V)[:, None]], 1)
        lp2 = torch.log_softmax(model(input_ids=x2).logits[:, -1].float(), -1)
    num, den = [], []
    for a in range(V):
        for comp, lp in ([([a], lp1[a].item())] if a in end_ids else
                         [([a, b], lp1[a].item() + lp2[a, b].item()) for b in range(V)]):
            lw = lp + (weight(comp) if weight else 0.0)
            den.append(lw)
            if member(comp):
                num.append(lw)
    return (torch.logsumexp(torch.tensor(num), 0) - torch.logsumexp(torch.tensor(den), 0)).item()


def test_ctl_steps_move_q_towards_sigma_on_the_bad_set_exactly(tiny_model):
    """A case with a known answer: q starts at p (a random tiny model), sigma ∝ p exp(beta r) with beta = -10 and the
    toy's classifier reward puts almost all its mass on the bad set. A few CTL steps (the script's functions, Adam)
    must raise q's exact P(bad) (enumerated over every 2-token completion) towards sigma's, at every step."""
    import copy

    from shared.generation import HFGenerator

    p, tok = tiny_model
    p.eval()
    q = copy.deepcopy(p)
    prompt = tok(toy.PROMPT).input_ids
    bad = set(toy.bad_token_ids(tok))
    reward = toy.make_toy_reward(tok, "toy_classifier")
    score = lambda comp: reward([toy.PROMPT], [tok.decode(comp, skip_special_tokens=True)])[0]  # noqa: E731
    is_bad = lambda comp: any(t in bad for t in comp)  # noqa: E731
    end = {tok.eos_token_id}
    log_sigma_bad = _exact_log_prob_set(p, prompt, end, is_bad, weight=lambda c: -10.0 * score(c))
    trace = [_exact_log_prob_set(q, prompt, end, is_bad)]
    assert log_sigma_bad > -0.01 and trace[0] < -1.5  # sigma is (almost) all bad, q = p is not
    opt = torch.optim.Adam(q.parameters(), lr=3e-3)
    n = 256
    for step in range(4):
        comps = HFGenerator(q, tok).generate([prompt], n=n, temperature=1.0, top_p=1.0, max_new_tokens=2,
                                             seed=10 + step)[0]
        ids, attn, mask = _batch(tok, toy.PROMPT, [c.token_ids for c in comps])
        r = torch.tensor(reward([toy.PROMPT] * n, [tok.decode(c.token_ids, skip_special_tokens=True) for c in comps]))
        with torch.no_grad():
            lq_old, lp = forward_logprobs(q, ids, attn, mask), forward_logprobs(p, ids, attn, mask)
        w_sigma, w_pi = ctl_weights(lp, lq_old, -10.0 * r, mask, n)
        opt.zero_grad()
        ctl_loss(forward_logprobs(q, ids, attn, mask), lp, w_sigma, w_pi, mask, n).backward()
        opt.step()
        trace.append(_exact_log_prob_set(q, prompt, end, is_bad))
    assert all(b > a for a, b in zip(trace, trace[1:])), trace
    assert trace[-1] - trace[0] > 0.5 and trace[-1] < log_sigma_bad, trace


def _instrumented_run(tmp_path, monkeypatch, *flags):
    """Run algorithms/repulse.py's main in this process on the toy and record, in order: sampling calls, log-prob
    forwards (which model, with or without grad, which sample set), weight computations and optimizer steps."""
    from algorithms import repulse
    from shared import generation

    events, engines = [], []
    name = lambda m: {id(e): k for e, k in zip(engines, ("p", "q"))}.get(id(m), "other")  # noqa: E731

    real_prepare = repulse.prepare
    def prepare(*a, **k):  # noqa: E306
        out = real_prepare(*a, **k)
        engines.append(out[0])  # p_theta is prepared first, then q_xi
        return out

    real_generate = generation.HFGenerator.generate
    def generate(self, *a, **k):  # noqa: E306
        events.append(("generate",))
        return real_generate(self, *a, **k)

    real_fwd = repulse.forward_logprobs
    def forward_logprobs(model, input_ids, *a, **k):  # noqa: E306
        events.append(("fwd", name(model), torch.is_grad_enabled(),  # the sample set: its storage and content
                       (input_ids.data_ptr(), hash(input_ids.numpy().tobytes()))))
        return real_fwd(model, input_ids, *a, **k)

    class Guard(repulse.NonFiniteGuard):
        def step(self, engine):
            events.append(("step", name(engine)))
            return super().step(engine)

    class Checkpointer(repulse.Checkpointer):  # marks where each training iteration starts and ends
        def step_start(self, *a, **k):
            events.append(("iteration",))
            return super().step_start(*a, **k)

        def step_end(self, *a, **k):
            events.append(("end",))
            return super().step_end(*a, **k)

    for attr, fn in (("prepare", prepare), ("forward_logprobs", forward_logprobs), ("NonFiniteGuard", Guard),
                     ("Checkpointer", Checkpointer)):
        monkeypatch.setattr(repulse, attr, fn)
    for fn_name in ("snis_weights", "ctl_weights"):
        real = getattr(repulse, fn_name)
        monkeypatch.setattr(repulse, fn_name, lambda *a, _real=real, _n=fn_name: events.append((_n,)) or _real(*a))
    monkeypatch.setattr(generation.HFGenerator, "generate", generate)
    args = repulse.Args(output_dir=str(tmp_path), total_episodes=64, num_generations=16, local_micro_batch_size=16,
                        eval_every=0, eval_num_samples=16, sample_every=0, save_model=False, save_every=0,
                        best_metric="", **dict(flags))
    repulse.main(args)
    return events


def test_q_is_updated_before_p_and_both_steps_use_the_samples_drawn_before_either(tmp_path, monkeypatch):
    """One training iteration of the real script (the order of docs/repulse.md): both samplings and every no-grad
    log-prob (the stored log q, log p on the q samples, log p on the p samples) and the SNIS / CTL weights come before
    any optimizer step; every q step comes before the first p step; nothing is sampled between the updates; the
    gradient forwards run on exactly the sample sets drawn at the start of the iteration. Catches: p updated first,
    weights recomputed with an updated q or p, re-sampling between the updates."""
    events = _instrumented_run(tmp_path, monkeypatch)
    starts = [i for i, e in enumerate(events) if e == ("iteration",)]
    ends = [i for i, e in enumerate(events) if e == ("end",)]
    assert len(starts) == len(ends) == 2  # 64 samples, 2 x 16 per iteration
    for start, stop in zip(starts, ends):
        it = events[start + 1 : stop]
        steps = [i for i, e in enumerate(it) if e[0] == "step"]
        q_steps = [i for i in steps if it[i] == ("step", "q")]
        p_steps = [i for i in steps if it[i] == ("step", "p")]
        assert q_steps and p_steps and max(q_steps) < min(p_steps), it  # every q step before the first p step
        first_step = steps[0]
        assert it[:2] == [("generate",), ("generate",)]  # both samplings first (p's, then q's) ...
        assert [e for e in it if e == ("generate",)] == it[:2], it  # ... and no other
        assert [e for e in it[first_step:] if e[0] in ("snis_weights", "ctl_weights")] == [], it
        assert [e for e in it[first_step:] if e[0] == "fwd" and not e[2]] == [], it  # no log-prob recomputed after
        stored = [e for e in it if e[0] == "fwd" and not e[2]]
        assert [e[1] for e in stored] == ["p", "q", "p"]  # log p on S_p, log q on S_q, log p on S_q
        s_p, s_q = stored[0][3], stored[1][3]
        assert stored[2][3] == s_q and s_p != s_q
        grad_fwds = [(e[1], e[3]) for e in it if e[0] == "fwd" and e[2]]
        assert grad_fwds == [("q", s_q), ("p", s_p), ("p", s_q)], grad_fwds  # CTL, RL term, negative term
        assert it.index(("snis_weights",)) < it.index(("ctl_weights",)) < first_step


def test_the_toys_best_metric_is_the_exact_p_bad_and_varies(tmp_path):
    """The toy's dev slice is its one prompt: a sampled dev/p_bad (the fraction of eval_num_samples samples with
    r < eta) is 0 for every p_theta with P(bad) << 1/samples, so it was constant and kept the first such step as
    best. On the toy dev/p_bad is the exact P(bad) (the sampled fraction stays as dev/p_bad_sampled), so it varies
    with every update and output_dir/best is the step with the lowest."""
    run([sys.executable, "algorithms/repulse.py", "--output_dir", str(tmp_path), "--total_episodes", "256",
         "--num_generations", "32", "--local_micro_batch_size", "32", "--eval_every", "1", "--eval_num_samples", "64",
         "--sample_every", "0", "--no_save_model", "--save_every", "0"])
    evals = [r for r in metrics(tmp_path) if "dev/p_bad" in r]
    assert len(evals) == 256 // 64 + 1  # step 0, every step
    values = [r["dev/p_bad"] for r in evals]
    assert len(set(values)) == len(values), values  # not constant
    for r in evals:
        assert r["dev/p_bad"] == pytest.approx(math.exp(r["exact/log_p_bad"]), rel=1e-6)
        assert 0.0 <= r["dev/p_bad_sampled"] <= 1.0
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["metric"] == "dev/p_bad" and best["value"] == min(values)
    assert best["step"] == evals[values.index(min(values))]["step"]


def test_toy_classifier_reward_is_classifier_shaped():
    """Enumerating every completion of <= 2 characters: the bad set has the lowest scores (all below eta = -1, all
    others above it), scores are continuous-valued rather than an indicator, the start model's mode "1\n" is far
    from the top, and many completions tie near the top (no single best output)."""
    from shared.tiny import CHARS

    outs = [a + b for a in CHARS for b in CHARS] + list(CHARS) + [""]
    score = toy.make_toy_reward(None, "toy_classifier")
    r = dict(zip(outs, score([toy.PROMPT] * len(outs), outs)))
    bad = [o for o in outs if any(c in toy.BAD_CHARS for c in o)]
    good = [o for o in outs if o not in set(bad)]
    assert max(r[o] for o in bad) < -1.0 < min(r[o] for o in good)
    assert min(r[o] for o in bad) == pytest.approx(-4.0) and max(r.values()) == pytest.approx(4.0)
    assert len({round(r[o], 6) for o in bad}) > 3 and len({round(r[o], 6) for o in good}) > 10  # not an indicator
    assert r["00"] < r["0\n"] < r["1\n"] < r["\n\n"]  # more / nearer toxic characters score lower
    assert 0 < r["1\n"] < 1 and sum(r[o] > 4 - 1e-3 for o in good) > 1000
    # the older indicator reward stays reachable as `toy`
    old = toy.make_toy_reward(None, "toy")([toy.PROMPT] * 3, ["0\n", "1\n", "\n\n"])
    assert old[0] == toy.BAD_REWARD and 0 < old[1] < old[2] <= 1
    with pytest.raises(ValueError, match="reward_fn"):
        toy.make_toy_reward(None, "toy_binary")


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
    assert_clean_exit(out, " ".join(cmd))
    return out


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--total_episodes", "256", "--num_generations", "32", "--local_micro_batch_size", "16",
         "--eval_every", "2", "--eval_num_samples", "64", "--sample_every", "2"]


def test_repulse_toy_end_to_end(tmp_path):
    """The script as users launch it, with every model (KL > 0 loads p_0) and micro-batching."""
    run([sys.executable, "algorithms/repulse.py", "--output_dir", str(tmp_path), *SMALL, "--beta", "0.1"])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "loss/proposal_avg" in r]
    assert len(steps) == 256 // 64  # p and q samples both count towards total_episodes
    assert steps[-1]["episode"] == 256
    for key in ("exact/log_p_bad", "exact/log_q_bad", "proposal/ess_frac", "objective/kl", "optim/grad_norm_q",
                "objective/entropy"):
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
         "16", "--local_micro_batch_size", "8", "--eval_every", "0", "--eval_num_samples", "32", "--beta", "0.1",
         "--no_save_model"])
    rows = metrics(tmp_path)
    assert rows[-1]["check/world_size"] == 2
    assert rows[-1]["check/ranks_identical_weights"] == 1
    assert rows[-1]["check/proposal_ranks_identical_weights"] == 1
    assert [r["episode"] for r in rows if "loss/proposal_avg" in r][-1] == 256


def _load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, next((ROOT / "scripts").glob(f"**/{name}.py")))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_sweep_summary_checks_the_goal_seed_by_seed(tmp_path):
    """scripts/experiments/repulse_toy.py --paper: the goal (>= 1 nat below REINFORCE at held-out reward within 5%) is checked
    per seed against REINFORCE's run of the same seed, only over the seeds both finished; unfinished runs are pending;
    the docs renderer reads the summary."""
    sweep = _load_script("repulse_toy")

    def fake(name, seed, final, reward, per_step=1000, steps=10):
        run = tmp_path / f"{name}_seed{seed}"
        run.mkdir()
        rows = [{"step": 0, "episode": 0, "exact/log_p_bad": -5.0}]
        rows += [{"step": k, "episode": k * per_step, "exact/log_p_bad": -5.0 + (final + 5.0) * k / steps,
                  "objective/scores": reward} for k in range(1, steps + 1)]
        rows.append({"step": steps, "exact/log_p_bad": final, "eval/mean_reward": reward, "eval/p_bad": 0.0,
                     "time/total": 1.0})
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    fake("reinforce", 1, -8.0, 4.0, per_step=500, steps=20)
    fake("reinforce", 2, -8.0, 4.0, per_step=500, steps=20)
    fake("repulse_a0.1", 1, -9.5, 3.9)  # 1.5 nats lower, reward 2.5% lower: met
    fake("repulse_a0.1", 2, -9.5, 3.5)  # reward 12.5% lower: not met
    fake("repulse_a1", 1, -9.1, 4.0)  # met on seed 1; seed 2 not run
    (tmp_path / "repulse_a1_seed2").mkdir()  # started, unfinished (no time/total)
    (tmp_path / "repulse_a1_seed2" / "metrics.jsonl").write_text(json.dumps({"step": 0, "episode": 0}))
    names = sweep.configs(["reinforce", "repulse"], [0.1, 1.0], paper=True)
    assert list(names) == ["reinforce", "repulse_a0.1", "repulse_a1"] and names["repulse_a1"][-2:] == ["--alpha", "1"]
    d = sweep.paper_summary(tmp_path, names, [1, 2], {"env": None, "command": "python scripts/experiments/repulse_toy.py --paper"})
    assert d["pending"] == ["repulse_a1_seed2"] and not d["complete"]
    g = d["goal"]["repulse_a0.1"]
    assert [g["per_seed"][s]["met"] for s in ("1", "2")] == [True, False] and not g["met_on_every_seed"]
    assert g["per_seed"]["1"]["log_p_bad_gap_nats (reinforce - this)"] == pytest.approx(1.5)
    assert g["per_seed"]["2"]["relative_reward_difference"] == pytest.approx(0.125)
    assert d["goal"]["repulse_a1"]["seeds_compared"] == ["1"] and d["goal"]["repulse_a1"]["met_on_every_seed"]
    run = d["runs"]["reinforce"]["1"]
    assert run["p_updates"] == 20 and run["final_log_p_bad"] == -8.0
    assert [c[0] for c in run["curve"]] == [0, 5000, 10000]  # the paper's evaluation points, every 5,000 samples
    assert run["curve"][1][2] == pytest.approx(4.0)
    table = _load_script("docs_tables").repulse_toy_paper({**d, "settings": {**d["settings"], "common_flags": []}})
    assert "| repulse_a0.1 | 10 | −9.50, −9.50 |" in table and "+1.50, +1.50 | no |" in table
    assert "incomplete, 1 runs pending" in table
    # a run finished by another invocation (several at once, or on another machine) is credited to the one its
    # directory names, ahead of a stored summary's and of this invocation
    by = {"git_commit": "abc1234", "invocation_time": "2026-11-26 10:00:00", "device": "CPU Xeon x16"}
    (tmp_path / "repulse_a1_seed1" / sweep.FINISHED_UNDER).write_text(json.dumps(by))
    here = {"env": {"git_commit": "def5678", "time": "2026-11-26 11:00:00"}}
    stored = {"repulse_a1": {"1": {"finished_under": {"git_commit": "0000000"}}},
              "reinforce": {"1": {"finished_under": {"git_commit": "1111111"}}}}
    d = sweep.paper_summary(tmp_path, names, [1, 2], here, stored)
    assert d["runs"]["repulse_a1"]["1"]["finished_under"] == by
    assert d["runs"]["reinforce"]["1"]["finished_under"] == {"git_commit": "1111111"}  # no file: the stored one
    assert d["runs"]["repulse_a0.1"]["1"]["finished_under"]["git_commit"] == "def5678"  # neither: this invocation


def test_paper_sweep_reuses_runs_stored_in_its_summary(tmp_path):
    """A fresh clone has no run directories: finished runs stored in docs/results/repulse_toy.json are reused (same
    flags, same built-in models), not rerun; other flags or another start model reuse nothing; the plot's curves come
    from the stored summary."""
    sweep = _load_script("repulse_toy")
    names = sweep.configs(["reinforce", "repulse"], [0.1], paper=True)
    models = {"builtin:tiny-sft": {"weights_sha256": "ab", "expected": True}}
    run = {"samples": 250000, "p_updates": 500, "initial_log_p_bad": -5.0, "final_log_p_bad": -7.0,
           "heldout_mean_reward": 1.0, "curve": [[0, -5.0, None], [5000, -5.5, 0.9]],
           "finished_under": {"git_commit": "abc1234", "invocation_time": "2026-11-26 06:40:00"}}
    stored = {"settings": {"common_flags": ["--x"], "config_flags": names},
              "runs": {"reinforce": {"1": run}, "repulse_a0.1": {}},
              "invocations": [{"env": {"builtin_models": models}, "command": "python scripts/experiments/repulse_toy.py --paper"}]}
    path = tmp_path / "repulse_toy.json"
    path.write_text(json.dumps(stored))
    reused = sweep.stored_runs(path, ["--x"], names, models)
    assert reused["reinforce"]["1"]["final_log_p_bad"] == -7.0
    assert sweep.stored_runs(path, ["--y"], names, models) == {}  # other common flags
    assert sweep.stored_runs(path, ["--x"], names, {"builtin:tiny-sft": {"weights_sha256": "cd"}}) == {}
    more = models | {"builtin:tiny-rm": {"weights_sha256": "ef", "expected": True}}  # another model built since
    assert sweep.stored_runs(path, ["--x"], names, more)["reinforce"]["1"]["final_log_p_bad"] == -7.0
    assert sweep.stored_runs(path, ["--x"], names, {"builtin:tiny-rm": {"weights_sha256": "ef"}}) == {}
    other = sweep.configs(["reinforce"], [0.1], paper=True) | {"repulse_a0.1": ["--alpha", "0.2"]}
    assert set(sweep.stored_runs(path, ["--x"], other, models)) == {"reinforce"}  # a config's flags changed
    d = sweep.paper_summary(tmp_path / "runs", names, [1], {"env": {"git_commit": "def5678"}}, reused)
    assert d["runs"]["reinforce"]["1"]["finished_under"]["git_commit"] == "abc1234"
    assert d["pending"] == ["repulse_a0.1_seed1"]
    curves = sweep.paper_curves(d)
    assert curves["reinforce"][0][1] == {"episode": 5000, "exact/log_p_bad": -5.5, "objective/scores": 0.9}


def test_paper_table_counts_the_runs_each_machine_finished():
    """The sweep is spread over machines (this CPU, a GPU machine's CPUs): the table says which finished how many,
    from a run's own finished_under, else from the invocation it names."""
    tables = _load_script("docs_tables")
    inv = [{"env": {"time": "t1", "device": "CPU A x2", "torch": "2.13"}},
           {"env": {"time": "t2", "device": "CPU B x16", "torch": "2.11"}}]
    runs = {"reinforce": {"1": {"finished_under": {"invocation_time": "t1"}},
                          "2": {"finished_under": {"invocation_time": "t2", "device": "CPU B x16"}}},
            "repulse_a1": {"1": {"finished_under": {"invocation_time": "t1"}}, "2": {}}}
    assert tables.finishing_machines({"invocations": inv, "runs": runs}) == {
        "CPU A x2 (torch 2.13)": 2, "CPU B x16 (torch 2.11)": 1, "machine not recorded": 1}


def test_toy_cost_script_times_the_pieces_and_computes_a_run(tmp_path, monkeypatch):
    """scripts/benchmarks/repulse_toy_cost.py (the cost statement in docs/repulse.md) on the toy's own model: the pieces are
    timed, the exact log P(bad) whole (a small vocabulary), and a run's cost is the paper budget's sum of them."""
    import sys

    cost = _load_script("repulse_toy_cost")
    monkeypatch.setattr(sys, "argv", ["repulse_toy_cost.py", "--model", "builtin:tiny-sft", "--num_samples", "8",
                                      "--repeats", "1", "--results", str(tmp_path)])
    cost.main()
    (path,) = tmp_path.glob("*.json")
    d = json.loads(path.read_text())
    s, b = d["seconds"], d["budget"]
    assert d["exact_how"] == "timed whole" and all(v > 0 for v in s.values())
    assert (b["p_updates_reinforce"], b["steps_repulse"], b["exact_evaluations"]) == (31250, 15625, 51)  # N = 8
    want = (b["p_updates_reinforce"] * (s["generate"] + s["train"]) + 51 * s["exact_log_p_bad"]) / 3600
    assert d["per_run_hours"]["reinforce"] == pytest.approx(want)
