"""Metrics: a JSONL file always (`<output_dir>/metrics.jsonl`), Weights & Biases when `track` is set,
sample completions in `<output_dir>/samples.jsonl` (and a wandb table), and a progress bar.

Only the main process writes; other ranks get a tracker whose methods do nothing (no rank checks at
call sites, as SFFD's no-op writer). Plot any run with `python scripts/plot.py <output_dir>`.

A fresh run starts both JSONL files empty. A resumed run (`resume=` the checkpoint's `state_dict()`) cuts
them back to their length at the checkpoint and appends, and continues the same wandb run, so the files of
an interrupted-and-resumed run equal those of a straight run (apart from the wall-clock `time` fields).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class Tracker:
    def __init__(self, args, output_dir: str | Path, run_name: str, enabled: bool, total: int, track: bool = False,
                 wandb_project: str = "cleanrlhf", wandb_entity: str | None = None, resume: dict | None = None):
        self.enabled = enabled
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        config = asdict(args) if is_dataclass(args) else dict(args)
        (self.dir / "args.json").write_text(json.dumps(config, indent=2, default=str))
        for name in ("metrics", "samples"):
            path = self.dir / f"{name}.jsonl"
            if resume is None:
                path.write_text("")
            elif path.exists() and path.stat().st_size > resume[name]:
                with open(path, "r+b") as f:  # drop what the interrupted run logged after its checkpoint
                    f.truncate(resume[name])
        self.metrics_file = open(self.dir / "metrics.jsonl", "a")
        self.samples_file = open(self.dir / "samples.jsonl", "a")
        self.wandb_id = None
        if track:
            import wandb

            self.wandb = wandb
            wandb_id = resume.get("wandb_id") if resume else None
            wandb.init(project=wandb_project, entity=wandb_entity, name=run_name, config=config, save_code=True,
                       id=wandb_id, resume="allow" if wandb_id else None)
            self.wandb_id = wandb.run.id
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=resume.get("step", 0) if resume else 0, desc=run_name,
                        dynamic_ncols=True)
        self.start = time.time()

    def state_dict(self) -> dict:
        """Lengths of the JSONL files and the wandb run id, for resuming (shared/checkpoint.py)."""
        if not self.enabled:
            return {}
        return {"metrics": self.metrics_file.tell(), "samples": self.samples_file.tell(), "wandb_id": self.wandb_id}

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time() - self.start, 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        if self.wandb:
            self.wandb.log(row, step=step)

    def progress(self, n: int, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: f"{_clean(v):.3g}" if isinstance(_clean(v), float) else v
                                      for k, v in postfix.items()}, refresh=False)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """rows: dicts such as {"prompt", "completion", "reward"}; printed, saved to samples.jsonl and wandb."""
        if not self.enabled or not rows:
            return
        for r in rows:
            self.samples_file.write(json.dumps({"step": step, **{k: _clean(v) for k, v in r.items()}}) + "\n")
        self.samples_file.flush()
        head = rows[0]
        if self.bar is not None:
            self.bar.write(f"[step {step}] sample: " + " | ".join(f"{k}={v!r}" for k, v in head.items()))
        if self.wandb:
            cols = list(head)
            self.wandb.log({"samples": self.wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])},
                           step=step)

    def write(self, text: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if not self.enabled:
            return
        self.bar.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.wandb:
            self.wandb.finish()


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
