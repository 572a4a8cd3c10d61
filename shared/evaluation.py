"""Held-out evaluation, one code path for the training scripts (their `eval/*` and `dev/*` metrics) and for
algorithms/evaluate.py, so that a training run's held-out numbers and evaluate.py's agree for the same checkpoint
and settings: the same prompt chunks and seeds (`generate_chunks`), the same grader call, the same estimators.

Grader accuracy and pass@k for verifiable tasks, and the reward model's mean score for reward-model tasks.
Independent of the training reward (a reward model, a shaped reward): accuracy always grades with `reward_fn`
on the held-out split; with `reward_model` the same completions also get `eval/reward`, the reward model's mean
score; without a grader (`reward_fn` None, prompts without answers) only `eval/reward` is reported.

Chunks and seeds. The prompts of a set are cut into fixed chunks of EVAL_CHUNK consecutive indices, and a rank gets a
contiguous run of whole chunks. vLLM seeds every prompt by its own index (`seed_for(seed, i)`), so its completions do
not depend on how prompts are batched; HF `generate` draws one random stream per call, so it generates one chunk
per call, seeded by the chunk's first index. Either way a prompt's completions depend only on (seed, its index),
never on the number of ranks or on which chunks an interrupted evaluate.py had already done. The same seed at every
evaluation (common random numbers) makes successive evaluations compare policies rather than sampling noise.

Estimators (used by evaluate.py; the training scripts log accuracy and pass@num_samples):
  accuracy   mean grade over all samples of all prompts
  pass@k     unbiased estimator of Chen et al. 2021 (https://arxiv.org/abs/2107.03374, Sec. 2.1) with n samples of
             which c are correct (grade > 0.5): 1 - C(n-c, k) / C(n, k), computed as a product (`pass_at_k`)
  maj@k      majority vote over the extracted answers of k samples, averaged over the floor(n/k) disjoint blocks of k
             consecutive samples; ties count the fraction of the tied answers that are correct (`maj_at_k`)
  CI         percentile bootstrap over prompts, fixed seed (`bootstrap_ci`)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from shared.rewards import compute_rewards

EVAL_CHUNK = 64  # prompts per HF `generate` call in evaluation (its seeding unit); vLLM seeds each prompt itself


def eval_seed(seed: int) -> int:
    """Sampling seed of the held-out evaluation of a run with `--seed seed` (grpo, ppo, vineppo, drca and
    evaluate.py; sft.py and dpo.py evaluate with seed + 7)."""
    return seed + 1_000_003


def prompt_chunks(num_prompts: int, chunk: int = EVAL_CHUNK) -> list[range]:
    """[0, chunk), [chunk, 2 chunk), ... covering num_prompts prompts (the last one may be shorter)."""
    return [range(s, min(s + chunk, num_prompts)) for s in range(0, num_prompts, chunk)]


def shard(items: list, rank: int, world_size: int) -> list:
    """This rank's contiguous share of `items`: ceil(len / world_size) each, the last ranks fewer (maybe none)."""
    per_rank = math.ceil(len(items) / world_size)
    return items[rank * per_rank : (rank + 1) * per_rank]


def generate_chunks(generator, prompt_ids: list[list[int]], chunks: list[range], n: int, temperature: float,
                    top_p: float, max_new_tokens: int, seed: int, num_calls: int = 0) -> list[list]:
    """Completions [prompt][sample] of the prompts of `chunks` (in order), seeded as the module docstring says.

    A generator with `seeds_each_prompt` (vLLM) gets each run of consecutive chunks in one call; any other (HF) one
    call per chunk, padded with empty calls to `num_calls` (under ZeRO-3 every rank must make as many `generate`
    calls: each forward gathers shards from all ranks)."""
    per_prompt = getattr(generator, "seeds_each_prompt", False)
    runs: list[range] = []
    for c in chunks:
        if runs and per_prompt and runs[-1].stop == c.start:
            runs[-1] = range(runs[-1].start, c.stop)
        else:
            runs.append(c)
    out: list[list] = []
    for r in runs:
        out += generator.generate([prompt_ids[i] for i in r], n=n, temperature=temperature, top_p=top_p,
                                  max_new_tokens=max_new_tokens, seed=seed, index_offset=r.start)
    for _ in range(len(runs), 0 if per_prompt else num_calls):
        generator.generate([], n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    return out


# ---- estimators ----------------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, Eq. 1): 1 - C(n-c, k) / C(n, k), computed as
    1 - prod_{i=n-c+1}^{n} (1 - k / i) (their numerically stable form: no huge binomials)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k: needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(answers: list, correct: list[bool]) -> float:
    """Majority vote over `answers` (None: no vote): 1.0 if the most frequent answer is correct, 0.0 if not or if
    nobody voted. An answer's correctness is that of its first sample. Ties between answers count the fraction of
    the tied answers that are correct (the expected score of breaking the tie uniformly at random), so the result
    does not depend on the order of the samples."""
    votes: dict = {}  # answer -> [count, correct]
    for a, ok in zip(answers, correct):
        if a is not None:
            votes.setdefault(a, [0, bool(ok)])[0] += 1
    if not votes:
        return 0.0
    top = max(count for count, _ in votes.values())
    tied = [ok for count, ok in votes.values() if count == top]
    return sum(tied) / len(tied)


def maj_at_k(answers: list, correct: list[bool], k: int) -> float:
    """maj@k from n >= k samples: the majority vote of each of the floor(n/k) disjoint blocks of k consecutive samples
    (samples are i.i.d., so each block is a fair draw of k), averaged."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k: needs 1 <= k <= n, got n={n}, k={k}")
    blocks = [majority_vote(answers[s : s + k], correct[s : s + k]) for s in range(0, n - k + 1, k)]
    return sum(blocks) / len(blocks)


def bootstrap_ci(values: dict[str, np.ndarray], num_bootstrap: int, confidence: float, seed: int) -> dict:
    """Percentile bootstrap confidence interval of the mean of each per-prompt array in `values` (all of one length
    P): `num_bootstrap` resamples of P prompts with replacement, the same resamples for every metric, from
    numpy's default_rng(seed). Returns {name: [low, high]}."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
    size = len(next(iter(arrays.values())))
    rng = np.random.default_rng(seed)
    means = {k: [] for k in arrays}
    block = max(1, 2**22 // max(size, 1))  # resamples per draw: at most ~4M indices in memory
    for start in range(0, num_bootstrap, block):
        idx = rng.integers(0, size, size=(min(block, num_bootstrap - start), size))
        for k, v in arrays.items():
            means[k].append(v[idx].mean(axis=1))
    q = [(1 - confidence) / 2, (1 + confidence) / 2]
    return {k: [float(x) for x in np.quantile(np.concatenate(m), q)] for k, m in means.items()}


# ---- the training scripts' held-out evaluation ---------------------------------------------------------------------
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
    """{"<prefix>/accuracy": mean correctness over num_samples per prompt, "<prefix>/pass@<num_samples>": any
    correct} (with a grader), plus "<prefix>/reward" (mean reward-model score of the same completions) when
    `reward_model` is given."""
    if reward_fn is None and reward_model is None:
        raise ValueError("evaluate_accuracy: needs a grader (reward_fn) or a reward_model")
    chunks = prompt_chunks(len(eval_data.rows))
    mine = shard(chunks, info.rank, info.world_size)
    idx = [i for c in mine for i in c]
    outs = generate_chunks(generator, eval_data.prompt_ids, mine, num_samples, temperature, 1.0, max_new_tokens, seed,
                           num_calls=math.ceil(len(chunks) / info.world_size))
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
    passed = sum(pass_at_k(num_samples, int((g > 0.5).sum()), num_samples) for g in r)  # any correct: k = n
    stats = torch.tensor([r.sum(), passed, r.numel(), len(idx), rm_sum, error is not None], dtype=torch.float64)
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
