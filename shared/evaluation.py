"""Held-out evaluation: grader accuracy and pass@k for verifiable tasks, and the reward model's mean score
for reward-model tasks.

Independent of the training reward (a reward model, a shaped reward): accuracy always grades with `reward_fn`
on the held-out split; with `reward_model` the same completions also get `eval/reward`, the
reward model's mean score; without a grader (`reward_fn` None, prompts without answers) only `eval/reward` is
reported. Prompts are split into contiguous blocks over the ranks and seeded by their global index, so results
do not depend on the number of ranks; the same seed at every evaluation (common random numbers) makes
successive evaluations compare policies rather than sampling noise.
"""

from __future__ import annotations

import math

import torch

from shared.rewards import compute_rewards


def evaluate_accuracy(generator, sets: dict, reward_fn, decode, info, num_samples: int, temperature: float,
                      max_new_tokens: int, seed: int, reward_model=None, pad_id: int = 0,
                      micro_batch_size: int = 64) -> dict:
    """`evaluate_set` on every non-empty set of `sets`, {prefix: PromptData}: {"eval": the reported held-out split,
    "dev": the slice of the training split that selects output_dir/best}. Empty or None sets are skipped (the same
    on every rank: set sizes do not depend on the rank)."""
    out = {}
    for prefix, data in sets.items():
        if data is not None and data.rows:
            out |= evaluate_set(generator, data, reward_fn, decode, info, num_samples, temperature, max_new_tokens,
                                seed, reward_model, pad_id, micro_batch_size, prefix)
    return out


def evaluate_set(generator, eval_data, reward_fn, decode, info, num_samples: int, temperature: float,
                 max_new_tokens: int, seed: int, reward_model=None, pad_id: int = 0, micro_batch_size: int = 64,
                 prefix: str = "eval") -> dict:
    """{"<prefix>/accuracy": mean correctness over num_samples per prompt, "<prefix>/pass@k": any correct} (with a
    grader), plus "<prefix>/reward" (mean reward-model score of the same completions) when `reward_model` is given."""
    if reward_fn is None and reward_model is None:
        raise ValueError("evaluate_accuracy: needs a grader (reward_fn) or a reward_model")
    per_rank = math.ceil(len(eval_data.rows) / info.world_size)
    idx = list(range(info.rank * per_rank, min(len(eval_data.rows), (info.rank + 1) * per_rank)))
    outs = generator.generate([eval_data.prompt_ids[i] for i in idx], n=num_samples, temperature=temperature,
                              top_p=1.0, max_new_tokens=max_new_tokens, seed=seed, index_offset=info.rank * per_rank)
    rows = [eval_data.rows[i] for i in idx for _ in range(num_samples)]
    comps = [c for group in outs for c in group]
    r = torch.zeros(len(idx), num_samples, dtype=torch.float64)
    error = None  # a failing reward function: every rank still runs the collectives below, then all raise
    if reward_fn is not None:
        try:
            r = torch.tensor(compute_rewards(reward_fn, [x["prompt"] for x in rows],
                                             [decode(c.token_ids) for c in comps], [x["answer"] for x in rows],
                                             [c.finished for c in comps], rows),
                             dtype=torch.float64).view(len(idx), num_samples)
        except ValueError as e:
            error = e
    rm_sum = 0.0
    if reward_model is not None:
        from shared.scalar import score_sequences

        prompts = [eval_data.prompt_ids[i] for i in idx for _ in range(num_samples)]
        scores = score_sequences(reward_model, prompts, [c.token_ids for c in comps], pad_id, info, micro_batch_size)
        rm_sum = scores.double().sum().item()
    stats = torch.tensor([r.sum(), (r.max(1).values > 0.5).sum() if len(idx) else 0, r.numel(), len(idx), rm_sum,
                          error is not None], dtype=torch.float64)
    info.all_reduce(stats)
    if error is not None:
        raise error
    if stats[5] > 0:
        raise ValueError("the reward function failed on another rank during evaluation")
    out = {}
    if reward_fn is not None:
        out = {f"{prefix}/accuracy": (stats[0] / stats[2]).item(),
               f"{prefix}/pass@{num_samples}": (stats[1] / stats[3]).item()}
    if reward_model is not None:
        out[f"{prefix}/reward"] = (stats[4] / stats[2]).item()
    return out
