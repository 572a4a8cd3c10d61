"""Unit tests of dpo.py's pure functions (the losses of docs/dpo.md)."""

import math
import random

import pytest
import torch

from algorithms.dpo import Args, make_pairs, preference_loss, sequence_logps, validate
from shared import data, task
from shared.cli import check_args


def sig(x):
    return 1 / (1 + math.exp(-x))


# one pair with hand-picked summed log-probs: delta = (-3 - -4) - (-6 - -5) = 1 + 1 = 2
POL_W, POL_L, REF_W, REF_L = -3.0, -6.0, -4.0, -5.0
BETA, EPS = 0.5, 0.1


def loss(kind, **kw):
    t = lambda x: torch.tensor([x])  # noqa: E731
    return preference_loss(t(POL_W), t(POL_L), t(REF_W), t(REF_L), kind, kw.pop("beta", BETA), **kw).item()


def test_each_loss_matches_its_formula_on_hand_made_numbers():
    d = 2.0
    assert loss("sigmoid") == pytest.approx(-math.log(sig(BETA * d)))
    assert loss("cdpo", label_smoothing=EPS) == pytest.approx(
        -(1 - EPS) * math.log(sig(BETA * d)) - EPS * math.log(sig(-BETA * d)))
    assert loss("robust", label_smoothing=EPS) == pytest.approx(
        (-(1 - EPS) * math.log(sig(BETA * d)) + EPS * math.log(sig(-BETA * d))) / (1 - 2 * EPS))
    assert loss("hinge") == pytest.approx(max(0.0, 1 - BETA * d))
    assert loss("hinge", beta=0.1) == pytest.approx(0.8)
    assert loss("ipo") == pytest.approx((d - 1 / (2 * BETA)) ** 2)  # summed log-ratios
    len_w, len_l = torch.tensor([2.0]), torch.tensor([4.0])  # length-averaged: 1/2 - (-1)/4 = 0.75
    assert loss("ipo", len_w=len_w, len_l=len_l) == pytest.approx((0.75 - 1 / (2 * BETA)) ** 2)
    # DPO-Positive: s_theta(y_w) = -3 > s_ref(y_w) = -4, so no penalty: equals cDPO
    assert loss("dpop", label_smoothing=EPS) == pytest.approx(loss("cdpo", label_smoothing=EPS))


def test_dpop_penalises_a_falling_chosen_likelihood():
    t = lambda x: torch.tensor([x])  # noqa: E731
    # chosen log-prob fell by 0.5 below the reference: z = delta - lambda * 0.5
    pol_w, pol_l, ref_w, ref_l = -4.5, -7.0, -4.0, -5.0
    delta = (pol_w - ref_w) - (pol_l - ref_l)  # 1.5
    z = delta - 50.0 * 0.5
    got = preference_loss(t(pol_w), t(pol_l), t(ref_w), t(ref_l), "dpop", 0.1, 0.0, 50.0).item()
    assert got == pytest.approx(-math.log(sig(0.1 * z)))
    assert got > preference_loss(t(pol_w), t(pol_l), t(ref_w), t(ref_l), "sigmoid", 0.1).item()


def test_label_smoothing_zero_reduces_to_sigmoid():
    torch.manual_seed(0)
    pw, pl, rw, rl = (torch.randn(16) * 3 for _ in range(4))
    base = preference_loss(pw, pl, rw, rl, "sigmoid", 0.3)
    for kind in ("cdpo", "robust"):
        torch.testing.assert_close(preference_loss(pw, pl, rw, rl, kind, 0.3, 0.0), base)


def test_every_loss_is_log2_or_its_constant_at_step_zero():
    z = torch.full((4,), -7.0)
    for kind in ("sigmoid", "cdpo", "robust", "dpop"):
        torch.testing.assert_close(preference_loss(z, z, z, z, kind, 0.1, 0.0), torch.full((4,), math.log(2)))
    torch.testing.assert_close(preference_loss(z, z, z, z, "hinge", 0.1), torch.ones(4))
    torch.testing.assert_close(preference_loss(z, z, z, z, "ipo", 0.1), torch.full((4,), 25.0))


@pytest.fixture(scope="module")
def pair_batch(tiny_model):
    model, tok = tiny_model
    rows = task.builtin_preferences("test")[:4]
    p = [data.encode_prompt(tok, r["prompt"], False) for r in rows]
    c = [data.encode_response(tok, r["chosen"]) for r in rows]
    r_ = [data.encode_response(tok, r["rejected"] + "\n0") for r in rows]  # a different length
    return model.eval(), tok, p, c, r_


def test_dpo_loss_is_log2_and_dpop_penalty_zero_at_step_zero_with_a_real_model(pair_batch):
    """pi == pi_ref (the reference log-probs computed by the same model) gives delta = 0 exactly."""
    model, tok, p, c, r_ = pair_batch
    ids, attn, resp = data.pad_batch(p + p, c + r_, tok.pad_token_id)
    with torch.no_grad():
        ref, _ = sequence_logps(model, ids, attn, resp)
    pol, _ = sequence_logps(model, ids, attn, resp)
    n = len(p)
    losses = preference_loss(pol[:n], pol[n:], ref[:n], ref[n:], "sigmoid", 0.1)
    torch.testing.assert_close(losses, torch.full((n,), math.log(2)))
    assert torch.relu(ref[:n] - pol[:n]).abs().max().item() == 0.0  # DPO+ penalty
    losses.mean().backward()  # the gradient flows to the policy, never to the cached reference
    assert ref.grad_fn is None and not ref.requires_grad
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()


def test_sequence_logp_is_the_masked_sum_over_response_tokens(pair_batch):
    model, tok, p, c, _ = pair_batch
    ids, attn, resp = data.pad_batch(p, c, tok.pad_token_id)
    with torch.no_grad():
        s, lengths = sequence_logps(model, ids, attn, resp, temperature=0.6)
        for i in range(len(p)):  # each sequence alone, unpadded, summed by hand over its response tokens
            seq = torch.tensor([p[i] + c[i]])
            logits = model(input_ids=seq).logits[0, :-1].float() / 0.6
            logp = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None]).squeeze(-1)
            expected = logp[len(p[i]) - 1 :].sum()  # positions predicting the response tokens (EOS included)
            assert s[i].item() == pytest.approx(expected.item(), abs=1e-4)
            assert lengths[i].item() == len(c[i])


def test_concatenated_chosen_rejected_equals_separate_forwards_and_pad_is_eos(pair_batch):
    """[chosen; rejected] padded together gives the same s_theta as separate forwards, also
    when pad == eos."""
    model, tok, p, c, r_ = pair_batch
    with torch.no_grad():
        both, _ = sequence_logps(model, *data.pad_batch(p + p, c + r_, tok.pad_token_id))
        sep_c, _ = sequence_logps(model, *data.pad_batch(p, c, tok.pad_token_id))
        sep_r, _ = sequence_logps(model, *data.pad_batch(p, r_, tok.pad_token_id))
        eos_pad, _ = sequence_logps(model, *data.pad_batch(p + p, c + r_, tok.eos_token_id))
    torch.testing.assert_close(both, torch.cat([sep_c, sep_r]), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(eos_pad, both, atol=1e-4, rtol=1e-5)


def test_self_generated_pairs_follow_vineppo():
    rng = random.Random(0)
    # threshold 0.5: 0.5 counts as correct, 0.49 does not
    samples = [([1], 1.0), ([2], 0.5), ([3], 0.49), ([4], 0.0), ([5], 0.0)]
    pairs = make_pairs(samples, 0.5, 64, rng)
    assert sorted(pairs) == sorted([(c, w) for c in ([1], [2]) for w in ([3], [4], [5])])
    assert make_pairs([([1], 1.0), ([2], 1.0)], 0.5, 64, rng) == []  # no incorrect sample: skipped
    assert make_pairs([([1], 0.0), ([2], 0.0)], 0.5, 64, rng) == []  # no correct sample: skipped
    many = [([i], 1.0) for i in range(10)] + [([100 + i], 0.0) for i in range(10)]  # 100 possible pairs
    sub = make_pairs(many, 0.5, 64, rng)
    assert len(sub) == 64 and len(set(map(lambda x: (x[0][0], x[1][0]), sub))) == 64  # without replacement


def test_validate_rejects_label_smoothing_where_it_does_nothing():
    with pytest.raises(ValueError, match="label_smoothing"):
        validate(Args(loss_type="sigmoid", label_smoothing=0.1))
    with pytest.raises(ValueError, match="^loss_type: 'kto' is not one of sigmoid, cdpo, robust, hinge, ipo, dpop, simpo, orpo$"):
        check_args(Args(loss_type="kto"))
    validate(Args(loss_type="cdpo", label_smoothing=0.1))
