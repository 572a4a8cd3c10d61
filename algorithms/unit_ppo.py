"""Unit-level PPO: PPO for RLHF on dense rewards, a unit-level reward model read at every unit end. Docs: docs/unit_ppo.md

Yin et al. 2025, "Segmenting Text and Learning Their Rewards for Improved RLHF in Language Model"
(https://arxiv.org/abs/2501.02790; code yinyueqin/DenseRewardRLHF-PPO, the DRCA seed's fork npnike10/LearningSegmentRewards).
Each rollout is cut into units by unit_rm.py's rule (peak_unit_ends) on the entropies of the initial (SFT) policy at
its action positions; unit_rm.py's reward model is read at every unit end e_k, normalised by its location-aware
normaliser (unit_normalizer.json beside the checkpoint: mu(p) = a ln p + b, sigma(p) likewise) and spread over the unit.

Default objective (maximised):
    J(theta) = 1/sum_i |o_i| * sum_i sum_t min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)
    A = whiten(GAE_{gamma=1, lam=0.95}(r, V)), r_it = clip(rhat_k / L_k, -10, 10) - beta * k1_it for t in unit k of o_i,
    rhat_k = (v_k - mu(k/K)) / sigma(k/K), L_k = e_k - e_{k-1}, beta = 0.05; critic: ppo_rlhf.py's, from the SFT model

Delta from PPO for RLHF (algorithms/ppo_rlhf.py; `diff` the two files): dense per-unit rewards replace the score on the
last token (`--reward_placement`: segment_normalization, every_segment_last, same_segment_last, or segment_last_avg,
the bandit baseline: the mean of the globally normalised v_k on the last token); the critic starts from the SFT
model with a fresh head (the reference), not from the reward model; eval/reward is not computed (the unit RM has no
sequence score at EOS), so the headline is the grader's held-out accuracy.

Launch (the reward model is unit_rm.py's output_dir/final; tau must be the one it was trained with):
    python algorithms/unit_ppo.py                  # CPU, built-in task, builtin:tiny-unit-rm (a unit_rm.py run)
    python algorithms/unit_rm.py                   # your own unit RM, then:
    python algorithms/unit_ppo.py --reward_model_path runs/unit_rm/final
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/unit_ppo.py
    accelerate launch --config_file scripts/accelerate/zero3.yaml --num_processes 8 algorithms/unit_ppo.py \
        --model_name_or_path <sft model> --reward_model_path <unit_rm.py's output_dir/final> --tau 2 \
        --dataset <prompts.jsonl> --reward_fn none --chat_template --max_new_tokens 512 --learning_rate 3e-6
"""

from __future__ import annotations

import json
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
from shared.checkpoint import BestModel, Checkpointer, save_final, save_hf
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, enable_gradient_checkpointing,
                                full_named_parameters, init_distributed, load_causal_lm, load_reference,
                                load_tokenizer, prepare, seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, completion_metrics, make_generator
from shared.logprobs import forward_logprobs, fp32_lm_head
from shared.mismatch import mismatch_metrics
from shared.lora import add_lora, check_lora
from shared.prompts import load_prompt_task, task_summary
from shared.scalar import check_same_tokenizer, head, load_reward_model, load_scalar_model, normalized, token_values
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "unit_ppo"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/unit_ppo"
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
    reward_model_path: str = "builtin:tiny-unit-rm"
    """unit reward model: unit_rm.py's output_dir/final, with its unit_normalizer.json (`builtin:tiny-unit-rm`: a built-in one)"""
    critic_model_path: str = ""
    """initialise the critic from this checkpoint (default: the SFT policy with a fresh value head, as the reference code)"""
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
    tau: Annotated[float, Ge(0)] = 0.5
    """entropy threshold of the units (unit_rm.py's --tau; must be the reward model's: its normaliser records it)"""
    reward_placement: Literal["segment_normalization", "every_segment_last", "same_segment_last",
                              "segment_last_avg"] = "segment_normalization"
    """unit reward rhat_k on its tokens: / L_k on each, on its last, whole on each; segment_last_avg: bandit, last token"""
    reward_clip: Annotated[float, Gt(0)] = 10.0
    """per-token rewards are clipped to [-reward_clip, reward_clip] before the KL term (the reference: 10)"""
    total_episodes: Annotated[int, Ge(1)] = 51200
    """total completions to sample over the run (steps = total_episodes / batch_size)"""
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
    lam: Annotated[float, Interval(ge=0, le=1)] = 0.95
    """GAE lambda (TRL, summarize_from_feedback_details: 0.95)"""
    epsilon_low: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """lower clip range of PPO-clip: ratio >= 1 - epsilon_low"""
    epsilon_high: Annotated[float, Ge(0)] = 0.2
    """upper clip range: ratio <= 1 + epsilon_high"""
    cliprange_value: Annotated[float, Gt(0)] = 0.2
    """value clip range around the old values"""
    whiten_advantages: bool = True
    """normalise advantages to zero mean, unit variance over the whole batch (all ranks)"""
    kl_placement: Literal["reward", "loss"] = "reward"
    """`reward`: -beta * k1 on every token's reward (RLHF); `loss`: beta * k3 as a loss term (ppo.py)"""
    beta: Annotated[float, Ge(0)] = 0.05
    """KL coefficient (TRL's kl_coef: 0.05); 0 skips the reference model"""
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
    eval_every: Annotated[int, Ge(0)] = 25
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
    """log a table of sample completions every this many steps"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_prompts: tyro.conf.Suppress[int] = 0
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


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


BANDIT_TAU = 1000.0  # the reference's switch: one unit, read at EOS
NORMALIZER_FILE = "unit_normalizer.json"  # beside unit_rm.py's HF checkpoint


# unit_rm.py's segmentation rule, copied: the rollouts are cut as the reward model's training responses were
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


def gather_unit_values(values: torch.Tensor, prompt_lens: list[int], ends: list[list[int]]):
    """v_k = values[i, prompt_len_i + e_k] for each row i of a right-padded [N, L] batch: ([N, K_max], mask [N, K_max])."""
    k_max = max(len(e) for e in ends)
    index = torch.zeros(len(ends), k_max, dtype=torch.long, device=values.device)
    mask = torch.zeros(len(ends), k_max, dtype=values.dtype, device=values.device)
    for i, e in enumerate(ends):
        index[i, : len(e)] = torch.tensor([prompt_lens[i] + j for j in e], device=values.device)
        mask[i, : len(e)] = 1.0
    return values.gather(1, index) * mask, mask


def load_normalizer(path: str, tau: float, model: str) -> dict:
    """unit_rm.py's unit_normalizer.json in the reward model's directory, checked to be for this run's segmentation
    (peak units, tau, entropy model, mean aggregation): a ValueError naming the flag otherwise (the reference falls
    back to mu = 0, sigma = 1 without a word)."""
    file = os.path.join(path, NORMALIZER_FILE)
    if not os.path.exists(file):
        raise ValueError(f"reward_model_path: {path} has no {NORMALIZER_FILE} (train it with algorithms/unit_rm.py)")
    with open(file) as fh:
        norm = json.load(fh)
    for flag, want, key in (("tau", tau, "tau"), ("model_name_or_path", model, "model"),
                            ("reward_model_path", "avg", "aggregation"), ("reward_model_path", "peak", "method")):
        if norm.get(key) != want:
            raise ValueError(f"{flag}: the reward model's normaliser is for {key} {norm.get(key)!r}, not {want!r} "
                             f"({file})")
    return norm


def position_normalize(unit_values: list[float], norm: dict) -> list[float]:
    """rhat_k = (v_k - mu(k/K)) / sigma(k/K), mu(p) = a ln(p + 1e-10) + b (norm["mu"] = [a, b]), sigma likewise,
    floored at 1e-3 (a fitted line can cross 0)."""
    out = []
    for k, v in enumerate(unit_values, start=1):
        lp = math.log(k / len(unit_values) + 1e-10)
        mu, sigma = norm["mu"][0] * lp + norm["mu"][1], norm["sigma"][0] * lp + norm["sigma"][1]
        out.append((v - mu) / max(sigma, 1e-3))
    return out


def place_unit_rewards(unit_rewards: list[float], ends: list[int], n: int, placement: str) -> list[float]:
    """Per-action rewards of one completion of n actions from its units' rewards (unit k covers actions
    (e_{k-1}, e_k], e_0 = -1; the reference's `get_segment_rewards`):
      segment_normalization  r_k / L_k on each action of unit k (L_k = e_k - e_{k-1}): sums to sum_k r_k
      every_segment_last     r_k on e_k only: sums to sum_k r_k
      same_segment_last      r_k on each action of unit k: sums to sum_k L_k r_k
      segment_last_avg       mean_k r_k on the last action (n - 1): the bandit reward
    Actions after the last unit (EOS) get 0, except segment_last_avg's."""
    out = [0.0] * n
    if placement == "segment_last_avg":
        out[n - 1] = sum(unit_rewards) / len(unit_rewards)
        return out
    prev = -1
    for r, e in zip(unit_rewards, ends):
        length = e - prev
        if placement == "every_segment_last":
            out[e] = r
        else:
            for j in range(prev + 1, e + 1):
                out[j] = r / length if placement == "segment_normalization" else r
        prev = e
    return out


def rollout_unit_values(reward_model, entropy_model, input_ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
                        prompts: list[list[int]], responses: list[list[int]], tau: float, micro_batch_size: int):
    """Each completion's unit ends (peak_unit_ends on entropy_model's entropies at its action positions; without an
    entropy model one unit at its last token) and the reward model's value v_k at each end, micro-batch by micro-batch
    over the padded batch (input_ids / attn / resp as data_utils.pad_batch builds them): (ends, values) as lists."""
    ends, unit_v = [], []
    with torch.no_grad():
        for s in range(0, len(responses), micro_batch_size):
            sl = slice(s, s + micro_batch_size)
            if entropy_model is not None:
                ent = forward_logprobs(entropy_model, input_ids[sl], attn[sl], resp[sl], 1.0, True)[1]
                # position j's entropy (predicting token j + 1) is entry j + 1 of the response's entropies;
                # a completion of EOS alone has no unit: it is read at its one token, as the bandit
                e = [peak_unit_ends(ent[j, len(prompts[s + j]) : len(prompts[s + j]) - 1 + len(r)].tolist() + [0.0],
                                    tau) or [len(r) - 1] for j, r in enumerate(responses[sl])]
            else:
                e = [[len(r) - 1] for r in responses[sl]]
            v, _ = gather_unit_values(token_values(reward_model, input_ids[sl], attn[sl]),
                                      [len(p) for p in prompts[sl]], e)
            ends += e
            unit_v += [v[j, : len(e[j])].tolist() for j in range(len(e))]
    return ends, unit_v


def normalize_units(unit_values: list[list[float]], norm: dict, reward_model, bandit: bool) -> list[list[float]]:
    """Each completion's rhat_k: position_normalize by the location-aware normaliser, or for the bandit baseline
    (segment_last_avg) v_k normalised by the reward model's stored reward_mean / reward_std (unset: 0 and 1)."""
    if not bandit:
        return [position_normalize(v, norm) for v in unit_values]
    cfg = getattr(reward_model, "module", reward_model).config
    mu, sd = cfg.reward_mean or 0.0, cfg.reward_std or 1.0
    return [[(x - mu) / sd for x in v] for v in unit_values]


def dense_unit_rewards(unit_rewards: list[list[float]], ends: list[list[int]], first: list[int], lengths: list[int],
                       finished: list[bool], mask: torch.Tensor, placement: str, penalty_reward_value: float,
                       reward_clip: float) -> torch.Tensor:
    """Per-action rewards like `mask` [B, T]: completion i's place_unit_rewards from column first[i] (its first
    action; position t predicts token t + 1) over its lengths[i] actions; a completion not `finished` gets only
    penalty_reward_value on its last action (--non_stop_penalty); clipped to +-reward_clip, 0 outside the mask."""
    dense = torch.zeros_like(mask)
    for i, (r, e) in enumerate(zip(unit_rewards, ends)):
        row = place_unit_rewards(r, e, lengths[i], placement)
        if not finished[i]:
            row = [0.0] * (len(row) - 1) + [penalty_reward_value]
        dense[i, first[i] : first[i] + len(row)] = torch.tensor(row, device=mask.device)
    return dense.clamp(-reward_clip, reward_clip) * mask


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


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.adaptive_kl and args.beta == 0:
        raise ValueError("adaptive_kl: needs beta > 0 to adapt")
    if args.reward_fn == "none":
        raise ValueError("reward_fn: unit_ppo.py's evaluation needs a grader (the unit RM gives no sequence score)")


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    validate(args)
    info = init_distributed()
    derive_sizes(args, info.world_size)  # batch_size, local_minibatch_size, num_steps, ... (shared/cli.py)

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for init and data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: validated before anything is written (a bad row, model path or reward function stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    rm_path = resolve_model_path(args.reward_model_path, "reward_model_path")
    normalizer = load_normalizer(rm_path, args.tau, args.model_name_or_path)  # for this tau and this SFT model
    critic_path = resolve_model_path(args.critic_model_path, "critic_model_path") if args.critic_model_path else ""
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    check_same_tokenizer(rm_path, tokenizer)
    # train / held-out / dev prompts and the grader (None with --reward_fn none: no accuracy, best/ by dev/reward)
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, rm_path,
                                                                  graded=False if args.reward_fn == "none" else None)
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headline = "eval/accuracy"  # printed at start and end: the grader's held-out accuracy

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.top_p < 1.0:
        tracker.write("warning: top_p < 1 makes the trainer's log-probs differ from the sampler's")
    tracker.write(task_summary(train_data, eval_data, dev_data, args.num_steps, args.batch_size) + "; scored by "
                  f"{args.reward_model_path}")

    # models and optimizers: policy, critic (own optimizer), frozen reference and reward model
    dtype = default_dtype(info.device)
    schedule = lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps))  # noqa: E731
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    policy = add_lora(policy, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
    policy, optimizer, scheduler = prepare(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                           info, args.local_micro_batch_size, args.gradient_accumulation_steps,
                                           args.max_grad_norm, dtype)
    critic_path = critic_path or model_path  # the SFT model with a fresh head (the reference's critic)
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
    # the reference (the SFT policy) gives the KL term and the entropies that cut units; LoRA: the policy, adapters off
    use_ref = args.beta > 0 or args.tau != BANDIT_TAU
    ref_policy = load_reference(policy, model_path, dtype, info, bool(args.lora_r)) if use_ref else None
    fp32_lm_head([policy, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
    reward_model = load_reward_model(rm_path, tokenizer, info, dtype)  # frozen; read at every unit end
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

    def evaluate(step: int) -> dict:  # grader accuracy, pass@k, RM score on eval and dev (shared/evaluation.py)
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed), reward_model=None,
                                    pad_id=tokenizer.pad_token_id, micro_batch_size=args.local_micro_batch_size)
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
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, [c.token_ids for c in comps], tokenizer.pad_token_id,
                                                     info.device)
        mask = resp[:, 1:].float()  # position t predicts token t+1: 1 on completion tokens, EOS included
        sampler_logp = data_utils.sampler_logprobs([len(p) for p in prompts], [c.logprobs for c in comps], mask)

        # 2. dense rewards: units at the SFT policy's entropy peaks, the RM read at each unit end, normalised by the
        # unit's position and spread over its actions (--reward_placement)
        with timer("reward"):
            texts, responses = [decode(c.token_ids) for c in comps], [c.token_ids for c in comps]
            ends, unit_v = rollout_unit_values(reward_model, ref_policy if args.tau != BANDIT_TAU else None, input_ids,
                                               attn, resp, prompts, responses, args.tau, args.local_micro_batch_size)
            unit_r = normalize_units(unit_v, normalizer, reward_model, args.reward_placement == "segment_last_avg")
            dense = dense_unit_rewards(unit_r, ends, [len(p) - 1 for p in prompts], [len(r) for r in responses],
                                       [c.finished or not args.non_stop_penalty for c in comps], mask,
                                       args.reward_placement, args.penalty_reward_value, args.reward_clip)
            scores = dense.sum(1)  # each completion's total reward before the KL term (logged)

        # 3. log-probs and values before the update (no grad): old policy, reference, critic
        old_logp, ref_logp, old_values = torch.zeros_like(mask), torch.zeros_like(mask), torch.zeros_like(mask)
        entropy_sum = torch.zeros(args.local_batch_size, device=info.device)
        with timer("logprob"), torch.no_grad():
            for s in range(0, args.local_batch_size, args.local_micro_batch_size):
                sl = slice(s, s + args.local_micro_batch_size)
                old_logp[sl], ent = forward_logprobs(policy, input_ids[sl], attn[sl], resp[sl], args.temperature, True)
                entropy_sum[sl] = (ent * mask[sl]).sum(1)
                if ref_policy is not None:
                    ref_logp[sl] = forward_logprobs(ref_policy, input_ids[sl], attn[sl], resp[sl], args.temperature)[0]
                old_values[sl] = critic_values(critic, input_ids[sl], attn[sl])
        old_values = old_values * mask

        # 4. rewards: the dense unit rewards, minus beta * k1 per token when the KL is in the reward
        kl_k1 = kl_penalty(old_logp, ref_logp, "k1") * mask if ref_policy is not None else torch.zeros_like(mask)
        rewards = dense
        if args.kl_placement == "reward":
            rewards = rewards - beta * kl_k1

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
            "objective/units": sum(len(e) for e in ends) / len(ends),
            "objective/kl": kl_k1.sum(1).mean().item(),
            "objective/non_score_reward": -(beta * kl_k1).sum(1).mean().item() if args.kl_placement == "reward"
            else 0.0,
            "objective/entropy": (entropy_sum / mask.sum(1).clamp(min=1)).mean().item(),
            "val/values_mean": (old_values.sum() / mask.sum()).item(),
            "val/explained_variance": (1 - torch.var((returns - old_values)[mask > 0]) / ret_var.clamp(min=1e-8)).item(),
            "optim/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "optim/critic_grad_norm": sum(critic_norms) / max(len(critic_norms), 1),
        })
        metrics = info.mean_over_ranks(local)
        if args.adaptive_kl:
            beta = adaptive_kl_update(beta, metrics["objective/kl"], args.kl_target, args.batch_size, args.kl_horizon)
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
        tracker.progress(1, reward=metrics["objective/scores"])  # and the last held-out accuracy
        if args.sample_every and step % args.sample_every == 0:
            tracker.log_samples([{"prompt": decode(prompts[i]), "completion": texts[i], "score": scores[i].item(),
                                  "finish_reason": comps[i].finish_reason}
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
