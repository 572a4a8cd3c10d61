"""Resuming never unpickles code: every file of a checkpoint (ours and DeepSpeed's engine states) and dpo.py's saved
pairs are read with torch's weights_only unpickler, and a file that would import anything else stops the run with a
one-line error before anything is loaded or written (shared/checkpoint.py, `safe_load`, `check_checkpoint_files`)."""

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared.checkpoint import Checkpointer, check_checkpoint_files, safe_load

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--generator", "hf", "--dev_num_prompts", "8", "--total_episodes", "16", "--local_num_prompts", "4",
       "--num_generations", "4", "--local_micro_batch_size", "8", "--eval_every", "0", "--eval_num_prompts", "8",
       "--save_every", "1", "--no_save_model"]


class Payload:
    """What a crafted checkpoint holds: unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real one-step grpo.py checkpoint (HF generation: no engine start), written by the code under test."""
    out = tmp_path_factory.mktemp("run")
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), *RUN], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (step,) = sorted((out / "checkpoints").glob("step_*"))
    return step


def _crafted(src: Path, tmp_path: Path, name: str, how: str) -> tuple[Path, Path]:
    """A copy of the checkpoint whose file `name` is replaced by a crafted torch file or a bare pickle."""
    dst = tmp_path / "ckpt" / src.name
    shutil.copytree(src, dst)
    marker = tmp_path / "ran"
    target = dst / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if how == "torch":
        torch.save({"step": 1, "payload": Payload(marker)}, target)
    else:  # a bare pickle, of the newest protocol or of protocol 0 (text, no protocol header)
        target.write_bytes(pickle.dumps(Payload(marker), protocol=0 if how == "pickle0" else None))
    return dst, marker


def test_every_file_of_a_real_checkpoint_loads_safely(checkpoint):
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*.pt"))
    assert {"state.pt", "rank0.pt", "policy/mp_rank_00_model_states.pt"} <= set(files), files
    check_checkpoint_files(checkpoint)
    state = safe_load(checkpoint / "state.pt")
    assert state["step"] == 1 and state["args"]["total_episodes"] == 16


@pytest.mark.parametrize("name", ["state.pt", "rank0.pt", "policy/mp_rank_00_model_states.pt",
                                  "policy/zero_pp_rank_0_mp_rank_00_optim_states.pt"])
@pytest.mark.parametrize("how", ["torch", "pickle", "pickle0"])
def test_a_crafted_pickle_in_any_file_is_refused_and_runs_nothing(checkpoint, tmp_path, name, how):
    path, marker = _crafted(checkpoint, tmp_path, name, how)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), save_every=1, keep_checkpoints=1, stop_after_steps=0,
                           resume=str(path))
    with pytest.raises(ValueError) as e:
        Checkpointer(args, SimpleNamespace(rank=0, world_size=1, is_main=True))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"resume: {path / name} is refused: it would import")
    assert "system" in message or how != "torch"
    assert not marker.exists()


def test_the_script_refuses_a_crafted_checkpoint_with_one_line_and_writes_nothing(checkpoint, tmp_path):
    path, marker = _crafted(checkpoint, tmp_path, "state.pt", "torch")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), *RUN, "--resume",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: resume: {path / 'state.pt'} is refused")
    assert not marker.exists() and not out.exists()


def test_deepspeeds_zero_optimizer_classes_are_allowed_and_nothing_else():
    """What ZeRO-2/3 optimizer states hold besides tensors (measured on a 2-process ZeRO-2 checkpoint): the stage
    enum, the loss scaler and fragment addresses. They load; a class outside the list does not."""
    import tempfile

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with tempfile.TemporaryDirectory() as d:
        ok = Path(d) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
                                             "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}]},
                    "ds_version": "0.19.8"}, ok)
        check_checkpoint_files(Path(d))
        assert safe_load(ok)["optimizer_state_dict"]["zero_stage"] == ZeroStageEnum.gradients
        torch.save({"x": SimpleNamespace(a=1)}, Path(d) / "other.pt")
        with pytest.raises(ValueError, match=r"other\.pt is refused: it would import types\.SimpleNamespace"):
            check_checkpoint_files(Path(d))


def _outside_payload(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the checkpoint, and outside it a copy of its `policy/` folder whose model-states file is the real
    state dict with a payload beside it (so that a load that runs it would even continue)."""
    dst = tmp_path / "ckpt" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    outside = tmp_path / "elsewhere" / "policy"
    shutil.copytree(checkpoint / "policy", outside)
    marker = tmp_path / "ran"
    states = outside / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)
    torch.save({**sd, "payload": Payload(marker)}, states)
    return dst, outside, marker


@pytest.mark.parametrize("how", ["relative folder link", "absolute folder link", "linked file"])
def test_a_link_out_of_the_checkpoint_is_refused_and_runs_nothing(checkpoint, tmp_path, how):
    """The crafted file sits outside the checkpoint, reached through a link: the check follows links, and refuses any
    that leaves the checkpoint (before the fix, the walk skipped the link and DeepSpeed's load ran the payload)."""
    path, outside, marker = _outside_payload(checkpoint, tmp_path)
    if how == "linked file":
        link = path / "policy" / "mp_rank_00_model_states.pt"
        link.unlink()
        link.symlink_to(os.path.relpath(outside / "mp_rank_00_model_states.pt", link.parent))
    else:
        link = path / "policy"
        shutil.rmtree(link)
        link.symlink_to(os.path.relpath(outside, path) if how.startswith("relative") else outside)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), save_every=1, keep_checkpoints=1, stop_after_steps=0,
                           resume=str(path))
    with pytest.raises(ValueError, match=r"^resume: .* is refused: it links to .*, outside the checkpoint") as e:
        Checkpointer(args, SimpleNamespace(rank=0, world_size=1, is_main=True))
    assert "\n" not in str(e.value) and not marker.exists()


def test_the_script_refuses_a_linked_checkpoint_and_writes_nothing(checkpoint, tmp_path):
    path, outside, marker = _outside_payload(checkpoint, tmp_path)
    shutil.rmtree(path / "policy")
    (path / "policy").symlink_to(os.path.relpath(outside, path))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), *RUN, "--resume",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "outside the checkpoint" in proc.stderr.strip().splitlines()[-1]
    assert not marker.exists() and not out.exists()


def test_a_link_inside_the_checkpoint_is_followed_and_checked(checkpoint, tmp_path):
    """A link that stays inside the checkpoint is allowed, and the file it points to is checked like any other."""
    dst = tmp_path / "ckpt" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    (dst / "state_link.pt").symlink_to("state.pt")
    check_checkpoint_files(dst)
    marker = tmp_path / "ran"
    torch.save({"payload": Payload(marker)}, dst / "crafted.bin")
    (dst / "policy" / "alias.pt").symlink_to("../crafted.bin")
    with pytest.raises(ValueError, match=r"crafted\.bin is refused: it would import"):
        check_checkpoint_files(dst)
    assert not marker.exists()


def test_deepspeed_loads_through_the_weights_only_engine(checkpoint, tmp_path):
    """The second guard: a file DeepSpeed opens is read weights-only and only from inside the checkpoint, so a file
    swapped after the check is refused too."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from shared.checkpoint import _WeightsOnlyEngine

    path, outside, marker = _outside_payload(checkpoint, tmp_path)
    engine = _WeightsOnlyEngine(TorchCheckpointEngine(), path)
    assert engine.load(str(path / "policy" / "mp_rank_00_model_states.pt"))["module"]
    assert engine.name == "TorchCheckpointEngine"  # everything else passes through
    with pytest.raises(ValueError, match="outside the checkpoint"):
        engine.load(str(outside / "mp_rank_00_model_states.pt"))
    shutil.copy(outside / "mp_rank_00_model_states.pt", path / "policy" / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match="is refused: it would import"):
        engine.load(str(path / "policy" / "mp_rank_00_model_states.pt"))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["state.pt", "rank0.pt"])
@pytest.mark.parametrize("how", ["truncated", "empty", "missing"])
def test_a_truncated_or_missing_file_is_one_line_naming_it(checkpoint, tmp_path, name, how):
    dst = _damaged(checkpoint, tmp_path, name, how)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), save_every=1, keep_checkpoints=1, stop_after_steps=0,
                           resume=str(dst))
    with pytest.raises(ValueError) as e:
        Checkpointer(args, SimpleNamespace(rank=0, world_size=1, is_main=True))
    message = str(e.value)
    assert "\n" not in message and str(dst / name) in message
    assert ("missing" if how == "missing" else "truncated") in message


@pytest.mark.parametrize("how", ["truncated", "missing"])
def test_the_script_stops_with_one_line_on_a_damaged_model_state(checkpoint, tmp_path, how):
    """DeepSpeed's own files: read through the weights-only engine, which names the file, or refused by DeepSpeed's
    checks, which the restore turns into one line naming the engine's folder."""
    dst = _damaged(checkpoint, tmp_path, "policy/mp_rank_00_model_states.pt", how)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), *RUN, "--resume",
                           str(dst)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: resume: ") and str(dst / "policy") in last, last


def _damaged(checkpoint: Path, tmp_path: Path, name: str, how: str) -> Path:
    dst = tmp_path / "ckpt" / checkpoint.name
    shutil.copytree(checkpoint, dst)
    target = dst / name
    if how == "missing":
        target.unlink()
    else:
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2] if how == "truncated" else b"")
    return dst
