"""A quiet console (shared/console.py): library INFO/WARNING logs and warnings hidden unless --verbose, errors shown;
one progress bar and a summary line per run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared import console

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = """
import logging, os, sys, sysconfig, warnings
from shared.console import quiet_libraries

quiet_libraries(verbose=sys.argv[1] == "verbose")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger

configure_logging_if_needed(LoggingConfig())  # as vLLM does when an engine is created (level: VLLM_LOGGING_LEVEL)
log = init_logger("vllm.console_test")
log.info("VLLM-INFO")
log.warning("VLLM-WARNING")
log.error("VLLM-ERROR")
import deepspeed  # on CPU it warns "Setting accelerator to CPU" while importing; its logger resets its level

deepspeed.utils.logger.warning("DS-WARNING")
deepspeed.utils.logger.error("DS-ERROR")
from transformers.utils import logging as hf_logging

hf_logging.get_logger("transformers.console_test").warning("HF-WARNING")
hf_logging.get_logger("transformers.console_test").error("HF-ERROR")
logging.getLogger("accelerate.console_test").warning("ACCELERATE-WARNING")
logging.getLogger("accelerate.console_test").error("ACCELERATE-ERROR")
library_file = os.path.join(sysconfig.get_paths()["purelib"], "some_library.py")  # a warning raised in a library
exec(compile("import warnings; warnings.warn('LIBRARY-WARNING', FutureWarning)", library_file, "exec"))
warnings.warn("USER-WARNING")  # raised by the user's own code
print("PRINTED")
"""
HIDDEN = ["VLLM-INFO", "VLLM-WARNING", "DS-WARNING", "HF-WARNING", "ACCELERATE-WARNING", "LIBRARY-WARNING"]
SHOWN = ["VLLM-ERROR", "DS-ERROR", "HF-ERROR", "ACCELERATE-ERROR", "USER-WARNING", "PRINTED"]


def clean_env(**extra) -> dict:
    """This environment without the variables quiet_libraries sets (another test may have left them)."""
    env = {k: v for k, v in os.environ.items() if k not in console.LIBRARY_ENV}
    return {**env, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_library_logs_and_warnings_are_hidden_unless_verbose_and_errors_always_show(mode):
    proc = subprocess.run([sys.executable, "-c", LIBRARIES, mode], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for marker in SHOWN:
        assert marker in out, marker
    for marker in HIDDEN:
        assert (marker in out) == (mode == "verbose"), marker
    if "Setting accelerator to CPU" in out or mode == "quiet":  # DeepSpeed only warns on a machine without GPU
        assert ("Setting accelerator to CPU" in out) == (mode == "verbose")


def test_muted_holds_back_library_output_and_shows_it_when_the_call_fails(monkeypatch, capfd):
    monkeypatch.setattr(console, "_verbose", False)
    with console.muted():
        os.write(1, b"C-LEVEL STDOUT\n")  # as a C++ extension writes, past Python's sys.stdout
        os.write(2, b"C-LEVEL STDERR\n")
    assert capfd.readouterr() == ("", "")
    with pytest.raises(RuntimeError, match="engine failed"):
        with console.muted():
            os.write(2, b"why it failed\n")
            raise RuntimeError("engine failed")
    assert "why it failed" in capfd.readouterr().err
    monkeypatch.setattr(console, "_verbose", True)
    with console.muted():
        os.write(1, b"VERBOSE\n")
    assert "VERBOSE" in capfd.readouterr().out


# ---------------------------------------------------------------- real runs, as users launch them
TINY_RUN = ["algorithms/grpo.py", "--model_name_or_path", "builtin:tiny", "--total_episodes", "32",
            "--local_num_prompts", "4", "--num_generations", "4", "--local_micro_batch_size", "8",
            "--eval_num_prompts", "8", "--eval_num_samples", "2", "--eval_every", "1", "--sample_every", "0"]
READ_TRACKIO = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
                "print(json.dumps([sorted(r) for r in S.get_logs('cleanrlhf', S.get_runs('cleanrlhf')[0])]))")
LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|Warning)\b|RotaryEmbedding|it/s\]|s/it\]|\d+%\|")


def launch(args: list[str], **env) -> tuple[str, str]:
    """stdout and stderr as a terminal receives them (bytes decoded as they are: text mode would turn \r into \n)."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=clean_env(**env), capture_output=True, timeout=600)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, (stdout + stderr)[-6000:]
    return stdout, stderr


@pytest.mark.slow
def test_a_default_run_prints_our_lines_one_progress_bar_and_a_summary(tmp_path):
    """grpo.py with vLLM (2 steps), reporting to trackio: no vLLM/library INFO or WARNING line on the console, one
    progress bar (tqdm redraws it with \\r), a summary line; trackio stores the metrics.jsonl names locally."""
    out_dir = tmp_path / "run"
    stdout, stderr = launch([*TINY_RUN, "--output_dir", str(out_dir), "--report_to", "trackio"],
                            TRACKIO_DIR=str(tmp_path / "trackio"))
    console_text = stdout + stderr
    pieces = [p for p in re.split(r"[\r\n]", console_text) if p.strip()]
    assert not [p for p in pieces if LIBRARY_LINE.search(p)], console_text[-6000:]
    bars = [p for p in pieces if re.search(r": step \d+/2 \|", p)]
    assert len({b.split(":")[0] for b in bars}) == 1 and bars[-1].split(":")[0].startswith("grpo__")
    assert re.search(r": step 2/2 \|.*reward=[-0-9.e]+, eval/accuracy=[0-9.]+", bars[-1]), bars[-1]
    assert "nan" not in " ".join(bars)
    assert stderr.count("\n") == 1  # the bar's own line, redrawn in place (\r)
    lines = stdout.split("\n")[:-1]
    assert len(lines) <= 6, stdout  # trackio's line, the data line, step 0's accuracy, first -> last, the summary
    summary = (rf"done: 2 steps in \S+; final eval/accuracy [0-9.]+ \(best dev/accuracy [0-9.]+ @ step \d\); "
               rf"wrote {re.escape(str(out_dir))}/metrics.jsonl, final/, best/")
    assert re.fullmatch(summary, lines[-1]), lines[-1]
    read = subprocess.run([sys.executable, "-c", READ_TRACKIO], env=clean_env(TRACKIO_DIR=str(tmp_path / "trackio")),
                          capture_output=True, text=True, timeout=300)  # TRACKIO_DIR is read when trackio is imported
    trackio_keys = {k for row in json.loads(read.stdout.splitlines()[-1]) for k in row} - {"step", "timestamp"}
    jsonl_keys = {k for line in (out_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}
    assert trackio_keys == jsonl_keys - {"step", "time"}


@pytest.mark.slow
def test_verbose_shows_the_library_logs(tmp_path):
    stdout, stderr = launch([*TINY_RUN, "--output_dir", str(tmp_path), "--verbose"])
    assert re.search(r"INFO .*\[", stdout + stderr) and "WARNING" in stdout + stderr
    assert "Reloading weights" in stdout + stderr  # vLLM's weight-sync INFO line, every step


# ---------------------------------------------------------------- the end of a run: the bar's last state once
def _console_of_a_run(tmp_path, monkeypatch, stopped: bool) -> list[str]:
    """What a log file (stdout and stderr into one file, `\\r` read as a line break) holds of a Tracker's 3-step
    run, finished or stopped after step 2 with the checkpoint's two lines; tqdm draws on every update
    (mininterval 0), as it does when a step takes longer than its 0.1 s."""
    import io

    from shared.tracking import Tracker

    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    monkeypatch.setattr(sys, "stderr", log)
    tracker = Tracker({"best_metric": "eval/accuracy"}, tmp_path, "run", True, total=3)
    tracker.bar.mininterval = 0
    first = tracker.log_start({"eval/accuracy": 0.25}, "eval/accuracy", 10, 0)
    for step in (1, 2) if stopped else (1, 2, 3):
        tracker.log({"objective/scores": 0.5}, step)
        tracker.progress(1, reward=0.5)
    if stopped:
        tracker.write("[step 2] saved checkpoint c")
        tracker.write("rerun with the same flags (--resume auto) to continue from c")
        tracker.close("stopped")
    else:
        tracker.log_end({"eval/accuracy": 0.75, "time/total": 1.0}, 3, "eval/accuracy", first)
        tracker.close()
    return [p for p in re.split(r"[\r\n]", log.getvalue()) if p.strip()]


def test_the_progress_bar_is_not_drawn_again_and_again_at_the_end_of_a_run(tmp_path, monkeypatch):
    """A finished run: the last step's bar, then the final bar (with the final evaluation) once, above the
    `first -> last` and summary lines; a stopped run: the bar below the checkpoint's lines once (before: the same
    final bar three times, and below the `first -> last` line; a stopped run's twice in a row)."""
    pieces = _console_of_a_run(tmp_path / "done", monkeypatch, stopped=False)
    bar = re.compile(r"^run: step \d/3 \|")
    assert [bool(bar.match(p)) for p in pieces[-4:]] == [True, True, False, False], pieces
    assert "reward=0.5, eval/accuracy=0.25" in pieces[-4] and "reward=0.5, eval/accuracy=0.75" in pieces[-3]
    assert pieces[-2].startswith("held-out accuracy 0.250 -> 0.750") and pieces[-1].startswith("done: 3 steps")
    assert sum(p.startswith("run: step 3/3") for p in pieces) == 2
    pieces = _console_of_a_run(tmp_path / "stopped", monkeypatch, stopped=True)
    assert [bool(bar.match(p)) for p in pieces[-6:]] == [True, False, True, False, True, False], pieces
    assert pieces[-1].startswith("stopped: 2 steps")
