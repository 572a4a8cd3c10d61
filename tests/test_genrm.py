"""GenRM (algorithms/genrm.py), the verifiers as rewards and selectors (shared/verifier.py), best-of-N
(shared/evaluation.py, algorithms/evaluate.py --verifiers): hand-computed numbers and the spec's definitions, then
one small run per claim, the runs shared."""

import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from algorithms import genrm
from shared import task
from shared.evaluation import best_of_n, weighted_vote_at_k
from shared.units import line_spans
from shared.verifier import cot_mean, line_rewards, sequence_prob
from tests.test_e2e import metrics, run

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--local_num_prompts", "24", "--num_generations", "4", "--total_episodes", "64", "--local_micro_batch_size",
         "16", "--eval_num_prompts", "6", "--dev_num_prompts", "6", "--eval_num_samples", "4", "--eval_every", "2",
         "--max_new_tokens", "12"]


# ---------------------------------------------------------------- scores from logits
def test_p_yes_is_the_softmax_entry_and_a_multi_token_verdict_the_product():
    logits = torch.tensor([[[2.0, 0.0, -1.0, 0.5]]])  # [B=1, m=1, V=4]
    assert torch.allclose(sequence_prob(logits, [0]), torch.softmax(logits[0, 0], -1)[0].unsqueeze(0))
    assert math.isclose(sequence_prob(logits, [0]).item(), math.exp(2) / (math.exp(2) + 1 + math.exp(-1) + math.exp(.5)),
                        rel_tol=1e-6)
    two = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 3.0, 0.0]]])  # " Y" "es" as two tokens
    p1, p2 = math.e / (math.e + 2), math.exp(3) / (math.exp(3) + 2)
    assert math.isclose(sequence_prob(two, [0, 1]).item(), p1 * p2, rel_tol=1e-6)


def test_genrm_loss_by_hand_and_sft_coef_zero_drops_the_sft_gradient():
    lv = torch.tensor([[-0.5, 0.0], [-1.0, -2.0]], requires_grad=True)
    mv = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    ls = torch.tensor([[-0.2, -0.4]], requires_grad=True)
    ms = torch.tensor([[1.0, 1.0]])
    loss, v, s = genrm.genrm_loss(lv, mv, ls, ms, 0.5, num_verify_tokens=3, num_sft_tokens=2)
    assert math.isclose(v.item(), 3.5 / 3, rel_tol=1e-6) and math.isclose(s.item(), 0.3, rel_tol=1e-6)
    assert math.isclose(loss.item(), 3.5 / 3 + 0.5 * 0.3, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(ls.grad, torch.tensor([[-0.25, -0.25]]))
    ls.grad = None
    genrm.genrm_loss(lv, mv, ls, ms, 0.0, 3, 2)[0].backward()
    assert ls.grad is None  # no gradient from the SFT term at all


def test_cot_score_is_the_mean_over_k_and_a_rationale_without_verdict_counts_zero():
    # 2 responses, K = 3 rationales each; response 0's second rationale never reached the question
    p_yes = torch.tensor([0.9, 0.6, 0.3, 0.2, 0.1])
    owner = [0, 0, 1, 1, 1]
    assert torch.allclose(cot_mean(p_yes, owner, 2, 3), torch.tensor([(0.9 + 0.6 + 0) / 3, 0.6 / 3]))
    assert torch.equal(cot_mean(torch.zeros(0), [], 2, 3), torch.zeros(2))


def test_cot_scoring_of_the_tiny_model_equals_a_manual_forward_per_rationale():
    """K sampled rationales (fixed seed): the score is the mean of p(verdict | ..., rationale), read by hand here."""
    from shared.distributed import init_distributed, load_causal_lm, load_tokenizer
    from shared.models import resolve_model_path
    from shared.verifier import GenerativeVerifier, continuation_logprob, has_question, text_ids

    path = resolve_model_path("builtin:tiny-sft")
    tok, info = load_tokenizer(path), init_distributed()
    model = load_causal_lm(path, torch.float32)
    config = SimpleNamespace(genrm_mode="cot", genrm_question="1 ", genrm_yes="\n", genrm_no="2",  # digits: often
                             genrm_cot_prompt="=", genrm_num_rationales=3, genrm_temperature=1.0,
                             genrm_max_rationale_tokens=6, genrm_seed=5)
    v = GenerativeVerifier(model, tok, config)
    prompts = [text_ids(tok, "3+4+5+1="), text_ids(tok, "1+1+1+1=")]
    responses = [text_ids(tok, "7\n12\n13") + [tok.eos_token_id], text_ids(tok, "2\n3\n4") + [tok.eos_token_id]]
    out = v.score(prompts, responses, tok.pad_token_id, info, 4)
    groups = v.rationales(prompts, responses, info)
    for i, group in enumerate(groups):
        # the sampled rationale stops at "1"; the question's trailing blank follows it, then the verdict
        ps = [continuation_logprob(model, [prompts[i] + responses[i] + v.cot_prompt + c.token_ids + text_ids(tok, " ")],
                                   v.yes,
                                   tok.pad_token_id, info.device).exp().item()
              if has_question(tok, c.token_ids, "1") else 0.0 for c in group]
        assert math.isclose(out["p_yes"][i].item(), sum(ps) / 3, rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(out["no_verdict"][i].item(), sum(p == 0.0 for p in ps) / 3, abs_tol=1e-6)
    assert out["no_verdict"].mean() < 1  # some rationales reached the question


# ---------------------------------------------------------------- data
def test_builtin_rationale_checks_every_line_against_the_expected_running_sum():
    assert genrm.builtin_rationale("3+4+5+1=", "7\n12\n13") == "7 7 Y\n12 12 Y\n13 13 Y"
    assert genrm.builtin_rationale("3+4+5+1=", "7\n13\n14") == "7 7 Y\n13 12 N\n14 13 N"
    assert genrm.builtin_rationale("3+4+5+1=", "7\n12") == "7 7 Y\n12 12 Y\n- 13 N"
    assert genrm.builtin_rationale("3+4+5+1=", "7\n12\n13\n5") == "7 7 Y\n12 12 Y\n13 13 Y\n5 - N"
    assert genrm.rationale_agrees("7 7 Y\n12 12 Y\n13 13 Y", 1) and not genrm.rationale_agrees("7 7 Y\n12 12 Y", 0)
    assert genrm.rationale_agrees("7 7 Y\n13 12 N", 0)


def test_direct_and_cot_examples_end_with_the_question_and_one_verdict_token_on_the_character_tokenizer():
    from shared.distributed import load_tokenizer
    from shared.models import resolve_model_path
    from shared.verifier import text_ids

    tok = load_tokenizer(resolve_model_path("builtin:tiny-sft"))
    fmt = genrm.verdict_strings(tok, "auto")
    assert fmt is genrm.SHORT  # " Yes" is four characters here
    p, y = text_ids(tok, "3+4+5+1="), text_ids(tok, "7\n12\n13") + [tok.eos_token_id]
    ctx, target = genrm.verify_example(p, y, 1, fmt, tok)
    assert tok.decode(ctx[len(p) + len(y):]) == "\nCorrect? " and target == text_ids(tok, "Y") and len(target) == 1
    assert genrm.verify_example(p, y, 0, fmt, tok)[1] == text_ids(tok, "N")
    ctx, target = genrm.verify_example(p, y, 1, fmt, tok, "7 7 Y\n12 12 Y\n13 13 Y")
    assert tok.decode(ctx[len(p) + len(y):]) == "\nCheck:\n"
    assert tok.decode(target) == "7 7 Y\n12 12 Y\n13 13 Y\nCorrect? Y"


def test_auroc_by_hand():
    assert genrm.auroc([0.9, 0.8, 0.3, 0.1], [1, 1, 0, 0]) == 1.0
    assert genrm.auroc([0.5, 0.2, 0.5, 0.9], [1, 1, 0, 0]) == (0.5 + 0 + 1 * 0 + 0) / 4  # pairs: (0.5,0.5) half
    assert math.isnan(genrm.auroc([0.1], [1]))


# ---------------------------------------------------------------- best-of-N
def test_best_of_n_blocks_tie_break_and_one_block_when_n_is_k():
    scores = [0.1, 0.9, 0.5, 0.5, 0.7, 0.2, 0.7, 0.3]
    correct = [1, 0, 1, 0, 0, 1, 1, 1]
    assert best_of_n(scores, correct, 1) == sum(correct) / 8
    assert best_of_n(scores, correct, 2) == (0 + 1 + 0 + 1) / 4  # blocks [0.1,0.9] [0.5,0.5]->first [0.7,0.2] [0.7,0.3]
    assert best_of_n(scores, correct, 4) == (0 + 0) / 2  # 0.9 in block 0; 0.7 (index 4, first of the tie) in block 1
    assert best_of_n(scores, correct, 8) == 0.0  # one block: 0.9 at index 1
    assert best_of_n(scores[:7], correct[:7], 4) == 0.0  # 7 samples: one block of 4
    with pytest.raises(ValueError):
        best_of_n(scores, correct, 9)


def test_weighted_vote_sums_weights_per_answer():
    answers = ["5", "6", "6", "5", "7", None, "7", "7"]
    weights = [0.9, 0.3, 0.4, 0.1, 0.2, 0.9, 0.2, 0.2]
    correct = [1, 0, 0, 1, 0, 0, 0, 0]
    # block 0: 5 -> 1.0, 6 -> 0.7: "5" (correct); block 1: 7 -> 0.6 (None does not vote): wrong
    assert weighted_vote_at_k(answers, weights, correct, 4) == 0.5
    assert weighted_vote_at_k(["a", "b"], [0.5, 0.5], [0, 1], 2) == 0.0  # a tie: the answer seen first
    sig = [1 / (1 + math.exp(-s)) for s in (2.0, -1.0, -1.0)]  # implicit PRM: sigmoid of the scores
    assert weighted_vote_at_k(["x", "y", "y"], sig, [1, 0, 0], 3) == 1.0  # 0.88 > 2 x 0.27


# ---------------------------------------------------------------- implicit PRM scorer
def test_line_rewards_partition_the_tokens_and_the_score_is_the_min_over_lines(tmp_path):
    from shared.distributed import init_distributed, load_tokenizer
    from shared.models import resolve_model_path
    from shared.scalar import load_reward_model, score_sequences
    from shared.verifier import ImplicitPRM, text_ids

    path = resolve_model_path("builtin:tiny-sft")
    tok, info = load_tokenizer(path), init_distributed()
    ids = text_ids(tok, "7\n12\n13") + [tok.eos_token_id]
    spans = line_spans(lambda x: tok.decode(x, skip_special_tokens=True), ids)
    assert spans == [(0, 2), (2, 5), (5, 8)]  # "7\n" | "12\n" | "13<eos>"
    assert line_rewards(torch.arange(8.0), spans) == [1.0, 9.0, 18.0]
    ckpt = tmp_path / "prm"
    shutil.copytree(path, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "implicit_prm_reference": "builtin:tiny-sft",
                                                  "implicit_prm_beta": 0.05}))
    prm = load_reward_model(str(ckpt), tok, info, torch.float32)
    assert isinstance(prm, ImplicitPRM)
    prompts = [text_ids(tok, "3+4+5+1=")] * 2
    responses = [ids, text_ids(tok, "7\n13\n14") + [tok.eos_token_id]]
    assert torch.equal(score_sequences(prm, prompts, responses, tok.pad_token_id, info, 4), torch.zeros(2))  # phi = ref
    with torch.no_grad():  # another pi_phi: the score is beta * min over lines of the summed log-ratios
        for p in prm.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = prm.token_rewards(prompts, responses, tok.pad_token_id, info)
    assert torch.allclose(d[0].sum(), prm.score(prompts, responses, tok.pad_token_id, info, 4)["sum"][0])
    expected = min(float(d[0][s:e].sum()) for s, e in [(0, 2), (2, 5), (5, 8)])
    assert math.isclose(score_sequences(prm, prompts, responses, tok.pad_token_id, info, 4)[0].item(), expected,
                        rel_tol=1e-5)


# ---------------------------------------------------------------- runs
def _run(out: Path, *flags: str) -> list[dict]:
    run([sys.executable, "algorithms/genrm.py", "--output_dir", str(out), *SMALL, *flags])
    return metrics(out)


@pytest.fixture(scope="module")
def direct_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("genrm") / "direct"
    return out, _run(out)


@pytest.mark.slow
def test_direct_run_logs_the_verifier_metrics_labels_from_the_grader_and_saves_what_scoring_needs(direct_run):
    out, rows = direct_run
    last = [r for r in rows if "eval/auroc" in r][-1]
    for key in ("eval/p_yes_correct", "eval/p_yes_incorrect", "eval/no_verdict_frac", "eval/bon/acc@4",
                "eval/bon/pass@4", "eval/bon/maj@4", "dev/auroc"):
        assert key in last
    assert any("genrm/loss_verify" in r and "genrm/loss_sft" in r for r in rows)
    config = json.loads((out / "final" / "config.json").read_text())
    assert (config["genrm_mode"], config["genrm_question"], config["genrm_yes"], config["genrm_no"]) == \
        ("direct", "\nCorrect? ", "Y", "N")
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert logged and all(s["label"] == task.grade(s["completion"], s["answer"], s["finished"]) for s in logged)


@pytest.mark.slow
def test_grpo_takes_a_genrm_checkpoint_as_its_reward_and_evaluate_selects_best_of_n_with_it(direct_run, tmp_path):
    from shared.distributed import init_distributed, load_tokenizer
    from shared.scalar import load_reward_model, score_sequences
    from shared.verifier import GenerativeVerifier, text_ids

    final = direct_run[0] / "final"
    tok, info = load_tokenizer(str(final)), init_distributed()
    verifier = load_reward_model(str(final), tok, info, torch.float32)
    assert isinstance(verifier, GenerativeVerifier)
    prompt, response = text_ids(tok, "3+4+5+1="), text_ids(tok, "7\n12\n13") + [tok.eos_token_id]
    with torch.no_grad():
        logits = verifier.model(torch.tensor([prompt + response + text_ids(tok, "\nCorrect? ")])).logits
    by_hand = torch.softmax(logits[0, -1], -1)[text_ids(tok, "Y")[0]].item()
    assert math.isclose(score_sequences(verifier, [prompt], [response], tok.pad_token_id, info, 4).item(), by_hand,
                        rel_tol=1e-5)
    run([sys.executable, "algorithms/grpo.py", "--output_dir", str(tmp_path / "grpo"), "--reward_model_path", str(final),
         "--generator", "hf", "--total_episodes", "16", "--local_num_prompts", "4", "--num_generations", "4",
         "--local_micro_batch_size", "16", "--max_new_tokens", "12", "--eval_every", "0", "--eval_num_prompts", "4",
         "--eval_num_samples", "2", "--dev_num_prompts", "4", "--save_every", "0", "--no_save_model"])
    rows = metrics(tmp_path / "grpo")
    scores = [r["objective/scores"] for r in rows if "objective/scores" in r]
    assert scores and all(0 <= s <= 1 for s in scores)  # probabilities, not the grader's 0/1 alone
    # ppo_rlhf.py takes it too, its critic then a fresh head on the policy (a verifier has no value head)
    run([sys.executable, "algorithms/ppo_rlhf.py", "--output_dir", str(tmp_path / "ppo"), "--reward_model_path",
         str(final), "--generator", "hf", "--total_episodes", "16", "--local_num_prompts", "4", "--num_generations", "4",
         "--local_micro_batch_size", "16", "--max_new_tokens", "12", "--eval_every", "0", "--eval_num_prompts", "4",
         "--eval_num_samples", "2", "--dev_num_prompts", "4", "--save_every", "0", "--no_save_model"])
    rows = metrics(tmp_path / "ppo")
    scores = [r["objective/scores"] for r in rows if "objective/scores" in r]
    assert scores and all(0 <= s <= 1 for s in scores) and 0 <= rows[-1]["eval/reward"] <= 1
    # and repulse.py (its reward on the built-in prompts: p(Yes), not the grader's 0/1)
    run([sys.executable, "algorithms/repulse.py", "--output_dir", str(tmp_path / "repulse"), "--dataset", "builtin",
         "--reward_model_path", str(final), "--generator", "hf", "--total_episodes", "32", "--local_num_prompts", "4",
         "--num_generations", "4", "--local_micro_batch_size", "16", "--max_new_tokens", "12", "--eval_every", "0",
         "--eval_num_prompts", "4", "--eval_num_samples", "2", "--dev_num_prompts", "4", "--save_every", "0",
         "--no_save_model"])
    scores = [r["objective/scores"] for r in metrics(tmp_path / "repulse") if "objective/scores" in r]
    assert scores and all(0 <= s <= 1 for s in scores) and any(0 < s < 1 for s in scores)
    run([sys.executable, "algorithms/evaluate.py", "--output_dir", str(tmp_path / "ev"), "--generator", "hf",
         "--eval_num_prompts", "4", "--num_samples", "4", "--k", "1", "4", "--num_bootstrap", "10", "--max_new_tokens", "12",
         "--verifiers", f"genrm={final}", "rm=builtin:tiny-rm"])
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())["metrics"]
    records = [json.loads(line) for line in (tmp_path / "ev" / "completions.jsonl").read_text().splitlines()]
    for name in ("genrm", "rm"):
        assert summary[f"eval/bon/{name}@1"] == summary["eval/pass@1"]
        expected = sum(best_of_n([s["scores"][name] for s in r["samples"]], [s["grade"] > 0.5 for s in r["samples"]],
                                 4) for r in records) / len(records)
        assert math.isclose(summary[f"eval/bon/{name}@4"], expected)
        assert f"eval/wvote/{name}@4" in summary


@pytest.mark.slow
def test_cot_run_trains_on_rationales_and_scores_k_of_them(tmp_path):
    rows = _run(tmp_path / "cot", "--verifier", "cot", "--num_rationales", "2", "--max_rationale_tokens", "40",
                "--eval_every", "0")
    first = next(r for r in rows if "data/verify_examples" in r)
    assert first["data/verify_examples"] > 0 and "data/rationales_dropped" in first
    last = [r for r in rows if "eval/auroc" in r][-1]
    assert 0 <= last["eval/no_verdict_frac"] <= 1
    config = json.loads((tmp_path / "cot" / "final" / "config.json").read_text())
    assert config["genrm_mode"] == "cot" and config["genrm_num_rationales"] == 2


@pytest.mark.slow
def test_stop_and_resume_equals_a_straight_run(tmp_path):
    from tests.resume_runs import metric_rows, weights

    flags = ["--eval_every", "2", "--save_every", "2", "--total_episodes", "64"]
    _run(tmp_path / "a", *flags)
    _run(tmp_path / "b", *flags, "--stop_after_steps", "2")
    _run(tmp_path / "b", *flags)
    assert metric_rows(tmp_path / "a") == metric_rows(tmp_path / "b")
    wa, wb = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_processes_under_zero2_train_one_verifier(tmp_path):
    out = tmp_path / "z2"
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         "--num_processes", "2", "algorithms/genrm.py", "--output_dir", str(out), *SMALL, "--local_num_prompts", "12",
         "--local_micro_batch_size", "8", "--eval_every", "0"])
    rows = metrics(out)
    assert any("genrm/loss_verify" in r for r in rows) and (out / "final" / "config.json").exists()
    assert [r for r in rows if "data/verify_examples" in r][0]["data/verify_examples"] == 24 * 4


def test_a_bad_labelled_row_is_a_one_line_error_naming_it(tmp_path):
    import tyro

    data = tmp_path / "labelled.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": 1}) + "\n"
                    + json.dumps({"prompt": "1+2=", "completion": "3", "label": "yes"}) + "\n")
    args = tyro.cli(genrm.Args, args=["--output_dir", str(tmp_path / "out"), "--data_path", str(data)])
    with pytest.raises(ValueError, match=r"^data_path: .* row 2: field 'label' must be 0 or 1, got 'yes'$"):
        genrm.main(args)
    assert not (tmp_path / "out").exists()
