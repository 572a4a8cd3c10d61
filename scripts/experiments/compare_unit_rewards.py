"""Experiment (not a test): Unit-level rewards against bandit and token-level ones: docs/unit_rm.md, docs/unit_ppo.md.

    python scripts/experiments/compare_unit_rewards.py --part rm --seeds 1 2 3     # (a) the reward models, same held-out pairs
    python scripts/experiments/compare_unit_rewards.py --part ppo --seeds 1 2 3    # (b) unit PPO vs PPO on the bandit RM vs DRCA
    python scripts/experiments/compare_unit_rewards.py --part ppo --reward_models builtin --seeds 1 2 3   # (b) on the built-in RMs
    python scripts/experiments/compare_unit_rewards.py --part ppo --reward_models builtin --arms unit_ppo unit_ppo_bandit \
        --seeds 1 2 3   # the same unit RM, its rewards spread over the units or as one reward at the end

(a) trains, per seed and with the same budget (--rm_episodes pairs), rm.py (the bandit RM), unit_rm.py at its default
tau and unit_rm.py --tau 0 (token level), and reads each run's final held-out evaluation (the same 500 held-out pairs
for all): pair accuracy, and for the unit RMs eval/localisation, the share of slipped responses whose lowest unit
reward falls on the slipped line (shared/localisation.py; the bandit RM has one unit, so it is not reported).
(b) runs, per seed from the same start (builtin:tiny-sft) and at equal samples, unit_ppo.py on seed 1's unit RM of (a),
ppo_rlhf.py on seed 1's rm.py RM of (a) and drca.py on the same rm.py RM (--scorer rm), and reads held-out grader
accuracy at each evaluation; with --reward_models builtin, the RMs are the built-in ones each script defaults to
(unit_ppo.py: builtin:tiny-unit-rm, unit_rm.py on 32,000 pairs; ppo_rlhf.py and drca.py: builtin:tiny-rm, rm.py's
default run on 128,000 pairs), written to unit_rewards_ppo_builtin.json. --arms picks the arms (a file named for them when
not the three above): unit_ppo_bandit is unit_ppo.py on the same unit RM with `--reward_placement segment_last_avg`,
the mean unit reward at the last token (the bandit placement), which separates the dense placement from the RM. Writes runs/compare_unit_rewards/<part>/... and docs/results/unit_rewards_<part>.json
with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_common as bc  # noqa: E402

RM_ARMS = {"bandit_rm": ["algorithms/rm.py"], "unit_rm": ["algorithms/unit_rm.py"],
           "token_rm": ["algorithms/unit_rm.py", "--tau", "0"]}
PPO_ARMS = {"unit_ppo": "algorithms/unit_ppo.py", "ppo_rlhf": "algorithms/ppo_rlhf.py", "drca": "algorithms/drca.py",
            "unit_ppo_bandit": "algorithms/unit_ppo.py"}
DEFAULT_PPO_ARMS = ["unit_ppo", "ppo_rlhf", "drca"]


def rows(run: Path) -> list[dict]:
    return bc.read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []


def finished(run: Path) -> bool:
    return (run / "final" / "config.json").exists() or any("time/total" in r for r in rows(run))


def spread(vals: list[float]) -> dict:
    return {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals), "per_seed": vals}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["rm", "ppo"], required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rm_episodes", type=int, default=32000, help="training pairs of every reward model")
    p.add_argument("--ppo_episodes", type=int, default=5120, help="completions sampled by every policy arm")
    p.add_argument("--reward_models", choices=["part_rm", "builtin"], default="part_rm",
                   help="--part ppo: seed 1's RMs of --part rm, or the built-in RMs the scripts default to")
    p.add_argument("--arms", nargs="+", choices=list(PPO_ARMS), default=DEFAULT_PPO_ARMS, help="--part ppo: the arms")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare_unit_rewards")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    a = p.parse_args()
    provenance = {"env": bc.environment(), "command": shlex.join(["python", "scripts/experiments/compare_unit_rewards.py", *sys.argv[1:]])}
    tag = a.part + ("_builtin" if a.part == "ppo" and a.reward_models == "builtin" else "")
    if a.part == "ppo" and a.arms != DEFAULT_PPO_ARMS:
        tag += "_" + "_".join(a.arms)
    out = a.out / tag
    out.mkdir(parents=True, exist_ok=True)
    common = ["--save_every", "0", "--resume", "no"]
    summary: dict = {**provenance, "part": a.part, "seeds": a.seeds, "commands": {}}
    if a.part == "rm":
        flags = ["--total_episodes", str(a.rm_episodes), "--best_metric", "", "--dev_num_prompts", "0", *common]
        for seed in a.seeds:
            for arm, argv in RM_ARMS.items():
                run = out / f"{arm}_seed{seed}"
                cmd = [*argv, "--seed", str(seed), "--output_dir", str(run.relative_to(ROOT)), *flags]
                summary["commands"][arm] = "python " + shlex.join([*cmd[:-4]])
                if not finished(run):
                    print("python " + shlex.join(cmd), flush=True)
                    subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT)
        for arm in RM_ARMS:
            finals = [[r for r in rows(out / f"{arm}_seed{s}") if "eval/accuracy" in r][-1] for s in a.seeds]
            summary[arm] = {"accuracy": spread([f["eval/accuracy"] for f in finals])}
            if "eval/localisation" in finals[0]:
                summary[arm]["localisation"] = spread([f["eval/localisation"] for f in finals])
                summary[arm]["localisation_chance"] = spread([f["eval/localisation_chance"] for f in finals])
                summary[arm]["units_per_response"] = spread([f["eval/units_per_response"] for f in finals])
    else:
        if a.reward_models == "builtin":
            unit_rm, bandit_rm = "builtin:tiny-unit-rm", "builtin:tiny-rm"
        else:
            unit_rm = a.out / "rm" / "unit_rm_seed1" / "final"
            bandit_rm = a.out / "rm" / "bandit_rm_seed1" / "final"
            if not (unit_rm.exists() and bandit_rm.exists()):
                raise SystemExit("error: --part ppo needs --part rm's seed-1 reward models (run --part rm first)")
            unit_rm, bandit_rm = str(unit_rm.relative_to(ROOT)), str(bandit_rm.relative_to(ROOT))
        summary["reward_models"] = {arm: unit_rm if arm.startswith("unit_ppo") else bandit_rm for arm in a.arms}
        summary["arms"] = a.arms
        arm_flags = {"unit_ppo": ["--reward_model_path", unit_rm],
                     "ppo_rlhf": ["--reward_model_path", bandit_rm],
                     "drca": ["--reward_model_path", bandit_rm, "--scorer", "rm"],
                     "unit_ppo_bandit": ["--reward_model_path", unit_rm, "--reward_placement", "segment_last_avg"]}
        flags = ["--total_episodes", str(a.ppo_episodes), "--eval_every", "5", "--eval_num_prompts", "200",
                 "--no_save_model", *common]
        for seed in a.seeds:
            for arm in a.arms:
                script, run = PPO_ARMS[arm], out / f"{arm}_seed{seed}"
                cmd = [script, "--seed", str(seed), "--output_dir", str(run.relative_to(ROOT)), *arm_flags[arm], *flags]
                summary["commands"][arm] = "python " + shlex.join(cmd)
                if not finished(run):
                    print("python " + shlex.join(cmd), flush=True)
                    subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT)
        for arm in a.arms:
            curves = [[r for r in rows(out / f"{arm}_seed{s}") if "eval/accuracy" in r] for s in a.seeds]
            n = min(len(c) for c in curves)
            # samples at each evaluation: step x the run's completions per step (the end-of-run row has no episode)
            batch_size = json.loads((out / f"{arm}_seed{a.seeds[0]}" / "args.json").read_text())["batch_size"]
            summary[arm] = {"curve": [{"episode": curves[0][k]["step"] * batch_size, "step": curves[0][k]["step"],
                                       "accuracy": spread([c[k]["eval/accuracy"] for c in curves])} for k in range(n)],
                            "minutes": spread([c[-1].get("time/total", 0) / 60 for c in curves])}
    summary["env"]["builtin_models"] = bc.builtin_models()
    a.results.mkdir(parents=True, exist_ok=True)
    path = a.results / f"unit_rewards_{tag}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("env",)}, indent=1)[:4000])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
