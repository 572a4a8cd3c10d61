"""DRCA: PPO whose sequence reward is redistributed over text units by counterfactual differences. Docs: docs/drca.md

Source: the "Learning Segment Rewards" code (github.com/npnike10/LearningSegmentRewards, an OpenRLHF fork:
`train_drca_ray.py`, `utils/unit_reward.py`), which calls it "unit-level difference rewards for fine-grained credit
assignment" (we read DRCA as Difference-Reward Credit Assignment). The beta-mixing is ABC's (Chan et al. 2024,
https://arxiv.org/abs/2402.00782) with its attention weights replaced by counterfactual unit differences.

Per rollout, with R = (RM(x, y) - mu) / sigma the reward model's normalised score:
  1. split the response into at most N units: step labels (`regex`) or peaks of the policy's entropy (`entropy`);
  2. for each unit k build a counterfactual response: `truncate` (the reference: the prefix before the unit,
     the unit blanked with spaces, then EOS) or `mask` (leave-one-out: the unit blanked, the rest kept);
  3. score every counterfactual with the same RM in batches: d_k = R - R~_k (mu cancels);
  4. per-token rewards: drca_beta * d_k / |unit k| on unit k's tokens, (1 - drca_beta) * R on the last token;
  5. then PPO as in ppo_rlhf.py: clip to [-10, 10], minus beta * k1 KL per token (--beta), GAE on a critic
     (initialised from the RM), batch whitening, clipped policy and value updates.
Delta from PPO (algorithms/ppo_rlhf.py): only step 4's reward placement and the scorer calls it needs; drca_beta = 0
is ppo_rlhf.py's reward. Reference-code bugs are fixed by default and reproducible with flags (docs/drca.md lists them).
On the built-in task `--scorer auto` (the default) scores responses and counterfactuals with the per-line grader, as
its small RMs do not judge counterfactual text well enough to learn (docs/drca.md); elsewhere `auto` is the RM.

Launch:
    python algorithms/drca.py              # CPU, built-in task, a few minutes: held-out accuracy rises (docs/drca.md)
    python algorithms/drca.py --scorer rm  # builtin:tiny-rm scores (its score rises, held-out accuracy does not)
    accelerate launch --config_file scripts/accelerate/zero3.yaml --num_processes 8 algorithms/drca.py \
        --model_name_or_path <sft> --reward_model_path <rm trained by rm.py> --dataset <prompts.jsonl> \
        --chat_template --max_new_tokens 2048 --learning_rate 6.57e-6 --critic_learning_rate 2.34e-6
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared import task as builtin_task
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, enable_gradient_checkpointing,
                                full_named_parameters, init_distributed, load_causal_lm, load_tokenizer,
                                prepare, prepare_frozen, seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, make_generator
from shared.prompts import load_prompt_task
from shared.scalar import check_same_tokenizer, head, load_scalar_model, normalized, score_sequences, token_values
from shared.localisation import load_slips, localisation_metrics
from shared.logprobs import forward_logprobs, response_entropies
from shared.units import blank_token_id, response_units, unit_pattern, unit_pattern_name
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker

@dataclass
class Args:
    # common args
    exp_name: str = "drca"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/drca"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoints (output_dir/final, output_dir/critic) go"""
    model_name_or_path: str = "builtin:tiny-sft"
    """hub name or local path of the policy (and reference); `builtin:tiny-sft` is the built-in warm start"""
    reward_model_path: str = "builtin:tiny-rm"
    """reward model (HF sequence classification, e.g. from rm.py); `builtin:tiny-rm` is rm.py's default run"""
    critic_model_path: str = ""
    """initialise the critic from this checkpoint (default: the reward model, as the reference)"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """dataset column with the gold answer (held-out accuracy only; training uses the reward model)"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader for eval/accuracy: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, `none`, or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend: `vllm` (colocated in-process engine) or `hf` (model.generate)"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    vllm_enable_sleep: bool = False
    """put vLLM to sleep during training to free GPU memory (GPU only)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""
    save_model: bool = True
    """save the final policy (output_dir/final) and critic (output_dir/critic) as HF checkpoints"""

    # reliability (shared/checkpoint.py; docs/drca.md#reliability)
    save_every: Annotated[int, Ge(0)] = 25
    """save a resumable checkpoint in output_dir/checkpoints every this many steps (0: only on SIGTERM/SIGINT/stop_after_steps)"""
    keep_checkpoints: Annotated[int, Ge(1)] = 2
    """how many of the most recent checkpoints to keep in output_dir/checkpoints"""
    resume: str = "auto"
    """`auto`: resume from output_dir's latest checkpoint if any; `yes`: must resume; `no`: must not; or a checkpoint directory"""
    stop_after_steps: Annotated[int, Ge(0)] = 0
    """save a checkpoint and exit after this many steps of this invocation (0: run to the end); for time-limited jobs"""
    max_nonfinite_steps: Annotated[int, Ge(0)] = 10
    """optimizer steps with a non-finite loss or gradient are skipped and counted; abort the run after this many"""
    best_metric: str = "dev/accuracy"
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none); dev/reward with --reward_fn none"""

    # algorithm args: DRCA
    drca_beta: Annotated[float, Interval(ge=0, le=1)] = 0.8
    """share of the reward spread over units (drca_beta * d_k); (1 - drca_beta) * R stays on the last token; 0 = PPO"""
    max_units_per_sequence: Annotated[int, Ge(1)] = 10
    """N: at most this many units per response (the N-th absorbs the rest)"""
    unit_extraction: Literal["regex", "entropy"] = "regex"
    """`regex` (a pattern marks where units start) or `entropy` (units start at policy-entropy peaks)"""
    unit_pattern: str = "auto"
    """regex units: `labels` (reference: "A. "), `labels+digits`, `lines`, a raw regex, or `auto` (lines for builtin)"""
    unit_entropy_threshold: Annotated[float, Ge(0)] = 1.5
    """entropy units: tau, in nats; a token whose entropy exceeds it starts a new unit"""
    entropy_boundary: Literal["before", "after"] = "before"
    """entropy units: `before` (a peak token starts a unit) or `after` (the reference: it ends one)"""
    entropy_cap: bool = True
    """entropy units: cap at max_units_per_sequence (the reference ignores the cap)"""
    entropy_source: Literal["policy", "reference"] = "policy"
    """entropy units: entropy of the current `policy` (the reference) or of the frozen `reference` model"""
    scorer: Literal["auto", "rm", "line_grader"] = "auto"
    """scores responses and counterfactuals: `rm`, `line_grader` (built-in task; an upper bound) or `auto` (docs/drca.md)"""
    counterfactual: Literal["truncate", "mask"] = "truncate"
    """`truncate` (reference: prefix + blanked unit + EOS) or `mask` (leave-one-out: blank the unit, keep the rest)"""
    unitless_fallback: Literal["terminal", "zeros"] = "terminal"
    """a response without units gets R on its last token (`terminal`) or, as the reference, nothing (`zeros`)"""
    response_skip_tokens: Annotated[int, Ge(-1)] = -1
    """response tokens before the unit region: -1 = auto (a leading <think>...</think> block and whitespace)"""
    code_compat_regex_offsets: bool = False
    """reproduce the reference's regex offsets (blank lines shift later units one character left)"""

    # algorithm args: PPO
    total_episodes: Annotated[int, Ge(1)] = 25600
    """total completions to sample over the run (steps = total_episodes / batch_size; 50 steps by default)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """policy AdamW learning rate (constant after warm-up)"""
    critic_learning_rate: Annotated[float, Gt(0)] = 3e-4
    """critic AdamW learning rate (its own optimizer)"""
    warmup_steps: Annotated[int, Ge(0)] = 5
    """linear learning-rate warm-up steps (both optimizers)"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm (each model)"""
    num_generations: Annotated[int, Ge(1)] = 8
    """completions per prompt"""
    local_num_prompts: Annotated[int, Ge(1)] = 64
    """prompts per rank per step (local_batch_size = local_num_prompts * num_generations completions)"""
    num_minibatches: Annotated[int, Ge(1)] = 2
    """optimizer steps per pass over the batch"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """completions per forward/backward (and reward-model forward) on each rank; memory: docs/performance.md"""
    num_iterations: Annotated[int, Ge(1)] = 2
    """passes over each batch (reference DRCA: 1, its PPO baseline: 2)"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature; trainer logits are divided by it too"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling; <1 makes the trainer's log-probs differ from the sampler's"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it are 'truncated'"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    beta: Annotated[float, Ge(0)] = 0.01
    """eta: coefficient of the per-token k1 KL penalty in the reward (reference 0.01, fixed); 0 skips the reference"""
    reward_clip: Annotated[float, Gt(0)] = 10.0
    """per-token rewards are clipped to [-reward_clip, reward_clip] before the KL term (reference 10)"""
    gamma: Annotated[float, Interval(ge=0, le=1)] = 1.0
    """GAE discount (reference 1)"""
    lam: Annotated[float, Interval(ge=0, le=1)] = 1.0
    """GAE lambda (reference 1)"""
    epsilon_low: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """lower clip range of PPO-clip: ratio >= 1 - epsilon_low"""
    epsilon_high: Annotated[float, Ge(0)] = 0.2
    """upper clip range: ratio <= 1 + epsilon_high"""
    cliprange_value: Annotated[float, Gt(0)] = 0.5
    """value clip range around the old values (reference 0.5)"""
    whiten_advantages: bool = True
    """normalise advantages to zero mean, unit variance over all tokens of the batch (all ranks)"""
    eval_every: Annotated[int, Ge(0)] = 10
    """evaluate on the held-out split every this many steps (0: only before and after training)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 500
    """held-out prompts per evaluation (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts kept out of training (<= 10%), evaluated with the held-out set; picks output_dir/best (0: none)"""
    eval_num_samples: Annotated[int, Ge(1)] = 4
    """samples per held-out prompt (accuracy = mean correctness, reward = mean RM score)"""
    eval_temperature: Annotated[float, Ge(0)] = 1.0
    """sampling temperature for evaluation"""
    sample_every: Annotated[int, Ge(0)] = 25
    """log a table of sample completions with their units and credits every this many steps"""
    localisation_num_pairs: Annotated[int, Ge(0)] = 200
    """built-in task only: held-out slip pairs on which each evaluation measures eval/localisation (docs/drca.md; 0: off)"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_prompts: tyro.conf.Suppress[int] = 0
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: counterfactuals and difference rewards (docs/drca.md: y~_k, credit d_k, r_t)
def counterfactual_response(response: list[int], start: int, end: int, mode: str, fill_id: int,
                            eos_id: int) -> list[int]:
    """Response tokens with [start, end) blanked by fill_id: `truncate` ends with EOS right after the unit
    (length end + 1), `mask` keeps everything after it (leave-one-out)."""
    blank = [fill_id] * (end - start)
    if mode == "truncate":
        return response[:start] + blank + [eos_id]
    if mode == "mask":
        return response[:start] + blank + response[end:]
    raise ValueError(f"counterfactual: expected truncate or mask, got {mode!r}")


def unit_token_rewards(scores: torch.Tensor, unit_spans: list[list[tuple[int, int]]], credits: list[list[float]],
                       last_action: torch.Tensor, num_actions: int, beta: float,
                       unitless_fallback: str = "terminal") -> torch.Tensor:
    """Per-action rewards [B, A] before clipping and KL: beta * d_k / |A_k| on every action of unit k (action-space
    spans [a, b), empty ones skipped), (1 - beta) * R on the last action (assigned, not added), 0 elsewhere.
    A response without units gets R on its last action (`terminal`); with `zeros` (the reference) it gets nothing,
    unless no response in the batch has a unit (then the reference falls back to plain PPO for all)."""
    B = scores.shape[0]
    rewards = torch.zeros(B, num_actions, dtype=torch.float32, device=scores.device)
    any_units = any(len(u) > 0 for u in unit_spans)
    for i in range(B):
        if unit_spans[i]:
            for (a, b), d in zip(unit_spans[i], credits[i]):
                if b > a:
                    rewards[i, a:b] = beta * d / (b - a)
            rewards[i, last_action[i]] = (1 - beta) * scores[i]
        elif unitless_fallback == "terminal" or not any_units:
            rewards[i, last_action[i]] = scores[i]
        elif unitless_fallback != "zeros":
            raise ValueError(f"unitless_fallback: expected terminal or zeros, got {unitless_fallback!r}")
    return rewards


def shaped_rewards(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                   beta: float, reward_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """clamp(r, ±reward_clip) - beta * clamp(k1, ±10) per action (beta: --beta; 0 on padding); returns (r', k1)."""
    kl = torch.clamp(logp - ref_logp, -10, 10) * mask
    return (torch.clamp(rewards, -reward_clip, reward_clip) - beta * kl) * mask, kl


# ALGO LOGIC: PPO (as ppo.py)
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over the masked positions of [B, T] tensors; returns advantages and returns (A + V), 0 outside the mask."""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(last)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m
        advantages[:, t] = last
        next_value = torch.where(m > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | None = None,
                  var: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked entries; mean/var may be given (all-reduced over ranks)."""
    if mean is None:
        mean = (x * mask).sum() / mask.sum()
    if var is None:
        var = (((x - mean) ** 2) * mask).sum() / mask.sum()
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float, mask: torch.Tensor | None = None):
    """PPO-clip per-token loss -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) and the clipped-token indicator,
    rho = pi_theta / pi_old per token. The log-ratio is masked before exp, so padding has rho = 1, never inf (then
    inf * 0 = NaN in the masked sum)."""
    ratio = torch.exp(logp - logp_old if mask is None else (logp - logp_old) * mask)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    return loss, is_clipped.float(), ratio


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float):
    """Clipped value loss 0.5 max((V - G)^2, (V_clip - G)^2) per token and the clipped indicator."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def init_value_head(model) -> None:
    """Critic head weight ~ N(0, 1/sqrt(H+1)), bias 0 (when the critic does not start from a reward model)."""
    layer = head(model)
    torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(layer.weight.shape[1] + 1))
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-action values [B, L-1], normalised by the stored reward stats when the critic is a reward model
    (the reference's `--normalize_reward` critic): V = (v - mu) / sigma."""
    return normalized(token_values(critic, input_ids, attention_mask)[:, :-1], critic)


def effective_scorer(args: Args) -> str:
    """--scorer auto: the per-line grader on the built-in task (module docstring), the reward model elsewhere."""
    if args.scorer != "auto":
        return args.scorer
    return "line_grader" if builtin_task.is_builtin(args.dataset) else "rm"


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if not args.reward_model_path:
        raise ValueError("reward_model_path: DRCA needs a reward model (e.g. `builtin:tiny-rm` or one from rm.py)")
    if effective_scorer(args) == "line_grader" and not builtin_task.is_builtin(args.dataset):
        raise ValueError(f"scorer: line_grader grades the built-in running sums only, not dataset {args.dataset!r}")
    if args.unit_extraction == "regex":
        unit_pattern(args.unit_pattern, args.dataset)  # a raw regex must compile
    if args.entropy_source == "reference" and args.beta == 0:
        raise ValueError("entropy_source: `reference` needs the reference model, which beta 0 skips")


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    validate(args)
    args.scorer = effective_scorer(args)  # `auto` resolved, so the run's config names the scorer that ran
    info = init_distributed()
    derive_sizes(args, info.world_size)  # batch_size, local_minibatch_size, num_steps, ... (shared/cli.py)
    args.unit_pattern = unit_pattern_name(args.unit_pattern, args.dataset)  # `auto` resolved: the config names it
    unit_flags = dict(skip=args.response_skip_tokens, extraction=args.unit_extraction,
                      pattern=unit_pattern(args.unit_pattern, args.dataset), max_units=args.max_units_per_sequence,
                      threshold=args.unit_entropy_threshold, boundary=args.entropy_boundary, cap=args.entropy_cap,
                      code_compat=args.code_compat_regex_offsets)  # shared/units.py takes the values, not the flags

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for init and data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003

    # data, validated before anything is written (one line per error); the grader: None with --reward_fn none
    model_path = resolve_model_path(args.model_name_or_path)
    rm_path = resolve_model_path(args.reward_model_path, "reward_model_path")
    critic_path = resolve_model_path(args.critic_model_path, "critic_model_path") if args.critic_model_path else ""
    tokenizer = load_tokenizer(model_path)
    check_same_tokenizer(rm_path, tokenizer)
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, rm_path,
                                                                  graded=False if args.reward_fn == "none" else None)
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headlines = ["eval/accuracy", "eval/reward"] if reward_fn else ["eval/reward"]  # printed at start and end
    # held-out slip pairs of the built-in task: is the lowest credit on the slipped line? (shared/localisation.py)
    slips = load_slips(args, tokenizer) if args.localisation_num_pairs and builtin_task.is_builtin(args.dataset) else None
    fill_id, eos_id = blank_token_id(tokenizer), tokenizer.eos_token_id  # a counterfactual blanks a unit with fill_id

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.top_p < 1.0:
        tracker.write("warning: top_p < 1 makes the trainer's log-probs differ from the sampler's")
    tracker.write(f"{len(train_data.rows)} train prompts ({train_data.num_filtered} over max_prompt_length dropped), "
                  f"{len(eval_data.rows)} eval prompts, {len(dev_data.rows)} dev prompts, {args.num_steps} steps of "
                  f"{args.batch_size} completions; scored by "
                  f"{'the per-line grader' if args.scorer == 'line_grader' else args.reward_model_path}")

    # models and optimizers: policy, critic (from the RM, own optimizer), frozen reference and reward model
    dtype = default_dtype(info.device)
    schedule = lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps))  # noqa: E731
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
    policy, optimizer, scheduler = prepare(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                           info, args.local_micro_batch_size, args.gradient_accumulation_steps,
                                           args.max_grad_norm, dtype)
    critic_path = critic_path or rm_path
    critic = load_scalar_model(critic_path, dtype)
    if critic_path == model_path:  # a fresh head on the policy's backbone
        init_value_head(critic)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    critic = critic.to(info.device)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate, weight_decay=0.0, fused=True)
    critic, critic_optimizer, _ = prepare(critic, critic_optimizer,
                                          torch.optim.lr_scheduler.LambdaLR(critic_optimizer, schedule), info,
                                          args.local_micro_batch_size, args.gradient_accumulation_steps,
                                          args.max_grad_norm, dtype)
    ref_policy = prepare_frozen(load_causal_lm(model_path, dtype), info, dtype) if args.beta > 0 else None
    reward_model = prepare_frozen(load_scalar_model(rm_path, dtype), info, dtype)
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))

    # generation engine
    generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                               dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                               world_size=info.world_size, zero_stage=info.zero_stage,
                               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                               enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop)
    decode = completion_decoder(tokenizer, args.stop)  # text for rewards and logs: EOS skipped, cut at --stop
    micro = args.local_micro_batch_size

    def rm_scores(prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """Normalised RM scores in micro-batches (shared/scalar.py), or the per-line grader's (--scorer line_grader)."""
        if args.scorer == "line_grader":
            grades = [builtin_task.line_grade(tokenizer.decode(p, skip_special_tokens=True), decode(r))
                      for p, r in zip(prompts, responses)]
            return torch.tensor(grades, dtype=torch.float32, device=info.device)
        return score_sequences(reward_model, prompts, responses, tokenizer.pad_token_id, info, micro)

    def unit_credits(prompts, responses, entropies):
        """Units of each response (none when `entropies` is None) and their credits d_k = R - R~_k: one scorer call
        per response and one per unit (its counterfactual). Returns units, R, credits, the number of counterfactuals."""
        units = ([response_units(r, e, tokenizer, decode, **unit_flags) for r, e in zip(responses, entropies)]
                 if entropies is not None else [[] for _ in responses])
        cf_owner, cf_prompts, cf_responses = [], [], []
        for i in range(len(responses)):
            for s, e in units[i]:
                cf_owner.append(i)
                cf_prompts.append(prompts[i])
                cf_responses.append(counterfactual_response(responses[i], s, e, args.counterfactual, fill_id, eos_id))
        scores, cf_scores = rm_scores(prompts, responses), rm_scores(cf_prompts, cf_responses)
        credits = [[] for _ in responses]
        for i, cf_score in zip(cf_owner, cf_scores.tolist()):
            credits[i].append(scores[i].item() - cf_score)
        return units, scores, credits, len(cf_responses)

    def slip_credits(prompts, responses):
        """Units and credits of held-out slip responses as in training (entropies from --entropy_source)."""
        source = ref_policy if args.entropy_source == "reference" and ref_policy is not None else policy
        entropies = (response_entropies(source, prompts, responses, tokenizer.pad_token_id, micro, args.temperature,
                                        info.device) if args.unit_extraction == "entropy" else [None] * len(responses))
        units, _, credits, _ = unit_credits(prompts, responses, entropies)
        return units, credits

    def evaluate(step: int) -> dict:
        """Grader accuracy / pass@k and the mean RM score of the same samples (eval, dev); slip localisation."""
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed), reward_model=reward_model,
                                    pad_id=tokenizer.pad_token_id, micro_batch_size=micro)
        if slips is not None:
            metrics |= localisation_metrics(slips, info, decode, slip_credits)
        return {**metrics, **best.update(metrics, step, policy)}  # keeps the best policy (on dev) in output_dir/best

    # TRY NOT TO MODIFY: resume: weights, optimizers, LR schedulers, data position, RNG, first evaluation
    engines = {"policy": policy, "critic": critic}
    start_step, state = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
    first = state.get("first_eval", {})
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:
        metrics = evaluate(0)
        tracker.log({**metrics, "data/train_prompts": len(train_data.rows),
                     "data/skipped_too_long": train_data.num_filtered}, 0)
        first = dict(metrics)
        tracker.write("[step 0] held-out " + ", ".join(f"{k[5:]} {metrics[k]:.3f}" for k in headlines))
    policy.train()
    critic.train()
    B = args.local_batch_size
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        # 1. rollout: this rank's slice of the global prompt batch
        with timer("generate"):
            global_idx = sampler.next_indices(args.num_prompts)
            local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
            outs = generator.generate([train_data.prompt_ids[i] for i in local_idx], n=args.num_generations,
                                      temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919 + step,
                                      index_offset=info.rank * args.local_num_prompts)
            generator.sleep(level=2)  # --vllm_enable_sleep: weights discarded, the sync after the update reloads them
        comps = [c for group in outs for c in group]
        responses = [c.token_ids for c in comps]
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, responses, tokenizer.pad_token_id, info.device)
        mask = resp[:, 1:].float()  # action t emits token t+1: 1 on completion tokens, EOS included
        last_action = (mask * torch.arange(mask.shape[1], device=info.device)).argmax(1)
        finished = torch.tensor([c.finished for c in comps], device=info.device)

        # 2. log-probs, entropies and values before the update (no grad): old policy, reference, critic
        old_logp, ref_logp, old_values, entropy = [torch.zeros_like(mask) for _ in range(4)]
        with timer("logprob"), torch.no_grad():
            for s in range(0, B, micro):
                sl = slice(s, s + micro)
                old_logp[sl], entropy[sl] = forward_logprobs(policy, input_ids[sl], attn[sl], resp[sl],
                                                             args.temperature, True)
                if ref_policy is not None:
                    ref_logp[sl], ref_ent = forward_logprobs(ref_policy, input_ids[sl], attn[sl], resp[sl],
                                                             args.temperature, args.entropy_source == "reference")
                    if args.entropy_source == "reference":
                        entropy[sl] = ref_ent
                old_values[sl] = critic_values(critic, input_ids[sl], attn[sl])
        old_values = old_values * mask

        # 3. units and counterfactual credits: R from the scorer, then one scorer call per unit, d_k = R - R~_k
        with timer("reward"):  # beta = 0 is plain PPO: no unit is needed
            entropies = [entropy[i, len(prompts[i]) - 1 :].cpu() for i in range(B)] if args.drca_beta > 0 else None
            units, scores, credits, num_counterfactuals = unit_credits(prompts, responses, entropies)

        # 4. per-token rewards: drca_beta * d_k / |unit| on unit k, (1 - drca_beta) R last; clip; minus beta * k1
        action_units = [[(len(prompts[i]) + s - 1, len(prompts[i]) + e - 1) for s, e in units[i]] for i in range(B)]
        raw_rewards = unit_token_rewards(scores, action_units, credits, last_action, mask.shape[1], args.drca_beta,
                                         args.unitless_fallback)
        rewards, kl_k1 = shaped_rewards(raw_rewards, old_logp, ref_logp if ref_policy is not None else old_logp,
                                        mask, args.beta, args.reward_clip)

        # 5. advantages: GAE on the critic's values, whitened over the whole batch (all ranks)
        advantages, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            sums = torch.stack([(advantages * mask).sum(), (advantages**2 * mask).sum(), mask.sum()]).double().cpu()
            info.all_reduce(sums)
            mean = sums[0] / sums[2]
            var = sums[1] / sums[2] - mean**2
            advantages = masked_whiten(advantages, mask, mean.float().to(info.device), var.float().to(info.device))

        # 6. update: num_iterations passes x num_minibatches steps of the policy, then the critic, on the same minibatch
        stats = defaultdict(list)  # metric name -> one value per micro-batch
        grad_norms, critic_norms = [], []
        with timer("train"):
            for _ in range(args.num_iterations):
                perm = torch.randperm(B)
                for mb in range(args.num_minibatches):
                    mb_idx = perm[mb * args.local_minibatch_size : (mb + 1) * args.local_minibatch_size]
                    mb_tokens = mask[mb_idx].sum()
                    global_tokens = info.all_reduce(mb_tokens.clone().cpu()).item()
                    for idx in data_utils.micro_batches(mb_idx.tolist(), [], args.gradient_accumulation_steps, "padded"):
                        m_mask = mask[idx]
                        # policy: token mean of the clipped surrogate over the minibatch (all ranks)
                        logp, _ = forward_logprobs(policy, input_ids[idx], attn[idx], resp[idx], args.temperature)
                        pg, is_clipped, ratio = clipped_surrogate(logp, old_logp[idx], advantages[idx],
                                                                  args.epsilon_low, args.epsilon_high, m_mask)
                        guard.backward(policy, (pg * m_mask).sum() * info.world_size / max(global_tokens, 1))
                        norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                        grad_norms += [norm] if norm is not None else []
                        # critic: clipped value regression on the GAE returns
                        values = critic_values(critic, input_ids[idx], attn[idx])
                        vf, vclipped = value_loss(values, old_values[idx], returns[idx], args.cliprange_value)
                        guard.backward(critic, (vf * m_mask).sum() * info.world_size / max(global_tokens, 1))
                        norm = guard.step(critic)
                        critic_norms += [norm] if norm is not None else []
                        with torch.no_grad():
                            n = m_mask.sum().clamp(min=1)
                            mm = lambda x: ((x * m_mask).sum() / n).item()  # noqa: E731
                            for k, v in {"loss/policy_avg": mm(pg), "loss/value_avg": mm(vf),
                                         "policy/clipfrac_avg": mm(is_clipped), "val/clipfrac_avg": mm(vclipped),
                                         "policy/approxkl_avg": mm(0.5 * (logp - old_logp[idx]) ** 2),
                                         "val/ratio": mm(ratio)}.items():
                                stats[k].append(v)

        # 7. weight sync
        with timer("sync"):
            generator.wake_up()
            generator.sync_weights(full_named_parameters(policy, info))

        # 8. log (reduced over ranks once per step)
        lengths = mask.sum(1)
        flat_credits = [d for c in credits for d in c]
        with_units = [i for i in range(B) if units[i]]
        # sum_a r_a = drca_beta * sum_k d_k + (1 - drca_beta) R, before clipping (0 up to rounding), max over ranks
        identity_err = max([abs(raw_rewards[i].sum().item() - args.drca_beta * sum(credits[i])
                                - (1 - args.drca_beta) * scores[i].item()) for i in with_units], default=0.0)
        ret_var = torch.var(returns[mask > 0]) if mask.sum() > 1 else torch.tensor(0.0)
        avg = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
        local = {
            "objective/scores": scores.mean().item(),
            "objective/kl": kl_k1.sum(1).mean().item(),
            "objective/non_score_reward": -(args.beta * kl_k1).sum(1).mean().item(),
            "objective/entropy": ((entropy * mask).sum(1) / lengths.clamp(min=1)).mean().item(),
            "drca/units_per_seq": sum(len(u) for u in units) / B,
            "drca/unitless_frac": 1 - len(with_units) / B,
            "drca/credit_mean": avg(flat_credits),
            "drca/credit_std": max(avg([d * d for d in flat_credits]) - avg(flat_credits) ** 2, 0.0) ** 0.5,
            "drca/rm_calls": float(B + num_counterfactuals),
            "drca/token_reward_clipfrac": ((raw_rewards.abs() > args.reward_clip).float() * mask).sum().item()
            / mask.sum().item(),
            **{k: avg(v) for k, v in stats.items()},
            "val/values_mean": (old_values.sum() / mask.sum()).item(),
            "val/explained_variance": (1 - torch.var((returns - old_values)[mask > 0]) / ret_var.clamp(min=1e-8)).item(),
            "val/sequence_lengths": lengths.mean().item(),
            "val/stop_rate": finished.float().mean().item(),
            "optim/grad_norm": avg(grad_norms), "optim/critic_grad_norm": avg(critic_norms),
        }
        metrics = info.mean_over_ranks(local)
        metrics["drca/rm_calls"] *= info.world_size  # per step, all ranks
        metrics["drca/sum_identity_err"] = max(info.gather_objects(identity_err))
        metrics.update({"objective/rlhf_reward": metrics["objective/scores"] + metrics["objective/non_score_reward"],
                        "lr": scheduler.get_last_lr()[0], "episode": step * args.batch_size,
                        "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"), ckpt.user_code(step, engines, tracker, trained=True, sampler=sampler, guard=guard,
                                               best=best, first_eval=first):
                metrics.update(evaluate(step))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, reward=metrics["objective/scores"], units=metrics["drca/units_per_seq"])
        if args.sample_every and step % args.sample_every == 0:
            tracker.log_samples([{"prompt": decode(prompts[i]), "completion": decode(responses[i]),
                                  "score": scores[i].item(), "units": [decode(responses[i][s:e]) for s, e in units[i]],
                                  "credits": [round(d, 4) for d in credits[i]], "finish_reason": comps[i].finish_reason}
                                 for i in range(0, B, args.num_generations)][:8], step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, sampler=sampler, guard=guard, best=best, first_eval=first)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)

    with ckpt.user_code(args.num_steps, engines, tracker, trained=True,
                        sampler=sampler, guard=guard, best=best, first_eval=first):
        metrics = evaluate(args.num_steps)
    metrics["time/total"] = time.time() - start
    final = ""  # saved before the end-of-run checks, so a failure there loses nothing
    if args.save_model:
        final = str(save_hf(policy, tokenizer, os.path.join(args.output_dir, "final"), info))
        save_hf(critic, tokenizer, os.path.join(args.output_dir, "critic"), info)
    metrics.update(check_ranks(policy, info, local_idx))
    metrics.update(check_engine(generator, policy, eval_data.prompt_ids[:4], info, args.max_new_tokens))
    tracker.log(metrics, args.num_steps)
    tracker.write("held-out " + ", ".join(f"{k[5:]} {first[k]:.3f} -> {metrics[k]:.3f}" for k in headlines)
                  + f" in {metrics['time/total']:.0f}s")
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
