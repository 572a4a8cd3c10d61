"""dpo.py's losses without a reference model, SimPO (`--loss_type simpo`) and ORPO (`--loss_type orpo`): hand-computed
numbers, TRL's definitions (trl 1.16.0 trl/experimental/cpo/cpo_trainer.py `cpo_loss` with loss_type="simpo" and
cpo_alpha=0; trl/experimental/orpo/orpo_trainer.py `odds_ratio_loss` and `loss = policy_nll_loss - losses.mean()`,
transcribed below), and two training steps with no reference model loaded."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from algorithms.dpo import Args, log1mexp, reference_free_loss, validate

ROOT = Path(__file__).resolve().parents[1]


def trl_simpo(avg_w, avg_l, beta, simpo_gamma, label_smoothing):
    logits = avg_w - avg_l
    logits = logits - simpo_gamma / beta
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing)


def trl_log1mexp(x):
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def trl_orpo(avg_w, avg_l, beta, chosen_nll):
    log_odds = (avg_w - avg_l) - (trl_log1mexp(avg_w) - trl_log1mexp(avg_l))
    losses = beta * F.logsigmoid(log_odds)
    return chosen_nll - losses.mean()


def averages(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(n, generator=g) * 3 - 0.01, -torch.rand(n, generator=g) * 3 - 0.01


def test_simpo_hand_computed():
    """a_w = -1, a_l = -2, beta 2, gamma 1: z = 2 * 1 - 1 = 1, loss -log sigmoid(1) = 0.3133; eps 0.1 adds
    0.1 * (log sigmoid(1) - log sigmoid(-1)) = 0.1 * (-0.3133 + 1.3133) = ... as the formula."""
    w, l = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert reference_free_loss(w, l, "simpo", 2.0, 1.0).item() == pytest.approx(-math.log(1 / (1 + math.exp(-1))))
    smoothed = 0.9 * -math.log(1 / (1 + math.exp(-1))) + 0.1 * -math.log(1 / (1 + math.exp(1)))
    assert reference_free_loss(w, l, "simpo", 2.0, 1.0, label_smoothing=0.1).item() == pytest.approx(smoothed)


def test_orpo_hand_computed():
    """a_w = log 0.5, a_l = log 0.25: odds 1 and 1/3, log odds ratio log 3; loss -log 0.5 - 0.1 log sigmoid(log 3)
    = 0.6931 - 0.1 log(3/4) = 0.7219."""
    w, l = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    want = -math.log(0.5) - 0.1 * math.log(0.75)
    assert reference_free_loss(w, l, "orpo", 0.1, orpo_lambda=0.1).item() == pytest.approx(want)
    assert log1mexp(torch.tensor([-1e-6, -0.5, -30.0])).tolist() == pytest.approx(
        [math.log(1e-6), math.log(1 - math.exp(-0.5)), -math.exp(-30.0)], rel=1e-4)


@pytest.mark.parametrize("beta,gamma,eps", [(0.1, 0.5, 0.0), (2.0, 1.0, 0.0), (2.5, 1.4, 0.2)])
def test_simpo_equals_trl(beta, gamma, eps):
    w, l = averages(1)
    assert torch.allclose(reference_free_loss(w, l, "simpo", beta, gamma, label_smoothing=eps),
                          trl_simpo(w, l, beta, gamma, eps), atol=1e-6)


@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_orpo_equals_trl_on_equal_lengths(lam):
    """TRL's NLL is the token mean over the batch's chosen responses; with one length per response it is the mean of
    -a(y_w), so the batch mean of the per-pair loss equals TRL's loss, and its gradient too."""
    w, l = averages(2)
    a, b = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ours = reference_free_loss(a, l, "orpo", 0.1, orpo_lambda=lam).mean()
    trl = trl_orpo(b, l, lam, (-b).mean())
    assert ours.item() == pytest.approx(trl.item(), abs=1e-6)
    ours.backward()
    trl.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_the_flags_check():
    validate(Args(loss_type="simpo", label_smoothing=0.1))
    with pytest.raises(ValueError, match="^label_smoothing: not used by loss_type=orpo"):
        validate(Args(loss_type="orpo", label_smoothing=0.1))
    with pytest.raises(ValueError, match="^ref_model_name_or_path: loss_type=simpo uses no reference model"):
        validate(Args(loss_type="simpo", ref_model_name_or_path="builtin:tiny"))


def test_two_steps_without_a_reference(tmp_path, loss_type="orpo"):
    """Two steps of 32 pairs (ORPO; SimPO takes the same path with another loss): the losses are finite and the run has
    no reference-log-prob phase."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, "algorithms/dpo.py", "--output_dir", str(tmp_path), "--loss_type", loss_type,
                    "--total_episodes", "64", "--local_micro_batch_size", "32", "--eval_every", "0",
                    "--eval_num_prompts", "8", "--eval_num_samples", "1", "--dev_num_prompts", "0",
                    "--eval_num_pairs", "16", "--generator", "hf", "--no_save_model", "--best_metric", ""],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/dpo" in r]
    assert steps[-1]["step"] == 2 and all(math.isfinite(r["loss/dpo"]) for r in steps)
    assert not any("time/ref_logps" in r for r in rows)
    assert any("eval/rewards/accuracies" in r for r in rows)
