"""Tracking plumbing: JSONL metrics, sample tables, wandb (offline), the no-op tracker of non-main ranks, plotting."""

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(_Args(), tmp_path / "run", "run", enabled=True, total=1, track=True, wandb_project="test")
    t.log({"a": 2.0}, step=1)
    t.log_samples([{"prompt": "p", "completion": "c", "reward": 0.0}], step=1)
    t.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


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
    out = subprocess.run([sys.executable, "scripts/plot.py", str(run), "--keys", "eval/accuracy", "missing/key"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = run / "curves.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
