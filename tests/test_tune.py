"""scripts/tools/tune.py (docs/tuning.md): a study of a real script (sft.py, 2-step runs) and its resume, the one-line error
of a search space naming a flag grpo.py lacks; and, on a stand-in script that logs a known curve (FAKE below: fast
and deterministic), a crashed trial, a pruned trial, two workers on one SQLite study, a killed worker's trial."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

# A stand-in training script: eval/score = x * step at steps 0..steps, one row per step in metrics.jsonl (after
# `sleep` seconds); --mode crash raises at step 2. Each launch appends its output_dir to --launch_log and writes its
# pid to output_dir/pid.
FAKE = '''
import json, os, time
from dataclasses import dataclass
from pathlib import Path
import tyro

@dataclass
class Args:
    x: float = 0.5
    mode: str = "ok"
    steps: int = 4
    sleep: float = 0.0
    seed: int = 1
    launch_log: str = ""
    output_dir: str = "runs/fake"

if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pid").write_text(str(os.getpid()))
    if args.launch_log:
        with open(args.launch_log, "a") as fh:
            fh.write(args.output_dir + "\\n")
    for step in range(args.steps + 1):
        time.sleep(args.sleep)
        if args.mode == "crash" and step == 2:
            raise ValueError("fake crash at step 2")
        with open(out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": step, "eval/score": args.x * step + 0.001 * args.seed}) + "\\n")
'''


def tune(*flags, check=True, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "scripts/tools/tune.py", *map(str, flags)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def write_space(path: Path, space: dict, fixed: dict) -> Path:
    path.write_text(json.dumps({"search_space": space, "fixed": fixed}))
    return path


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    return script


def load(study_dir: Path, name: str = "tune") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{study_dir / 'study.db'}")


def fake_flags(fake, space, study_dir, *extra):
    return ["--script", fake, "--space", space, "--objective", "eval/score", "--direction", "maximize",
            "--study_dir", study_dir, "--poll_s", "0.1", *extra]


# ---------------------------------------------------------------- a real script
def test_bad_search_space_is_one_line_error_before_any_trial(tmp_path):
    space = write_space(tmp_path / "bad.json", {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3},
                                                "no_such_flag": {"type": "int", "low": 1, "high": 4}}, {})
    proc = tune("--script", "algorithms/grpo.py", "--space", space, "--study_dir", tmp_path / "study", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no_such_flag" in lines[0], proc.stderr
    assert not (tmp_path / "study" / "study.db").exists()


def test_sft_study_of_three_trials_resumes_where_it_stopped(tmp_path):
    """2 trials, then the same command with --n_trials 3 runs one more: trials 0 and 1 are kept, not re-run."""
    space = write_space(tmp_path / "sft.json", {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3,
                                                                  "log": True}},
                        {"total_episodes": 64, "local_micro_batch_size": 32, "eval_num_prompts": 8, "eval_every": 1,
                         "dev_num_prompts": 8, "save_every": 0, "best_metric": ""})  # 2 steps of 32
    study_dir = tmp_path / "study"
    flags = ["--script", "algorithms/sft.py", "--space", space, "--objective", "loss/sft", "--direction", "minimize",
             "--study_dir", study_dir, "--poll_s", "0.5", "--pruner", "none"]
    tune(*flags, "--n_trials", 2)
    first = {t.number: t.datetime_start for t in load(study_dir).trials}
    assert sorted(first) == [0, 1]
    out = tune(*flags, "--n_trials", 3).stdout
    assert "2 of 3 trials so far" in out
    trials = load(study_dir).trials
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state.name == "COMPLETE" for t in trials)
    assert {t.number: t.datetime_start for t in trials[:2]} == first
    for t in trials:  # the objective is the last loss/sft of the trial's own run, launched with its flags
        rows = [json.loads(x) for x in (study_dir / "trials" / f"{t.number:04d}" / "metrics.jsonl").read_text()
                .splitlines()]
        assert t.value == [r["loss/sft"] for r in rows if "loss/sft" in r][-1]
        assert t.user_attrs["flags"][-2:] == ["--learning_rate", str(t.params["learning_rate"])]
        assert (study_dir / "trials" / f"{t.number:04d}.log").exists()
    assert len({t.params["learning_rate"] for t in trials}) == 3
    best = json.loads((study_dir / "best_params.json").read_text())
    assert best["best_value"] == min(t.value for t in trials)
    assert best["command"].startswith("python algorithms/sft.py ") and best["command"] in out


# ---------------------------------------------------------------- mechanics, on the stand-in script
def test_crashing_trial_is_recorded_and_the_study_goes_on(tmp_path, fake):
    space = write_space(tmp_path / "s.json", {"x": {"type": "float", "low": 0.0, "high": 1.0},
                                              "mode": {"type": "categorical", "choices": ["ok", "crash"]}}, {})
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = optuna.create_study(study_name="tune", storage=f"sqlite:///{study_dir / 'study.db'}", direction="maximize")
    study.enqueue_trial({"x": 0.9, "mode": "crash"})
    study.enqueue_trial({"x": 0.3, "mode": "ok"})
    out = tune(*fake_flags(fake, space, study_dir, "--n_trials", 2)).stdout
    t0, t1 = load(study_dir).trials
    assert t0.state.name == "FAIL" and t0.user_attrs["error"].endswith("ValueError: fake crash at step 2"), out
    assert t1.state.name == "COMPLETE" and t1.value == pytest.approx(0.3 * 4 + 0.001)
    assert json.loads((study_dir / "best_params.json").read_text())["best_trial"] == 1


def test_trial_behind_the_median_is_pruned_and_its_process_killed(tmp_path, fake):
    space = write_space(tmp_path / "s.json", {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                        {"steps": 20, "sleep": 0.15})
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = optuna.create_study(study_name="tune", storage=f"sqlite:///{study_dir / 'study.db'}", direction="maximize")
    study.enqueue_trial({"x": 1.0})
    study.enqueue_trial({"x": 0.1})
    tune(*fake_flags(fake, space, study_dir, "--n_trials", 2, "--pruner", "median", "--n_startup_trials", 1))
    t0, t1 = load(study_dir).trials
    assert t0.state.name == "COMPLETE" and t1.state.name == "PRUNED"
    assert t1.intermediate_values and max(t1.intermediate_values) < 20  # stopped before the end
    rows = (study_dir / "trials" / "0001" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) < 21
    pid = int((study_dir / "trials" / "0001" / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_two_workers_share_one_sqlite_study_and_run_no_trial_twice(tmp_path, fake):
    launches = tmp_path / "launches.txt"
    space = write_space(tmp_path / "s.json", {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                        {"steps": 3, "sleep": 0.2, "launch_log": str(launches)})
    study_dir = tmp_path / "study"
    cmd = [sys.executable, "scripts/tools/tune.py", *map(str, fake_flags(fake, space, study_dir, "--n_trials", 6,
                                                                         "--pruner", "none"))]
    workers = [subprocess.Popen([*cmd, "--seed", str(s)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for s in (1, 2)]
    outs = [w.communicate(timeout=300)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outs
    trials = load(study_dir).trials
    assert len(trials) >= 6 and all(t.state.name == "COMPLETE" for t in trials)
    ran = launches.read_text().splitlines()
    assert len(ran) == len(set(ran)) == len(trials)  # each trial launched once, in its own output_dir
    by_worker = [{int(x.split()[1]) for x in out.splitlines() if x.startswith("trial ")} for out in outs]
    assert by_worker[0] and by_worker[1], outs  # both workers ran trials
    assert not by_worker[0] & by_worker[1] and by_worker[0] | by_worker[1] == {t.number for t in trials}


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # retried_trial_number
def test_killed_workers_trial_is_marked_failed_and_retried(tmp_path, fake):
    """A worker killed mid-trial: its trial's process dies with it; the next worker marks the trial FAIL once its
    heartbeat is older than the grace period, and (--max_retry 1) re-runs its flags as a new trial."""
    study_dir = tmp_path / "study"
    slow = write_space(tmp_path / "slow.json", {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                       {"steps": 200, "sleep": 0.1})
    hb = ["--heartbeat_interval", 1, "--grace_period", 2, "--max_retry", 1, "--n_trials", 2, "--pruner", "none"]
    worker = subprocess.Popen([sys.executable, "scripts/tools/tune.py", *map(str, fake_flags(fake, slow, study_dir, *hb))],
                              cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = study_dir / "trials" / "0000" / "pid"
    deadline = time.time() + 60
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    child = int(pid_file.read_text())
    for _ in range(50):  # the trial's process gets SIGKILL with its worker (PR_SET_PDEATHSIG)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"trial process {child} outlived its killed worker")
    assert load(study_dir).trials[0].state.name == "RUNNING"
    time.sleep(3)  # past the grace period
    quick = write_space(tmp_path / "quick.json", {"x": {"type": "float", "low": 0.0, "high": 1.0}}, {"steps": 2})
    tune(*fake_flags(fake, quick, study_dir, *hb))
    trials = load(study_dir).trials
    assert trials[0].state.name == "FAIL"
    retry = trials[1]
    assert retry.state.name == "COMPLETE" and retry.params == trials[0].params
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(retry) == 0
    assert len(trials) == 3  # the retry replaces the killed trial in the --n_trials budget


# ---------------------------------------------------------------- the stored search (docs/tuning.md)
def test_the_tuning_page_shows_the_table_its_stored_search_renders():
    """docs/tuning.md's measured table is tune.py's rendering of the stored summary it links, with the command that
    wrote it (a summary whose `command` is the best trial's gets the tuner's command from its stored args)."""
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from tune import tune_command, tuning_table

    page = (ROOT / "docs" / "tuning.md").read_text()
    stored = sorted((ROOT / "docs" / "bench" / "tuning").glob("*.json"))
    assert stored
    for path in stored:
        d = json.loads(path.read_text())
        assert path.name in page and tuning_table(d) in page
        assert tune_command(d).startswith("python scripts/tools/tune.py ")
        assert ("--seeds 1 2 3" in tune_command(d)) == bool(d.get("seeds"))  # a search re-run over seeds says so
    assert tune_command({"command": "python scripts/tools/tune.py --n_trials 3", "best_command": "x"}) == \
        "python scripts/tools/tune.py --n_trials 3"
