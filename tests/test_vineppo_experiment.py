"""Issue #18's experiment tooling: the value-prediction metrics (scripts/experiments/value_prediction.py) and the head-to-head
runner's bookkeeping (scripts/experiments/compare_vineppo_ppo_grpo.py), against hand-computed numbers. Nothing is launched."""

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path[:0] = [str(SCRIPTS), *(str(p) for p in sorted(SCRIPTS.iterdir()) if p.is_dir())]  # scripts/ and its kinds


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, next(SCRIPTS.glob(f"**/{name}.py")))  # scripts/<kind>/<name>.py
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vp = load("value_prediction")
cmp = load("compare_vineppo_ppo_grpo")


# --- value prediction ---------------------------------------------------------------------------------------------
def test_mean_abs_error():
    assert vp.mean_abs_error([0.5, 1.0], [0.0, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        vp.mean_abs_error([0.5], [0.0, 0.5])  # lengths must agree


def test_ranking_accuracy_hand_computed():
    # pairs with distinct truths: (0,1) (0,2) (0,3) concordant, (1,2) tied estimate -> 1/2, (1,3) concordant;
    # (2,3) has equal truths and is not a pair
    est, truth = [0.1, 0.5, 0.5, 0.9], [0.0, 0.25, 0.75, 0.75]
    assert vp.ranking_pairs(est, truth) == (4.5, 5)
    assert vp.ranking_accuracy(est, truth) == pytest.approx(0.9)
    assert vp.ranking_accuracy([1.0, 0.0], [0.0, 1.0]) == 0.0  # discordant
    assert vp.ranking_accuracy([0.3, 0.3, 0.3], [0.0, 0.5, 1.0]) == 0.5  # a constant estimate: chance
    assert vp.ranking_accuracy([0.1, 0.9], [0.5, 0.5]) is None  # no pair with distinct truths


def test_per_position_hand_computed():
    positions = [0, 0, 1, 1, 1]
    truth = [0.2, 0.6, 0.0, 0.5, 1.0]
    est = {"critic": [0.4, 0.4, 0.5, 0.5, 0.5], "mc_k9": [0.0, 1.0, 0.1, 0.3, 0.2]}
    rows = vp.per_position(positions, truth, est)
    assert [r["position"] for r in rows] == [0, 1, "all"]
    p0, p1, pooled = rows
    assert (p0["num_states"], p0["num_pairs"], p0["mean_truth"]) == (2, 1, pytest.approx(0.4))
    assert p0["mae"] == {"critic": pytest.approx(0.2), "mc_k9": pytest.approx(0.3)}
    assert p0["ranking_accuracy"] == {"critic": 0.5, "mc_k9": 1.0}
    # position 1: the critic ties every pair; MC orders (0,1) and (0,2) right and (1,2) wrong
    assert (p1["num_states"], p1["num_pairs"]) == (3, 3)
    assert p1["mae"] == {"critic": pytest.approx(1 / 3), "mc_k9": pytest.approx(1.1 / 3)}
    assert p1["ranking_accuracy"] == {"critic": pytest.approx(0.5), "mc_k9": pytest.approx(2 / 3)}
    # pooled: same-position pairs only (4 of them; no pair across positions), MAE over all 5 states
    assert (pooled["num_states"], pooled["num_pairs"]) == (5, 4)
    assert pooled["mae"] == {"critic": pytest.approx(0.28), "mc_k9": pytest.approx(0.34)}
    assert pooled["ranking_accuracy"] == {"critic": pytest.approx(0.5), "mc_k9": pytest.approx(0.75)}


def test_pool_value_tables():
    a = [{"position": 0, "num_states": 2, "mean_truth": 0.4, "mae": {"c": 0.2}, "ranking_accuracy": {"c": 0.5}},
         {"position": "all", "num_states": 2, "mean_truth": 0.4, "mae": {"c": 0.2}, "ranking_accuracy": {"c": 0.5}}]
    b = [{"position": 0, "num_states": 4, "mean_truth": 0.6, "mae": {"c": 0.4}, "ranking_accuracy": {"c": None}},
         {"position": 1, "num_states": 1, "mean_truth": 1.0, "mae": {"c": 0.1}, "ranking_accuracy": {"c": None}},
         {"position": "all", "num_states": 5, "mean_truth": 0.8, "mae": {"c": 0.3}, "ranking_accuracy": {"c": 1.0}}]
    rows = cmp.pool_value_tables([a, b])
    assert [r["position"] for r in rows] == [0, 1, "all"]
    assert rows[0] == {"position": 0, "seeds": 2, "num_states": 6, "mean_truth": pytest.approx(0.5),
                       "mae": {"c": pytest.approx(0.3)}, "ranking_accuracy": {"c": 0.5}}  # None is skipped
    assert rows[1]["ranking_accuracy"] == {"c": None} and rows[1]["seeds"] == 1
    assert rows[2]["ranking_accuracy"] == {"c": pytest.approx(0.75)}


# --- the head-to-head runner --------------------------------------------------------------------------------------
def test_optimizer_steps():
    assert cmp.optimizer_steps(10, {"num_ppo_epochs": 2, "num_minibatches": 2}) == 40
    assert cmp.optimizer_steps(10, {"num_iterations": 3, "num_minibatches": 2}) == 60  # grpo's passes


def test_curve_sums_training_phases_without_eval():
    args = {"num_ppo_epochs": 2, "num_minibatches": 2}
    rows = [{"step": 0, "time": 9.0, "eval/accuracy": 0.3},
            {"step": 1, "time/generate": 1.0, "time/train": 2.0},
            # an evaluation step: time/eval is not training time; a resumed run's `time` restarts (ignored)
            {"step": 2, "time": 1.0, "time/generate": 1.0, "time/value_estimation": 0.5, "time/train": 2.0,
             "time/eval": 100.0, "eval/accuracy": 0.5},
            {"step": 3, "time/generate": 1.0, "time/train": 1.0, "time/sync": 0.5, "eval/accuracy": 0.4}]
    assert cmp.curve(rows, args) == [
        {"step": 0, "gradient_steps": 0, "train_seconds": 0.0, "accuracy": 0.3},
        {"step": 2, "gradient_steps": 8, "train_seconds": 6.5, "accuracy": 0.5},
        {"step": 3, "gradient_steps": 12, "train_seconds": 9.0, "accuracy": 0.4}]


def pts(*accs, every=2, sec=10.0):
    return [{"step": i * every, "gradient_steps": 4 * i * every, "train_seconds": sec * i * every, "accuracy": x}
            for i, x in enumerate(accs)]


def test_first_reach_plain_and_twice_in_a_row():
    points = [{"step": i, "accuracy": a} for i, a in enumerate([0.3, 0.61, 0.55, 0.6, 0.62, 0.5])]
    assert cmp.first_reach(points, 0.6)["step"] == 1  # one lucky evaluation counts for the plain definition
    assert cmp.first_reach(points, 0.6, consecutive=2)["step"] == 3
    assert cmp.first_reach(points, 0.63) is None and cmp.first_reach(points, 0.62, consecutive=2) is None
    assert cmp.first_reach(points[:5], 0.62, consecutive=2)["step"] == 4  # the last evaluation, with no successor


def test_summarize_seed_and_goal():
    curves = {"ppo": pts(0.3, 0.4, 0.5, 0.55, 0.6), "vineppo": pts(0.3, 0.6, 0.7, 0.65, 0.7, sec=20.0),
              "grpo": pts(0.3, 0.35, 0.4, 0.45, 0.5)}
    s = cmp.summarize_seed(curves, {a: 8 for a in curves})
    assert s["target_accuracy"] == 0.6
    ppo, vine, grpo = (s["algorithms"][a] for a in ("ppo", "vineppo", "grpo"))
    assert (ppo["gradient_steps_to_target"], ppo["rollout_steps_to_target"], ppo["train_seconds_to_target"]) == \
        (32, 8, 80.0)
    assert (vine["gradient_steps_to_target"], vine["train_seconds_to_target"], vine["relative_resolution"]) == \
        (8, 40.0, 1.0)  # reached at the first evaluation after step 0: resolved to 100% only
    assert (vine["initial_accuracy"], vine["final_accuracy"], vine["final_gradient_steps"]) == (0.3, 0.7, 32)
    assert grpo["gradient_steps_to_target"] is None and grpo["train_seconds_to_target"] is None
    assert ppo["relative_resolution"] == 0.25
    # reached twice in a row (the last evaluation counts alone): PPO at its last, VinePPO's 0.6, 0.7 at steps 1, 2
    assert (ppo["gradient_steps_to_target_twice"], vine["gradient_steps_to_target_twice"]) == (32, 8)
    g = cmp.goal([{"seed": 1, **s}], None, 9)
    assert g == {"vineppo_within_a_third_of_ppo_steps_on_every_seed": True, "mc_beats_critic_at_every_position": None,
                 "positions_without_ranking": None}
    slow = cmp.summarize_seed({**curves, "vineppo": pts(0.3, 0.4, 0.5, 0.6, 0.6)}, {a: 8 for a in curves})
    assert cmp.goal([{"seed": 1, **s}, {"seed": 2, **slow}], None, 9)[
        "vineppo_within_a_third_of_ppo_steps_on_every_seed"] is False


def test_command_without_budget():
    assert cmp.without_budget("python scripts/experiments/compare_vineppo_ppo_grpo.py --budget_minutes 20 --k 3") == \
        "python scripts/experiments/compare_vineppo_ppo_grpo.py --k 3"


def test_goal_value_table():
    row = lambda pos, mae_c, mae_m, r_c, r_m: {"position": pos, "mae": {"critic": mae_c, "mc_k9": mae_m},  # noqa
                                               "ranking_accuracy": {"critic": r_c, "mc_k9": r_m}}
    good = [row(0, 0.2, 0.1, 0.6, 0.7), row(1, 0.2, 0.1, 0.6, 0.8), row("all", 0.9, 0.9, 0.9, 0.1)]  # "all" ignored
    assert cmp.goal([], good, 9)["mc_beats_critic_at_every_position"] is True
    bad = good[:1] + [row(1, 0.2, 0.1, 0.6, 0.6)]  # equal ranking accuracy at one position is not "higher"
    assert cmp.goal([], bad, 9)["mc_beats_critic_at_every_position"] is False
    # a position with a single state (no pair): ranking undefined there, compared on MAE only, and named
    lone = good + [row(2, 0.4, 0.0, None, None)]
    g = cmp.goal([], lone, 9)
    assert g["mc_beats_critic_at_every_position"] is True and g["positions_without_ranking"] == [2]
    assert cmp.goal([], good + [row(2, 0.1, 0.4, None, None)], 9)["mc_beats_critic_at_every_position"] is False
    assert cmp.goal([], [row(0, 0.2, 0.1, None, None)], 9)["mc_beats_critic_at_every_position"] is False  # nothing ranked


def test_run_argv_same_budget_for_every_algorithm():
    a = SimpleNamespace(total_episodes=51200, learning_rate=1e-4, eval_every=2, chunk_steps=25, k=9,
                        eval_num_prompts=500)
    argvs = {algo: cmp.run_argv(algo, 3, Path("o"), "start", a) for algo in cmp.ALGOS}
    flags = {algo: dict(zip(v[1::2], v[2::2])) for algo, v in argvs.items()}
    for algo, f in flags.items():
        assert argvs[algo][0] == f"algorithms/{algo}.py"
        assert f["--dataset"] == "builtin:sums-6" and f["--max_new_tokens"] == "18" and f["--seed"] == "3"
        assert f["--local_num_prompts"] == "64" and f["--total_episodes"] == "51200"
        assert f["--learning_rate"] == "0.0001" and f["--warmup_steps"] == "5" and f["--eval_every"] == "2"
    assert flags["grpo"]["--num_generations"] == flags["ppo"]["--num_generations"] == "8"  # one vocabulary
    assert flags["grpo"]["--num_iterations"] == flags["ppo"]["--num_iterations"] == flags["vineppo"][
        "--num_iterations"] == "2"
    assert flags["vineppo"]["--num_mc_rollouts"] == "9" and "--num_mc_rollouts" not in flags["ppo"]


def test_run_argv_flags_exist():
    """Every flag the runner passes is a field of the script's Args (a renamed flag fails here, not after hours)."""
    import dataclasses
    import importlib

    a = SimpleNamespace(total_episodes=51200, learning_rate=1e-4, eval_every=2, chunk_steps=25, k=9,
                        eval_num_prompts=500)
    for algo in cmp.ALGOS:
        fields = {f.name for f in dataclasses.fields(importlib.import_module(f"algorithms.{algo}").Args)}
        argv = cmp.run_argv(algo, 1, Path("o"), "start", a)
        assert {x[2:].removeprefix("no_") for x in argv if x.startswith("--")} <= fields


def test_docs_renderers_of_the_result():
    """scripts/tools/docs_tables.py renders docs/results/vineppo_vs_ppo.json (once measured) from these fields."""
    docs_tables = load("docs_tables")
    curves = {"ppo": pts(0.3, 0.4, 0.5, 0.55, 0.6), "vineppo": pts(0.3, 0.6, 0.7, 0.65, 0.7, sec=20.0),
              "grpo": pts(0.3, 0.35, 0.4, 0.45, 0.5)}
    per_seed = [{"seed": 1, **cmp.summarize_seed(curves, {a: 8 for a in curves})}]
    table = vp.per_position([0, 0, 1, 1], [0.2, 0.6, 0.0, 0.5],
                            {"critic": [0.4, 0.4, 0.5, 0.5], "mc_k9": [0.0, 1.0, 0.1, 0.3]})
    d = {"settings": {"vineppo_k": 9, "eval": "500 test prompts x 4 samples, T = 1", "eval_every": 2,
                      "gradient_steps_per_rollout_step": 4, "rollout_steps": 8, "prompts_per_step": 64,
                      "completions_per_prompt": 8, "learning_rate": 1e-4},
         "sft_start": {"weights_sha256": cmp.EXPECTED_SFT_SHA256}, "per_seed": per_seed,
         "value_prediction": {"per_position_mean_over_seeds": cmp.pool_value_tables([table]),
                              "per_seed": [{"num_prompts": 2, "k_truth": 256}]},
         "goal": cmp.goal(per_seed, cmp.pool_value_tables([table]), 9),
         "command": "python scripts/experiments/compare_vineppo_ppo_grpo.py", "env": {"device": "CPU X x2", "time": "t", "git_commit": "abc1234"}}
    text = docs_tables.vineppo_vs_ppo(d)
    assert "| 1 | PPO | 0.300 | 0.600 | 32 / 32 | 1.3 / 1.3 |" in text
    assert "| 1 | VinePPO (K = 9) | 0.300 | 0.700 | 8 / 32 | 0.7 / 2.7 |" in text
    assert "| 1 | GRPO | 0.300 | 0.500 | never / 32 | never / 1.3 |" in text
    assert "within 1/3 of PPO's gradient steps on every seed: yes" in text
    text = docs_tables.vineppo_value_table(d)
    assert "| S_0 | 2 | 0.200 | 0.300 | 0.500 | 1.000 |" in text
    assert "| S_1 | 2 | 0.250 | 0.150 | 0.500 | 1.000 |" in text
    assert "MC better on both at every position: no" in text  # S_0: the MC's MAE is higher


# --- reusing PPO runs across K ablations (--ppo_from) -------------------------------------------------------------
def recorded_args(argv: list[str]) -> dict:
    """What a script's args.json holds for `argv`: typed values (ints, floats, bools), as tyro parses them."""
    out, i = {}, 1
    while i < len(argv):
        name = argv[i][2:]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            v = argv[i + 1]
            for cast in (int, float):
                try:
                    v = cast(v)
                    break
                except ValueError:
                    pass
            out[name], i = v, i + 2
        else:
            out[name.removeprefix("no_")], i = not name.startswith("no_"), i + 1
    return out


def test_argv_mismatches():
    a = SimpleNamespace(total_episodes=51200, learning_rate=1e-4, eval_every=2, chunk_steps=25, k=9,
                        eval_num_prompts=500)
    argv = cmp.run_argv("ppo", 2, Path("o"), "start", a)
    rec = recorded_args(argv)
    assert rec["learning_rate"] == 1e-4 and rec["gradient_checkpointing"] is False and rec["best_metric"] == ""
    assert cmp.argv_mismatches(argv, rec) == []
    assert cmp.argv_mismatches(argv, {**rec, "learning_rate": 1.0e-4}) == []  # 0.0001 recorded as a float
    assert cmp.argv_mismatches(argv, {**rec, "learning_rate": 2e-4}) == ["--learning_rate: 0.0002 recorded, '0.0001' now"]
    assert cmp.argv_mismatches(argv, {**rec, "gradient_checkpointing": True}) == [
        "--gradient_checkpointing: True recorded, False now"]
    assert cmp.argv_mismatches(argv, {**rec, "output_dir": "elsewhere"}, skip=("output_dir",)) == []
    assert len(cmp.argv_mismatches(argv, {**rec, "output_dir": "elsewhere"})) == 1
    missing = dict(rec)
    del missing["eval_every"]
    assert cmp.argv_mismatches(argv, missing) == ["--eval_every: '<absent>' recorded, '2' now"]
    # K is VinePPO's flag only: PPO's runs match whatever --k the ablation uses
    assert cmp.argv_mismatches(cmp.run_argv("ppo", 2, Path("o"), "start", SimpleNamespace(**{**vars(a), "k": 16})),
                               rec) == []


def fake_ppo_source(root: Path, a, seeds=(1, 2), weights="w" * 64) -> Path:
    src = root / "src"
    (src / "sft_start" / "final").mkdir(parents=True)
    (src / "sft_start" / "build.json").write_text(json.dumps({"weights_sha256": weights}))
    for seed in seeds:
        run = src / f"ppo_seed{seed}"
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "finished.json").write_text(json.dumps({"num_steps": 100}))
        rec = recorded_args(cmp.run_argv("ppo", seed, run, str(src / "sft_start" / "final"), a))
        (run / "args.json").write_text(json.dumps({**rec, "stop_after_steps": 25}))
        (src / "logs" / f"ppo_seed{seed}_from0000").mkdir(parents=True)
    sessions = [{"command": "python scripts/experiments/compare_vineppo_ppo_grpo.py --k 3", "env": {"git_commit": "abc1234",
                 "time": "2026-11-26 04:18:12", "device": "CPU X x2"},
                 "units": [{"run": "ppo_seed1", "from_step": 0, "to_step": 25, "seconds": 1.0},
                           {"run": "vineppo_seed1", "from_step": 0, "to_step": 25, "seconds": 2.0}]}]
    (src / "sessions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sessions))
    return src


def test_reuse_ppo_runs(tmp_path):
    a = SimpleNamespace(total_episodes=51200, learning_rate=1e-4, eval_every=2, chunk_steps=25, k=16,
                        eval_num_prompts=500, seeds=[1, 2], algos=["ppo", "vineppo"], out=tmp_path / "out")
    a.ppo_from = fake_ppo_source(tmp_path, a)
    runs = {(algo, s): a.out / f"{algo}_seed{s}" for s in a.seeds for algo in a.algos}
    prov = cmp.reuse_ppo_runs(a, runs)
    assert prov["copied"] == ["ppo_seed1", "ppo_seed2"] and prov["weights_sha256"] == "w" * 64
    assert [u["run"] for u in prov["sessions"][0]["units"]] == ["ppo_seed1"]  # PPO's units only
    assert prov["sessions"][0]["git_commit"] == "abc1234"
    assert cmp.finished(a.out / "ppo_seed1") and (a.out / "sft_start" / "build.json").exists()
    assert (a.out / "logs" / "ppo_seed2_from0000").is_dir() and not (a.out / "vineppo_seed1").exists()
    assert cmp.reuse_ppo_runs(a, runs)["copied"] == []  # already there: nothing copied again
    # the caption of the rendered table names where the PPO runs came from
    docs_tables = load("docs_tables")
    assert docs_tables._reused_ppo({"ppo_runs_from": prov}).startswith(f"The PPO runs are those of `{prov['dir']}`")
    assert docs_tables._reused_ppo({}) == ""


@pytest.mark.parametrize("break_it", ["flags", "weights", "unfinished", "no_ppo"])
def test_reuse_ppo_runs_refuses(tmp_path, break_it):
    a = SimpleNamespace(total_episodes=51200, learning_rate=1e-4, eval_every=2, chunk_steps=25, k=16,
                        eval_num_prompts=500, seeds=[1], algos=["ppo", "vineppo"], out=tmp_path / "out")
    a.ppo_from = fake_ppo_source(tmp_path, a, seeds=(1,))
    if break_it == "flags":
        a.learning_rate = 3e-4
    elif break_it == "weights":
        (a.out / "sft_start").mkdir(parents=True)
        (a.out / "sft_start" / "build.json").write_text(json.dumps({"weights_sha256": "x" * 64}))
    elif break_it == "unfinished":
        (a.ppo_from / "ppo_seed1" / "checkpoints" / "finished.json").unlink()
    else:
        a.algos = ["vineppo"]
    runs = {(algo, s): a.out / f"{algo}_seed{s}" for s in a.seeds for algo in a.algos}
    with pytest.raises(SystemExit, match="--ppo_from"):
        cmp.reuse_ppo_runs(a, runs)
    assert not (a.out / "ppo_seed1").exists()


def test_plateau_renderer_by_hand():
    """Windowed means of each half's last `width` rollout steps, and the gradient steps until the trailing windowed
    mean first reaches PPO's last window (by hand: evaluations every 2 rollout steps, width 4, 8 rollout steps)."""
    docs_tables = load("docs_tables")
    #                  steps: 0    2    4    6    8
    curves = {"ppo_seed1": pts(0.3, 0.4, 0.5, 0.5, 0.7), "vineppo_seed1": pts(0.3, 0.5, 0.7, 0.6, 0.6)}
    d = {"settings": {"vineppo_k": 9, "eval": "E", "eval_every": 2, "gradient_steps_per_rollout_step": 4,
                      "rollout_steps": 8}, "curves": curves, "_path": "docs/results/x.json",
         "per_seed": [{"seed": 1, "algorithms": {"ppo": {}, "vineppo": {}}}]}
    text = docs_tables.vineppo_plateau(d, width=4)
    # PPO: steps 1-4 -> evaluations at 2, 4: 0.45; steps 5-8 -> 6, 8: 0.6; target 0.6, first reached (trailing window)
    # at step 8. VinePPO: 0.6 and 0.6; its trailing window reaches 0.6 at step 4 ((0.5 + 0.7) / 2), 16 gradient steps
    assert "| 1 | PPO | 0.450 | 0.600 | +0.150 | 32 / 32 |" in text
    assert "| 1 | VinePPO (K = 9) | 0.600 | 0.600 | +0.000 | 16 / 32 |" in text
    assert "accuracy, rollout steps 1-4 | accuracy, rollout steps 5-8 |" in text
    assert "[`results/x.json`](results/x.json)" in text

