"""DRCA: PPO whose sequence reward is redistributed over text units by counterfactual differences. Docs: docs/drca.md

Source: the "Learning Segment Rewards" code (github.com/npnike10/LearningSegmentRewards, an OpenRLHF fork): "unit-level
difference rewards for fine-grained credit assignment" (Difference-Reward Credit Assignment); the drca_beta mixing is
ABC's (Chan et al. 2024, https://arxiv.org/abs/2402.00782) with counterfactual differences for attention weights.
With R the scorer's normalised score of response y: 1. split y into at most N units (step labels or lines, or peaks of
the policy's entropy); 2. blank each unit k (`truncate`: prefix, blanked unit, EOS, the reference; `mask`: leave one
out); 3. score the counterfactuals: credit d_k = R - R~_k; 4. then PPO as in ppo_rlhf.py on the rewards
    r_t = clamp(drca_beta * d_k / |u_k| on unit k's tokens, (1 - drca_beta) * R on the last token, -10, 10)
          - beta * clamp(k1_t, -10, 10),  drca_beta = 0.8, beta = 0.01, gamma = lambda = 1, eps = 0.2 (the default)

Delta from PPO (algorithms/ppo_rlhf.py): steps 1-3, the reward above (drca_beta = 0: ppo_rlhf.py's), slip localisation
and `--scorer` (auto: the built-in task's per-line grader); reference bugs are fixed, reproducible with flags. Every
ppo_rlhf.py flag is here (`--tis`, LoRA, `--adaptive_kl`, `--kl_placement loss`), some with the reference's defaults.

Launch:
    python algorithms/drca.py              # CPU, built-in task, a few minutes: held-out accuracy rises (docs/drca.md)
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
from shared.checkpoint import BestModel, Checkpointer, save_final, save_hf
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, enable_gradient_checkpointing,
                                full_named_parameters, init_distributed, load_causal_lm, load_reference,
                                load_tokenizer, prepare, seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, completion_metrics, make_generator
from shared.localisation import load_slips, localisation_metrics
from shared.logprobs import forward_logprobs, fp32_lm_head, response_entropies
from shared.mismatch import mismatch_metrics
from shared.lora import add_lora, check_lora
from shared.prompts import load_prompt_task, task_summary
from shared.scalar import (check_same_tokenizer, head, load_reward_model, load_scalar_model, normalized, score_sequences,
                           token_values)
from shared.verifier import verifier_kind
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
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """hub name or local path of the policy; `builtin:tiny-sft` is the tiny model warm-started by sft.py (committed weights)"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """column of the gold answer (held-out accuracy only; training uses the reward model)"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader for eval/accuracy: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, `none`, or `module:function`"""
    reward_model_path: str = "builtin:tiny-rm"
    """reward model: rm.py's (HF sequence classification; `builtin:tiny-rm`: its default run), genrm.py's or implicit_prm.py's"""
    critic_model_path: str = ""
    """initialise the critic from this checkpoint (default: the reward model, as the reference code; a verifier: the policy)"""
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
    fp32_lm_head: bool = False
    """run the LM head's matmul in fp32 in both the trainer and the sampler: less mismatch, a slower head"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""
    lora_r: Annotated[int, Ge(0)] = 0
    """LoRA rank: rank-r adapters on the policy and the critic (its value head trains in full), the rest frozen (0: off)"""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA alpha: the adapters' update B A is scaled by lora_alpha / lora_r"""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input in training forwards (0 keeps log-probs deterministic)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: `all-linear` (attention and MLP linears, not the output head) or names (`q_proj,v_proj`)"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """how vLLM gets a LoRA policy: merged weights (`merged`) or the adapter alone, served by vLLM's LoRA (`adapter`); docs/lora.md"""
    save_model: bool = True
    """save the final policy (output_dir/final) and critic (output_dir/critic) as HF checkpoints"""

    # reliability (shared/checkpoint.py; docs/running.md#reliability)
    save_every: Annotated[int, Ge(0)] = 25
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
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none); dev/reward with --reward_fn none"""

    # algorithm args
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
    """completions per forward/backward on each rank (HF `per_device_train_batch_size`); memory: docs/performance.md"""
    num_iterations: Annotated[int, Ge(1)] = 2
    """passes over each batch (TRL's PPO and summarize_from_feedback_details: 4)"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature; trainer logits are divided by it too"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling; <1 makes the trainer's log-probs differ from the sampler's"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it are 'truncated'"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    gamma: Annotated[float, Interval(ge=0, le=1)] = 1.0
    """GAE discount"""
    lam: Annotated[float, Interval(ge=0, le=1)] = 1.0
    """GAE lambda (the reference: 1)"""
    epsilon_low: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """lower clip range of PPO-clip: ratio >= 1 - epsilon_low"""
    epsilon_high: Annotated[float, Ge(0)] = 0.2
    """upper clip range: ratio <= 1 + epsilon_high"""
    cliprange_value: Annotated[float, Gt(0)] = 0.5
    """value clip range around the old values (the reference: 0.5)"""
    whiten_advantages: bool = True
    """normalise advantages to zero mean, unit variance over the whole batch (all ranks)"""
    kl_placement: Literal["reward", "loss"] = "reward"
    """`reward`: -beta * k1 on every token's reward (RLHF); `loss`: beta * k3 as a loss term (ppo.py)"""
    beta: Annotated[float, Ge(0)] = 0.01
    """KL coefficient (the reference: 0.01, fixed); 0 skips the reference model"""
    adaptive_kl: bool = False
    """adapt beta towards kl_target (Ziegler et al.)"""
    kl_target: Annotated[float, Gt(0)] = 6.0
    """target per-sequence KL for the adaptive controller"""
    kl_horizon: Annotated[int, Ge(1)] = 10000
    """horizon (in episodes) of the adaptive controller"""
    non_stop_penalty: bool = False
    """replace the score of completions without EOS by penalty_reward_value (TRL's missing_eos_penalty)"""
    penalty_reward_value: Annotated[float, Interval()] = -1.0  # any real number
    """score given to completions without EOS when non_stop_penalty is on"""
    ratio_threshold: Annotated[float, Gt(0)] = 10.0
    """skip a policy micro-batch (loss x 0) whose mean ratio exceeds this (VinePPO safety check)"""
    tis: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"] = \
        "none"
    """sampler/trainer mismatch correction: `none`, per token, per completion or by its geometric mean; docs/mismatch.md"""
    tis_cap: Annotated[float, Gt(0)] = 2.0
    """C: cap of the truncated weight w = pi_train_old / pi_sampler, upper bound of the masks' kept range [lo, C]"""
    tis_mask_low: Annotated[float, Ge(0)] = 0.0
    """lo: lower bound of the masks' kept range (0: 1/C)"""
    entropy_coef: Annotated[float, Ge(0)] = 0.0
    """entropy bonus: entropy_coef * token entropy is subtracted from every token's loss (0: off)"""
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
    reward_clip: Annotated[float, Gt(0)] = 10.0
    """per-token rewards are clipped to [-reward_clip, reward_clip] before the KL term (the reference: 10)"""
    eval_every: Annotated[int, Ge(0)] = 10
    """evaluate on the held-out split every this many steps (0: only before and after training)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 500
    """held-out prompts per evaluation (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts kept out of training (<= 10%), evaluated with the held-out set; picks output_dir/best (0: none)"""
    eval_num_samples: Annotated[int, Ge(1)] = 4
    """samples per held-out prompt (accuracy = mean correctness; pass@k over them)"""
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
    """Response tokens with [start, end) blanked: `truncate` ends with EOS after the unit, `mask` keeps the rest."""
    blank = [fill_id] * (end - start)
    if mode == "truncate":
        return response[:start] + blank + [eos_id]
    if mode == "mask":
        return response[:start] + blank + response[end:]
    raise ValueError(f"counterfactual: expected truncate or mask, got {mode!r}")


def unit_token_rewards(scores: torch.Tensor, unit_spans: list[list[tuple[int, int]]], credits: list[list[float]],
                       last_action: torch.Tensor, num_actions: int, beta: float,
                       unitless_fallback: str = "terminal") -> torch.Tensor:
    """Per-action rewards [B, A] before clipping and KL: beta * d_k / |A_k| on the actions [a, b) of unit k, (1 - beta)
    * R on the last action, 0 elsewhere. A response without units gets R on its last action (`terminal`) or, with
    `zeros` (the reference), nothing unless no response in the batch has a unit (then all get plain PPO's)."""
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


def drca_metrics(units: list, credits: list[list[float]], num_counterfactuals: int, raw_rewards: torch.Tensor,
                 mask: torch.Tensor, reward_clip: float, world_size: int) -> dict[str, float]:
    """This rank's DRCA metrics of a step: units per response, the fraction without a unit, the credits' mean and
    std, the scorer calls (responses + counterfactuals, times world_size: their mean over ranks is the step's total)
    and the fraction of actions whose reward reward_clip clips."""
    flat, avg = [d for c in credits for d in c], lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    return {"drca/units_per_seq": sum(len(u) for u in units) / len(units),
            "drca/unitless_frac": 1 - sum(1 for u in units if u) / len(units),
            "drca/credit_mean": avg(flat), "drca/credit_std": max(avg([d * d for d in flat]) - avg(flat) ** 2, 0.0) ** 0.5,
            "drca/rm_calls": float(len(units) + num_counterfactuals) * world_size,
            "drca/token_reward_clipfrac": ((raw_rewards.abs() > reward_clip).float() * mask).sum().item()
            / mask.sum().item()}


def sum_identity_error(raw_rewards: torch.Tensor, credits: list[list[float]], scores: torch.Tensor, units: list,
                       drca_beta: float) -> float:
    """max over responses with units of |sum_a r_a - drca_beta * sum_k d_k - (1 - drca_beta) R|, rewards before
    clipping: 0 up to rounding (drca/sum_identity_err)."""
    return max([abs(raw_rewards[i].sum().item() - drca_beta * sum(credits[i]) - (1 - drca_beta) * scores[i].item())
                for i in range(len(units)) if units[i]], default=0.0)


# ALGO LOGIC: algorithm-local pure functions
def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """GAE over the masked (completion) positions of [B, T] tensors.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last completion token is 0); A_t = delta_t + gamma lam A_{t+1}.
    Returns advantages and returns (A + V), both 0 outside the mask."""
    values = values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(last)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m
        advantages[:, t] = last
        # after the completion nothing is bootstrapped (V = 0, A = 0); prompt positions are masked anyway
        next_value = torch.where(m > 0, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, mean: torch.Tensor | None = None,
                  var: torch.Tensor | None = None, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over masked entries; mean/var may be given
    (e.g. all-reduced over ranks). shift_mean=False adds the mean back."""
    if mean is None:
        mean = (x * mask).sum() / mask.sum()
    if var is None:
        var = (((x - mean) ** 2) * mask).sum() / mask.sum()
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from samples of pi, d = logp - logp_ref: k1 = d; k2 = d^2/2;
    k3 = exp(-d) - 1 + d >= 0 (the GRPO/TRL default). As a loss only k2's gradient equals grad KL."""
    d = logp - logp_ref if mask is None else (logp - logp_ref) * mask  # mask first: no inf/NaN from padding
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"kl_estimator: expected k1, k2 or k3, got {estimator!r}")


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


def tis_weights(logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, mode: str,
                cap: float, low: float = 0.0) -> torch.Tensor:
    """Importance weights w = pi_train_old / pi_sampler correcting sampler/trainer mismatch, detached.

    token_truncate:    w_t = min(rho_t, C)                      rho_t = exp(log pi_old(y_t) - log pi_sampler(y_t))
    token_mask:        w_t = rho_t if lo <= rho_t <= C, else 0    (IcePop, arXiv 2510.18855)
    sequence_truncate: w_t = min(rho_seq, C) on every token       rho_seq = prod_t rho_t, one weight per completion
    sequence_mask:     w_t = rho_seq if lo <= rho_seq <= C, else 0 on every token
    geometric_mask:    w_t = 1 if lo <= rho_geo <= C, else 0      rho_geo = exp(mean_t log rho_t) (Geo-RS)
    lo = low, or 1/C when low = 0 (a mask's kept range; the truncate modes have no lower bound). token_* and
    sequence_* are TRL's `vllm_importance_sampling_mode` with clip_max = C: its *_mask modes with clip_min = lo, its
    *_truncate modes with clip_min unset (TRL's clip_min would raise a weight below it to clip_min; nothing here
    does); geometric_mask is verl's `rollout_rs: geometric` (rejection only: no weight on kept tokens; its
    ratio sits near 1, so C near 1, e.g. 1.001). A masked token stays in the loss's token count (IcePop, TRL); verl
    drops it from the count. log rho_seq is clamped to [-20, 20] before the exp (verl's bound against overflow),
    which changes no weight for C < e^20. cap = inf gives the mode's weights before truncation or mask."""
    log_w = (logp_old - logp_sampler).detach() * mask  # [B, T], 0 on padding
    lo = low or 1 / cap
    if mode == "none":
        return torch.ones_like(log_w)
    if mode == "geometric_mask":
        g = torch.exp(log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
        return ((g >= lo) & (g <= cap)).float()
    if mode.startswith("sequence_"):
        log_w = log_w.sum(1, keepdim=True).clamp(-20.0, 20.0).expand_as(mask)  # log rho_seq on every token
    w = torch.exp(log_w)
    if mode.endswith("_truncate"):
        return w.clamp(max=cap)
    if mode.endswith("_mask"):
        return w * ((w <= cap) & (w >= lo)).float()
    raise ValueError("tis: expected none, token_truncate, token_mask, sequence_truncate, sequence_mask or "
                     f"geometric_mask, got {mode!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float):
    """Clipped value loss 0.5 max((V - R)^2, (V_clip - R)^2) per token and the clipped indicator."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def adaptive_kl_update(beta: float, current_kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Ziegler et al.'s controller: beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n_steps / horizon."""
    error = max(-0.2, min(0.2, current_kl / target - 1))
    return beta * (1 + error * n_steps / horizon)


def init_value_head(model) -> None:
    """Critic head weight ~ N(0, 1/sqrt(H+1)), bias 0 (as vwxyzjn/summarize_from_feedback_details and VinePPO's
    `pretrained_with_value_head.py`)."""
    layer = head(model)
    torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(layer.weight.shape[1] + 1))
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-action values [B, L-1]. A critic initialised from a reward model (the default with one) carries the RM's
    score stats: its values are normalised with them, V = (v - mu) / sigma, the same units as the normalised
    rewards it must predict (raw RM units biased every sequence's last advantage by (v - mu) / sigma - v)."""
    return normalized(token_values(critic, input_ids, attention_mask)[:, :-1], critic)


def effective_scorer(args: Args) -> str:
    """--scorer auto: the per-line grader on the built-in task (module docstring), the reward model elsewhere."""
    return args.scorer if args.scorer != "auto" else "line_grader" if builtin_task.is_builtin(args.dataset) else "rm"


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.adaptive_kl and args.beta == 0:
        raise ValueError("adaptive_kl: needs beta > 0 to adapt")
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
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: validated before anything is written (a bad row, model path or reward function stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    rm_path = resolve_model_path(args.reward_model_path, "reward_model_path")
    critic_path = resolve_model_path(args.critic_model_path, "critic_model_path") if args.critic_model_path else ""
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    check_same_tokenizer(rm_path, tokenizer)
    # train / held-out / dev prompts and the grader (None with --reward_fn none: no accuracy, best/ by dev/reward)
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, rm_path,
                                                                  graded=False if args.reward_fn == "none" else None)
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headline = "eval/reward"  # printed at start and end: the reward model's mean normalised score, held out
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
    tracker.write(task_summary(train_data, eval_data, dev_data, args.num_steps, args.batch_size) + "; scored by "
                  f"{'the per-line grader' if args.scorer == 'line_grader' else args.reward_model_path}")

    # models and optimizers: policy, critic (own optimizer), frozen reference and reward model
    dtype = default_dtype(info.device)
    schedule = lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps))  # noqa: E731
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    policy = add_lora(policy, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
    policy, optimizer, scheduler = prepare(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                           info, args.local_micro_batch_size, args.gradient_accumulation_steps,
                                           args.max_grad_norm, dtype)
    critic_path = critic_path or (model_path if verifier_kind(rm_path) else rm_path)  # a GenRM has no value head
    critic = load_scalar_model(critic_path, dtype)
    if critic_path == model_path:  # a fresh head on the policy's backbone
        init_value_head(critic)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    critic = critic.to(info.device)
    critic = add_lora(critic, args, seq_cls=True)  # LoRA: adapters on the backbone, the value head in full
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate, weight_decay=0.0, fused=True)
    critic, critic_optimizer, _ = prepare(critic, critic_optimizer,
                                          torch.optim.lr_scheduler.LambdaLR(critic_optimizer, schedule), info,
                                          args.local_micro_batch_size, args.gradient_accumulation_steps,
                                          args.max_grad_norm, dtype)
    # the reference is only loaded when the KL term is used (no NaN KL when beta = 0); LoRA: the policy, adapters off
    ref_policy = load_reference(policy, model_path, dtype, info, bool(args.lora_r)) if args.beta > 0 else None
    fp32_lm_head([policy, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
    reward_model = load_reward_model(rm_path, tokenizer, info, dtype)  # frozen; a verifier scores as shared/verifier.py
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))

    # generation engine
    generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                               dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                               world_size=info.world_size, zero_stage=info.zero_stage,
                               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                               enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop, lora_sync=args.lora_sync,
                               fp32_lm_head=args.fp32_lm_head)
    decode = completion_decoder(tokenizer, args.stop)  # text for rewards and logs: EOS skipped, cut at --stop

    def rm_scores(prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """Normalised RM scores in micro-batches (shared/scalar.py), or the per-line grader's (--scorer line_grader)."""
        if args.scorer == "line_grader":
            return torch.tensor([builtin_task.line_grade(tokenizer.decode(p, skip_special_tokens=True), decode(r))
                                 for p, r in zip(prompts, responses)], dtype=torch.float32, device=info.device)
        return score_sequences(reward_model, prompts, responses, tokenizer.pad_token_id, info, args.local_micro_batch_size)

    def unit_credits(prompts, responses, entropies, scores):
        """Units of each response (none when `entropies` is None) and their credits d_k = R - R~_k (R: `scores`): one
        scorer call per unit (its counterfactual). Returns units, credits and the number of counterfactuals."""
        units = ([response_units(r, e, tokenizer, decode, **unit_flags) for r, e in zip(responses, entropies)]
                 if entropies is not None else [[] for _ in responses])
        cfs = [(i, counterfactual_response(responses[i], s, e, args.counterfactual, fill_id, eos_id))
               for i in range(len(responses)) for s, e in units[i]]  # (owner, counterfactual response)
        credits = [[] for _ in responses]
        for (i, _), cf_score in zip(cfs, rm_scores([prompts[i] for i, _ in cfs], [r for _, r in cfs]).tolist()):
            credits[i].append(scores[i].item() - cf_score)
        return units, credits, len(cfs)

    def drca_rewards(prompts, responses, unit_entropy, scores, mask):
        """Step 4's units, credits, number of counterfactuals, per-action rewards (unit_token_rewards; no unit with
        drca_beta = 0: plain PPO) and their sum_identity_error; `unit_entropy`: each action's entropy (--entropy_source)."""
        entropies = [unit_entropy[i, len(p) - 1 :].cpu() for i, p in enumerate(prompts)] if args.drca_beta else None
        units, credits, num_counterfactuals = unit_credits(prompts, responses, entropies, scores)
        action_units = [[(len(p) + s - 1, len(p) + e - 1) for s, e in u] for p, u in zip(prompts, units)]
        last_action = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)
        raw_rewards = unit_token_rewards(scores, action_units, credits, last_action, mask.shape[1], args.drca_beta,
                                         args.unitless_fallback)
        return units, credits, num_counterfactuals, raw_rewards, sum_identity_error(raw_rewards, credits, scores, units,
                                                                                    args.drca_beta)

    def slip_credits(prompts, responses):
        """Units and credits of held-out slip responses as in training (entropies from --entropy_source)."""
        source = ref_policy if args.entropy_source == "reference" and ref_policy is not None else policy
        entropies = (response_entropies(source, prompts, responses, tokenizer.pad_token_id, args.local_micro_batch_size,
                                        args.temperature, info.device)
                     if args.unit_extraction == "entropy" else [None] * len(responses))
        return unit_credits(prompts, responses, entropies, rm_scores(prompts, responses))[:2]

    def evaluate(step: int) -> dict:  # grader accuracy, pass@k, RM score on eval and dev (shared/evaluation.py)
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed), reward_model=reward_model,
                                    pad_id=tokenizer.pad_token_id, micro_batch_size=args.local_micro_batch_size)
        if slips is not None:  # eval/localisation: the lowest credit on the slipped line (shared/localisation.py)
            metrics |= localisation_metrics(slips, info, decode, slip_credits)
        return {**metrics, **best.update(metrics, step, policy)}  # keeps the best policy (on dev) in output_dir/best

    # TRY NOT TO MODIFY: resume: weights, optimizers, LR schedulers, data position, RNG, the adaptive KL coefficient
    engines = {"policy": policy, "critic": critic}
    resumable = {"sampler": sampler, "guard": guard, "best": best}  # saved and restored with each checkpoint
    start_step, state = ckpt.restore(engines, **resumable)
    beta, first_eval = state.get("beta", args.beta), state.get("first_eval")  # beta adapts with --adaptive_kl
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:  # the held-out value before training, logged with the train set's size
        first_eval = tracker.log_start(evaluate(0), headline, len(train_data.rows), train_data.num_filtered)
    policy.train()
    critic.train()
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, beta=beta, first_eval=first_eval)
        # 1. rollout: this rank's slice of the global prompt batch, G samples each
        with timer("generate"):
            global_idx = sampler.next_indices(args.num_prompts)
            local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
            outs = generator.generate([train_data.prompt_ids[i] for i in local_idx], n=args.num_generations,
                                      temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919 + step,
                                      index_offset=info.rank * args.local_num_prompts)
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU for training (the sync replaces the weights)
        comps = [c for group in outs for c in group]
        responses = [c.token_ids for c in comps]
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, responses, tokenizer.pad_token_id, info.device)
        mask = resp[:, 1:].float()  # position t predicts token t+1: 1 on completion tokens, EOS included
        finished = torch.tensor([c.finished for c in comps], device=info.device)
        sampler_logp = data_utils.sampler_logprobs([len(p) for p in prompts], [c.logprobs for c in comps], mask)

        # 2. scores R: the reward model's normalised score of prompt + completion, or the per-line grader's (--scorer)
        with timer("reward"):
            texts = [decode(c.token_ids) for c in comps]
            scores = rm_scores(prompts, responses)
            if args.non_stop_penalty:  # before the credits: d_k = R - R~_k with the penalised R
                scores = torch.where(finished, scores, torch.full_like(scores, args.penalty_reward_value))

        # 3. log-probs and values before the update (no grad): old policy, reference, critic
        old_logp, ref_logp, old_values = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)
        entropy_sum = torch.zeros(args.local_batch_size, device=info.device)
        unit_entropy = torch.zeros_like(mask)  # per token, of --entropy_source: where entropy units start
        with timer("logprob"), torch.no_grad():
            for s in range(0, args.local_batch_size, args.local_micro_batch_size):
                sl = slice(s, s + args.local_micro_batch_size)
                old_logp[sl], ent = forward_logprobs(policy, input_ids[sl], attn[sl], resp[sl], args.temperature, True)
                entropy_sum[sl], unit_entropy[sl] = (ent * mask[sl]).sum(1), ent
                if ref_policy is not None:
                    ref_logp[sl], ref_ent = forward_logprobs(ref_policy, input_ids[sl], attn[sl], resp[sl],
                                                             args.temperature, args.entropy_source == "reference")
                    unit_entropy[sl] = ref_ent if args.entropy_source == "reference" else unit_entropy[sl]
                old_values[sl] = critic_values(critic, input_ids[sl], attn[sl])
        old_values = old_values * mask

        # 4. rewards: units, credits d_k = R - R~_k (a scorer call per counterfactual), r_t as in the module docstring
        with timer("reward"):
            units, credits, num_cf, raw_rewards, identity_err = drca_rewards(prompts, responses, unit_entropy, scores, mask)
        rewards, kl_k1 = shaped_rewards(raw_rewards, old_logp, ref_logp if ref_policy is not None else old_logp, mask,
                                        beta if args.kl_placement == "reward" else 0.0, args.reward_clip)

        # 5. advantages: GAE on the critic's values, whitened over the whole batch (all ranks)
        advantages, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            sums = torch.stack([(advantages * mask).sum(), (advantages**2 * mask).sum(), mask.sum()]).double().cpu()
            info.all_reduce(sums)
            mean = sums[0] / sums[2]
            var = sums[1] / sums[2] - mean**2
            advantages = masked_whiten(advantages, mask, mean.float().to(info.device), var.float().to(info.device))

        # 6. update: num_iterations passes x num_minibatches steps of the policy, then the critic, on each minibatch
        stats = defaultdict(list)  # metric name -> one value per micro-batch
        grad_norms, critic_norms = [], []
        with timer("train"):
            for _ in range(args.num_iterations):
                perm = torch.randperm(args.local_batch_size)
                for mb in range(args.num_minibatches):
                    mb_idx = perm[mb * args.local_minibatch_size : (mb + 1) * args.local_minibatch_size]
                    mb_tokens = mask[mb_idx].sum()
                    global_tokens = info.all_reduce(mb_tokens.clone().cpu()).item()
                    for idx in data_utils.micro_batches(mb_idx.tolist(), [], args.gradient_accumulation_steps, "padded"):
                        m_mask = mask[idx]
                        # policy: token mean of the clipped surrogate over the step (all ranks), + beta * k3 loss
                        logp, entropy = forward_logprobs(policy, input_ids[idx], attn[idx], resp[idx], args.temperature,
                                                         args.entropy_coef > 0)
                        pg, is_clipped, ratio = clipped_surrogate(logp, old_logp[idx], advantages[idx],
                                                                  args.epsilon_low, args.epsilon_high, m_mask)
                        # TIS: w = pi_old / pi_sampler (the generator's log-probs of the same weights: its kernels
                        # and precision differ from the trainer's), truncated or masked at tis_cap
                        w = tis_weights(old_logp[idx], sampler_logp[idx], m_mask, args.tis, args.tis_cap, args.tis_mask_low)
                        per_token = pg * w
                        if args.entropy_coef:  # entropy bonus, aggregated over the same tokens as the policy term
                            per_token = per_token - args.entropy_coef * entropy
                        loss = (per_token * m_mask).sum() * info.world_size / max(global_tokens, 1)
                        kl_loss = torch.zeros((), device=info.device)
                        if args.kl_placement == "loss" and ref_policy is not None:
                            # k3 per token, clamped to [0, 10] as in VinePPO
                            k3 = torch.clamp(kl_penalty(logp, ref_logp[idx], "k3", m_mask) * m_mask, 0, 10)
                            kl_loss = beta * k3.sum() / args.local_minibatch_size  # seq-sum, batch-mean
                            loss = loss + kl_loss
                        mean_ratio = ((ratio * m_mask).sum() / m_mask.sum().clamp(min=1)).item()
                        skip = mean_ratio > args.ratio_threshold  # a wildly off-policy micro-batch: no update
                        guard.backward(policy, loss * (0.0 if skip else 1.0))
                        norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                        grad_norms += [norm] if norm is not None else []
                        # critic: clipped value regression on the GAE returns
                        values = critic_values(critic, input_ids[idx], attn[idx])
                        vf, vclipped = value_loss(values, old_values[idx], returns[idx], args.cliprange_value)
                        guard.backward(critic, (vf * m_mask).sum() * info.world_size / max(global_tokens, 1))
                        norm = guard.step(critic)
                        critic_norms += [norm] if norm is not None else []
                        with torch.no_grad():  # masked token means for logging
                            n = m_mask.sum().clamp(min=1)
                            mm = lambda x: ((x * m_mask).sum() / n).item()  # noqa: E731
                            for k, v in {"loss/policy_avg": mm(pg), "loss/value_avg": mm(vf),
                                         "loss/kl_avg": kl_loss.item(), "policy/clipfrac_avg": mm(is_clipped),
                                         "policy/approxkl_avg": mm(0.5 * (logp - old_logp[idx]) ** 2),
                                         "val/clipfrac_avg": mm(vclipped), "val/ratio": mean_ratio,
                                         "val/ratio_var": mm((ratio - mean_ratio) ** 2), "val/skipped_frac": float(skip)}.items():
                                stats[k].append(v)

        # 7. weight sync: push the updated policy into the generation engine
        with timer("sync"):
            generator.wake_up()
            generator.sync_weights(full_named_parameters(policy, info))

        # 8. log (reduced over ranks once per step)
        ret_var = torch.var(returns[mask > 0]) if mask.sum() > 1 else torch.tensor(0.0)
        local = {k: sum(v) / len(v) for k, v in stats.items()}
        with torch.no_grad():  # the mismatch of the whole batch, before the update (docs/mismatch.md)
            w_step = tis_weights(old_logp, sampler_logp, mask, args.tis, args.tis_cap, args.tis_mask_low)
            w_raw = tis_weights(old_logp, sampler_logp, mask, args.tis, math.inf, 0.0)  # before truncation or mask
            local.update(mismatch_metrics(old_logp, sampler_logp, mask, w_step, w_raw))
        local.update({
            **completion_metrics(scores.tolist(), comps),  # objective/scores(_std), val/sequence_lengths, stop_rate
            "objective/kl": kl_k1.sum(1).mean().item(),
            "objective/non_score_reward": -(beta * kl_k1).sum(1).mean().item() if args.kl_placement == "reward"
            else 0.0,
            "objective/entropy": (entropy_sum / mask.sum(1).clamp(min=1)).mean().item(),
            "val/values_mean": (old_values.sum() / mask.sum()).item(),
            "val/explained_variance": (1 - torch.var((returns - old_values)[mask > 0]) / ret_var.clamp(min=1e-8)).item(),
            "optim/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "optim/critic_grad_norm": sum(critic_norms) / max(len(critic_norms), 1),
            **drca_metrics(units, credits, num_cf, raw_rewards, mask, args.reward_clip, info.world_size),
        })
        metrics = info.mean_over_ranks(local)
        if args.adaptive_kl:
            beta = adaptive_kl_update(beta, metrics["objective/kl"], args.kl_target, args.batch_size, args.kl_horizon)
        metrics["drca/sum_identity_err"] = max(info.gather_objects(identity_err))  # max over ranks
        metrics.update({"objective/rlhf_reward": metrics["objective/scores"] + metrics["objective/non_score_reward"],
                        "objective/kl_coef": beta, "lr": scheduler.get_last_lr()[0],
                        "episode": step * args.batch_size, "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
        # evaluation: the engine holds this step's weights (synced above)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"), ckpt.user_code(step, engines, tracker, trained=True, **resumable, beta=beta,
                                               first_eval=first_eval):
                metrics.update(evaluate(step))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, reward=metrics["objective/scores"], units=metrics["drca/units_per_seq"])
        if args.sample_every and step % args.sample_every == 0:
            tracker.log_samples([{"prompt": decode(prompts[i]), "completion": texts[i], "score": scores[i].item(),
                                  "units": [decode(responses[i][s:e]) for s, e in units[i]],
                                  "credits": [round(d, 4) for d in credits[i]], "finish_reason": comps[i].finish_reason}
                                 for i in range(0, args.local_batch_size, args.num_generations)][:8], step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, **resumable, beta=beta, first_eval=first_eval)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)

    with ckpt.user_code(args.num_steps, engines, tracker, trained=True, **resumable, beta=beta,
                        first_eval=first_eval):
        metrics = evaluate(args.num_steps)
    metrics["time/total"] = time.time() - start
    # output_dir/final and output_dir/critic (scripts/experiments/value_prediction.py), saved before the end-of-run checks
    final = save_final(policy, tokenizer, args.output_dir, info) if args.save_model else ""
    if args.save_model:
        save_hf(critic, tokenizer, os.path.join(args.output_dir, "critic"), info)
    metrics.update(check_ranks(policy, info, local_idx))
    metrics.update(check_engine(generator, policy, eval_data.prompt_ids[:4], info, args.max_new_tokens))
    tracker.log_end(metrics, args.num_steps, headline, first_eval)
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
