"""End-to-end runs of the scripts exactly as users launch them, on the built-in tiny model.

Covers: sft.py; grpo.py with vLLM and with HF generation, the optional branches (KL to a reference,
num_iterations > 1, several minibatches, truncation masking), a learning check, and each variant flag (GSPO, CISPO,
RLOO, REINFORCE++-baseline, DPPO, MaxRL, the entropy bonus, the geometric mismatch mask); ppo.py and vineppo.py (dapo.py: tests/test_dapo.py); rm.py and
its checkpoint as the reward of grpo.py, ppo.py and drca.py; dpo.py; and 2-process `accelerate launch` runs under
ZeRO-2 and ZeRO-3 whose ranks must end with identical weights."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_clean_exit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--dev_num_prompts", "8",  # a small dev slice (selects best/) keeps the runs short
         "--total_episodes", "64", "--local_num_prompts", "4", "--num_generations", "4", "--local_micro_batch_size",
         "8", "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "1"]


def run(cmd: list[str], timeout: int = 600) -> str:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    assert_clean_exit(out, " ".join(cmd))
    return out


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def batch_main(plan_file: str) -> None:
    """The child process of `run_batch`: each planned command line `[script.py, *flags]` runs in turn as
    `python script.py *flags` would run it (runpy, `__name__ == "__main__"`, sys.argv, the script's folder first on
    sys.path), its stdout and stderr (file descriptors 1 and 2, so C-level output too) in its own log; the exit status
    (SystemExit's code, 1 after an uncaught exception, whose traceback goes to the log) is written to the results file
    after each run, so a run that kills the process leaves the earlier results."""
    import runpy
    import traceback

    plan = json.loads(Path(plan_file).read_text())
    results = {}
    for item in plan["runs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        log = os.open(item["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 0
        try:
            sys.argv = list(item["argv"])
            sys.path[0] = str(Path(item["argv"][0]).resolve().parent)
            runpy.run_path(item["argv"][0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:  # noqa: BLE001 - recorded as the run's failure, with its traceback in its log
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (log, *saved):
                os.close(fd)
        results[item["name"]] = code
        Path(plan["results"]).write_text(json.dumps(results))


def run_batch(runs: dict[str, list[str]], work: Path, env: dict | None = None, timeout: int = 1800) -> dict:
    """Run several script command lines (name -> [script.py, *flags]) one after another in ONE Python process
    (`batch_main`), so torch, transformers and vLLM are imported once for all of them instead of once per run.
    Returns name -> {"code": exit status (None: the process died before it), "log": the run's own output, "batch":
    the process's own output and exit status}; `check_batch_run` asserts on one entry as `run` does on a subprocess."""
    work.mkdir(parents=True, exist_ok=True)
    plan = {"runs": [{"name": n, "argv": [str(a) for a in argv], "log": str(work / f"{n}.log")}
                     for n, argv in runs.items()], "results": str(work / "results.json")}
    (work / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", "import sys; from tests.test_e2e import batch_main; "
                           "batch_main(sys.argv[1])", str(work / "plan.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    batch = f"(batch process exit status {proc.returncode})\n{proc.stdout + proc.stderr}"
    done = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else {}
    return {n: {"code": done.get(n), "log": (work / f"{n}.log").read_text() if (work / f"{n}.log").exists() else "",
                "batch": batch, "batch_code": proc.returncode, "cmd": " ".join(str(a) for a in argv)}
            for n, argv in runs.items()}


def check_batch_run(result: dict) -> str:
    """As `run` for a subprocess: exit status 0 and a clean exit (the run's log and the batch process's own output,
    which holds any exit-time failure); returns the run's log."""
    out = result["log"]
    assert result["code"] == 0, f"{result['cmd']} failed ({result['code']}):\n{out[-6000:]}\n{result['batch'][-3000:]}"
    assert result["batch_code"] == 0, f"the batch process of {result['cmd']} failed:\n{result['batch'][-6000:]}"
    assert_clean_exit(out + result["batch"], result["cmd"])
    return out


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
    # trained with gradient checkpointing (the default), saved for generation: the KV cache stays on
    assert json.loads((tmp_path / "final" / "config.json").read_text()).get("use_cache", True) is True


def test_sft_two_ranks_equal_one_rank_with_gradient_accumulation(tmp_path):
    """token_mean over the whole step: 2 ranks x 1 micro-batch trains like 1 rank x 2 accumulated micro-batches (the
    same global batch: the sampler's indices are split by rank, or by micro-batch), so the loss and weights match."""
    common = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--loss_reduction", "token_mean",
              "--learning_rate", "1e-5", "--eval_num_prompts", "2", "--eval_every", "0", "--save_every", "0", "--best_metric", ""]
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         "algorithms/sft.py", "--output_dir", str(tmp_path / "two"), *common], timeout=900)
    run([sys.executable, "algorithms/sft.py", "--output_dir", str(tmp_path / "one"), *common,
         "--gradient_accumulation_steps", "2"])
    two = [r["loss/sft"] for r in metrics(tmp_path / "two") if "loss/sft" in r]
    one = [r["loss/sft"] for r in metrics(tmp_path / "one") if "loss/sft" in r]
    assert len(two) == len(one) == 1 and two[0] == pytest.approx(one[0], rel=1e-5)
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "two" / "final" / "model.safetensors"), load_file(tmp_path / "one" / "final" /
                                                                                 "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


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
    """From the built-in warm start (builtin:tiny-sft, committed weights), GRPO must raise a clean reward within 20 steps."""
    reward = tmp_path / "reward.py"
    reward.write_text("def starts_with_one(prompts, completions, **kw):\n"
                      "    return [float(c.startswith('1')) for c in completions]\n")
    out_dir = tmp_path / "run"
    run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out_dir), "--reward_fn",
         f"{reward}:starts_with_one", "--total_episodes", "2560", "--local_num_prompts", "16",
         "--local_micro_batch_size", "64", "--eval_every", "0", "--eval_num_prompts", "16", "--no_save_model"])
    scores = [r["objective/scores"] for r in metrics(out_dir) if "objective/scores" in r]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.2, scores


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_two_processes_deepspeed(tmp_path, stage):
    """accelerate launch, 2 CPU processes, a vLLM engine per rank: ranks see different prompts, end identical."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"scripts/accelerate/zero{stage}.yaml",
         "algorithms/grpo.py", "--output_dir", str(tmp_path), "--model_name_or_path", "builtin:tiny", *SMALL,
         "--total_episodes", "64", "--eval_every", "0", "--beta", "0.05"], timeout=900)  # 2 steps
    last = metrics(tmp_path)[-1]
    assert last["check/world_size"] == 2.0
    assert last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


# ---------------------------------------------------------------- grpo.py's variant flags (docs/grpo.md, Variants)
TINY_RUN = [*SMALL, "--generator", "hf", "--total_episodes", "32", "--eval_every", "0"]  # 2 steps, no evaluation
VARIANTS = {
    "gspo": ["--importance_level", "sequence", "--epsilon_low", "3e-4", "--epsilon_high", "4e-4",
             "--loss_aggregation", "seq_mean"],
    "cispo": ["--policy_loss", "cispo", "--epsilon_high", "4"],
    "rloo": ["--advantage_estimator", "rloo"],
    "reinforce_pp_baseline": ["--advantage_estimator", "reinforce_pp_baseline", "--mask_truncated_completions"],
    "dppo_tv": ["--policy_loss", "dppo_tv"],
    "sapo_offpolicy_mask_unbiased_kl": ["--policy_loss", "sapo", "--off_policy_mask_threshold", "0", "--beta", "0.01",
                                        "--use_bias_correction_kl"],
    "dppo_kl_maxrl_entropy_geo": ["--policy_loss", "dppo_kl", "--advantage_estimator", "maxrl", "--entropy_coef", "0.01",
                                  "--tis", "geometric_mask", "--tis_cap", "1.001"],
}


@pytest.mark.parametrize("name", VARIANTS)
def test_grpo_variant_trains_end_to_end(tmp_path, name):
    """Two steps of each variant (default 2 iterations x 2 minibatches, so the ratio moves off 1): finite losses and
    gradients, a saved policy."""
    run([sys.executable, "algorithms/grpo.py", "--output_dir", str(tmp_path), *TINY_RUN, *VARIANTS[name]])
    steps = [r for r in metrics(tmp_path) if "loss/policy_avg" in r]
    assert len(steps) == 2
    for key in ("loss/policy_avg", "optim/grad_norm", "val/ratio", "val/advantages_mean", "policy/clipfrac_avg",
                "objective/entropy", "val/sampler_kl", "val/tis_ratio_p99", "val/tis_seq_clipfrac"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert (tmp_path / "final" / "config.json").exists()


PPO_SMALL = ["--dev_num_prompts", "8",  # a small dev slice (selects best/) keeps the runs short
              # a small dev slice (selects best/) keeps the runs short
         "--model_name_or_path", "builtin:tiny", "--total_episodes", "64", "--local_num_prompts", "4",
             "--num_generations", "4", "--local_micro_batch_size", "8", "--max_new_tokens", "8",
             "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "1"]


def test_ppo_rlhf_with_adaptive_kl_and_the_non_eos_penalty(tmp_path):
    """ppo_rlhf.py: a reward model (here the tiny model with a fresh scalar head) scores completions, KL in the
    reward (its default), adaptive KL, non-EOS penalty; the held-out accuracy is still the task grader's."""
    from shared.scalar import load_scalar_model
    from shared.tiny import builtin_tiny

    import torch

    rm_dir = tmp_path / "rm"
    rm = load_scalar_model(str(builtin_tiny()), torch.float32)
    rm.save_pretrained(rm_dir)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(builtin_tiny()).save_pretrained(rm_dir)
    out = tmp_path / "run"
    run([sys.executable, "algorithms/ppo_rlhf.py", "--output_dir", str(out), *PPO_SMALL, "--reward_model_path",
         str(rm_dir), "--adaptive_kl", "--non_stop_penalty", "--generator", "hf"])
    steps = [r for r in metrics(out) if "loss/value_avg" in r]
    assert len(steps) == 4 and steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert steps[-1]["objective/kl_coef"] != 0.05  # the adaptive controller moved beta
    assert "eval/accuracy" in metrics(out)[-1]


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_single_process(tmp_path, script):
    """ppo.py with an entropy bonus and the token mask on [0.5, 5] (IcePop's form), vineppo.py with the geometric
    mask: the flags every script that samples with vLLM shares (tests/test_mismatch.py has their numbers)."""
    extra = (["--entropy_coef", "0.01", "--tis", "token_mask", "--tis_cap", "5", "--tis_mask_low", "0.5"]
             if script == "ppo" else ["--tis", "geometric_mask", "--tis_cap", "1.001"])
    run([sys.executable, f"algorithms/{script}.py", "--output_dir", str(tmp_path), *PPO_SMALL, *extra])
    steps = [r for r in metrics(tmp_path) if "objective/scores" in r]
    assert len(steps) == 4
    for key in ("policy/clipfrac_avg", "val/ratio", "objective/kl", "time/generate", "time/train", "time/sync",
                "objective/entropy", "val/sampler_kl", "val/tis_ratio_p99", "val/tis_seq_clipfrac"):
        assert all(key in r for r in steps), key
    if script == "vineppo":
        for key in ("mc_values/mean", "val/unique_state_frac", "val/steps_per_response", "time/value_estimation"):
            assert all(key in r for r in steps), key
        assert all(r["val/unique_state_frac"] <= 1.0 for r in steps)
    else:
        assert all("val/explained_variance" in r and "loss/value_avg" in r for r in steps)
    assert metrics(tmp_path)[-1]["check/ranks_identical_weights"] == 1.0


def test_vineppo_hf_generation_under_zero3_two_processes(tmp_path):
    """The HF backend under ZeRO-3 needs the same generate calls on every rank (each forward gathers shards): VinePPO's
    MC rollouts have per-state budgets that differ between ranks (one call per budget: different counts, a hang), and
    one held-out prompt leaves rank 1 with none (a crash). Both must now run to the end."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
         "algorithms/vineppo.py", "--output_dir", str(tmp_path), *PPO_SMALL, "--total_episodes", "64",
         "--generator", "hf", "--eval_num_prompts", "1", "--no_save_model"], timeout=400)
    rows = metrics(tmp_path)
    assert rows[-1]["check/ranks_identical_weights"] == 1.0 and "eval/accuracy" in rows[-1]
    assert len([r for r in rows if "mc_values/mean" in r]) == 2


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_two_processes_zero2(tmp_path, script):
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         f"algorithms/{script}.py", "--output_dir", str(tmp_path), *PPO_SMALL, "--total_episodes", "64", "--eval_every",
         "0"], timeout=900)  # 2 steps
    last = metrics(tmp_path)[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


# ---------------------------------------------------------------- reward model and DPO
@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A reward model trained by rm.py on the built-in pairs (short run), as later RL runs use it."""
    out = tmp_path_factory.mktemp("rm")
    run([sys.executable, "algorithms/rm.py", "--output_dir", str(out), "--total_episodes", "1280",
         "--local_micro_batch_size", "32", "--eval_num_pairs", "64", "--eval_every", "20"])
    return out


def test_rm_uneven_held_out_pairs_under_zero3(tmp_path):
    """33 held-out pairs on 2 ranks with micro-batches of 16: 17 pairs (2 forwards) vs 16 (1 forward). Under ZeRO-3
    every forward gathers shards from all ranks, so the evaluation hung; now the short rank runs a dummy forward."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
         "algorithms/rm.py", "--output_dir", str(tmp_path), "--total_episodes", "64", "--local_micro_batch_size", "16",
         "--eval_num_pairs", "33", "--eval_every", "0", "--save_every", "0"], timeout=400)
    evals = [r for r in metrics(tmp_path) if "eval/accuracy" in r]
    assert len(evals) == 2 and metrics(tmp_path)[-1]["check/ranks_identical_weights"] == 1.0


def test_rm_saves_a_normalised_sequence_classifier(trained_rm):
    rows = metrics(trained_rm)
    for key in ("loss/rm", "rm/accuracy", "rm/margin", "rm/chosen", "rm/rejected", "optim/grad_norm"):
        assert any(key in r for r in rows), key
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 3 and all(k in evals[-1] for k in ("eval/margin", "eval/loss", "eval/reward_std"))
    import torch
    from transformers import AutoModelForSequenceClassification

    from shared import data
    from shared.distributed import load_tokenizer
    from shared.scalar import score_last_token

    model = AutoModelForSequenceClassification.from_pretrained(trained_rm / "final").eval()
    assert model.config.reward_mean == pytest.approx(evals[-1]["eval/reward_mean"])
    tok = load_tokenizer(str(trained_rm / "final"))
    pairs = data.load_preferences("builtin", "test", tok, limit=64)
    ids, attn, _ = data.pad_batch(pairs.prompt_ids * 2, pairs.chosen_ids + pairs.rejected_ids, tok.pad_token_id)
    with torch.no_grad():
        scores = score_last_token(model, ids, attn).double()  # normalised with the stored stats
    assert abs(scores.mean().item()) < 1e-3 and scores.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)
    acc = (scores[:64] > scores[64:]).double().mean().item()
    assert acc == pytest.approx(evals[-1]["eval/accuracy"], abs=1e-9)  # same pairs, same scores as rm.py's eval


def test_rm_trained_by_rm_py_is_the_reward_of_grpo(trained_rm, tmp_path):
    """The rm.py checkpoint, passed as --reward_model_path, scores GRPO's completions end to end."""
    run([sys.executable, "algorithms/grpo.py", "--output_dir", str(tmp_path), "--reward_model_path",
         str(trained_rm / "final"), *SMALL, "--generator", "hf"])
    steps = [r for r in metrics(tmp_path) if "objective/scores" in r]
    assert len(steps) == 4
    assert all(r["objective/scores"] != int(r["objective/scores"]) for r in steps)  # real-valued RM scores, not 0/1
    assert "eval/accuracy" in metrics(tmp_path)[-1]  # held-out accuracy still from the grader
    assert math.isfinite(metrics(tmp_path)[-1]["eval/reward"])  # and the reward model's held-out score


def _strip_answers(rows: list[dict], out: Path) -> None:
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("answer", "response")}) + "\n"
                           for r in rows))


@pytest.mark.parametrize("script", ["grpo", "ppo_rlhf", "drca"])
def test_a_reward_model_task_needs_no_gold_answers(trained_rm, tmp_path, script):
    """Prompts without an answer column train on the reward model; no accuracy is reported, the held-out and
    dev reward are, and best/ is selected on dev/reward."""
    from shared import task

    _strip_answers(task.builtin_split("train")[:200], tmp_path / "p.train.jsonl")
    _strip_answers(task.builtin_split("test")[:8], tmp_path / "p.test.jsonl")
    flags = {"grpo": SMALL, "ppo_rlhf": PPO_SMALL, "drca": DRCA_SMALL}[script]
    out = tmp_path / "run"
    log = run([sys.executable, f"algorithms/{script}.py", "--output_dir", str(out), *flags, "--generator", "hf",
               "--dataset", str(tmp_path / "p.jsonl"), "--reward_model_path", str(trained_rm / "final")])
    rows = metrics(out)
    evals = [r for r in rows if "eval/reward" in r]
    assert evals and all("eval/accuracy" not in r and "dev/accuracy" not in r for r in rows)
    assert all(math.isfinite(r["dev/reward"]) for r in evals)
    assert json.loads((out / "best" / "best.json").read_text())["metric"] == "dev/reward"
    assert "held-out reward" in log


def test_rm_trained_by_rm_py_is_the_reward_of_ppo_rlhf(trained_rm, tmp_path):
    run([sys.executable, "algorithms/ppo_rlhf.py", "--output_dir", str(tmp_path), *PPO_SMALL, "--reward_model_path",
         str(trained_rm / "final"), "--generator", "hf"])
    steps = [r for r in metrics(tmp_path) if "loss/value_avg" in r]
    assert len(steps) == 4 and all(math.isfinite(r["objective/scores"]) for r in steps)
    assert all(math.isfinite(r["eval/reward"]) for r in metrics(tmp_path) if "eval/accuracy" in r)


DRCA_SMALL = ["--scorer", "rm",  # the RM scores (the built-in task's default, --scorer auto, is the per-line grader)
              "--dev_num_prompts", "8", "--localisation_num_pairs", "12",  # small dev and slip sets: short runs
               "--total_episodes", "64", "--local_num_prompts", "4", "--num_generations", "4",
              "--local_micro_batch_size", "8", "--max_new_tokens", "8", "--eval_num_prompts", "8",
              "--eval_num_samples", "2", "--eval_every", "2", "--sample_every", "1"]


@pytest.mark.parametrize("generator,extra", [
    ("vllm", ["--lora_r", "4", "--tis", "token_mask", "--kl_placement", "loss", "--adaptive_kl"]),  # ppo_rlhf.py's
    ("hf", ["--unit_extraction", "entropy", "--unit_entropy_threshold", "0.5", "--counterfactual", "mask",
            "--entropy_source", "reference", "--unitless_fallback", "zeros"]),
])
def test_drca_with_the_rm_trained_by_rm_py(trained_rm, tmp_path, generator, extra):
    """Units found, one RM call per unit on top of one per response, the reward identity holds, and the held-out
    metrics are the grader's accuracy and the RM's mean score; with the features drca.py shares with ppo_rlhf.py
    (LoRA, TIS, the KL as a loss term, the adaptive KL coefficient) the same, plus their effects."""
    run([sys.executable, "algorithms/drca.py", "--output_dir", str(tmp_path), "--reward_model_path",
         str(trained_rm / "final"), *DRCA_SMALL, "--generator", generator, *extra])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "loss/value_avg" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["drca/units_per_seq"] > 0 and r["drca/credit_std"] > 0
        assert r["drca/rm_calls"] == pytest.approx(16 * (1 + r["drca/units_per_seq"]))
        assert r["drca/sum_identity_err"] < 1e-4
        assert math.isfinite(r["loss/policy_avg"]) and math.isfinite(r["val/explained_variance"])
    assert steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    evals = [r for r in rows if "eval/reward" in r]
    assert len(evals) == 3 and all("eval/accuracy" in r for r in evals)
    for r in evals:  # slips of held-out built-in pairs located by the credits, against a random unit
        assert 0 <= r["eval/localisation"] <= 1 and 0 < r["eval/localisation_chance"] <= 1
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(len(x["units"]) == len(x["credits"]) for x in samples) and any(x["units"] for x in samples)
    assert rows[-1]["check/ranks_identical_weights"] == 1.0
    assert (tmp_path / "final" / "config.json").exists() and (tmp_path / "critic" / "config.json").exists()
    if "--lora_r" in extra:  # adapters exported with the merged models; k3 in the loss, none in the reward; beta adapts
        assert (tmp_path / "final" / "adapter").is_dir() and (tmp_path / "critic" / "adapter").is_dir()
        assert all(r["objective/non_score_reward"] == 0.0 and r["loss/kl_avg"] >= 0 for r in steps)
        assert steps[-1]["loss/kl_avg"] > 0 and steps[-1]["objective/kl_coef"] != steps[0]["objective/kl_coef"]
        assert all(0 < r["val/tis_weight"] <= 2.0 for r in steps)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_drca_line_grader_scorer_locates_every_slip(trained_rm, tmp_path, mode):
    """--scorer line_grader scores responses and counterfactuals with the per-line grader; through drca.py's
    own units, token blanking and decoding, the lowest credit is the slipped line on every held-out pair, in both
    modes; the training reward is the grader's score (at most 1, a correct response)."""
    run([sys.executable, "algorithms/drca.py", "--output_dir", str(tmp_path), "--reward_model_path",
         str(trained_rm / "final"), *DRCA_SMALL, "--generator", "hf", "--scorer", "line_grader", "--counterfactual",
         mode, "--total_episodes", "32", "--no_save_model"])
    rows = metrics(tmp_path)
    evals = [r for r in rows if "eval/localisation" in r]
    assert evals and all(r["eval/localisation"] == 1.0 for r in evals)
    steps = [r for r in rows if "loss/value_avg" in r]
    assert steps and all(-1.0 <= r["objective/scores"] <= 1.0 and r["drca/sum_identity_err"] < 1e-4 for r in steps)


def test_drca_beta_zero_is_ppo_without_unit_calls(trained_rm, tmp_path):
    run([sys.executable, "algorithms/drca.py", "--output_dir", str(tmp_path), "--reward_model_path",
         str(trained_rm / "final"), *DRCA_SMALL, "--generator", "hf", "--drca_beta", "0", "--no_save_model"])
    steps = [r for r in metrics(tmp_path) if "loss/value_avg" in r]
    assert all(r["drca/units_per_seq"] == 0 and r["drca/rm_calls"] == 16 for r in steps)


def test_drca_two_processes_zero2(trained_rm, tmp_path):
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml",
         "algorithms/drca.py", "--output_dir", str(tmp_path), "--reward_model_path", str(trained_rm / "final"),
         *DRCA_SMALL, "--no_save_model"], timeout=900)  # 2 steps
    rows = metrics(tmp_path)
    last = rows[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0
    steps = [r for r in rows if "loss/value_avg" in r]
    assert len(steps) == 2 and all(r["drca/rm_calls"] == pytest.approx(32 * (1 + r["drca/units_per_seq"]))
                                   for r in steps)


DPO_SMALL = ["--dev_num_prompts", "8",  # a small dev slice (selects best/) keeps the runs short
              # a small dev slice (selects best/) keeps the runs short
         "--total_episodes", "256", "--local_micro_batch_size", "32", "--eval_num_prompts", "16",
             "--eval_num_samples", "2", "--eval_num_pairs", "32", "--eval_every", "4"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_offline_pairs(tmp_path, loss_type):
    run([sys.executable, "algorithms/dpo.py", "--output_dir", str(tmp_path), *DPO_SMALL, "--loss_type", loss_type,
         "--generator", "hf" if loss_type == "ipo" else "vllm"])
    rows = metrics(tmp_path)
    first_eval = next(r for r in rows if "eval/loss/dpo" in r)
    if loss_type == "sigmoid":  # policy == reference before the first update: delta = 0 for every pair
        assert first_eval["eval/loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
    assert first_eval["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    steps = [r for r in rows if "loss/dpo" in r]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "time/train"):
        assert key in steps[-1], key
    assert steps[-1]["rewards/margins"] > 0  # the policy moved toward the chosen responses
    last = rows[-1]
    assert last["check/ranks_identical_weights"] == 1.0 and any("eval/accuracy" in r for r in rows[-3:])
    assert (tmp_path / "final" / "config.json").exists() and (tmp_path / "samples.jsonl").read_text()


def test_dpo_reference_logps_precomputed_equal_on_the_fly(tmp_path):
    """Same run with cached reference log-probs and with a frozen reference model: same losses."""
    common = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--eval_num_prompts", "0",
              "--eval_num_pairs", "16", "--no_save_model", "--loss_type", "dpop", "--logit_temperature", "0.6"]
    run([sys.executable, "algorithms/dpo.py", "--output_dir", str(tmp_path / "a"), *common])
    run([sys.executable, "algorithms/dpo.py", "--output_dir", str(tmp_path / "b"), *common, "--no_precompute_ref_logps"])
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    la, lb = [r for r in a if "loss/dpo" in r], [r for r in b if "loss/dpo" in r]
    assert la and len(la) == len(lb)
    for x, y in zip(la, lb):
        for key in ("loss/dpo", "rewards/chosen", "rewards/rejected", "dpop/penalty"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    ea, eb = [r for r in a if "eval/loss/dpo" in r], [r for r in b if "eval/loss/dpo" in r]
    assert ea[-1]["eval/loss/dpo"] == pytest.approx(eb[-1]["eval/loss/dpo"], rel=1e-4)


def test_dpo_self_generated_pairs(tmp_path):
    run([sys.executable, "algorithms/dpo.py", "--output_dir", str(tmp_path), "--pair_source", "self_generated",
         "--num_generation_prompts", "32", "--num_generations", "8", *DPO_SMALL, "--total_episodes", "128",
         "--loss_type", "dpop", "--logit_temperature", "0.6"])
    rows = metrics(tmp_path)
    info = rows[0]
    assert 0 < info["pairs/sample_accuracy"] < 1 and info["pairs/num_pairs"] == info["data/train_pairs"] > 0
    assert info["pairs/num_pairs"] <= 32 * 16  # at most 4 x 4 pairs per prompt with 8 samples
    assert any("loss/dpo" in r for r in rows)


def test_dpo_two_processes_zero3(tmp_path):
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
         "algorithms/dpo.py", "--output_dir", str(tmp_path), *DPO_SMALL, "--eval_num_pairs", "33"], timeout=900)
    last = metrics(tmp_path)[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


def test_dpo_on_pairs_without_gold_answers(tmp_path):
    """A plain prompt/chosen/rejected dataset runs with the default flags' evaluation: no task accuracy, the
    held-out and dev pairs' implicit-reward accuracy, best/ selected on the dev pairs."""
    from shared import task

    for split, n in (("train", 400), ("test", 40)):
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                for r in task.builtin_preferences(split)[:n]]
        (tmp_path / f"pairs.{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    log = run([sys.executable, "algorithms/dpo.py", "--output_dir", str(out), "--dataset",
               str(tmp_path / "pairs.jsonl"), "--total_episodes", "128", "--local_micro_batch_size", "32",
               "--eval_every", "2"])
    rows = metrics(out)
    assert not any("eval/accuracy" in r for r in rows)
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    assert len(evals) == 3 and all("dev/rewards/accuracies" in r for r in evals)
    assert json.loads((out / "best" / "best.json").read_text())["metric"] == "dev/rewards/accuracies"
    assert "no 'answer' column" in log


def test_optimizer_offload_from_an_accelerate_config_is_honoured(tmp_path):
    """#22: `offload_optimizer_device: cpu` in an accelerate config (exported as ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_
    DEVICE) was silently ignored; now it is DeepSpeed's ZeRO-Offload, and training matches the run without it."""
    common = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--eval_num_prompts", "4", "--eval_every",
              "0", "--save_every", "0", "--best_metric", ""]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    for name, offload in (("plain", "none"), ("offload", "cpu")):
        proc = subprocess.run([sys.executable, "algorithms/sft.py", "--output_dir", str(tmp_path / name), *common],
                              cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**env, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": offload})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the engine the scripts build (shared/distributed.py prepare) offloads under that environment, and only then
    probe = ("import torch; from shared.distributed import init_distributed, prepare; from shared.tiny import tiny_config; "
             "from transformers import LlamaForCausalLM; info = init_distributed(); "
             "m = LlamaForCausalLM(tiny_config(101, 1, 2, 0)); "
             "e, _, _ = prepare(m, torch.optim.AdamW(m.parameters()), None, info, 1, 1, 1.0, torch.float32); "
             "print('OFFLOAD', e.zero_cpu_offload())")
    for offload, expected in (("none", "OFFLOAD False"), ("cpu", "OFFLOAD True")):
        proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**env, "PYTHONPATH": str(ROOT), "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": offload})
        assert expected in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("plain", "offload"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    loss = [[r["loss/sft"] for r in metrics(tmp_path / n) if "loss/sft" in r] for n in ("plain", "offload")]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)
