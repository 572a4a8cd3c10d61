"""The fair GenRM comparison (scripts/experiments/genrm_fair.py, docs/genrm.md): the discriminative baseline's BCE
(algorithms/genrm.py --loss_type bce), balancing within a prompt, AUROC within a prompt and best-of-N over distinct
responses, against hand-computed numbers; then two steps of the baseline."""

import json
import math
import sys

import pytest
import torch

from algorithms import genrm
from scripts.experiments import genrm_fair as fair
from tests.test_e2e import run


def test_bce_loss_by_hand():
    # z = log p(Yes) - log p(No): ln(0.6 / 0.2) = ln 3 for a correct row, ln(0.1 / 0.4) = -ln 4 for an incorrect one
    logp_yes, logp_no = torch.log(torch.tensor([0.6, 0.1])), torch.log(torch.tensor([0.2, 0.4]))
    loss = genrm.bce_loss(logp_yes, logp_no, torch.tensor([1, 0]), 4.0)
    # -log sigmoid(ln 3) = ln(4/3); -log(1 - sigmoid(-ln 4)) = -log(4/5) = ln(5/4); summed, over the step's 4 rows
    assert loss.item() == pytest.approx((math.log(4 / 3) + math.log(5 / 4)) / 4, rel=1e-6)
    # only the difference matters: the same logits shifted together give the same loss (a scalar head)
    assert genrm.bce_loss(logp_yes - 2.0, logp_no - 2.0, torch.tensor([1, 0]), 4.0).item() == pytest.approx(loss.item())


def test_bce_loss_gradient_pushes_yes_up_for_a_correct_row():
    logp_yes = torch.tensor([-1.0], requires_grad=True)
    logp_no = torch.tensor([-1.0], requires_grad=True)
    genrm.bce_loss(logp_yes, logp_no, torch.tensor([1]), 1.0).backward()
    assert logp_yes.grad.item() == pytest.approx(-0.5) and logp_no.grad.item() == pytest.approx(0.5)  # sigmoid(0) - 1


def test_balance_within_prompt_keeps_min_of_each_label_in_order():
    rows = [{"prompt": p, "label": y, "i": i} for i, (p, y) in enumerate(
        [("a", 1), ("a", 1), ("b", 0), ("a", 0), ("a", 1), ("c", 1), ("c", 0), ("c", 0)])]
    out = fair.balance_within_prompt(rows)
    # a: 3 correct, 1 incorrect -> the first correct (0) and the incorrect (3); b: one label only -> none; c: 5, 6
    assert [r["i"] for r in out] == [0, 3, 5, 6]
    for p in {r["prompt"] for r in out}:
        assert sum(r["label"] for r in out if r["prompt"] == p) * 2 == sum(1 for r in out if r["prompt"] == p)


def test_within_prompt_auroc_by_hand():
    # prompt 1: correct 0.9 against incorrect 0.5 (won) and 0.95 (lost) -> 0.5; prompt 2: correct 0.3 (won) and 0.2
    # (a tie) against incorrect 0.2 -> (1 + 0.5) / 2 = 0.75; prompt 3: one label only, left out
    groups = [([0.9, 0.5, 0.95], [1, 0, 0]), ([0.3, 0.2, 0.2], [1, 1, 0]), ([0.1, 0.7], [1, 1])]
    assert fair.within_prompt_auroc(groups) == pytest.approx((0.5 + 0.75) / 2)
    # a score that is constant within a prompt (the prompt's difficulty) is at chance within every prompt, though it
    # separates the prompts: correct rows of the easy prompt above incorrect rows of the hard one
    easy, hard = ([0.75] * 4, [1, 1, 1, 0]), ([0.25] * 4, [1, 0, 0, 0])
    assert fair.within_prompt_auroc([easy, hard]) == 0.5
    assert fair.auroc(easy[0] + hard[0], easy[1] + hard[1]) == pytest.approx((3 * 3 + 3 * 0.5 + 3 * 0.5) / 16)


def test_distinct_best_of_n_merges_identical_strings():
    texts = ["7", "7", "8", "9", "7", "6", "5", "8"]
    correct = [1, 1, 0, 0, 1, 0, 0, 0]
    scores = [0.2, 0.2, 0.9, 0.1, 0.2, 0.3, 0.0, 0.9]
    # distinct in first-appearance order: 7 (idx 0), 8 (2), 9 (3), 6 (5), 5 (6); blocks of 2: [0, 2], [3, 5]
    assert fair.distinct_blocks(texts, 2) == [[0, 2], [3, 5]]
    assert fair.distinct_best_of_n(texts, scores, correct, 2) == 0.0  # 8 over 7, then 6 over 9
    assert fair.distinct_chance(texts, correct, 2) == pytest.approx((0.5 + 0.0) / 2)
    assert fair.distinct_pass(texts, correct, 2) == 0.5
    # fewer distinct responses than N: one block of all five
    assert fair.distinct_blocks(texts, 8) == [[0, 2, 3, 5, 6]]
    assert fair.distinct_chance(texts, correct, 8) == pytest.approx(1 / 5)
    # over samples a repeated correct string is no likelier at random: blocks of 4 -> {7, 8, 9}: 1/3, {7, 6, 5, 8}: 1/4
    assert fair.sample_chance_per_distinct(texts, correct, 4) == pytest.approx((1 / 3 + 1 / 4) / 2)


def test_render_names_every_row(tmp_path):
    ref = {c: {"auroc": 0.5, "auroc_within_prompt": 0.5, "bon@4": 0.1, "bon_distinct@4": 0.2, "bon@16": 0.3,
               "bon_distinct@16": 0.4} for c in ("first_sample", "majority_vote", "prompt_difficulty",
                                                "random_per_distinct", "pass")}
    ref["stats"] = {"accuracy": 0.5, "mean_distinct_responses": 6.0, "mean_distinct_correct": 1.0,
                    "prompts_with_both_labels": 80}
    run_metrics = {**ref["first_sample"], "train_minutes": 2.0}
    d = {"k": [4, 16], "references": ref, "num_prompts": 100, "num_samples": 16, "policy": "builtin:tiny-sft",
         "seeds": [1, 2], "train_flags": "--eval_every 0", "command": "python x.py", "env": {"device": "CPU X x2"},
         "data": {"all": {"rows": 10, "correct": 5, "prompts": 2}, "prompt_balanced": {"rows": 4, "correct": 2,
                                                                                      "prompts": 1}},
         "runs": {"disc": {"1": run_metrics, "2": {**run_metrics, "bon@4": 0.3}}}}
    text = fair.render(d)
    row = "| discriminative (BCE), all rows, batches half Yes / half No | 0.500 | 0.500 | 0.200 (0.100 to 0.300) |"
    assert row in text
    assert text.count("\n|") == 7 and "`python x.py`, CPU X x2." in text


def test_two_steps_of_the_discriminative_baseline(tmp_path):
    out = tmp_path / "bce"
    run([sys.executable, "algorithms/genrm.py", "--loss_type", "bce", "--sft_coef", "0", "--local_num_prompts", "16",
        "--num_generations", "4", "--total_episodes", "32", "--local_micro_batch_size", "16", "--eval_num_prompts",
        "4", "--dev_num_prompts", "0", "--best_metric", "", "--eval_num_samples", "2", "--eval_every", "0",
        "--max_new_tokens", "12", "--output_dir", str(out)])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("genrm/loss_verify" in r and r["genrm/loss_sft"] == 0.0 for r in rows)
    assert json.loads((out / "final" / "config.json").read_text())["genrm_loss_type"] == "bce"
    last = [r for r in rows if "eval/p_yes_correct" in r][-1]
    assert 0 < last["eval/p_yes_correct"] < 1 and last["eval/p_verdict"] < 1  # the score is normalised, p(Yes) is not


def test_a_bce_checkpoint_is_scored_as_a_reward_by_the_score_it_was_trained_on():
    """shared/verifier.verifier_scores: p(yes) for a GenRM, p(yes) / (p(yes) + p(no)) for `--loss_type bce`."""
    from types import SimpleNamespace

    from shared.verifier import GenerativeVerifier, verifier_scores

    class Stub(GenerativeVerifier):
        def __init__(self, loss_type):
            self.loss_type = loss_type

        def score(self, prompts, responses, pad_id, info, micro_batch_size, with_no=False, seed=None):
            return {"p_yes": torch.tensor([0.2, 0.6]), "p_no": torch.tensor([0.6, 0.2]) if with_no else None}

    info = SimpleNamespace(device=torch.device("cpu"))
    assert verifier_scores(Stub("nll"), [[1], [1]], [[2], [2]], 0, info, 2).tolist() == pytest.approx([0.2, 0.6])
    assert verifier_scores(Stub("bce"), [[1], [1]], [[2], [2]], 0, info, 2).tolist() == pytest.approx([0.25, 0.75])
