"""algorithms/calibration.py (linguistic calibration): the reader, the reward and the calibration metrics against
hand-computed numbers and the reference's definitions (tatsu-lab/linguistic_calibration), then exact resume, a
two-process run, and the start-up probe that refuses a reader whose forecasts ignore stated chances."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from algorithms.calibration import (calibration_metrics, ece, lc_reward, parser_reader, read_confidence,
                                    reader_accuracy, summary_line, top_answer)
from tests.test_e2e import metrics, run

ROOT = Path(__file__).resolve().parents[1]
LOW = math.log(1e-4) - 5.0  # the lowest reward before the offset: gold unforecast, nothing extracted


def reward(text: str, gold: str, finished: bool = True, offset: float = 0.0) -> float:
    forecasts, p_golds = parser_reader([{"answer": gold}], [text], [finished])
    return lc_reward(forecasts[0], p_golds[0], 1e-4, 5.0, offset)


# ---- the reader and the reward ------------------------------------------------------------------------------------
def test_reward_by_hand():
    assert reward("7\n12\n13\n13@70;14@30", "13") == pytest.approx(math.log(0.7))
    assert reward("13@70;14@30", "15") == pytest.approx(math.log(1e-4))  # gold not listed: p = 0, clipped at eps
    assert reward("13@70", "13") == pytest.approx(math.log(0.7) - 5 * 0.3)
    assert reward("13@70;14@70", "13") == pytest.approx(math.log(0.7) - 5 * 0.4)
    assert reward("7\n12\n13", "13") == 0.0  # a bare number states certainty: log 1, sum 1
    assert reward("13@100", "13") == 0.0 and reward("13@100", "14") == pytest.approx(math.log(1e-4))
    assert reward("13@70;14@30", "13", offset=5.0) == pytest.approx(math.log(0.7) + 5.0)  # C, the reference's offset
    # the reference's formula, transcribed: log(clip(p_gold, eps, 1)) - lambda * |sum(extracted probs) - 1| + C
    p_gold, probs, eps, lam, c = 0.0, [0.2, 0.5], 1e-4, 5.0, 5.0
    assert lc_reward({"1": 0.2, "2": 0.5}, p_gold, eps, lam, c) == pytest.approx(
        np.log(np.clip(p_gold, eps, 1)) - lam * np.abs(np.sum(probs) - 1) + c)


def test_clip_at_eps_and_one():
    assert lc_reward({}, 0.0, 1e-4, 0.0, 0.0) == math.log(1e-4)
    assert lc_reward({"1": 1.0}, 1.0, 1e-4, 5.0, 0.0) == 0.0
    assert lc_reward({"1": 1.0}, 1.5, 1e-4, 5.0, 0.0) == -5 * 0.0  # p above 1 clipped to 1 (an LM reader cannot)


@pytest.mark.parametrize("text", ["", "13@", "@70", "13@75", "13@70;;14@30", "13@70;", "1@10;2@10;3@10;4@10;5@60",
                                  "١٣@70", "13 @ 70", "3+4+5+1=", "7\n12\n13\n13@7O", "13@-10", "\n\n"])
def test_malformed_text_reads_as_no_answer_with_the_lowest_reward(text):
    assert read_confidence(text) == {}
    assert reward(text, "13") == pytest.approx(LOW) and reward(text, "13", offset=5.0) == pytest.approx(LOW + 5)
    assert top_answer({}) == (None, 1.0)


def test_truncated_completions_and_duplicates():
    assert read_confidence("13@70;14@30", finished=False) == {}  # cut by the length limit: no answer
    assert read_confidence("13@40;13@30") == {"13": 0.4}  # the first of a repeated answer, deduplicated as A
    assert reward("13@40;13@30", "13") == pytest.approx(math.log(0.4) - 5 * 0.6)
    assert read_confidence("013@50;14@50") == {"13": 0.5, "14": 0.5}  # numbers compare as numbers
    assert top_answer({"13": 0.5, "14": 0.5}) == ("13", 0.5)  # ties: the first
    assert reader_accuracy(["p"] * 3, ["1\n13@60;14@40", "14@60;13@40", "13"], ["13"] * 3, [True, True, False]) == [
        1.0, 0.0, 0.0]


def test_summary_line_from_ten_samples():
    answers = ["14", "13", "13", "12", None, "13", "14", "13", "12", "13"]
    assert summary_line(answers) == "13@50;14@20;12@20"  # by count, ties in first-seen order; None not listed
    assert summary_line(["5"] * 10) == "5@100"
    assert summary_line(["1", "2", "3", "4", "5", "1", "1", "1", "1", "1"]) == "1@60;2@10;3@10;4@10"  # <= 4
    assert read_confidence(summary_line(["13"] * 7 + ["14"] * 3)) == {"13": 0.7, "14": 0.3}  # sums to 1 with M = 10
    sys.path.insert(0, str(ROOT / "scripts" / "builders"))
    from lc_sft_data import distill

    samples = ["7\n12\n14", "7\n11\n13", "7\n12\n13", "7\n12\n13", "x", "7\n12\n14", "7\n12\n13", "1", "2", "3"]
    assert distill(samples) == "7\n11\n13\n13@40;14@20;1@10;2@10"  # the first modal sample's lines, slip and all


# ---- calibration metrics ------------------------------------------------------------------------------------------
def reference_compute_ece(confidence_arr, correctness_arr, ece_type="equal_bin_count", n_bins=20):
    """The reference's `compute_ece` (process_eval_results.py), transcribed; empty equal-width bins skipped."""
    n_count_per_bin = len(confidence_arr) // n_bins
    accs, confs, counts = [], [], []
    if ece_type == "equal_bin_length":
        bin_indices = np.digitize(confidence_arr, np.linspace(0, 1, n_bins + 1)) - 1
        bin_indices[confidence_arr == 1] = n_bins - 1
        for b in range(n_bins):
            m = bin_indices == b
            if m.sum():
                accs.append(correctness_arr[m].mean()), confs.append(confidence_arr[m].mean()), counts.append(m.sum())
    else:
        ranked = sorted(zip(confidence_arr, correctness_arr), key=lambda x: x[0])
        for i in range(n_bins):
            conf, corr = zip(*ranked[i * n_count_per_bin : (i + 1) * n_count_per_bin])
            accs.append(np.mean(corr)), confs.append(np.mean(conf)), counts.append(len(conf))
    accs, confs, counts = map(np.array, (accs, confs, counts))
    return np.abs(accs - confs).dot(counts) / counts.sum()


def test_ece_equal_width_by_hand():
    conf = [0.0, 0.05, 0.45, 0.55, 0.95, 1.0, 1.0, 1.0]
    corr = [0, 0, 1, 0, 1, 1, 1, 0]
    # bins: [0, .1): {0, .05} acc 0 conf .025; [.4, .5): acc 1 conf .45; [.5, .6): acc 0 conf .55;
    # last bin [.9, 1]: {.95, 1, 1, 1} acc .75 conf .9875
    by_hand = (2 * 0.025 + 1 * 0.55 + 1 * 0.55 + 4 * abs(0.75 - 0.9875)) / 8
    assert ece(conf, corr, 10, "equal_width") == pytest.approx(by_hand)
    assert ece(conf, corr, 10, "equal_width") == pytest.approx(reference_compute_ece(
        np.array(conf), np.array(corr, dtype=float), "equal_bin_length", 10))
    # the reference's edges are np.linspace's: 0.3 lies below its edge 0.30000000000000004, in bin [.2, .3)
    assert ece([0.2, 0.3], [1, 0], 10) == pytest.approx(abs(0.5 - 0.25))


def test_ece_equal_count_is_the_reference_s_including_the_dropped_remainder():
    rng = np.random.default_rng(0)
    conf = rng.choice([0.1, 0.3, 0.5, 0.7, 1.0], 47)  # 47 = 20 * 2 + 7: the 7 most confident are in no bin
    corr = (rng.random(47) < conf).astype(float)
    assert ece(conf, corr, 20, "equal_count") == pytest.approx(reference_compute_ece(conf, corr))
    assert ece([0.9, 0.1, 0.5, 1.0, 1.0], [1, 0, 1, 0, 0], 2, "equal_count") == pytest.approx(
        (2 * abs(0.5 - 0.3) + 2 * abs(0.5 - 0.95)) / 4)  # bins {.1, .5}, {.9, 1}; the last 1.0 in none


def test_brier_log_loss_and_empty_extractions_by_hand():
    forecasts = [{"13": 0.7, "14": 0.3}, {"5": 0.6, "6": 0.2}, {}, {"9": 1.0}]
    golds, correct = ["13", "6", "2", "8"], [True, False, False, False]
    p_golds = [f.get(g, 0.0) for f, g in zip(forecasts, golds)]
    m = calibration_metrics(forecasts, golds, p_golds, correct)
    # confidences .7, .6, 1 (empty: counted confident and wrong), 1
    assert m["accuracy"] == 0.25
    assert m["brier"] == pytest.approx((0.3**2 + 0.6**2 + 1 + 1) / 4)
    assert m["brier_multi"] == pytest.approx(((0.3**2 + 0.3**2) + (0.6**2 + 0.8**2) + 1 + (1 + 1)) / 4)
    assert m["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.2) + 2 * math.log(1e-4)) / 4)
    assert m["ece"] == pytest.approx((abs(0 - 0.6) + abs(1 - 0.7) + 2 * abs(0 - 1)) / 4)
    assert all(type(v) is float for v in m.values())  # plain floats: they go into checkpoints (best.json's value)


def test_lm_reader_parses_its_extraction_and_forecasts_a_probability():
    import torch

    from shared.distributed import load_causal_lm, load_tokenizer
    from shared.models import resolve_model_path
    from shared.reader import LMReader, split_answers

    assert split_answers("No Answer") == [] and split_answers("") == []
    assert split_answers(" 13; 14 ;13;;15; 16; 17\nmore") == ["13", "14", "15", "16"]
    path = resolve_model_path("builtin:tiny-sft")
    reader = LMReader(load_causal_lm(path, torch.float32), load_tokenizer(path), 4)
    forecasts, p_golds = reader([{"prompt": "3+4=", "answer": "7"}] * 2, ["7\n7@70;8@30", "x"], [True, False])
    assert 0 < p_golds[0] < 1 and forecasts[1] == {} and p_golds[1] == 0.0  # a truncated text: no answer
    assert all(0 < p < 1 for p in forecasts[0].values())


def test_the_update_is_grpo_s_the_reward_aside():
    """calibration.py's advantages and per-token loss are grpo.py's defaults on the same numbers (only the reward
    differs, which `diff algorithms/grpo.py algorithms/calibration.py` shows)."""
    import torch

    from algorithms import calibration as lc
    from algorithms import grpo

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 8, generator=g)
    for scaling in ("group", "batch", "none"):
        assert torch.equal(lc.compute_advantages(rewards, scaling), grpo.compute_advantages(rewards, scaling))
    logp, old = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    adv, mask = torch.randn(6, 1, generator=g).expand(6, 5), (torch.rand(6, 5, generator=g) > 0.3).float()
    for a, b in zip(lc.clipped_surrogate(logp, old, adv, 0.2, 0.28, mask), grpo.clipped_surrogate(logp, old, adv, 0.2,
                                                                                                   0.28, mask)):
        assert torch.equal(a, b)
    loss = lc.clipped_surrogate(logp, old, adv, 0.2, 0.28, mask)[0]
    assert torch.equal(lc.aggregate_loss(loss, mask, "global_token", 6, 20, 20, 1, 5),
                       grpo.aggregate_loss(loss, mask, "global_token", 6, 20, 20, 1, 5))


def test_maxrl_is_refused_the_reader_s_log_score_is_not_0_or_1():
    from algorithms.calibration import Args, validate

    with pytest.raises(ValueError, match=r"^advantage_estimator: maxrl needs rewards 0 or 1"):
        validate(Args(advantage_estimator="maxrl"))
    validate(Args(advantage_estimator="rloo", policy_loss="cispo", importance_level="sequence"))


# ---- runs -----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("lc_resume")
    run([sys.executable, "tests/resume_runs.py", str(out), "calibration"], timeout=900)
    return out, json.loads((out / "results.json").read_text())["calibration"]


@pytest.mark.slow
def test_n_steps_then_resume_equals_straight_run(resumed):
    _, r = resumed
    assert r["stopped_at"] >= 2 and r["rows_at_stop"] < r["n_rows"][1]
    assert r["rows_equal"], f"first differing row: {r['first_diff']}"
    assert r["weights_equal"] and r["finished"]
    first, last = r["first_row"], r["last_row"]
    assert {"eval/accuracy", "eval/ece", "eval/ece_20eq", "eval/brier", "eval/brier_multi", "eval/log_loss"} <= set(first)


@pytest.mark.slow
def test_two_processes_score_as_one(resumed, tmp_path):
    """Two ranks (ZeRO-2): the held-out forecasts before training (chunk-seeded, gathered over ranks) equal the
    one-process run's, every logged reward is the reader's on its text, and the ranks end with identical weights."""
    base, _ = resumed
    sys.path.insert(0, str(ROOT / "tests"))
    from resume_runs import cases

    from shared import task

    _, flags, _ = cases({"prompts": str(base / "data" / "prompts.jsonl"), "sft": "", "pairs": "", "rm": ""})["calibration"]
    # the same flags: 64 episodes are 2 steps of 2 ranks x 4 prompts x 4 samples
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         "algorithms/calibration.py", "--output_dir", str(tmp_path), *flags, "--save_every", "0"], timeout=900)
    rows, one = metrics(tmp_path), [json.loads(line) for line in (base / "calibration" / "a" / "metrics.jsonl")
                                    .read_text().splitlines()]
    evals = lambda r: {k: v for k, v in r.items() if k.startswith(("eval/", "dev/"))}  # noqa: E731
    assert evals(rows[0]) == evals(one[0]) and evals(rows[0])
    assert rows[-1]["check/ranks_identical_weights"] == 1.0 and rows[-1]["check/world_size"] == 2.0
    for s in (json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()):
        for x in s["rows"] if "rows" in s else [s]:
            gold = str(sum(task.prompt_terms(x["prompt"])))
            assert x["reward"] == pytest.approx(reward(x["completion"], gold, x["finish_reason"] == "stop", 5.0))


class FakeReader:
    """A reader whose p(gold) is `follow` * the stated percent / 100 + (1 - follow) * 0.12, extracting `extract`."""

    def __init__(self, follow: float, extract: str | None = None):
        self.follow, self.extract = follow, extract

    def __call__(self, rows, texts, finished):
        import re
        stated = [int(re.search(r"(\d+)%", t).group(1)) / 100 for t in texts]
        claimed = [re.search(r"is (\d+)\.", t).group(1) for t in texts]
        ps = [self.follow * c + (1 - self.follow) * 0.12 for c in stated]
        forecasts = [{self.extract or a: p} for a, p in zip(claimed, ps)]
        return forecasts, [p if r["answer"] == a else (1 - p) / 10 for r, a, p in zip(rows, claimed, ps)]


@pytest.mark.parametrize("reader, refused", [(FakeReader(1.0), False), (FakeReader(0.5), False),
                                             (FakeReader(0.0), True), (FakeReader(0.2), True),
                                             (FakeReader(1.0, extract="12 + 7 = 19"), True)])
def test_the_probe_refuses_a_reader_that_ignores_stated_chances(reader, refused):
    from shared.reader import probe_reader

    if refused:
        with pytest.raises(ValueError, match=r"^reader: its forecasts do not follow stated chances"):
            probe_reader(reader)
    else:
        probe_reader(reader)


@pytest.mark.real_model
def test_the_zero_shot_smollm2_reader_is_refused_at_start_up(tmp_path):
    """The review's finding: the zero-shot SmolLM2 reader's p(gold) stays at 0.12-0.15 while the stated chance moves
    from 90% to 10%, and its extraction returns the equation; RL against it trains on noise, so it is refused with one
    line before anything is written."""
    out = tmp_path / "out"
    import os
    import subprocess

    proc = subprocess.run([sys.executable, "algorithms/calibration.py", "--output_dir", str(out), "--model_name_or_path",
                           "builtin:smollm2-135m", "--chat_template", "--reader", "lm", "--reader_max_new_tokens", "8",
                           "--generator", "hf"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert err and err[0].startswith("error: reader: its forecasts do not follow stated chances"), proc.stderr[-2000:]
    assert not out.exists() or not any(out.iterdir())
