"""GRPO learning on a real pretrained chat model, SmolLM2-135M-Instruct, on CPU (a benchmark, not a test).

    python scripts/bench_real_model_grpo.py                        # about an hour on 2 CPU cores; writes the JSON + PNG
    python scripts/bench_real_model_grpo.py --stop_after_steps 10  # a time-limited slice; rerun the same to continue
    python scripts/bench_real_model_grpo.py --write_data data/     # only write the task's GSM8K-format files

Task ("chat sums", shared/task.py): "What is 12+7?" for operands 0..19, 400 problems, 100 held out and 300 for
training (disjoint, fixed), written as a GSM8K-format local file pair `chat_sums.{train,test}.jsonl` (question /
answer "12 + 7 = 19\\n#### 19"), asked through the model's chat template with " Answer with the number only."
appended. Reward: `--reward_fn math` (Minerva extraction: "The answer is N", else the last number; 0 if the turn
did not end). GSM8K's own grader needs a "#### N" line that this model almost never writes: see
scripts/real_model_prompts.py and docs/real_models.md for the measured rates of each prompt/grader pair.

Runs algorithms/grpo.py as a user would (one process, vLLM generation, the flags below), then evaluates the start
and final checkpoints greedily (vLLM, T = 0) on the same 100 held-out prompts. Held-out sampled accuracy (T = 1,
4 samples per prompt) comes from grpo.py's own evaluations. Writes docs/bench/real_model_grpo/<device>_<time>.json
(command, settings, environment, curve, before/after, time per step, peak memory) and docs/img/real_model_grpo_cpu.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def grpo_args(a, dataset: Path, run_dir: Path) -> list[str]:
    return ["algorithms/grpo.py", "--model_name_or_path", "builtin:smollm2-135m", "--chat_template",
            "--dataset", str(dataset), "--prompt_key", "question", "--answer_key", "answer",
            "--prompt_template", PROMPT_TEMPLATE, "--reward_fn", "math", "--output_dir", str(run_dir),
            "--seed", str(a.seed), "--learning_rate", str(a.learning_rate), "--warmup_steps", "2",
            "--total_episodes", str(a.total_episodes), "--local_num_prompts", "16", "--num_generations", "8",
            "--num_minibatches", "1", "--num_iterations", "1", "--local_micro_batch_size", "32",
            "--max_new_tokens", "32", "--eval_every", str(a.eval_every), "--eval_num_prompts", "100",
            "--eval_num_samples", "4", "--save_every", "5", "--sample_every", "5",
            *(["--stop_after_steps", str(a.stop_after_steps)] if a.stop_after_steps else [])]


def greedy_accuracy(model_path: str, dataset: Path) -> dict:
    """Greedy (T = 0) held-out accuracy of a checkpoint with the same prompts, chat template and grader."""
    import torch

    from shared import data
    from shared.distributed import load_tokenizer
    from shared.generation import VLLMGenerator, completion_decoder, stop_token_ids
    from shared.rewards import compute_rewards, load_reward_fn

    tok = load_tokenizer(model_path)
    test = data.load_prompts(str(dataset), "test", tok, "question", "answer", PROMPT_TEMPLATE, True, 256)
    gen = VLLMGenerator(model_path, tok, torch.float32, seed=0, max_model_len=512,
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


def plot(rows: list[dict], greedy: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [(r["step"], r["time"] / 60, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [(r["step"], r["objective/scores"]) for r in rows if "objective/scores" in r]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    axes[0].plot([e[0] for e in evals], [e[2] for e in evals], marker="o", label="held-out, sampled (T=1, 4/prompt)")
    axes[0].plot([t[0] for t in train], [t[1] for t in train], alpha=0.5, label="training reward (T=1)")
    last = evals[-1][0]
    axes[0].scatter([0, last], [greedy["start"]["accuracy"], greedy["final"]["accuracy"]], marker="x", color="k",
                    zorder=3, label="held-out, greedy")
    axes[0].set_xlabel("GRPO step (128 completions each)")
    axes[0].set_ylabel("accuracy")
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    axes[1].plot([e[1] for e in evals], [e[2] for e in evals], marker="o")
    axes[1].set_xlabel("wall-clock minutes (2 CPU cores)")
    axes[1].set_ylabel("held-out sampled accuracy")
    axes[1].grid(alpha=0.3)
    fig.suptitle("GRPO on SmolLM2-135M-Instruct (builtin:smollm2-135m), chat sums, CPU", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "real_model_grpo", help="work directory")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--total_episodes", type=int, default=3200, help="completions (25 steps of 128)")
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--stop_after_steps", type=int, default=0, help="stop (resumable) after this many steps")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "real_model_grpo")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "real_model_grpo_cpu.png")
    p.add_argument("--write_data", type=Path, default=None, help="only write the task's files into this directory")
    a = p.parse_args()
    if a.write_data:
        print(write_data(a.write_data))
        return

    dataset = write_data(a.out / "data")
    run_dir = a.out / f"grpo_seed{a.seed}"
    argv = grpo_args(a, dataset, run_dir)
    command = "python " + " ".join(shlex.quote(x) for x in argv)
    print(f"[bench] {command}", flush=True)
    child = bc.run_child(argv, a.out / f"log_seed{a.seed}", env=bc.child_env())
    if not (run_dir / "final" / "config.json").exists():
        print(f"[bench] stopped after a slice (see {child['log']}); rerun the same command to continue")
        return
    rows = bc.read_jsonl(run_dir / "metrics.jsonl")
    from shared.models import resolve_model_path

    greedy = {"start": greedy_accuracy(resolve_model_path("builtin:smollm2-135m"), dataset),
              "final": greedy_accuracy(str(run_dir / "final"), dataset)}
    evals = [{"step": r["step"], "minutes": r["time"] / 60, "accuracy": r["eval/accuracy"],
              "pass@4": r.get("eval/pass@4")} for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "objective/scores" in r]
    step_times = bc.iteration_times([r["time"] for r in steps])[1:]
    result = {
        "benchmark": "real_model_grpo", "env": bc.environment(), "command": f"python scripts/bench_real_model_grpo.py "
        f"--seed {a.seed} --learning_rate {a.learning_rate} --total_episodes {a.total_episodes}",
        "grpo_command": command, "model": "builtin:smollm2-135m (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized, fp32)",
        "task": "chat sums a+b, a,b in 0..19: 300 train / 100 held-out prompts, GSM8K-format file, --reward_fn math",
        "settings": {k: str(v) for k, v in vars(a).items()},
        "sampled_accuracy": {"start": evals[0]["accuracy"], "final": evals[-1]["accuracy"],
                             "delta_points": 100 * (evals[-1]["accuracy"] - evals[0]["accuracy"])},
        "greedy_accuracy": greedy, "curve": evals,
        "train_reward": [{"step": r["step"], "reward": r["objective/scores"], "length": r["val/sequence_lengths"],
                          "stop_rate": r["val/stop_rate"]} for r in steps],
        "seconds_per_step": bc.summarize(step_times), "total_minutes": rows[-1]["time"] / 60,
        "time_split_s_per_step": {k: bc.summarize([r[k] for r in steps if k in r])["median"]
                                  for k in ("time/generate", "time/reward", "time/logprob", "time/train", "time/sync")},
        "peak_rss_mb": child["peak_rss_mb"],
    }
    path = bc.write_result("real_model_grpo", result, a.results)
    plot(rows, greedy, a.plot)
    s = result["sampled_accuracy"]
    print(f"[bench] held-out sampled accuracy {s['start']:.3f} -> {s['final']:.3f} ({s['delta_points']:+.1f} points), "
          f"greedy {greedy['start']['accuracy']:.3f} -> {greedy['final']['accuracy']:.3f}; {path}; {a.plot}")


if __name__ == "__main__":
    main()
