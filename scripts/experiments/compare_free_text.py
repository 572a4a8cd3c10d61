"""Experiment (not a test): free-text metrics and LLM-judge win rates of sft.py, dpo.py, ppo_rlhf.py and drca.py against
the SFT start: docs/evaluate_text.md.

    python scripts/experiments/compare_free_text.py --seeds 1 2 3

Per seed, trains sft.py (its default run, from builtin:tiny), dpo.py (its default run), ppo_rlhf.py and drca.py
(--rl_episodes completions each; both on builtin:tiny-rm), the last three from builtin:tiny-sft, the SFT start. Then
algorithms/evaluate_text.py scores each final model and the start, greedy on --num_prompts held-out prompts of the
built-in task: BLEU against the reference solutions, BERTScore F1 (encoder builtin:tiny-sft), the perplexity of the
completions under the start, and builtin:tiny-rm's normalised score. Last, a judge (builtin:smollm2-135m, the chat
model that ships offline, served by vLLM's OpenAI server, --judge_structured) grades the first --judge_prompts
predictions of each: the three rubric scores, and the win rate against the start's predictions in both orders (the
start against itself: the position-bias check). Writes runs/compare_free_text/... and docs/results/free_text.json
with the commands and the machine; `render` draws its table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_common as bc  # noqa: E402

ARMS = ["sft", "dpo", "ppo_rlhf", "drca"]
SHOWN = [("eval/bleu", "BLEU", 1), ("eval/sentence_bleu", "sentence BLEU", 1), ("eval/bertscore_f1", "BERTScore F1", 4),
         ("eval/perplexity", "perplexity under the start", 3), ("eval/reward/rm", "tiny-rm score (normalised)", 3)]
JUDGED = [("eval/judge/factual_accuracy", "factual accuracy", 2), ("eval/judge/logical_soundness", "logical soundness", 2),
          ("eval/judge/efficiency", "efficiency", 2), ("eval/judge/win_rate", "win rate vs the start", 3)]


def spread(vals: list[float]) -> dict:
    return {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals), "per_seed": vals}


def run(cmd: list[str], log: Path | None = None) -> None:
    print("python " + shlex.join(cmd), flush=True)
    if log is None:
        subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT, env=bc.child_env())
        return
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=bc.child_env(), stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"error: {shlex.join(cmd)} failed ({proc.returncode}); see {log}")


def start_judge(model: str, port: int, log: Path) -> subprocess.Popen:
    from shared.models import resolve_model_path

    cmd = ["-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model_path(model), "--served-model-name",
           "judge", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--enforce-eager",
           "--dtype", "float32"]
    env = bc.child_env({"VLLM_CPU_KVCACHE_SPACE": "2", "TORCHDYNAMO_DISABLE": "1"})
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"error: the judge server exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit(f"error: the judge server did not start in 600 s; see {log}")


def head(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:n]))
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rl_episodes", type=int, default=5120, help="completions sampled by ppo_rlhf.py and drca.py")
    p.add_argument("--num_prompts", type=int, default=200, help="held-out prompts scored by evaluate_text.py")
    p.add_argument("--judge_prompts", type=int, default=40, help="of those, the first ones the judge grades")
    p.add_argument("--judge_model", default="builtin:smollm2-135m")
    p.add_argument("--port", type=int, default=18777)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_free_text")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    a = p.parse_args()
    summary: dict = {"env": bc.environment(), "command": bc.invocation(), "seeds": a.seeds, "commands": {},
                     "num_prompts": a.num_prompts, "judge_prompts": a.judge_prompts, "judge_model": a.judge_model}
    a.out.mkdir(parents=True, exist_ok=True)
    rel = lambda path: str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)  # noqa: E731
    train = {"sft": ["algorithms/sft.py"], "dpo": ["algorithms/dpo.py"],
             "ppo_rlhf": ["algorithms/ppo_rlhf.py", "--total_episodes", str(a.rl_episodes)],
             "drca": ["algorithms/drca.py", "--total_episodes", str(a.rl_episodes)]}
    common = ["--save_every", "0", "--resume", "no"]
    for seed in a.seeds:
        for arm in ARMS:
            run_dir = a.out / f"{arm}_seed{seed}"
            cmd = [*train[arm], "--seed", str(seed), "--output_dir", rel(run_dir), *common]
            summary["commands"][f"train_{arm}"] = "python " + shlex.join([*train[arm], "--seed", "SEED", *common])
            if not (run_dir / "final" / "config.json").exists():
                run(cmd, a.out / f"{arm}_seed{seed}.log")
    metrics = ["--eval_num_prompts", str(a.num_prompts), "--bertscore_model", "builtin:tiny-sft",
               "--bertscore_num_layers", "2", "--perplexity_model", "builtin:tiny-sft", "--verifiers",
               "rm=builtin:tiny-rm", "--num_bootstrap", "0"]
    evals = {("start", 0): "builtin:tiny-sft"}
    evals.update({(arm, seed): rel(a.out / f"{arm}_seed{seed}" / "final") for seed in a.seeds for arm in ARMS})
    (a.out / "eval").mkdir(exist_ok=True)
    for (arm, seed), model in evals.items():
        out = a.out / "eval" / f"{arm}_seed{seed}"
        cmd = ["algorithms/evaluate_text.py", "--model_name_or_path", model, "--output_dir", rel(out), *metrics]
        summary["commands"]["evaluate"] = "python " + shlex.join([*cmd[:2], "MODEL", cmd[3], "DIR", *metrics])
        if not (out / "summary.json").exists():
            run(cmd, a.out / "eval" / f"{arm}_seed{seed}.log")
    judge = None
    try:
        base = head(a.out / "eval" / "start_seed0" / "predictions.jsonl", a.out / "eval" / "start_head.jsonl",
                    a.judge_prompts)
        for (arm, seed) in evals:
            out = a.out / "judge" / f"{arm}_seed{seed}"
            (a.out / "judge").mkdir(exist_ok=True)
            preds = head(a.out / "eval" / f"{arm}_seed{seed}" / "predictions.jsonl",
                         a.out / "judge" / f"{arm}_seed{seed}_head.jsonl", a.judge_prompts)
            flags = ["--judge_base_url", f"http://127.0.0.1:{a.port}/v1", "--judge_structured", "--judge_max_tokens",
                     "4", "--judge_baseline_path", rel(base), "--verifiers", "--num_bootstrap", "0"]
            cmd = ["algorithms/evaluate_text.py", "--predictions_path", rel(preds), "--output_dir", rel(out), *flags]
            summary["commands"]["judge"] = "python " + shlex.join([*cmd[:2], "PREDICTIONS", cmd[3], "DIR", *flags])
            if not (out / "summary.json").exists():
                if judge is None:
                    judge = start_judge(a.judge_model, a.port, a.out / "judge_server.log")
                run(cmd, a.out / "judge" / f"{arm}_seed{seed}.log")
    finally:
        if judge is not None:
            judge.terminate()
            judge.wait(60)
    summary["commands"]["judge_server"] = ("python -m vllm.entrypoints.openai.api_server --model JUDGE_DIR "
                                           f"--served-model-name judge --port {a.port} --max-model-len 2048 "
                                           "--enforce-eager --dtype float32")
    summary["commands"]["placeholders"] = ("SEED: each seed; MODEL: builtin:tiny-sft or a run's final/; DIR: its output "
                                           "directory; PREDICTIONS: the first --judge_prompts lines of its "
                                           "predictions.jsonl; JUDGE_DIR: the directory of --judge_model")
    read = lambda kind, arm, seed: json.loads((a.out / kind / f"{arm}_seed{seed}" / "summary.json").read_text())  # noqa: E731
    for arm in ["start", *ARMS]:
        seeds = [0] if arm == "start" else a.seeds
        ms = [read("eval", arm, s)["metrics"] for s in seeds]
        js = [read("judge", arm, s)["metrics"] for s in seeds]
        entry = {k: spread([m[k] for m in ms]) for k, _, _ in SHOWN if all(k in m for m in ms)}
        entry.update({k: spread([m[k] for m in js]) for k, _, _ in JUDGED if all(k in m for m in js)})
        for k in ("judge/questions", "judge/failed", "judge/unparsed", "eval/judge/win_rate/count"):
            entry[k] = [m.get(k, 0) for m in js]
        summary[arm] = entry
    summary["env"]["builtin_models"] = bc.builtin_models()
    a.results.mkdir(parents=True, exist_ok=True)
    path = a.results / "free_text.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(render(summary))
    print(f"wrote {path}")


def render(d: dict) -> str:
    """The table of docs/results/free_text.json: each model's metrics, mean (min-max) over seeds."""
    def cell(arm: str, key: str, digits: int) -> str:
        v = d[arm].get(key)
        if v is None:
            return "-"
        if len(v["per_seed"]) == 1:
            return f"{v['mean']:.{digits}f}"
        return f"{v['mean']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"

    # corpus BLEU is stored but not shown when it is 0 for every model (no completion of the built-in task has a 4-gram)
    zero_bleu = all(d[arm].get("eval/bleu", {}).get("max", 1) == 0 for arm in ["start", *ARMS])
    cols = [c for c in SHOWN if not (zero_bleu and c[0] == "eval/bleu")] + JUDGED
    lines = ["| model | " + " | ".join(name for _, name, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    names = {"start": "SFT start (`builtin:tiny-sft`)", "sft": "`sft.py`", "dpo": "`dpo.py`",
             "ppo_rlhf": "`ppo_rlhf.py`", "drca": "`drca.py`"}
    for arm in ["start", *ARMS]:
        lines.append(f"| {names[arm]} | " + " | ".join(cell(arm, k, n) for k, _, n in cols) + " |")
    unparsed = sum(sum(d[arm]["judge/unparsed"]) for arm in ["start", *ARMS])
    failed = sum(sum(d[arm]["judge/failed"]) for arm in ["start", *ARMS])
    asked = sum(sum(d[arm]["judge/questions"]) for arm in ["start", *ARMS])
    lines.append("")
    lines.append(f"Seeds {', '.join(map(str, d['seeds']))} (the start: one greedy evaluation); {d['num_prompts']} held-out "
                 f"prompts of the built-in task, greedy; the judge ({d['judge_model']}, structured replies) on the first "
                 f"{d['judge_prompts']} of them: {asked} questions, {failed} failed, {unparsed} unparsed."
                 + (" Corpus BLEU is 0 for every model (three-number answers hold no 4-gram)." if zero_bleu else "")
                 + " "
                 f"`{d['command']}`, {d['env']['device']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
