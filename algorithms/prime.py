"""PRIME: RL with implicit process rewards from a PRM trained online on outcome labels. Docs: docs/prime.md

Paper: Cui et al. 2025, "Process Reinforcement through Implicit Rewards" (https://arxiv.org/abs/2502.01456); code:
verl's recipe/prime. The implicit PRM pi_phi (init: the start model) and its frozen reference pi_ref give completion
token t the process reward beta * q_t, q_t = log pi_phi(y_t) - log pi_ref(y_t) (0 on the last token). On each batch
pi_phi takes --prm_num_minibatches steps (1; verl's recipe: 4) of BCE(sigmoid(beta * sum_t q_t), acc) on the grader's
0/1 outcome acc, then scores the batch (`--prm_update before`, verl) or the steps' own forwards score it (`after`).

Default objective (maximised): grpo.py's PPO-clip with token advantages (verl `compute_rloo_advantage_return`)
    A_it = whiten(sum_{s>=t} R_is),  R = c_p * rloo(r / max_{j,s} |sum_{u>=s} r_ju|) + c_o * rloo(acc at the last token)
    rloo(x)_it = x_it * n / (n - 1) - sum_j mean_t(x_jt) / (n - 1) over the group's n completions;  c_p = c_o = 5
    J(theta) = 1/sum_i |o_i| * sum_i sum_t w_it * min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)

Delta from GRPO (algorithms/grpo.py): a second trained model (the PRM, own AdamW) and its frozen reference; token
advantages from RLOO on both reward sources; verl's accuracy filter: oversample_factor times the prompts are sampled,
groups with accuracy in [accuracy_lower, accuracy_upper] and no truncated completion are trained first, failing ones
fill the batch only when too few pass. grpo.py's --policy_loss (CISPO, DPPO, SAPO), GSPO, --mask_truncated_completions,
TIS and LoRA (on the policy; the PRM trains every weight) work as there; its advantage estimators and
--reward_model_path do not apply (the advantage is PRIME's RLOO; the PRM is the reward model). The PRM's optimizer:
--prm_num_minibatches steps per batch, clipped at --prm_max_grad_norm (defaults 1 and 1.0; verl's recipe: 4 and 10).
Defaults: grpo.py's, with oversample_factor 2 (verl: 4): on CPU an update costs more than sampling, so sampling twice
the prompts and training on the half whose groups carry an outcome signal keeps a run about as long as grpo.py's at
the same number of generated samples (total_episodes counts every generated sample); n = 8 as grpo.py.

Launch:
    python algorithms/prime.py                                 # CPU, built-in task, tiny model
    python algorithms/prime.py --prm_update after              # score with the PRM step's own forward
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/prime.py   # several processes
    accelerate launch --config_file scripts/accelerate/zero3.yaml algorithms/prime.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --chat_template --dataset openai/gsm8k:main \
        --prompt_key question --answer_key answer --reward_fn gsm8k --max_new_tokens 512 --learning_rate 5e-7 \
        --prm_learning_rate 1e-6 --num_generations 4 --oversample_factor 4 --max_prompt_length 512 \
        --prm_num_minibatches 4 --prm_max_grad_norm 10 \
        --prompt_template "{prompt}\nSolve step by step. End with a line '#### <answer>'."
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_final, save_hf
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, full_named_parameters, init_distributed,
                                load_causal_lm, load_reference, load_tokenizer, prepare, prepare_frozen,
                                seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, completion_metrics, make_generator
from shared.logprobs import batch_logprobs, check_packing, fp32_lm_head, micro_batch_logprobs
from shared.mismatch import mismatch_metrics
from shared.lora import add_lora, check_lora
from shared.prompts import load_prompt_task, task_summary
from shared.rewards import check_labels, probe_reward_fn, score_completions
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "prime"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/prime"
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
    """column of the gold answer given to the grader (the 0/1 outcome that trains the PRM)"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced (VinePPO: `[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:`)"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function` / `file.py:function`"""
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
    """LoRA rank: train rank-r adapters on the policy, frozen otherwise (0: off, every weight trains)"""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA alpha: the adapters' update B A is scaled by lora_alpha / lora_r"""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input in training forwards (0 keeps log-probs deterministic)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: `all-linear` (attention and MLP linears, not the output head) or names (`q_proj,v_proj`)"""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """how vLLM gets a LoRA policy: merged weights (`merged`) or the adapter alone, served by vLLM's LoRA (`adapter`); docs/lora.md"""
    save_model: bool = True
    """save the final policy (output_dir/final) and the implicit PRM (output_dir/prm) as HF checkpoints"""

    # reliability (shared/checkpoint.py; docs/grpo.md#reliability)
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
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 102400
    """total completions to sample over the run, filtered ones included (steps = total_episodes / generated per step)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """AdamW learning rate (constant after warm-up)"""
    warmup_steps: Annotated[int, Ge(0)] = 5
    """linear learning-rate warm-up steps"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    num_generations: Annotated[int, Ge(1)] = 8
    """n: completions per prompt (the group of the leave-one-out baselines); must be > 1"""
    local_num_prompts: Annotated[int, Ge(1)] = 64
    """trained prompts per rank per step (local_batch_size = local_num_prompts * num_generations completions)"""
    oversample_factor: Annotated[int, Ge(1)] = 2
    """prompts sampled per trained prompt; the accuracy filter keeps local_num_prompts groups of them (verl: 4)"""
    accuracy_lower: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """a group passes the filter when its mean accuracy is >= this (verl `accuracy_lower_bound`)"""
    accuracy_upper: Annotated[float, Interval(ge=0, le=1)] = 0.8
    """... and <= this (verl `accuracy_upper_bound`)"""
    filter_truncated: bool = True
    """a group with a completion that hit max_new_tokens fails the filter (verl `filter_truncate`)"""
    prm_learning_rate: Annotated[float, Gt(0)] = 5e-4
    """AdamW learning rate of the implicit PRM (own optimizer; implicit_prm.py's default; verl at 7B: 1e-6, policy 5e-7)"""
    prm_beta: Annotated[float, Gt(0)] = 0.05
    """beta of the PRM: r_t = beta * (log pi_phi - log pi_ref) and its CE loss (verl `beta_train`)"""
    prm_num_minibatches: Annotated[int, Ge(1)] = 1
    """PRM optimizer steps per batch, on consecutive slices of it (verl's recipe: 4, reward_model.mini_batch_size 64 of 256)"""
    prm_max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm of the PRM (verl's recipe: 10, reward_model.model.optim.grad_clip)"""
    prm_update: Literal["before", "after"] = "before"
    """`before`: update the PRM on the batch, then score it (verl); `after`: rewards from the update's own forward"""
    reward_dpo_coef: Annotated[float, Ge(0)] = 5.0
    """c_p: weight of the process-reward RLOO term (verl `dpo_coef`)"""
    reward_gt_coef: Annotated[float, Ge(0)] = 5.0
    """c_o: weight of the outcome RLOO term (verl `gt_coef`)"""
    num_minibatches: Annotated[int, Ge(1)] = 2
    """optimizer steps per pass over the batch"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """completions per forward/backward on each rank (HF `per_device_train_batch_size`); memory: docs/performance.md"""
    micro_batching: Literal["padded", "sorted", "packed"] = "padded"
    """rows of a forward: `padded` (to the batch's longest), `sorted` (by length) or `packed` (several per row); docs/grpo.md"""
    num_iterations: Annotated[int, Ge(1)] = 2
    """mu: passes over each batch; >1 reuses samples with the clipped ratio against the sampling-time log-probs"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature; trainer logits are divided by it too"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling; <1 makes the trainer's log-probs differ from the sampler's"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it are 'truncated' (reward 0 from the graders)"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    loss_aggregation: Literal["seq_mean", "token_mean", "global_token", "constant"] = "global_token"
    """`seq_mean` (GRPO) | `token_mean` (per rank) | `global_token` (DAPO, all ranks) | `constant` (Dr. GRPO)"""
    epsilon_low: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """lower clip range of PPO-clip: ratio >= 1 - epsilon_low (1: no lower bound; CISPO has none)"""
    epsilon_high: Annotated[float, Ge(0)] = 0.28
    """upper clip range: ratio <= 1 + epsilon_high (clip-higher, DAPO)"""
    importance_level: Literal["token", "sequence"] = "token"
    """importance ratio per `token` (PPO, GRPO) or per `sequence`: exp(mean log ratio), clipped once (GSPO; docs/grpo.md)"""
    policy_loss: Literal["clip", "cispo", "dppo_tv", "dppo_kl", "sapo"] = "clip"
    """`clip` PPO-clip; `cispo` -sg(min(ratio, 1+eps_high)) A log pi; `dppo_*` masked -ratio A; `sapo` a soft gate"""
    sapo_temperature_pos: Annotated[float, Gt(0)] = 1.0
    """`sapo`: the gate's temperature on tokens with advantage > 0 (TRL's default)"""
    sapo_temperature_neg: Annotated[float, Gt(0)] = 1.05
    """`sapo`: the gate's temperature on tokens with advantage <= 0 (TRL's default)"""
    beta: Annotated[float, Ge(0)] = 0.0
    """KL loss coefficient; 0 skips the reference model entirely"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator in the loss: `k1` (log ratio), `k2` (half squared log ratio), `k3` (exp(-d)-1+d)"""
    use_bias_correction_kl: bool = False
    """weight the KL term by the importance ratio pi / pi_old (DeepSeek-V3.2's unbiased estimate; with --beta > 0)"""
    off_policy_mask_threshold: Annotated[float, Ge(0)] | None = None
    """drop completions with A < 0 whose mean log(pi_sampler / pi) exceeds this (DeepSeek-V3.2's delta); None: off"""
    mask_truncated_completions: bool = False
    """exclude completions that hit max_new_tokens from the loss (DAPO overlong filtering)"""
    tis: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"] = \
        "token_truncate"
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
    generated_batch_size: tyro.conf.Suppress[int] = 0
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: algorithm-local pure functions
def filter_groups(acc: torch.Tensor, truncated: torch.Tensor, lower: float, upper: float,
                  keep: int) -> tuple[list[int], list[bool]]:
    """The `keep` groups to train on, of acc [P, n] (0/1) and truncated [P, n] (verl `filter_and_downsample`), and
    which groups pass: a group fails when its mean accuracy is outside [lower, upper] or one of its completions hit
    the length limit; passing groups first, then failing ones only to fill the batch, each in sampling order (a
    stable sort; verl's argsort is not stable)."""
    mean = acc.float().mean(1)
    passing = ((mean >= lower) & (mean <= upper) & ~truncated.any(1)).tolist()
    return sorted(range(acc.shape[0]), key=lambda p: not passing[p])[:keep], passing


def implicit_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q_t = log pi_phi(y_t) - log pi_ref(y_t) on completion tokens, 0 elsewhere [B, T]: the implicit PRM's token
    rewards before beta; beta * sum_t q_t = beta log pi_phi(y) / pi_ref(y) is its outcome reward r_phi(y)."""
    return (logp - ref_logp) * mask


def prm_ce_loss(q: torch.Tensor, acc: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """The implicit PRM's cross-entropy BCE(sigmoid(beta * sum_t q_t), acc), mean over the rows (verl
    `compute_ce_dpo_loss_rm`; ImplicitPRM's `CETrainer.loss_fn`), computed from the logit for stability."""
    return F.binary_cross_entropy_with_logits(beta * (q * mask).sum(1), acc.float())


def process_rewards(q: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Token rewards beta * q_t on every completion token except the last one, which gets 0 (verl
    `_forward_micro_batch`: `token_level_score[i, :max_positions - 1]`; the outcome reward sits there)."""
    keep = mask.clone()
    keep[torch.arange(mask.shape[0]), (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)] = 0
    return beta * q * keep


def reward_scale(rewards: torch.Tensor) -> torch.Tensor:
    """max_{i,t} |sum_{s>=t} r_is|: the batch_norm divisor of the token rewards (verl `prime_norm`, + 1e-6 there)."""
    return rewards.flip(1).cumsum(1).flip(1).abs().max()


def masked_rloo(rewards: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """verl's `masked_rloo` on rows grouped n at a time: with m_j the mean of row j's masked rewards, every masked
    r_it becomes r_it * n / (n - 1) - sum_j m_j / (n - 1) (sum over the group); unmasked entries 0. For one reward per
    row this is r_i - mean_{j != i} r_j, the leave-one-out baseline."""
    m = mask.bool()
    r = torch.where(m, rewards, torch.zeros_like(rewards))
    means = r.sum(1) / m.sum(1).clamp(min=1)  # [B]
    group_sum = means.view(-1, n).sum(1).repeat_interleave(n)[:, None]
    return torch.where(m, r * n / (n - 1) - group_sum / (n - 1), torch.zeros_like(r))


def prime_returns(token_rewards: torch.Tensor, acc: torch.Tensor, mask: torch.Tensor, n: int, coef_process: float,
                  coef_outcome: float) -> torch.Tensor:
    """Returns G_it = sum_{s>=t} R_is of verl's `compute_rloo_advantage_return`, R = c_p * masked_rloo(process
    rewards, completion mask) + c_o * masked_rloo(acc on the last completion token, that token only); A is these
    returns whitened over the batch (masked_whiten, all ranks)."""
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)
    rows = torch.arange(mask.shape[0], device=mask.device)
    outcome, outcome_mask = torch.zeros_like(mask), torch.zeros_like(mask)
    outcome[rows, last], outcome_mask[rows, last] = acc.float().to(mask.device), 1.0
    total = coef_process * masked_rloo(token_rewards, mask, n) + coef_outcome * masked_rloo(outcome, outcome_mask, n)
    return (total * mask).flip(1).cumsum(1).flip(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8) on masked entries, var Bessel-corrected (verl `masked_whiten`, unbiased);
    sums = (sum x m, sum x^2 m, sum m), e.g. all-reduced over ranks; default: this batch's."""
    if sums is None:
        sums = torch.stack([(x * mask).sum(), (x**2 * mask).sum(), mask.sum()]).double()
    mean = sums[0] / sums[2]
    var = (sums[1] / sums[2] - mean**2) * sums[2] / (sums[2] - 1)
    return ((x - mean.float()) * torch.rsqrt(var.float() + 1e-8)) * mask


def dpo_accuracy(q: torch.Tensor, acc: torch.Tensor, mask: torch.Tensor, n: int) -> float:
    """verl `compute_dpo_accuracy`: per group, the pairs whose PRM scores sum_t q_t order as their accuracies,
    weighted by |acc_i - acc_j|; 0.5 for a group with no label difference; mean over groups."""
    iu, out = torch.triu_indices(n, n, 1), []
    for s, a in zip((q * mask).sum(1).view(-1, n), acc.float().view(-1, n)):
        ds, da = (s[:, None] - s[None])[iu[0], iu[1]], (a[:, None] - a[None])[iu[0], iu[1]]
        w = da.abs().sum().item()
        out.append(0.5 if w == 0 else (((ds > 0) == (da > 0)).float() * da.abs()).sum().item() / w)
    return sum(out) / len(out)


def update_prm(prm, guard, prm_ref_logp: torch.Tensor, input_ids: torch.Tensor, attn: torch.Tensor,
               resp: torch.Tensor, lengths: list[int], mask: torch.Tensor, acc: torch.Tensor, beta: float,
               num_micro_batches: int, layout: str, order: str,
               num_minibatches: int = 1) -> tuple[torch.Tensor, float, float | None]:
    """num_minibatches optimizer steps of the implicit PRM on this batch, one per consecutive slice of B /
    num_minibatches rows (verl's `update_rm`: batch.split(mini_batch_size)), each the CE loss's mean over its slice in
    num_micro_batches / num_minibatches micro-batches, and the batch's token rewards q [B, T] before beta, detached:
    from the steps' own forwards, i.e. each slice scored by the PRM before its step (`after`), or from a forward of
    the updated PRM (`before`, verl's default). Returns (q, mean loss of the steps, last gradient norm)."""
    q = torch.zeros_like(mask)
    loss_sum, norm = 0.0, None
    size = mask.shape[0] // num_minibatches
    for mb in range(num_minibatches):
        rows = list(range(mb * size, (mb + 1) * size))
        for idx in data_utils.micro_batches(rows, lengths, num_micro_batches // num_minibatches, layout):
            logp = micro_batch_logprobs(prm, input_ids[idx], attn[idx], resp[idx], layout, 1.0)[0]
            q_mb = implicit_rewards(logp, prm_ref_logp[idx], mask[idx])
            loss = prm_ce_loss(q_mb, acc[idx], mask[idx], beta) * len(idx) / size
            guard.backward(prm, loss)
            norm = guard.step(prm)
            q[idx] = q_mb.detach()
            loss_sum += loss.item() / num_minibatches
    if order == "before":
        logp = batch_logprobs([prm], input_ids, attn, resp, lengths, num_micro_batches, layout, 1.0)[0]
        q = implicit_rewards(logp, prm_ref_logp, mask)
    return q, loss_sum, norm


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


def log_importance_ratio(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor | None = None,
                         level: str = "token") -> torch.Tensor:
    """log of the importance ratio pi_theta / pi_old on every token, [B, T], masked before any exp (padding: 0).
    token:    log rho_{i,t} = log pi(y_t) - log pi_old(y_t)                                   PPO, GRPO
    sequence: log s_i = (1/|y_i|) sum_t log rho_{i,t} on every token of completion i: GSPO's length-normalised ratio
              (Zheng et al. 2025, arXiv 2507.18071, §4.1), equal in value and gradient to GSPO-token (§4.3) with
              one advantage per completion, as here (tests/test_grpo.py)."""
    log_ratio = logp - logp_old if mask is None else (logp - logp_old) * mask
    if level == "token":
        return log_ratio
    if level == "sequence":
        m = torch.ones_like(log_ratio) if mask is None else mask
        log_s = log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
        return log_s * m  # broadcast to the completion's tokens; padding keeps ratio 1
    raise ValueError(f"importance_level: expected token or sequence, got {level!r}")


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float, mask: torch.Tensor | None = None, level: str = "token"):
    """PPO-clip per-token loss -min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) and the clipped-token indicator.
    level="sequence": rho is GSPO's s_i, clipped once per completion (GSPO's Eq. 5 with --loss_aggregation seq_mean).
    The log-ratio is masked before exp: padding has rho = 1, never inf (inf * 0 = NaN in the masked sum)."""
    ratio = torch.exp(log_importance_ratio(logp, logp_old, mask, level))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    return loss, is_clipped.float(), ratio


def cispo_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, eps_high: float,
                    mask: torch.Tensor | None = None, level: str = "token"):
    """CISPO per-token loss -sg(min(rho, 1+eps_high)) * A * log pi (MiniMax-M1, arXiv 2506.13585, §3.1) and the
    indicator of tokens whose weight was truncated. The weight is detached: every token keeps the gradient
    -w A grad log pi, also where PPO-clip would zero it. No lower bound (MiniMax-M1 sets none; ScaleRL's CISPO,
    arXiv 2510.13786, truncates at 5: --epsilon_high 4), so --epsilon_low does not apply. The loss value contains
    log pi and is not an objective."""
    ratio = torch.exp(log_importance_ratio(logp, logp_old, mask, level))
    weight = ratio.clamp(max=1 + eps_high).detach()  # sg(r_hat): no gradient through the weight
    loss = -weight * advantages * (logp if mask is None else logp * mask)
    is_clipped = ratio > 1 + eps_high
    return loss, is_clipped.float(), ratio


def dppo_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, logp_sampler: torch.Tensor, advantages: torch.Tensor,
                   eps_low: float, eps_high: float, divergence: str, mask: torch.Tensor | None = None):
    """DPPO per-token loss -M * rho * A (arXiv 2602.04879) and the indicator of masked tokens: no ratio clipping;
    M = 0 on a token whose p = pi(y_t) left the trust region around the sampler's p_s = pi_sampler(y_t) (the anchor
    of the paper's Sec. 5.2, verl, prime-rl and TRL) in the direction its advantage pushes (A > 0: up, eps_high):
      tv: |p - p_s| > eps                                              (verl `dppo_tv`)
      kl: p_s log(p_s / p) + (1 - p_s) log((1 - p_s) / (1 - p)) > eps, the binary KL (verl `dppo_kl`)
    (A < 0: down, eps_low). rho = pi / pi_old (the --tis weight carries pi_old / pi_sampler); the mask is detached,
    kept tokens get the unclipped gradient -A grad rho."""
    log_ratio = logp - logp_old if mask is None else (logp - logp_old) * mask
    ratio = torch.exp(log_ratio)
    p, p_s = torch.exp(logp.detach()), torch.exp(logp_sampler)
    if divergence == "tv":
        out_up, out_down = p - p_s > eps_high, p - p_s < -eps_low
    elif divergence == "kl":
        kl = p_s * (logp_sampler - logp.detach()) + (1 - p_s) * torch.log((1 - p_s + 1e-8) / (1 - p + 1e-8))
        out_up, out_down = (kl > eps_high) & (p > p_s), (kl > eps_low) & (p < p_s)
    else:
        raise ValueError(f"policy_loss: expected dppo_tv or dppo_kl, got dppo_{divergence}")
    masked = torch.where(advantages > 0, out_up, (advantages < 0) & out_down)
    return -ratio * advantages * (~masked), masked.float(), ratio


def sapo_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, tau_pos: float,
                   tau_neg: float, mask: torch.Tensor | None = None, level: str = "token"):
    """SAPO per-token loss -f(rho) * A, the soft gate f(rho) = (4 / tau) sigmoid(tau (rho - 1)) in place of the clip
    (Gao et al. 2025, arXiv 2511.20347; TRL's `sapo`), tau = tau_pos where A > 0, else tau_neg; and the
    indicator of tokens whose gradient weight f'(rho) = 4 sigmoid (1 - sigmoid) fell below 1/2. On-policy (rho = 1)
    the weight is 1, the plain policy gradient; it decays smoothly as rho leaves 1, faster for the larger tau."""
    ratio = torch.exp(log_importance_ratio(logp, logp_old, mask, level))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = -(4 / tau) * gate * advantages
    return loss, (4 * gate * (1 - gate) < 0.5).float(), ratio


def off_policy_sequence_mask(logp: torch.Tensor, logp_sampler: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, Eq. 9; TRL's `off_policy_mask_threshold`), [B, T]
    and detached: 0 on every token of a completion with a negative advantage whose mean over its tokens of
    log pi_sampler - log pi (pi: the policy being trained) exceeds delta, 1 elsewhere."""
    d = (logp_sampler - logp.detach()) * mask
    mean_kl = d.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return ((advantages >= 0) | (mean_kl <= delta)).to(mask.dtype)


def unbiased_kl(kl: torch.Tensor, logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor | None = None,
                level: str = "token") -> torch.Tensor:
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556; TRL's `use_bias_correction_kl`): the per-token
    estimate weighted by the importance ratio pi / pi_old at --importance_level, not detached (as TRL)."""
    return kl * torch.exp(log_importance_ratio(logp, logp_old, mask, level))


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


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, num_seqs: int, num_tokens: int,
                   num_tokens_global: int, world_size: int, max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the optimizer-step loss; num_seqs / num_tokens count the whole optimizer step on
    this rank, num_tokens_global on all ranks. Summed over micro-batches and averaged over ranks (as DeepSpeed does
    with gradients) this gives:
      seq_mean:     (1/B) sum_i [sum_t l m / sum_t m]         GRPO; a 1/|o_i| weight per token (length bias)
      token_mean:   (1/ranks) sum_ranks [sum l m / tokens on that rank]
      global_token: sum l m / tokens of the step on all ranks  DAPO; split-invariant across GA and ranks
      constant:     sum l m / (B * max_new_tokens)             Dr. GRPO"""
    if mode == "seq_mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    if mode == "token_mean":
        return (loss * mask).sum() / max(num_tokens, 1)
    if mode == "global_token":
        return (loss * mask).sum() * world_size / max(num_tokens_global, 1)
    if mode == "constant":
        return (loss * mask).sum() / (num_seqs * max_new_tokens)
    raise ValueError(f"loss_aggregation: expected seq_mean, token_mean, global_token or constant, got {mode!r}")


def completion_mask(response_mask: torch.Tensor, finished: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """[B, L-1] loss mask aligned with forward_logprobs (position t predicts token t+1): 1 on completion tokens,
    EOS included; rows of truncated completions (no EOS) are zeroed when mask_truncated (DAPO overlong filter)."""
    mask = response_mask[:, 1:].float()
    if mask_truncated:
        mask = mask * finished.float().to(mask.device)[:, None]
    return mask


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.num_generations < 2:
        raise ValueError("num_generations: PRIME needs at least 2 completions per prompt (leave-one-out baselines)")
    if args.accuracy_lower > args.accuracy_upper:
        raise ValueError(f"accuracy_lower: {args.accuracy_lower} is above accuracy_upper ({args.accuracy_upper})")
    if args.policy_loss.startswith("dppo") and args.importance_level != "token":
        raise ValueError("importance_level: dppo_tv and dppo_kl mask single tokens (use --importance_level token)")


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    validate(args)
    info = init_distributed()
    derive_sizes(args, info.world_size)  # batch_size, local_minibatch_size, num_steps, ... (shared/cli.py)
    args.generated_batch_size = args.batch_size * args.oversample_factor  # every sampled completion is counted
    args.num_steps = args.total_episodes // args.generated_batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one step's samples "
                         f"({args.generated_batch_size})")
    if (args.local_batch_size // args.local_micro_batch_size) % args.prm_num_minibatches:
        raise ValueError(f"prm_num_minibatches: {args.prm_num_minibatches} does not divide the "
                         f"{args.local_batch_size // args.local_micro_batch_size} micro-batches of a rank's batch")

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for init and data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: validated before anything is written (a bad row, model path or reward function stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    # train / held-out / dev prompts and the grader (its 0/1 outcome is the PRM's label and the outcome reward)
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, "")
    check_labels(probe_reward_fn(reward_fn, train_data.rows), reward_fn)  # the PRM's labels must be 0 or 1
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headline = "eval/accuracy"  # the held-out number printed at start and end

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.top_p < 1.0:  # with --tis none only (shared/cli.py)
        tracker.write("warning: top_p < 1 makes the trainer's log-probs differ from the sampler's; "
                      "val/sampler_kl and the TIS ratios show how much")
    tracker.write(task_summary(train_data, eval_data, dev_data, args.num_steps, args.batch_size))
    tracker.write(f"each step samples {args.generated_batch_size} completions and trains on {args.batch_size}")

    # models and optimizer
    dtype = default_dtype(info.device)
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    if args.micro_batching == "packed":  # a model that cannot pack: one line now, not wrong gradients later
        check_packing(policy, train_data.prompt_ids)
    policy = add_lora(policy, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    policy, optimizer, scheduler = prepare(policy, optimizer, scheduler, info, args.local_micro_batch_size,
                                           args.gradient_accumulation_steps, args.max_grad_norm, dtype)
    # ALGO LOGIC: the implicit PRM pi_phi (trained, own AdamW, constant LR as verl) and its frozen reference pi_ref
    prm = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    prm_optimizer = torch.optim.AdamW(prm.parameters(), lr=args.prm_learning_rate, weight_decay=0.0, fused=True)
    prm, prm_optimizer, _ = prepare(prm, prm_optimizer, torch.optim.lr_scheduler.LambdaLR(prm_optimizer, lambda s: 1.0),
                                    info, args.local_micro_batch_size,
                                    args.local_batch_size // args.local_micro_batch_size // args.prm_num_minibatches,
                                    args.prm_max_grad_norm, dtype)
    prm_ref = prepare_frozen(load_causal_lm(model_path, dtype), info, dtype)
    # the reference is only loaded when the KL term is used (no NaN KL when beta = 0); LoRA: the policy, adapters off
    ref_policy = load_reference(policy, model_path, dtype, info, bool(args.lora_r)) if args.beta > 0 else None
    fp32_lm_head([policy, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))

    # generation engine
    generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                               dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                               world_size=info.world_size, zero_stage=info.zero_stage, stop=args.stop,
                               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                               enable_sleep_mode=args.vllm_enable_sleep, lora_sync=args.lora_sync,
                               fp32_lm_head=args.fp32_lm_head)
    decode = completion_decoder(tokenizer, args.stop)  # text for rewards and logs: EOS skipped, cut at --stop

    def evaluate(step: int) -> dict:  # grader accuracy and pass@k on eval and dev (shared/evaluation.py)
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed))
        return {**metrics, **best.update(metrics, step, policy)}  # keeps the best policy (on dev) in output_dir/best

    # TRY NOT TO MODIFY: resume: weights, optimizers (policy and PRM), LR schedulers, data position, RNG
    engines = {"policy": policy, "prm": prm}
    resumable = {"sampler": sampler, "guard": guard, "best": best}  # saved and restored with each checkpoint
    start_step, state = ckpt.restore(engines, **resumable)
    first_eval = state.get("first_eval")
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    def rollout(step: int) -> tuple[list[int], list, list[str], list[float]]:
        """1. rollout and 2. reward: this rank's slice of the next num_prompts * oversample_factor prompts, G samples
        each (global prompt i seeded by index i), graded: its prompt indices, completions ([P * G]), texts, rewards."""
        with timer("generate"):
            local_gen = args.local_num_prompts * args.oversample_factor
            global_idx = sampler.next_indices(args.num_prompts * args.oversample_factor)
            local_idx = global_idx[info.rank * local_gen : (info.rank + 1) * local_gen]
            outs = generator.generate([train_data.prompt_ids[i] for i in local_idx], n=args.num_generations,
                                      temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919 + step,
                                      index_offset=info.rank * local_gen)
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU for training (the sync replaces the weights)
        return (local_idx, *score(step, local_idx, outs))

    def score(step: int, local_idx: list[int], outs: list) -> tuple[list, list[str], list[float]]:
        """2. reward of a rollout's samples: completions (prompt-major: [P_local * G]), texts, rewards."""
        comps = [c for group in outs for c in group]  # prompt-major: [P_local * G]
        rows = [train_data.rows[i] for i in local_idx for _ in range(args.num_generations)]
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        with timer("reward"):  # the grader's 0/1 (raising: save step - 1, stop)
            texts = [decode(c.token_ids) for c in comps]
            scores = score_completions(reward_fn, None, rows, prompts, comps, texts, tokenizer.pad_token_id,
                                       info, args.local_micro_batch_size, ckpt.user_code(step, engines, tracker))
            with ckpt.user_code(step, engines, tracker):  # the PRM's labels: 0 or 1, else save step - 1, stop
                check_labels(scores, reward_fn)
        return comps, texts, scores

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:  # the held-out value before training, logged with the train set's size
        first_eval = tracker.log_start(evaluate(0), headline, len(train_data.rows), train_data.num_filtered)
    policy.train()
    prm.train()
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, first_eval=first_eval)
        # 1. rollout and 2. reward (rollout() above): this rank's slice of the global prompt batch, G samples each
        local_idx, comps, texts, scores = rollout(step)

        # 2. (end) the accuracy filter: local_num_prompts of this rank's sampled groups, passing groups first
        G, acc_all = args.num_generations, torch.tensor(scores, dtype=torch.float32).view(-1, args.num_generations)
        truncated = torch.tensor([not c.finished for c in comps]).view(-1, G) & args.filter_truncated
        kept, passing = filter_groups(acc_all, truncated, args.accuracy_lower, args.accuracy_upper,
                                      args.local_num_prompts)
        filter_stats = {"prime/filter_pass_frac": sum(passing) / len(passing),
                        "prime/kept_pass_frac": sum(passing[p] for p in kept) / len(kept)}
        filter_stats.update({f"prime/groups_correct_{k}": (acc_all.sum(1) == k).float().mean().item() for k in range(G + 1)})
        rows_kept = [p * G + k for p in kept for k in range(G)]
        local_idx = [local_idx[p] for p in kept]
        comps, texts, scores = [comps[i] for i in rows_kept], [texts[i] for i in rows_kept], [scores[i] for i in rows_kept]

        # 3. tensors: [prompt | completion | pad], response mask from lengths (pad == eos safe)
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, [c.token_ids for c in comps], tokenizer.pad_token_id,
                                                     info.device)
        lengths = attn.sum(1).tolist()  # tokens per row: --micro_batching groups rows by them
        mask = completion_mask(resp, torch.tensor([c.finished for c in comps]), args.mask_truncated_completions)
        acc = torch.tensor(scores, dtype=torch.float32, device=info.device)
        sampler_logp = data_utils.sampler_logprobs([len(p) for p in prompts], [c.logprobs for c in comps], mask)

        # 4. log-probs before the update: old (for the ratio and TIS), reference (KL term), the PRM's reference
        reuse = args.num_iterations > 1 or args.num_minibatches > 1  # else pi_old is the update's own log-probs
        num_micro = args.local_batch_size // args.local_micro_batch_size
        with timer("logprob"):  # micro-batches of the whole batch, laid out as in training; zeros for a None
            old_logp, ref_logp = batch_logprobs([policy if reuse else None, ref_policy], input_ids, attn, resp, lengths,
                                                num_micro, args.micro_batching, args.temperature)
            prm_ref_logp = batch_logprobs([prm_ref], input_ids, attn, resp, lengths, num_micro, args.micro_batching,
                                          1.0)[0]

        # 5. ALGO LOGIC: advantages: the implicit PRM's steps on this batch's outcomes, its token rewards normalised
        # over all ranks, RLOO per group (a group is on one rank), returns whitened over all ranks' completion tokens
        with timer("prm"):
            q, prm_loss, prm_norm = update_prm(prm, guard, prm_ref_logp, input_ids, attn, resp, lengths, mask, acc,
                                               args.prm_beta, num_micro, args.micro_batching, args.prm_update,
                                               args.prm_num_minibatches)
        token_rewards = process_rewards(q, mask, args.prm_beta)
        scale = info.all_reduce(reward_scale(token_rewards).cpu().reshape(1), "max")
        token_rewards = token_rewards / (scale.to(info.device) + 1e-6)
        returns = prime_returns(token_rewards, acc, mask, G, args.reward_dpo_coef, args.reward_gt_coef)
        sums = info.all_reduce(torch.stack([(returns * mask).sum(), (returns**2 * mask).sum(), mask.sum()]).double().cpu())
        adv_tok = masked_whiten(returns, mask, sums.to(info.device))

        # 6. update: num_iterations passes x num_minibatches optimizer steps x gradient accumulation
        stats = defaultdict(list)  # metric name -> one value per micro-batch
        grad_norms = []
        with timer("train"):
            for _ in range(args.num_iterations):
                perm = torch.randperm(args.local_batch_size)
                for mb in range(args.num_minibatches):
                    mb_idx = perm[mb * args.local_minibatch_size : (mb + 1) * args.local_minibatch_size]
                    mb_tokens = mask[mb_idx].sum()
                    global_tokens = info.all_reduce(mb_tokens.clone().cpu()).item()
                    # exactly gradient_accumulation_steps micro-batches (DeepSpeed's boundary; ZeRO-3's collectives)
                    for idx in data_utils.micro_batches(mb_idx.tolist(), lengths, args.gradient_accumulation_steps,
                                                        args.micro_batching):
                        m_mask = mask[idx]
                        logp, entropy = micro_batch_logprobs(policy, input_ids[idx], attn[idx], resp[idx],
                                                             args.micro_batching, args.temperature, True)
                        logp_old = old_logp[idx] if reuse else logp.detach()
                        if not reuse:
                            old_logp[idx] = logp_old  # for the step's mismatch metrics
                        if args.policy_loss == "cispo":
                            pg, is_clipped, ratio = cispo_surrogate(logp, logp_old, adv_tok[idx], args.epsilon_high,
                                                                    m_mask, args.importance_level)
                        elif args.policy_loss.startswith("dppo"):
                            pg, is_clipped, ratio = dppo_surrogate(logp, logp_old, sampler_logp[idx], adv_tok[idx],
                                                                   args.epsilon_low, args.epsilon_high,
                                                                   args.policy_loss[5:], m_mask)
                        elif args.policy_loss == "sapo":
                            pg, is_clipped, ratio = sapo_surrogate(logp, logp_old, adv_tok[idx],
                                                                   args.sapo_temperature_pos,
                                                                   args.sapo_temperature_neg, m_mask,
                                                                   args.importance_level)
                        else:
                            pg, is_clipped, ratio = clipped_surrogate(logp, logp_old, adv_tok[idx], args.epsilon_low,
                                                                      args.epsilon_high, m_mask, args.importance_level)
                        if args.off_policy_mask_threshold is not None:  # DeepSeek-V3.2: stale negative samples out
                            keep = off_policy_sequence_mask(logp, sampler_logp[idx], adv_tok[idx], m_mask,
                                                            args.off_policy_mask_threshold)
                            pg = pg * keep
                            stats["policy/off_policy_masked"].append(1 - keep[:, 0].mean().item())
                        # TIS: w = pi_old / pi_sampler (same weights, the generator's kernels), truncated or masked
                        w = tis_weights(logp_old, sampler_logp[idx], m_mask, args.tis, args.tis_cap, args.tis_mask_low)
                        per_token = pg * w
                        if args.entropy_coef:  # entropy bonus, aggregated over the same tokens as the policy term
                            per_token = per_token - args.entropy_coef * entropy
                        kl = torch.zeros_like(logp)
                        if ref_policy is not None:
                            kl = kl_penalty(logp, ref_logp[idx], args.kl_estimator, m_mask)
                            if args.use_bias_correction_kl:
                                kl = unbiased_kl(kl, logp, logp_old, m_mask, args.importance_level)
                            per_token = per_token + args.beta * kl  # KL in the loss, same aggregator as the PG term
                        loss = aggregate_loss(per_token, m_mask, args.loss_aggregation, args.local_minibatch_size,
                                              int(mb_tokens.item()), int(global_tokens), info.world_size,
                                              args.max_new_tokens)
                        guard.backward(policy, loss)
                        norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                        grad_norms += [norm] if norm is not None else []
                        with torch.no_grad():  # masked token means for logging
                            n = m_mask.sum().clamp(min=1)
                            mm = lambda x: (x * m_mask).sum() / n  # noqa: E731
                            for k, v in {"loss/policy_avg": mm(pg), "policy/clipfrac_avg": mm(is_clipped),
                                         "policy/approxkl_avg": mm(0.5 * (logp - logp_old) ** 2),
                                         "objective/kl": (kl * m_mask).sum(1).mean(), "objective/entropy": mm(entropy),
                                         "val/ratio": mm(ratio), "val/ratio_var": mm((ratio - mm(ratio)) ** 2)}.items():
                                stats[k].append(v.item())

        # 7. weight sync: push the updated policy into the generation engine
        with timer("sync"):
            generator.wake_up()
            generator.sync_weights(full_named_parameters(policy, info))

        # 8. log (reduced over ranks once per step)
        local = {k: sum(v) / len(v) for k, v in stats.items()}
        with torch.no_grad():  # the mismatch of the whole batch, before the update (docs/mismatch.md)
            w_step = tis_weights(old_logp, sampler_logp, mask, args.tis, args.tis_cap, args.tis_mask_low)
            w_raw = tis_weights(old_logp, sampler_logp, mask, args.tis, math.inf, 0.0)  # before truncation or mask
            local.update(mismatch_metrics(old_logp, sampler_logp, mask, w_step, w_raw))
        local.update({**completion_metrics(scores, comps),  # objective/scores(_std), val/sequence_lengths, stop_rate
                      "optim/grad_norm": sum(grad_norms) / max(len(grad_norms), 1), **filter_stats,
                      "reward_model/dpo_loss": prm_loss, "reward_model/grad_norm": prm_norm or 0.0,
                      "reward_model/reward": token_rewards.sum(1).mean().item(),
                      "reward_model/raw_reward": q.sum(1).mean().item(),
                      "reward_model/dpo_acc": dpo_accuracy(q, acc, mask, G)})
        metrics = info.mean_over_ranks(local)
        mean_g, mean_g2 = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()  # of the returns, before whitening
        metrics.update({"val/returns_mean": mean_g, "val/returns_std": max(mean_g2 - mean_g**2, 0.0) ** 0.5,
                        "lr": scheduler.get_last_lr()[0], "episode": step * args.generated_batch_size,
                        "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
        # evaluation: the engine holds this step's weights (synced above)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"), ckpt.user_code(step, engines, tracker, trained=True, **resumable, first_eval=first_eval):
                metrics.update(evaluate(step))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, reward=metrics["objective/scores"])  # and the last held-out accuracy
        if args.sample_every and step % args.sample_every == 0:
            tracker.log_samples([{"prompt": decode(train_data.prompt_ids[local_idx[i // args.num_generations]]),
                                  "completion": texts[i], "reward": scores[i], "finish_reason": comps[i].finish_reason}
                                 for i in range(0, len(comps), args.num_generations)][:8], step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, **resumable, first_eval=first_eval)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)

    with ckpt.user_code(args.num_steps, engines, tracker, trained=True, **resumable, first_eval=first_eval):
        metrics = evaluate(args.num_steps)
    metrics["time/total"] = time.time() - start
    # output_dir/final, saved before the end-of-run checks, so a failure there loses nothing
    final = save_final(policy, tokenizer, args.output_dir, info) if args.save_model else ""
    if args.save_model:  # the PRM in output_dir/prm, with implicit_prm.py's config keys (reference, beta)
        # the reference as a run in any directory finds it: a local directory's absolute path, else the name as given
        reference = (os.path.abspath(model_path) if os.path.isdir(os.path.expanduser(args.model_name_or_path))
                     else args.model_name_or_path)
        save_hf(prm, tokenizer, os.path.join(args.output_dir, "prm"), info,
                {"implicit_prm_reference": reference, "implicit_prm_beta": args.prm_beta})
    metrics.update(check_ranks(policy, info, local_idx))
    metrics.update(check_engine(generator, policy, eval_data.prompt_ids[:4], info, args.max_new_tokens))
    tracker.log_end(metrics, args.num_steps, headline, first_eval)
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
