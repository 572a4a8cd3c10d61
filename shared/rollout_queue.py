"""Asynchronous generation (algorithms/grpo_async.py, algorithms/ppo_async.py): step t+1's batch is generated in a
background thread while step t trains, Cleanba-style (Huang et al. 2023, arXiv 2310.00036;
"Asynchronous RLHF", Noukhovitch et al. 2024, arXiv 2410.18252; open-instruct's ppo_vllm_thread.py).

    rollouts, shuffle_rng = resume_async(state, seed)  # the queue with a resumed run's generated, untrained
                                                        # batches, and the update's own shuffle generator
    rollouts.submit(s, version, fn, *args)  # fn(*args) in the worker thread; `version`: updates of the weights in
                                            # the engine now (the batch's behaviour policy)
    batch = rollouts.take(step)             # blocks until step's batch is generated: .result, .version, .seconds
    rollouts.wait()                         # before a weight sync: no generation in flight (never sync during one)
    state = async_checkpoint_state(rollouts, shuffle_rng)  # both, for a resumable checkpoint

One worker thread runs the submitted generations in order, so a weight sync that waits for the queue to drain
(`wait`) falls between two generations. The caller keeps the queue bounded (one batch submitted and not
taken) and draws each batch's prompts on the main thread when it submits it, so the data order and the sampling
seeds are those of a synchronous run. The weights of the colocated engine change only at the caller's sync, so a
batch's `version` is the number of updates the engine held when it was submitted: it is generated from those
weights, whatever the trainer does meanwhile. Generation (vLLM releases the GIL in its kernels and torch ops) overlaps
the trainer's forward and backward passes; on one device they share its compute, so the overlap gains little there
(docs/grpo_async.md).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


@dataclass
class Batch:
    step: int  # the training step it is for
    version: int  # number of policy updates of the weights that generated it (the behaviour policy)
    result: Any  # what the submitted function returned
    seconds: float  # wall time of its generation (in the worker, overlapping training)


def _timed(fn: Callable, *args) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


class RolloutQueue:
    def __init__(self, restored: list[dict] | None = None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._pending: dict[int, tuple[int, Future]] = {}
        for b in restored or []:  # generated before the checkpoint, not yet trained on
            done: Future = Future()
            done.set_result((b["result"], b["seconds"]))
            self._pending[b["step"]] = (b["version"], done)

    def __contains__(self, step: int) -> bool:
        return step in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, step: int, version: int, fn: Callable, *args) -> None:
        """Run fn(*args) in the worker thread, after every generation submitted before it."""
        if step in self._pending:
            raise RuntimeError(f"RolloutQueue: step {step} was submitted twice")
        self._pending[step] = (version, self._pool.submit(_timed, fn, *args))

    def take(self, step: int) -> Batch:
        """Step's batch, waiting for its generation to finish (re-raises its exception)."""
        version, future = self._pending.pop(step)
        result, seconds = future.result()
        return Batch(step, version, result, seconds)

    def wait(self) -> None:
        """Block until no generation is running or queued (re-raising a failed one's exception)."""
        for _, future in list(self._pending.values()):
            future.result()

    def state_dict(self) -> list[dict]:
        """The generated, not yet trained batches (waits for those in flight): rank-local checkpoint state."""
        self.wait()
        return [{"step": s, "version": v, "result": f.result()[0], "seconds": f.result()[1]}
                for s, (v, f) in sorted(self._pending.items())]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def resume_async(state: dict, seed: int) -> tuple[RolloutQueue, "torch.Generator"]:
    """The queue (with a resumed run's generated, untrained batches) and the update's own shuffle
    generator (the engine thread draws on torch's global RNG at timing-dependent moments), both from a checkpoint's
    rank-local `state` (empty for a fresh run), the generator seeded with `seed` there."""
    import torch

    shuffle_rng = torch.Generator().manual_seed(seed)
    if "shuffle_rng" in state:
        shuffle_rng.set_state(state["shuffle_rng"])
    return RolloutQueue(restored=state.get("async_rollouts")), shuffle_rng


def async_checkpoint_state(rollouts: RolloutQueue | None, shuffle_rng) -> dict | None:
    """The rank-local checkpoint state of resume_async's pair."""
    if rollouts is None:
        return None
    return {"async_rollouts": rollouts.state_dict(), "shuffle_rng": shuffle_rng.get_state()}
