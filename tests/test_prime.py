"""prime.py: the advantage against a NumPy transcription of verl's compute_rloo_advantage_return and hand-computed
numbers, the PRM's CE loss and token rewards, the accuracy filter, the PRM update order; exact resume (policy and PRM
optimizers) in one process and under ZeRO-2 with 2 processes; 2 steps on the real chat model."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from algorithms.prime import (Args, dpo_accuracy, filter_groups, implicit_rewards, masked_rloo, masked_whiten,
                              prime_returns, prm_ce_loss, process_rewards, reward_scale, update_prm, validate)

ROOT = Path(__file__).resolve().parents[1]


# ---- the reference's formula, transcribed (verl recipe/prime/prime_core_algos.py, prime_dp_rm.py) -----------------
def np_masked_rloo(reward, mask, n):
    """verl `masked_rloo`: per group of n rows, every masked entry r -> r * n/(n-1) - sum_j mean_j / (n-1)."""
    reward = np.where(mask, reward, 0.0).astype(np.float64)
    for start in range(0, reward.shape[0], n):
        means = [reward[p][mask[p]].mean() for p in range(start, start + n)]
        baseline = sum(means) / (n - 1)
        block, m = reward[start : start + n], mask[start : start + n]
        block[m] = block[m] * (n / (n - 1)) - baseline
    return reward


def np_prime_advantages(rm_scores, acc, eos_mask, n, dpo_coef, gt_coef):
    """verl `compute_rloo_advantage_return` after `prime_norm` (batch_norm): returns and whitened advantages."""
    rev = np.flip(np.cumsum(np.flip(rm_scores, 1), 1), 1)
    rm_scores = rm_scores / (np.abs(rev).max() + 1e-6)
    tensors = [np_masked_rloo(rm_scores, eos_mask, n) * dpo_coef]
    length = eos_mask.sum(1)
    reward, rmask = np.zeros(eos_mask.shape), np.zeros(eos_mask.shape, dtype=bool)
    reward[np.arange(len(length)), length - 1] = acc
    rmask[np.arange(len(length)), length - 1] = True
    tensors.append(np_masked_rloo(reward, rmask, n) * gt_coef)
    final = sum(tensors)
    returns = np.flip(np.cumsum(np.flip(final * eos_mask, 1), 1), 1)
    m = eos_mask.astype(np.float64)
    mean = (returns * m).sum() / m.sum()
    var = (((returns - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)  # verl masked_var(unbiased=True)
    return (returns - mean) / np.sqrt(var + 1e-8) * m, returns


def batch():
    """2 groups x n = 4 completions of lengths 1..4 (left-aligned response positions), hand-set q and accuracies."""
    lengths = [3, 1, 4, 2, 4, 4, 2, 3]
    mask = torch.zeros(8, 5)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    q = torch.tensor([[0.5, -1.0, 2.0, 0, 0], [1.5, 0, 0, 0, 0], [-0.5, 0.25, 1.0, -2.0, 0], [3.0, -1.0, 0, 0, 0],
                      [0.1, 0.2, 0.3, 0.4, 0], [-0.3, 0.0, 0.6, -0.1, 0], [2.0, 2.0, 0, 0, 0], [-1.0, 1.0, 0.5, 0, 0]])
    acc = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    return q * mask, acc, mask


def test_advantage_equals_a_numpy_transcription_of_the_reference():
    q, acc, mask = batch()
    beta = 0.05
    r = process_rewards(q, mask, beta)
    r = r / (reward_scale(r) + 1e-6)
    returns = prime_returns(r, acc, mask, 4, 5.0, 5.0)
    adv = masked_whiten(returns, mask)
    # the reference: token scores beta * q on all but the last response token (prime_granularity "token")
    scores = np.zeros(tuple(mask.shape))
    for i, n in enumerate(mask.sum(1).int().tolist()):
        scores[i, : n - 1] = beta * q.numpy()[i, : n - 1]
    ref_adv, ref_returns = np_prime_advantages(scores, acc.numpy(), mask.numpy().astype(bool), 4, 5.0, 5.0)
    np.testing.assert_allclose(returns.numpy(), ref_returns, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-4, atol=1e-5)
    m = mask.bool()
    assert adv[m].mean().abs() < 1e-5 and adv[m].std().item() == pytest.approx(1.0, abs=1e-4)


def test_outcome_term_is_the_leave_one_out_baseline_by_hand():
    """One reward per completion: r_i - mean_{j != i} r_j. Group 1 accuracies 1, 0, 1, 0: 1 - 1/3, 0 - 2/3, ..."""
    _, acc, mask = batch()
    last = torch.zeros_like(mask)
    last[torch.arange(8), mask.sum(1).long() - 1] = 1
    out = masked_rloo(last * acc[:, None], last, 4)
    got = (out * last).sum(1)
    assert got[:4].tolist() == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3])
    assert got[4:].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, -1.0])
    by_definition = [acc[i] - (acc[(i // 4) * 4 : (i // 4) * 4 + 4].sum() - acc[i]) / 3 for i in range(8)]
    assert got.tolist() == pytest.approx([x.item() for x in by_definition])
    # the process term: r_it - mean_{j != i} m_j + (r_it - m_i) / (n - 1), m_j a row's token mean
    q, _, _ = batch()
    means = (q * mask).sum(1) / mask.sum(1)
    i, t = 2, 1
    expected = q[i, t] - (means[:4].sum() - means[i]) / 3 + (q[i, t] - means[i]) / 3
    assert masked_rloo(q, mask, 4)[i, t].item() == pytest.approx(expected.item())


def test_advantage_is_invariant_to_a_common_coefficient_and_to_the_reward_scale():
    q, acc, mask = batch()

    def adv(r, cp, co):
        r = r / (reward_scale(r) + 1e-6)
        return masked_whiten(prime_returns(r, acc, mask, 4, cp, co), mask)

    r = process_rewards(q, mask, 0.05)
    torch.testing.assert_close(adv(r, 5.0, 5.0), adv(r, 1.0, 1.0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(adv(r, 5.0, 5.0), adv(r * 37.0, 5.0, 5.0), atol=1e-5, rtol=1e-4)  # batch_norm
    assert not torch.allclose(adv(r, 5.0, 5.0), adv(r, 5.0, 1.0), atol=1e-3)  # the ratio does matter


def test_token_rewards_ce_loss_and_dpo_accuracy_by_hand():
    q, acc, mask = batch()
    r = process_rewards(q, mask, 0.5)
    assert r[0].tolist() == [0.25, -0.5, 0.0, 0.0, 0.0]  # last response token (index 2) gets 0
    assert r[1].tolist() == [0.0] * 5  # a one-token response: its only token is the last
    logp = torch.randn(8, 5)
    assert implicit_rewards(logp, logp, mask).abs().sum() == 0  # pi_phi = pi_ref: no reward
    # BCE(sigmoid(beta * sum q), l): row 0 sums to 1.5 -> logit 0.075 (label 1); row 1: 1.5 -> 0.075 (label 0)
    beta = 0.05
    loss = prm_ce_loss(q[:2], acc[:2], mask[:2], beta)
    by_hand = (-math.log(1 / (1 + math.exp(-0.075))) - math.log(1 - 1 / (1 + math.exp(-0.075)))) / 2
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    assert dpo_accuracy(q[:4], torch.ones(4), mask[:4], 4) == 0.5  # no label difference
    perfect = torch.tensor([[3.0], [1.0], [2.0], [0.0]])
    assert dpo_accuracy(perfect, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 1), 4) == 1.0
    assert dpo_accuracy(-perfect, torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 1), 4) == 0.0


def test_accuracy_filter_keeps_passing_groups_first_and_fills_with_failing_ones():
    acc = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 0, 0]]).float()
    trunc = torch.zeros(6, 4, dtype=torch.bool)
    kept, passing = filter_groups(acc, trunc, 0.2, 0.8, 3)
    assert passing == [False, True, False, True, True, True] and kept == [1, 3, 4]
    trunc[3, 2] = True  # a completion at the length limit fails its group
    kept, passing = filter_groups(acc, trunc, 0.2, 0.8, 5)
    assert kept == [1, 4, 5, 0, 2]  # 3 passing, then failing groups fill in sampling order
    with pytest.raises(ValueError, match="num_generations"):
        validate(Args(num_generations=1))


def test_prm_update_order_and_no_gradient_to_the_reference(tiny_model):
    """`after`: the rewards are the step's own forward (the PRM before its step); `before`: a forward of the updated
    PRM. The frozen reference never gets a gradient."""
    import copy

    from shared import data
    from shared.distributed import NonFiniteGuard, init_distributed, prepare
    from shared.logprobs import forward_logprobs

    model, tok = tiny_model
    info = init_distributed()
    prompts = [tok(x).input_ids for x in ["1+2+3=", "4+5=", "7+1+1=", "2+2="]]
    comps = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in ["3\n6", "9", "8\n9", "5"]]
    ids, attn, resp = data.pad_batch(prompts, comps, tok.pad_token_id)
    mask, acc, lengths = resp[:, 1:].float(), torch.tensor([1.0, 1.0, 1.0, 0.0]), attn.sum(1).tolist()
    ref = copy.deepcopy(model).requires_grad_(False)
    ref_logp = forward_logprobs(ref, ids, attn, resp, 1.0)[0]
    out = {}
    for order in ("after", "before"):
        prm = copy.deepcopy(model)
        engine, *_ = prepare(prm, torch.optim.AdamW(prm.parameters(), lr=1e-2), None, info, 2, 2, 1.0,
                             torch.float32)
        with torch.no_grad():
            before = implicit_rewards(forward_logprobs(engine, ids, attn, resp, 1.0)[0], ref_logp, mask)
        q, loss, norm = update_prm(engine, NonFiniteGuard(1), ref_logp, ids, attn, resp, lengths, mask, acc, 0.05, 2,
                                   "padded", order)
        with torch.no_grad():
            after = implicit_rewards(forward_logprobs(engine, ids, attn, resp, 1.0)[0], ref_logp, mask)
        assert not torch.allclose(before, after)  # the step changed the PRM
        torch.testing.assert_close(q, before if order == "after" else after, atol=1e-6, rtol=1e-5)
        assert loss == pytest.approx(prm_ce_loss(before, acc, mask, 0.05).item(), rel=1e-5) and norm > 0
        out[order] = q
    assert all(p.grad is None for p in ref.parameters())


def test_prm_takes_one_clipped_step_per_minibatch_as_verl(tiny_model):
    """--prm_num_minibatches k: k optimizer steps on consecutive slices of the batch, each on its slice's CE mean and
    clipped at --prm_max_grad_norm (verl's recipe: reward_model.mini_batch_size 64 of 256 samples, grad_clip 10): the
    PRM ends where plain AdamW with clip_grad_norm_ on the two slices in turn ends; the one-step default differs."""
    import copy

    from shared import data
    from shared.distributed import NonFiniteGuard, init_distributed, prepare
    from shared.logprobs import forward_logprobs

    model, tok = tiny_model
    info = init_distributed()
    prompts = [tok(x).input_ids for x in ["1+2+3=", "4+5=", "7+1+1=", "2+2="]]
    comps = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in ["3\n6", "9", "8\n9", "5"]]
    ids, attn, resp = data.pad_batch(prompts, comps, tok.pad_token_id)
    mask, acc, lengths = resp[:, 1:].float(), torch.tensor([1.0, 0.0, 1.0, 0.0]), attn.sum(1).tolist()
    ref = copy.deepcopy(model).requires_grad_(False)
    ref_logp = forward_logprobs(ref, ids, attn, resp, 1.0)[0]
    clip, lr = 0.05, 1e-2  # a clip below the gradient's norm: every step is clipped
    by_hand = copy.deepcopy(model)
    opt = torch.optim.AdamW(by_hand.parameters(), lr=lr)
    for rows in ([0, 1], [2, 3]):
        q = implicit_rewards(forward_logprobs(by_hand, ids[rows], attn[rows], resp[rows], 1.0)[0], ref_logp[rows],
                             mask[rows])
        prm_ce_loss(q, acc[rows], mask[rows], 0.05).backward()
        assert torch.nn.utils.clip_grad_norm_(by_hand.parameters(), clip) > clip
        opt.step()
        opt.zero_grad()
    weights = {}
    for k in (2, 1):
        prm = copy.deepcopy(model)
        engine, *_ = prepare(prm, torch.optim.AdamW(prm.parameters(), lr=lr), None, info, 2, 2 // k, clip,
                             torch.float32)
        update_prm(engine, NonFiniteGuard(1), ref_logp, ids, attn, resp, lengths, mask, acc, 0.05, 2, "padded",
                   "after", num_minibatches=k)
        weights[k] = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    expected = torch.cat([p.detach().flatten() for p in by_hand.parameters()])
    torch.testing.assert_close(weights[2], expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(weights[1], expected, atol=1e-4)


def test_prm_minibatches_must_divide_the_micro_batches(tmp_path):
    from algorithms.prime import main

    out = tmp_path / "run"
    with pytest.raises(ValueError, match="^prm_num_minibatches: 3 does not divide the 2 micro-batches"):
        main(Args(output_dir=str(out), local_num_prompts=2, num_generations=4, local_micro_batch_size=4,
                  prm_num_minibatches=3, generator="hf"))
    assert not out.exists()


# ---- end-to-end: exact resume in one process and under ZeRO-2 with 2 processes ------------------------------------
def launch(cmd, timeout=900):
    from tests.test_reliability import launch as run

    return run(cmd, timeout)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("prime_resume")
    launch([sys.executable, "tests/resume_runs.py", str(out), "prime", "implicit_prm"])
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", ["prime", "implicit_prm"])
def test_stop_and_resume_equals_the_straight_run(resumed, case):
    """Every metric row and the final weights (prime.py: policy and PRM, both optimizers resumed) bit for bit."""
    r = resumed[case]
    assert r["stopped_at"] >= 1 and r["rows_at_stop"] < r["n_rows"][1]
    assert r["rows_equal"], f"first differing row: {r['first_diff']}"
    assert r["weights_equal"] and r["finished"] and r["best"]
    assert set(r["weights"]) >= ({"final", "prm"} if case == "prime" else {"final"})


def test_prime_learns_signals_and_logs_its_metrics(resumed):
    last = resumed["prime"]["last_row"]
    row = resumed["prime"]["step_row"]
    for key in ("reward_model/dpo_loss", "reward_model/grad_norm", "reward_model/reward", "reward_model/raw_reward",
                "reward_model/dpo_acc", "prime/filter_pass_frac", "prime/kept_pass_frac", "prime/groups_correct_0",
                "val/returns_mean"):
        assert key in row, key
    assert row["episode"] % 32 == 0  # every generated sample counted: 4 prompts x 2 (oversampled) x 4 per step
    assert last["check/ranks_identical_weights"] == 1.0


def test_two_processes_zero2_resume_exactly(tmp_path):
    """prime.py under ZeRO-2 with 2 processes: stop + resume equals the straight run; ranks end identical."""
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
            "tests/resume_runs.py", str(tmp_path), "prime@zero2"])
    r = json.loads((tmp_path / "results.json").read_text())["prime@zero2"]
    assert r["rows_equal"] and r["weights_equal"], r["first_diff"]
    assert r["last_row"]["check/world_size"] == 2.0 and r["last_row"]["check/ranks_identical_weights"] == 1.0


@pytest.mark.real_model
@pytest.mark.slow
def test_two_steps_on_the_chat_model(tmp_path):
    from tests.test_e2e import metrics, run

    out = tmp_path / "prime"
    run([sys.executable, "algorithms/prime.py", "--output_dir", str(out), "--model_name_or_path",
         "builtin:smollm2-135m", "--chat_template", "--dev_num_prompts", "4", "--learning_rate", "1e-5",
         "--prm_learning_rate", "1e-5", "--max_new_tokens", "16", "--local_num_prompts", "2", "--num_generations", "2",
         "--local_micro_batch_size", "4", "--num_minibatches", "1", "--total_episodes", "16", "--eval_num_prompts",
         "4", "--eval_num_samples", "1", "--eval_every", "0", "--generator", "hf", "--stop", "."], timeout=900)
    rows = metrics(out)
    assert [r["step"] for r in rows if "reward_model/dpo_loss" in r] == [1, 2]
    config = json.loads((out / "prm" / "config.json").read_text())
    assert config["implicit_prm_reference"] == "builtin:smollm2-135m" and config["implicit_prm_beta"] == 0.05
