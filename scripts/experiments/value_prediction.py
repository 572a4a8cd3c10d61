"""Experiment (not a test): VinePPO's value-prediction analysis in small (docs/vineppo.md).

At the step boundaries of held-out responses sampled from a policy (states S_j: the prompt and the response's
first j steps), compare two value estimates with a Monte Carlo "ground truth" (K_truth rollouts per state, from
the same policy):
  - the PPO critic's prediction (a critic saved by `algorithms/ppo.py` in <output_dir>/critic), read at the
    state's last token, as ppo.py reads it for GAE;
  - VinePPO's estimate, the mean reward of K (default 9) fresh rollouts.
The VinePPO paper (Sec. 6) finds the MC estimate far more accurate. Reported, overall and per step position j:
  - mean absolute error against the ground truth;
  - pairwise ranking accuracy: over the pairs of states at the same step position (from different responses)
    whose ground-truth values differ, the share that the estimator orders the same way; a tie in the estimate
    counts half (K = 9 rollouts give 10 possible values, so MC ties are common). The overall number pools the
    pairs of every position.

    python scripts/experiments/value_prediction.py --policy runs/ppo/final --critic runs/ppo/critic
    python scripts/experiments/value_prediction.py --policy runs/ppo/final --critic runs/ppo/critic \
        --dataset builtin:sums-6 --max_new_tokens 18 --output value.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared import data  # noqa: E402
from shared.distributed import default_dtype, load_tokenizer  # noqa: E402
from shared.generation import VLLMGenerator  # noqa: E402
from shared.rewards import compute_rewards, load_reward_fn  # noqa: E402
from shared.scalar import load_scalar_model, token_values  # noqa: E402
from shared.steps import StepSplitError, get_splitter, step_token_starts  # noqa: E402


def mean_abs_error(estimate: list[float], truth: list[float]) -> float:
    return statistics.mean(abs(a - b) for a, b in zip(estimate, truth, strict=True))


def ranking_pairs(estimate: list[float], truth: list[float]) -> tuple[float, int]:
    """(concordance, pairs) over the pairs i < j with truth[i] != truth[j]: concordance adds 1 for each pair the
    estimate orders as the truth does, 0.5 for a tie in the estimate, 0 otherwise."""
    score, pairs = 0.0, 0
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            if truth[i] == truth[j]:
                continue
            pairs += 1
            d = (estimate[i] - estimate[j]) * (truth[i] - truth[j])
            score += 1.0 if d > 0 else 0.5 if estimate[i] == estimate[j] else 0.0
    return score, pairs


def ranking_accuracy(estimate: list[float], truth: list[float]) -> float | None:
    """Pairwise ranking accuracy (ties in the estimate count half); None when no pair has distinct truths."""
    score, pairs = ranking_pairs(estimate, truth)
    return score / pairs if pairs else None


def per_position(positions: list[int], truth: list[float], estimates: dict[str, list[float]]) -> list[dict]:
    """One row per step position j (states S_j), then an "all" row: the number of states, ranked pairs (pairs at
    the same position with distinct truths), the mean truth, and per estimator its MAE and ranking accuracy (the
    "all" row pools the same-position pairs of every position)."""
    rows, pooled = [], {name: [0.0, 0] for name in estimates}
    for j in sorted(set(positions)):
        idx = [i for i, p in enumerate(positions) if p == j]
        t = [truth[i] for i in idx]
        row = {"position": j, "num_states": len(idx), "num_pairs": 0, "mean_truth": statistics.mean(t),
               "mae": {}, "ranking_accuracy": {}}
        for name, est in estimates.items():
            e = [est[i] for i in idx]
            score, pairs = ranking_pairs(e, t)
            pooled[name][0] += score
            pooled[name][1] += pairs
            row["num_pairs"] = pairs
            row["mae"][name] = mean_abs_error(e, t)
            row["ranking_accuracy"][name] = score / pairs if pairs else None
        rows.append(row)
    rows.append({"position": "all", "num_states": len(truth),
                 "num_pairs": next(iter(pooled.values()))[1] if pooled else 0, "mean_truth": statistics.mean(truth),
                 "mae": {name: mean_abs_error(est, truth) for name, est in estimates.items()},
                 "ranking_accuracy": {name: (s / n if n else None) for name, (s, n) in pooled.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy checkpoint whose states are evaluated")
    p.add_argument("--critic", required=True, help="critic checkpoint saved by ppo.py")
    p.add_argument("--dataset", default="builtin")
    p.add_argument("--split", default="test")
    p.add_argument("--splitter", default="lines", help="step splitter (shared/steps.py); `lines` for builtin:sums-N")
    p.add_argument("--num_prompts", type=int, default=200)
    p.add_argument("--k", type=int, default=9, help="rollouts of the VinePPO estimate")
    p.add_argument("--k_truth", type=int, default=256, help="rollouts of the ground truth")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=16, help="as in training (builtin:sums-6: 18)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    provenance = {"env": bc.environment(), "command": bc.invocation()}  # at the start: env.time is the start time

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = default_dtype(device)
    tok = load_tokenizer(args.policy)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompts = data.load_prompts(args.dataset, args.split, tok, limit=args.num_prompts)
    reward_fn = load_reward_fn("auto", args.dataset)
    split = get_splitter(args.splitter)
    gen = VLLMGenerator(args.policy, tok, dtype, seed=args.seed, max_model_len=512)
    critic = load_scalar_model(args.critic, dtype).to(device).eval()

    # one held-out response per prompt, its states at step boundaries
    trajs = gen.generate(prompts.prompt_ids, n=1, temperature=args.temperature, top_p=1.0,
                         max_new_tokens=args.max_new_tokens, seed=args.seed)
    states, positions, unsplittable = [], [], 0  # (prompt index, completion prefix), step position j
    for i, group in enumerate(trajs):
        ids = group[0].token_ids
        try:
            starts = step_token_starts(ids, split(decode(ids)), decode)
        except StepSplitError:  # VinePPO drops such a response from the loss; here it has no states
            unsplittable += 1
            continue
        for j, k in enumerate(starts):
            states.append((i, ids[:k]))
            positions.append(j)
    budgets = [args.max_new_tokens - len(prefix) for _, prefix in states]
    requests = [prompts.prompt_ids[i] + prefix for i, prefix in states]

    def mc_values(k: int, seed: int) -> list[float]:
        outs = gen.generate(requests, n=k, temperature=args.temperature, top_p=1.0, max_new_tokens=budgets, seed=seed)
        flat = [(s, c) for s, group in zip(states, outs) for c in group]
        rows = [prompts.rows[i] for (i, _), _ in flat]
        r = compute_rewards(reward_fn, [x["prompt"] for x in rows], [decode(pre + c.token_ids) for (_, pre), c in flat],
                            [x["answer"] for x in rows], [c.finished for _, c in flat], rows)
        return torch.tensor(r).view(len(states), k).mean(1).tolist()

    truth = mc_values(args.k_truth, args.seed + 1)
    vine = mc_values(args.k, args.seed + 2)
    with torch.no_grad():
        critic_v = []
        for s in range(0, len(requests), 256):
            chunk = requests[s : s + 256]
            ids, attn, _ = data.pad_batch(chunk, [[] for _ in chunk], tok.pad_token_id, device)
            v = token_values(critic, ids, attn)
            critic_v += v.gather(1, (attn.sum(1) - 1).unsqueeze(1)).squeeze(1).tolist()  # value at the state's last token

    table = per_position(positions, truth, {"critic": critic_v, f"mc_k{args.k}": vine})
    result = {**provenance, "policy": args.policy, "critic": args.critic, "dataset": args.dataset,
              "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts,
              "num_states": len(states), "unsplittable_responses": unsplittable, "k": args.k,
              "k_truth": args.k_truth, "mae_critic": mean_abs_error(critic_v, truth),
              f"mae_mc_k{args.k}": mean_abs_error(vine, truth), "mean_truth_value": statistics.mean(truth),
              "per_position": table}
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
