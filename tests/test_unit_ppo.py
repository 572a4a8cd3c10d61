"""Unit tests of unit_ppo.py (docs/unit_ppo.md): each reward placement's sums, the location-aware normalisation, the
normaliser checks, the segmentation shared with unit_rm.py, and a 2-step run with its bad-input errors."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import algorithms.unit_rm as unit_rm
from algorithms.unit_ppo import load_normalizer, peak_unit_ends, place_unit_rewards, position_normalize

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


def test_two_steps_run_and_another_tau_is_one_line(unit_rm_dir, tmp_path):
    out = tmp_path / "ppo"
    small = ["--total_episodes", "32", "--local_num_prompts", "4", "--num_generations", "4",
             "--local_micro_batch_size", "8", "--eval_num_prompts", "4", "--eval_num_samples", "1",
             "--dev_num_prompts", "0", "--best_metric", "", "--generator", "hf", "--save_every", "0",
             "--no_save_model", "--reward_model_path", str(unit_rm_dir)]
    proc = _run([*small, "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "objective/units" in r]
    assert len(steps) == 2 and all(r["objective/units"] >= 1 and math.isfinite(r["objective/scores"]) for r in steps)
    proc = _run([*small, "--tau", "1.0", "--output_dir", str(tmp_path / "bad")])
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: tau: the reward model's normaliser")
    assert not (tmp_path / "bad").exists()
