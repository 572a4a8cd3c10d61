"""Unit-level (segment) reward model: a value head read at the end of each unit of the response. Docs: docs/unit_rm.md

Yin et al. 2025, "Segmenting Text and Learning Their Rewards for Improved RLHF in Language Model"
(https://arxiv.org/abs/2501.02790; code yinyueqin/DenseRewardRLHF-PPO, the DRCA seed's fork npnike10/LearningSegmentRewards).
A response is cut into units at the entropy peaks of the frozen SFT model (`--model_name_or_path`, which the head
also starts from): position j ends a unit when H_j > tau (H_j: the entropy of the distribution predicting token j+1),
and the last unit ends on the token before EOS (tau = 1000: one unit read at EOS, rm.py's bandit RM; tau = 0: about
one unit per token). The head's value v_k at unit k's end is the unit's reward; the sequence reward is their mean:

    r(x, y) = 1/K sum_k v_k,   Hbar(y) = H(softmax_k v_k) / K
    loss = -mean log sigmoid(r_w - r_l - margin) - lambda_reg * (mean Hbar(y_w) + mean Hbar(y_l))   lambda_reg = 0.02

Delta from rm.py (`diff` the two files): units and the mean of their values replace the score at EOS; the credit
entropy term (lambda_reg = 0 gives Yin et al.'s loss); after training, output_dir/final/unit_normalizer.json holds the
location-aware normaliser unit_ppo.py needs: per position p = k/K (3 decimals) the mean and population std of v_k
over training responses, fitted as mu(p) = a ln p + b and sigma(p) = a' ln p + b' (sklearn's HuberRegressor).

Launch:
    python algorithms/unit_rm.py                                # CPU, built-in pairs, about 5 minutes
    python algorithms/unit_rm.py --tau 1000 --lambda_reg 0      # the bandit RM (one unit) through the same code
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/unit_rm.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \
        --eval_split test --learning_rate 1e-5 --total_episodes 60000 --local_micro_batch_size 4 \
        --gradient_accumulation_steps 4 --max_seq_length 1024 --tau 2
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, enable_gradient_checkpointing,
                                init_distributed, load_causal_lm, load_tokenizer, prepare, prepare_frozen,
                                seed_everything)
from shared.localisation import localisation_metrics
from shared.logprobs import response_entropies
from shared.lora import add_lora, check_lora
from shared.scalar import head, load_scalar_model, token_values, use_distinct_pad_token
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "unit_rm"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (head init, data order)"""
    output_dir: str = "runs/unit_rm"
    """where metrics.jsonl, samples.jsonl and the final reward model (output_dir/final, with unit_normalizer.json) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """SFT causal LM: the backbone of the head and the frozen model whose entropy cuts units; `builtin:tiny-sft` is the built-in"""
    dataset: str = "builtin"
    """`builtin` (pairs; `builtin:sums-N`: N = 3..12 terms), a .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for pairwise accuracy (and the normalisation stats)"""
    prompt_key: str = "prompt"
    """column holding the prompt (text or messages; optional for conversational chosen/rejected)"""
    chosen_key: str = "chosen"
    """column holding the preferred response (text, or a conversation ending with the assistant reply)"""
    rejected_key: str = "rejected"
    """column holding the dispreferred response"""
    margin_key: str = ""
    """optional column with a per-pair margin m in log sigmoid(r_w - r_l - m) (Llama 2); empty: no margin"""
    prompt_template: str = "{prompt}"
    """template applied to text prompts; `{prompt}` is replaced by the dataset prompt"""
    response_template: str = "{response}"
    """template applied to each response text"""
    chat_template: bool = False
    """wrap text prompts with the tokenizer's chat template (conversational rows always use it)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """pairs whose prompt is longer than this many tokens are skipped (and counted)"""
    max_seq_length: Annotated[int, Ge(1)] = 512
    """pairs whose prompt + longer response exceed this many tokens are skipped (and counted)"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""
    lora_r: Annotated[int, Ge(0)] = 0
    """LoRA rank: rank-r adapters on the backbone (the score head trains in full), the rest frozen (0: off, all weights train)"""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA alpha: the adapters' update B A is scaled by lora_alpha / lora_r"""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input in training forwards (0 keeps log-probs deterministic)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: `all-linear` (attention and MLP linears, not the output head) or names (`q_proj,v_proj`)"""

    # reliability (shared/checkpoint.py; docs/rm.md#reliability)
    save_every: Annotated[int, Ge(0)] = 250
    """save a resumable checkpoint in output_dir/checkpoints every this many steps (0: only on SIGTERM/SIGINT/stop_after_steps)"""
    keep_checkpoints: Annotated[int, Ge(1)] = 2
    """how many of the most recent checkpoints to keep in output_dir/checkpoints"""
    resume: str = "auto"
    """`auto`: resume the latest checkpoint if any; `yes`: must; `no`: must not; `overwrite`: start afresh; or a checkpoint dir"""
    stop_after_steps: Annotated[int, Ge(0)] = 0
    """save a checkpoint and exit after this many steps of this invocation (0: run to the end); for time-limited jobs"""
    max_nonfinite_steps: Annotated[int, Ge(0)] = 10
    """optimizer steps with a non-finite loss or gradient are skipped and counted; abort the run after this many"""
    best_metric: str = "dev/accuracy"
    """dev metric that picks output_dir/best, saved with its reward_mean/std (`name:min`: lower is better; empty: none)"""

    # algorithm args
    tau: Annotated[float, Ge(0)] = 0.5
    """entropy threshold: position j ends a unit when the SFT model's H_j > tau (1000: one unit, the bandit RM; 0: tokens)"""
    lambda_reg: Annotated[float, Ge(0)] = 0.02
    """lambda in - lambda * (Hbar_w + Hbar_l), Hbar = H(softmax of the unit rewards) / K (0: Yin et al.'s loss)"""
    normalizer_num_pairs: Annotated[int, Ge(1)] = 2000
    """training pairs (chosen and rejected) whose unit rewards fit the location-aware normaliser (the reference: 9000)"""
    total_episodes: Annotated[int, Ge(1)] = 128000
    """number of preference pairs to consume (epochs = total_episodes / number of pairs)"""
    learning_rate: Annotated[float, Gt(0)] = 3e-4
    """peak learning rate (linear warm-up, cosine decay to 10%); 1e-5 suits 0.5B-7B backbones"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """pairs per forward pass on each rank (chosen and rejected go through one forward: 2x sequences)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    center_rewards_coefficient: Annotated[float, Ge(0)] = 0.0
    """eta in eta * mean((r_w + r_l)^2), which keeps rewards centred at 0 (TRL suggests 0.01); 0 disables it"""
    eval_every: Annotated[int, Ge(0)] = 250
    """evaluate held-out pairwise accuracy every this many optimizer steps (0: only at the end)"""
    eval_num_pairs: Annotated[int, Ge(0)] = 500
    """held-out pairs per evaluation, a fixed-seed sample (the final one also sets reward_mean / reward_std)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts held out with all their pairs (<= 10%) whose pair accuracy selects output_dir/best (0: none)"""
    num_sample_pairs: Annotated[int, Ge(0)] = 4
    """held-out pairs whose scores are written to samples.jsonl at each evaluation"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: head init and the Bradley-Terry loss
def init_reward_head(model) -> None:
    """Head weight ~ N(0, 1/sqrt(H+1)), bias 0 (open-instruct `reward_modeling.py`,
    vwxyzjn/summarize_from_feedback_details `reward.py`)."""
    layer = head(model)
    torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(layer.weight.shape[1] + 1))
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_w - r_l - m) + eta (r_w + r_l)^2, [B] (TRL `RewardTrainer.compute_loss`)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


BANDIT_TAU = 1000.0
NORMALIZER_FILE = "unit_normalizer.json"  # beside the HF checkpoint: read by unit_ppo.py  # the reference's switch: one unit, read at EOS


def peak_unit_ends(entropy: list[float], tau: float) -> list[int]:
    """Unit ends e_1 < ... < e_K in response coordinates (the reference's `segment_data_peak`): entropy[j] is the SFT
    model's entropy at response position j (predicting token j + 1), n = len(entropy), the last token (n - 1) is EOS
    or the length cut. tau = 1000: [n - 1]. Else E = {j : entropy[j] > tau}, then: E empty -> [n - 2]; max E = n - 1
    -> dropped when n - 2 is in E, else replaced by n - 2; max E < n - 2 -> n - 2 appended. Unit k covers tokens
    (e_{k-1}, e_k] (e_0 = -1), so a peak token j + 1 starts a unit; without EOS fix-up room (n < 2) there is none."""
    n = len(entropy)
    if tau == BANDIT_TAU:
        return [n - 1] if n >= 1 else []
    if n < 2:
        return []
    ends = [j for j in range(n) if entropy[j] > tau]
    if not ends:
        ends = [n - 2]
    elif ends[-1] == n - 1:
        ends = ends[:-1] if n - 2 in ends else ends[:-1] + [n - 2]
    elif ends[-1] < n - 2:
        ends = ends + [n - 2]
    return ends


def response_unit_ends(entropies, responses: list[list[int]], tau: float, where: str) -> list[list[int]]:
    """peak_unit_ends of each response from shared/logprobs.py::response_entropies' output (entropy of the distribution
    producing token t, so position j's is entry j + 1; position n - 1's is never needed, see peak_unit_ends). A
    response without a unit (only EOS) is a ValueError naming `where` and the row."""
    out = []
    for i, (ent, resp) in enumerate(zip(entropies, responses)):
        n = len(resp)
        h = ent[1:n].tolist() + [0.0]
        ends = peak_unit_ends(h, tau)
        if not ends:
            raise ValueError(f"{where}: row {i}: the response has no unit ({n} token(s); a unit needs a token before EOS)")
        out.append(ends)
    return out


def check_units(splits: dict, min_tokens: int, dataset: str) -> None:
    """A ValueError naming the dataset, split, pair and side of the first response with fewer than min_tokens tokens
    (EOS included): a unit needs a token before EOS (2), the bandit's one unit at EOS needs only EOS (1)."""
    for name, d in splits.items():
        for i in range(len(d)):
            for side, ids in (("chosen", d.chosen_ids[i]), ("rejected", d.rejected_ids[i])):
                if len(ids) < min_tokens:
                    raise ValueError(f"dataset {dataset!r}: {name} pair {i}: the {side} response has no unit "
                                     f"({len(ids)} token(s); a unit needs a token before EOS)")


def gather_unit_values(values: torch.Tensor, prompt_lens: list[int], ends: list[list[int]]):
    """v_k = values[i, prompt_len_i + e_k] for each row i of a right-padded [N, L] batch: ([N, K_max], mask [N, K_max])."""
    k_max = max(len(e) for e in ends)
    index = torch.zeros(len(ends), k_max, dtype=torch.long, device=values.device)
    mask = torch.zeros(len(ends), k_max, dtype=values.dtype, device=values.device)
    for i, e in enumerate(ends):
        index[i, : len(e)] = torch.tensor([prompt_lens[i] + j for j in e], device=values.device)
        mask[i, : len(e)] = 1.0
    return values.gather(1, index) * mask, mask


def sequence_reward(unit_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r = 1/K sum_k v_k over each row's units (the reference's agg_func `avg`), [N]."""
    return (unit_values * mask).sum(1) / mask.sum(1).clamp(min=1)


def credit_entropy(unit_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hbar = H(softmax_k v_k) / K per row, [N]: the entropy of the credit distribution over a row's K units, divided by
    K (the reference's normalisation; H / log K would be scale-free). One unit: 0."""
    logits = unit_values.masked_fill(mask == 0, float("-inf"))
    logp = torch.log_softmax(logits, dim=1)
    h = -(logp.exp() * logp.masked_fill(mask == 0, 0.0)).sum(1)
    return h / mask.sum(1).clamp(min=1)


def unit_rm_loss(chosen_units: torch.Tensor, chosen_mask: torch.Tensor, rejected_units: torch.Tensor,
                 rejected_mask: torch.Tensor, lambda_reg: float, margin: torch.Tensor | None = None,
                 center_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss BT(r_w, r_l) - lambda_reg * (Hbar_w + Hbar_l), [B], whose batch mean is the module docstring's
    loss, and the sequence rewards (r_w [B], r_l [B]). lambda_reg = 0 is bradley_terry_loss on the unit means."""
    r_w, r_l = sequence_reward(chosen_units, chosen_mask), sequence_reward(rejected_units, rejected_mask)
    loss = bradley_terry_loss(r_w, r_l, margin, center_coef)
    if lambda_reg:
        loss = loss - lambda_reg * (credit_entropy(chosen_units, chosen_mask) + credit_entropy(rejected_units, rejected_mask))
    return loss, r_w, r_l


def position_stats(unit_values: list[list[float]]) -> dict[str, tuple[float, float, int]]:
    """Per position key f"{k/K:.3f}" (k = 1..K of each response): mean, population std and count of the v_k there."""
    by_key: dict[str, list[float]] = {}
    for v in unit_values:
        for k, x in enumerate(v, start=1):
            by_key.setdefault(f"{k / len(v):.3f}", []).append(x)
    return {key: (float(np.mean(xs)), float(np.std(xs)), len(xs)) for key, xs in sorted(by_key.items())}


def fit_log_normalizer(stats: dict[str, tuple[float, float, int]]) -> dict[str, list[float]]:
    """mu(p) = a ln p + b and sigma(p) = a' ln p + b', each a HuberRegressor(epsilon=1.35) fit over the position keys
    (x = ln(p + 1e-10), the reference's `plot_logfit_function_sklearn.py`): {"mu": [a, b], "sigma": [a', b']}. A single
    position (every response one unit) gives slope 0 and its own mean and std."""
    from sklearn.linear_model import HuberRegressor

    p = np.array([float(k) for k in stats])
    mu, sigma = np.array([s[0] for s in stats.values()]), np.array([s[1] for s in stats.values()])
    if len(p) < 2:
        return {"mu": [0.0, float(mu[0])], "sigma": [0.0, float(sigma[0])]}
    x = np.log(p + 1e-10).reshape(-1, 1)
    out = {}
    for name, y in (("mu", mu), ("sigma", sigma)):
        fit = HuberRegressor(epsilon=1.35, max_iter=1000).fit(x, y)
        out[name] = [float(fit.coef_[0]), float(fit.intercept_)]
    return out


def score_pairs(model, prompts: list[list[int]], chosen: list[list[int]], rejected: list[list[int]], pad_id: int,
                device, chosen_ends: list[list[int]], rejected_ends: list[list[int]]):
    """Unit values of chosen and rejected in one right-padded forward of 2B sequences:
    (v_w [B, K], mask_w, v_l [B, K], mask_l)."""
    input_ids, attn, _ = data_utils.pad_batch(prompts + prompts, chosen + rejected, pad_id, device)
    values = token_values(model, input_ids, attn)
    units, mask = gather_unit_values(values, [len(p) for p in prompts + prompts], chosen_ends + rejected_ends)
    b = len(prompts)
    return units[:b], mask[:b], units[b:], mask[b:]


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    if args.center_rewards_coefficient < 0:
        raise ValueError(f"center_rewards_coefficient: must be >= 0, got {args.center_rewards_coefficient}")
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")

    # TRY NOT TO MODIFY: seeding (same seed on every rank for init and data order)
    seed_everything(args.seed)

    # data: (prompt, chosen, rejected) token ids, validated before anything is written (bad-row policy in
    # shared/data.py::load_preferences)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path, seq_cls=True)  # --lora_* flags against the model, before anything is written
    load = dict(tokenizer=tokenizer, prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                rejected_key=args.rejected_key, prompt_template=args.prompt_template,
                response_template=args.response_template, use_chat_template=args.chat_template,
                max_prompt_length=args.max_prompt_length, max_seq_length=args.max_seq_length)
    train = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts, **load)
    dev = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts, part="dev",
                                      **load)  # selects output_dir/best; never the reported eval set
    held_out = data_utils.load_preferences(args.dataset, args.eval_split, limit=args.eval_num_pairs, **load)

    def margins(d: data_utils.PreferenceData) -> list[float] | None:
        if not args.margin_key:
            return None
        out = []
        for i, row in enumerate(d.rows):
            value = row.get(args.margin_key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise data_utils.DataError(f"dataset {args.dataset!r}: pair {i}: margin column {args.margin_key!r} "
                                           f"is {value!r}, expected a finite number")
            out.append(float(value))
        return out

    train_margin, held_out_margin, dev_margin = margins(train), margins(held_out), margins(dev)
    check_units({"train": train, "dev": dev, "eval": held_out}, 1 if args.tau == BANDIT_TAU else 2, args.dataset)
    sampler = data_utils.PromptSampler(len(train), args.seed)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    tracker.write(f"{len(train)} training pairs ({train.num_identical} identical chosen/rejected and "
                  f"{train.num_too_long} over-long skipped), {len(held_out)} held-out pairs, {len(dev)} dev pairs, "
                  f"{args.num_steps} steps")

    # model: backbone + scalar head; any stored normalisation is dropped (this run measures its own)
    dtype = default_dtype(info.device)
    model = load_scalar_model(model_path, dtype)
    model.config.reward_mean = model.config.reward_std = None
    # the frozen SFT model whose entropies cut the units (not needed for one unit at EOS)
    sft = None if args.tau == BANDIT_TAU else prepare_frozen(load_causal_lm(model_path, dtype), info, dtype)
    # pad != EOS in the saved checkpoint, so HF's own classifier forward reads the score at EOS, where this script
    # reads it (shared/scalar.py::use_distinct_pad_token); the vocabulary, and so the policy's ids, are unchanged
    new_pad = use_distinct_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    if new_pad is not None:
        tracker.write(f"pad token {new_pad!r} (the tokenizer padded with its EOS token)")
    if not any(a.endswith("ForSequenceClassification") for a in model.config.architectures or []):
        init_reward_head(model)  # a causal-LM backbone gets a fresh head; a trained RM keeps its own
    model = add_lora(model, args, seq_cls=True)  # LoRA: adapters on the backbone, the score head in full
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.to(info.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  fused=True)
    warmup = max(1, int(args.warmup_ratio * args.num_steps))

    def lr_lambda(step: int) -> float:  # linear warm-up, cosine decay to 10% of the peak
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    model, optimizer, scheduler = prepare(model, optimizer, scheduler, info, args.local_micro_batch_size,
                                          args.gradient_accumulation_steps, args.max_grad_norm, dtype)
    pad_id = tokenizer.pad_token_id

    def unit_ends(prompts: list[list[int]], responses: list[list[int]]) -> list[list[int]]:
        """Unit ends of each response (peak_unit_ends) from the frozen SFT model's entropies."""
        if sft is None:
            return [[len(r) - 1] for r in responses]
        ent = response_entropies(sft, prompts, responses, pad_id, len(responses), 1.0, info.device)
        return response_unit_ends(ent, responses, args.tau, "dataset")

    def unit_credits(prompts: list[list[int]], responses: list[list[int]]):
        """Each response's unit token spans (e_{k-1}, e_k] as [a, b) and unit rewards v_k (shared/localisation.py)."""
        spans, credits = [], []
        with torch.no_grad():
            for s in range(0, len(responses), args.local_micro_batch_size):
                p, r = prompts[s : s + args.local_micro_batch_size], responses[s : s + args.local_micro_batch_size]
                ends = unit_ends(p, r)
                ids, attn, _ = data_utils.pad_batch(p, r, pad_id, info.device)
                v, m = gather_unit_values(token_values(model, ids, attn), [len(x) for x in p], ends)
                spans += [[(a + 1, b + 1) for a, b in zip([-1] + e[:-1], e)] for e in ends]
                credits += [v[i, : len(e)].tolist() for i, e in enumerate(ends)]
        return spans, credits

    def pair_units(d: data_utils.PreferenceData, idx: list[int]):
        """score_pairs on the pairs idx of d, with their unit ends."""
        p, c, r = [d.prompt_ids[i] for i in idx], [d.chosen_ids[i] for i in idx], [d.rejected_ids[i] for i in idx]
        ends = unit_ends(p + p, c + r)
        return score_pairs(model, p, c, r, pad_id, info.device, ends[: len(idx)], ends[len(idx) :])

    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(len(dev)))  # output_dir/best

    def score_set(d: data_utils.PreferenceData, d_margin, prefix: str, num_samples: int) -> tuple[dict, list]:
        """Pairwise accuracy, margin, loss and the mean / std of all scores (chosen and rejected pooled: OpenRLHF's
        normalisation stats) on the pairs d (each rank scores a slice); the first num_samples pairs' scores."""
        n = len(d)
        mine = list(range(info.rank, n, info.world_size))
        sums = torch.zeros(6, dtype=torch.float64)  # count, correct, margin, loss, sum r, sum r^2
        units_sum = torch.zeros(1, dtype=torch.float64)  # units over chosen and rejected
        samples = []
        # every rank runs the same number of forwards (ZeRO-3 gathers shards in each): a rank with fewer pairs
        # (e.g. 487 pairs on 8 ranks) scores a dummy pair for the batches it lacks and discards it
        n_batches = int(info.all_reduce(torch.tensor([math.ceil(len(mine) / args.local_micro_batch_size)]),
                                        "max").item())
        with torch.no_grad():
            for b in range(n_batches):
                idx = mine[b * args.local_micro_batch_size : (b + 1) * args.local_micro_batch_size]
                if not idx:
                    score_pairs(model, [[pad_id]], [[pad_id, pad_id]], [[pad_id, pad_id]], pad_id, info.device,
                                [[0]], [[0]])
                    if sft is not None:
                        unit_ends([[pad_id]], [[pad_id, pad_id]])
                    continue
                v_w, m_w, v_l, m_l = pair_units(d, idx)
                m = None if d_margin is None else torch.tensor([d_margin[i] for i in idx], device=v_w.device)
                loss, r_w, r_l = unit_rm_loss(v_w, m_w, v_l, m_l, args.lambda_reg, m, args.center_rewards_coefficient)
                units_sum += torch.tensor([m_w.sum().item() + m_l.sum().item()], dtype=torch.float64)
                both = torch.cat([r_w, r_l]).double().cpu()
                sums += torch.tensor([len(idx), (r_w > r_l).sum().item(), (r_w - r_l).sum().item(),
                                      loss.sum().item(), both.sum().item(), (both**2).sum().item()], dtype=torch.float64)
                for j, i in enumerate(idx):
                    if i < num_samples:
                        samples.append({"prompt": str(d.rows[i]["prompt"]), "chosen": d.rows[i]["chosen"],
                                        "rejected": d.rows[i]["rejected"], "score_chosen": r_w[j].item(),
                                        "score_rejected": r_l[j].item()})
        info.all_reduce(sums)
        info.all_reduce(units_sum)
        samples = [x for part in info.gather_objects(samples) for x in part]
        count = sums[0].item()
        mean = sums[4].item() / (2 * count)
        std = math.sqrt(max(sums[5].item() / (2 * count) - mean**2, 0.0))
        return {f"{prefix}/accuracy": sums[1].item() / count, f"{prefix}/margin": sums[2].item() / count,
                f"{prefix}/loss": sums[3].item() / count, f"{prefix}/reward_mean": mean,
                f"{prefix}/reward_std": std, f"{prefix}/units_per_response": units_sum[0].item() / (2 * count)}, samples

    def evaluate(step: int) -> dict:
        """score_set on the held-out pairs (eval/, reported) and the dev slice (dev/, selects output_dir/best)."""
        model.eval()
        metrics, samples = score_set(held_out, held_out_margin, "eval", args.num_sample_pairs)
        if len(held_out) and "rejected_step" in held_out.rows[0]:  # the built-in task: is the lowest unit the slip?
            metrics |= localisation_metrics(held_out, info, tokenizer.decode, unit_credits)
        if len(dev):
            metrics |= score_set(dev, dev_margin, "dev", 0)[0]
        model.train()
        stats = {"reward_mean": metrics["eval/reward_mean"],  # normalisation of this model's scores
                 "reward_std": max(metrics["eval/reward_std"], 1e-6)}
        metrics.update(best.update(metrics, step, model, extra_config=stats))  # the best model in output_dir/best
        tracker.log(metrics, step)
        tracker.log_samples(samples, step)
        tracker.write(f"[step {step}] held-out pairwise accuracy {metrics['eval/accuracy']:.3f}, "
                      f"margin {metrics['eval/margin']:.2f}")
        return metrics

    def fit_normalizer() -> dict:
        """The location-aware normaliser (module docstring) from the unit rewards of the first normalizer_num_pairs
        training pairs, chosen and rejected (each rank scores a slice; all ranks run the same number of forwards)."""
        model.eval()
        n = min(args.normalizer_num_pairs, len(train))
        mine = list(range(info.rank, n, info.world_size))
        n_batches = int(info.all_reduce(torch.tensor([math.ceil(len(mine) / args.local_micro_batch_size)]),
                                        "max").item())
        rows = []
        with torch.no_grad():
            for b in range(n_batches):
                idx = mine[b * args.local_micro_batch_size : (b + 1) * args.local_micro_batch_size] or mine[:1] or [0]
                v_w, m_w, v_l, m_l = pair_units(train, idx)
                if b * args.local_micro_batch_size < len(mine):
                    for v, m in ((v_w, m_w), (v_l, m_l)):
                        rows += [v[i, : int(m[i].sum())].tolist() for i in range(len(idx))]
        rows = [r for part in info.gather_objects(rows) for r in part]
        stats = position_stats(rows)
        return {"method": "peak", "tau": args.tau, "model": args.model_name_or_path, "aggregation": "avg",
                "num_responses": len(rows), **fit_log_normalizer(stats),
                "positions": {k: {"mean": m, "std": s, "count": c} for k, (m, s, c) in stats.items()}}

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG, this rank's loss window
    engines = {"model": model}
    start_step, state = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
    window = state.get("window", torch.zeros(6, dtype=torch.float64))  # pairs, loss, correct, margin, chosen, rejected

    # training loop
    timer = Timer()
    model.train()
    if start_step == 0:
        tracker.log({"data/train_pairs": len(train), "data/skipped_identical": train.num_identical,
                     "data/skipped_too_long": train.num_too_long}, 0)
        evaluate(0)
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        with timer("train"):
            global_idx = sampler.next_indices(args.batch_size)
            local_idx = global_idx[info.rank * args.local_batch_size : (info.rank + 1) * args.local_batch_size]
            for m in range(args.gradient_accumulation_steps):
                idx = local_idx[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                v_w, m_w, v_l, m_l = pair_units(train, idx)
                margin = None if train_margin is None else torch.tensor([train_margin[i] for i in idx],
                                                                        device=v_w.device)
                losses, r_w, r_l = unit_rm_loss(v_w, m_w, v_l, m_l, args.lambda_reg, margin,
                                                args.center_rewards_coefficient)
                guard.backward(model, losses.sum() / args.local_batch_size)  # mean over the step
                grad_norm = guard.step(model)  # a non-finite loss or gradient skips the step (counted)
                with torch.no_grad():
                    window += torch.tensor([len(idx), losses.sum().item(), (r_w > r_l).sum().item(),
                                            (r_w - r_l).sum().item(), r_w.sum().item(), r_l.sum().item()],
                                           dtype=torch.float64)
        if step % 10 == 0 or step == args.num_steps:
            info.all_reduce(window)
            n = window[0].item()
            metrics = {"loss/rm": window[1].item() / n, "rm/accuracy": window[2].item() / n,
                       "rm/margin": window[3].item() / n, "rm/chosen": window[4].item() / n,
                       "rm/rejected": window[5].item() / n, "lr": scheduler.get_last_lr()[0],
                       "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                       "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
            tracker.log(metrics, step)
            tracker.progress(0, loss=metrics["loss/rm"])
            window.zero_()
        tracker.progress(1)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            evaluate(step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, local={"window": window}, sampler=sampler, guard=guard, best=best)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)
    final_metrics = evaluate(args.num_steps)
    # the stats make scores normalised ((r - mean) / std) wherever shared/scalar.py::score_last_token reads them
    stats = {"reward_mean": final_metrics["eval/reward_mean"], "reward_std": max(final_metrics["eval/reward_std"], 1e-6)}
    final = save_hf(model, tokenizer, os.path.join(args.output_dir, "final"), info, extra_config=stats)
    normalizer = fit_normalizer()
    if info.is_main:
        with open(os.path.join(final, NORMALIZER_FILE), "w") as fh:
            json.dump(normalizer, fh, indent=1)
    tracker.write(f"normaliser: mu(p) = {normalizer['mu'][0]:.3f} ln p + {normalizer['mu'][1]:.3f}, sigma(p) = "
                  f"{normalizer['sigma'][0]:.3f} ln p + {normalizer['sigma'][1]:.3f} ({len(normalizer['positions'])} positions)")
    tracker.log(check_ranks(model, info, local_idx), args.num_steps)  # after the save: a failure here loses nothing
    tracker.write(f"saved {final} (reward_mean {stats['reward_mean']:.3f}, reward_std {stats['reward_std']:.3f})")
    ckpt.finish()
    tracker.close()
    return str(final)


if __name__ == "__main__":
    run_cli(main, Args)
