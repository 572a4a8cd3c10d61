"""VinePPO's value-prediction analysis in small (an experiment, not a test).

At the step boundaries of held-out responses sampled from a policy, compare two value estimates with a
Monte Carlo "ground truth" (K_truth rollouts per state):
  - the PPO critic's prediction (a critic saved by `algorithms/ppo.py` in <output_dir>/critic);
  - VinePPO's estimate, the mean reward of K (default 9) rollouts.
Reports the mean absolute error of each (the VinePPO paper, Sec. 6, finds the MC estimate far more accurate).

    python scripts/value_prediction.py --policy runs/ppo/final --critic runs/ppo/critic
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import data  # noqa: E402
from shared.distributed import default_dtype, load_tokenizer  # noqa: E402
from shared.generation import VLLMGenerator  # noqa: E402
from shared.rewards import compute_rewards, load_reward_fn  # noqa: E402
from shared.scalar import load_scalar_model, token_values  # noqa: E402
from shared.steps import get_splitter, step_token_starts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, help="policy checkpoint whose states are evaluated")
    p.add_argument("--critic", required=True, help="critic checkpoint saved by ppo.py")
    p.add_argument("--dataset", default="builtin")
    p.add_argument("--split", default="test")
    p.add_argument("--splitter", default="lines")
    p.add_argument("--num_prompts", type=int, default=200)
    p.add_argument("--k", type=int, default=9, help="rollouts of the VinePPO estimate")
    p.add_argument("--k_truth", type=int, default=256, help="rollouts of the ground truth")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=16)
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
    states = []  # (prompt index, completion prefix)
    for i, group in enumerate(trajs):
        ids = group[0].token_ids
        for k in step_token_starts(ids, split(decode(ids)), decode):
            states.append((i, ids[:k]))
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

    mae = lambda est: statistics.mean(abs(a - b) for a, b in zip(est, truth))  # noqa: E731
    result = {**provenance, "policy": args.policy, "critic": args.critic, "num_prompts": args.num_prompts,
              "num_states": len(states), "k": args.k,
              "k_truth": args.k_truth, "mae_critic": mae(critic_v), f"mae_mc_k{args.k}": mae(vine),
              "mean_truth_value": statistics.mean(truth)}
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
