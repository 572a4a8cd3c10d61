"""Unit tests of grpo.py's pure functions: advantages, KL estimators, clipping, loss aggregation (length bias,
split invariance), TIS, masks, the REINFORCE gradient and config validation."""

import math
import sys

import pytest
import torch

from algorithms.grpo import (Args, aggregate_loss, cispo_surrogate, clipped_surrogate, completion_mask,
                             compute_advantages, dppo_surrogate, kl_penalty,
                             log_importance_ratio, tis_weights, validate)
from shared.logprobs import forward_logprobs


# ---------------------------------------------------------------- advantages (all-equal groups get 0, not NaN)
def test_group_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected, as TRL's nanstd
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-4)
    torch.testing.assert_close(compute_advantages(r, "group"), expected)
    torch.testing.assert_close(compute_advantages(r, "none"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))


def test_batch_scaling_uses_batch_std():
    r = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    out = compute_advantages(r, "batch")
    torch.testing.assert_close(out, (r - r.mean(1, keepdim=True)) / (r.std() + 1e-4))


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_all_equal_groups_give_zero_finite_advantages(scaling):
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    out = compute_advantages(r, scaling)
    assert torch.isfinite(out).all() and (out == 0).all()


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_centered_advantages_sum_to_zero_per_group(scaling):
    r = torch.rand(5, 8)
    assert compute_advantages(r, scaling).sum(1).abs().max() < 1e-5


# ---------------------------------------------------------------- RLOO, REINFORCE++-baseline
def test_rloo_leave_one_out_baseline_hand_computed():
    # group [1, 0, 0, 1]: sum 2, baseline_i = (2 - r_i) / 3 = 1/3, 2/3, 2/3, 1/3 -> A = 2/3, -2/3, -2/3, 2/3
    # group [3, 1, 0, 0]: sum 4, baseline_i = (4 - r_i) / 3 = 1/3, 1, 4/3, 4/3 -> A = 8/3, 0, -4/3, -4/3
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 0.0, 0.0]])
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [8 / 3, 0.0, -4 / 3, -4 / 3]])
    torch.testing.assert_close(compute_advantages(r, "group", estimator="rloo"), expected)
    # the baseline is the mean of the *others*, not the group mean (which gives 0.5, -0.5, ... and 2, 0, -1, -1)
    assert not torch.allclose(compute_advantages(r, "group", estimator="rloo"), compute_advantages(r, "none"))
    # equivalently G/(G-1) times the centred reward
    torch.testing.assert_close(compute_advantages(r, "group", estimator="rloo"), 4 / 3 * compute_advantages(r, "none"))


def test_reinforce_pp_baseline_token_weighted_whitening_hand_computed():
    # rewards [[1, 0], [1, 1]], completions of 1, 3, 2 and 2 trained tokens (8 in all)
    # centred c = [[0.5, -0.5], [0, 0]]; token mean mu = (0.5*1 - 0.5*3 + 0*2 + 0*2) / 8 = -0.125
    # var = (0.625^2*1 + 0.375^2*3 + 0.125^2*2 + 0.125^2*2) / 8 = 0.875 / 8 = 0.109375, sigma = 0.330719
    # A = (c - mu) / sigma = [[0.625, -0.375], [0.125, 0.125]] / 0.330719
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    counts = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    out = compute_advantages(r, "group", estimator="reinforce_pp_baseline", token_counts=counts)
    torch.testing.assert_close(out, torch.tensor([[1.889822, -1.133893], [0.377964, 0.377964]]))
    # the all-equal group gets -mu/sigma = 0.378, not 0 (the global mean is subtracted, as in OpenRLHF)
    # unweighted (one count per completion): c = [0.5, -0.5, 0, 0], mu = 0, sigma = sqrt(0.5 / 4) = 0.353553
    out = compute_advantages(r, "group", estimator="reinforce_pp_baseline")
    torch.testing.assert_close(out, torch.tensor([[1.414214, -1.414214], [0.0, 0.0]]))


def test_new_estimators_are_finite_on_all_equal_batches():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert (compute_advantages(r, "group", estimator="rloo") == 0).all()
    out = compute_advantages(r, "group", estimator="reinforce_pp_baseline", token_counts=torch.zeros(2, 3))
    assert (out == 0).all()  # sigma clamped at eps, total tokens at 1: no NaN even with every token masked
    assert compute_advantages(torch.rand(5, 8), "group", estimator="rloo").sum(1).abs().max() < 1e-5


def test_default_estimator_is_unchanged_grpo():
    r = torch.rand(4, 8)
    for scaling in ("group", "batch", "none"):
        assert torch.equal(compute_advantages(r, scaling), compute_advantages(r, scaling, estimator="grpo"))


# ---------------------------------------------------------------- KL estimators (k3's gradient is not the KL's)
def test_kl_estimators_formulas():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    # k1 summed over a sequence is the sequence log-ratio s_theta - s_ref
    assert torch.isclose(kl_penalty(logp, ref, "k1").sum(), logp.sum() - ref.sum())
    assert (kl_penalty(logp, logp, "k3") == 0).all()  # zero at initialisation (policy == reference)


def test_k2_gradient_is_kl_gradient_but_k3_is_not():
    """Exact expectation over a categorical: E_pi[grad k2] == grad KL(pi||ref), E_pi[grad k3] != (k3 in a loss is
    biased)."""
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), 0)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, 0)
        loss = (logp.exp().detach() * kl_penalty(logp, ref, estimator)).sum()  # samples fixed, as in a loss term
        return torch.autograd.grad(loss, theta)[0]

    logp = torch.log_softmax(theta, 0)
    true = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)[0]
    torch.testing.assert_close(expected_grad("k2"), true)
    assert (expected_grad("k3") - true).abs().max() > 1e-2


# ---------------------------------------------------------------- clipping
def test_clip_higher_bounds_apply_on_the_correct_side():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped, ratio = clipped_surrogate(logp, logp_old, adv, eps_low=0.2, eps_high=0.28)
    # A>0, rho=1.5 > 1.28: clipped at 1.28; A<0, rho=1.5: the unclipped term is the min, not clipped
    # A>0, rho=0.5: unclipped (pessimistic); A<0, rho=0.5 < 0.8: clipped at 0.8
    torch.testing.assert_close(loss, torch.tensor([-1.28, 1.5, -0.5, 0.8]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(ratio, torch.tensor([1.5, 1.5, 0.5, 0.5]))


# ---------------------------------------------------------------- GSPO: sequence-level ratio (arXiv 2507.18071)
def _gspo_batch():
    """Two completions, old log-probs 0: completion 0 has 3 tokens with log ratios 0.3, -0.1, 0.1; completion 1 has
    one token with log ratio 0.6 and two padding positions (extreme values there must not leak in)."""
    logp = torch.tensor([[0.3, -0.1, 0.1], [0.6, 50.0, -50.0]], requires_grad=True)
    return logp, torch.zeros(2, 3), torch.tensor([[1.0, 1, 1], [1, 0, 0]])


def test_gspo_sequence_ratio_hand_computed():
    # s_0 = exp((0.3 - 0.1 + 0.1) / 3) = exp(0.1) = 1.105171 on all three tokens; s_1 = exp(0.6 / 1) = 1.822119 on its
    # token, padding keeps log ratio 0 (ratio 1)
    logp, old, mask = _gspo_batch()
    torch.testing.assert_close(log_importance_ratio(logp, old, mask, "sequence"),
                               torch.tensor([[0.1, 0.1, 0.1], [0.6, 0.0, 0.0]]))
    torch.testing.assert_close(log_importance_ratio(logp, old, mask, "token"), (logp * mask).detach())
    # A = +1 for both, eps 0.2 / 0.28: s_0 = 1.105 is inside [0.8, 1.28] -> loss -1.105171 per token, not clipped;
    # s_1 = 1.822 > 1.28 with A > 0 -> loss -1.28 (clipped, no gradient)
    adv = torch.ones(2, 3)
    loss, clipped, ratio = clipped_surrogate(logp, old, adv, 0.2, 0.28, mask, "sequence")
    e01 = math.exp(0.1)
    torch.testing.assert_close((loss * mask).detach(), torch.tensor([[-e01, -e01, -e01], [-1.28, 0, 0]]))
    torch.testing.assert_close(clipped * mask, torch.tensor([[0.0, 0, 0], [1, 0, 0]]))
    torch.testing.assert_close(ratio[1, 0].item(), math.exp(0.6))
    # gradient of the masked sum: every token k of completion 0 gets sum_t d(-s_0)/d logp_k = 3 * (-s_0 / 3) = -s_0
    # (the ratio's gradient is s_0 * (1/|y|) for each token); the clipped completion 1 gets none
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-e01, -e01, -e01], [0.0, 0, 0]]))


def test_gspo_clips_the_whole_sequence_where_token_level_clips_one_token():
    # log ratios 0.5, -0.4, 0.0 (A = +1): token level clips token 0 only (e^0.5 = 1.65 > 1.28);
    # sequence level: s = exp(0.1 / 3) = 1.034, no token clipped
    logp, old, adv = torch.tensor([[0.5, -0.4, 0.0]]), torch.zeros(1, 3), torch.ones(1, 3)
    assert clipped_surrogate(logp, old, adv, 0.2, 0.28, None, "token")[1].tolist() == [[1.0, 0.0, 0.0]]
    assert clipped_surrogate(logp, old, adv, 0.2, 0.28, None, "sequence")[1].tolist() == [[0.0, 0.0, 0.0]]
    # GSPO's own range 3e-4 / 4e-4: s = 1.034 > 1.0004 -> all three tokens clipped together
    assert clipped_surrogate(logp, old, adv, 3e-4, 4e-4, None, "sequence")[1].tolist() == [[1.0, 1.0, 1.0]]


@pytest.mark.parametrize("mode", ["seq_mean", "global_token"])
def test_gspo_token_variant_equals_gspo_with_sequence_advantages(mode):
    """GSPO-token (§4.3): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], written out here. With one advantage per completion
    it has GSPO's value and gradient, which is why grpo.py has no separate flag for it."""
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    old = torch.randn(3, 4)
    logp = (old + 0.3 * torch.randn(3, 4)).requires_grad_()
    adv = torch.tensor([[1.5], [-0.7], [0.4]]).expand(3, 4)
    eps_low, eps_high = 0.05, 0.05  # narrow, so that some completions clip

    loss = clipped_surrogate(logp, old, adv, eps_low, eps_high, mask, "sequence")[0]
    gspo = aggregate_loss(loss, mask, mode, 3, int(mask.sum()), int(mask.sum()), 1, 4)
    g_gspo = torch.autograd.grad(gspo, logp)[0]

    log_s = ((logp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
    s_tok = torch.exp(log_s).detach() * torch.exp(logp - logp.detach())
    token_loss = -torch.minimum(s_tok * adv, torch.clamp(s_tok, 1 - eps_low, 1 + eps_high) * adv)
    gspo_token = aggregate_loss(token_loss, mask, mode, 3, int(mask.sum()), int(mask.sum()), 1, 4)
    g_token = torch.autograd.grad(gspo_token, logp)[0]
    assert (torch.exp(log_s) > 1 + eps_high).any() or (torch.exp(log_s) < 1 - eps_low).any()  # some clipping
    torch.testing.assert_close(gspo, gspo_token)
    torch.testing.assert_close(g_gspo * mask, g_token * mask)


def test_gspo_on_policy_gradient_is_the_token_level_one():
    """Ratio 1 (logp_old = logp): sequence and token level both give -A grad log pi per token (with any aggregation
    that weights a completion's tokens equally)."""
    torch.manual_seed(1)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    logp = torch.randn(2, 3, requires_grad=True)
    adv = torch.tensor([[0.8], [-1.1]]).expand(2, 3)
    grads = []
    for level in ("token", "sequence"):
        loss = clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.28, mask, level)[0]
        grads.append(torch.autograd.grad(aggregate_loss(loss, mask, "global_token", 2, 5, 5, 1, 3), logp)[0])
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], -adv * mask / 5)


# ---------------------------------------------------------------- CISPO (MiniMax-M1, arXiv 2506.13585)
def test_cispo_hand_computed_and_every_token_keeps_its_gradient():
    # ratios 1.5, 0.5, 1.1 (logp_old = 0, so logp = log ratio = 0.405465, -0.693147, 0.095310), A = +1, +1, -1,
    # eps_high 0.28, no lower bound: weights sg(min(r, 1.28)) = 1.28, 0.5, 1.1; loss = -w A logp:
    #   -1.28 * 1 * 0.405465 = -0.518995;  -0.5 * 1 * -0.693147 = 0.346574;  -1.1 * -1 * 0.095310 = 0.104841
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, clipped, ratio = cispo_surrogate(logp, torch.zeros(3), adv, 0.28)
    torch.testing.assert_close(loss.detach(), torch.tensor([-0.518995, 0.346574, 0.104841]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0]))  # truncated above 1.28 only
    torch.testing.assert_close(ratio.detach(), torch.tensor([1.5, 0.5, 1.1]))
    # d loss / d logp = -w A exactly: the weight carries no gradient (else d/dlogp would add -A logp dw/dlogp), and
    # token 0, truncated, still gets -1.28 where PPO-clip gives 0
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.28, -0.5, 1.1]))
    g_clip = torch.autograd.grad(clipped_surrogate(logp, torch.zeros(3), adv, 0.2, 0.28)[0].sum(), logp)[0]
    assert g_clip[0] == 0 and g_clip[1] != 0  # PPO-clip: token 0 clipped (no gradient); token 1 pessimistic, kept


def test_cispo_has_no_lower_bound_and_padding_is_finite():
    logp = torch.tensor([[math.log(0.01), -300.0]], requires_grad=True)  # ratio 0.01, then a padding position
    loss, clipped, _ = cispo_surrogate(logp, torch.zeros(1, 2), torch.ones(1, 2), 0.28, torch.tensor([[1.0, 0]]))
    # weight = min(0.01, 1.28) = 0.01 (MiniMax-M1: no lower bound); loss = -0.01 * log(0.01) = 0.0460517
    torch.testing.assert_close(loss[0, 0].item(), -0.01 * math.log(0.01))
    assert clipped[0, 0] == 0 and loss[0, 1] == 0


def test_cispo_on_policy_gradient_is_reinforce():
    torch.manual_seed(2)
    logp = torch.randn(2, 3, requires_grad=True)
    adv = torch.tensor([[0.8], [-1.1]]).expand(2, 3)
    loss = cispo_surrogate(logp, logp.detach(), adv, 0.28)[0]
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), logp)[0], -adv)


# ---------------------------------------------------------------- aggregation (length bias, split invariance)
def _grad(mode, splits, lengths, world_size):
    """Gradient of the step loss when the batch is cut into `splits` (list of ranks, each a list of micro-batches)."""
    torch.manual_seed(0)
    T = max(lengths)
    x = torch.randn(len(lengths), T, 3)
    mask = torch.zeros(len(lengths), T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    total_tokens = int(mask.sum())
    rank_grads = []
    for rank in splits:
        rank_idx = [i for micro in rank for i in micro]
        tokens = int(mask[rank_idx].sum())
        g = torch.zeros(3)
        for micro in rank:
            per_token = (x[micro] * theta).sum(-1) ** 2
            loss = aggregate_loss(per_token, mask[micro], mode, len(rank_idx), tokens, total_tokens, world_size, T)
            g += torch.autograd.grad(loss, theta)[0]
        rank_grads.append(g)
    return torch.stack(rank_grads).mean(0)  # DeepSpeed averages gradients over ranks


@pytest.mark.parametrize("mode", ["seq_mean", "token_mean", "global_token", "constant"])
def test_aggregation_invariant_to_gradient_accumulation(mode):
    lengths = [1, 5, 3, 8, 2, 7, 4, 6]
    one_big = _grad(mode, [[list(range(8))]], lengths, 1)  # bs 8 x GA 1
    many_small = _grad(mode, [[[i] for i in range(8)]], lengths, 1)  # bs 1 x GA 8
    torch.testing.assert_close(one_big, many_small)


@pytest.mark.parametrize("mode", ["seq_mean", "global_token", "constant"])
def test_aggregation_invariant_to_data_parallel_split(mode):
    lengths = [1, 5, 3, 8, 2, 7, 4, 6]
    single = _grad(mode, [[list(range(8))]], lengths, 1)
    two_ranks = _grad(mode, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], lengths, 2)  # 2 ranks x 4 (GA 2)
    torch.testing.assert_close(single, two_ranks)


def test_length_bias_per_token_weights():
    """Per-token gradient weight: 1/(B|o_i|) under seq_mean (length bias), independent of |o_i| otherwise."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    for mode, expected in [("seq_mean", [[0.5, 0, 0, 0], [0.125] * 4]),
                           ("global_token", [[0.2, 0, 0, 0], [0.2] * 4]),
                           ("constant", [[0.125, 0, 0, 0], [0.125] * 4])]:
        per_token = torch.ones(2, 4, requires_grad=True)
        loss = aggregate_loss(per_token, mask, mode, 2, 5, 5, 1, 4)
        torch.testing.assert_close(torch.autograd.grad(loss, per_token)[0], torch.tensor(expected))


# ---------------------------------------------------------------- TIS (sampler / trainer mismatch)
def test_tis_modes_on_hand_made_ratios():
    # per-token ratios rho = pi_old / pi_sampler: row 0 = 1, 3, 0.25 (3 tokens); row 1 = 1.5, 1.2 and a padding token
    logp_old = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.2, 7.0]]))
    sampler = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    w = lambda mode, cap=2.0: tis_weights(logp_old, sampler, mask, mode, cap) * mask  # noqa: E731 (padding aside)
    torch.testing.assert_close(w("token_truncate"), torch.tensor([[1.0, 2.0, 0.25], [1.5, 1.2, 0]]))
    # masks keep [1/C, C] = [0.5, 2]
    torch.testing.assert_close(w("token_mask"), torch.tensor([[1.0, 0.0, 0.0], [1.5, 1.2, 0]]))
    # one weight per completion, the product of its tokens' ratios (TRL, verl): row 0: 1 * 3 * 0.25 = 0.75;
    # row 1: 1.5 * 1.2 = 1.8 (the padding token's 7 does not count)
    torch.testing.assert_close(w("sequence_truncate"), torch.tensor([[0.75, 0.75, 0.75], [1.8, 1.8, 0]]))
    torch.testing.assert_close(w("sequence_truncate", 1.5), torch.tensor([[0.75, 0.75, 0.75], [1.5, 1.5, 0]]))
    torch.testing.assert_close(w("sequence_mask"), torch.tensor([[0.75, 0.75, 0.75], [1.8, 1.8, 0]]))
    # cap 1.5: row 1's 1.8 is outside [2/3, 1.5]: masked; row 0's 0.75 inside, kept
    torch.testing.assert_close(w("sequence_mask", 1.5), torch.tensor([[0.75, 0.75, 0.75], [0.0, 0, 0]]))
    # no token of a masked or truncated sequence keeps a weight of its own: one token with ratio 50 in a 20-token
    # completion of ratio 1 elsewhere gets the sequence's weight min(50, 2) = 2, not 50
    one_off = torch.zeros(1, 20)
    one_off[0, 7] = math.log(50.0)
    torch.testing.assert_close(tis_weights(one_off, torch.zeros(1, 20), torch.ones(1, 20), "sequence_truncate", 2.0),
                               torch.full((1, 20), 2.0))
    assert (tis_weights(one_off, torch.zeros(1, 20), torch.ones(1, 20), "sequence_mask", 2.0) == 0).all()
    assert (tis_weights(logp_old, sampler, mask, "none", 2.0) == 1).all()
    # cap = inf: the uncorrected weights at the mode's level (what the logged correction fraction compares with)
    torch.testing.assert_close(w("token_mask", math.inf), torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.2, 0]]))
    torch.testing.assert_close(w("sequence_mask", math.inf), torch.tensor([[0.75, 0.75, 0.75], [1.8, 1.8, 0]]))


def test_geometric_mask_and_a_lower_bound_of_the_masks():
    # the ratios of test_tis_modes_on_hand_made_ratios: row 0 = 1, 3, 0.25; row 1 = 1.5, 1.2 and a padding token
    logp_old = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.2, 7.0]]))
    sampler, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    w = lambda mode, cap, low=0.0: tis_weights(logp_old, sampler, mask, mode, cap, low) * mask  # noqa: E731
    # geometric means: row 0 (1 * 3 * 0.25)^(1/3) = 0.9086, row 1 (1.5 * 1.2)^(1/2) = 1.3416; kept: weight 1
    torch.testing.assert_close(w("geometric_mask", 2.0), mask)
    # C = 1.2, lo = 1/1.2 = 0.833: row 0 kept, row 1 rejected whole (no token keeps a weight of its own)
    torch.testing.assert_close(w("geometric_mask", 1.2), torch.tensor([[1.0, 1, 1], [0, 0, 0]]))
    # lo = 0.95 above row 0's 0.9086: rejected too
    torch.testing.assert_close(w("geometric_mask", 1.5, 0.95), torch.tensor([[0.0, 0, 0], [1, 1, 0]]))
    # IcePop's token mask on [0.5, 5]: 3 is kept now, 0.25 still dropped
    torch.testing.assert_close(w("token_mask", 5.0, 0.5), torch.tensor([[1.0, 3.0, 0.0], [1.5, 1.2, 0]]))
    # a sequence mask on [0.8, 2]: row 0's product 0.75 is below 0.8
    torch.testing.assert_close(w("sequence_mask", 2.0, 0.8), torch.tensor([[0.0, 0, 0], [1.8, 1.8, 0]]))
    # cap = inf, low = 0: the weights before the mask (what the logged correction fractions compare with)
    torch.testing.assert_close(w("geometric_mask", math.inf), mask)


def test_sequence_weights_do_not_overflow():
    """log rho_seq is clamped to [-20, 20] before the exp: a 1,000-token completion 0.1 nat off per token is masked
    (or truncated to C), never inf or NaN."""
    old = torch.full((1, 1000), 0.1)
    for mode, expected in (("sequence_mask", 0.0), ("sequence_truncate", 2.0)):
        w = tis_weights(old, torch.zeros(1, 1000), torch.ones(1, 1000), mode, 2.0)
        assert torch.isfinite(w).all() and (w == expected).all()


def test_tis_weight_carries_no_gradient():
    logp_old = torch.randn(2, 3, requires_grad=True)
    w = tis_weights(logp_old, torch.zeros(2, 3), torch.ones(2, 3), "token_truncate", 2.0)
    assert not w.requires_grad


# ---------------------------------------------------------------- MaxRL
def test_maxrl_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # (r - mean) / mean: mean 0.5 -> +-1; no success -> 0; one success in 4 -> 0.75 / 0.25 = 3 and -1; all -> 0
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0, 0, 0], [3.0, -1, -1, -1], [0.0, 0, 0, 0]])
    torch.testing.assert_close(compute_advantages(r, "group", estimator="maxrl"), expected)
    # its definition: 1/p times GRPO's unscaled advantage (Dr. GRPO's r - mean), p the group's success rate
    torch.testing.assert_close(compute_advantages(r[[0, 2]], "group", estimator="maxrl"),
                               compute_advantages(r[[0, 2]], "none") / r[[0, 2]].mean(1, keepdim=True))


def test_maxrl_refuses_rewards_other_than_0_and_1():
    with pytest.raises(ValueError, match=r"^advantage_estimator maxrl: needs rewards 0 or 1, got 0\.5$"):
        compute_advantages(torch.tensor([[1.0, 0.5]]), "group", estimator="maxrl")


# ---------------------------------------------------------------- DPPO
def _dppo_case():
    """Tokens with p_old, p and the advantage: (a) up 0.1 with A > 0, (b) up 0.4 with A > 0, (c) up 0.4 with A < 0,
    (d) down 0.3 with A < 0, (e) down 0.15 with A < 0, (f) 0.01 -> 0.28 with A > 0, (g) 0.9 -> 0.99 with A > 0."""
    p_old = torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.01, 0.9]])
    p = torch.tensor([[0.6, 0.9, 0.9, 0.2, 0.35, 0.28, 0.99]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0]])
    return torch.log(p).requires_grad_(), torch.log(p_old), adv, p / p_old


def test_dppo_tv_masks_a_probability_moved_past_epsilon_in_the_advantages_direction():
    logp, logp_old, adv, ratio = _dppo_case()
    loss, masked, _ = dppo_surrogate(logp, logp_old, logp_old, adv, 0.2, 0.28, "tv")  # sampler == pi_old
    # |p - p_old|: (a) 0.1 kept, (b) 0.4 > 0.28 masked, (c) moved up with A < 0: kept, (d) 0.3 > 0.2 masked,
    # (e) 0.15 kept, (f) 0.27 kept, (g) 0.09 kept
    torch.testing.assert_close(masked, torch.tensor([[0.0, 1, 0, 1, 0, 0, 0]]))
    keep = 1 - masked
    torch.testing.assert_close(loss, -ratio * adv * keep)
    # kept tokens: the unclipped gradient -A rho (d rho / d log p = rho); masked: none
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, -adv * ratio * keep)


def test_dppo_kl_masks_by_the_binary_kl_of_the_sampled_token():
    logp, logp_old, adv, _ = _dppo_case()
    bkl = lambda q, p: q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # noqa: E731
    # (a) 0.0204, (b) 0.5108 > 0.28, (c) moved up with A < 0, (d) 0.2231 > 0.2, (e) 0.0472, (f) 0.2819 > 0.28: masked
    # though TV (0.27) keeps it, (g) 0.1445: kept though it is the largest ratio change at high probability
    assert [round(bkl(q, p), 4) for q, p in ((0.5, 0.6), (0.5, 0.9), (0.5, 0.2), (0.5, 0.35), (0.01, 0.28),
                                             (0.9, 0.99))] == [0.0204, 0.5108, 0.2231, 0.0472, 0.2819, 0.1445]
    _, masked, _ = dppo_surrogate(logp, logp_old, logp_old, adv, 0.2, 0.28, "kl")
    torch.testing.assert_close(masked, torch.tensor([[0.0, 1, 0, 1, 0, 1, 0]]))


@pytest.mark.parametrize("div", ["tv", "kl"])
def test_dppo_trust_region_is_measured_from_the_sampler_not_the_trainers_old_policy(div):
    """The paper (Sec. 5.2), verl's recipe, prime-rl and TRL anchor the trust region at the behaviour policy: on a
    batch generated one update before (grpo_async.py) the trainer's pi_old equals pi on the first pass (ratio 1),
    yet a token whose probability is 0.4 above the sampler's is outside the region and masked; the same token with
    the sampler at pi_old would be kept."""
    logp, logp_old, adv, _ = _dppo_case()
    logp_now = logp.detach().clone().requires_grad_()  # pi_old = pi: the first pass over the batch
    _, masked, ratio = dppo_surrogate(logp_now, logp_now.detach(), logp_old, adv, 0.2, 0.28, div)
    assert torch.all(ratio == 1) and masked[0, 1] == 1 and masked[0, 3] == 1  # (b) and (d) of _dppo_case
    _, kept, _ = dppo_surrogate(logp_now, logp_now.detach(), logp_now.detach(), adv, 0.2, 0.28, div)
    assert kept.sum() == 0


def test_dppo_on_policy_gradient_is_reinforce():
    """rho = 1 on the first pass: nothing masked, the gradient is -A grad log pi, as clip's."""
    logp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    adv = torch.tensor([[0.5, -2.0]])
    for div in ("tv", "kl"):
        loss, masked, _ = dppo_surrogate(logp, logp.detach(), logp.detach(), adv, 0.2, 0.28, div)
        assert masked.sum() == 0
        torch.testing.assert_close(torch.autograd.grad(loss.sum(), logp)[0], -adv)


# ---------------------------------------------------------------- entropy (logged, and the --entropy_coef bonus)
def test_token_entropy_is_hand_computed_and_differentiable():
    from shared.logprobs import token_logprobs

    head = torch.nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3))
    hidden = torch.log(torch.tensor([[1.0, 1.0, 2.0]])).requires_grad_()  # probs 0.25, 0.25, 0.5
    _, entropy = token_logprobs(head, hidden, torch.tensor([2]), 1.0, True)
    torch.testing.assert_close(entropy, torch.tensor([-(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))]))
    (grad,) = torch.autograd.grad(entropy.sum(), hidden)
    # dH/dz_i = -p_i (log p_i + H): the bonus raises the logits of the less likely tokens
    h = entropy.item()
    expected = torch.tensor([[-0.25 * (math.log(0.25) + h), -0.25 * (math.log(0.25) + h), -0.5 * (math.log(0.5) + h)]])
    torch.testing.assert_close(grad, expected)


# ---------------------------------------------------------------- masks
def test_completion_mask_drops_truncated_rows_only_when_asked():
    resp = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    finished = torch.tensor([True, False])
    torch.testing.assert_close(completion_mask(resp, finished, False), resp[:, 1:].float())
    torch.testing.assert_close(completion_mask(resp, finished, True), torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0.0]]))


# ---------------------------------------------------------------- REINFORCE gradient
def test_on_policy_loss_gradient_is_reinforce(tiny_model):
    """mu=1, beta=0: loss is -mean A (not informative), gradient is -(1/N) sum A grad log pi."""
    model, tok = tiny_model
    ids = torch.tensor([[1, 20, 21, 22, 23, 24], [1, 25, 26, 27, 28, 29]])
    attn = torch.ones_like(ids)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1.0]])
    resp = torch.nn.functional.pad(mask, (1, 0))  # [B, L]: 1 on the response tokens that mask's positions predict
    adv = torch.tensor([[0.7], [-1.3]]).expand(2, 5)
    logp, _ = forward_logprobs(model, ids, attn, resp, temperature=0.8)
    pg, _, ratio = clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.28)
    loss = aggregate_loss(pg, mask, "global_token", 2, 5, 5, 1, 5)
    assert torch.allclose(ratio, torch.ones_like(ratio))
    assert torch.isclose(loss, -(adv * mask).sum() / 5)
    params = [p for p in model.parameters() if p.requires_grad]
    g_loss = torch.autograd.grad(loss, params)
    logp2, _ = forward_logprobs(model, ids, attn, resp, temperature=0.8)
    g_pg = torch.autograd.grad(-(adv * mask * logp2).sum() / 5, params)
    for a, b in zip(g_loss, g_pg):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- config validation (e.g. one generation per prompt)
@pytest.mark.parametrize("change, flag", [({"num_generations": 1}, "num_generations"),
                                          ({"advantage_scaling": "std"}, "advantage_scaling"),
                                          ({"loss_aggregation": "sum"}, "loss_aggregation"),
                                          ({"kl_estimator": "k4"}, "kl_estimator"),
                                          ({"importance_level": "seq"}, "importance_level"),
                                          ({"policy_loss": "ppo"}, "policy_loss"),
                                          ({"advantage_estimator": "reinforce"}, "advantage_estimator"),
                                          ({"epsilon_low": 1.5}, "epsilon_low"),
                                          ({"advantage_estimator": "rloo", "advantage_scaling": "batch"},
                                           "advantage_scaling"),
                                          ({"tis": "yes"}, "tis"), ({"generator": "sglang"}, "generator"),
                                          ({"advantage_estimator": "maxrl", "reward_model_path": "builtin:tiny-rm"},
                                           "advantage_estimator"),
                                          ({"policy_loss": "dppo_tv", "importance_level": "sequence"},
                                           "importance_level"),
                                          ({"top_p": 0.9}, "top_p"), ({"tis_mask_low": 2.0}, "tis_mask_low"),
                                          ({"entropy_coef": -0.1}, "entropy_coef")])
def test_invalid_config_is_rejected_naming_the_flag(change, flag):
    from shared.cli import check_args

    args = Args(**change)
    with pytest.raises(ValueError, match=f"^{flag}: "):
        check_args(args)  # the start-up checks in run_cli's order: fixed choices and ranges, then the script's own
        validate(args)


def test_variant_flags_parse():
    from shared.cli import parse_cli

    args = parse_cli(Args, ["--importance_level", "sequence", "--policy_loss", "cispo", "--advantage_estimator",
                            "reinforce_pp_baseline", "--epsilon_low", "1"])
    assert (args.importance_level, args.policy_loss, args.advantage_estimator) == ("sequence", "cispo",
                                                                                 "reinforce_pp_baseline")
    assert args.epsilon_low == 1.0
    default = Args()  # the defaults are the plain GRPO run
    assert (default.importance_level, default.policy_loss, default.advantage_estimator) == ("token", "clip", "grpo")


@pytest.mark.parametrize("argv, message", [
    (["--advantage_estimator", "rloo", "--advantage_scaling", "none"],
     "error: advantage_scaling: applies to --advantage_estimator grpo only (rloo has its own normalisation)\n"),
    (["--epsilon_low", "1.5"], "error: epsilon_low: must be in [0, 1], got 1.5\n"),
    (["--importance_level", "seq"], "error: --importance_level: 'seq' is not one of token, sequence\n"),
    (["--policy_loss", "ppo"], "error: --policy_loss: 'ppo' is not one of clip, cispo, dppo_tv, dppo_kl, sapo\n"),
    (["--advantage_estimator", "reinforce"],
     "error: --advantage_estimator: 'reinforce' is not one of grpo, rloo, reinforce_pp_baseline, maxrl\n"),
    (["--mask_truncated_completions", "yes"], "error: unexpected argument 'yes'; see --help\n"),  # a switch: no value
])
def test_bad_variant_flags_exit_2_before_anything_is_written(argv, message, tmp_path, monkeypatch, capsys):
    """Through the real entry point (run_cli(grpo.main)): one line naming the flag, exit status 2, no output_dir."""
    from algorithms import grpo
    from shared.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv, "--output_dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as e:
        run_cli(grpo.main, grpo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_entropy_bonus_is_not_a_hidden_default():
    assert Args().entropy_coef == 0.0  # an opt-in flag, off by default (GRPO has no entropy term)


def test_clipped_surrogate_and_kl_masked_before_exp():
    """Padding with extreme log-probs must not turn the masked loss into NaN (skipped steps)."""
    from algorithms.grpo import kl_penalty

    logp = torch.tensor([[-1.0, 150.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -150.0]])
    adv = torch.tensor([[0.5, -0.5]])
    mask = torch.tensor([[1.0, 0.0]])
    assert not torch.isfinite((clipped_surrogate(logp, old, adv, 0.2, 0.28)[0] * mask).sum())
    loss, _, ratio = clipped_surrogate(logp, old, adv, 0.2, 0.28, mask)
    (loss * mask).sum().backward()
    assert torch.isfinite(logp.grad).all() and ratio[0, 1] == 1.0
    assert loss[0, 0].item() == pytest.approx(-0.5 * math.exp(0.2))  # inside the clip range [0.8, 1.28]
    assert torch.isfinite(kl_penalty(-logp.detach() * 5, old, "k3", mask) * mask).all()
