"""implicit_prm.py: the implicit reward's sequence and token forms, the CE loss against hand-computed numbers, the
gradient reaching pi_phi and never pi_ref, line rewards partitioning the tokens, labels from the grader, the labelled
file's bad rows; 2 steps on the real chat model (exact resume: tests/test_prime.py's fixture)."""

import json
import math
import sys

import pytest
import torch

from algorithms.implicit_prm import ce_loss, dpo_accuracy, held_out_metrics, implicit_rewards, line_rewards
from shared import data
from shared.units import line_spans
from shared.generation import completion_decoder
from shared.logprobs import forward_logprobs


def rows(tok):
    prompts = [tok(x).input_ids for x in ["3+4+5=", "1+2+3+4=", "9+9="]]
    comps = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in ["7\n12", "3\n6\n10", "18"]]
    return prompts, comps


def test_sequence_and_token_forms_and_the_ce_loss(tiny_model):
    """r = beta * (s_phi - s_ref), s = summed response log-probs (prompt excluded); 0 when phi = ref; the token
    rewards sum to r; the CE loss is BCE(sigmoid(r), l) by hand for l = 1 and 0; the gradient reaches pi_phi only."""
    import copy

    model, tok = tiny_model
    prompts, comps = rows(tok)
    ids, attn, resp = data.pad_batch(prompts, comps, tok.pad_token_id)
    mask = resp[:, 1:].float()
    phi, ref = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
    assert implicit_rewards(forward_logprobs(phi, ids, attn, resp, 1.0)[0],
                            forward_logprobs(ref, ids, attn, resp, 1.0)[0], mask).abs().max() == 0
    with torch.no_grad():
        for p in phi.parameters():
            p.add_(0.05 * torch.randn_like(p))
    logp = forward_logprobs(phi, ids, attn, resp, 1.0)[0]
    ref_logp = forward_logprobs(ref, ids, attn, resp, 1.0)[0]
    d = implicit_rewards(logp, ref_logp, mask)
    beta = 0.05
    # the sequence form from full logits: sum over the response tokens only, each model's log-prob of the sequence
    def seq_logp(m, i):
        full = torch.log_softmax(m(input_ids=ids[i : i + 1], attention_mask=attn[i : i + 1]).logits[0, :-1].float(), -1)
        n = len(prompts[i])
        return sum(full[t - 1, ids[i, t]] for t in range(n, n + len(comps[i])))
    for i in range(3):
        r_seq = beta * (seq_logp(phi, i) - seq_logp(ref, i))
        assert beta * d[i].sum().item() == pytest.approx(r_seq.item(), abs=1e-5)
    labels = torch.tensor([1.0, 0.0, 1.0])
    r = (beta * d.sum(1)).tolist()
    by_hand = -(math.log(1 / (1 + math.exp(-r[0]))) + math.log(1 - 1 / (1 + math.exp(-r[1])))
                + math.log(1 / (1 + math.exp(-r[2])))) / 3
    loss = ce_loss(d, labels, mask, beta)
    assert loss.item() == pytest.approx(by_hand, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in ref.parameters())
    assert sum(p.grad.abs().sum() for p in phi.parameters() if p.grad is not None) > 0


def test_line_rewards_partition_the_tokens_and_take_the_line_s_newline(tiny_model):
    _, tok = tiny_model
    decode = completion_decoder(tok)
    ids = tok("12\n15\n7", add_special_tokens=False).input_ids + [tok.eos_token_id]
    spans = line_spans(decode, ids)
    assert spans == [(0, 3), (3, 6), (6, 8)]  # "12\n", "15\n", "7" + EOS
    covered = [j for a, b in spans for j in range(a, b)]
    assert covered == list(range(len(ids)))  # every token in exactly one line
    d = [0.1, 0.2, 0.3, -1.0, 0.5, 0.5, 2.0, -0.5]
    assert line_rewards(d, spans, 0.5) == pytest.approx([0.3, 0.0, 0.75])
    assert sum(line_rewards(d, spans, 0.5)) == pytest.approx(0.5 * sum(d))  # they sum to r
    trailing = tok("3\n4\n", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert line_spans(decode, trailing) == [(0, 2), (2, 5)]  # EOS after a final newline joins the last line


def test_dpo_accuracy_and_held_out_metrics_by_hand():
    assert dpo_accuracy([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0, 0, 0]) == 0.5
    assert dpo_accuracy([3.0, 1.0, 2.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0]) == 1.0
    assert dpo_accuracy([3.0, 1.0, 0.0, 2.0], [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0]) == 0.5  # 2 of 4 pairs
    m = held_out_metrics("eval", [1.0, -2.0, -0.5, 0.5], [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], 0.05)
    assert m["eval/acc"] == 0.5 and m["eval/dpo_acc"] == 0.5
    assert m["eval/reward_correct"] == pytest.approx(0.25) and m["eval/reward_incorrect"] == pytest.approx(-0.75)
    bce = lambda r, l: -(l * math.log(1 / (1 + math.exp(-r))) + (1 - l) * math.log(1 - 1 / (1 + math.exp(-r))))  # noqa: E731
    assert m["eval/loss"] == pytest.approx((bce(1, 1) + bce(-2, 0) + bce(-0.5, 1) + bce(0.5, 0)) / 4)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+2=", "response": "3", "label": 0.5}, "row 1: field 'label' is 0.5, expected 0 or 1"),
    ({"prompt": "1+2=", "response": "3"}, "row 1: field 'label' is None, expected 0 or 1"),
    ({"prompt": "", "response": "3", "label": 1}, "row 1: field 'prompt' is '', expected text"),
    ({"prompt": "1+2=", "response": 3, "label": 1}, "row 1: field 'response' is 3, expected text")])
def test_a_bad_labelled_row_is_one_line_naming_it_and_nothing_is_written(tmp_path, row, message):
    import tyro

    from algorithms import implicit_prm

    path = tmp_path / "labelled.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "response": "2", "label": 1}) + "\n" + json.dumps(row) + "\n")
    out = tmp_path / "run"
    args = tyro.cli(implicit_prm.Args, args=["--data_path", str(path), "--output_dir", str(out)], use_underscores=True)
    with pytest.raises(ValueError, match=message) as error:
        implicit_prm.main(args)
    assert "\n" not in str(error.value) and "labelled.jsonl" in str(error.value)
    assert not out.exists()


def test_labels_are_the_grader_s(tmp_path, monkeypatch):
    """The sampled rows' labels equal shared/task.py::grade of the decoded samples (finished ones only)."""
    import tyro

    from algorithms import implicit_prm
    from shared import task

    seen = {}
    real = implicit_prm.compute_rewards

    def recording(fn, prompts, completions, answers, finished, rows_):
        out = real(fn, prompts, completions, answers, finished, rows_)
        seen.setdefault("rows", []).extend(zip(completions, answers, finished, out))
        return out

    monkeypatch.setattr(implicit_prm, "compute_rewards", recording)
    args = tyro.cli(implicit_prm.Args, args=["--generator", "hf", "--total_episodes", "8", "--local_num_prompts", "4",
                                             "--num_generations", "2", "--local_micro_batch_size", "8",
                                             "--eval_num_prompts", "2", "--dev_num_prompts", "0", "--best_metric", "",
                                             "--localisation_num_pairs", "0", "--max_new_tokens", "12",
                                             "--output_dir", str(tmp_path / "run")], use_underscores=True)
    implicit_prm.main(args)
    assert len(seen["rows"]) == 12 and {x[3] for x in seen["rows"]} <= {0.0, 1.0}
    assert all(label == task.grade(c, a, f) for c, a, f, label in seen["rows"])
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["implicit_prm_reference"] == "builtin:tiny-sft" and config["implicit_prm_beta"] == 0.05


@pytest.mark.real_model
@pytest.mark.slow
def test_two_steps_on_the_chat_model(tmp_path):
    from tests.test_e2e import metrics, run

    out = tmp_path / "iprm"
    run([sys.executable, "algorithms/implicit_prm.py", "--output_dir", str(out), "--model_name_or_path",
         "builtin:smollm2-135m", "--chat_template", "--dev_num_prompts", "4", "--learning_rate", "1e-5",
         "--max_new_tokens", "16", "--local_num_prompts", "4", "--num_generations", "2", "--local_micro_batch_size",
         "4", "--total_episodes", "8", "--eval_num_prompts", "2", "--localisation_num_pairs", "4", "--generator",
         "hf", "--stop", "."], timeout=900)
    rows = metrics(out)
    assert [r["step"] for r in rows if "prm/loss" in r] == [1, 2]
    assert "prm/localisation" in rows[-1]
