"""Straight vs interrupted-and-resumed runs of the scripts, all in one process (imported once), for
tests/test_reliability.py. Not collected by pytest (no test_ prefix): run as

    python tests/resume_runs.py OUT_DIR CASE [CASE ...]          # one process
    accelerate launch --config_file scripts/accelerate/zero3.yaml tests/resume_runs.py OUT_DIR sft@zero3

For each case: run A straight; run B with --stop_after_steps K, then B again with the same flags (it resumes from
its checkpoint, --resume auto); compare every metrics.jsonl row (wall-clock `time` fields aside) and the final
weights (and critic) bit for bit. A and the first part of B are two runs with the same seed, so equal rows also
mean the script is deterministic; the case `grpo` also runs seed 2, whose rows must differ. Writes
OUT_DIR/results.json (rank 0). A case `name@zeroN` runs under ZeRO stage N (needs `accelerate launch`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RL_SMALL = ["--model_name_or_path", "builtin:tiny-sft", "--local_num_prompts", "4", "--local_micro_batch_size", "8",
            "--max_new_tokens", "8", "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "2",
            "--sample_every", "1", "--generator", "hf", "--max_prompt_length", "24"]

LORA = ["--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "1e-3"]


def write_datasets(out: Path) -> dict[str, str]:
    """Small local JSONL datasets (each with one prompt over the length limit, which is dropped and counted)."""
    from shared import task

    out.mkdir(parents=True, exist_ok=True)
    long = "9+" * 20 + "1="

    def dump(name, rows):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    train, test = task.builtin_split("train"), task.builtin_split("test")
    dump("prompts.jsonl", train[:64] + [{"prompt": long, "answer": "1"}])
    dump("prompts.test.jsonl", test[:8])
    # 16 usable (2 steps of 8): 17 examples + 1 too long, of which the dev slice (selects best/) takes row 3
    dump("sft.jsonl", train[:17] + [{"prompt": long, "response": "1", "answer": "1"}])
    dump("sft.test.jsonl", test[:8])
    pairs = task.builtin_preferences("train")[:48]
    dump("pairs.jsonl", pairs + [{**pairs[0], "prompt": long}, {**pairs[1], "rejected": pairs[1]["chosen"]}])
    dump("pairs.test.jsonl", task.builtin_preferences("test")[:16])
    return {k: str(out / f"{k}.jsonl") for k in ("prompts", "sft", "pairs")} | {"rm": str(tiny_reward_model(out))}


def tiny_reward_model(out: Path) -> Path:
    """A reward model for drca.py: the tiny backbone with a fresh scalar head (seeded), saved once."""
    from shared.scalar import load_scalar_model
    from shared.tiny import builtin_tiny, build_tokenizer

    path = out / "rm"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        load_scalar_model(str(builtin_tiny()), torch.float32).save_pretrained(path)
        build_tokenizer().save_pretrained(path)
    return path


def cases(d: dict[str, str]) -> dict[str, tuple[str, list[str], int]]:
    """name -> (script, flags, K = steps before the interruption)."""
    return {
        # 16 examples, 8 per step: K = 2 ends exactly at the epoch boundary (the resume must still train)
        "sft": ("sft", ["--model_name_or_path", "builtin:tiny", "--dataset", d["sft"], "--total_episodes", "40",
                        "--local_micro_batch_size", "8", "--eval_num_prompts", "8", "--eval_every", "2",
                        "--max_prompt_length", "24", "--reward_fn", "builtin"], 2),
        "grpo": ("grpo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "80",
                          "--num_generations", "4", "--beta", "0.05"], 3),
        # the grpo variants in one run: REINFORCE++-baseline advantages, CISPO's loss on GSPO's sequence ratio
        "grpo_variants": ("grpo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes",
                                   "80", "--num_generations", "4", "--advantage_estimator", "reinforce_pp_baseline",
                                   "--policy_loss", "cispo", "--importance_level", "sequence"], 3),
        # dynamic sampling: extra rounds draw on the sampler, their seeds on the round
        "dapo": ("dapo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "80",
                          "--num_generations", "4", "--max_refill_rounds", "2"], 3),
        "ppo": ("ppo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "80",
                        "--num_generations", "4"], 3),
        # the adaptive KL coefficient is resumed state
        "ppo_rlhf": ("ppo_rlhf", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes",
                                  "80", "--num_generations", "4", "--reward_model_path", d["rm"], "--adaptive_kl",
                                  "--kl_horizon", "100"], 3),
        "vineppo": ("vineppo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes",
                                "80", "--num_generations", "4", "--num_mc_rollouts", "3"], 3),
        "dpo": ("dpo", ["--dataset", d["pairs"], "--reward_fn", "builtin", "--total_episodes", "192",
                        "--local_micro_batch_size", "16", "--eval_num_prompts", "8", "--eval_num_samples", "2",
                        "--eval_num_pairs", "16", "--eval_every", "4", "--generator", "hf",
                        "--max_prompt_length", "24"], 7),
        "dpo_self_generated": ("dpo", ["--dataset", d["prompts"], "--reward_fn", "builtin", "--pair_source",
                                       "self_generated", "--num_generation_prompts", "16", "--num_generations",
                                       "4", "--total_episodes", "96", "--local_micro_batch_size", "16",
                                       "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_num_pairs", "0",
                                       "--eval_every", "2", "--generator", "hf", "--max_prompt_length", "24"], 2),
        "rm": ("rm", ["--dataset", d["pairs"], "--total_episodes", "192", "--local_micro_batch_size", "16",
                      "--eval_num_pairs", "16", "--eval_every", "4", "--max_prompt_length", "24"],
               7),
        "drca": ("drca", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "80",
                          "--num_generations", "4", "--reward_model_path", d["rm"],
                          "--unit_pattern", "lines"], 3),
        # units at the frozen SFT model's entropy peaks; the normaliser is fitted after the last step
        "unit_rm": ("unit_rm", ["--dataset", d["pairs"], "--total_episodes", "192", "--local_micro_batch_size", "16",
                                "--eval_num_pairs", "16", "--eval_every", "4", "--max_prompt_length", "24",
                                "--normalizer_num_pairs", "16"], 7),
        # dense unit rewards from the default reward model (builtin:tiny-unit-rm), its critic from the SFT policy
        "unit_ppo": ("unit_ppo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes",
                                  "80", "--num_generations", "4"], 3),
        # 2 iterations of 8 prompts x 4 samples, 2 epochs; K = 3 stops inside iteration 1's M-step
        "restem": ("restem", ["--model_name_or_path", "builtin:tiny-sft", "--dataset", d["prompts"], "--reward_fn",
                              "builtin", "--generator", "hf", "--total_episodes", "64", "--local_num_prompts", "8",
                              "--num_generations", "4", "--local_micro_batch_size", "4", "--num_epochs", "2",
                              "--max_new_tokens", "8", "--eval_num_prompts", "8", "--eval_num_samples", "2",
                              "--max_prompt_length", "24", "--early_stop", "choose_best"], 3),
        # LoRA (shared/lora.py): checkpoints hold the adapters and their optimizer state only; grpo's KL reference
        # is the policy with its adapters disabled
        "sft_lora": ("sft", ["--model_name_or_path", "builtin:tiny", "--dataset", d["sft"], "--total_episodes", "40",
                             "--local_micro_batch_size", "8", "--eval_num_prompts", "8", "--eval_every", "2",
                             "--max_prompt_length", "24", "--reward_fn", "builtin", *LORA], 2),
        "grpo_lora": ("grpo", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes",
                               "80", "--num_generations", "4", "--beta", "0.05", *LORA], 3),
        # the reader's reward on the confidence format of builtin:tiny-lc-sft (tests/test_calibration.py)
        "calibration": ("calibration", [*with_flag(with_flag(RL_SMALL, "--model_name_or_path", "builtin:tiny-lc-sft"),
                                                   "--max_new_tokens", "24"), "--dataset", d["prompts"],
                                        "--reward_fn", "builtin", "--total_episodes", "64", "--num_generations", "4",
                                        "--beta", "0.05"], 2),
        # the PRM and its optimizer are resumed state; 2 prompts sampled per trained prompt (the accuracy filter)
        "prime": ("prime", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "96",
                            "--num_generations", "4"], 2),
        # the teacher (builtin:tiny-grpo, frozen) is no resumed state; the task reward mixed in (--reward_coef)
        "opd": ("opd", [*RL_SMALL, "--dataset", d["prompts"], "--reward_fn", "builtin", "--total_episodes", "48",
                        "--num_generations", "4", "--reward_coef", "0.5"], 2),
        # the labelled rows are sampled again on resume (seeded, from the frozen reference); slip localisation on
        "implicit_prm": ("implicit_prm", ["--dataset", "builtin", "--generator", "hf", "--total_episodes", "48",
                                          "--local_num_prompts", "8", "--num_generations", "2",
                                          "--local_micro_batch_size", "8", "--eval_num_prompts", "8",
                                          "--max_new_tokens", "8", "--max_prompt_length", "24", "--eval_every", "2",
                                          "--localisation_num_pairs", "8"], 3),
        # calculator episodes on the 10-term task from the SFT start that knows the call syntax
        "grpo_tools": ("grpo_tools", [*with_flag(with_flag(RL_SMALL, "--model_name_or_path", "builtin:tiny-tools-sft"),
                                                 "--max_new_tokens", "48"), "--dataset", "builtin:sums-10",
                                      "--total_episodes", "48", "--num_generations", "4", "--dev_num_prompts", "8"], 2),
        "repulse": ("repulse", ["--total_episodes", "240", "--num_generations", "20", "--local_micro_batch_size", "20",
                                "--eval_num_samples", "40", "--eval_every", "2", "--sample_every", "2"], 3),
    }


# two ranks double the batch: these cases get more episodes, so that K steps stop before the end
TWO_RANKS = {"sft": "80", "sft_lora": "80", "ppo": "160", "drca": "160", "grpo": "160", "grpo_variants": "160",
             "grpo_lora": "160", "vineppo": "160", "dpo": "384", "rm": "384", "repulse": "480", "restem": "128",
             "prime": "192", "implicit_prm": "96", "unit_rm": "384", "unit_ppo": "160"}


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    i = flags.index(name)
    return flags[: i + 1] + [value] + flags[i + 2 :]


def metric_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith("time/")} for r in rows]


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for sub, name in (("final", "model.safetensors"), ("critic", "model.safetensors"), ("prm", "model.safetensors"),
                      ("final/adapter", "adapter_model.safetensors")):  # a LoRA run's adapter too
        if (out / sub / name).exists():
            found.update({f"{sub}/{k}": v for k, v in load_file(out / sub / name).items()})
    return found


def run(script: str, flags: list[str], out: Path, *more: str) -> None:
    import tyro

    mod = importlib.import_module(f"algorithms.{script}")
    mod.main(tyro.cli(mod.Args, args=["--output_dir", str(out), *flags, *more], use_underscores=True))


def compare(name: str, script: str, flags: list[str], k: int, base: Path, rank: int) -> dict:
    from shared.checkpoint import list_checkpoints

    a, b = base / name / "a", base / name / "b"
    flags = [*flags, "--save_every", str(k)]
    run(script, flags, a)
    run(script, flags, b, "--stop_after_steps", str(k))
    stopped_at, rows_at_stop = [s for s, _ in list_checkpoints(b)][-1], len(metric_rows(b))
    run(script, flags, b)  # --resume auto: continues from step K in the same output_dir
    ra, rb = metric_rows(a), metric_rows(b)
    diff = next(([x, y] for x, y in zip(ra, rb) if x != y), None)
    wa, wb = weights(a), weights(b)
    out = {"rows_equal": ra == rb, "n_rows": [len(ra), len(rb)], "rows_at_stop": rows_at_stop, "first_diff": diff,
           "weights_equal": wa.keys() == wb.keys() and all(torch.equal(wa[key], wb[key]) for key in wa),
           "weights": sorted({key.split("/")[0] for key in wa}), "adapter": any(".lora_" in key for key in wa),
           "best": (a / "best" / "best.json").exists(),
           "stopped_at": stopped_at, "finished": (b / "checkpoints" / "finished.json").exists(),
           "first_row": ra[0], "last_row": ra[-1], "step_row": next((r for r in reversed(ra) if "episode" in r), {})}
    if name == "grpo":  # the comparison can fail: another seed gives other metrics
        run(script, flags, base / name / "seed2", "--seed", "2")
        out["other_seed_rows_differ"] = metric_rows(base / name / "seed2")[1:] != ra[1:]
    return out


def main() -> None:
    base = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", 0))
    datasets = write_datasets(base / "data") if rank == 0 else {
        **{k: str(base / "data" / f"{k}.jsonl") for k in ("prompts", "sft", "pairs")}, "rm": str(base / "data" / "rm")}
    from shared.distributed import init_distributed

    init_distributed().barrier()  # rank 0 wrote the datasets
    table = cases(datasets)
    results = {}
    for case in sys.argv[2:]:
        name, _, stage = case.partition("@zero")
        if stage:
            os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = stage
        script, flags, k = table[name]
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            flags = with_flag(flags, "--total_episodes", TWO_RANKS[name])
        results[case] = compare(case, script, flags, k, base, rank)
    if rank == 0:
        (base / "results.json").write_text(json.dumps(results, indent=1, default=str))
    # as run_cli does after a finished run: end the process group before interpreter exit
    from shared.distributed import end_process_group

    end_process_group()


if __name__ == "__main__":
    main()
