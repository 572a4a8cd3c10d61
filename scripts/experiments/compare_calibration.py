"""Experiment (not a test): Linguistic calibration against an accuracy-only reward, on the built-in task.

    python scripts/experiments/compare_calibration.py                                  # seeds 1 2 3, 51,200 episodes per run
    python scripts/experiments/compare_calibration.py --seeds 1 --total_episodes 5120  # a quick look

Three arms, each seed: the summary-distillation start `builtin:tiny-lc-sft` (no RL); grpo.py from it with the
accuracy reward (1 when the built-in reader's top answer is the gold one, `algorithms.calibration:reader_accuracy`);
calibration.py from it (the reader's log-score reward). Each trained policy's output_dir/final and the start are then
evaluated the same way, on the 500 held-out prompts, one sample each at temperature 1 and greedily, by
calibration.py's reader and metrics (accuracy, ECE with 10 equal-width and 20 equal-count bins, Brier, log-loss).
Finished runs are reused (their output_dir/final exists). Writes docs/bench/calibration/<device>_<time>.json
(rendered into docs/calibration.md by scripts/tools/docs_tables.py) and a reliability diagram (docs/img/).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

ROOT = bc.ROOT
START = "builtin:tiny-lc-sft"
ARMS = ("start", "grpo", "calibration")


def train_argv(arm: str, seed: int, episodes: int, out: Path) -> list[str]:
    common = ["--seed", str(seed), "--total_episodes", str(episodes), "--eval_every", "0", "--sample_every", "0"]
    if arm == "grpo":
        return ["algorithms/grpo.py", "--model_name_or_path", START, "--max_new_tokens", "32", "--reward_fn",
                "algorithms.calibration:reader_accuracy", *common, "--output_dir", str(out)]
    return ["algorithms/calibration.py", *common, "--output_dir", str(out)]


def evaluate(model: str, seed: int, temperature: float) -> tuple[dict, list]:
    """calibration.py's held-out metrics of one policy, and its (confidence, correct) pairs."""
    import torch

    from algorithms.calibration import evaluate_calibration, parser_reader, top_answer  # noqa: F401
    from shared import data as data_utils
    from shared.distributed import init_distributed, load_causal_lm, load_tokenizer
    from shared.evaluation import eval_seed
    from shared.generation import completion_decoder, make_generator
    from shared.models import resolve_model_path
    from shared.rewards import load_reward_fn

    info, path = init_distributed(), resolve_model_path(model)
    tok = load_tokenizer(path)
    policy = load_causal_lm(path, torch.float32).eval()
    data = data_utils.load_prompts("builtin", "test", tok, limit=500, max_prompt_length=256)
    gen = make_generator("hf", model_path=path, model=policy, tokenizer=tok, dtype=torch.float32, seed=seed,
                         max_model_len=288, world_size=1, zero_stage=0)
    pairs = []

    def read(rows, texts, finished):  # the parser reader, keeping what the diagram needs
        forecasts, p_golds = parser_reader(rows, texts, finished)
        pairs.extend((top_answer(f)[1], top_answer(f)[0] == str(r["answer"])) for f, r in zip(forecasts, rows))
        return forecasts, p_golds

    metrics = evaluate_calibration(gen, data, read, load_reward_fn("builtin"), completion_decoder(tok), info, 1,
                                   temperature, 32, eval_seed(seed), 1e-4, "eval")
    return {k.split("/")[1]: v for k, v in metrics.items()}, pairs


def diagram(pairs: dict[str, list], path: Path) -> None:
    """Reliability diagram, 10 equal-width bins pooled over seeds: accuracy against mean confidence, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k:", label="calibrated")
    for arm, ps in pairs.items():
        conf, corr = np.array([c for c, _ in ps]), np.array([float(k) for _, k in ps])
        idx = np.digitize(conf, np.linspace(0, 1, 11)) - 1
        idx[conf == 1] = 9
        xs = [conf[idx == b].mean() for b in range(10) if (idx == b).any()]
        ys = [corr[idx == b].mean() for b in range(10) if (idx == b).any()]
        ns = [int((idx == b).sum()) for b in range(10) if (idx == b).any()]
        ax.plot(xs, ys, "o-", label=arm)
        for x, y, n in zip(xs, ys, ns):
            ax.annotate(str(n), (x, y), fontsize=6, textcoords="offset points", xytext=(3, -8))
    ax.set_xlabel("reader's confidence in its top answer (bin mean)")
    ax.set_ylabel("accuracy in the bin")
    ax.set_title("held-out, T = 1, seeds pooled; numbers: samples per bin", fontsize=8)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--total_episodes", type=int, default=51200)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "calibration", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "calibration")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "calibration_reliability.png")
    a = p.parse_args()
    a.plot = a.plot.resolve()
    env = bc.environment()
    runs, pairs, commands = {arm: {} for arm in ARMS}, {arm: [] for arm in ARMS}, {}
    for seed in a.seeds:
        for arm in ARMS:
            model = START
            if arm != "start":
                out = a.out / f"{arm}_seed{seed}"
                argv = train_argv(arm, seed, a.total_episodes, out)
                commands[arm] = "python " + shlex.join(argv[:-2]).replace(f"--seed {seed}", "--seed <k>")
                if not (out / "final" / "config.json").exists():
                    print(f"[calibration] python {shlex.join(argv)}", flush=True)
                    bc.run_child(argv, a.out / f"log_{arm}_seed{seed}")
                model = str(out / "final")
            sampled, ps = evaluate(model, seed, 1.0)
            greedy, _ = evaluate(model, seed, 0.0)
            runs[arm][seed] = {"sampled": sampled, "greedy": greedy}
            pairs[arm] += ps
            print(f"[calibration] seed {seed} {arm}: {sampled}", flush=True)
    diagram(pairs, a.plot)
    result = {"benchmark": "calibration", "env": env, "command": bc.invocation(), "seeds": a.seeds,
              "total_episodes": a.total_episodes, "start": START, "train_commands": commands, "runs": runs,
              "plot": str(a.plot.relative_to(ROOT)) if ROOT in a.plot.parents else str(a.plot)}
    path = bc.write_result("calibration", result, a.results, latest=False)
    print(f"[calibration] wrote {path}", flush=True)


if __name__ == "__main__":
    main()
