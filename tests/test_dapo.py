"""dapo.py: DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2) in its own file.

Pure functions against hand-computed numbers and against grpo.py's (the losses and advantages dapo.py keeps are
grpo.py's on its default path), bad flags, and end-to-end runs: the batch is refilled, a batch that cannot be
filled trains on what it has, and two ranks pool their groups."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from algorithms import dapo, grpo
from conftest import assert_clean_exit

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--dev_num_prompts", "8", "--total_episodes", "32", "--local_num_prompts", "4", "--num_generations", "4",
            "--local_micro_batch_size", "8", "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "0",
            "--sample_every", "1", "--generator", "hf"]  # 2 steps, no evaluation


def test_informative_groups_keep_a_spread_of_rewards():
    # all wrong, all right, 1 of 4 right, all equal non-binary, two distinct non-binary values
    r = torch.tensor([[0.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0], [0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.7, 0.3]])
    assert dapo.informative_groups(r).tolist() == [False, False, True, False, True]
    # the dropped groups are exactly those with zero advantage (0.1 * 4 / 4 may round, so the test is on max > min)
    adv = dapo.compute_advantages(r, "group")
    assert ((adv.abs().amax(1) > 1e-6) == dapo.informative_groups(r)).all()


def test_fill_batch_keeps_the_first_informative_groups_then_fills_with_dropped_ones():
    g = lambda i: (i, [f"c{i}a", f"c{i}b"], [f"t{i}a", f"t{i}b"], [float(i), 0.0])  # noqa: E731  (i, comps, texts, r)
    kept, dropped = [g(0), g(1), g(2)], [g(7), g(8)]
    # 4 prompts on 2 ranks of 2: 3 informative groups, one dropped group (7) fills the last place and gets no loss
    assert dapo.fill_batch(kept, dropped, 4, 0, 2) == (3, [True] * 4, [0, 1], ["c0a", "c0b", "c1a", "c1b"],
                                                       ["t0a", "t0b", "t1a", "t1b"], [0.0, 0.0, 1.0, 0.0])
    assert dapo.fill_batch(kept, dropped, 4, 1, 2)[:3] == (3, [True, True, False, False], [2, 7])
    # more informative groups than places: the surplus is discarded, no filler
    assert dapo.fill_batch(kept + [g(3), g(4)], dropped, 4, 1, 2)[:3] == (4, [True] * 4, [2, 3])


def test_advantages_hand_computed_and_equal_to_grpos():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected, as TRL's nanstd
    torch.testing.assert_close(dapo.compute_advantages(r, "group")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    for scaling in ("group", "batch", "none"):
        torch.testing.assert_close(dapo.compute_advantages(r, scaling), grpo.compute_advantages(r, scaling))


def test_clipped_surrogate_is_grpos_token_level_one():
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    adv, mask = torch.randn(3, 5, generator=g), (torch.rand(3, 5, generator=g) > 0.3).float()
    for a, b in zip(dapo.clipped_surrogate(logp, old, adv, 0.2, 0.28, mask),
                    grpo.clipped_surrogate(logp, old, adv, 0.2, 0.28, mask, "token")):
        torch.testing.assert_close(a, b)
    # hand-computed: ratio 1.5 with A = +1 is clipped at 1.28; ratio 0.5 with A = -1 at 0.8
    loss, clipped, _ = dapo.clipped_surrogate(torch.log(torch.tensor([[1.5, 0.5]])), torch.zeros(1, 2),
                                              torch.tensor([[1.0, -1.0]]), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8]]))
    assert clipped.tolist() == [[1.0, 1.0]]


def test_overlong_penalty_hand_computed_and_as_verls():
    """DAPO's soft overlong punishment (§3.4, Eq. 13) with L_max = max_new_tokens = 16 and L_cache = 4: 0 up to 12
    tokens, then -(|y| - 12) / 4, -1 at 16; verl's DAPO reward manager computes it as below (penalty_factor 1)."""
    lengths = torch.tensor([3, 12, 13, 14, 16])
    got = dapo.overlong_penalty(lengths, 16, 4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))

    def verl(valid_response_length, max_resp_len=16, overlong_buffer_len=4, overlong_penalty_factor=1.0):
        expected_len = max_resp_len - overlong_buffer_len  # verl/workers/reward_manager/dapo.py
        exceed_len = valid_response_length - expected_len
        return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)

    assert got.tolist() == [verl(n) for n in lengths.tolist()]
    # an all-wrong group of different lengths stays uninformative: the filter reads the rewards before the penalty
    assert not dapo.informative_groups(torch.zeros(1, 5)).item()
    assert dapo.informative_groups(torch.zeros(1, 5) + got).item()  # (on shaped rewards it would be kept)


@pytest.mark.parametrize("argv, message", [
    (["--max_refill_rounds", "-1"], "error: max_refill_rounds: must be in [0, inf), got -1\n"),
    (["--num_generations", "1"], "error: num_generations: GRPO needs at least 2 completions per prompt"),
    (["--overlong_buffer_len", "-2"], "error: overlong_buffer_len: must be in [0, inf), got -2\n"),
    (["--advantage_estimator", "maxrl", "--overlong_buffer_len", "4"], "error: advantage_estimator: maxrl needs rewards"),
])
def test_bad_flags_exit_2_before_anything_is_written(argv, message, tmp_path, monkeypatch, capsys):
    from shared.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["dapo.py", *argv, "--output_dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as e:
        run_cli(dapo.main, dapo.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def run(cmd: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    assert_clean_exit(out, " ".join(cmd))
    return out


def metrics(out_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _sampling_counts_add_up(r: dict, num_prompts: int) -> None:
    sampled = num_prompts * (r["dynamic_sampling/extra_rounds"] + 1)  # groups sampled in the step
    kept = num_prompts - r["dynamic_sampling/unfilled_groups"]  # groups trained on
    assert r["dynamic_sampling/dropped_groups"] + kept + r["dynamic_sampling/surplus_groups"] == sampled
    assert r["val/frac_reward_zero_std"] == pytest.approx(r["dynamic_sampling/dropped_groups"] / sampled)


@pytest.mark.slow
def test_dynamic_sampling_refills_the_batch(tmp_path):
    """The SFT warm start solves some prompts of the built-in task: dynamic sampling drops the all-equal groups,
    samples extra rounds when needed, and its counts add up (with the soft overlong penalty on the last 8 of the 16
    tokens: it shapes the trained rewards, not the filter, so the counts are the filter's)."""
    run([sys.executable, "algorithms/dapo.py", "--output_dir", str(tmp_path), *TINY_RUN, "--max_refill_rounds", "3",
         "--overlong_buffer_len", "8"])
    steps = [r for r in metrics(tmp_path) if "loss/policy_avg" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 <= r["dynamic_sampling/extra_rounds"] <= 3
        _sampling_counts_add_up(r, 4)
        assert math.isfinite(r["loss/policy_avg"]) and math.isfinite(r["optim/grad_norm"])
    assert any(r["dynamic_sampling/unfilled_groups"] < 4 for r in steps)  # it trained on informative groups


@pytest.mark.slow
def test_dynamic_sampling_that_cannot_fill_trains_on_what_it_has(tmp_path):
    """A reward that is always 0: no group is informative, every round is used, the shortfall is logged and printed
    once, and the run finishes (the filler groups are masked out of the loss)."""
    reward = tmp_path / "zero.py"
    reward.write_text("def zero(completions, **kw):\n    return [0.0 for _ in completions]\n")
    out = run([sys.executable, "algorithms/dapo.py", "--output_dir", str(tmp_path / "run"), *TINY_RUN,
               "--reward_fn", f"{reward}:zero", "--max_refill_rounds", "1"])
    steps = [r for r in metrics(tmp_path / "run") if "loss/policy_avg" in r]
    assert [r["dynamic_sampling/unfilled_groups"] for r in steps] == [4, 4]
    assert [r["dynamic_sampling/extra_rounds"] for r in steps] == [1, 1]
    for r in steps:
        _sampling_counts_add_up(r, 4)
        assert r["loss/policy_avg"] == 0.0 and r["val/advantages_std"] == 0.0
    assert out.count("dynamic sampling: 0 of 4 groups informative after 1 extra rounds") == 1


@pytest.mark.slow
def test_dynamic_sampling_two_processes(tmp_path):
    """2 ranks pool their groups (global prompt order) and take their slices of the refilled batch: they end with
    identical weights and trained on disjoint prompts."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         "algorithms/dapo.py", "--output_dir", str(tmp_path), *TINY_RUN, "--total_episodes", "64"], timeout=900)
    rows = metrics(tmp_path)
    for r in [r for r in rows if "loss/policy_avg" in r]:
        _sampling_counts_add_up(r, 8)
    assert rows[-1]["check/world_size"] == 2.0
    assert rows[-1]["check/ranks_identical_weights"] == 1.0 and rows[-1]["check/ranks_shared_prompts"] == 0.0
