"""Metrics: a JSONL file always (`<output_dir>/metrics.jsonl`), Weights & Biases or trackio with `--report_to`,
sample completions in `<output_dir>/samples.jsonl` (and a wandb/trackio table), one progress bar and an
end-of-run summary line.

`--report_to wandb|trackio` logs the same metric names as metrics.jsonl (whose rows add `step` and `time`: the
backends keep their own step and wall-clock fields), under `--project`. trackio is local-first: it writes a SQLite
file under `TRACKIO_DIR` (default `~/.cache/huggingface/trackio`); see it with `trackio show --project <project>`.

Only the main process writes; other ranks get a tracker whose methods do nothing (no rank checks at
call sites, as the no-op writer of vwxyzjn/summarize_from_feedback_details). Plot any run with
`python scripts/tools/plot.py <output_dir>`.

The progress bar shows the step, the values the script passes to `progress` (reward or loss) and the last
held-out value of `eval_key` (`--best_metric`'s key, its `eval/` twin for a `dev/` metric), carried from the
last evaluation (`-` before the first), with elapsed and remaining time. A line written during the run (`write`)
goes above the bar, which is redrawn below it. At the end the bar is left showing its last state once: `log_end` ends
it before its `first -> last` line, and `close()` does not draw again a bar that already shows what it would (after a
`write`); `close()` then prints one summary line: steps, time, final and best held-out value, and the files written.

A fresh run starts both JSONL files empty. A resumed run (`resume=` the checkpoint's `state_dict()`) cuts
them back to their length at the checkpoint and appends, and continues the same wandb or trackio run, so the
files of an interrupted-and-resumed run equal those of a straight run (apart from the wall-clock `time` fields).
What the interrupted run had already sent to wandb/trackio after its checkpoint (read from the JSONL lines cut
off) is not sent again: those backends keep one value per step and metric (wandb drops steps below its last;
trackio would store a second row), the interrupted run's; a resumed run recomputes the same values (exact resume).
"""

from __future__ import annotations

import importlib
import json
import math
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

from tqdm.std import tqdm as std_tqdm

from shared.console import muted

REPORT_TO = ("none", "wandb", "trackio")


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def _fmt(v) -> str:
    v = _clean(v)
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def duration(seconds: float) -> str:
    """7m32s, 1h05m, 45s."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Tracker:
    def __init__(self, args, output_dir: str | Path, run_name: str, enabled: bool, total: int, report_to: str = "none",
                 project: str = "cleanrlhf", resume: dict | None = None, eval_key: str | None = None):
        self.enabled = enabled
        self.backend = None  # the wandb or trackio module: the same init/log/Table/finish calls
        self.bar = None
        self.bar_current = False  # the bar on screen shows its current step and postfix (drawn since they changed)
        if not enabled:
            return
        if report_to not in REPORT_TO:
            raise ValueError(f"report_to: expected one of {', '.join(REPORT_TO)}, got {report_to!r}")
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        config = asdict(args) if is_dataclass(args) else dict(args)
        (self.dir / "args.json").write_text(json.dumps(config, indent=2, default=str))
        # the bar and summary show the reported held-out value (eval/...); best/ is selected on --best_metric's key,
        # usually its dev/ twin on the dev slice
        self.best_key = (config.get("best_metric") or "eval/accuracy").partition(":")[0]
        self.eval_key = eval_key or (self.best_key.replace("dev/", "eval/", 1) if self.best_key.startswith("dev/")
                                     else self.best_key)
        self.last_eval: tuple | None = None  # (value, step) of the last held-out evaluation
        self.best: tuple | None = None  # (value, step) of output_dir/best, from BestModel's best/* metrics
        # (step, key) pairs the interrupted run already sent to wandb/trackio after its checkpoint: not sent again
        self.sent: dict[int, set] = {}
        for name in ("metrics", "samples"):
            path = self.dir / f"{name}.jsonl"
            if resume is None:
                path.write_text("")
            elif path.exists() and path.stat().st_size > resume[name]:
                with open(path, "r+b") as f:  # drop what the interrupted run logged after its checkpoint
                    f.seek(resume[name])
                    for line in f.read().decode(errors="replace").splitlines():
                        try:
                            row = json.loads(line)
                        except ValueError:  # a line cut by the interruption
                            continue
                        keys = set(row) - {"step", "time"} if name == "metrics" else {"samples"}
                        self.sent.setdefault(row.get("step"), set()).update(keys)
                    f.truncate(resume[name])
        if resume is not None and (self.dir / "metrics.jsonl").exists():  # the bar and the summary carry the
            for line in (self.dir / "metrics.jsonl").read_text().splitlines():  # held-out values logged before
                self._remember(json.loads(line))
        self.metrics_file = open(self.dir / "metrics.jsonl", "a")
        self.samples_file = open(self.dir / "samples.jsonl", "a")
        self.report_to, self.run_id = report_to, None
        if report_to != "none":
            try:
                self.backend = importlib.import_module(report_to)
            except ImportError as e:
                raise ValueError(f"report_to: {report_to} is not installed ({e}); see requirements.txt") from e
            run_id = (resume or {}).get(f"{report_to}_id")  # continue the interrupted run
            if report_to == "wandb":  # quiet unless --verbose through WANDB_SILENT: not muted, it may ask for a login
                self.backend.init(project=project, name=run_name, config=config, save_code=True, id=run_id,
                                  resume="allow" if run_id else None)
                self.run_id = self.backend.run.id
                where = self.backend.run.url or self.backend.run.dir
            else:  # trackio identifies a run by its name; no CPU/GPU system metrics: the same keys as JSONL
                with muted():  # its banner: the line below says where the run is
                    self.backend.init(project=project, name=run_id or run_name, config=config,
                                      resume="allow" if run_id else "never", auto_log_cpu=False, auto_log_gpu=False)
                self.run_id = run_id or run_name
                from trackio.utils import TRACKIO_DIR

                where = f"{TRACKIO_DIR} (trackio show --project {project})"
            print(f"{report_to}: project {project}, run {self.run_id}: {where}", flush=True)
        from tqdm.auto import tqdm

        self.initial = resume.get("step", 0) if resume else 0
        self.postfix: dict = {}
        self.bar = tqdm(total=total, initial=self.initial, desc=run_name, dynamic_ncols=True, postfix=self._postfix(),
                        bar_format="{desc}: step {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")
        self.start = time.time()


    def _remember(self, row: dict) -> None:
        if row.get(self.eval_key) is not None:
            self.last_eval = (row[self.eval_key], row["step"])
        if row.get(f"best/{self.best_key}") is not None and row.get("best/step") is not None:
            self.best = (row[f"best/{self.best_key}"], row["best/step"])

    def _postfix(self) -> str:
        shown = {**self.postfix, self.eval_key: self.last_eval[0] if self.last_eval else None}
        return ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items())

    def state_dict(self) -> dict:
        """Lengths of the JSONL files and the wandb/trackio run id, for resuming (shared/checkpoint.py)."""
        if not self.enabled:
            return {}
        state = {"metrics": self.metrics_file.tell(), "samples": self.samples_file.tell()}
        if self.backend is not None:
            state[f"{self.report_to}_id"] = self.run_id
        return state

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.start, 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        self._remember(row)
        if self.bar is not None:  # shown at the bar's next redraw
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar_current = False
            if step <= self.initial:  # set-up (models, engine, step-0 evaluation) ends: keep it out of tqdm's step
                self.bar.last_print_t = time.time()  # rate (timed from last_print_t), or the first ETAs are hours long
        if self.backend:
            fresh = {k: v for k, v in row.items() if k not in ("step", "time") and k not in self.sent.get(step, ())}
            if fresh:
                self.backend.log(fresh, step=step)

    def log_start(self, metrics: dict, key: str, train_prompts: int, skipped_too_long: int) -> float:
        """Log the evaluation before training with the train set's size (data/*), write `[step 0] held-out
        accuracy 0.557` (key `eval/accuracy`); returns metrics[key] (on every rank)."""
        self.log({**metrics, "data/train_prompts": train_prompts, "data/skipped_too_long": skipped_too_long}, 0)
        self.write(f"[step 0] held-out {key.split('/')[1]} {metrics[key]:.3f}")
        return metrics[key]

    def log_end(self, metrics: dict, step: int, key: str, first: float) -> None:
        """Log the end-of-run metrics, write `held-out accuracy 0.557 -> 0.812 in 612s` (first, metrics[key] and
        metrics["time/total"])."""
        self.log(metrics, step)
        self.end_progress()  # the bar's last state above the closing lines, not redrawn below each of them
        self.write(f"held-out {key.split('/')[1]} {first:.3f} -> {metrics[key]:.3f} in {metrics['time/total']:.0f}s")

    def progress(self, n: int, **postfix) -> None:
        """Advance the bar by n steps; `postfix` (e.g. reward=..., loss=...) stays shown until replaced (None: not
        shown)."""
        if self.bar is not None:
            self.postfix.update({k: v for k, v in postfix.items() if v is not None})
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            if n:
                self.bar.update(n)  # drawn unless the last draw is under tqdm's mininterval old
                self.bar_current = self.bar.last_print_n == self.bar.n
            else:
                self.bar.refresh()
                self.bar_current = True

    def end_progress(self) -> None:
        """End the bar's line, leaving it on screen; lines written after it are plain lines. Drawn once more only if
        what it shows is out of date (tqdm's close draws it again regardless: a copy of the same line in a log)."""
        if self.bar is None or self.bar.disable:
            return
        if self.bar_current and type(self.bar).display is std_tqdm.display:  # a console bar (not a notebook widget)
            self.bar.display = lambda *args, **kwargs: None  # close() then only ends its line
        self.bar.close()

    def log_samples(self, rows: list[dict], step: int) -> None:
        """rows: dicts such as {"prompt", "completion", "reward"}; printed, saved to samples.jsonl and wandb/trackio."""
        if not self.enabled or not rows:
            return
        for r in rows:
            self.samples_file.write(json.dumps({"step": step, **{k: _clean(v) for k, v in r.items()}}) + "\n")
        self.samples_file.flush()
        head = rows[0]
        if self.bar is not None:
            self.bar.write(f"[step {step}] sample: " + " | ".join(f"{k}={v!r}" for k, v in head.items()))
            self.bar_current = not self.bar.disable  # tqdm redraws an open bar below the line
        if self.backend and "samples" not in self.sent.get(step, ()):
            cols = list(head)
            self.backend.log({"samples": self.backend.Table(columns=cols, data=[[r.get(c) for c in cols]
                                                                                for r in rows])}, step=step)

    def write(self, text: str) -> None:
        """A line above the bar (which tqdm redraws below it), or a plain line once the bar has ended."""
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)
            self.bar_current = self.bar is not None and not self.bar.disable

    def summary(self, status: str = "done") -> str:
        """`done: 200 steps in 7m32s; final eval/accuracy 0.81 (best 0.83 @ step 175); wrote runs/grpo/metrics.jsonl,
        samples.jsonl, final/, best/` (this invocation's time; `status` is `stopped` for an interrupted run)."""
        steps = f"{self.bar.n} steps" + (f" (resumed at step {self.initial})" if self.initial else "")
        parts = [f"{status}: {steps} in {duration(time.time() - self.start)}"]
        if self.last_eval is not None:
            value, step = self.last_eval
            text = f"{'final' if status == 'done' else 'last'} {self.eval_key} {_fmt(value)}"
            text += f" @ step {step}" if status != "done" else ""
            if self.best is not None:
                named = "" if self.best_key == self.eval_key else f"{self.best_key} "
                text += f" (best {named}{_fmt(self.best[0])} @ step {self.best[1]})"
            parts.append(text)
        wrote = [str(self.dir / "metrics.jsonl")]
        wrote += ["samples.jsonl"] if self.samples_file.tell() else []
        wrote += [f"{d}/" for d in ("final", "critic", "best") if (self.dir / d).is_dir()]
        wrote += ["checkpoints/"] if any((self.dir / "checkpoints").glob("step_*")) else []
        parts.append("wrote " + ", ".join(wrote))
        return "; ".join(parts)

    def close(self, status: str = "done") -> None:
        """Close the bar and files, print the summary line, finish the wandb/trackio run."""
        if not self.enabled:
            return
        self.end_progress()
        print(self.summary(status), flush=True)
        self.metrics_file.close()
        self.samples_file.close()
        if self.backend:
            with muted():
                self.backend.finish()


class Timer:
    """Accumulates wall time per phase: `with timer("generate"): ...`; `timer.pop()` -> {"time/generate": s}."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._name = None

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        self._t0, self._cur = time.perf_counter(), self._name
        return self

    def __exit__(self, *exc):
        self.totals[self._cur] = self.totals.get(self._cur, 0.0) + time.perf_counter() - self._t0

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.totals.items()}
        self.totals = {}
        return out
