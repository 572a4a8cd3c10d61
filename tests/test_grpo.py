"""Unit tests of grpo.py's pure functions (grpo.md "Tests this implementation should have"; pitfalls P1-P3, P7, P9,
P10, P15, P16)."""

import math

import pytest
import torch

from algorithms.grpo import (Args, aggregate_loss, clipped_surrogate, completion_mask, compute_advantages,
                             forward_logprobs, kl_penalty, tis_weights, validate)


# ---------------------------------------------------------------- advantages (grpo.md §1, P2)
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


# ---------------------------------------------------------------- KL estimators (building_blocks §5, P7)
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
    """Exact expectation over a categorical: E_pi[grad k2] == grad KL(pi||ref), E_pi[grad k3] != (pitfalls P7)."""
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


# ---------------------------------------------------------------- clipping (P10)
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


# ---------------------------------------------------------------- aggregation (P1, P3)
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
    """Per-token gradient weight: 1/(B|o_i|) under seq_mean (length bias), independent of |o_i| otherwise (P1)."""
    mask = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1]])
    for mode, expected in [("seq_mean", [[0.5, 0, 0, 0], [0.125] * 4]),
                           ("global_token", [[0.2, 0, 0, 0], [0.2] * 4]),
                           ("constant", [[0.125, 0, 0, 0], [0.125] * 4])]:
        per_token = torch.ones(2, 4, requires_grad=True)
        loss = aggregate_loss(per_token, mask, mode, 2, 5, 5, 1, 4)
        torch.testing.assert_close(torch.autograd.grad(loss, per_token)[0], torch.tensor(expected))


# ---------------------------------------------------------------- TIS (P9)
def test_tis_modes_on_hand_made_ratios():
    logp_old = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.0, 1.0, 1.0]]))
    sampler = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    torch.testing.assert_close(tis_weights(logp_old, sampler, mask, "token_truncate", 2.0),
                               torch.tensor([[1.0, 2.0, 0.25], [1, 1, 1]]))
    torch.testing.assert_close(tis_weights(logp_old, sampler, mask, "token_mask", 2.0),
                               torch.tensor([[1.0, 0.0, 0.0], [1, 1, 1]]))
    # sequence 0: geometric mean ratio (3 * 0.25)^(1/3) = 0.909 is inside [0.5, 2] -> kept as per-token w
    torch.testing.assert_close(tis_weights(logp_old, sampler, mask, "sequence_mask", 2.0), torch.exp(logp_old))
    torch.testing.assert_close(tis_weights(logp_old, sampler, mask, "sequence_mask", 1.05)[0], torch.zeros(3))
    assert (tis_weights(logp_old, sampler, mask, "none", 2.0) == 1).all()


def test_tis_weight_carries_no_gradient():
    logp_old = torch.randn(2, 3, requires_grad=True)
    w = tis_weights(logp_old, torch.zeros(2, 3), torch.ones(2, 3), "token_truncate", 2.0)
    assert not w.requires_grad


# ---------------------------------------------------------------- masks (P4)
def test_completion_mask_drops_truncated_rows_only_when_asked():
    resp = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    finished = torch.tensor([True, False])
    torch.testing.assert_close(completion_mask(resp, finished, False), resp[:, 1:].float())
    torch.testing.assert_close(completion_mask(resp, finished, True), torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0.0]]))


# ---------------------------------------------------------------- REINFORCE gradient (P16)
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


# ---------------------------------------------------------------- config validation (P15)
@pytest.mark.parametrize("change, flag", [({"num_generations": 1}, "num_generations"),
                                          ({"advantage_scaling": "std"}, "advantage_scaling"),
                                          ({"loss_aggregation": "sum"}, "loss_aggregation"),
                                          ({"kl_estimator": "k4"}, "kl_estimator"),
                                          ({"tis": "yes"}, "tis"), ({"generator": "sglang"}, "generator")])
def test_invalid_config_is_rejected_naming_the_flag(change, flag):
    from shared.distributed import check_args

    args = Args(**change)
    with pytest.raises(ValueError, match=f"^{flag}: "):
        check_args(args)  # the start-up checks in run_cli's order: fixed choices and ranges, then the script's own
        validate(args)


def test_entropy_bonus_is_not_a_hidden_default():
    assert not any("entropy_coef" in f for f in Args.__dataclass_fields__)  # P10: no hidden entropy bonus


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
