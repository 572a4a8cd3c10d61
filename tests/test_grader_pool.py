"""The sympy worker of shared/graders.py under faults: a SIGTERM to a run's process group (SLURM preemption,
`scancel`, `timeout`), a worker killed by SIGKILL (the OOM killer), and a caller without a main guard. A dead worker
counts as a timeout and a fresh one serves later calls; nothing waits on it forever."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared import graders
from shared.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _workers(parent: int) -> list[int]:
    """Pids of the grader workers (multiprocessing spawn children) of process `parent`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"spawn_main" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (ValueError, OSError, IndexError):
            continue
    return pids


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _in_thread(fn, timeout: float):
    """`fn()` in a thread; fails the test instead of hanging when it does not return within `timeout` seconds."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"no answer from the grader within {timeout} s (a hang)"
    return result[0]


def test_sigterm_to_the_process_group_of_a_math_graded_run_exits_143_with_a_checkpoint(tmp_path):
    """grpo.py with `--reward_fn math` on gold answers written as fractions (so every grade goes to the sympy worker),
    SIGTERM to the whole process group mid-run: the step finishes, the checkpoint is saved and the process exits 143
    within seconds, its worker gone (before: the worker died holding the pool's lock and the run never exited)."""
    from shared import task

    for split, name in (("train", "prompts.jsonl"), ("test", "prompts.test.jsonl")):
        rows = [{"prompt": r["prompt"], "answer": "\\frac{%d}{2}" % (2 * int(r["answer"]))}
                for r in task.builtin_split(split)[:32]]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cmd = [sys.executable, "algorithms/grpo.py", "--output_dir", str(out), "--dataset", str(tmp_path / "prompts.jsonl"),
           "--reward_fn", "math", "--model_name_or_path", "builtin:tiny-sft", "--generator", "hf",
           "--local_num_prompts", "2", "--num_generations", "2", "--local_micro_batch_size", "4",
           "--max_new_tokens", "8", "--eval_num_prompts", "4", "--eval_every", "0", "--save_every", "0",
           "--total_episodes", "400"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and '"step": 2' in metrics.read_text():
                break
            time.sleep(0.1)
        workers = _workers(proc.pid)
        assert proc.poll() is None and workers, "the run ended, or graded without a sympy worker, before step 2"
        os.killpg(proc.pid, signal.SIGTERM)
        log = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, log[-3000:]
    (step, _), = list_checkpoints(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step >= 2 and rows[-1]["step"] == step and not (out / "checkpoints" / "finished.json").exists()
    time.sleep(0.5)
    assert not any(_alive(pid) for pid in workers), "the grader worker outlived its run"


def test_a_killed_worker_is_a_timeout_and_a_fresh_one_grades_the_next_call():
    """SIGKILL to the idle worker (as the OOM killer): the next grade comes back at once as a timeout (False), the
    one after is graded by a new worker (before: the next grade and the pool's terminate waited forever)."""
    assert _in_thread(lambda: graders.symbolic_equal("x+1", "1+x"), 120)
    pid = graders._POOL.process.pid
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.05)
    start = time.time()
    assert not _in_thread(lambda: graders.symbolic_equal("x+1", "1+x", timeout=30.0), 60)  # a timeout, yet at once
    assert time.time() - start < 10
    assert _in_thread(lambda: graders.symbolic_equal("x+1", "1+x"), 120)
    assert graders._POOL.process.pid != pid and _alive(graders._POOL.process.pid)


def test_a_replaced_worker_does_not_rerun_a_caller_without_a_main_guard(tmp_path):
    """A user's script that grades at top level (no `if __name__ == "__main__":`): its worker killed, the replacement
    does not re-import (re-run) the script (before: the pool restarted its worker with the script's code)."""
    script = tmp_path / "user_reward.py"
    script.write_text(
        "import multiprocessing, os, signal, time\n"
        "from shared import graders\n"
        "print('ran', flush=True)\n"
        "print(graders.symbolic_equal('x+1', '1+x'), flush=True)\n"
        "os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)\n"
        "time.sleep(1.0)\n"
        "print(graders.symbolic_equal('x+1', '1+x'), graders.symbolic_equal('x+1', '1+x'), flush=True)\n")
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the script hung; its output: {e.stdout!r}") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["ran", "True", "False True"], proc.stdout


# ---------------------------------------------------------------- shared/units.py line_spans (issue #61, item 5)
def test_line_spans_end_a_line_at_a_token_of_several_newlines_and_blank_lines_are_no_lines():
    """GPT-2-style vocabularies hold '\\n\\n': '7' '\\n\\n' '1' '2' '\\n' is two lines, as when the newlines are two
    tokens (before: a line ended after every token once a '\\n\\n' had passed: '7\\n\\n', '1', '2\\n')."""
    from shared.units import line_spans

    vocab = {"7": 0, "1": 1, "2": 2, "\n": 3, "\n\n": 4, " ": 5, "<eos>": 6}
    piece = {i: ("" if t == "<eos>" else t) for t, i in vocab.items()}
    decode = lambda ids: "".join(piece[i] for i in ids)  # noqa: E731

    def lines(*tokens):
        ids = [vocab[t] for t in tokens]
        spans = line_spans(decode, ids)
        assert [j for a, b in spans for j in range(a, b)] == list(range(len(ids)))  # a partition of the tokens
        return ["".join(tokens[a:b]) for a, b in spans]

    assert lines("7", "\n\n", "1", "2", "\n") == ["7\n\n", "12\n"]
    assert lines("7", "\n", "\n", "1", "2", "\n") == ["7\n\n", "12\n"]  # the same lines, one newline a token
    assert lines("7", "\n\n", "1", "\n\n", "2", "<eos>") == ["7\n\n", "1\n\n", "2<eos>"]
    assert lines("7", "\n", " ", "\n", "1", "\n", "2", "\n", "\n", "<eos>") == ["7\n \n", "1\n", "2\n\n<eos>"]
    assert lines("\n\n", "7", "\n", " ", "1") == ["\n\n7\n", " 1"]  # leading blank lines join the first line
    assert lines("7", "1", "2") == ["712"] and lines() == []
