"""SAPO (`--policy_loss sapo`) and DeepSeek-V3.2's off-policy sequence mask (`--off_policy_mask_threshold`) and
unbiased KL (`--use_bias_correction_kl`) in the GRPO family: hand-computed numbers, and equality with TRL's
definitions (trl/trainer/grpo_trainer.py, `_compute_loss` and `get_off_policy_mask`, transcribed below)."""

import importlib

import pytest
import torch

FILES = ["grpo", "grpo_async", "dapo", "grpo_tools", "calibration", "opd", "prime"]


def trl_sapo(per_token_logps, old_per_token_logps, advantages, mask, level, pos, neg):
    """TRL's `sapo` branch: coef_1 from the token or sequence log-ratio, the sigmoid gate, -soft_coef_1 * A."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    temperatures = torch.where(advantages > 0, pos, neg)
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * advantages, coef_1


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    """TRL's GRPOTrainer.get_off_policy_mask (advantages [B, 1])."""
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def batch(seed=0, b=6, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    sampler = old + 0.2 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g)
    mask = torch.ones(b, t)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, sampler, adv, mask


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sapo_equals_trl(name, level):
    m = importlib.import_module(f"algorithms.{name}")
    logp, old, _, adv, mask = batch()
    adv_tok = adv.expand_as(logp)
    loss, _, ratio = m.sapo_surrogate(logp, old, adv_tok, 1.0, 1.05, mask, level)
    want, coef_1 = trl_sapo(logp, old, adv, mask, level, 1.0, 1.05)
    assert torch.allclose((loss * mask), (want.expand_as(logp) * mask), atol=1e-6)
    assert torch.allclose(ratio * mask, coef_1.expand_as(logp) * mask, atol=1e-6)


def test_sapo_hand_computed_on_policy_is_the_policy_gradient():
    """At rho = 1 the gate is sigmoid(0) = 1/2: loss -(4 / tau) A / 2 = -2 A / tau, and its gradient in log pi is -A
    (f'(1) = 4 * 1/2 * 1/2 = 1, drho/dlogp = rho = 1), whatever tau; off policy the weight shrinks, faster for a larger
    tau: rho = 2 with tau = 1 gives f' = 4 s (1 - s) with s = sigmoid(1) = 0.7311, 0.7864; with tau = 4, 0.0707."""
    from algorithms.grpo import sapo_surrogate

    logp = torch.zeros(2, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, attenuated, ratio = sapo_surrogate(logp, torch.zeros(2), adv, 1.0, 2.0)
    assert loss.tolist() == pytest.approx([-2.0, 1.0])
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, 1.0])
    assert attenuated.tolist() == [0.0, 0.0]
    for tau, weight in ((1.0, 0.7864477), (4.0, 0.0706508)):
        x = torch.tensor([float(torch.log(torch.tensor(2.0)))], requires_grad=True)  # rho = 2
        loss, attenuated, _ = sapo_surrogate(x, torch.zeros(1), torch.ones(1), tau, tau)
        loss.backward()
        assert x.grad.item() == pytest.approx(-weight * 2, rel=1e-5)  # -f'(rho) * rho * A
        assert attenuated.item() == float(weight < 0.5)


@pytest.mark.parametrize("name", FILES)
def test_off_policy_sequence_mask_equals_trl(name):
    m = importlib.import_module(f"algorithms.{name}")
    logp, _, sampler, adv, mask = batch(1)
    for delta in (0.0, 0.05, 0.5):
        keep = m.off_policy_sequence_mask(logp, sampler, adv.expand_as(logp), mask, delta)
        want = trl_off_policy_mask(adv, logp, sampler, mask, delta)
        assert torch.equal(keep, want.expand_as(logp))


def test_off_policy_sequence_mask_hand_computed():
    """Mean log(pi_sampler / pi) over the completion's tokens: 0.5 (row 0, A < 0: dropped at delta 0.4, kept at 0.5),
    0.5 with A > 0 (row 1: kept), -1 (row 2: kept); the padded token of row 0 does not count."""
    from algorithms.grpo import off_policy_sequence_mask

    logp = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 1]])
    adv = torch.tensor([[-1.0], [1.0], [-1.0]]).expand(3, 3)
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.4)[:, 0].tolist() == [0.0, 1.0, 1.0]
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.5)[:, 0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", FILES)
def test_unbiased_kl_equals_trl(name):
    """TRL: per_token_kl = k3(ref, logp) * coef_1, coef_1 = exp(logp - old) (token level), with its gradient."""
    m = importlib.import_module(f"algorithms.{name}")
    logp, old, ref, _, mask = batch(2)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    ours = m.unbiased_kl(m.kl_penalty(a, ref, "k3", mask), a, old, mask, "token") * mask
    trl = (torch.exp(ref - b) - (ref - b) - 1) * torch.exp(b - old) * mask
    assert torch.allclose(ours, trl, atol=1e-6)
    ours.sum().backward()
    trl.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_the_flags_parse_and_default_off():
    from algorithms.grpo import Args
    from shared.cli import parse_cli

    args = parse_cli(Args, [])
    assert (args.policy_loss, args.off_policy_mask_threshold, args.use_bias_correction_kl) == ("clip", None, False)
    args = parse_cli(Args, ["--policy_loss", "sapo", "--off_policy_mask_threshold", "0.5", "--use_bias_correction_kl",
                            "--sapo_temperature_pos", "2"])
    assert (args.policy_loss, args.off_policy_mask_threshold, args.use_bias_correction_kl,
            args.sapo_temperature_pos, args.sapo_temperature_neg) == ("sapo", 0.5, True, 2.0, 1.05)
