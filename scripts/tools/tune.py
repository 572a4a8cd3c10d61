"""Hyperparameter search for any script in algorithms/, on Optuna. Docs: docs/tuning.md

One tuner for every script (not one per trainer): a search space in a small JSON or YAML file maps the script's
flags to distributions, and each trial is the script's own process, launched as a user would, in its own output_dir:
    python scripts/tools/tune.py --space scripts/tools/tune_spaces/grpo.yaml --script algorithms/grpo.py \\
        --objective eval/accuracy --direction maximize --n_trials 8
    accelerate launch ... : add --launcher accelerate --accelerate_config scripts/accelerate/zero2.yaml --num_processes 2

The search space file (flag -> distribution, plus fixed flags):
    search_space:
      learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}
      num_iterations: {type: int, low: 1, high: 4}
      loss_aggregation: {type: categorical, choices: [token_mean, seq_mean]}
    fixed: {total_episodes: 3200, eval_every: 2, save_model: false}

Everything else is Optuna's:
    - storage: an RDB (SQLite by default, sqlite:///<study_dir>/study.db; any SQLAlchemy URL), with heartbeats, so
      a killed worker's RUNNING trial is marked FAIL by the next worker (and retried with --max_retry); the same
      --study_name continues where it stopped; several workers (--n_jobs threads, or the same command run several
      times, on one machine or several) share one study; optuna-dashboard reads the storage as it is;
    - sampler: TPE (multivariate, constant liar for parallel workers) or random;
    - pruner: median or Hyperband, fed the objective metric as the run logs it (metrics.jsonl, polled while the
      process runs); a pruned trial's process group is killed.
Objective: one metric key of metrics.jsonl, maximised or minimised, its last value (`last`) or the best over the run
(`best`). A crashed trial is FAIL with its error's last line as user attr `error`; the study goes on.
Writes, under --study_dir: study.db, trials/<number>/ (each trial's output_dir) and trials/<number>.log (its stdout
and stderr), best_params.json (the best trial's flags and the command to paste) and, with --seeds, seeds/ and the
best flags against the defaults over those seeds (mean and spread) in best_params.json. --result_dir also writes
the whole summary (command, machine, every trial) as JSON there (docs/bench/tuning/).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge, Gt

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_common import ROOT, child_env, environment, invocation, write_result  # noqa: E402


@dataclass
class Args:
    script: str = "algorithms/grpo.py"
    """the script to tune (any script whose flags are a dataclass `Args`, e.g. algorithms/*.py)"""
    space: str = "scripts/tools/tune_spaces/grpo.yaml"
    """search-space file (JSON or YAML): `search_space` (flag -> distribution) and `fixed` (flag -> value)"""
    objective: str = "eval/accuracy"
    """metric key of the run's metrics.jsonl to optimise"""
    direction: Literal["maximize", "minimize"] = "maximize"
    """maximise or minimise the objective"""
    objective_reduce: Literal["last", "best"] = "last"
    """the objective's value of a run: its last logged value, or the best over the run"""
    n_trials: Annotated[int, Ge(0)] = 8
    """trials of the study in all (finished, pruned, failed or running, any worker); a continued study runs the rest"""
    n_jobs: Annotated[int, Ge(1)] = 1
    """trials at once in this worker (threads, one process each); more workers: run the same command again"""
    study_name: str = "tune"
    """study name in the storage; an existing study of this name is continued"""
    study_dir: str = "runs/tune"
    """where trials/, best_params.json and (by default) study.db go"""
    storage: str = ""
    """SQLAlchemy URL of the study's database (empty: sqlite:///<study_dir>/study.db); e.g. postgresql://host/db"""
    sampler: Literal["tpe", "random"] = "tpe"
    """Optuna sampler: TPE (multivariate, constant liar) or random"""
    seed: Annotated[int, Ge(0)] = 1
    """sampler seed; give each worker process of one study its own"""
    pruner: Literal["median", "hyperband", "none"] = "median"
    """Optuna pruner fed the objective as the run logs it: MedianPruner, HyperbandPruner, or no pruning"""
    n_startup_trials: Annotated[int, Ge(0)] = 2
    """median pruner: trials that finish before any is pruned"""
    n_warmup_steps: Annotated[int, Ge(0)] = 0
    """median pruner: a trial is not pruned before this step"""
    min_resource: Annotated[int, Ge(1)] = 1
    """Hyperband pruner: the step of the first rung (steps as the script logs them)"""
    poll_s: Annotated[float, Gt(0)] = 2.0
    """seconds between two reads of a running trial's metrics.jsonl"""
    heartbeat_interval: Annotated[int, Ge(1)] = 60
    """seconds between a running trial's heartbeats in the storage"""
    grace_period: Annotated[int, Ge(1)] = 180
    """a RUNNING trial without a heartbeat for this long (its worker was killed) is marked FAIL by the next worker"""
    max_retry: Annotated[int, Ge(0)] = 0
    """times a killed worker's trial is re-run with its flags as a new trial (0: only marked FAIL)"""
    timeout_s: Annotated[float, Ge(0)] = 0.0
    """a trial running longer than this is killed and FAIL (0: no limit)"""
    launcher: Literal["python", "accelerate"] = "python"
    """how each trial starts: `python script ...` or `accelerate launch --config_file ... --num_processes N script`"""
    accelerate_config: str = "scripts/accelerate/zero2.yaml"
    """--launcher accelerate: the accelerate config file"""
    num_processes: Annotated[int, Ge(1)] = 1
    """--launcher accelerate: ranks per trial"""
    seeds: list[int] = field(default_factory=list)
    """re-run the best trial's flags over these seeds (and the defaults, see --seeds_defaults): mean and spread"""
    seeds_defaults: bool = True
    """with --seeds: also run the script's defaults of the searched flags (the fixed flags kept) over those seeds"""
    result_dir: str = ""
    """also write the summary (command, machine, trials, seeds) as JSON here (e.g. docs/bench/tuning)"""


DIST_KEYS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
             "categorical": {"type", "choices"}}


# --- the search space ---------------------------------------------------------------------------------------------
def script_fields(script: Path) -> dict[str, dataclasses.Field]:
    """The flags of a script: the fields of its `Args` dataclass, read by running the module (not as __main__)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = runpy.run_path(str(script), run_name="__tune_args__")
    if not dataclasses.is_dataclass(module.get("Args")):
        raise ValueError(f"--script {script}: no dataclass `Args`")
    return {f.name: f for f in dataclasses.fields(module["Args"])}


def load_space(path: Path, flags: dict) -> tuple[dict, dict]:
    """(search_space, fixed) of a search-space file, checked against the script's flags: a ValueError names the flag."""
    import yaml  # PyYAML, which optuna brings; JSON is YAML too

    try:
        spec = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--space {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    unknown = set(spec) - {"search_space", "fixed"} if isinstance(spec, dict) else {"(not a mapping)"}
    if unknown:
        raise ValueError(f"--space {path}: unknown key(s) {sorted(unknown)}; expected search_space and fixed")
    space, fixed = spec.get("search_space") or {}, spec.get("fixed") or {}
    if not space:
        raise ValueError(f"--space {path}: search_space is empty")
    for name in [*space, *fixed]:
        if name not in flags:
            raise ValueError(f"--space {path}: {name}: the script has no flag --{name}")
        if name == "output_dir":
            raise ValueError(f"--space {path}: output_dir: set by the tuner (each trial its own, under --study_dir)")
    for name in set(space) & set(fixed):
        raise ValueError(f"--space {path}: {name}: both searched and fixed")
    for name, d in space.items():
        kind = d.get("type") if isinstance(d, dict) else None
        if kind not in DIST_KEYS:
            raise ValueError(f"--space {path}: {name}: type must be one of {sorted(DIST_KEYS)}")
        if set(d) - DIST_KEYS[kind]:
            raise ValueError(f"--space {path}: {name}: unknown key(s) {sorted(set(d) - DIST_KEYS[kind])} for {kind}")
        need = ("choices",) if kind == "categorical" else ("low", "high")
        if any(k not in d for k in need):
            raise ValueError(f"--space {path}: {name}: a {kind} distribution needs {' and '.join(need)}")
        if kind == "categorical" and not (isinstance(d["choices"], list) and d["choices"]):
            raise ValueError(f"--space {path}: {name}: choices must be a non-empty list")
        if kind != "categorical":
            cast = float if kind == "float" else int
            try:  # YAML 1.1 reads 1e-5 (no dot) as a string
                d["low"], d["high"] = cast(d["low"]), cast(d["high"])
            except (TypeError, ValueError):
                raise ValueError(f"--space {path}: {name}: low and high must be {kind}s") from None
            if not d["low"] <= d["high"]:
                raise ValueError(f"--space {path}: {name}: low {d['low']} > high {d['high']}")
    return space, fixed


def suggest(trial, space: dict) -> dict:
    """One value per searched flag, from the trial (Optuna's distributions)."""
    values = {}
    for name, d in space.items():
        if d["type"] == "float":
            values[name] = trial.suggest_float(name, d["low"], d["high"], log=d.get("log", False), step=d.get("step"))
        elif d["type"] == "int":
            values[name] = trial.suggest_int(name, d["low"], d["high"], log=d.get("log", False), step=d.get("step", 1))
        else:
            values[name] = trial.suggest_categorical(name, d["choices"])
    return values


def cli_flags(values: dict) -> list[str]:
    """Flags as tyro parses them: --name value, --name / --no_name for booleans, --name a b for lists."""
    out = []
    for name, v in values.items():
        if isinstance(v, bool):
            out.append(f"--{name}" if v else f"--no_{name}")
        elif isinstance(v, (list, tuple)):
            out += [f"--{name}", *map(str, v)]
        else:
            out += [f"--{name}", str(v)]
    return out


def launch_cmd(args: Args, flags: list[str]) -> list[str]:
    """The command a user would type for these flags (the script's path as given)."""
    if args.launcher == "python":
        return ["python", args.script, *flags]
    return ["accelerate", "launch", "--config_file", args.accelerate_config, "--num_processes",
            str(args.num_processes), args.script, *flags]


def process_cmd(cmd: list[str]) -> list[str]:
    """`launch_cmd` run by this interpreter: `python` is sys.executable, `accelerate launch` its module."""
    if cmd[0] == "python":
        return [sys.executable, *cmd[1:]]
    port = socket.socket()  # a free port for the ranks' rendezvous: trials run at once must not share one
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free), *cmd[2:]]


# --- one run ------------------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child, before exec: start its own process group and get SIGKILL when the worker dies (PR_SET_PDEATHSIG),
    so a killed worker leaves no trial running."""
    os.setsid()
    _libc.prctl(1, signal.SIGKILL)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a run's whole process group (the script, its ranks, its engines) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class TrialFailed(Exception):
    """A run that exited non-zero, timed out, or logged no objective: the trial is FAIL, the study goes on."""


def last_line(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def read_new_rows(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete JSON lines of metrics.jsonl after byte `offset` (a line still being written waits for the next read)."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(x) for x in data[:end].splitlines() if x.strip()]
    return rows, offset + end


def run_script(args: Args, cmd: list[str], out_dir: Path, trial=None) -> dict:
    """Run one command with --output_dir out_dir, its output to out_dir.log; read the objective from its metrics.jsonl
    as it runs and, with a trial, report it (step by step) and kill the run when the pruner says so.
    Returns {"value", "values", "steps", "wall_s", "pruned"}; raises TrialFailed."""
    if out_dir.exists():  # a folder left by an earlier study under the same trial number
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    log = out_dir.with_suffix(".log")
    better = max if args.direction == "maximize" else min
    values, steps, reported, running, offset, pruned = [], [], set(), None, 0, False
    t0 = time.time()
    with open(log, "w") as fh:
        fh.write(shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(process_cmd([*cmd, "--output_dir", str(out_dir)]), stdout=fh, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=child_env(), preexec_fn=_die_with_parent)
        try:
            while True:
                done = proc.poll() is not None
                rows, offset = read_new_rows(out_dir / "metrics.jsonl", offset)
                for r in rows:
                    if args.objective not in r or not isinstance(r[args.objective], (int, float)):
                        continue
                    v, step = float(r[args.objective]), int(r.get("step", len(values)))
                    values.append(v)
                    steps.append(step)
                    running = v if running is None else better(running, v)
                    if trial is not None and math.isfinite(v) and step not in reported:  # one value per step
                        trial.report(running if args.objective_reduce == "best" else v, step)
                        reported.add(step)
                        if trial.should_prune():
                            pruned = True
                if pruned or done:
                    break
                if args.timeout_s and time.time() - t0 > args.timeout_s:
                    kill_group(proc)
                    raise TrialFailed(f"timed out after {args.timeout_s:.0f} s")
                time.sleep(args.poll_s)
        finally:
            if proc.poll() is None:
                kill_group(proc)
    out = {"values": values, "steps": steps, "wall_s": time.time() - t0, "pruned": pruned,
           "value": None if not values else (values[-1] if args.objective_reduce == "last" else better(values))}
    if pruned:
        return out
    if proc.returncode != 0:
        raise TrialFailed(f"exit status {proc.returncode}: {last_line(log)}")
    if not values:
        raise TrialFailed(f"{args.objective} is not in {out_dir / 'metrics.jsonl'}")
    if not math.isfinite(out["value"]):
        raise TrialFailed(f"{args.objective} is {out['value']}")
    return out


# --- the study ----------------------------------------------------------------------------------------------------
def make_study(args: Args):
    import numpy as np
    import optuna
    import sqlalchemy
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    url = args.storage or f"sqlite:///{Path(args.study_dir).resolve() / 'study.db'}"
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}  # workers wait for SQLite's lock
    pruner = {"median": lambda: optuna.pruners.MedianPruner(args.n_startup_trials, args.n_warmup_steps),
              "hyperband": lambda: optuna.pruners.HyperbandPruner(min_resource=args.min_resource),
              "none": optuna.pruners.NopPruner}[args.pruner]()
    for attempt in range(5):  # workers started at once race to create the schema: the loser tries again
        try:
            retry = RetryHeartbeatStaleTrialCallback(max_retry=args.max_retry) if args.max_retry else None
            storage = RDBStorage(url, engine_kwargs=engine, heartbeat_interval=args.heartbeat_interval,
                                 grace_period=args.grace_period, heartbeat_stale_trial_callback=retry)
            study = optuna.create_study(storage=storage, pruner=pruner, study_name=args.study_name,
                                        direction=args.direction, load_if_exists=True)
            break
        except sqlalchemy.exc.SQLAlchemyError:
            if attempt == 4:
                raise
            time.sleep(1 + attempt)
    # the sampler's seed moves on with the trials already in the study, so a continued study does not draw its
    # first points again
    seed = int(np.random.SeedSequence([args.seed, len(study.get_trials(deepcopy=False))]).generate_state(1)[0])
    study.sampler = (optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
                     if args.sampler == "tpe" else optuna.samplers.RandomSampler(seed=seed))
    return study, url


def trials_used(study) -> int:
    """Trials that count against --n_trials: finished, pruned, failed or running, a retried trial counted once."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {RetryHeartbeatStaleTrialCallback.retried_trial_number(t) for t in trials} - {None}
    return sum(t.state != TrialState.WAITING and t.number not in retried for t in trials)


def defaults(fields: dict, names) -> dict:
    """The script's default values of these flags."""
    out = {}
    for name in names:
        f = fields[name]
        out[name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def summarize(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs} if xs else {"n": 0}


def tuning_table(d: dict) -> str:
    """The markdown of a --result_dir summary (docs/tuning.md): every trial, then the best flags against the defaults
    over the seeds, with the command and the machine in the caption."""
    names, key = list(d["search_space"]), d["objective"]
    g = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"| trial | {' | '.join(f'`--{n}`' for n in names)} | state | {key} | last step | wall |",
             "|" + "---|" * (len(names) + 5)]
    for t in d["trials"]:
        steps = [int(k) for k in t["intermediate"]]
        wall = "-" if t["wall_s"] is None else f"{t['wall_s']:.0f} s"
        lines.append(f"| {t['number']} | {' | '.join(g(t['params'].get(n)) for n in names)} | {t['state']} | "
                     f"{g(t['value'])} | {max(steps) if steps else '-'} | {wall} |")
    states = [t["state"] for t in d["trials"]]
    lines += ["", f"{len(states)} trials ({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
                  f"{states.count('FAIL')} failed; a pruned trial's value is the one at its last step), searched in "
                  f"{d['search_wall_s'] / 60:.1f} min; best: trial {d['best_trial']}."]
    if d.get("seeds"):
        lines += ["", f"| flags | {key}: mean | min - max | seeds |", "|---|---|---|---|"]
        for name, r in d["seeds"].items():
            st, seeds = r[key], " ".join(str(x["seed"]) for x in r["runs"])
            cells = f"{st['mean']:.3f} | {st['min']:.3f} - {st['max']:.3f}" if st["n"] else "- | -"
            searched = " ".join(f for i, f in enumerate(r["flags"]) if f.lstrip("-") in names
                                or (i and r["flags"][i - 1].lstrip("-") in names))
            label = "best trial" if name == "best" else "defaults"
            lines.append(f"| {label}: `{searched}` | {cells} | {seeds} |")
    lines += ["", f"The best trial's command: `{d.get('best_command', d['command'])}`. Written by "
                  f"`{tune_command(d)}`, {d['env']['device']}."]
    return "\n".join(lines)


def tune_command(d: dict) -> str:
    """The command that wrote a summary: its `command`, or, in a summary whose `command` is the best trial's (written
    before `best_command` was kept apart), this script with the flags of its stored `args` that differ from the
    defaults."""
    if "best_command" in d:
        return d["command"]
    default = dataclasses.asdict(Args())
    return shlex.join(["python", "scripts/tools/tune.py",
                       *cli_flags({k: v for k, v in d["args"].items() if v != default[k]})])


def main(args: Args) -> None:
    import optuna
    from optuna.trial import TrialState

    script = Path(args.script)
    if not script.is_absolute():
        script = ROOT / script if not script.exists() else script.resolve()
    if not script.exists():
        raise ValueError(f"--script {args.script}: no such file")
    if args.launcher == "accelerate" and not Path(args.accelerate_config).exists() \
            and not (ROOT / args.accelerate_config).exists():
        raise ValueError(f"--accelerate_config {args.accelerate_config}: no such file")
    fields = script_fields(script)
    space, fixed = load_space(Path(args.space), fields)
    if args.seeds and "seed" not in fields:
        raise ValueError(f"--seeds: {args.script} has no --seed flag")
    study_dir = Path(args.study_dir).resolve()
    study_dir.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial, below
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # retried_trial_number
    study, url = make_study(args)
    optuna.storages.fail_stale_trials(study)  # a killed worker's RUNNING trial, past its grace period: FAIL
    lock = threading.Lock()

    def objective(trial) -> float:
        values = suggest(trial, space)
        flags = cli_flags({**fixed, **values})
        cmd = launch_cmd(args, flags)
        trial.set_user_attr("flags", flags)
        trial.set_user_attr("command", shlex.join(cmd))
        out_dir = study_dir / "trials" / f"{trial.number:04d}"
        trial.set_user_attr("output_dir", str(out_dir))
        try:
            res = run_script(args, cmd, out_dir, trial)
        except TrialFailed as e:
            trial.set_user_attr("error", str(e))
            raise
        trial.set_user_attr("wall_s", res["wall_s"])
        if res["pruned"]:
            raise optuna.TrialPruned(f"pruned at step {res['steps'][-1]}")
        return res["value"]

    def report(study, trial) -> None:  # one line per finished trial, and the --n_trials budget over all workers
        value = "" if trial.value is None else f" {args.objective}={trial.value:.4g}"
        if trial.state == TrialState.PRUNED:  # its value is the last reported one
            value = f" at step {trial.last_step}" + (value and f" ({value.strip()})")
        error = f" ({trial.user_attrs['error']})" if "error" in trial.user_attrs else ""
        wall = trial.user_attrs.get("wall_s")
        with lock:
            print(f"trial {trial.number} {trial.state.name}{value}{error}"
                  f"{f' in {wall:.0f} s' if wall else ''}: {' '.join(trial.user_attrs.get('flags', []))}", flush=True)
        if trials_used(study) >= args.n_trials:
            study.stop()

    t0 = time.time()
    if trials_used(study) < args.n_trials:
        print(f"study {args.study_name!r} in {url}: {trials_used(study)} of {args.n_trials} trials so far", flush=True)
        study.optimize(objective, n_jobs=args.n_jobs, catch=(TrialFailed,), callbacks=[report])
    search_wall_s = time.time() - t0

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        print(f"study {args.study_name!r}: no trial finished yet", flush=True)
        return
    best = study.best_trial
    best_flags = cli_flags({**fixed, **best.params})
    result = {"study": args.study_name, "storage": url, "script": args.script, "objective": args.objective,
              "direction": args.direction, "objective_reduce": args.objective_reduce, "best_value": best.value,
              "best_trial": best.number, "params": best.params, "flags": best_flags,
              "command": shlex.join(launch_cmd(args, best_flags))}

    if args.seeds:  # the best flags, and the script's defaults of the searched flags, over seeds
        groups = {"best": best_flags}
        if args.seeds_defaults:
            groups["defaults"] = cli_flags({**fixed, **defaults(fields, space)})
        result["seeds"] = {}
        for name, flags in groups.items():
            runs = []
            for s in args.seeds:
                cmd = launch_cmd(args, [*flags, "--seed", str(s)])
                try:
                    res = run_script(args, cmd, study_dir / "seeds" / f"{name}_seed{s}")
                    runs.append({"seed": s, "value": res["value"], "wall_s": res["wall_s"], "curve": res["values"],
                                 "steps": res["steps"]})
                except TrialFailed as e:
                    runs.append({"seed": s, "error": str(e)})
                print(f"{name} seed {s}: {runs[-1].get('value', runs[-1].get('error'))}", flush=True)
            result["seeds"][name] = {"flags": flags, "runs": runs,
                                     args.objective: summarize([r["value"] for r in runs if "value" in r])}
            st = result["seeds"][name][args.objective]
            if st["n"]:
                print(f"{name} over seeds {args.seeds}: {args.objective} mean {st['mean']:.4g} "
                      f"(min {st['min']:.4g}, max {st['max']:.4g})", flush=True)

    (study_dir / "best_params.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"best: trial {best.number}, {args.objective}={best.value:.4g}; wrote {study_dir / 'best_params.json'}\n"
          f"{result['command']}", flush=True)
    if args.result_dir:
        optuna.storages.fail_stale_trials(study)  # a killed worker's trial is FAIL in the summary, not RUNNING
        done = [t for t in study.get_trials(deepcopy=False) if t.datetime_complete and t.datetime_start]
        timing = {"search_wall_s": search_wall_s,  # this command's search; the two below cover the whole study
                  "trials_wall_s": sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done),
                  "study_span_s": (max(t.datetime_complete for t in done)
                                   - min(t.datetime_start for t in done)).total_seconds() if done else 0.0}
        trials = [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
                   "wall_s": t.user_attrs.get("wall_s"), "error": t.user_attrs.get("error"),
                   "intermediate": {str(k): v for k, v in t.intermediate_values.items()}}
                  for t in study.get_trials(deepcopy=False)]
        space_text = Path(args.space).read_text()
        summary = {**result, "best_command": result["command"], "command": invocation(), "env": environment(),
                   "args": dataclasses.asdict(args), "space_file": space_text, "search_space": space, "fixed": fixed,
                   **timing, "trials": trials}
        path = write_result("tuning", summary, out_dir=Path(args.result_dir), latest=False)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from shared.cli import run_cli

    run_cli(main, Args)
