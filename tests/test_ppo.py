"""Unit tests of ppo.py's pure functions (docs/ppo.md, Implementation details)."""

import math

import pytest
import torch

from algorithms.ppo import (compute_gae, init_value_head, kl_penalty, masked_whiten,
                            clipped_surrogate, score_rewards, value_loss)


def gae_loop(rewards, values, gamma, lam):
    """Reference: the textbook backward loop over one sequence's completion tokens (LMHPD tests/test_gae.py style)."""
    T = len(rewards)
    adv, last = [0.0] * T, 0.0
    for t in reversed(range(T)):
        next_value = values[t + 1] if t + 1 < T else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_a_plain_loop_on_masked_rows(gamma, lam):
    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0.0]])
    rewards, values = torch.randn(3, 6) * mask, torch.randn(3, 6)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    for i in range(3):
        pos = mask[i].nonzero().flatten().tolist()
        expected = gae_loop(rewards[i, pos].tolist(), values[i, pos].tolist(), gamma, lam)
        torch.testing.assert_close(adv[i, pos], torch.tensor(expected), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i, pos], adv[i, pos] + values[i, pos])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_with_gamma_lambda_one_gives_reward_to_go():
    mask = torch.tensor([[0, 1, 1, 1.0]])
    rewards = torch.tensor([[0, 0.1, -0.2, 1.0]])
    values = torch.tensor([[9.0, 0.3, 0.5, 0.7]])
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(ret, torch.tensor([[0, 0.9, 0.8, 1.0]]))  # A + V = sum of future rewards
    torch.testing.assert_close(adv, torch.tensor([[0, 0.6, 0.3, 0.3]]))  # = R - V_t


def test_score_goes_on_the_last_completion_token():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1.0]])
    rewards = score_rewards(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(rewards, torch.tensor([[0, 0, 2.0, 0, 0], [0, 0, 0, 0, -1.0]]))


def test_value_head_init():
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=32, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=8, num_labels=1)
    model = LlamaForSequenceClassification(cfg)
    init_value_head(model)
    std = model.score.weight.std().item()
    assert abs(std - 1 / math.sqrt(513)) < 0.1 / math.sqrt(513)
    assert model.score.bias is None or (model.score.bias == 0).all()


def test_clipped_value_loss_hand_computed():
    old = torch.tensor([0.0, 0.0, 0.0])
    new = torch.tensor([0.5, 0.1, -0.5])
    ret = torch.tensor([1.0, 1.0, 1.0])
    loss, clipped = value_loss(new, old, ret, cliprange_value=0.2)
    # V=0.5: unclipped (0.5-1)^2=0.25, clipped V=0.2 -> 0.64: max 0.64; V=0.1: both 0.81; V=-0.5: 2.25 vs 1.44
    torch.testing.assert_close(loss, 0.5 * torch.tensor([0.64, 0.81, 2.25]))
    torch.testing.assert_close(clipped, torch.tensor([1.0, 0.0, 0.0]))


def test_ppo_family_clipped_surrogate_is_grpos_with_a_symmetric_range():
    """One PPO-clip function in every file: ppo's -min(rho A, clip(rho, 1-eps, 1+eps) A) is grpo's token-level one."""
    import importlib

    from algorithms import grpo

    g = torch.Generator().manual_seed(1)
    logp, old = -torch.rand(3, 6, generator=g) * 2, -torch.rand(3, 6, generator=g) * 2
    adv, mask = torch.randn(3, 6, generator=g), (torch.rand(3, 6, generator=g) > 0.3).float()
    want = grpo.clipped_surrogate(logp, old, adv, 0.2, 0.2, mask, "token")
    for script in ("ppo", "ppo_async", "ppo_rlhf", "vineppo", "drca"):
        got = importlib.import_module(f"algorithms.{script}").clipped_surrogate(logp, old, adv, 0.2, 0.2, mask)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_policy_loss_is_ratio_one_at_the_old_policy():
    logp = torch.randn(4)
    loss, clipped, ratio = clipped_surrogate(logp, logp.clone(), torch.tensor([1.0, -1.0, 2.0, 0.0]), 0.2, 0.2)
    torch.testing.assert_close(ratio, torch.ones(4))
    assert clipped.sum() == 0
    torch.testing.assert_close(loss, torch.tensor([-1.0, 1.0, -2.0, 0.0]))
    loss, clipped, _ = clipped_surrogate(torch.log(torch.tensor([1.5, 0.5])), torch.zeros(2), torch.tensor([1.0, -1.0]),
                                         0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 0.8]))
    torch.testing.assert_close(clipped, torch.ones(2))


def test_masked_whiten_zero_mean_unit_variance():
    x = torch.randn(4, 7) * 3 + 2
    mask = (torch.rand(4, 7) > 0.3).float()
    w = masked_whiten(x, mask)
    vals = w[mask > 0]
    assert abs(vals.mean().item()) < 1e-5 and abs(vals.var(unbiased=False).item() - 1) < 1e-3
    kept = masked_whiten(x, mask, shift_mean=False)[mask > 0]
    assert abs(kept.mean().item() - x[mask > 0].mean().item()) < 1e-4


def test_k3_clamped_kl_is_zero_at_init_and_nonnegative():
    logp = torch.randn(10)
    assert (kl_penalty(logp, logp, "k3") == 0).all() and (kl_penalty(logp, logp + 1, "k3") >= 0).all()


def test_adaptive_kl_controller_formula_and_clip():
    from algorithms.ppo_rlhf import adaptive_kl_update

    assert adaptive_kl_update(0.1, 6.0, 6.0, 512, 10000) == pytest.approx(0.1)
    assert adaptive_kl_update(0.1, 7.2, 6.0, 512, 10000) == pytest.approx(0.1 * (1 + 0.2 * 512 / 10000))
    assert adaptive_kl_update(0.1, 60.0, 6.0, 512, 10000) == pytest.approx(0.1 * (1 + 0.2 * 512 / 10000))  # clipped
    assert adaptive_kl_update(0.1, 0.0, 6.0, 512, 10000) == pytest.approx(0.1 * (1 - 0.2 * 512 / 10000))


@pytest.mark.parametrize("change, flag", [({"kl_placement": "both"}, "kl_placement"), ({"generator": "x"}, "generator"),
                                          ({"adaptive_kl": True, "beta": 0.0}, "adaptive_kl")])
def test_invalid_config_is_rejected(change, flag):
    from algorithms.ppo_rlhf import Args, validate
    from shared.cli import check_args

    args = Args(**change)
    with pytest.raises(ValueError, match=f"^{flag}: "):
        check_args(args)  # the start-up checks in run_cli's order: fixed choices and ranges, then the script's own
        validate(args)


@pytest.mark.parametrize("script", ["ppo", "ppo_async", "ppo_rlhf", "vineppo", "drca", "grpo", "dapo", "grpo_async"])
def test_ratio_is_masked_before_exp_so_padding_cannot_poison_the_loss(script):
    """Extreme log-probs on padding (e.g. a pad position whose log-prob moved by 200 nats): exponentiated first, the
    ratio is inf there and inf * 0 = NaN in the masked sum, so the step was skipped as non-finite."""
    import importlib

    surrogate = importlib.import_module(f"algorithms.{script}").clipped_surrogate
    policy_loss = lambda logp, old, adv, eps, mask=None: surrogate(logp, old, adv, eps, eps, mask)  # noqa: E731
    logp = torch.tensor([[-1.0, -2.0, 200.0, -300.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert not torch.isfinite((policy_loss(logp, old, adv, 0.2)[0] * mask).sum())  # the old behaviour
    loss, clipped, ratio = policy_loss(logp, old, adv, 0.2, mask)
    total = (loss * mask).sum()
    total.backward()
    assert torch.isfinite(total) and torch.all(torch.isfinite(logp.grad)) and ratio[0, 2:].tolist() == [1.0, 1.0]
    expected = torch.maximum(-adv * torch.exp(logp - old), -adv * torch.clamp(torch.exp(logp - old), 0.8, 1.2))
    assert torch.allclose(loss[0, :2], expected[0, :2])  # unchanged where the mask is 1


def test_kl_penalty_masked_before_exp():
    logp = torch.tensor([[-1.0, -500.0]])
    ref = torch.tensor([[-1.5, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert not torch.isfinite((kl_penalty(logp, ref, "k3") * mask).sum())
    k3 = kl_penalty(logp, ref, "k3", mask)
    assert torch.isfinite(k3).all() and k3[0, 1] == 0 and k3[0, 0] == pytest.approx(math.expm1(-0.5) + 0.5)


def test_a_critic_from_a_reward_model_predicts_in_normalised_reward_units(tiny_path):
    """ppo_rlhf.py initialises the critic from rm.py's checkpoint, whose config stores the RM's score mean / std; the
    rewards it must predict are the normalised scores (r - mu) / sigma. Its values must be in those same units (they
    were raw head outputs, biasing every sequence's last advantage by the difference)."""
    from algorithms.ppo_rlhf import critic_values
    from shared import data
    from shared.scalar import load_scalar_model, score_last_token, token_values

    critic = load_scalar_model(tiny_path, torch.float32).eval()
    critic.config.reward_mean, critic.config.reward_std = 0.7, 2.5  # as rm.py writes them
    ids, attn, _ = data.pad_batch([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], pad_id=0)
    with torch.no_grad():
        raw = token_values(critic, ids, attn)
        values = critic_values(critic, ids, attn)
        reward = score_last_token(critic, ids, attn)  # what a reward model with these stats gives as the reward
    assert torch.allclose(values, (raw[:, :-1] - 0.7) / 2.5, atol=1e-6)
    last = attn.sum(1) - 1
    assert torch.allclose(reward, (raw[torch.arange(2), last] - 0.7) / 2.5, atol=1e-6)  # the same affine map
    del critic.config.reward_mean
    with torch.no_grad():  # a critic without stats (a fresh head on the policy): raw head outputs
        assert torch.allclose(critic_values(critic, ids, attn), raw[:, :-1])
