"""Unit tests of unit_ppo.py (docs/unit_ppo.md): each reward placement's sums, the location-aware normalisation, the
normaliser checks, the segmentation shared with unit_rm.py, the built-in unit RM, a 2-step run on it with its bad-input
errors, and exact resume of unit_rm.py and unit_ppo.py with 2 processes under ZeRO-3 and ZeRO-2."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import algorithms.unit_rm as unit_rm
from algorithms.unit_ppo import (dense_unit_rewards, load_normalizer, normalize_units, peak_unit_ends,
                                 place_unit_rewards, position_normalize)

ROOT = Path(__file__).resolve().parents[1]


def test_each_placement_sums_as_it_should():
    r, ends, n = [1.0, -2.0, 3.0], [1, 4, 5], 7  # units {0,1}, {2,3,4}, {5}; action 6 is EOS
    seg = place_unit_rewards(r, ends, n, "segment_normalization")
    assert seg == pytest.approx([0.5, 0.5, -2 / 3, -2 / 3, -2 / 3, 3.0, 0.0]) and sum(seg) == pytest.approx(2.0)
    assert place_unit_rewards(r, ends, n, "every_segment_last") == [0.0, 1.0, 0.0, 0.0, -2.0, 3.0, 0.0]
    same = place_unit_rewards(r, ends, n, "same_segment_last")
    assert same == [1.0, 1.0, -2.0, -2.0, -2.0, 3.0, 0.0] and sum(same) == 2 * 1 - 3 * 2 + 3  # sum_k L_k r_k
    assert place_unit_rewards(r, ends, n, "segment_last_avg") == [0.0] * 6 + [pytest.approx(2 / 3)]


def test_position_normalize_uses_the_log_fit():
    norm = {"mu": [0.5, 1.0], "sigma": [0.2, 2.0]}
    got = position_normalize([3.0, 1.0], norm)  # p = 1/2 then 1
    lp = math.log(0.5)
    assert got == pytest.approx([(3.0 - (0.5 * lp + 1.0)) / (0.2 * lp + 2.0), (1.0 - 1.0) / 2.0], abs=1e-9)
    assert position_normalize([1.0], {"mu": [0.0, 0.0], "sigma": [0.0, -1.0]}) == [1000.0]  # sigma floored at 1e-3


def test_the_rollout_segmentation_is_unit_rm_s():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        h = torch.rand(int(torch.randint(1, 9, (1,), generator=g)), generator=g).tolist()
        for tau in (0.0, 0.5, 1000.0):
            assert peak_unit_ends(h, tau) == unit_rm.peak_unit_ends(h, tau)


def test_dense_unit_rewards_place_each_completion_from_its_first_action_and_penalise_a_cut_one():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    # completion 0: 3 actions from column 1, units ending at 0 and 1; completion 1: 4 actions from column 2, not finished
    dense = dense_unit_rewards([[2.0, 4.0], [1.0]], [[0, 1], [2]], [1, 2], [3, 4], [True, False], mask,
                               "segment_normalization", -3.0, 10.0)
    assert dense.tolist() == [[0.0, 2.0, 4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, -3.0]]
    clipped = dense_unit_rewards([[50.0]], [[1]], [1], [3], [True], mask[:1], "every_segment_last", 0.0, 10.0)
    assert clipped.tolist() == [[0.0, 0.0, 10.0, 0.0, 0.0, 0.0]]  # clipped to +-reward_clip


def test_normalize_units_by_position_or_for_the_bandit_by_the_rm_stats():
    class Config:
        reward_mean, reward_std = 1.0, 2.0

    class RM:
        config = Config()

    norm = {"mu": [0.0, 1.0], "sigma": [0.0, 2.0]}  # mu(p) = 1, sigma(p) = 2 at every position
    assert normalize_units([[3.0, 5.0]], norm, RM(), bandit=False) == [[1.0, 2.0]]
    assert normalize_units([[3.0, 5.0]], {"mu": [9.0, 9.0], "sigma": [9.0, 9.0]}, RM(), bandit=True) == [[1.0, 2.0]]


def test_the_built_in_unit_rm_is_committed_with_its_normaliser_for_the_default_setting():
    """builtin:tiny-unit-rm (unit_ppo.py's default --reward_model_path): the committed weights, built by unit_rm.py from
    builtin:tiny-sft, and a normaliser that load_normalizer accepts for unit_ppo.py's defaults (tau 0.5)."""
    from shared import tiny
    from shared.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-unit-rm")
    assert tiny.weights_sha256(path) == tiny.EXPECTED_SHA256["tiny-unit-rm"]
    assert json.loads((Path(path) / "build.json").read_text())["recipe"].startswith(
        "python algorithms/unit_rm.py --model_name_or_path builtin:tiny-sft")
    norm = load_normalizer(path, 0.5, "builtin:tiny-sft")
    assert norm["num_responses"] > 0 and norm["sigma"][1] > 0


@pytest.fixture(scope="module")
def unit_rm_dir(tmp_path_factory):
    """builtin:tiny-rm's weights with a normaliser for tau 0.5 on builtin:tiny-sft (a unit RM's files; no training)."""
    from shared.models import resolve_model_path

    out = tmp_path_factory.mktemp("unit_rm") / "final"
    shutil.copytree(resolve_model_path("builtin:tiny-rm"), out)
    norm = {"method": "peak", "tau": 0.5, "model": "builtin:tiny-sft", "aggregation": "avg", "mu": [0.1, 0.0],
            "sigma": [0.0, 5.0]}
    (out / "unit_normalizer.json").write_text(json.dumps(norm))
    return out


def test_load_normalizer_refuses_another_setting(unit_rm_dir, tmp_path):
    assert load_normalizer(str(unit_rm_dir), 0.5, "builtin:tiny-sft")["sigma"] == [0.0, 5.0]
    with pytest.raises(ValueError, match="^tau: the reward model's normaliser is for tau 0.5, not 1.0"):
        load_normalizer(str(unit_rm_dir), 1.0, "builtin:tiny-sft")
    with pytest.raises(ValueError, match="^model_name_or_path: .* for model 'builtin:tiny-sft', not 'other'"):
        load_normalizer(str(unit_rm_dir), 0.5, "other")
    with pytest.raises(ValueError, match="^reward_model_path: .* has no unit_normalizer.json"):
        load_normalizer(str(tmp_path), 0.5, "builtin:tiny-sft")


def _run(args, timeout=420):
    return subprocess.run([sys.executable, "algorithms/unit_ppo.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_two_steps_on_the_default_reward_model_and_another_tau_is_one_line(tmp_path):
    """No --reward_model_path: the default, builtin:tiny-unit-rm (a fresh clone has no runs/unit_rm/final)."""
    out = tmp_path / "ppo"
    small = ["--total_episodes", "32", "--local_num_prompts", "4", "--num_generations", "4",
             "--local_micro_batch_size", "8", "--eval_num_prompts", "4", "--eval_num_samples", "1",
             "--dev_num_prompts", "0", "--best_metric", "", "--generator", "hf", "--save_every", "0",
             "--no_save_model"]
    proc = _run([*small, "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "objective/units" in r]
    assert len(steps) == 2 and all(r["objective/units"] >= 1 and math.isfinite(r["objective/scores"]) for r in steps)
    proc = _run([*small, "--tau", "1.0", "--output_dir", str(tmp_path / "bad")])
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: tau: the reward model's normaliser")
    assert not (tmp_path / "bad").exists()


def test_unit_rm_and_unit_ppo_resume_exactly_with_two_processes_under_zero3_and_zero2(tmp_path):
    """tests/resume_runs.py's comparison with 2 processes: unit_rm.py under ZeRO-3 (its frozen SFT entropy model and
    the trained head partitioned), unit_ppo.py under ZeRO-2 (policy and critic, frozen reference and unit RM): straight
    vs stopped after K steps and resumed, every metric row and the final weights (and critic) bit for bit, the ranks'
    weights identical. (The other pairing, unit_rm@zero2 and unit_ppo@zero3, runs the same way; not in the suite, for
    time.)"""
    from conftest import assert_clean_exit

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
           "--num_processes", "2", "tests/resume_runs.py", str(tmp_path), "unit_rm@zero3", "unit_ppo@zero2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert_clean_exit(proc.stdout + proc.stderr, " ".join(cmd))
    results = json.loads((tmp_path / "results.json").read_text())
    for case, r in results.items():
        assert r["rows_equal"], (case, r["first_diff"])
        assert r["weights_equal"] and r["finished"] and r["stopped_at"] >= 2 and r["rows_at_stop"] < r["n_rows"][1], case
        assert r["last_row"]["check/world_size"] == 2.0 and r["last_row"]["check/ranks_identical_weights"] == 1.0, case
    assert results["unit_ppo@zero2"]["weights"] == ["critic", "final"]
    norm = json.loads((tmp_path / "unit_rm@zero3" / "b" / "final" / "unit_normalizer.json").read_text())
    assert norm == json.loads((tmp_path / "unit_rm@zero3" / "a" / "final" / "unit_normalizer.json").read_text())
