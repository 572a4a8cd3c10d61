"""Held-out evaluation: accuracy and pass@k with the task's grader, and optionally a reward model's mean score.

Independent of the training reward (a reward model, a shaped reward): it always grades with `reward_fn`
on the held-out split (pitfalls U10); `score_fn` adds `eval/reward` for reward-model runs on the same samples. Prompts are split into contiguous blocks over the ranks and seeded by
their global index, so results do not depend on the number of ranks; the same seed at every evaluation
(common random numbers) makes successive evaluations compare policies rather than sampling noise.
"""

from __future__ import annotations

import math

import torch

from shared.rewards import compute_rewards


def evaluate_accuracy(generator, eval_data, reward_fn, decode, info, num_samples: int, temperature: float,
                      max_new_tokens: int, seed: int, score_fn=None) -> dict:
    """{"eval/accuracy": mean correctness over num_samples per prompt, "eval/pass@k": any correct}; without a
    grader (reward_fn None) neither. With `score_fn(prompt_ids, completion_ids) -> list[float]` (a reward model;
    called on every rank, also with empty lists) also "eval/reward", the mean score of the same samples."""
    per_rank = math.ceil(len(eval_data.rows) / info.world_size)
    idx = list(range(info.rank * per_rank, min(len(eval_data.rows), (info.rank + 1) * per_rank)))
    outs = generator.generate([eval_data.prompt_ids[i] for i in idx], n=num_samples, temperature=temperature,
                              top_p=1.0, max_new_tokens=max_new_tokens, seed=seed, index_offset=info.rank * per_rank)
    rows = [eval_data.rows[i] for i in idx for _ in range(num_samples)]
    comps = [c for group in outs for c in group]
    metrics = {}
    if score_fn is not None:
        scores = score_fn([eval_data.prompt_ids[i] for i in idx for _ in range(num_samples)],
                          [c.token_ids for c in comps])
        total = info.all_reduce(torch.tensor([float(sum(scores)), float(len(scores))], dtype=torch.float64))
        metrics["eval/reward"] = (total[0] / total[1].clamp(min=1)).item()
    if reward_fn is None:
        return metrics
    r = compute_rewards(reward_fn, [x["prompt"] for x in rows], [decode(c.token_ids) for c in comps],
                        [x["answer"] for x in rows], [c.finished for c in comps], rows)
    r = torch.tensor(r, dtype=torch.float64).view(len(idx), num_samples)
    stats = torch.tensor([r.sum(), (r.max(1).values > 0.5).sum() if len(idx) else 0, r.numel(), len(idx)],
                         dtype=torch.float64)
    info.all_reduce(stats)
    return {"eval/accuracy": (stats[0] / stats[2]).item(), f"eval/pass@{num_samples}": (stats[1] / stats[3]).item(),
            **metrics}
