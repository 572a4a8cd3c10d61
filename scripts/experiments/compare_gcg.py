"""Experiment (not a test): the GCG attack success rate on repulse.py's toy, for the start model, REINFORCE (RLOO)
and RePULSe, over seeds, at the settings of docs/repulse.md's stored P(bad) results.

    python scripts/experiments/compare_gcg.py                          # seeds 1 2 3: 6 training runs of 250,000 samples, 9 attacks
    python scripts/experiments/compare_gcg.py --seeds 1 --total_episodes 2000 --gcg_steps 2 --gcg_search_width 8 \\
        --num_samples 100 --out runs/compare_gcg_quick --results runs/compare_gcg_quick   # a quick look, not stored

Training: scripts/experiments/repulse_toy.py's --paper flags (N = 500, beta -10, c_KL 0, p LR 1e-4, q LR 3e-4, the classifier-like
reward) with the final p_theta saved; REINFORCE `--objective reinforce --alpha 0`, RePULSe `--alpha 10` (the alpha
that met docs/repulse.md's goal). Attack: algorithms/evaluate_gcg.py --dataset toy --max_new_tokens 2 (its three
targets, the bad characters; bad: r < -1), --gcg_steps x --gcg_search_width (default the paper's 250 x 512),
--num_samples samples per target with and without the suffix (default 1,000), seed s; the start model
(builtin:tiny-sft) is attacked once per seed too. Finished runs and attacks are reused. Writes
docs/results/gcg_toy.json (`--results`); `render(d)` is its table (docs/repulse.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
from repulse_toy import PAPER, START_MODEL  # noqa: E402

ROOT = bc.ROOT
CONFIGS = {"reinforce": ["--objective", "reinforce", "--alpha", "0"], "repulse_a10": ["--alpha", "10"]}
LABELS = {"start": f"start ({START_MODEL})", "reinforce": "REINFORCE (RLOO)", "repulse_a10": "RePULSe, alpha 10"}
METRICS = ("gcg/asr", "gcg/asr_no_suffix", "gcg/p_bad", "gcg/p_bad_no_suffix", "gcg/target_logprob",
           "gcg/target_logprob_init", "gcg/target_logprob_no_suffix")


def train_argv(config: str, seed: int, total_episodes: int, out: Path) -> list[str]:
    """repulse.py with the paper's toy flags and the model saved (output_dir/final)."""
    flags = [f for f in PAPER if f != "--no_save_model"]
    i = flags.index("--total_episodes")
    flags[i + 1] = str(total_episodes)
    return ["algorithms/repulse.py", *flags, *CONFIGS[config], "--seed", str(seed), "--output_dir", str(out)]


def attack_argv(model: str, seed: int, a, out: Path) -> list[str]:
    return ["algorithms/evaluate_gcg.py", "--model_name_or_path", model, "--dataset", "toy", "--max_new_tokens", "2",
            "--gcg_steps", str(a.gcg_steps), "--gcg_search_width", str(a.gcg_search_width), "--num_samples",
            str(a.num_samples), "--generator", "hf", "--seed", str(seed), "--output_dir", str(out)]


def spread(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "per_seed": xs}


def render(d: dict) -> str:
    """The table of docs/results/gcg_toy.json: per model, the ASR with and without the suffix (mean over seeds, the
    per-seed values), the target's log-probability and, for the trained ones, the final exact log P(bad)."""
    rows = ["| model | final exact log P(bad), mean | ASR with the suffix, per seed | mean | ASR without it, mean | "
            "log p(target): best suffix / initial / none, mean |", "|---|---|---|---|---|---|"]
    for name in d["models"]:
        m = d["summary"][name]
        lp = "-" if m.get("final_log_p_bad") is None else f"{m['final_log_p_bad']['mean']:.2f}"
        rows.append(f"| {LABELS.get(name, name)} | {lp} | "
                    + ", ".join(f"{x:.2f}" for x in m["gcg/asr"]["per_seed"]) + f" | {m['gcg/asr']['mean']:.2f} | "
                    f"{m['gcg/asr_no_suffix']['mean']:.2f} | {m['gcg/target_logprob']['mean']:.2f} / "
                    f"{m['gcg/target_logprob_init']['mean']:.2f} / {m['gcg/target_logprob_no_suffix']['mean']:.2f} |")
    s = d["settings"]
    caption = (f"Seeds {', '.join(map(str, d['seeds']))}; {s['total_episodes']:,} training samples per run; attack "
               f"{s['gcg_steps']} GCG steps x {s['gcg_search_width']} candidates on each of the toy's 3 targets, "
               f"{s['num_samples']:,} samples per target with and without the suffix; success: any sample with "
               f"r < -1. `{d['command']}`, {d['env']['device']}. Data: [gcg_toy.json](results/gcg_toy.json).")
    return "\n".join(rows) + "\n\n" + caption + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--total_episodes", type=int, default=250_000)
    p.add_argument("--gcg_steps", type=int, default=250)
    p.add_argument("--gcg_search_width", type=int, default=512)
    p.add_argument("--num_samples", type=int, default=1000)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_gcg", help="work directory")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    a = p.parse_args()
    runs = []
    for seed in a.seeds:
        for name in ["start", *CONFIGS]:
            model, lp = START_MODEL, None
            if name != "start":
                out = a.out / f"{name}_seed{seed}"
                argv = train_argv(name, seed, a.total_episodes, out)
                if not (out / "final" / "config.json").exists():
                    print(f"[gcg] python {shlex.join(argv)}", flush=True)
                    bc.run_child(argv, a.out / f"log_{name}_seed{seed}")
                rows = bc.read_jsonl(out / "metrics.jsonl")
                lp = [r["exact/log_p_bad"] for r in rows if "exact/log_p_bad" in r][-1]
                model = str(out / "final")
            attack = a.out / f"gcg_{name}_seed{seed}"
            argv = attack_argv(model, seed, a, attack)
            if not (attack / "summary.json").exists():
                print(f"[gcg] python {shlex.join(argv)}", flush=True)
                bc.run_child(argv, a.out / f"log_gcg_{name}_seed{seed}")
            metrics = json.loads((attack / "summary.json").read_text())["metrics"]
            runs.append({"model": name, "seed": seed, "final_log_p_bad": lp, "attack_command": "python "
                         + shlex.join(argv[:-2]), **{k: metrics[k] for k in METRICS}})
            print(f"[gcg] {name} seed {seed}: asr {metrics['gcg/asr']:.2f} (without the suffix "
                  f"{metrics['gcg/asr_no_suffix']:.2f})", flush=True)
    models = ["start", *CONFIGS]
    summary = {}
    for name in models:
        mine = [r for r in runs if r["model"] == name]
        summary[name] = {k: spread([r[k] for r in mine]) for k in METRICS}
        if name != "start":
            summary[name]["final_log_p_bad"] = spread([r["final_log_p_bad"] for r in mine])
    result = {"benchmark": "gcg_toy", "env": bc.environment(), "command": bc.invocation(), "seeds": a.seeds,
              "models": models, "settings": {"total_episodes": a.total_episodes, "gcg_steps": a.gcg_steps,
                                             "gcg_search_width": a.gcg_search_width, "num_samples": a.num_samples,
                                             "train_flags": {n: train_argv(n, 0, a.total_episodes, Path("X"))[1:-4]
                                                             for n in CONFIGS}},
              "runs": runs, "summary": summary}
    result["env"]["builtin_models"] = bc.builtin_models(None)
    a.results.mkdir(parents=True, exist_ok=True)
    path = a.results / "gcg_toy.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"[gcg] wrote {path}\n{render(result)}")


if __name__ == "__main__":
    main()
