"""End-to-end runs of the scripts exactly as users launch them (style.md S11), on the built-in tiny model.

Covers: sft.py, grpo.py with vLLM and with HF generation, the optional branches (KL to a reference,
num_iterations > 1, several minibatches, truncation masking), a learning check, and 2-process
`accelerate launch` runs under ZeRO-2 and ZeRO-3 whose ranks must end with identical weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--total_episodes", "64", "--local_num_prompts", "4", "--num_generations", "4", "--local_micro_batch_size",
         "8", "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "1"]


def run(cmd: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_and_saves_a_loadable_checkpoint(tmp_path):
    run([sys.executable, "algorithms/sft.py", "--output_dir", str(tmp_path), "--total_episodes", "512",
         "--local_micro_batch_size", "32", "--eval_num_prompts", "8", "--eval_every", "8"])
    rows = metrics(tmp_path)
    losses = [r["loss/sft"] for r in rows if "loss/sft" in r]
    assert losses[-1] < losses[0]
    assert any("eval/accuracy" in r for r in rows)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert model.config.num_hidden_layers == 3


@pytest.mark.parametrize("generator", ["vllm", "hf"])
def test_grpo_runs_every_branch(tmp_path, generator):
    run([sys.executable, "algorithms/grpo.py", "--generator", generator, "--output_dir", str(tmp_path),
         "--model_name_or_path", "builtin:tiny", *SMALL, "--beta", "0.05", "--num_iterations", "2",
         "--num_minibatches", "2", "--mask_truncated_completions", "--loss_aggregation", "seq_mean"])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "objective/scores" in r]
    assert len(steps) == 64 // 16
    for key in ("objective/kl", "objective/entropy", "policy/clipfrac_avg", "val/ratio", "val/frac_reward_zero_std",
                "val/stop_rate", "val/sequence_lengths", "time/generate", "time/logprob", "time/train", "time/sync",
                "optim/grad_norm", "val/sampler_logprob_diff"):
        assert all(key in r and r[key] is not None for r in steps), key
    assert steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-3)  # policy == reference before the first update
    assert abs(steps[0]["val/sampler_logprob_diff"]) < 1e-3  # trainer and sampler agree (same weights, same T)
    assert "eval/accuracy" in rows[-1] and rows[-1]["check/ranks_identical_weights"] == 1.0
    assert (tmp_path / "final" / "config.json").exists() and (tmp_path / "samples.jsonl").read_text()


def test_grpo_learns_a_simple_reward(tmp_path):
    """From the built-in warm start (built on first use by sft.py), GRPO must raise a clean reward within 30 steps."""
    reward = tmp_path / "reward.py"
    reward.write_text("def starts_with_one(prompts, completions, **kw):\n"
                      "    return [float(c.startswith('1')) for c in completions]\n")
    out_dir = tmp_path / "run"
    run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out_dir), "--reward_fn",
         f"{reward}:starts_with_one", "--total_episodes", "3840", "--local_num_prompts", "16",
         "--local_micro_batch_size", "64", "--eval_every", "0", "--eval_num_prompts", "16", "--no_save_model"])
    scores = [r["objective/scores"] for r in metrics(out_dir) if "objective/scores" in r]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.2, scores


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_two_processes_deepspeed(tmp_path, stage):
    """accelerate launch, 2 CPU processes, a vLLM engine per rank: ranks see different prompts, end identical."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"scripts/accelerate/zero{stage}.yaml",
         "algorithms/grpo.py", "--output_dir", str(tmp_path), "--model_name_or_path", "builtin:tiny", *SMALL,
         "--total_episodes", "96", "--beta", "0.05"], timeout=900)
    last = metrics(tmp_path)[-1]
    assert last["check/world_size"] == 2.0
    assert last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


PPO_SMALL = ["--model_name_or_path", "builtin:tiny", "--total_episodes", "64", "--local_num_prompts", "4",
             "--num_samples_per_prompt", "4", "--local_micro_batch_size", "8", "--max_new_tokens", "8",
             "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "1"]


def test_ppo_reward_model_flavour(tmp_path):
    """Flavour B: a reward model (here the tiny model with a fresh scalar head) scores completions, KL in the
    reward, adaptive KL, non-EOS penalty; the held-out metric is still the task grader."""
    from shared.scalar import load_scalar_model
    from shared.tiny import builtin_tiny

    import torch

    rm_dir = tmp_path / "rm"
    rm = load_scalar_model(str(builtin_tiny()), torch.float32)
    rm.save_pretrained(rm_dir)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(builtin_tiny()).save_pretrained(rm_dir)
    out = tmp_path / "run"
    run([sys.executable, "algorithms/ppo.py", "--output_dir", str(out), *PPO_SMALL, "--reward_model_path",
         str(rm_dir), "--kl_placement", "reward", "--kl_coef", "0.05", "--adaptive_kl", "--non_stop_penalty",
         "--lam", "0.95", "--generator", "hf"])
    steps = [r for r in metrics(out) if "loss/value_avg" in r]
    assert len(steps) == 4 and steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert steps[-1]["objective/kl_coef"] != 0.05  # the adaptive controller moved beta
    assert "eval/accuracy" in metrics(out)[-1]


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_single_process(tmp_path, script):
    run([sys.executable, f"algorithms/{script}.py", "--output_dir", str(tmp_path), *PPO_SMALL])
    steps = [r for r in metrics(tmp_path) if "objective/scores" in r]
    assert len(steps) == 4
    for key in ("policy/clipfrac_avg", "val/ratio", "objective/kl", "time/generate", "time/train", "time/sync"):
        assert all(key in r for r in steps), key
    if script == "vineppo":
        for key in ("mc_values/mean", "val/unique_state_frac", "val/steps_per_response", "time/value_estimation"):
            assert all(key in r for r in steps), key
        assert all(r["val/unique_state_frac"] <= 1.0 for r in steps)
    else:
        assert all("val/explained_variance" in r and "loss/value_avg" in r for r in steps)
    assert metrics(tmp_path)[-1]["check/ranks_identical_weights"] == 1.0


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_two_processes_zero2(tmp_path, script):
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         f"algorithms/{script}.py", "--output_dir", str(tmp_path), *PPO_SMALL, "--total_episodes", "96"], timeout=900)
    last = metrics(tmp_path)[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0
