"""VinePPO: PPO with Monte Carlo value estimates instead of a critic. Docs: docs/vineppo.md

Paper: VinePPO (Kazemnejad et al. 2024, https://arxiv.org/abs/2410.01679). Reference: McGill-NLP/VinePPO
(`math_episode_generator_with_mc_advantages.py` + the PPO trainer with `critic_model: null`).
A response is split into reasoning steps; the value of each intermediate state S_j (prompt + the first j steps)
is the mean reward of K fresh completions sampled from the current policy from that state, so every step gets
an unbiased advantage A_j = 1[j last]*R + V(S_{j+1}) - V(S_j), broadcast to its tokens.

Default objective (maximised), ppo.py's with MC advantages instead of GAE on a critic:
    J(theta) = 1/sum_i |o_i| * sum_i sum_t min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)
               - beta * 1/B sum_i sum_t clamp(k3_it, 0, 10)
    A_it = whiten(A_j) for the step j holding token t, V(S_j) = mean of K rewards from S_j; eps = 0.2, beta = 1e-4

Delta from PPO (algorithms/ppo.py, `diff` the two files): no critic, no value loss and no GAE; instead
step splitting, one generate call with n=K per unique state (identical states across the batch deduplicated,
prefix caching on), and step advantages. The PPO-clip update, the k3 KL loss and --tis are the same.

Launch:
    python algorithms/vineppo.py                                               # CPU, built-in task
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/vineppo.py
    accelerate launch --config_file scripts/accelerate/zero3.yaml --num_processes 8 algorithms/vineppo.py \
        --model_name_or_path realtreetune/rho-1b-sft-GSM8K --dataset openai/gsm8k:main --prompt_key question \
        --reward_fn gsm8k --prompt_template $'[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:' --temperature 0.6 \
        --top_p 0.9 --max_new_tokens 1024 --learning_rate 1e-6 --max_step_for_value_estimation 25
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_final
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, full_named_parameters,
                                init_distributed, load_causal_lm, load_reference, load_tokenizer, prepare,
                                seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, completion_metrics, make_generator
from shared.logprobs import forward_logprobs, fp32_lm_head
from shared.mismatch import mismatch_metrics
from shared.lora import add_lora, check_lora
from shared.prompts import load_prompt_task, task_summary
from shared.rewards import compute_rewards
from shared.steps import StepSplitError, get_splitter, step_token_starts
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "vineppo"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/vineppo"
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
    """column of the gold answer given to the reward function"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced (VinePPO: `[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:`)"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """`auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function` / `file.py:function`"""
    step_splitter: Literal["auto", "lines", "gsm8k", "math"] = "auto"
    """how responses are cut into steps: `auto` (by dataset), `lines` (built-in task), `gsm8k`, `math`"""
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
    """save the final policy as an HF checkpoint in output_dir/final"""

    # reliability (shared/checkpoint.py; docs/vineppo.md#reliability)
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
    total_episodes: Annotated[int, Ge(1)] = 51200
    """total completions to sample over the run (steps = total_episodes / batch_size)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """policy AdamW learning rate (constant after warm-up)"""
    warmup_steps: Annotated[int, Ge(0)] = 5
    """linear learning-rate warm-up steps"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    num_generations: Annotated[int, Ge(1)] = 8
    """completions per prompt"""
    local_num_prompts: Annotated[int, Ge(1)] = 64
    """prompts per rank per step (local_batch_size = local_num_prompts * num_generations completions)"""
    num_minibatches: Annotated[int, Ge(1)] = 2
    """optimizer steps per pass over the batch"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """completions per forward/backward on each rank (HF `per_device_train_batch_size`); memory: docs/performance.md"""
    num_iterations: Annotated[int, Ge(1)] = 2
    """passes over each batch (VinePPO: 2; TRL's PPO, summarize_from_feedback_details: 4)"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature; trainer logits are divided by it too"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling; <1 makes the trainer's log-probs differ from the sampler's"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it are 'truncated'"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    num_mc_rollouts: Annotated[int, Ge(1)] = 9
    """K: continuations sampled from each intermediate state to estimate its value"""
    max_step_for_value_estimation: Annotated[int, Ge(0)] = 0
    """roll out only states S_0..S_cap (0: all); later values are back-filled with the trajectory's own return"""
    epsilon_low: Annotated[float, Interval(ge=0, le=1)] = 0.2
    """lower clip range of PPO-clip: ratio >= 1 - epsilon_low"""
    epsilon_high: Annotated[float, Ge(0)] = 0.2
    """upper clip range: ratio <= 1 + epsilon_high"""
    whiten_advantages: bool = True
    """normalise advantages to zero mean, unit variance over the whole batch (all ranks)"""
    beta: Annotated[float, Ge(0)] = 1e-4
    """coefficient of the k3 KL loss to the reference (VinePPO: 1e-4, clamped to [0, 10]); 0 skips the reference model"""
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


def dedup_states(states_per_traj: list[list]) -> tuple[list, list[list[int | None]]]:
    """Unique states (first-seen order) and, per trajectory, each state's index into them; None (a state not
    rolled out) stays None. Identical states (e.g. S_0 of the samples of one prompt) are rolled out once."""
    index, unique, out = {}, [], []
    for states in states_per_traj:
        row = []
        for key in states:
            if key is not None and key not in index:
                index[key] = len(unique)
                unique.append(key)
            row.append(None if key is None else index[key])
        out.append(row)
    return unique, out


def step_states(token_ids: list[list[int]], texts: list[str], prompt_index: list[int], split_steps, decode,
                cap: int | None) -> tuple[list[list[int] | None], list[list], int]:
    """Each response's step starts (token offsets; None when the splitter fails: the trajectory leaves the loss, as
    VinePPO's `parse_failed`) and its states S_j as keys (prompt index, the tokens of the steps before j), None for a
    state past `cap` (not rolled out). Returns the starts, the keys and the number of failed splits."""
    starts, parse_failed = [], 0
    for ids, text in zip(token_ids, texts):
        try:
            starts.append(step_token_starts(ids, split_steps(text), decode))
        except StepSplitError:
            starts.append(None)
            parse_failed += 1
    keys = [[None if cap is not None and j > cap else (p, tuple(ids[:k])) for j, k in enumerate(st or [])]
            for ids, st, p in zip(token_ids, starts, prompt_index)]
    return starts, keys, parse_failed


def step_advantages(values: list[float], ret: float) -> list[float]:
    """A_j = 1[j = n-1] * R + V(S_{j+1}) - V(S_j) with V(S_n) = 0; sums to R - V(S_0)."""
    n = len(values)
    return [(ret if j == n - 1 else 0.0) + (values[j + 1] if j + 1 < n else 0.0) - values[j] for j in range(n)]


def backfill_values(values: list[float | None], ret: float) -> list[float]:
    """States beyond max_step_for_value_estimation were not rolled out: V_j = r_j + V_{j+1} = R (only the
    last step is rewarded), i.e. the trajectory's own outcome (as VinePPO's code)."""
    return [ret if v is None else v for v in values]


def token_advantages(starts: list[int], step_adv: list[float], num_tokens: int) -> list[float]:
    """Each token gets its step's advantage (piecewise constant; the EOS is in the last step)."""
    out = [0.0] * num_tokens
    bounds = starts + [num_tokens]
    for j, a in enumerate(step_adv):
        for i in range(bounds[j], bounds[j + 1]):
            out[i] = a
    return out


def mc_metrics(values: list[float], rollouts: list, num_unique: int, state_index: list[list], starts: list,
               parse_failed_frac: float) -> dict[str, float]:
    """This rank's Monte Carlo metrics of a step: the states' values (mean, std), the fraction of rollouts cut at
    max_new_tokens, unique states over states rolled out, steps per split response, failed splits, rollouts made."""
    avg = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    num_states = sum(k is not None for row in state_index for k in row)
    return {"mc_values/mean": avg(values), "mc_values/std": torch.tensor(values).std().item() if len(values) > 1 else 0.0,
            "val/mc_roll_trunc_frac": avg([not c.finished for c in rollouts]),
            "val/unique_state_frac": num_unique / max(num_states, 1),
            "val/steps_per_response": avg([len(st) for st in starts if st is not None]),
            "val/parse_failed": parse_failed_frac, "val/mc_rollouts": float(len(rollouts))}


def response_advantages(starts: list, state_index: list[list], values: list[float], scores: list[float],
                        offsets: list[int], lengths: list[int], mask: torch.Tensor):
    """Advantages like `mask` ([B, T]): each response's states' MC values (back-filled past the cap) give its step
    advantages, broadcast to each step's tokens from column offsets[i] on; and [B] kept, 0 where the split failed."""
    advantages, kept = torch.zeros_like(mask), torch.ones_like(mask[:, 0])
    for i, (st, idx, score, p, n) in enumerate(zip(starts, state_index, scores, offsets, lengths)):
        if st is None:
            kept[i] = 0.0
            continue
        v = backfill_values([values[k] if k is not None else None for k in idx], score)
        advantages[i, p : p + n] = torch.tensor(token_advantages(st, step_advantages(v, score), n))
    return advantages, kept


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    info = init_distributed()
    derive_sizes(args, info.world_size)  # batch_size, local_minibatch_size, num_steps, ... (shared/cli.py)

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for init and data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: validated before anything is written (a bad row, model path or reward function stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    # train / held-out / dev prompts and the grader
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer)
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headline = "eval/accuracy"  # printed at start and end: the grader's held-out accuracy

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.top_p < 1.0:
        tracker.write("warning: top_p < 1 makes the trainer's log-probs differ from the sampler's")
    tracker.write(task_summary(train_data, eval_data, dev_data, args.num_steps, args.batch_size))
    splitter_name = args.step_splitter
    if splitter_name == "auto":
        lowered = args.dataset.lower()
        splitter_name = "lines" if args.dataset.startswith("builtin") else "gsm8k" if "gsm8k" in lowered else "math"
    split_steps = get_splitter(splitter_name)

    # models and optimizer: policy and frozen reference (no critic)
    dtype = default_dtype(info.device)
    schedule = lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps))  # noqa: E731
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    policy = add_lora(policy, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=0.0, fused=True)
    policy, optimizer, scheduler = prepare(policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                           info, args.local_micro_batch_size, args.gradient_accumulation_steps,
                                           args.max_grad_norm, dtype)
    # the reference is only loaded when the KL term is used (no NaN KL when beta = 0); LoRA: the policy, adapters off
    ref_policy = load_reference(policy, model_path, dtype, info, bool(args.lora_r)) if args.beta > 0 else None
    fp32_lm_head([policy, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
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

    def evaluate(step: int) -> dict:  # grader accuracy and pass@k on eval and dev (shared/evaluation.py)
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed))
        return {**metrics, **best.update(metrics, step, policy)}  # keeps the best policy (on dev) in output_dir/best

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG
    engines = {"policy": policy}
    resumable = {"sampler": sampler, "guard": guard, "best": best}  # saved and restored with each checkpoint
    start_step, state = ckpt.restore(engines, **resumable)
    first_eval = state.get("first_eval")
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:  # the held-out value before training, logged with the train set's size
        first_eval = tracker.log_start(evaluate(0), headline, len(train_data.rows), train_data.num_filtered)
    policy.train()
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, first_eval=first_eval)
        # 1. rollout: this rank's slice of the global prompt batch, G samples each
        with timer("generate"):
            global_idx = sampler.next_indices(args.num_prompts)
            local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
            outs = generator.generate([train_data.prompt_ids[i] for i in local_idx], n=args.num_generations,
                                      temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919 + step,
                                      index_offset=info.rank * args.local_num_prompts)
        comps = [c for group in outs for c in group]
        rows = [train_data.rows[i] for i in local_idx for _ in range(args.num_generations)]
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, [c.token_ids for c in comps], tokenizer.pad_token_id,
                                                     info.device)
        mask = resp[:, 1:].float()  # position t predicts token t+1: 1 on completion tokens, EOS included
        sampler_logp = data_utils.sampler_logprobs([len(p) for p in prompts], [c.logprobs for c in comps], mask)

        # 2. scores: the grader (0 if truncated)
        with timer("reward"):
            texts = [decode(c.token_ids) for c in comps]
            with ckpt.user_code(step, engines, tracker):  # a raising reward function: save step - 1, stop
                scores = compute_rewards(reward_fn, [x["prompt"] for x in rows], texts, [x["answer"] for x in rows],
                                         [c.finished for c in comps], rows)

        # 3. states: split each response into steps; state S_j = prompt + the tokens of steps < j, each rolled out once
        starts, keys, parse_failed = step_states([c.token_ids for c in comps], texts,
                                                 [i for i in local_idx for _ in range(args.num_generations)],
                                                 split_steps, decode, args.max_step_for_value_estimation or None)
        unique, traj_states = dedup_states(keys)
        requests = [(train_data.prompt_ids[p] + list(prefix), args.max_new_tokens - len(prefix), train_data.rows[p],
                     list(prefix)) for p, prefix in unique]

        # 4. Monte Carlo values: K continuations per unique state, graded in full (each rank calls, maybe with none)
        with timer("value_estimation"):
            mc = generator.generate([r[0] for r in requests], n=args.num_mc_rollouts, temperature=args.temperature,
                                    top_p=args.top_p, max_new_tokens=[r[1] for r in requests],
                                    seed=args.seed * 7_919 + step + 500_009, index_offset=info.rank)
            flat = [(r, cont) for r, group in zip(requests, mc) for cont in group]
            with ckpt.user_code(step, engines, tracker):
                mc_rewards = compute_rewards(
                    reward_fn, [r[2]["prompt"] for r, _ in flat], [decode(r[3] + cont.token_ids) for r, cont in flat],
                    [r[2]["answer"] for r, _ in flat], [cont.finished for _, cont in flat], [r[2] for r, _ in flat])
            values = torch.tensor(mc_rewards).view(len(requests), args.num_mc_rollouts).mean(1).tolist()
            generator.sleep(level=2)  # --vllm_enable_sleep: weights discarded, the sync after the update reloads them

        # 5. advantages: step TD on the MC values, broadcast to tokens, whitened over the batch (all ranks)
        advantages, kept = response_advantages(starts, traj_states, values, scores, [len(p) - 1 for p in prompts],
                                               [len(c.token_ids) for c in comps], mask)  # from each response's
        mask = mask * kept[:, None]  # first completion token's column; a response whose split failed leaves the loss
        advantages = advantages * mask
        if args.whiten_advantages:
            sums = torch.stack([(advantages * mask).sum(), (advantages**2 * mask).sum(), mask.sum()]).double().cpu()
            info.all_reduce(sums)
            mean = sums[0] / sums[2]
            var = sums[1] / sums[2] - mean**2
            advantages = masked_whiten(advantages, mask, mean.float().to(info.device), var.float().to(info.device))

        # 6. log-probs before the update (no grad): old policy and reference
        old_logp, ref_logp = torch.zeros_like(mask), torch.zeros_like(mask)
        entropy_sum = torch.zeros(args.local_batch_size, device=info.device)
        with timer("logprob"), torch.no_grad():
            for s in range(0, args.local_batch_size, args.local_micro_batch_size):
                sl = slice(s, s + args.local_micro_batch_size)
                old_logp[sl], ent = forward_logprobs(policy, input_ids[sl], attn[sl], resp[sl], args.temperature, True)
                entropy_sum[sl] = (ent * mask[sl]).sum(1)
                if ref_policy is not None:
                    ref_logp[sl] = forward_logprobs(ref_policy, input_ids[sl], attn[sl], resp[sl], args.temperature)[0]
        kl_k1 = kl_penalty(old_logp, ref_logp, "k1") * mask if ref_policy is not None else torch.zeros_like(mask)

        # 7. update: num_iterations passes x num_minibatches policy steps (PPO-clip + k3 KL loss), no value loss
        stats = defaultdict(list)  # metric name -> one value per micro-batch
        grad_norms = []
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
                        if ref_policy is not None:
                            # k3 per token, clamped to [0, 10] as in VinePPO
                            k3 = torch.clamp(kl_penalty(logp, ref_logp[idx], "k3", m_mask) * m_mask, 0, 10)
                            kl_loss = args.beta * k3.sum() / args.local_minibatch_size  # seq-sum, batch-mean
                            loss = loss + kl_loss
                        mean_ratio = ((ratio * m_mask).sum() / m_mask.sum().clamp(min=1)).item()
                        skip = mean_ratio > args.ratio_threshold  # a wildly off-policy micro-batch: no update
                        guard.backward(policy, loss * (0.0 if skip else 1.0))
                        norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                        grad_norms += [norm] if norm is not None else []
                        with torch.no_grad():  # masked token means for logging
                            n = m_mask.sum().clamp(min=1)
                            mm = lambda x: ((x * m_mask).sum() / n).item()  # noqa: E731
                            for k, v in {"loss/policy_avg": mm(pg), "loss/kl_avg": kl_loss.item(),
                                         "policy/clipfrac_avg": mm(is_clipped),
                                         "policy/approxkl_avg": mm(0.5 * (logp - old_logp[idx]) ** 2),
                                         "val/ratio": mean_ratio, "val/ratio_var": mm((ratio - mean_ratio) ** 2),
                                         "val/skipped_frac": float(skip)}.items():
                                stats[k].append(v)

        # 8. weight sync: push the updated policy into the generation engine
        with timer("sync"):
            generator.wake_up()
            generator.sync_weights(full_named_parameters(policy, info))

        # 9. log (reduced over ranks once per step)
        local = {k: sum(v) / len(v) for k, v in stats.items()}
        with torch.no_grad():  # the mismatch of the whole batch, before the update (docs/mismatch.md)
            w_step = tis_weights(old_logp, sampler_logp, mask, args.tis, args.tis_cap, args.tis_mask_low)
            w_raw = tis_weights(old_logp, sampler_logp, mask, args.tis, math.inf, 0.0)  # before truncation or mask
            local.update(mismatch_metrics(old_logp, sampler_logp, mask, w_step, w_raw))
        local.update({
            **completion_metrics(scores, comps),  # objective/scores(_std), val/sequence_lengths, stop_rate
            "objective/kl": kl_k1.sum(1).mean().item(),
            "objective/entropy": (entropy_sum / mask.sum(1).clamp(min=1)).mean().item(),
            **mc_metrics(values, [cont for _, cont in flat], len(requests), traj_states, starts, parse_failed / len(comps)),
            "optim/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
        })
        metrics = info.mean_over_ranks(local)
        metrics.update({"lr": scheduler.get_last_lr()[0], "episode": step * args.batch_size,
                        "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
        # evaluation: the engine holds this step's weights (synced above)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"), ckpt.user_code(step, engines, tracker, trained=True, **resumable,
                                               first_eval=first_eval):
                metrics.update(evaluate(step))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, reward=metrics["objective/scores"])  # and the last held-out accuracy
        if args.sample_every and step % args.sample_every == 0:
            tracker.log_samples([{"prompt": decode(prompts[i]), "completion": texts[i], "score": scores[i],
                                  "finish_reason": comps[i].finish_reason}
                                 for i in range(0, args.local_batch_size, args.num_generations)][:8], step)

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
    # output_dir/final, saved before the end-of-run checks
    final = save_final(policy, tokenizer, args.output_dir, info) if args.save_model else ""
    metrics.update(check_ranks(policy, info, local_idx))
    metrics.update(check_engine(generator, policy, eval_data.prompt_ids[:4], info, args.max_new_tokens))
    tracker.log_end(metrics, args.num_steps, headline, first_eval)
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
