"""Checkpoints: HF exports (`save_hf`), resumable training state (`Checkpointer`) and the best model (`BestModel`).

HF exports (`output_dir/final`, `output_dir/best`) are `save_pretrained` + tokenizer, loadable by transformers
and vLLM. A LoRA run (shared/lora.py) exports the merged model there too, plus its adapter in peft format in
`<export>/adapter/`. Resumable checkpoints live in `output_dir/checkpoints/step_<N>/`:

    <engine name>/                  DeepSpeed `save_checkpoint` of each trained model: weights, optimizer
                                    (ZeRO shards, one file per rank), LR scheduler, DeepSpeed's step counters;
                                    with LoRA only the trained weights (adapters, a scalar head) and their
                                    optimizer state: the frozen base is read again from the model path
    rank<r>.pt                      rank r's python / numpy / torch (and CUDA) RNG states and its local state
                                    (e.g. per-rank loss sums not yet reduced for logging)
    state.pt                        step, the run's flags, the metrics/samples file offsets, and the script's
                                    state: data sampler position, NaN-guard count, best metric, algorithm
                                    state (KL coefficient, loss windows, ...)

Loading is safe: every file of a checkpoint is read with torch's `weights_only` unpickler (tensors, numbers,
strings, lists, tuples, dicts, and the few plain DeepSpeed classes its engine states hold) before anything is
loaded, DeepSpeed's own `load_checkpoint` included; a file that would import anything else (a pickle that runs
code), a link that leads outside the checkpoint, or a missing or truncated file stops the run with a one-line error
naming it, having run nothing. DeepSpeed itself then loads through a weights-only engine confined to the checkpoint.

A checkpoint is written to `step_<N>.tmp` by every rank and renamed into place by rank 0 only when complete,
so an interrupted save never leaves a half-written checkpoint (a save that fails, on a full disk say, removes its
`.tmp` and stops with one line; a resume removes any left by a killed run); only the last `keep_checkpoints` are
kept.

`--resume`: `auto` continues the latest checkpoint if any, `yes` must, `no` must not, `overwrite` starts afresh and
deletes output_dir's checkpoints/, final/ and best/, and a path resumes that checkpoint. A fresh start into an
output_dir holding another run's results (final/, or args.json of other flags) is refused. Resuming step N of this
run's own checkpoints keeps one history: the later checkpoints, the finished marker, final/ and a best/ chosen after
N move to `checkpoints/retired_after_step_N/`.
Resuming restores all of it and truncates metrics.jsonl / samples.jsonl to what they held at the checkpoint,
so N steps + resume + M steps writes the same files (and weights) as N + M steps straight. Generation seeds
are derived from (seed, step), so they need no state. Every rank must see the same filesystem (as DeepSpeed
assumes).

Signals: after `restore()`, SIGTERM and SIGINT only set a flag; at the end of the current step every rank
agrees on it, a checkpoint is saved and the script exits with status 128 + signal (143 / 130). A second
signal stops at once without saving.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import pickle
import random
import re
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch

from shared.distributed import DistInfo, full_named_parameters, unwrap
from shared.lora import ADAPTER_DIR, adapter_state_dict, base_module, is_peft

# flags that may change between a run and its resumption (they do not change what is trained)
OPERATIONAL_FLAGS = {"resume", "stop_after_steps", "save_every", "keep_checkpoints", "report_to", "project",
                     "verbose", "max_nonfinite_steps"}
STEP_DIR = re.compile(r"^step_(\d+)$")


def save_hf(model, tokenizer, path: str | Path, info: DistInfo, extra_config: dict | None = None) -> Path:
    """Save `model` (plain module or DeepSpeed engine) so `from_pretrained` and vLLM can load it.

    Written to `<path>.tmp`, renamed into place when complete. Under ZeRO-3 every rank must call it. A LoRA model:
    the merged weights as the base model's checkpoint, and the adapter (peft format) in `<path>/adapter`."""
    path = Path(path)
    # collective under ZeRO-3 (all ranks iterate; one parameter gathered at a time): rank 0 keeps a CPU copy, the
    # other ranks drop each tensor at once, so no GPU holds a second full copy of the model
    state = {k: v.detach().cpu().contiguous() for k, v in full_named_parameters(model, info) if info.is_main}
    adapter = adapter_state_dict(model, info.zero_stage == 3) if is_peft(model) else None  # collective too
    if info.is_main:
        module = base_module(model)  # a LoRA model's transformers model: saves the merged weights as its own
        for name, buf in module.named_buffers():  # persistent buffers (rare in LMs) travel too
            if name in module.state_dict():
                state.setdefault(name, buf.detach().cpu())
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if extra_config:
            for k, v in extra_config.items():
                setattr(module.config, k, v)
        try:
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if adapter is not None:  # loads with PeftModel.from_pretrained(base model, "<path>/adapter")
                unwrap(model).save_pretrained(tmp / ADAPTER_DIR, state_dict=adapter)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        except (OSError, RuntimeError) as e:  # a full disk: no partial export left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"save: writing {path} failed ({' '.join(str(e).split())[:160]}); removed the partial "
                             f"{tmp}; free space and rerun the same command (it resumes from the last checkpoint)")
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    info.barrier()
    return path


def save_final(model, tokenizer, output_dir: str, info: DistInfo) -> str:
    """The trained policy as an HF checkpoint in output_dir/final (save_hf); returns its path."""
    return str(save_hf(model, tokenizer, os.path.join(output_dir, "final"), info))


def _frozen(engine) -> bool:
    """True when some weights are not trained (LoRA's base model): they are left out of resumable checkpoints and,
    on resume, are those read from the model path again."""
    return any(not p.requires_grad for p in engine.module.parameters())


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in output_dir/checkpoints as (step, path), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / "state.pt").exists()]
    return sorted(found)


def _safe_globals() -> list:
    """The classes besides tensors and Python's plain types that a checkpoint may hold, each plain attributes and
    no code: DeepSpeed's ZeRO optimizer states store its stage (an enum), its loss scaler and the fragment addresses
    of flat parameters; the async scripts' rank state holds generated, untrained batches (`Completion`s)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from shared.generation import Completion

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, Completion]


def safe_load(path: str | Path, what: str = "resume", mmap: bool = False):
    """torch.load with the weights_only unpickler (tensors, numbers, strings, lists, tuples, dicts, _safe_globals);
    a file that would import anything else is refused, unread, with a one-line ValueError naming it, and so is a
    missing, truncated or unreadable file. `mmap`: map the tensors' storage instead of reading it (a check of a
    large file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: {path} is missing: the checkpoint is incomplete; resume from another one "
                         "(--resume output_dir/checkpoints/step_N)")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and _is_zip(path))
    except pickle.UnpicklingError as e:
        try:
            names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - not a readable torch file: said below
            names = ""
        if names or "Weights only load failed" in str(e):
            raise ValueError(f"{what}: {path} is refused: it would import {names or 'an unknown object'} (a "
                             "checkpoint holds tensors, numbers, strings and lists; loading anything else could run "
                             "code)") from None
        raise ValueError(f"{what}: {path} is truncated or not a torch file ({' '.join(str(e).split())[:120]}); "
                         "resume from another checkpoint (--resume output_dir/checkpoints/step_N)") from None
    except (RuntimeError, EOFError, OSError) as e:  # a cut zip archive, an empty file, an unreadable one
        raise ValueError(f"{what}: {path} is truncated or unreadable ({' '.join(str(e).split())[:120]}); resume "
                         "from another checkpoint (--resume output_dir/checkpoints/step_N)") from None


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def check_checkpoint_files(path: Path) -> None:
    """Refuse a checkpoint directory any of whose pickled files (ours and DeepSpeed's) holds more than data, before
    any of them is loaded (DeepSpeed's load_checkpoint unpickles with weights_only=False). Links are followed: a file
    or folder that resolves outside the checkpoint is refused, so every file checked is one that will be loaded."""
    root = Path(path).resolve()
    for f in sorted(_checkpoint_files(Path(path), root)):
        with open(f, "rb") as fh:
            head = fh.read(4)
        # every .pt file (what DeepSpeed and the scripts load, a pickle of any protocol), and any other torch zip
        # file or pickle of protocol 2+; the rest (DeepSpeed's zero_to_fp32.py, json) is never unpickled
        if f.suffix == ".pt" or head == b"PK\x03\x04" or head[:1] == b"\x80":
            safe_load(f, mmap=True)


def _checkpoint_files(path: Path, root: Path) -> list[Path]:
    """Every file below `path` (links followed), each checked to resolve inside `root`; a link that leaves it (a
    relative or absolute link, to a file or a folder) is refused with a one-line ValueError naming it."""
    files, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        real = Path(dirpath).resolve()
        if real in seen:  # a link back into the tree: walked once
            dirnames[:] = []
            continue
        seen.add(real)
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            target = p.resolve()
            if target != root and root not in target.parents:
                raise ValueError(f"resume: {p} is refused: it links to {target}, outside the checkpoint {root} (a "
                                 "checkpoint holds its own files; what is loaded must be what was checked)")
        files += [Path(dirpath) / n for n in filenames if (Path(dirpath) / n).is_file()]
    return files


class _WeightsOnlyEngine:
    """DeepSpeed's checkpoint engine for loading, with every file read through `safe_load` (weights only) and only
    from inside the checkpoint being resumed: the second guard behind `check_checkpoint_files`, so that a file
    swapped after the check is refused too. Saving and the rest pass through to DeepSpeed's own engine."""

    def __init__(self, inner, root: Path):
        self.inner, self.root = inner, Path(root).resolve()

    def load(self, path: str, map_location=None):
        target = Path(path).resolve()
        if self.root not in target.parents:
            raise ValueError(f"resume: {path} is refused: it resolves to {target}, outside the checkpoint {self.root}")
        return safe_load(target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                     gauss), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class UserCodeError(ValueError):
    """User code (a reward function) failed mid-run; the message names the step and the checkpoint saved."""


class Checkpointer:
    """Resumable checkpoints of one run (see the module docstring).

        ckpt = Checkpointer(args, info)           # resolves --resume and checks files and flags; writes nothing
        tracker = Tracker(..., resume=ckpt.tracker_state)
        start_step, extra = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
        for step in range(start_step + 1, args.num_steps + 1):
            ckpt.step_start(tracker, sampler=sampler, guard=guard, best=best, kl_coef=kl_coef)
            ...
            with ckpt.user_code(step, engines, tracker):   # the reward function: on error, save step - 1, stop
                scores = compute_rewards(reward_fn, ...)
            ...
            if ckpt.step_end(step):               # save_every, stop_after_steps, or SIGTERM/SIGINT on any rank
                ckpt.save(step, engines, tracker, local={"window": window}, sampler=sampler, guard=guard,
                          best=best, kl_coef=kl_coef)
                if ckpt.stopping:
                    break
        if ckpt.stopping:
            return ckpt.stop(tracker)             # exits 128 + signal after a signal
        ...
        ckpt.finish()                             # marks the run complete

    Keyword state given to `save` is the same on every rank and stored once, by value or through `state_dict()`
    when the object has one; `restore` loads it back into the objects passed by the same keyword and returns
    the rest as a dict, together with `local` (each rank's own state, stored per rank).
    """

    def __init__(self, args, info: DistInfo):
        self.args, self.info = args, info
        self.root = Path(args.output_dir) / "checkpoints"
        self.save_every, self.keep = args.save_every, args.keep_checkpoints
        self.stop_after = args.stop_after_steps
        self.steps_this_run = 0
        self.stopping = False
        self.signum = 0
        self._received = 0
        self._start: dict | None = None  # step_start's snapshot
        self._old_handlers: dict = {}
        self.path = self._resolve(args.resume)
        self.state: dict = {}
        if self.path is not None:
            check_checkpoint_files(self.path)
            self.state = safe_load(self.path / "state.pt")
            for r in range(self.state["world_size"]):  # each rank's RNG and local state: read by restore()
                if not (self.path / f"rank{r}.pt").is_file():
                    raise ValueError(f"resume: {self.path / f'rank{r}.pt'} is missing: the checkpoint is incomplete; "
                                     "resume from another one (--resume output_dir/checkpoints/step_N)")
            self._check_compatible(self.state)

    # ------------------------------------------------------------------ resolving --resume
    def _resolve(self, resume: str) -> Path | None:
        output_dir = self.args.output_dir
        existing = list_checkpoints(output_dir)
        finished = self.root / "finished.json"
        if resume == "overwrite":  # start afresh: restore() deletes the earlier run's files
            return None
        if resume in ("auto", "yes"):
            if finished.exists():
                raise ValueError(f"resume: {output_dir} holds a finished run ({finished}); choose another "
                                 "--output_dir, or delete it")
            if not existing:
                if resume == "yes":
                    raise ValueError(f"resume: no checkpoint in {self.root} to resume from")
                self._refuse_earlier_results()
                return None
            return existing[-1][1]
        if resume == "no":
            if existing or finished.exists():
                raise ValueError(f"resume: {output_dir} already holds a run with checkpoints; pass --resume auto "
                                 "to continue it, --resume overwrite to replace it, or choose another --output_dir")
            self._refuse_earlier_results()
            return None
        path = Path(resume)
        if path.is_dir() and STEP_DIR.match(path.name.removesuffix(".tmp")) and not (path / "state.pt").exists():
            raise ValueError(f"resume: {path / 'state.pt'} is missing: the checkpoint is incomplete; resume from "
                             "another one (--resume output_dir/checkpoints/step_N)")
        if not (path / "state.pt").exists():
            raise ValueError(f"resume: expected auto, yes, no, overwrite or a checkpoint directory; {resume!r} is "
                             "none of them")
        return path

    def _refuse_earlier_results(self) -> None:
        """A fresh start into an output_dir that holds another run's results (no checkpoint to resume) is refused:
        a finished run (final/), or files written with other flags. A rerun of the same flags whose run never
        reached a checkpoint starts over."""
        out = Path(self.args.output_dir)
        if (out / "final").exists():
            raise ValueError(f"resume: {out} holds a finished run ({out / 'final'}) and no checkpoint to resume; pass "
                             "--resume overwrite to replace it, or choose another --output_dir")
        try:
            saved = json.loads((out / "args.json").read_text())
        except (OSError, ValueError):  # no earlier run, or not one of ours
            saved = None
        if isinstance(saved, dict):
            now = json.loads(json.dumps(dataclasses.asdict(self.args), default=str))
            diff = [f"--{k} {saved.get(k)!r} (now {v!r})" for k, v in now.items()
                    if k in saved and k not in OPERATIONAL_FLAGS and k != "output_dir" and saved[k] != v]
            if diff:
                raise ValueError(f"resume: {out} holds another run's results (args.json, metrics.jsonl), written with "
                                 f"other flags: {'; '.join(diff[:5])}; pass --resume overwrite to replace them, or "
                                 "choose another --output_dir")

    def _check_compatible(self, state: dict) -> None:
        if state["world_size"] != self.info.world_size:
            raise ValueError(f"resume: {self.path} was written by {state['world_size']} processes, now "
                             f"{self.info.world_size}; resume with the same number of processes")
        saved, now = state["args"], dataclasses.asdict(self.args)
        flags = [f.name for f in dataclasses.fields(self.args) if "Suppress" not in str(f.type)]  # not computed ones
        diff = [f"--{k} {saved.get(k)!r} (now {now[k]!r})" for k in flags
                if k not in OPERATIONAL_FLAGS and k != "output_dir" and saved.get(k) != now[k]]
        if diff:
            raise ValueError(f"resume: {self.path} was written with other flags: {'; '.join(diff)}; resume with the "
                             f"same flags, or choose another --output_dir")

    @property
    def tracker_state(self) -> dict | None:
        """What the Tracker needs to continue the run's files (None on a fresh run)."""
        return {**self.state["tracker"], "step": self.start_step} if self.path is not None else None

    @property
    def start_step(self) -> int:
        return self.state.get("step", 0)

    # ------------------------------------------------------------------ restore / save
    def restore(self, engines: dict, **objects) -> tuple[int, dict]:
        """Load engines (weights, optimizer, scheduler), RNG and the objects' states from the checkpoint being
        resumed; returns (step, the remaining saved state). (0, {}) on a fresh run. Call it right before the
        training loop: RNG states are restored last. From here on SIGTERM/SIGINT stop the run cleanly. Rank 0 first
        removes interrupted saves, and retires (resume) or deletes (`overwrite`) what came after the resumed step."""
        self._install_signal_handlers()
        if self.info.is_main:
            for stale in self.root.glob("step_*.tmp") if self.root.is_dir() else []:  # an interrupted save's
                shutil.rmtree(stale, ignore_errors=True)
            if self.path is None and self.args.resume == "overwrite":
                out = Path(self.args.output_dir)
                for old in (self.root, out / "final", out / "best"):
                    shutil.rmtree(old, ignore_errors=True)
            elif self.path is not None:
                self._retire_later()
        self.info.barrier()
        if self.path is None:
            return 0, {}
        for name, engine in engines.items():
            if not (self.path / name).is_dir():
                raise ValueError(f"resume: {self.path} has no state for the {name!r} model ({self.path / name} is "
                                 "missing): the checkpoint is incomplete or from another script")
            inner = engine.checkpoint_engine
            engine.checkpoint_engine = _WeightsOnlyEngine(inner, self.path)
            try:
                load_path, _ = engine.load_checkpoint(str(self.path), tag=name, load_optimizer_states=True,
                                                      load_lr_scheduler_states=True,
                                                      load_module_strict=not _frozen(engine))
            except (FileNotFoundError, AssertionError, RuntimeError, KeyError) as e:  # DeepSpeed's own checks
                raise ValueError(f"resume: {self.path / name} cannot be loaded ({' '.join(str(e).split())[:160]}); "
                                 "resume from another checkpoint (--resume output_dir/checkpoints/step_N)") from None
            finally:
                engine.checkpoint_engine = inner
            if load_path is None:
                raise ValueError(f"resume: {self.path} has no state for the {name!r} model")
        extra = dict(self.state["extra"])
        for key, obj in objects.items():
            if obj is not None and key in extra:
                obj.load_state_dict(extra.pop(key))
        rank_state = safe_load(self.path / f"rank{self.info.rank}.pt")
        _set_rng_state(rank_state["rng"])
        if self.info.is_main:
            print(f"[cleanrlhf] resumed from {self.path} (step {self.start_step})", flush=True)
        return self.start_step, {**extra, **rank_state["local"]}

    def _retire_later(self) -> None:
        """Resuming this run's step N leaves one history: its checkpoints after N, the finished marker, final/ and
        a best/ chosen after N belong to the abandoned branch and are moved to checkpoints/retired_after_step_N/
        (metrics.jsonl and samples.jsonl are cut back to step N by the Tracker), so that a later `--resume auto`
        continues this branch."""
        if self.path.resolve().parent != self.root.resolve():  # another output_dir's checkpoint: nothing here of it
            return
        out, step = Path(self.args.output_dir), self.start_step
        later = [p for s, p in list_checkpoints(out) if s > step]
        later += [p for p in (self.root / "finished.json", out / "final") if p.exists()]
        try:
            best_step = json.loads((out / "best" / "best.json").read_text())["step"]
        except (OSError, ValueError, KeyError, TypeError):
            best_step = None
        if best_step is not None and best_step > step:
            later.append(out / "best")
        if not later:
            return
        dest = self.root / f"retired_after_step_{step:08d}"
        n = 1
        while dest.exists():
            n += 1
            dest = self.root / f"retired_after_step_{step:08d}.{n}"
        dest.mkdir(parents=True)
        for p in later:
            shutil.move(str(p), str(dest / p.name))
        print(f"[cleanrlhf] resuming step {step}: moved what the run wrote after it "
              f"({', '.join(p.name for p in later)}) to {dest}", file=sys.stderr, flush=True)

    def step_end(self, step: int) -> bool:
        """True when a checkpoint is due after this step: every save_every steps, after stop_after_steps steps
        of this invocation, or when any rank received SIGTERM/SIGINT (then `stopping` is set)."""
        self.steps_this_run += 1
        signum = self._received
        if self.info.world_size > 1:  # ranks may receive the signal during different steps: agree on it
            t = torch.tensor([signum], dtype=torch.int64, device=self.info.device)
            signum = int(self.info.all_reduce(t, "max").item())
        if signum:
            self.signum, self.stopping = signum, True
        if self.stop_after and self.steps_this_run >= self.stop_after and step < self.args.num_steps:
            self.stopping = True
        return self.stopping or bool(self.save_every and step % self.save_every == 0)

    def save(self, step: int, engines: dict, tracker, local: dict | None = None, **state) -> Path:
        """Write checkpoint `step` (every rank must call this), then keep only the last keep_checkpoints."""
        extra = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items() if v is not None}
        return self._write(step, engines, tracker, _rng_state(), local or {}, tracker.state_dict(), extra)

    def step_start(self, tracker, local: dict | None = None, **state) -> None:
        """Remember the state at the start of a step (RNG states, metrics-file offsets, the keyword state `save`
        takes: small), so that `user_code` can still save the previous step when this one fails before its first
        optimizer update (the weights, optimizer and LR schedule are then those of the previous step)."""
        self._start = {"rng": copy.deepcopy(_rng_state()), "local": copy.deepcopy(local or {}),
                       "tracker": tracker.state_dict(),
                       "extra": {k: copy.deepcopy(v.state_dict() if hasattr(v, "state_dict") else v)
                                 for k, v in state.items() if v is not None}}

    @contextlib.contextmanager
    def user_code(self, step: int, engines: dict, tracker, trained: bool = False, local: dict | None = None,
                  **state):
        """Run user code (a reward function) so that its exception on any rank stops the run without losing work.

        Every rank agrees on whether some rank failed (one all-reduce), then all save a resumable checkpoint and
        raise a one-line ValueError naming the error, the step and the checkpoint: checkpoint `step - 1` from
        `step_start` when nothing of this step was trained yet (`trained=False`), or checkpoint `step` from the
        given state when it was (an evaluation after the update; that step's metrics line is then not written).
        In step 1 with nothing trained there is nothing to save. Every rank must enter the block."""
        error = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any user error; re-raised below as one line, with its cause
            error = e
        failed = error is not None
        if self.info.world_size > 1:
            t = torch.tensor([int(failed)], dtype=torch.int64, device=self.info.device)
            failed = bool(self.info.all_reduce(t, "max").item())
        if not failed:
            return
        if trained:
            path = self.save(step, engines, tracker, local=local, **state)
        elif step > 1 and self._start is not None:
            s = self._start
            path = self._write(step - 1, engines, tracker, s["rng"], s["local"], s["tracker"], s["extra"])
        else:
            path = None
        what = " ".join(str(error).split()) if error is not None else "the reward function failed on another rank"
        saved = (f"saved checkpoint {path}: fix it and rerun the same command to resume" if path else
                 "nothing to save in the first step")
        raise UserCodeError(f"{what} (step {step}); {saved}") from error

    def _write(self, step: int, engines: dict, tracker, rng: dict, local: dict, tracker_state: dict,
               extra: dict) -> Path:
        info = self.info
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        info.barrier()
        try:
            for name, engine in engines.items():
                engine.save_checkpoint(str(tmp), tag=name, save_latest=False,
                                       exclude_frozen_parameters=_frozen(engine))
            torch.save({"rng": rng, "local": local}, tmp / f"rank{info.rank}.pt")
            if info.is_main:
                torch.save({"step": step, "world_size": info.world_size, "args": dataclasses.asdict(self.args),
                            "tracker": tracker_state, "extra": extra}, tmp / "state.pt")
        except (OSError, RuntimeError) as e:  # a full disk (ENOSPC; torch's writer says "file write failed")
            shutil.rmtree(tmp, ignore_errors=True)
            latest = list_checkpoints(self.args.output_dir)
            then = (f"rerun the same command to resume from {latest[-1][1]}" if latest else
                    "no earlier checkpoint to resume from")
            raise ValueError(f"checkpoint: saving step {step} to {tmp} failed ({' '.join(str(e).split())[:160]}); "
                             f"removed the partial checkpoint; free space, then {then}") from None
        info.barrier()
        if info.is_main:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for _, old in list_checkpoints(self.args.output_dir)[: -max(self.keep, 1)]:
                shutil.rmtree(old, ignore_errors=True)
            tracker.write(f"[step {step}] saved checkpoint {final}")
        info.barrier()
        return final

    def stop(self, tracker) -> str:
        """End an interrupted run after its checkpoint: exit 128 + signal after SIGTERM/SIGINT; return "" after
        --stop_after_steps."""
        tracker.end_progress()  # the bar once, above the closing lines
        tracker.write(f"rerun with the same flags (--resume auto) to continue from {self.root}")
        tracker.close("stopped")
        self._uninstall_signal_handlers()
        if self.signum:
            raise SystemExit(128 + self.signum)
        return ""

    def finish(self) -> None:
        """Mark the run complete (a later --resume auto refuses to continue it) and drop the signal handlers."""
        self._uninstall_signal_handlers()
        if self.info.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "finished.json").write_text(json.dumps({"num_steps": self.args.num_steps}))
        self.info.barrier()

    # ------------------------------------------------------------------ signals
    def _handle(self, signum, frame) -> None:
        if self._received:  # a second signal: stop now, without saving
            self._uninstall_signal_handlers()
            signal.raise_signal(signum)
            return
        self._received = signum
        print(f"[cleanrlhf] {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then "
              "exiting (send it again to stop at once)", file=sys.stderr, flush=True)

    def _install_signal_handlers(self) -> None:
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old_handlers[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (e.g. called from a worker thread): no handlers
            self._old_handlers = {}

    def _uninstall_signal_handlers(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}


class BestModel:
    """Keeps the HF checkpoint with the best held-out metric in output_dir/best (best.json says which step).

    `metric` is a key of the evaluation metrics, higher is better; a `:min` suffix means lower is better
    (`dev/p_bad:min`). Empty: disabled. The scripts select on `dev/*`, the dev slice of the training split, so the
    reported `eval/*` numbers are not inflated by selection; selecting on `eval/*` is allowed but said (`tracker`).
    `has_dev` False (no dev slice: a tiny training split, or dev_num_* 0) with a `dev/` metric: nothing is kept,
    said. The prefix is checked at start-up (`parse`), the name at the first evaluation that logs that set (step 0,
    before any training): a name the run does not log is an error listing those it does. Every rank must call `update` (saving gathers ZeRO-3 shards)."""

    def __init__(self, metric: str, output_dir: str | Path, info: DistInfo, tokenizer=None, tracker=None,
                 has_dev: bool = True):
        self.key, self.sign = self.parse(metric)
        key = self.key
        if tracker is not None and key.startswith("eval/"):
            tracker.write(f"warning: best_metric {key} selects output_dir/best on the reported held-out set, so its "
                          f"{key} overstates what a fresh sample would give; dev/ metrics avoid that")
        if tracker is not None and key.startswith("dev/") and not has_dev:
            tracker.write("note: no dev slice (training split too small, or dev size 0): output_dir/best is not kept")
        self.path = Path(output_dir) / "best"
        self.info, self.tokenizer = info, tokenizer
        self.value: float | None = None
        self.step: int | None = None

    @staticmethod
    def parse(metric: str) -> tuple[str, float]:
        """`name[:min|:max]` -> (name, +1.0 when higher is better, -1.0 when lower is); also checked at start-up."""
        key, _, mode = metric.partition(":")
        if mode not in ("", "min", "max"):
            raise ValueError(f"best_metric: expected `name`, `name:min` or `name:max`, got {metric!r}")
        if key and key.split("/")[0] not in ("dev", "eval"):
            raise ValueError(f"best_metric: expected a held-out metric, dev/<name> or eval/<name>, got {metric!r}")
        return key, -1.0 if mode == "min" else 1.0

    def update(self, metrics: dict, step: int, model, extra_config: dict | None = None) -> dict:
        """Save `model` if metrics[key] improved; returns {"best/<key>", "best/step"} to log (empty if no metric)."""
        if not self.key:
            return {}
        prefix = self.key.split("/")[0] + "/"
        logged = sorted(k for k in metrics if k.startswith(prefix))
        if self.key not in metrics and logged:  # this set was evaluated, without that metric: a misspelt name
            raise ValueError(f"best_metric: {self.key!r} is not among this run's metrics on that set: "
                             f"{', '.join(logged)}")
        v = metrics.get(self.key)
        if v is None or v != v:  # absent (set not evaluated this time) or NaN
            return {}
        if self.value is None or self.sign * v > self.sign * self.value:
            self.value, self.step = float(v), step
            save_hf(model, self.tokenizer, self.path, self.info, extra_config)
            if self.info.is_main:
                (self.path / "best.json").write_text(json.dumps({"metric": self.key, "value": v, "step": step}))
        return {f"best/{self.key}": self.value, "best/step": self.step}

    def state_dict(self) -> dict:
        return {"value": self.value, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.step = state["value"], state["step"]
