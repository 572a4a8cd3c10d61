"""One history per output_dir (shared/checkpoint.py): resuming an older checkpoint retires what came after it, a
fresh start never overwrites another run's results unless asked (`--resume overwrite`), and a save that fails on a
full disk stops with one line and leaves no partial checkpoint. Real grpo.py runs (HF generation, tiny sizes)."""

import json
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--generator", "hf", "--dev_num_prompts", "8", "--local_num_prompts", "4", "--num_generations", "4",
       "--local_micro_batch_size", "8", "--eval_every", "0", "--eval_num_prompts", "8", "--save_every", "1",
       "--keep_checkpoints", "4", "--best_metric", ""]


def grpo(out: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), *RUN, *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step run with a checkpoint after every step (and final/)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    grpo(out, "--total_episodes", "64")
    return out


def test_resuming_an_older_checkpoint_retires_the_abandoned_branch(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    straight = steps(out)
    assert straight == sorted(straight) and straight[-1] == 4  # (the final evaluation logs step 4 again)
    # resume step 2 (as the non-finite-step error advises), one step, stop at a checkpoint
    grpo(out, "--total_episodes", "64", "--resume", str(out / "checkpoints" / "step_00000002"),
         "--stop_after_steps", "1")
    retired = out / "checkpoints" / "retired_after_step_00000002"
    assert sorted(p.name for p in retired.iterdir()) == ["final", "finished.json", "step_00000003", "step_00000004"]
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_00000001", "step_00000002",
                                                                              "step_00000003"]
    assert not (out / "final").exists() and max(steps(out)) == 3
    # the next `--resume auto` continues this branch (before: the abandoned step 4, metrics read 0, 1, 2, 4)
    proc = grpo(out, "--total_episodes", "64")
    assert "resumed from" in proc.stdout + proc.stderr and "step_00000003" in proc.stdout + proc.stderr
    assert steps(out) == straight and (out / "final").is_dir()


def test_a_finished_run_without_checkpoints_is_not_overwritten(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints")  # deleted to free space: the finished marker went with it
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    proc = grpo(out, "--total_episodes", "32", "--learning_rate", "1e-5", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: resume: {out} holds a finished run") and "--resume overwrite" in last
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    grpo(out, "--total_episodes", "32", "--resume", "overwrite")
    assert steps(out)[-1] == 2 and json.loads((out / "args.json").read_text())["total_episodes"] == 32


@dataclass
class Args:
    output_dir: str
    resume: str = "auto"
    learning_rate: float = 1e-4
    save_every: int = 1
    keep_checkpoints: int = 1
    stop_after_steps: int = 0


def test_another_runs_files_with_other_flags_are_refused(tmp_path):
    """A run that never reached a checkpoint: the same flags start over, other flags are refused, unless asked."""
    from shared.checkpoint import Checkpointer

    info = SimpleNamespace(rank=0, world_size=1, is_main=True)
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text(json.dumps({"output_dir": "elsewhere", "resume": "no", "learning_rate": 0.5}))
    with pytest.raises(ValueError, match=r"holds another run's results .* --learning_rate 0\.5 \(now 0\.0001\)"):
        Checkpointer(Args(str(out)), info)
    assert Checkpointer(Args(str(out), learning_rate=0.5), info).path is None  # the same command: starts over
    assert Checkpointer(Args(str(out), resume="overwrite"), info).path is None
    (out / "final").mkdir()
    with pytest.raises(ValueError, match="holds a finished run"):
        Checkpointer(Args(str(out), learning_rate=0.5, resume="no"), info)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for the run's logs, not for a checkpoint (the tiny model's is about 10 MiB)."""
    mnt = tmp_path / f"disk_{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.decode().strip()}): the full-disk case needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_checkpoint(small_disk):
    out = small_disk / "run"
    proc = grpo(out, "--total_episodes", "32", check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint: saving step 1 to ") and "removed the partial checkpoint" in last, last
    assert not list((out / "checkpoints").glob("*.tmp")) and not list((out / "checkpoints").glob("step_*"))
