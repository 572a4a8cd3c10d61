"""Tracking plumbing: JSONL metrics, sample tables, wandb (offline) and trackio (local) with the same metric names,
the progress bar and the summary line, the no-op tracker of non-main ranks, plotting."""

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.tracking import Timer, Tracker

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Args:
    lr: float = 0.1
    name: str = "x"


def test_jsonl_metrics_samples_and_args(tmp_path):
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=2)
    t.log({"a": 1.0, "nan": math.nan, "inf": math.inf}, step=1)
    t.log_samples([{"prompt": "1+1=", "completion": "2", "reward": 1.0}], step=1)
    t.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["a"] == 1.0 and row["nan"] is None and row["inf"] > 1e300
    assert json.loads((tmp_path / "samples.jsonl").read_text())["completion"] == "2"
    assert json.loads((tmp_path / "args.json").read_text()) == {"lr": 0.1, "name": "x"}


def test_non_main_ranks_write_nothing(tmp_path):
    t = Tracker(_Args(), tmp_path / "rank1", "run", enabled=False, total=2)
    t.log({"a": 1.0}, step=1)
    t.log_samples([{"x": 1}], step=1)
    t.close()
    assert not (tmp_path / "rank1").exists()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _log_a_run(t: Tracker) -> None:
    t.log({"objective/scores": 0.5, "eval/accuracy": 0.25, "best/eval/accuracy": 0.25, "best/step": 0}, step=0)
    t.log({"objective/scores": 0.75, "loss/policy_avg": math.nan}, step=1)
    t.log_samples([{"prompt": "p", "completion": "c", "reward": 0.0}], step=1)


def test_wandb_offline_logs_the_jsonl_metric_names(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(_Args(), tmp_path / "run", "run", enabled=True, total=1, report_to="wandb", project="test")
    _log_a_run(t)
    assert t.state_dict()["wandb_id"] == t.run_id
    t.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    keys = {k for row in _rows(tmp_path / "run" / "metrics.jsonl") for k in row} - {"step", "time"}
    # protobuf records: the metric names appear verbatim. wandb's service process may still be writing the file
    # after finish() returns (seen once with the suite on both cores: only the file header was there), so wait for
    # it, up to 30 s
    deadline = time.monotonic() + 30
    while True:
        history = (run / f"run-{t.run_id}.wandb").read_bytes()
        missing = [k for k in keys if k.encode() not in history]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, missing


TRACKIO_RUN = """
import json, socket, sys
from dataclasses import dataclass

attempts = []
def refuse(self, address, *a, **k):  # local-first: any connection attempt is recorded and refused
    attempts.append(str(address))
    raise OSError("no network in this test")
socket.socket.connect = refuse

from shared.tracking import Tracker
sys.path.insert(0, "tests")
from test_tracking import _Args, _log_a_run

out = sys.argv[1]
t = Tracker(_Args(), out, "run-1", enabled=True, total=2, report_to="trackio", project="proj")
_log_a_run(t)
state = t.state_dict()  # the checkpoint of step 1
t.log({"objective/scores": 1.0}, step=2)  # logged after the checkpoint, then interrupted
t.log_samples([{"prompt": "p", "completion": "c"}], step=2)
t.close("stopped")
t = Tracker(_Args(), out, "run-2", enabled=True, total=2, report_to="trackio", project="proj",
            resume={**state, "step": 1})  # a resumed run continues the same trackio run
t.log({"objective/scores": 1.0}, step=2)  # step 2 again: already in trackio, not stored twice
t.log({"eval/accuracy": 0.5}, step=2)  # a metric the interrupted run had not reached at step 2: sent
t.log_samples([{"prompt": "p", "completion": "c"}], step=2)
t.log({"objective/scores": 2.0}, step=3)
t.close()
from trackio.sqlite_storage import SQLiteStorage

print(json.dumps({"runs": SQLiteStorage.get_runs("proj"), "logs": SQLiteStorage.get_logs("proj", "run-1"),
                  "attempts": attempts}, default=str))
"""


def test_trackio_logs_the_jsonl_metric_names_locally_and_resumes(tmp_path):
    """--report_to trackio: stored under TRACKIO_DIR, no network; the same names as metrics.jsonl (trackio adds its
    `step` and `timestamp`, and the `samples` table); a resumed run continues the same trackio run."""
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", TRACKIO_RUN, str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["attempts"] == [] and got["runs"] == ["run-1"]
    assert list((tmp_path / "trackio").glob("proj.db"))
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "objective/scores" in r] == [0, 1, 2, 3]  # the JSONL cut back and continued
    assert [r["step"] for r in got["logs"] if "objective/scores" in r] == [0, 1, 2, 3]  # no step twice in trackio
    assert [r["step"] for r in got["logs"] if "eval/accuracy" in r] == [0, 2]
    assert [r["step"] for r in got["logs"] if "samples" in r] == [1, 2]
    trackio_keys = {k for row in got["logs"] for k in row} - {"step", "timestamp", "samples"}
    assert trackio_keys == {k for row in rows for k in row} - {"step", "time"}
    assert "trackio: project proj, run run-1" in proc.stdout


def test_unknown_report_to_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="report_to: expected one of none, wandb, trackio"):
        Tracker(_Args(), tmp_path, "run", enabled=True, total=1, report_to="tensorboard")


def test_progress_bar_carries_the_last_held_out_value(tmp_path):
    """The bar shows the step, the script's values and the last evaluation's value: `-` before the first, carried
    between evaluations, never nan."""
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=3)
    assert t.bar.postfix == "eval/accuracy=-"
    t.log({"objective/scores": 0.5}, 1)
    t.progress(1, reward=0.5)
    assert t.bar.postfix == "reward=0.5, eval/accuracy=-"
    t.log({"objective/scores": 0.75, "eval/accuracy": 0.25}, 2)
    t.progress(1, reward=0.75)
    t.log({"objective/scores": math.nan}, 3)
    t.progress(1, reward=math.nan)
    assert t.bar.postfix == "reward=-, eval/accuracy=0.25"
    assert "step 3/3" in str(t.bar)
    t.close()
    # the held-out value shown is the key of --best_metric
    t = Tracker({"best_metric": "eval/p_bad:min"}, tmp_path, "run", enabled=True, total=3)
    t.log({"eval/p_bad": 0.125}, 1)
    t.progress(1, reward=1.0, log_p_bad=None)
    assert t.bar.postfix == "reward=1, eval/p_bad=0.125"
    t.close()


def test_remaining_time_leaves_the_set_up_out(tmp_path):
    """A slow start (models, engine, the step-0 evaluation: 1 s here) does not count as time of the first step, so
    the remaining-time estimate after it follows the step time (0.1 s), not the start (was: hours on a real run)."""
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=10)
    time.sleep(1.0)
    t.log({"eval/accuracy": 0.5}, 0)  # the last set-up line, logged at step 0
    for step in (1, 2):
        time.sleep(0.1)
        t.log({"objective/scores": 0.5}, step)
        t.progress(1, reward=0.5)
    assert t.bar.format_dict["rate"] > 4  # steps per second; ~0.9 if the set-up counted
    t.close()


def test_summary_line_names_steps_time_final_and_best_and_the_files(tmp_path, capsys):
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=2)
    _log_a_run(t)
    t.log({"eval/accuracy": 0.125, "best/eval/accuracy": 0.25, "best/step": 0}, step=2)
    t.progress(2)
    (tmp_path / "final").mkdir()
    (tmp_path / "best").mkdir()
    t.close()
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"done: 2 steps in 0s; final eval/accuracy 0.125 (best 0.25 @ step 0); wrote {tmp_path}/metrics.jsonl, "
        "samples.jsonl, final/, best/")


def test_summary_of_a_stopped_and_resumed_run(tmp_path, capsys):
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=4)
    _log_a_run(t)
    t.progress(1)
    state = t.state_dict()
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    t.close("stopped")
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stopped: 1 steps in 0s; last eval/accuracy 0.25 @ step 0 (best 0.25 @ step 0); wrote "
        f"{tmp_path}/metrics.jsonl, samples.jsonl, checkpoints/")
    t = Tracker(_Args(), tmp_path, "run", enabled=True, total=4, resume={**state, "step": 1})
    assert t.bar.postfix == "eval/accuracy=0.25"  # carried over from the metrics logged before the checkpoint
    t.progress(3)
    t.close()
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "done: 4 steps (resumed at step 1) in 0s; final eval/accuracy 0.25 (best 0.25 @ step 0)")
    # `--resume <checkpoint dir>` into another output_dir: no metrics.jsonl there yet
    t = Tracker(_Args(), tmp_path / "other", "run", enabled=True, total=4, resume={**state, "step": 1})
    assert t.bar.postfix == "eval/accuracy=-"
    t.close()


def test_timer_accumulates_per_phase():
    timer = Timer()
    with timer("a"):
        pass
    with timer("a"):
        pass
    with timer("b"):
        pass
    out = timer.pop()
    assert set(out) == {"time/a", "time/b"} and timer.pop() == {}


def test_plot_script_writes_a_png(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "time": s, "eval/accuracy": s / 10})
                                                 for s in range(5)))
    out = subprocess.run([sys.executable, "scripts/tools/plot.py", str(run), "--keys", "eval/accuracy", "missing/key"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = run / "curves.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_with_a_dev_best_metric_the_bar_shows_the_held_out_value_and_the_summary_the_dev_selection(tmp_path, capsys):
    """--best_metric dev/accuracy (the default): the bar and the final value are the reported eval/accuracy; the best
    checkpoint is named with the dev/ metric that selected it."""
    from shared.tracking import Tracker

    t = Tracker({"best_metric": "dev/accuracy"}, tmp_path, "run", enabled=True, total=2)
    t.log({"eval/accuracy": 0.5, "dev/accuracy": 0.75, "best/dev/accuracy": 0.75, "best/step": 0}, step=0)
    t.progress(2)
    assert "eval/accuracy=0.5" in t._postfix() and "dev/" not in t._postfix()
    t.close()
    out = capsys.readouterr().out
    assert "final eval/accuracy 0.5 (best dev/accuracy 0.75 @ step 0)" in out

