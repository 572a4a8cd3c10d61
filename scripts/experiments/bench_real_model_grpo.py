"""Experiment (not a test): GRPO learning on a real pretrained chat model, SmolLM2-135M-Instruct, on CPU or one GPU.

    python scripts/experiments/bench_real_model_grpo.py                        # 3 seeds, ~50 min each on 2 CPU cores; JSON + PNG
    python scripts/experiments/bench_real_model_grpo.py --generator hf --plot docs/img/real_model_grpo_gpu.png  # a GPU without vLLM
    python scripts/experiments/bench_real_model_grpo.py --seeds 1              # one seed
    python scripts/experiments/bench_real_model_grpo.py --stop_after_steps 10  # a time-limited slice; rerun the same to continue
    python scripts/experiments/bench_real_model_grpo.py --write_data data/     # only write the task's GSM8K-format files

Task ("chat sums", shared/task.py): "What is 12+7?" for operands 0..19, 400 problems, 100 held out and 300 for
training (disjoint, fixed), written as a GSM8K-format local file pair `chat_sums.{train,test}.jsonl` (question /
answer "12 + 7 = 19\\n#### 19"), asked through the model's chat template with " Answer with the number only."
appended. Reward: `--reward_fn math` (Minerva extraction: "The answer is N", else the last number; 0 if the turn
did not end). GSM8K's own grader needs a "#### N" line that this model almost never writes: see
scripts/experiments/real_model_prompts.py and docs/real_models.md for the measured rates of each prompt/grader pair.

For each seed, runs algorithms/grpo.py as a user would (one process, vLLM generation, the flags below; a finished
seed is kept in <out>/seed<k>.json and not rerun), then evaluates the start and final checkpoints greedily (vLLM,
T = 0) on the same 100 held-out prompts. Held-out sampled accuracy (T = 1,
4 samples per prompt) comes from grpo.py's own evaluations. Writes docs/bench/real_model_grpo/<device>_<time>.json
(command, settings, environment, curve, before/after, time per step, peak memory) and docs/img/real_model_grpo_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_common as bc  # noqa: E402

PROMPT_TEMPLATE = "{prompt} Answer with the number only."


def write_data(out: Path) -> Path:
    """Write chat_sums.train.jsonl / chat_sums.test.jsonl into `out`; return the dataset path to pass as --dataset
    (`chat_sums.jsonl`: the scripts read its `<stem>.<split>.jsonl` siblings)."""
    from shared.task import chat_sums_split

    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (out / f"chat_sums.{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_sums_split(split)))
    return out / "chat_sums.jsonl"


def grpo_args(a, seed: int, dataset: Path, run_dir: Path) -> list[str]:
    return ["algorithms/grpo.py", "--model_name_or_path", "builtin:smollm2-135m", "--chat_template",
            "--dataset", str(dataset), "--prompt_key", "question", "--answer_key", "answer",
            "--prompt_template", PROMPT_TEMPLATE, "--reward_fn", "math", "--output_dir", str(run_dir),
            "--seed", str(seed), "--learning_rate", str(a.learning_rate), "--warmup_steps", "2",
            "--total_episodes", str(a.total_episodes), "--local_num_prompts", "16", "--num_generations", "8",
            "--num_minibatches", "1", "--num_iterations", "1", "--local_micro_batch_size", "32",
            "--max_new_tokens", "32", "--eval_every", str(a.eval_every), "--eval_num_prompts", "100",
            "--eval_num_samples", "4", "--dev_num_prompts", "0", "--save_every", "5", "--sample_every", "5",
            "--generator", a.generator, "--no_gradient_checkpointing",
            *(["--stop_after_steps", str(a.stop_after_steps)] if a.stop_after_steps else [])]


def greedy_accuracy(model_path: str, dataset: Path, generator: str = "vllm") -> dict:
    """Greedy (T = 0) held-out accuracy of a checkpoint with the same prompts, chat template and grader, generated
    by the scripts' vLLM or HF backend (bf16 on GPU, fp32 on CPU)."""
    import torch

    from shared import data
    from shared.distributed import default_dtype, load_causal_lm, load_tokenizer
    from shared.generation import HFGenerator, VLLMGenerator, completion_decoder, stop_token_ids
    from shared.rewards import compute_rewards, load_reward_fn

    tok = load_tokenizer(model_path)
    test = data.load_prompts(str(dataset), "test", tok, "question", "answer", PROMPT_TEMPLATE, True, 256)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if generator == "hf":
        gen = HFGenerator(load_causal_lm(model_path, default_dtype(device)).to(device), tok,
                          stop_token_ids=stop_token_ids(model_path, tok))
    else:
        gen = VLLMGenerator(model_path, tok, default_dtype(device), seed=0, max_model_len=512,
                            stop_token_ids=stop_token_ids(model_path, tok))
    outs = gen.generate(test.prompt_ids, n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0)
    comps = [g[0] for g in outs]
    decode = completion_decoder(tok)
    scores = compute_rewards(load_reward_fn("math"), [r["prompt"] for r in test.rows],
                             [decode(c.token_ids) for c in comps], [r["answer"] for r in test.rows],
                             [c.finished for c in comps], test.rows)
    del gen
    return {"accuracy": sum(scores) / len(scores), "n": len(scores),
            "finished": sum(c.finished for c in comps) / len(comps),
            "mean_tokens": sum(len(c.token_ids) for c in comps) / len(comps),
            "examples": [decode(c.token_ids) for c in comps[:5]]}


def plot(seeds: dict, greedy_start: dict, path: Path, device: str = "CPU") -> None:
    """Held-out sampled accuracy against steps and minutes: every seed (thin), their mean (thick); greedy marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    curves = [r["curve"] for r in seeds.values()]
    for seed, r in seeds.items():
        axes[0].plot([e["step"] for e in r["curve"]], [e["accuracy"] for e in r["curve"]], color="C0", alpha=0.35,
                     lw=1)
        axes[0].plot([t["step"] for t in r["train_reward"]], [t["reward"] for t in r["train_reward"]], color="C1",
                     alpha=0.25, lw=1)
        axes[1].plot([e["minutes"] for e in r["curve"]], [e["accuracy"] for e in r["curve"]], marker=".",
                     label=f"seed {seed}")
    mean = [sum(c[i]["accuracy"] for c in curves) / len(curves) for i in range(min(map(len, curves)))]
    axes[0].plot([e["step"] for e in curves[0][: len(mean)]], mean, color="C0", marker="o",
                 label=f"held-out, sampled (T=1, 4/prompt), mean of {len(curves)} seeds")
    axes[0].plot([], [], color="C1", alpha=0.5, label="training reward (T=1)")
    last = curves[0][-1]["step"]
    finals = [r["greedy_final"]["accuracy"] for r in seeds.values()]
    axes[0].scatter([0] + [last] * len(finals), [greedy_start["accuracy"]] + finals, marker="x", color="k", zorder=3,
                    label="held-out, greedy")
    axes[0].set_xlabel("GRPO step (128 completions each)")
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    axes[1].set_xlabel("wall-clock minutes (2 CPU cores)" if device == "CPU" else f"wall-clock minutes ({device})")
    axes[1].set_ylabel("held-out sampled accuracy")
    axes[1].legend(fontsize=7)
    axes[1].grid(alpha=0.3)
    fig.suptitle(f"GRPO on SmolLM2-135M-Instruct (builtin:smollm2-135m), chat sums, {device}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run_seed(a, seed: int, dataset: Path) -> dict | None:
    """Train one seed (or continue it), then measure it; the result is cached in <out>/seed<k>.json. None when a
    --stop_after_steps slice ended before the run did."""
    cache = a.out / f"seed{seed}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    run_dir = a.out / f"grpo_seed{seed}"
    argv = grpo_args(a, seed, dataset, run_dir)
    command = "python " + " ".join(shlex.quote(x) for x in argv)
    print(f"[bench] seed {seed}: {command}", flush=True)
    child = bc.run_child(argv, a.out / f"log_seed{seed}", env=bc.child_env())
    if not (run_dir / "final" / "config.json").exists():
        print(f"[bench] stopped after a slice (see {child['log']}); rerun the same command to continue")
        return None
    rows = bc.read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "objective/scores" in r]
    evals = [{"step": r["step"], "minutes": r["time"] / 60, "accuracy": r["eval/accuracy"],
              "pass@4": r.get("eval/pass@4")} for r in rows if "eval/accuracy" in r]
    result = {
        "seed": seed, "grpo_command": command, "curve": evals,
        "sampled_start": evals[0]["accuracy"], "sampled_final": evals[-1]["accuracy"],
        "greedy_final": greedy_accuracy(str(run_dir / "final"), dataset, a.generator),
        "train_reward": [{"step": r["step"], "reward": r["objective/scores"], "length": r["val/sequence_lengths"],
                          "stop_rate": r["val/stop_rate"]} for r in steps],
        "seconds_per_step": bc.summarize(bc.iteration_times([r["time"] for r in steps])[1:]),
        "time_split_s_per_step": {k: bc.summarize([r[k] for r in steps if k in r])["median"]
                                  for k in ("time/generate", "time/reward", "time/logprob", "time/train", "time/sync")},
        "total_minutes": rows[-1]["time"] / 60, "peak_rss_mb": child["peak_rss_mb"],
        "loadavg_at_end": list(os.getloadavg()),
    }
    cache.write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "real_model_grpo", help="work directory")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--total_episodes", type=int, default=3200, help="completions (25 steps of 128)")
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--generator", choices=["vllm", "hf"], default="vllm",
                   help="grpo.py's generation backend, also for the greedy evaluations (hf: a machine without vLLM)")
    p.add_argument("--stop_after_steps", type=int, default=0, help="stop (resumable) after this many steps")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "real_model_grpo")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "real_model_grpo_cpu.png")
    p.add_argument("--write_data", type=Path, default=None, help="only write the task's files into this directory")
    a = p.parse_args()
    if a.write_data:
        print(write_data(a.write_data))
        return

    dataset = write_data(a.out / "data")
    seeds = {}
    for seed in a.seeds:
        result = run_seed(a, seed, dataset)
        if result is None:
            return
        seeds[seed] = result
    from shared.models import resolve_model_path

    greedy_start = greedy_accuracy(resolve_model_path("builtin:smollm2-135m"), dataset, a.generator)
    spread = lambda xs: {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}  # noqa: E731
    env = bc.environment()
    env_gpu = env.get("gpu")
    extra = f" --generator {a.generator}" if a.generator != "vllm" else ""
    extra += f" --plot {a.plot.relative_to(ROOT) if a.plot.is_relative_to(ROOT) else a.plot}" if env_gpu else ""
    result = {
        "benchmark": "real_model_grpo", "env": env,
        "command": f"python scripts/experiments/bench_real_model_grpo.py --seeds {' '.join(map(str, a.seeds))} --learning_rate "
                   f"{a.learning_rate} --total_episodes {a.total_episodes}{extra}",
        "model": "builtin:smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized, "
                 f"{'bf16' if env_gpu else 'fp32'})", "generator": a.generator,
        "task": "chat sums a+b, a,b in 0..19: 300 train / 100 held-out prompts, GSM8K-format file, --reward_fn math",
        "settings": {k: str(v) for k, v in vars(a).items()},
        "sampled_accuracy": {"start": spread([r["sampled_start"] for r in seeds.values()]),
                             "final": spread([r["sampled_final"] for r in seeds.values()]),
                             "delta_points": spread([100 * (r["sampled_final"] - r["sampled_start"])
                                                     for r in seeds.values()])},
        "greedy_accuracy": {"start": greedy_start,
                            "final": spread([r["greedy_final"]["accuracy"] for r in seeds.values()])},
        "seeds": {str(k): v for k, v in seeds.items()},
    }
    path = bc.write_result("real_model_grpo", result, a.results, latest=False)
    plot(seeds, greedy_start, a.plot, "CPU" if not env_gpu else env_gpu)
    s = result["sampled_accuracy"]
    print(f"[bench] held-out sampled accuracy {s['start']['mean']:.3f} -> {s['final']['mean']:.3f} (mean of "
          f"{len(seeds)} seeds, final {s['final']['min']:.3f}-{s['final']['max']:.3f}); {path}; {a.plot}")


if __name__ == "__main__":
    main()
