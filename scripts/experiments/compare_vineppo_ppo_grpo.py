"""Experiment (not a test): PPO vs VinePPO vs GRPO on `builtin:sums-6` (docs/vineppo.md).

    python scripts/experiments/compare_vineppo_ppo_grpo.py                          # everything, resumable (rerun to continue)
    python scripts/experiments/compare_vineppo_ppo_grpo.py --budget_minutes 150     # stop before a unit would pass 150 min
    python scripts/experiments/compare_vineppo_ppo_grpo.py --status                 # what is done, nothing run

1. The SFT start, built once into `<out>/sft_start` like shared/tiny.py builds `builtin:tiny-sft`: sft.py's
   calibration recipe for `builtin:sums-6` (scripts/experiments/calibrate_sums.py: default flags, `--max_new_tokens 18`,
   seed 1) from `builtin:tiny`, in a child process under `shared.tiny.BUILD_ENV` (CPU, one thread, AVX2 pinned),
   so every machine starts from the same weights; `build.json` records the SHA-256 of the weights. One start model
   for every algorithm and seed: the seeds vary the RL runs (sampling, minibatch order), not the start.
2. PPO, VinePPO (K = 9 MC rollouts per state, as in the paper) and GRPO from that start, `--seeds` (3), with the
   same prompts per step (64 prompts x 8 completions: `--local_num_prompts 64 --num_generations 8` in all three),
   the same total (`--total_episodes` completions), the same optimizer steps per rollout step (2 passes x 2
   minibatches: `--num_iterations 2 --num_minibatches 2`), the same learning-rate schedule (constant `--learning_rate` after 5 warm-up steps; PPO's
   critic keeps its own 3e-4) and the same held-out evaluation (500 test prompts x 4 samples at T = 1, every
   `--eval_every` rollout steps, the same sampling seed for all three). Everything else is each script's default
   (PPO and VinePPO: clip 0.2, k3 KL loss 1e-4; GRPO: clip 0.2/0.28, no KL, its group-normalised advantage).
   Work goes in chunks of `--chunk_steps` rollout steps per invocation (each script's `--stop_after_steps`; a rerun
   of the same command continues from `output_dir/checkpoints`, bit for bit on CPU), round-robin over the runs
   (ppo s1, vineppo s1, grpo s1, ppo s2, ... then the next chunk of each), so machine load affects all alike.
3. Value prediction (scripts/experiments/value_prediction.py) on each seed's final PPO policy: its critic and the K = 9 MC
   estimate against 256-rollout ground truth, per step position.
4. Once everything is done: `--results` (docs/results/vineppo_vs_ppo.json) and `--plot` (held-out accuracy
   against gradient steps and against training seconds: mean over seeds, min-max band).

Reported per seed and algorithm: final held-out accuracy; gradient (policy optimizer) steps and training seconds to
first reach PPO's final accuracy of that seed (null if never), read at the evaluations, so resolved to
`--eval_every` rollout steps (the result says the resolution of each). Training seconds are the summed phase times
of the training steps (generate, reward, MC values, log-probs, update, weight sync), without the held-out
evaluations, set-up and checkpointing: the same for a run done in one go or in chunks, and independent of the
evaluation frequency.

A K ablation needs no new PPO runs: PPO does not read `--k`, so `--ppo_from <another out>` copies that directory's
finished PPO runs and SFT start, after checking the same start weights and every PPO flag (paths aside); the result
names them and their sessions (`ppo_runs_from`):

    python scripts/experiments/compare_vineppo_ppo_grpo.py --k 16 --algos ppo vineppo --ppo_from runs/vineppo_k3 --out runs/vineppo_k16
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402
import calibrate_sums  # noqa: E402

ROOT = bc.ROOT
ALGOS = ("ppo", "vineppo", "grpo")
TASK, TERMS, MAX_NEW_TOKENS, SFT_SEED = "builtin:sums-6", 6, 18, 1
# phases of a training step in metrics.jsonl (ppo.py, vineppo.py, grpo.py: Timer); time/eval is left out
# SHA-256 of the SFT start's weights on x86-64 (torch 2.13.0, transformers 5.19.0) since sft.py's fused AdamW
# (0ea16ae); docs/results/vineppo_vs_ppo.json's runs started from the earlier build, 2b1a96d56eee (built twice, the same)
EXPECTED_SFT_SHA256 = "e461b7ba35905fee8ae8f9a88d61f76e8420b29af73e32c4c7bd963da7b2db3f"
TRAIN_PHASES = ("time/generate", "time/reward", "time/value_estimation", "time/logprob", "time/train", "time/sync")


# --- pure helpers (tests/test_vineppo_experiment.py) ------------------------------------------------------------
def run_argv(algo: str, seed: int, output_dir: Path, start: str, a) -> list[str]:
    """The script and flags of one run (without --stop_after_steps, which may change between invocations)."""
    common = ["--model_name_or_path", start, "--dataset", TASK, "--max_new_tokens", str(MAX_NEW_TOKENS),
              "--seed", str(seed), "--output_dir", str(output_dir), "--total_episodes", str(a.total_episodes),
              "--learning_rate", str(a.learning_rate), "--warmup_steps", "5", "--local_num_prompts", "64",
              "--num_minibatches", "2", "--temperature", "1.0", "--eval_every", str(a.eval_every),
              "--eval_num_prompts", str(a.eval_num_prompts), "--eval_num_samples", "4", "--eval_temperature", "1.0",
              "--dev_num_prompts", "0", "--best_metric", "", "--save_every", str(a.chunk_steps or 25),
              "--local_micro_batch_size", "256"]  # one micro-batch per minibatch, as the stored runs (then the default)
    # no gradient checkpointing, as the stored runs (the default until 2026-11-26; the same numbers, less time)
    if algo == "grpo":  # a group of 8 completions per prompt: 64 x 8, as ppo / vineppo sample
        return [f"algorithms/{algo}.py", *common, "--num_generations", "8", "--num_iterations", "2",
                "--no_gradient_checkpointing"]
    extra = ["--num_mc_rollouts", str(a.k)] if algo == "vineppo" else []
    return [f"algorithms/{algo}.py", *common, "--num_generations", "8", "--num_iterations", "2", *extra,
            "--no_gradient_checkpointing"]


def argv_mismatches(argv: list[str], recorded: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of `argv` (a script and its `--flag value` / `--no_flag` words) whose value differs from a run's
    recorded args.json, `skip` left out: what a reused run would have run differently."""
    out, i = [], 1
    while i < len(argv):
        name = argv[i][2:]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 2
        elif name.startswith("no_") and name[3:] in recorded:
            name, value, i = name[3:], False, i + 1
        else:
            value, i = True, i + 1
        if name in skip:
            continue
        have = recorded.get(name, "<absent>")
        same = have == value if isinstance(value, bool) else (
            str(have) == value or (isinstance(have, (int, float)) and not isinstance(have, bool)
                                   and _number(value) == have))
        if not same:
            out.append(f"--{name}: {have!r} recorded, {value!r} now")
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def optimizer_steps(step: int, args: dict) -> int:
    """Policy optimizer (gradient) steps after `step` rollout steps: passes x minibatches per rollout step."""
    return step * args.get("num_ppo_epochs", args.get("num_iterations", 1)) * args["num_minibatches"]


def curve(rows: list[dict], args: dict) -> list[dict]:
    """The held-out evaluations of a run's metrics.jsonl rows: rollout step, gradient steps, training seconds up to
    that step (summed TRAIN_PHASES of the steps <= it) and eval/accuracy."""
    seconds, total, out = {}, 0.0, []
    for r in sorted((r for r in rows if "time/train" in r), key=lambda r: r["step"]):
        total += sum(r.get(k, 0.0) for k in TRAIN_PHASES)
        seconds[r["step"]] = total
    for r in rows:
        if "eval/accuracy" in r:
            out.append({"step": r["step"], "gradient_steps": optimizer_steps(r["step"], args),
                        "train_seconds": seconds.get(r["step"], 0.0), "accuracy": r["eval/accuracy"]})
    return sorted(out, key=lambda x: x["step"])


def first_reach(points: list[dict], target: float, consecutive: int = 1) -> dict | None:
    """The first evaluation with accuracy >= target that `consecutive` - 1 later evaluations also reach (None if
    never). consecutive = 1 is the plain definition; 2 (reported beside it, fixed before any run) keeps a
    curve that plateaus near the target from 'reaching' it on one lucky evaluation (each has a standard error of
    about 0.01). The run's last evaluations count with the successors they have (PPO reaches its own final)."""
    for i in range(len(points)):
        if all(p["accuracy"] >= target for p in points[i:i + consecutive]):
            return points[i]
    return None


def summarize_seed(curves: dict[str, list[dict]], eval_every_steps: dict[str, int]) -> dict:
    """Per algorithm: initial and final accuracy, gradient steps / rollout steps / training seconds to first reach
    PPO's final accuracy (None if never), and the resolution of that step count (the gradient steps between two
    evaluations, relative to it)."""
    target = curves["ppo"][-1]["accuracy"]
    out = {"target_accuracy": target, "algorithms": {}}
    for algo, pts in curves.items():
        hit, sustained = first_reach(pts, target), first_reach(pts, target, consecutive=2)
        res = None
        if hit is not None and hit["gradient_steps"]:
            res = eval_every_steps[algo] / hit["gradient_steps"]
        out["algorithms"][algo] = {
            "initial_accuracy": pts[0]["accuracy"], "final_accuracy": pts[-1]["accuracy"],
            "final_gradient_steps": pts[-1]["gradient_steps"], "total_train_seconds": pts[-1]["train_seconds"],
            "gradient_steps_to_target": hit and hit["gradient_steps"], "rollout_steps_to_target": hit and hit["step"],
            "train_seconds_to_target": hit and hit["train_seconds"], "relative_resolution": res,
            "gradient_steps_to_target_twice": sustained and sustained["gradient_steps"]}
    return out


def without_budget(command: str) -> str:
    """The command that makes the result: a session's command without its --budget_minutes (rerun until done; each
    session's own command is kept in `sessions`)."""
    words = shlex.split(command)
    keep = [w for i, w in enumerate(words) if w != "--budget_minutes" and (i == 0 or words[i - 1] != "--budget_minutes")]
    return shlex.join(keep)


def goal(per_seed: list[dict], value_table: list[dict] | None, k: int) -> dict:
    """The experiment's two targets, as measured: VinePPO reaches PPO's final accuracy in <= 1/3 of PPO's gradient steps
    on every seed; the MC estimate has a lower MAE at every step position and a higher ranking accuracy at every
    position where ranking is defined (None while the value analysis is missing). A position reached by a single
    state of a seed (a response with an extra line) has no pair to rank: it is named in
    `positions_without_ranking` and compared on MAE alone."""
    def third(s):
        p, v = (s["algorithms"][a]["gradient_steps_to_target"] for a in ("ppo", "vineppo"))
        return v is not None and p is not None and v <= p / 3
    mc = f"mc_k{k}"
    better, unranked = None, None
    if value_table:
        rows = [r for r in value_table if r["position"] != "all"]
        ranked = [r for r in rows if r["ranking_accuracy"][mc] is not None and r["ranking_accuracy"]["critic"] is not None]
        unranked = [r["position"] for r in rows if r not in ranked]
        better = bool(ranked) and all(r["mae"][mc] < r["mae"]["critic"] for r in rows) and \
            all(r["ranking_accuracy"][mc] > r["ranking_accuracy"]["critic"] for r in ranked)
    return {"vineppo_within_a_third_of_ppo_steps_on_every_seed": all(third(s) for s in per_seed),
            "mc_beats_critic_at_every_position": better, "positions_without_ranking": unranked}


def pool_value_tables(tables: list[list[dict]]) -> list[dict]:
    """Mean over seeds of value_prediction.py's per-position rows (same positions; a position missing in a seed is
    averaged over the seeds that have it)."""
    found = {r["position"] for t in tables for r in t}
    keys = sorted(k for k in found if k != "all") + ["all"] * ("all" in found)
    out = []
    for pos in keys:
        rows = [r for t in tables for r in t if r["position"] == pos]
        mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731
        names = list(rows[0]["mae"])
        out.append({"position": pos, "seeds": len(rows), "num_states": sum(r["num_states"] for r in rows),
                    "mean_truth": mean([r["mean_truth"] for r in rows]),
                    "mae": {n: mean([r["mae"][n] for r in rows]) for n in names},
                    "ranking_accuracy": {n: mean([r["ranking_accuracy"][n] for r in rows
                                                  if r["ranking_accuracy"][n] is not None]) for n in names}})
    return out


# --- running ----------------------------------------------------------------------------------------------------
def build_sft_start(out: Path) -> dict:
    """<out>/sft_start: the shared SFT start, built once in a child under BUILD_ENV (shared/tiny.py)."""
    from shared import tiny

    final = out / "sft_start"
    if not (final / "build.json").exists():
        tiny.builtin_tiny()  # the base, built (under BUILD_ENV) before the child's run so the child only reads it

        def build(tmp: Path):
            argv = calibrate_sums.sft_argv(TERMS, SFT_SEED, tmp)
            print(f"[compare] building the SFT start: python {shlex.join(argv)} (BUILD_ENV: one thread)", flush=True)
            t0 = time.time()
            tiny._run_build([sys.executable, *argv], str(final))
            rows = [r for r in bc.read_jsonl(tmp / "metrics.jsonl") if "eval/accuracy" in r]
            record = {"recipe": "python " + shlex.join(argv[:-2]) + " --output_dir <out>/sft_start",
                      "base": "builtin:tiny", "base_sha256": tiny.weights_sha256(tiny.builtin_tiny()),
                      "weights_sha256": tiny.weights_sha256(tmp / "final"), "build_env": tiny.BUILD_ENV,
                      "heldout_accuracy": rows[-1]["eval/accuracy"], "heldout_note": "sft.py's final evaluation: "
                      "500 test prompts, 1 sample each at T = 1", "build_seconds": time.time() - t0}
            (tmp / "build.json").write_text(json.dumps(record, indent=1) + "\n")

        tiny.build_atomically(final, build)
    record = json.loads((final / "build.json").read_text())
    if tiny.weights_sha256(final / "final") != record["weights_sha256"]:
        raise SystemExit(f"{final}/final does not hold the weights its build.json names; delete {final} to rebuild")
    if record["weights_sha256"] != EXPECTED_SFT_SHA256:
        print(f"[compare] warning: the SFT start's weights are {record['weights_sha256'][:12]}, not the expected "
              f"{EXPECTED_SFT_SHA256[:12]} (another CPU architecture, library version or sft.py)", file=sys.stderr, flush=True)
    return {"path": str(final / "final"), **record, "expected_sha256": EXPECTED_SFT_SHA256}


def reuse_ppo_runs(a, runs: dict) -> dict:
    """Copy the finished PPO runs of `a.ppo_from` (and its SFT start) into `a.out`, after checking that they ran
    what this runner would run now (the same start weights, every PPO flag but the paths): PPO does not depend on
    --k, so an ablation of K can share one set of PPO runs. Returns the provenance kept in the session."""
    src = a.ppo_from.resolve()
    if "ppo" not in a.algos:
        raise SystemExit("error: --ppo_from needs ppo in --algos")
    src_start = json.loads((src / "sft_start" / "build.json").read_text())
    if (a.out / "sft_start" / "build.json").exists():
        mine = json.loads((a.out / "sft_start" / "build.json").read_text())
        if mine["weights_sha256"] != src_start["weights_sha256"]:
            raise SystemExit(f"error: --ppo_from: {src} started from other weights than {a.out}/sft_start")
    else:
        shutil.copytree(src / "sft_start", a.out / "sft_start")
    copied = []
    for seed in a.seeds:
        run, source = runs[("ppo", seed)], src / f"ppo_seed{seed}"
        if finished(run):
            continue
        if not finished(source):
            raise SystemExit(f"error: --ppo_from: {source} is not a finished run")
        bad = argv_mismatches(run_argv("ppo", seed, run, "", a), json.loads((source / "args.json").read_text()),
                              skip=("output_dir", "model_name_or_path", "stop_after_steps"))
        if bad:
            raise SystemExit(f"error: --ppo_from: {source} ran other flags: {'; '.join(bad)}")
        shutil.copytree(source, run)
        (a.out / "logs").mkdir(parents=True, exist_ok=True)
        for log in (src / "logs").glob(f"ppo_seed{seed}_from*"):
            shutil.copytree(log, a.out / "logs" / log.name, dirs_exist_ok=True)
        copied.append(run.name)
        print(f"[compare] ppo seed {seed}: reusing {source} (same start weights and flags)", flush=True)
    src_sessions = bc.read_jsonl(src / "sessions.jsonl")
    return {"dir": str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src), "copied": copied,
            "weights_sha256": src_start["weights_sha256"],
            "sessions": [{"command": s["command"], "git_commit": s["env"].get("git_commit"),
                          "time": s["env"].get("time"), "device": s["env"].get("device"),
                          "units": [u for u in s["units"] if u["run"].startswith("ppo_seed")]} for s in src_sessions]}


def finished(run: Path) -> bool:
    return (run / "checkpoints" / "finished.json").exists()


def steps_done(run: Path) -> int:
    if finished(run):
        return json.loads((run / "checkpoints" / "finished.json").read_text())["num_steps"]
    ckpts = sorted((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else []
    return int(ckpts[-1].name.split("_")[1]) if ckpts else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "vineppo_vs_ppo", help="work directory")
    p.add_argument("--total_episodes", type=int, default=51200, help="completions per run (512 per rollout step)")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--k", type=int, default=9, help="VinePPO's MC rollouts per state")
    p.add_argument("--eval_every", type=int, default=2, help="rollout steps between held-out evaluations")
    p.add_argument("--eval_num_prompts", type=int, default=500, help="held-out prompts per evaluation (a smoke "
                   "test: fewer)")
    p.add_argument("--chunk_steps", type=int, default=25, help="rollout steps per invocation (0: whole runs)")
    p.add_argument("--budget_minutes", type=float, default=0, help="start no unit that would end past this (0: none)")
    p.add_argument("--value_num_prompts", type=int, default=200, help="held-out responses of the value analysis")
    p.add_argument("--value_k_truth", type=int, default=256, help="rollouts of the ground truth per state")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS, help="(a smoke test: a subset)")
    p.add_argument("--ppo_from", type=Path, default=None, help="another work directory of this runner whose "
                   "finished PPO runs (and SFT start) to reuse: same start weights and PPO flags, checked")
    p.add_argument("--status", action="store_true", help="print what is done and exit")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results" / "vineppo_vs_ppo.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "vineppo_ppo_grpo_sums6_cpu.png")
    a = p.parse_args()
    a.out = a.out.resolve()
    runs = {(algo, seed): a.out / f"{algo}_seed{seed}" for seed in a.seeds for algo in a.algos}
    num_steps = a.total_episodes // 512
    if a.status:
        for (algo, seed), run in runs.items():
            print(f"{algo} seed {seed}: {steps_done(run)}/{num_steps} rollout steps{' (finished)' * finished(run)}")
        for seed in a.seeds:
            done = (a.out / f"value_prediction_seed{seed}.json").exists()
            print(f"value prediction seed {seed}: {'done' if done else 'not done'}")
        return
    a.out.mkdir(parents=True, exist_ok=True)
    session = {"env": bc.environment(), "command": bc.invocation(), "units": []}  # env.time: this session's start
    t0 = time.time()
    durations: dict[str, float] = {}  # the last duration of each kind of unit (earlier sessions too), for the budget
    if (a.out / "sessions.jsonl").exists():
        for unit in (u for s in bc.read_jsonl(a.out / "sessions.jsonl") for u in s["units"]):
            durations[unit["run"].split("_seed")[0] if unit.get("to_step") is not None else "value"] = unit["seconds"]

    def within_budget(kind: str) -> bool:
        if not a.budget_minutes:
            return True
        return time.time() - t0 + durations.get(kind, 0.0) <= 60 * a.budget_minutes

    def log_session():
        with open(a.out / "sessions.jsonl", "a") as fh:
            fh.write(json.dumps({**session, "minutes": (time.time() - t0) / 60}) + "\n")

    if a.ppo_from:
        session["ppo_from"] = reuse_ppo_runs(a, runs)
    start = build_sft_start(a.out)
    print(f"[compare] SFT start {start['path']} (weights {start['weights_sha256'][:12]}, held-out accuracy "
          f"{start['heldout_accuracy']:.3f})", flush=True)

    # 2. round-robin chunks: ppo s1, vineppo s1, grpo s1, ppo s2, ...
    while not all(finished(r) for r in runs.values()):
        for (algo, seed), run in runs.items():
            if finished(run):
                continue
            if not within_budget(algo):
                print(f"[compare] budget of {a.budget_minutes} min reached; rerun the same command to continue",
                      flush=True)
                log_session()
                return
            argv = run_argv(algo, seed, run, start["path"], a)
            if a.chunk_steps:
                argv += ["--stop_after_steps", str(a.chunk_steps)]
            before = steps_done(run)
            print(f"[compare] {algo} seed {seed}: steps {before}.. python {shlex.join(argv)}", flush=True)
            t = time.time()
            bc.run_child(argv, run.parent / f"logs/{run.name}_from{before:04d}")
            durations[algo] = time.time() - t
            session["units"].append({"run": run.name, "from_step": before, "to_step": steps_done(run),
                                     "seconds": durations[algo]})

    # 3. value prediction on each seed's final PPO policy
    for seed in a.seeds:
        if "ppo" not in a.algos:
            break
        path = a.out / f"value_prediction_seed{seed}.json"
        if path.exists():
            continue
        if not within_budget("value"):
            print(f"[compare] budget of {a.budget_minutes} min reached; rerun the same command to continue", flush=True)
            log_session()
            return
        ppo = runs[("ppo", seed)]
        argv = ["scripts/experiments/value_prediction.py", "--policy", str(ppo / "final"), "--critic", str(ppo / "critic"),
                "--dataset", TASK, "--max_new_tokens", str(MAX_NEW_TOKENS), "--num_prompts", str(a.value_num_prompts),
                "--k", str(a.k), "--k_truth", str(a.value_k_truth), "--seed", str(seed), "--output", str(path) + ".tmp"]
        print(f"[compare] value prediction, seed {seed}: python {shlex.join(argv)}", flush=True)
        t = time.time()
        bc.run_child(argv, a.out / f"logs/value_prediction_seed{seed}")
        shutil.move(str(path) + ".tmp", path)
        durations["value"] = time.time() - t
        session["units"].append({"run": path.name, "seconds": durations["value"]})
    log_session()

    # 4. results
    curves, args_of, per_seed = {}, {}, []
    for (algo, seed), run in runs.items():
        args_of[algo] = json.loads((run / "args.json").read_text())
        curves[(algo, seed)] = curve(bc.read_jsonl(run / "metrics.jsonl"), args_of[algo])
    every = {algo: optimizer_steps(a.eval_every, args_of[algo]) for algo in a.algos}
    for seed in a.seeds:
        if "ppo" in a.algos:
            per_seed.append({"seed": seed, **summarize_seed({algo: curves[(algo, seed)] for algo in a.algos}, every)})
    values = [json.loads((a.out / f"value_prediction_seed{s}.json").read_text()) for s in a.seeds
              if (a.out / f"value_prediction_seed{s}.json").exists()]
    table = pool_value_tables([v["per_position"] for v in values]) if values else None
    sessions = bc.read_jsonl(a.out / "sessions.jsonl")
    result = {
        "experiment": "vineppo_vs_ppo", "issue": 18, "task": TASK, "env": bc.environment(),
        "command": without_budget(sessions[0]["command"]), "sessions": sessions, "sft_start": start,
        "settings": {"seeds": a.seeds, "total_episodes": a.total_episodes, "rollout_steps": num_steps,
                     "prompts_per_step": 64, "completions_per_prompt": 8, "gradient_steps_per_rollout_step": 4,
                     "learning_rate": a.learning_rate, "warmup_steps": 5, "max_new_tokens": MAX_NEW_TOKENS,
                     "vineppo_k": a.k, "eval_every": a.eval_every,
                     "eval": f"{a.eval_num_prompts} test prompts x 4 samples, T = 1",
                     "chunk_steps": a.chunk_steps,
                     "train_seconds": "summed phase times of the training steps: " + ", ".join(TRAIN_PHASES)},
        "commands": {algo: "python " + shlex.join(run_argv(algo, 0, Path("<out>/<algo>_seed<seed>"), "<sft_start>",
                                                           a)).replace("--seed 0", "--seed <seed>")
                     for algo in a.algos},
        "ppo_runs_from": next((s["ppo_from"] for s in sessions if "ppo_from" in s), None),
        "per_seed": per_seed,
        "curves": {f"{algo}_seed{seed}": c for (algo, seed), c in curves.items()},
        "value_prediction": {"per_position_mean_over_seeds": table, "per_seed": values,
                             "policy": "each seed's final PPO policy (its critic was trained for it)"},
        "goal": goal(per_seed, table, a.k) if per_seed else None,
    }
    a.results.parent.mkdir(parents=True, exist_ok=True)
    result["env"]["builtin_models"] = bc.builtin_models()
    a.results.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"[compare] wrote {a.results}")
    plot(curves, a)


def plot(curves: dict, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for algo, color in zip(a.algos, ("tab:blue", "tab:orange", "tab:green")):
        runs = [curves[(algo, s)] for s in a.seeds]
        n = min(len(c) for c in runs)
        accs = [[c[i]["accuracy"] for c in runs] for i in range(n)]
        mean = [statistics.mean(x) for x in accs]
        xs_steps = [runs[0][i]["gradient_steps"] for i in range(n)]
        xs_time = [statistics.mean(c[i]["train_seconds"] for c in runs) / 60 for i in range(n)]
        for ax, xs in ((axes[0], xs_steps), (axes[1], xs_time)):
            ax.plot(xs, mean, color=color, label=f"{algo} ({len(runs)} seeds)")
            ax.fill_between(xs, [min(x) for x in accs], [max(x) for x in accs], color=color, alpha=0.2)
    axes[0].set_xlabel("gradient steps")
    axes[1].set_xlabel("training minutes (mean over seeds; evaluation excluded)")
    for ax in axes:
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{TASK}, same SFT start; mean and min-max over seeds", fontsize=10)
    fig.tight_layout()
    a.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.plot, dpi=120)
    print(f"[compare] wrote {a.plot}")


if __name__ == "__main__":
    main()
