"""End-to-end runs of the scripts exactly as users launch them, on the built-in tiny model.

Covers: sft.py; grpo.py with vLLM and with HF generation, the optional branches (KL to a reference,
num_iterations > 1, several minibatches, truncation masking), a learning check, and each variant flag (GSPO, CISPO,
RLOO, REINFORCE++-baseline, DPPO, MaxRL, the entropy bonus, the geometric mismatch mask); ppo.py and vineppo.py (dapo.py: tests/test_dapo.py); rm.py and
its checkpoint as the reward of grpo.py, ppo.py and drca.py; dpo.py; and 2-process `accelerate launch` runs under
ZeRO-2 and ZeRO-3 whose ranks must end with identical weights.

The single-process runs go one after another in one Python process, the 2-process runs in one pair of processes
(`run_batch`: each run as `python algorithms/<script>.py ...` or `accelerate launch ... algorithms/<script>.py ...` runs
it, with its own log, exit status and process group), so the libraries are imported and the ranks started once; the
tests assert on their outputs."""

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
    """The child process of `run_batch` (`python tests/test_e2e.py PLAN`, or under `accelerate launch` on every rank):
    each planned command line `[script.py, *flags]` runs in turn as `python script.py *flags` would run it (runpy,
    `__name__ == "__main__"`, sys.argv, the script's folder first on sys.path, the run's extra environment variables
    set for it alone), its stdout and stderr (file descriptors 1 and 2, so C-level output too) in its own log per rank;
    the exit status (SystemExit's code, 1 after an uncaught exception, whose traceback goes to the log) is written to
    the rank's results file after each run, so a run that kills the process leaves the earlier results."""
    import gc
    import runpy
    import traceback

    plan = json.loads(Path(plan_file).read_text())
    rank = os.environ.get("RANK", "0")
    suffix = "" if rank == "0" else f".rank{rank}"
    results = {}
    for i, item in enumerate(plan["runs"]):
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        log = os.open(item["log"] + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        env = dict(os.environ)
        os.environ.update(item["env"])
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            # each run starts its own process group (run_cli ends it), at its own port: torchrun's store holds the
            # previous group's keys under the same name, and a second group there never forms
            os.environ.update(TORCHELASTIC_USE_AGENT_STORE="False", MASTER_PORT=str(plan["ports"][i]))
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
            gc.collect()  # the run's engines and models, before the next run builds its own
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (log, *saved):
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
        results[item["name"]] = code
        Path(plan["results"] + suffix).write_text(json.dumps(results))
    if "torch.distributed" in sys.modules:  # a run that left its process group (a test helper, not run_cli)
        from shared.distributed import end_process_group

        end_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_batch(runs: dict[str, list[str]], work: Path, env: dict | None = None, timeout: int = 1800,
              launcher: tuple[str, ...] = (), ranks: int = 1, run_env: dict[str, dict] | None = None) -> dict:
    """Run several script command lines (name -> [script.py, *flags]) one after another in ONE Python process
    (`batch_main`; with `launcher`, e.g. `accelerate launch --config_file ...`, one process on each of `ranks`), so
    torch, transformers, DeepSpeed and vLLM are imported (and the ranks started) once for all of them instead of once
    per run; `run_env` gives a run extra environment variables (e.g. its ZeRO stage). Returns name -> {"code": exit status
    of every rank (None: the process died before it), "log": the run's own output (rank 0's, then the others'),
    "batch": the processes' own output}; `check_batch_run` asserts on one entry as `run` does on a subprocess."""
    work.mkdir(parents=True, exist_ok=True)
    plan = {"runs": [{"name": n, "argv": [str(a) for a in argv], "log": str(work / f"{n}.log"),
                      "env": (run_env or {}).get(n, {})} for n, argv in runs.items()],
            "results": str(work / "results.json"), "ports": [free_port() for _ in runs]}
    (work / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [*(launcher or [sys.executable]), str(ROOT / "tests" / "test_e2e.py"), str(work / "plan.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    batch = f"(batch process exit status {proc.returncode})\n{proc.stdout + proc.stderr}"
    suffixes = ["", *(f".rank{r}" for r in range(1, ranks))]
    done = [json.loads((work / f"results.json{s}").read_text()) if (work / f"results.json{s}").exists() else {}
            for s in suffixes]
    logs = lambda n: "".join((work / f"{n}.log{s}").read_text() for s in suffixes  # noqa: E731
                             if (work / f"{n}.log{s}").exists())
    return {n: {"code": [d.get(n) for d in done], "log": logs(n), "batch": batch, "batch_code": proc.returncode,
                "cmd": " ".join(str(a) for a in argv)} for n, argv in runs.items()}


def check_batch_run(result: dict) -> str:
    """As `run` for a subprocess: exit status 0 and a clean exit (the run's log and the batch process's own output,
    which holds any exit-time failure); returns the run's log."""
    out = result["log"]
    assert result["code"] == [0] * len(result["code"]), \
        f"{result['cmd']} failed (exit status per rank {result['code']}):\n{out[-6000:]}\n{result['batch'][-3000:]}"
    assert result["batch_code"] == 0, f"the batch process of {result['cmd']} failed:\n{result['batch'][-6000:]}"
    assert_clean_exit(out + result["batch"], result["cmd"])
    return out


def algo(name: str) -> str:
    return f"algorithms/{name}.py"


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
PPO_SMALL = ["--dev_num_prompts", "8",  # a small dev slice (selects best/) keeps the runs short
             "--model_name_or_path", "builtin:tiny", "--total_episodes", "64", "--local_num_prompts", "4",
             "--num_generations", "4", "--local_micro_batch_size", "8", "--max_new_tokens", "8",
             "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "1"]
PPO_FAMILY_EXTRA = {  # ppo.py: an entropy bonus and the token mask on [0.5, 5] (IcePop's form); vineppo.py: the geometric mask
    "ppo": ["--entropy_coef", "0.01", "--tis", "token_mask", "--tis_cap", "5", "--tis_mask_low", "0.5"],
    "vineppo": ["--tis", "geometric_mask", "--tis_cap", "1.001"],
}
DRCA_SMALL = ["--scorer", "rm",  # the RM scores (the built-in task's default, --scorer auto, is the per-line grader)
              "--dev_num_prompts", "8", "--localisation_num_pairs", "12",  # small dev and slip sets: short runs
              "--total_episodes", "64", "--local_num_prompts", "4", "--num_generations", "4",
              "--local_micro_batch_size", "8", "--max_new_tokens", "8", "--eval_num_prompts", "8",
              "--eval_num_samples", "2", "--eval_every", "2", "--sample_every", "1"]
DRCA_CASES = {
    "vllm": ["--lora_r", "4", "--tis", "token_mask", "--kl_placement", "loss", "--adaptive_kl"],  # ppo_rlhf.py's
    "hf": ["--unit_extraction", "entropy", "--unit_entropy_threshold", "0.5", "--counterfactual", "mask",
           "--entropy_source", "reference", "--unitless_fallback", "zeros"],
}
DPO_SMALL = ["--dev_num_prompts", "8",  # a small dev slice (selects best/) keeps the runs short
             "--total_episodes", "256", "--local_micro_batch_size", "32", "--eval_num_prompts", "16",
             "--eval_num_samples", "2", "--eval_num_pairs", "32", "--eval_every", "4"]
DPO_REF = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--eval_num_prompts", "0", "--eval_num_pairs",
           "16", "--no_save_model", "--loss_type", "dpop",
           "--logit_temperature", "0.6"]
SFT_COMMON = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--loss_reduction", "token_mean",
              "--learning_rate", "1e-5", "--eval_num_prompts", "2", "--eval_every", "0", "--save_every", "0",
              "--best_metric", ""]
OFFLOAD_COMMON = ["--total_episodes", "64", "--local_micro_batch_size", "16", "--eval_num_prompts", "4", "--eval_every",
                  "0", "--save_every", "0", "--best_metric", ""]
# the engine the scripts build (shared/distributed.py prepare) offloads under that environment, and only then
OFFLOAD_PROBE = """import torch
from transformers import LlamaForCausalLM

from shared.distributed import end_process_group, init_distributed, prepare
from shared.tiny import tiny_config

info = init_distributed()
m = LlamaForCausalLM(tiny_config(101, 1, 2, 0))
e, _, _ = prepare(m, torch.optim.AdamW(m.parameters()), None, info, 1, 1, 1.0, torch.float32)
print("OFFLOAD", e.zero_cpu_offload())
end_process_group()
"""


def _strip_answers(rows: list[dict], out: Path) -> None:
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("answer", "response")}) + "\n"
                           for r in rows))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every single-process run of this file, one after another in one Python process (`run_batch`: each as
    `python algorithms/<script>.py ...` runs it, with its own log and exit status), so the libraries are imported once;
    rm.py's run goes first, as the later runs take its checkpoint as their reward model. name -> (result, output_dir);
    the tests below assert on them (`done`)."""
    base = tmp_path_factory.mktemp("e2e")
    plan, run_env = single_process_plan(base)
    results = run_batch(plan, base / "batch", run_env=run_env)
    return {name: (results[name], base / name) for name in plan}


def single_process_plan(base: Path) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """The runs of the `runs` fixture, their output_dirs under `base` (their inputs written there first), and the
    environment of the runs that need one."""
    import torch
    from transformers import AutoTokenizer

    from shared import task
    from shared.scalar import load_scalar_model
    from shared.tiny import builtin_tiny

    inputs = base / "inputs"
    inputs.mkdir()
    (inputs / "reward.py").write_text("def starts_with_one(prompts, completions, **kw):\n"
                                      "    return [float(c.startswith('1')) for c in completions]\n")
    # ppo_rlhf.py's reward model: the tiny model with a fresh scalar head
    load_scalar_model(str(builtin_tiny()), torch.float32).save_pretrained(inputs / "fresh_rm")
    AutoTokenizer.from_pretrained(builtin_tiny()).save_pretrained(inputs / "fresh_rm")
    # prompts without an answer column; prompt/chosen/rejected pairs without one
    _strip_answers(task.builtin_split("train")[:200], inputs / "p.train.jsonl")
    _strip_answers(task.builtin_split("test")[:8], inputs / "p.test.jsonl")
    for split, n in (("train", 400), ("test", 40)):
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                for r in task.builtin_preferences(split)[:n]]
        (inputs / f"pairs.{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (inputs / "offload_probe.py").write_text(OFFLOAD_PROBE)

    out = lambda name: ["--output_dir", str(base / name)]  # noqa: E731
    rm = str(base / "rm" / "final")
    plan = {
        # a reward model trained by rm.py on the built-in pairs (short run), as the later RL runs use it
        "rm": [algo("rm"), *out("rm"), "--total_episodes", "1280", "--local_micro_batch_size", "32",
               "--eval_num_pairs", "64", "--eval_every", "20"],
        "sft": [algo("sft"), *out("sft"), "--total_episodes", "512", "--local_micro_batch_size", "32",
                "--eval_num_prompts", "8", "--eval_every", "8"],
        "sft_one_rank": [algo("sft"), *out("sft_one_rank"), *SFT_COMMON, "--gradient_accumulation_steps", "2"],
        **{f"grpo_every_branch_{g}": [algo("grpo"), "--generator", g, *out(f"grpo_every_branch_{g}"),
                                      "--model_name_or_path", "builtin:tiny", *SMALL, "--beta", "0.05",
                                      "--num_iterations", "2", "--num_minibatches", "2",
                                      "--mask_truncated_completions", "--loss_aggregation", "seq_mean"]
           for g in ("vllm", "hf")},
        "grpo_learns": [algo("grpo"), *out("grpo_learns"), "--reward_fn", f"{inputs / 'reward.py'}:starts_with_one",
                        "--total_episodes", "2560", "--local_num_prompts", "16", "--local_micro_batch_size", "64",
                        "--eval_every", "0", "--eval_num_prompts", "16", "--no_save_model"],
        **{f"variant_{n}": [algo("grpo"), *out(f"variant_{n}"), *TINY_RUN, *flags] for n, flags in VARIANTS.items()},
        "ppo_rlhf_adaptive": [algo("ppo_rlhf"), *out("ppo_rlhf_adaptive"), *PPO_SMALL, "--reward_model_path",
                              str(inputs / "fresh_rm"), "--adaptive_kl", "--non_stop_penalty", "--generator", "hf"],
        **{f"single_{s}": [algo(s), *out(f"single_{s}"), *PPO_SMALL, *PPO_FAMILY_EXTRA[s]] for s in PPO_FAMILY_EXTRA},
        "rm_grpo": [algo("grpo"), *out("rm_grpo"), "--reward_model_path", rm, *SMALL, "--generator", "hf"],
        **{f"no_gold_{s}": [algo(s), *out(f"no_gold_{s}"), *flags, "--generator", "hf", "--dataset",
                            str(inputs / "p.jsonl"), "--reward_model_path", rm]
           for s, flags in (("grpo", SMALL), ("ppo_rlhf", PPO_SMALL), ("drca", DRCA_SMALL))},
        "rm_ppo_rlhf": [algo("ppo_rlhf"), *out("rm_ppo_rlhf"), *PPO_SMALL, "--reward_model_path", rm, "--generator",
                        "hf"],
        **{f"drca_{g}": [algo("drca"), *out(f"drca_{g}"), "--reward_model_path", rm, *DRCA_SMALL, "--generator", g,
                         *extra] for g, extra in DRCA_CASES.items()},
        **{f"drca_line_{m}": [algo("drca"), *out(f"drca_line_{m}"), "--reward_model_path", rm, *DRCA_SMALL,
                              "--generator", "hf", "--scorer", "line_grader", "--counterfactual", m,
                              "--total_episodes", "32", "--no_save_model"] for m in ("truncate", "mask")},
        "drca_beta0": [algo("drca"), *out("drca_beta0"), "--reward_model_path", rm, *DRCA_SMALL, "--generator", "hf",
                       "--drca_beta", "0", "--no_save_model"],
        **{f"dpo_{t}": [algo("dpo"), *out(f"dpo_{t}"), *DPO_SMALL, "--loss_type", t, "--generator",
                        "hf" if t == "ipo" else "vllm"] for t in ("sigmoid", "ipo")},
        "dpo_ref_cached": [algo("dpo"), *out("dpo_ref_cached"), *DPO_REF],
        "dpo_ref_model": [algo("dpo"), *out("dpo_ref_model"), *DPO_REF, "--no_precompute_ref_logps"],
        "dpo_self": [algo("dpo"), *out("dpo_self"), "--pair_source", "self_generated", "--num_generation_prompts",
                     "32", "--num_generations", "8", *DPO_SMALL, "--total_episodes", "128", "--loss_type", "dpop",
                     "--logit_temperature", "0.6"],
        "dpo_no_gold": [algo("dpo"), *out("dpo_no_gold"), "--dataset", str(inputs / "pairs.jsonl"),
                        "--total_episodes", "128", "--local_micro_batch_size", "32", "--eval_every", "2"],
        # `offload_optimizer_device: cpu` in an accelerate config is exported as this environment variable
        **{f"offload_{o}": [algo("sft"), *out(f"offload_{o}"), *OFFLOAD_COMMON] for o in ("none", "cpu")},
        **{f"offload_probe_{o}": [str(inputs / "offload_probe.py")] for o in ("none", "cpu")},
    }
    run_env = {name: {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                      "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": name.rsplit("_", 1)[1]}
               for name in plan if name.startswith("offload_")}
    return plan, run_env


def done(runs: dict, name: str) -> tuple[Path, str]:
    """The output_dir and log of a finished run of the batch (exit status 0, a clean exit: `check_batch_run`)."""
    result, out = runs[name]
    return out, check_batch_run(result)


LAUNCH_2 = (sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Every 2-process run of this file (`accelerate launch`, 2 CPU processes), one after another in one pair of
    processes (`run_batch` with a launcher; each run under its own ZeRO stage, ACCELERATE_DEEPSPEED_ZERO_STAGE, as the
    accelerate config sets it, and its own process group); drca.py's reward model is its default, builtin:tiny-rm."""
    base = tmp_path_factory.mktemp("e2e2")
    out = lambda name: ["--output_dir", str(base / name)]  # noqa: E731
    plan = {
        "sft_two_ranks": ([algo("sft"), *out("sft_two_ranks"), *SFT_COMMON], 2),
        **{f"grpo_zero{stage}": ([algo("grpo"), *out(f"grpo_zero{stage}"), "--model_name_or_path", "builtin:tiny",
                                  *SMALL, "--total_episodes", "64", "--eval_every", "0", "--beta", "0.05"], stage)
           for stage in (2, 3)},  # 2 steps
        "vineppo_hf_zero3": ([algo("vineppo"), *out("vineppo_hf_zero3"), *PPO_SMALL, "--total_episodes", "64",
                              "--generator", "hf", "--eval_num_prompts", "1", "--no_save_model"], 3),
        **{f"{s}_zero2": ([algo(s), *out(f"{s}_zero2"), *PPO_SMALL, "--total_episodes", "64", "--eval_every", "0"], 2)
           for s in ("ppo", "vineppo")},  # 2 steps
        "rm_uneven_zero3": ([algo("rm"), *out("rm_uneven_zero3"), "--total_episodes", "64", "--local_micro_batch_size",
                             "16", "--eval_num_pairs", "33", "--eval_every", "0", "--save_every", "0"], 3),
        "drca_zero2": ([algo("drca"), *out("drca_zero2"), *DRCA_SMALL, "--no_save_model"], 2),  # 2 steps
        "dpo_zero3": ([algo("dpo"), *out("dpo_zero3"), *DPO_SMALL, "--eval_num_pairs", "33"], 3),
    }
    results = run_batch({n: argv for n, (argv, _) in plan.items()}, base / "batch", launcher=LAUNCH_2, ranks=2,
                        run_env={n: {"ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage)} for n, (_, stage) in plan.items()})
    return {name: (results[name], base / name) for name in plan}


def two_ranks_end_identical(rows: list[dict]) -> None:
    last = rows[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


def test_sft_trains_and_saves_a_loadable_checkpoint(runs):
    out, _ = done(runs, "sft")
    rows = metrics(out)
    losses = [r["loss/sft"] for r in rows if "loss/sft" in r]
    assert losses[-1] < losses[0]
    assert any("eval/accuracy" in r for r in rows)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 3
    # trained with gradient checkpointing (the default), saved for generation: the KV cache stays on
    assert json.loads((out / "final" / "config.json").read_text()).get("use_cache", True) is True


def test_sft_two_ranks_equal_one_rank_with_gradient_accumulation(runs, two_process_runs):
    """token_mean over the whole step: 2 ranks x 1 micro-batch trains like 1 rank x 2 accumulated micro-batches (the
    same global batch: the sampler's indices are split by rank, or by micro-batch), so the loss and weights match."""
    two_dir, _ = done(two_process_runs, "sft_two_ranks")
    one_dir, _ = done(runs, "sft_one_rank")
    two = [r["loss/sft"] for r in metrics(two_dir) if "loss/sft" in r]
    one = [r["loss/sft"] for r in metrics(one_dir) if "loss/sft" in r]
    assert len(two) == len(one) == 1 and two[0] == pytest.approx(one[0], rel=1e-5)
    from safetensors.torch import load_file

    a, b = load_file(two_dir / "final" / "model.safetensors"), load_file(one_dir / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


@pytest.mark.parametrize("generator", ["vllm", "hf"])
def test_grpo_runs_every_branch(runs, generator):
    out, _ = done(runs, f"grpo_every_branch_{generator}")
    rows = metrics(out)
    steps = [r for r in rows if "objective/scores" in r]
    assert len(steps) == 64 // 16
    for key in ("objective/kl", "objective/entropy", "policy/clipfrac_avg", "val/ratio", "val/frac_reward_zero_std",
                "val/stop_rate", "val/sequence_lengths", "time/generate", "time/logprob", "time/train", "time/sync",
                "optim/grad_norm", "val/sampler_logprob_diff"):
        assert all(key in r and r[key] is not None for r in steps), key
    assert steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-3)  # policy == reference before the first update
    assert abs(steps[0]["val/sampler_logprob_diff"]) < 1e-3  # trainer and sampler agree (same weights, same T)
    assert "eval/accuracy" in rows[-1] and rows[-1]["check/ranks_identical_weights"] == 1.0
    assert (out / "final" / "config.json").exists() and (out / "samples.jsonl").read_text()


def test_grpo_learns_a_simple_reward(runs):
    """From the built-in warm start (builtin:tiny-sft, committed weights), GRPO must raise a clean reward within 20 steps."""
    out, _ = done(runs, "grpo_learns")
    scores = [r["objective/scores"] for r in metrics(out) if "objective/scores" in r]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.2, scores


@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_two_processes_deepspeed(two_process_runs, stage):
    """accelerate launch, 2 CPU processes, a vLLM engine per rank: ranks see different prompts, end identical."""
    out, _ = done(two_process_runs, f"grpo_zero{stage}")
    two_ranks_end_identical(metrics(out))


# ---------------------------------------------------------------- grpo.py's variant flags (docs/grpo.md, Variants)
@pytest.mark.parametrize("name", VARIANTS)
def test_grpo_variant_trains_end_to_end(runs, name):
    """Two steps of each variant (default 2 iterations x 2 minibatches, so the ratio moves off 1): finite losses and
    gradients, a saved policy."""
    out, _ = done(runs, f"variant_{name}")
    steps = [r for r in metrics(out) if "loss/policy_avg" in r]
    assert len(steps) == 2
    for key in ("loss/policy_avg", "optim/grad_norm", "val/ratio", "val/advantages_mean", "policy/clipfrac_avg",
                "objective/entropy", "val/sampler_kl", "val/tis_ratio_p99", "val/tis_seq_clipfrac"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert (out / "final" / "config.json").exists()


def test_ppo_rlhf_with_adaptive_kl_and_the_non_eos_penalty(runs):
    """ppo_rlhf.py: a reward model (here the tiny model with a fresh scalar head) scores completions, KL in the
    reward (its default), adaptive KL, non-EOS penalty; the held-out accuracy is still the task grader's."""
    out, _ = done(runs, "ppo_rlhf_adaptive")
    steps = [r for r in metrics(out) if "loss/value_avg" in r]
    assert len(steps) == 4 and steps[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)
    assert steps[-1]["objective/kl_coef"] != 0.05  # the adaptive controller moved beta
    assert "eval/accuracy" in metrics(out)[-1]


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_single_process(runs, script):
    """ppo.py with an entropy bonus and the token mask on [0.5, 5] (IcePop's form), vineppo.py with the geometric
    mask: the flags every script that samples with vLLM shares (tests/test_mismatch.py has their numbers)."""
    out, _ = done(runs, f"single_{script}")
    steps = [r for r in metrics(out) if "objective/scores" in r]
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
    assert metrics(out)[-1]["check/ranks_identical_weights"] == 1.0


def test_vineppo_hf_generation_under_zero3_two_processes(two_process_runs):
    """The HF backend under ZeRO-3 needs the same generate calls on every rank (each forward gathers shards): VinePPO's
    MC rollouts have per-state budgets that differ between ranks (one call per budget: different counts, a hang), and
    one held-out prompt leaves rank 1 with none (a crash). Both must now run to the end."""
    out, _ = done(two_process_runs, "vineppo_hf_zero3")
    rows = metrics(out)
    assert rows[-1]["check/ranks_identical_weights"] == 1.0 and "eval/accuracy" in rows[-1]
    assert len([r for r in rows if "mc_values/mean" in r]) == 2


@pytest.mark.parametrize("script", ["ppo", "vineppo"])
def test_ppo_family_two_processes_zero2(two_process_runs, script):
    out, _ = done(two_process_runs, f"{script}_zero2")
    two_ranks_end_identical(metrics(out))


# ---------------------------------------------------------------- reward model and DPO
def test_rm_uneven_held_out_pairs_under_zero3(two_process_runs):
    """33 held-out pairs on 2 ranks with micro-batches of 16: 17 pairs (2 forwards) vs 16 (1 forward). Under ZeRO-3
    every forward gathers shards from all ranks, so the evaluation hung; now the short rank runs a dummy forward."""
    out, _ = done(two_process_runs, "rm_uneven_zero3")
    evals = [r for r in metrics(out) if "eval/accuracy" in r]
    assert len(evals) == 2 and metrics(out)[-1]["check/ranks_identical_weights"] == 1.0


def test_rm_saves_a_normalised_sequence_classifier(runs):
    trained_rm, _ = done(runs, "rm")
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


def test_rm_trained_by_rm_py_is_the_reward_of_grpo(runs):
    """The rm.py checkpoint, passed as --reward_model_path, scores GRPO's completions end to end."""
    out, _ = done(runs, "rm_grpo")
    steps = [r for r in metrics(out) if "objective/scores" in r]
    assert len(steps) == 4
    assert all(r["objective/scores"] != int(r["objective/scores"]) for r in steps)  # real-valued RM scores, not 0/1
    assert "eval/accuracy" in metrics(out)[-1]  # held-out accuracy still from the grader
    assert math.isfinite(metrics(out)[-1]["eval/reward"])  # and the reward model's held-out score


@pytest.mark.parametrize("script", ["grpo", "ppo_rlhf", "drca"])
def test_a_reward_model_task_needs_no_gold_answers(runs, script):
    """Prompts without an answer column train on the reward model; no accuracy is reported, the held-out and
    dev reward are, and best/ is selected on dev/reward."""
    out, log = done(runs, f"no_gold_{script}")
    rows = metrics(out)
    evals = [r for r in rows if "eval/reward" in r]
    assert evals and all("eval/accuracy" not in r and "dev/accuracy" not in r for r in rows)
    assert all(math.isfinite(r["dev/reward"]) for r in evals)
    assert json.loads((out / "best" / "best.json").read_text())["metric"] == "dev/reward"
    assert "held-out reward" in log


def test_rm_trained_by_rm_py_is_the_reward_of_ppo_rlhf(runs):
    out, _ = done(runs, "rm_ppo_rlhf")
    steps = [r for r in metrics(out) if "loss/value_avg" in r]
    assert len(steps) == 4 and all(math.isfinite(r["objective/scores"]) for r in steps)
    assert all(math.isfinite(r["eval/reward"]) for r in metrics(out) if "eval/accuracy" in r)


@pytest.mark.parametrize("generator", list(DRCA_CASES))
def test_drca_with_the_rm_trained_by_rm_py(runs, generator):
    """Units found, one RM call per unit on top of one per response, the reward identity holds, and the held-out
    metrics are the grader's accuracy and the RM's mean score; with the features drca.py shares with ppo_rlhf.py
    (LoRA, TIS, the KL as a loss term, the adaptive KL coefficient) the same, plus their effects."""
    out, _ = done(runs, f"drca_{generator}")
    rows = metrics(out)
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
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(len(x["units"]) == len(x["credits"]) for x in samples) and any(x["units"] for x in samples)
    assert rows[-1]["check/ranks_identical_weights"] == 1.0
    assert (out / "final" / "config.json").exists() and (out / "critic" / "config.json").exists()
    if "--lora_r" in DRCA_CASES[generator]:  # adapters exported with the merged models; k3 in the loss, none in the
        # reward; beta adapts
        assert (out / "final" / "adapter").is_dir() and (out / "critic" / "adapter").is_dir()
        assert all(r["objective/non_score_reward"] == 0.0 and r["loss/kl_avg"] >= 0 for r in steps)
        assert steps[-1]["loss/kl_avg"] > 0 and steps[-1]["objective/kl_coef"] != steps[0]["objective/kl_coef"]
        assert all(0 < r["val/tis_weight"] <= 2.0 for r in steps)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_drca_line_grader_scorer_locates_every_slip(runs, mode):
    """--scorer line_grader scores responses and counterfactuals with the per-line grader; through drca.py's
    own units, token blanking and decoding, the lowest credit is the slipped line on every held-out pair, in both
    modes; the training reward is the grader's score (at most 1, a correct response)."""
    out, _ = done(runs, f"drca_line_{mode}")
    rows = metrics(out)
    evals = [r for r in rows if "eval/localisation" in r]
    assert evals and all(r["eval/localisation"] == 1.0 for r in evals)
    steps = [r for r in rows if "loss/value_avg" in r]
    assert steps and all(-1.0 <= r["objective/scores"] <= 1.0 and r["drca/sum_identity_err"] < 1e-4 for r in steps)


def test_drca_beta_zero_is_ppo_without_unit_calls(runs):
    out, _ = done(runs, "drca_beta0")
    steps = [r for r in metrics(out) if "loss/value_avg" in r]
    assert steps and all(r["drca/units_per_seq"] == 0 and r["drca/rm_calls"] == 16 for r in steps)


def test_drca_two_processes_zero2(two_process_runs):
    out, _ = done(two_process_runs, "drca_zero2")
    rows = metrics(out)
    two_ranks_end_identical(rows)
    steps = [r for r in rows if "loss/value_avg" in r]
    assert len(steps) == 2 and all(r["drca/rm_calls"] == pytest.approx(32 * (1 + r["drca/units_per_seq"]))
                                   for r in steps)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_offline_pairs(runs, loss_type):
    out, _ = done(runs, f"dpo_{loss_type}")
    rows = metrics(out)
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
    assert (out / "final" / "config.json").exists() and (out / "samples.jsonl").read_text()


def test_dpo_reference_logps_precomputed_equal_on_the_fly(runs):
    """Same run with cached reference log-probs and with a frozen reference model: same losses."""
    a, b = metrics(done(runs, "dpo_ref_cached")[0]), metrics(done(runs, "dpo_ref_model")[0])
    la, lb = [r for r in a if "loss/dpo" in r], [r for r in b if "loss/dpo" in r]
    assert la and len(la) == len(lb)
    for x, y in zip(la, lb):
        for key in ("loss/dpo", "rewards/chosen", "rewards/rejected", "dpop/penalty"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    ea, eb = [r for r in a if "eval/loss/dpo" in r], [r for r in b if "eval/loss/dpo" in r]
    assert ea[-1]["eval/loss/dpo"] == pytest.approx(eb[-1]["eval/loss/dpo"], rel=1e-4)


def test_dpo_self_generated_pairs(runs):
    out, _ = done(runs, "dpo_self")
    rows = metrics(out)
    info = rows[0]
    assert 0 < info["pairs/sample_accuracy"] < 1 and info["pairs/num_pairs"] == info["data/train_pairs"] > 0
    assert info["pairs/num_pairs"] <= 32 * 16  # at most 4 x 4 pairs per prompt with 8 samples
    assert any("loss/dpo" in r for r in rows)


def test_dpo_two_processes_zero3(two_process_runs):
    out, _ = done(two_process_runs, "dpo_zero3")
    two_ranks_end_identical(metrics(out))


def test_dpo_on_pairs_without_gold_answers(runs):
    """A plain prompt/chosen/rejected dataset runs with the default flags' evaluation: no task accuracy, the
    held-out and dev pairs' implicit-reward accuracy, best/ selected on the dev pairs."""
    out, log = done(runs, "dpo_no_gold")
    rows = metrics(out)
    assert not any("eval/accuracy" in r for r in rows)
    evals = [r for r in rows if "eval/rewards/accuracies" in r]
    assert len(evals) == 3 and all("dev/rewards/accuracies" in r for r in evals)
    assert json.loads((out / "best" / "best.json").read_text())["metric"] == "dev/rewards/accuracies"
    assert "no 'answer' column" in log


def test_optimizer_offload_from_an_accelerate_config_is_honoured(runs):
    """#22: `offload_optimizer_device: cpu` in an accelerate config (exported as ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_
    DEVICE) was silently ignored; now it is DeepSpeed's ZeRO-Offload, and training matches the run without it."""
    for offload, expected in (("none", "OFFLOAD False"), ("cpu", "OFFLOAD True")):
        _, log = done(runs, f"offload_probe_{offload}")
        assert expected in log, log[-2000:]
    from safetensors.torch import load_file

    plain, offloaded = done(runs, "offload_none")[0], done(runs, "offload_cpu")[0]
    a, b = (load_file(d / "final" / "model.safetensors") for d in (plain, offloaded))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    loss = [[r["loss/sft"] for r in metrics(d) if "loss/sft" in r] for d in (plain, offloaded)]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)


if __name__ == "__main__":  # the child process of run_batch
    batch_main(sys.argv[1])
