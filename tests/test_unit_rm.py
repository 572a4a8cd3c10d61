"""Unit tests of unit_rm.py (docs/unit_rm.md): the peak segmentation rule with its EOS fix-ups, the unit values, the
MaxEnt loss against hand-computed numbers, the normaliser fit, and a 2-step run with its bad-input errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from algorithms.rm import bradley_terry_loss
from algorithms.unit_rm import (check_units, credit_entropy, fit_log_normalizer, gather_unit_values, peak_unit_ends,
                                position_stats, response_unit_ends, sequence_reward, unit_rm_loss)

ROOT = Path(__file__).resolve().parents[1]


def test_peak_unit_ends_follows_the_reference_rule_and_its_eos_fix_ups():
    # n = 7 (EOS at 6): peaks at 1 and 4, max E = 4 < n - 2 -> 5 appended; units {0,1}, {2,3,4}, {5}; EOS in none
    assert peak_unit_ends([0.1, 2.0, 0.2, 0.3, 1.9, 0.1, 0.1], 1.5) == [1, 4, 5]
    assert peak_unit_ends([0.1, 0.1, 0.1, 0.1], 1.5) == [2]  # E empty -> [n - 2]
    assert peak_unit_ends([2.0, 0.1, 2.0, 2.0], 1.5) == [0, 2]  # max E = n - 1 with n - 2 in E: dropped
    assert peak_unit_ends([2.0, 0.1, 0.1, 2.0], 1.5) == [0, 2]  # max E = n - 1 without n - 2: replaced by n - 2
    assert peak_unit_ends([0.1, 0.1, 2.0, 0.1], 1.5) == [2]  # max E = n - 2: unchanged
    assert peak_unit_ends([5.0, 5.0, 5.0, 5.0], 1000) == [3]  # tau = 1000: one unit read at EOS (the bandit RM)
    assert peak_unit_ends([0.3, 0.2, 0.4, 0.1, 0.5], 0) == [0, 1, 2, 3]  # tau = 0: one unit per token before EOS
    assert peak_unit_ends([0.3], 0.5) == [] and peak_unit_ends([0.3], 1000) == [0]  # EOS alone: no unit


def test_the_last_entropy_never_matters():
    """The fix-ups make the result E' + {n - 2} (E' = the peaks before n - 1) whatever H_{n-1} is."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        h = (torch.rand(int(torch.randint(2, 9, (1,), generator=g)), generator=g) * 2).tolist()
        a, b = peak_unit_ends(h[:-1] + [0.0], 1.0), peak_unit_ends(h[:-1] + [9.0], 1.0)
        assert a == b == sorted({j for j in range(len(h) - 1) if h[j] > 1.0} | {len(h) - 2})


def test_response_unit_ends_shifts_response_entropies_and_refuses_a_response_without_unit():
    # response_entropies: entry t is the entropy producing token t, so position j's is entry j + 1
    ent = torch.tensor([9.0, 0.1, 2.0, 0.1, 0.1])  # peak producing token 2 -> position 1 ends a unit
    assert response_unit_ends([ent], [[5, 6, 7, 8, 2]], 1.5, "dataset") == [[1, 3]]
    with pytest.raises(ValueError, match="dataset: row 1: the response has no unit"):
        response_unit_ends([ent, ent[:1]], [[5, 6, 7, 8, 2], [2]], 1.5, "dataset")


def test_a_pair_whose_response_has_no_unit_is_refused_at_start_up_naming_split_pair_and_side():
    class Pairs:  # the fields of shared/data.py's PreferenceData that the check reads
        def __init__(self, chosen, rejected):
            self.chosen_ids, self.rejected_ids = chosen, rejected

        def __len__(self):
            return len(self.chosen_ids)

    good = Pairs([[5, 2], [6, 7, 2]], [[8, 2], [9, 2]])
    check_units({"train": good, "eval": good}, 2, "d.jsonl")  # every response has a token before EOS
    bad = Pairs([[5, 2], [6, 2]], [[8, 2], [2]])  # pair 1's rejected side is EOS alone
    with pytest.raises(ValueError, match=r"^dataset 'd.jsonl': eval pair 1: the rejected response has no unit "
                                         r"\(1 token\(s\); a unit needs a token before EOS\)$"):
        check_units({"train": good, "eval": bad}, 2, "d.jsonl")
    check_units({"eval": bad}, 1, "d.jsonl")  # tau = 1000: the one unit is read at EOS, which every response has


def test_unit_values_are_read_at_each_unit_end():
    values = torch.arange(20.0).reshape(2, 10)
    v, m = gather_unit_values(values, [3, 2], [[0, 2], [4]])
    torch.testing.assert_close(v, torch.tensor([[3.0, 5.0], [16.0, 0.0]]))
    torch.testing.assert_close(m, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(sequence_reward(v, m), torch.tensor([4.0, 16.0]))


def test_credit_entropy_and_loss_match_hand_computed_values():
    v = torch.tensor([[0.0, math.log(3.0), 0.0], [1.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # softmax [1/4, 3/4]
    torch.testing.assert_close(credit_entropy(v, m), torch.tensor([h / 2, 0.0]))
    lw = torch.tensor([[1.0, 3.0]])  # r_w = 2, Hbar_w = H(softmax [1, 3]) / 2
    lr = torch.tensor([[0.0, 0.0]])  # r_l = 0, softmax uniform: H = log 2, Hbar = log(2) / 2
    ones = torch.ones(1, 2)
    p = torch.softmax(torch.tensor([1.0, 3.0]), 0)
    hw = -(p * p.log()).sum().item() / 2
    loss, r_w, r_l = unit_rm_loss(lw, ones, lr, ones, 0.1)
    expected = math.log(1 + math.exp(-2.0)) - 0.1 * (hw + math.log(2) / 2)
    torch.testing.assert_close(loss, torch.tensor([expected]))
    torch.testing.assert_close((r_w, r_l), (torch.tensor([2.0]), torch.tensor([0.0])))


def test_lambda_zero_is_the_plain_bradley_terry_loss_and_padding_gives_finite_gradients():
    g = torch.Generator().manual_seed(1)
    vw, vl = torch.randn(4, 5, generator=g, requires_grad=True), torch.randn(4, 5, generator=g)
    mw = torch.tensor([[1.0] * k + [0.0] * (5 - k) for k in (1, 2, 5, 3)])
    ml = torch.tensor([[1.0] * k + [0.0] * (5 - k) for k in (5, 1, 2, 4)])
    loss, r_w, r_l = unit_rm_loss(vw, mw, vl, ml, 0.0)
    torch.testing.assert_close(loss, bradley_terry_loss(sequence_reward(vw, mw), sequence_reward(vl, ml)))
    reg, _, _ = unit_rm_loss(vw, mw, vl, ml, 0.5)
    assert not torch.allclose(reg, loss)
    reg.sum().backward()
    assert torch.isfinite(vw.grad).all() and (vw.grad * (1 - mw) == 0).all()


def test_position_stats_and_the_normaliser_fit_recover_known_coefficients():
    stats = position_stats([[1.0, 3.0], [3.0, 5.0], [2.0]])  # keys k/K: 0.5 holds [1, 3], 1.0 holds [3, 5, 2]
    assert stats["0.500"] == (2.0, 1.0, 2)
    assert stats["1.000"][0] == pytest.approx(10 / 3) and stats["1.000"][1] == pytest.approx(math.sqrt(14 / 9))
    ps = [k / 10 for k in range(1, 11)]
    fake = {f"{p:.3f}": (0.7668 * math.log(p) + 0.4705, 0.2569 * math.log(p) + 2.8339, 10) for p in ps}
    fit = fit_log_normalizer(fake)
    assert fit["mu"] == pytest.approx([0.7668, 0.4705], abs=1e-3)
    assert fit["sigma"] == pytest.approx([0.2569, 2.8339], abs=1e-3)
    assert fit_log_normalizer({"1.000": (0.5, 2.0, 3)}) == {"mu": [0.0, 0.5], "sigma": [0.0, 2.0]}


def _run(args, tmp_path, timeout=420):
    return subprocess.run([sys.executable, "algorithms/unit_rm.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_two_steps_write_the_normaliser_and_bad_input_is_one_line(tmp_path):
    out = tmp_path / "urm"
    proc = _run(["--output_dir", str(out), "--total_episodes", "32", "--local_micro_batch_size", "16",
                 "--eval_num_pairs", "8", "--dev_num_prompts", "0", "--best_metric", "", "--normalizer_num_pairs",
                 "16", "--save_every", "0", "--num_sample_pairs", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    norm = json.loads((out / "final" / "unit_normalizer.json").read_text())
    assert norm["tau"] == 0.5 and norm["model"] == "builtin:tiny-sft" and norm["aggregation"] == "avg"
    assert norm["num_responses"] == 32 and len(norm["mu"]) == len(norm["sigma"]) == 2
    assert sum(p["count"] for p in norm["positions"].values()) > 32  # more than one unit per response
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval/localisation" in r][-1]
    assert 0 <= final["eval/localisation"] <= 1 and final["eval/units_per_response"] > 1
    # a pair with an empty side: one line, exit 2, nothing written
    bad = tmp_path / "bad.jsonl"
    good = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}
    bad.write_text("".join(json.dumps(good) + "\n" for _ in range(11)) + json.dumps({**good, "rejected": ""}) + "\n")
    proc = _run(["--dataset", str(bad), "--eval_split", "train", "--output_dir", str(tmp_path / "bad")], tmp_path)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "row 11" in errors[0] and "'rejected' is empty" in errors[0]
    assert not (tmp_path / "bad").exists()
