"""OPD: on-policy distillation. Docs: docs/opd.md

Papers: Agarwal et al. 2024, GKD (https://arxiv.org/abs/2306.13649); Lu & Thinking Machines Lab 2025, "On-Policy
Distillation" (https://thinkingmachines.ai/blog/on-policy-distillation). The student samples G completions per
prompt as in GRPO; a frozen teacher with the same tokenizer scores every sampled token in one forward pass, and each
generated token t of completion i gets its own advantage, the negative single-sample reverse KL, with no discount
and no task reward: A_it = sg(log nu(y_it | s_it) - log pi_old(y_it | s_it)), nu the teacher, pi_old the student
before the update. The update is grpo.py's clipped surrogate with that advantage.

Default objective (maximised), log-probs of both models log_softmax(logits / T), T the rollout temperature:
    J(theta) = 1/sum_i |o_i| * sum_i sum_t w_it * min(rho_it A_it, clip(rho_it, 1 - eps_low, 1 + eps_high) A_it)
    rho_it = pi_theta(o_it) / pi_old(o_it),  w_it = min(pi_old(o_it) / pi_sampler(o_it), C),  eps_low = 0.2,
    eps_high = 0.28, C = tis_cap = 2; the token mean runs over the generated tokens (EOS included) of the step

Delta from GRPO (algorithms/grpo.py): the per-token teacher advantage replaces the group-normalised reward; a frozen
teacher (--teacher_model_name_or_path, default builtin:tiny-grpo) is loaded beside the policy, its vocabulary and
bos/eos/pad ids checked against the student's at start-up (embeddings padded to different sizes: the
full-distribution losses compare the tokenizer's real tokens). Flags that switch a pure function: --loss jsd (GKD's
generalised JSD with --jsd_beta, backpropagated through the student's whole distribution on the completion positions,
in chunks) or fkl_topk (forward KL on the teacher's --topk tokens, --topk_tail), --reward_coef (adds coef x the task
reward's advantage, by grpo.py's --advantage_estimator), --control_adv c (A_it = -c on every generated token: the
fixed-negative-advantage control, no teacher signal). grpo.py's other flags work as there: --policy_loss (CISPO, DPPO,
SAPO) on the teacher advantage, --beta and --kl_estimator (KL to the frozen start model; 0: not loaded), GSPO, TIS,
LoRA, and DeepSeek-V3.2's --off_policy_mask_threshold and --use_bias_correction_kl. Which teacher scores which row:
--teachers name=path ... (MOPD: several frozen teachers, each vocabulary-checked; each row's --teacher_column picks
one; A_it, or the divergence of --loss jsd / fkl_topk, uses row i's teacher), --self_distillation (the teacher is a frozen copy of the start model) and
--teacher_context reference (the teacher reads --teacher_template, the row's gold answer in it, in place of the
student's prompt; its log-probs are taken on the student's own completion tokens; the student never sees the answer).

Launch:
    python algorithms/opd.py                                   # CPU, built-in task, tiny-sft from tiny-grpo
    python algorithms/opd.py --control_adv 0.3                 # the fixed-negative-advantage control
    python algorithms/opd.py --loss jsd --jsd_beta 0.5         # GKD: generalised JSD on the student's samples
    python algorithms/opd.py --self_distillation --teacher_context reference   # OPSD: the start model, answer in view
    python algorithms/opd.py --dataset mix.jsonl --teachers math=org/math-7b code=org/code-7b   # MOPD by `teacher_id`
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/opd.py   # several processes
    accelerate launch --config_file scripts/accelerate/zero3.yaml algorithms/opd.py \
        --model_name_or_path Qwen/Qwen3-0.6B --teacher_model_name_or_path Qwen/Qwen3-8B --chat_template \
        --dataset openai/gsm8k:main --prompt_key question --answer_key answer --max_new_tokens 512 --learning_rate 1e-6 \
        --prompt_template "{prompt}\nSolve step by step. End with a line '#### <answer>'." --max_prompt_length 512
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_final
from shared.cli import derive_sizes, run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, full_named_parameters, init_distributed,
                                load_causal_lm, load_reference, load_tokenizer, max_over_ranks, output_head, prepare,
                                prepare_frozen, seed_everything)
from shared.evaluation import eval_seed, evaluate_accuracy
from shared.generation import check_engine, completion_decoder, completion_metrics, make_generator
from shared.logprobs import batch_logprobs, check_packing, fp32_lm_head, micro_batch_logprobs
from shared.mismatch import mismatch_metrics
from shared.lora import add_lora, check_lora
from shared.prompts import load_prompt_task, task_summary
from shared.rewards import score_completions
from shared.scalar import load_reward_model
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "opd"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/opd"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """hub name or local path of the policy; `builtin:tiny-sft` is the tiny model warm-started by sft.py (committed weights)"""
    teacher_model_name_or_path: str = "builtin:tiny-grpo"
    """the frozen teacher (same tokenizer as the policy); `builtin:tiny-grpo` is tiny-sft trained by grpo.py (committed)"""
    teachers: tuple[str, ...] = ()
    """MOPD: several frozen teachers `name=path` (`--teachers math=org/a code=org/b`), replacing the one above"""
    teacher_column: str = "teacher_id"
    """with two or more --teachers: the dataset column naming each row's teacher (TRL's `teacher_id`)"""
    self_distillation: bool = False
    """the teacher is a frozen copy of the student's start model (--model_name_or_path), not --teacher_model_name_or_path"""
    teacher_context: Literal["none", "reference"] = "none"
    """`reference`: the teacher reads --teacher_template (the row's gold answer in it) in place of the student's prompt"""
    teacher_template: str = "Here is a reference solution:\n{answer}\n\n{prompt}"
    """--teacher_context reference: the teacher's prompt; {prompt}: the student's prompt text, {answer}: the gold answer"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """column of the gold answer given to the reward function; may be absent with --reward_model_path (then no accuracy)"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced (VinePPO: `[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:`)"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """`auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function` / `file.py:function`"""
    reward_model_path: str = ""
    """reward model scoring completions instead of reward_fn (rm.py, genrm.py, implicit_prm.py; HF classifier); accuracy still graded"""
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
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none); `dev/reward` with a reward model"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 102400
    """total completions to sample over the run (steps = total_episodes / batch_size)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """AdamW learning rate (constant after warm-up)"""
    warmup_steps: Annotated[int, Ge(0)] = 5
    """linear learning-rate warm-up steps"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    num_generations: Annotated[int, Ge(1)] = 8
    """G: completions per prompt (the group); must be > 1 with --reward_coef"""
    local_num_prompts: Annotated[int, Ge(1)] = 64
    """prompts per rank per step (local_batch_size = local_num_prompts * num_generations completions)"""
    num_minibatches: Annotated[int, Ge(1)] = 2
    """optimizer steps per pass over the batch"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """completions per forward/backward on each rank (HF `per_device_train_batch_size`); memory: docs/performance.md"""
    micro_batching: Literal["padded", "sorted", "packed"] = "padded"
    """rows of a forward: `padded` (to the batch's longest), `sorted` (by length) or `packed` (several per row); docs/grpo.md"""
    num_iterations: Annotated[int, Ge(1)] = 2
    """mu: passes over each batch; >1 reuses samples with the clipped ratio against the sampling-time log-probs"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature; the student's and the teacher's logits are divided by it too (log_softmax(logits / T))"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling; <1 makes the trainer's log-probs differ from the sampler's"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it are 'truncated' (reward 0 from the graders)"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    loss: Literal["pg", "jsd", "fkl_topk"] = "pg"
    """`pg`: clipped policy gradient on A_t = sg(log nu - log pi_old); `jsd`: GKD's generalised JSD; `fkl_topk`: top-k forward KL"""
    jsd_beta: Annotated[float, Interval(ge=0, le=1)] = 0.5
    """with --loss jsd: 0 is KL(teacher || student) (forward), 1 is KL(student || teacher) (reverse), between: JSD_beta"""
    topk: Annotated[int, Ge(1)] = 32
    """with --loss fkl_topk: the teacher's top-k tokens the forward KL sums over"""
    topk_tail: bool = False
    """with --loss fkl_topk: add the tail bucket (1 - P_k) log((1 - P_k) / (1 - Q_k)) (the coarse-grained KL, unclamped)"""
    control_adv: Annotated[float, Ge(0)] = 0.0
    """c > 0: A_t = -c on every generated token instead of the teacher's advantage (fixed-negative-advantage control)"""
    reward_coef: Annotated[float, Ge(0)] = 0.0
    """add reward_coef x the task reward's advantage (--advantage_estimator) to every token's advantage (0: none)"""
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp_baseline", "maxrl"] = "grpo"
    """`grpo`: r - group mean, then --advantage_scaling; `reinforce_pp_baseline`: batch-whitened; `rloo`; `maxrl`; docs/grpo.md"""
    advantage_scaling: Literal["group", "batch", "none"] = "group"
    """with `grpo`: `group`: (r-mean)/(std_group+1e-4) (GRPO); `batch`: divide by the batch std; `none`: r-mean (Dr. GRPO)"""
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
    local_minibatch_size: tyro.conf.Suppress[int] = 0
    gradient_accumulation_steps: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: algorithm-local pure functions
def compute_advantages(rewards: torch.Tensor, scaling: str, eps: float = 1e-4, estimator: str = "grpo",
                       token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G], one per completion (docs/grpo.md, Variants).

    grpo: (r_i - mean_G r) / (std + eps), std Bessel-corrected (TRL `nanstd`) of the group (`group`, DeepSeekMath
          §4.1.2) or of the batch (`batch`), or no division (`none`, Dr. GRPO)
    rloo: r_i - (sum_j r_j - r_i) / (G - 1), the mean of the G-1 *other* samples (Ahmadian et al. 2024)
    reinforce_pp_baseline: (c_i - mu) / max(sigma, eps), c_i = r_i - mean_G r, mu and sigma the mean and population
          std of c over the batch's completion tokens, c_i counted token_counts[i] times or once (Hu et al. 2025)
    maxrl: (r_i - mean_G r) / mean_G r, rewards 0 or 1 only (MaxRL, arXiv 2602.02710); a group without success gets 0
    Equal rewards in a group: A = 0 under grpo, rloo and maxrl (no NaN), -mu / sigma under reinforce_pp_baseline."""
    if estimator == "rloo":
        baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)  # leave-one-out mean
        return rewards - baseline
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if estimator == "maxrl":
        non_binary = rewards[(rewards != 0) & (rewards != 1)]
        if len(non_binary):
            raise ValueError(f"advantage_estimator maxrl: needs rewards 0 or 1, got {non_binary[0].item():g}")
        return centered / rewards.mean(dim=1, keepdim=True).clamp(min=eps)  # a mean of 0: every r is 0, A = 0
    if estimator == "reinforce_pp_baseline":
        n = torch.ones_like(rewards) if token_counts is None else token_counts.to(rewards.dtype)
        total = n.sum().clamp(min=1)
        mu = (centered * n).sum() / total  # token-weighted batch mean
        sigma = (((centered - mu) ** 2 * n).sum() / total).sqrt()  # population std (OpenRLHF: var clamped at 1e-8)
        return (centered - mu) / sigma.clamp(min=eps)
    if estimator != "grpo":
        raise ValueError(f"advantage_estimator: expected grpo, rloo, reinforce_pp_baseline or maxrl, got {estimator!r}")
    if scaling == "none":
        return centered
    if scaling == "group":
        return centered / (rewards.std(dim=1, keepdim=True) + eps)
    if scaling == "batch":
        return centered / (rewards.std() + eps)
    raise ValueError(f"advantage_scaling: expected group, batch or none, got {scaling!r}")


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


def opd_advantages(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor, control_adv=0.0):
    """Per-token advantages [B, T] on the generated tokens (mask 1), 0 elsewhere, no discount:
      A_t = sg(log nu(y_t|s_t) - log pi_old(y_t|s_t)), the negative single-sample (k1) reverse KL (tinker-cookbook's
            incorporate_kl_penalty with kl_penalty_coef 1 and kl_discount_factor 0; verl's PG OPD reward)
      A_t = -control_adv when control_adv > 0: a fixed negative advantage on every sampled token and no teacher signal
            (the control of arXiv 2608.31046)"""
    if control_adv > 0:
        return -control_adv * mask
    return ((teacher_logp - student_logp) * mask).detach()  # mask first: no inf/NaN from padding


def generalized_jsd(student_lp: torch.Tensor, teacher_lp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD per position, [..., V] log-probs -> [...] (TRL's generalized_jsd_loss before masking):
      beta = 0: KL(nu || pi) = sum_v nu (log nu - log pi)                         forward KL
      beta = 1: KL(pi || nu) = sum_v pi (log pi - log nu)                         reverse KL
      else:     beta KL(nu || M) + (1 - beta) KL(pi || M),  M = beta nu + (1 - beta) pi"""
    kl = lambda log_p, log_q: (log_p.exp() * (log_p - log_q)).sum(-1)  # noqa: E731  KL(p || q) over the vocabulary
    if beta == 0:
        return kl(teacher_lp, student_lp)
    if beta == 1:
        return kl(student_lp, teacher_lp)
    log_m = torch.logsumexp(torch.stack([student_lp + math.log(1 - beta), teacher_lp + math.log(beta)]), 0)
    return beta * kl(teacher_lp, log_m) + (1 - beta) * kl(student_lp, log_m)


def topk_forward_kl(student_lp: torch.Tensor, teacher_lp: torch.Tensor, k: int, tail: bool = False, eps: float = 1e-6):
    """Forward KL on the teacher's top-k tokens per position, [..., V] log-probs -> [...] (verl's OPD loss modes):
      forward_kl_topk:      max(0, sum_{v in TopK(nu)} nu(v) (log nu(v) - log pi(v)))
      forward_kl_topk_tail: the same sum, unclamped, + (1 - P_k) log((1 - P_k) / (1 - Q_k)): the exact KL after the
                            tokens outside TopK(nu) are merged into one bucket (>= 0); 1 - Q_k floored at eps
    P_k, Q_k: the teacher's and the student's mass on TopK(nu). Also returns, per position and without gradient,
    teacher_mass P_k, student_mass Q_k and overlap_ratio |TopK(nu) & TopK(pi)| / k (verl's topk metrics)."""
    k = min(k, teacher_lp.shape[-1])
    t_top, ids = teacher_lp.topk(k, -1)
    s_top = student_lp.gather(-1, ids)
    head = (t_top.exp() * (t_top - s_top)).sum(-1)
    p_k, q_k = t_top.exp().sum(-1), s_top.exp().sum(-1)
    if tail:
        p_tail = (1 - p_k).clamp(min=0)
        loss = head + torch.xlogy(p_tail, p_tail) - p_tail * torch.log((1 - q_k).clamp(min=eps))
    else:
        loss = head.clamp(min=0)
    overlap = (ids[..., :, None] == student_lp.topk(k, -1).indices[..., None, :]).any(-1).float().sum(-1) / k
    return loss, {"teacher_mass": p_k.detach(), "student_mass": q_k.detach(), "overlap_ratio": overlap}


def distribution_terms(student_head, teacher_heads: tuple, student_hidden: torch.Tensor, teacher_hiddens: tuple,
                       route: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None,
                       loss: str, jsd_beta: float, topk: int, topk_tail: bool) -> tuple[torch.Tensor, ...]:
    """The full-distribution loss at N completion positions from the student's and the teachers' final hidden states
    [N, H]: the distributions log_softmax(logits / T) over the first vocab_size logits (all: None), float32, the
    teachers' without gradient, position n taking teacher route[n]'s (MOPD; one teacher: route all 0). Returns per
    position (divergence, log pi(target), entropy, teacher_mass, student_mass, overlap_ratio), the divergence
    generalized_jsd (`jsd`) or topk_forward_kl (`fkl_topk`; the last three are its metrics, else 0)."""
    student_lp = torch.log_softmax(student_head(student_hidden)[:, :vocab_size].float() / temperature, -1)  # [N, V]
    with torch.no_grad():
        teacher_lp = None
        for k, (head, hidden) in enumerate(zip(teacher_heads, teacher_hiddens)):
            lp = torch.log_softmax(head(hidden)[:, :vocab_size].float() / temperature, -1)
            teacher_lp = lp if teacher_lp is None else torch.where((route == k)[:, None], lp, teacher_lp)
    logp = student_lp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(student_lp.exp() * student_lp).sum(-1)
    if loss == "jsd":
        zero = torch.zeros_like(logp)
        return generalized_jsd(student_lp, teacher_lp, jsd_beta), logp, entropy, zero, zero, zero
    divergence, masses = topk_forward_kl(student_lp, teacher_lp, topk, topk_tail)
    return divergence, logp, entropy, masses["teacher_mass"], masses["student_mass"], masses["overlap_ratio"]


def distribution_losses(policy, teachers: list, row_teacher: torch.Tensor, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor, response_mask: torch.Tensor, temperature: float,
                        vocab_size: int | None, loss: str, jsd_beta: float, topk: int, topk_tail: bool,
                        chunk_size: int = 512):
    """--loss jsd / fkl_topk on one micro-batch of right-padded rows [B, L]: (divergence, log pi, entropy) [B, L-1] at
    the positions t that predict a completion token (response_mask[:, t+1] = 1), 0 elsewhere, and the top-k metrics.
    Row b learns from teachers[row_teacher[b]] (MOPD: every teacher runs on every row, as in --loss pg).
    The models' LM heads run on those positions only, chunk_size at a time, each chunk recomputed in the backward
    pass (as shared/logprobs.py's forward_logprobs): two [chunk_size, V] float32 distributions at a time per teacher,
    not [B, L-1, V] per model."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    keep = response_mask[:, 1:].bool()  # [B, L-1]: position t predicts token t+1
    hidden = []
    for model in (policy, *teachers):  # the models' own forwards, computing the logits of the last position only
        with torch.no_grad() if model is not policy else contextlib.nullcontext():
            out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        output_hidden_states=True, logits_to_keep=1)
        hidden.append(out.hidden_states[-1][:, :-1][keep])  # [N, H]
        del out
    targets = input_ids[:, 1:][keep]
    route = row_teacher.to(keep.device)[:, None].expand_as(keep)[keep]  # [N]: each position's teacher
    teacher_heads = tuple(output_head(t) for t in teachers)
    num_chunks = max_over_ranks(max(1, math.ceil(len(targets) / chunk_size)))  # ZeRO-3: each head call gathers
    chunks = []
    for k in range(num_chunks):
        s = slice(k * chunk_size, (k + 1) * chunk_size)
        chunks.append(checkpoint(distribution_terms, output_head(policy), teacher_heads, hidden[0][s],
                                 tuple(h[s] for h in hidden[1:]), route[s], targets[s], temperature, vocab_size, loss,
                                 jsd_beta, topk, topk_tail, use_reentrant=False, preserve_rng_state=False))
    terms = []
    for values in zip(*chunks):
        full = hidden[0].new_zeros(keep.shape, dtype=torch.float32)
        full[keep] = torch.cat(values)
        terms.append(full)
    divergence, logp, entropy, p_k, q_k, overlap = terms
    masses = {"teacher_mass": p_k, "student_mass": q_k, "overlap_ratio": overlap} if loss == "fkl_topk" else {}
    return divergence, logp, entropy, masses


def compared_vocab_size(student_rows: int, teacher_rows: int, num_tokens: int,
                        field: str = "teacher_model_name_or_path") -> int | None:
    """The logits the full-distribution losses compare: all of them (None) when the student's and the teacher's
    embeddings have as many rows; else the tokenizer's num_tokens real tokens, the rows above them being padding that
    no token id reaches (Qwen2.5: 151,936 rows at 0.5B-3B, 152,064 at 7B, 151,665 tokens). A tokenizer with more tokens
    than a model has rows is a one-line error naming `field`."""
    if student_rows == teacher_rows:
        return None
    if num_tokens > min(student_rows, teacher_rows):
        raise ValueError(f"{field}: the tokenizer has {num_tokens} tokens, but the student's "
                         f"embedding has {student_rows} rows and the teacher's {teacher_rows}")
    return num_tokens


def check_same_vocabulary(student_tok, teacher_tok, field: str = "teacher_model_name_or_path") -> None:
    """The teacher scores the student's token ids, so both tokenizers must map every token to the same id and share
    bos/eos/pad ids: a one-line error naming `field` and the first difference (equal sizes do not imply equal ids)."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student_tok, name) != getattr(teacher_tok, name):
            raise ValueError(f"{field}: the teacher's {name} is {getattr(teacher_tok, name)}, the "
                             f"student's {getattr(student_tok, name)} (the teacher must share the tokenizer)")
    s_vocab, t_vocab = student_tok.get_vocab(), teacher_tok.get_vocab()
    for token in sorted(set(s_vocab) | set(t_vocab), key=lambda t: (s_vocab.get(t, t_vocab.get(t)), t)):
        if s_vocab.get(token) != t_vocab.get(token):
            raise ValueError(f"{field}: token {token!r} has id {t_vocab.get(token)} in the "
                             f"teacher's vocabulary, {s_vocab.get(token)} in the student's (it must share the tokenizer)")


def parse_teachers(entries: tuple[str, ...], default: str) -> dict[str, str]:
    """--teachers `name=path` entries -> {name: path}, in order; none: {"default": default} (the single teacher).
    One-line errors for an entry without `=`, an empty name or path, and a name given twice."""
    if not entries:
        return {"default": default}
    teachers = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"teachers: expected name=path, got {entry!r}")
        if name in teachers:
            raise ValueError(f"teachers: the name {name!r} is given twice")
        teachers[name] = path
    return teachers


def teacher_routes(rows: list[dict], column: str, names: list[str], where: str) -> list[int]:
    """MOPD: each row's teacher, the index in `names` of the value of its `column` (TRL's `teacher_id`); with one
    teacher every row goes to it (no column needed). A row without the column, or naming no teacher, is a one-line
    error naming the row (a misrouted row would silently learn from the wrong teacher)."""
    if len(names) == 1:
        return [0] * len(rows)
    index = {name: k for k, name in enumerate(names)}
    routes = []
    for i, row in zip(data_utils.row_numbers(rows), rows):
        if column not in row:
            raise ValueError(f"teacher_column: {where} row {i} has no column {column!r} (--teachers routes each row "
                             f"by it; the row has {sorted(row)})")
        if str(row[column]) not in index:
            raise ValueError(f"teacher_column: {where} row {i} names teacher {row[column]!r}, not one of --teachers "
                             f"({', '.join(names)})")
        routes.append(index[str(row[column])])
    return routes


def teacher_prompt_text(prompt: str, answer: str, template: str) -> str:
    """--teacher_context reference: the teacher's prompt text, `template` with {prompt} the student's prompt text
    (after --prompt_template) and {answer} the row's gold answer. Only the teacher reads it; the student samples
    from its own prompt (OPSD, arXiv 2601.18734: the privileged context in the teacher's prompt only)."""
    return template.replace("{answer}", answer).replace("{prompt}", prompt)


def align_completions(logp: torch.Tensor, src_prompt_lens: list[int], dst_prompt_lens: list[int],
                      completion_lens: list[int], like: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of the same completions moved from one row layout to another, [B, Ls-1] -> like [B, L-1]:
    completion token k of row i sits at column p - 1 + k of a layout whose prompt has p tokens, so the teacher's
    log-probs on [teacher prompt | completion] land on the student's [prompt | completion] columns of the same token;
    0 elsewhere."""
    out = torch.zeros_like(like)
    for i, (sp, dp, n) in enumerate(zip(src_prompt_lens, dst_prompt_lens, completion_lens)):
        out[i, dp - 1 : dp - 1 + n] = logp[i, sp - 1 : sp - 1 + n]
    return out


def select_teacher(teacher_logps: list[torch.Tensor], routes: torch.Tensor) -> torch.Tensor:
    """MOPD: row i's log-probs from teacher routes[i], [K] x [B, T] -> [B, T] (one teacher: its log-probs)."""
    return torch.stack(teacher_logps)[routes, torch.arange(len(routes))]


def context_teacher_logprobs(teachers: list, teacher_prompt_ids: list[list[int]], local_idx: list[int],
                             prompts: list[list[int]], comps: list, old_logp: torch.Tensor, pad_id: int, device,
                             num_micro: int, args) -> list[torch.Tensor]:
    """--teacher_context reference: each teacher's log-probs of the completions after its own prompt (the row's
    teacher_prompt_ids, G completions per prompt of local_idx), [teacher prompt | the same completion tokens], moved
    onto the student's columns (align_completions), [K] x [B, T]."""
    teacher_prompts = [teacher_prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
    t_ids, t_attn, t_resp = data_utils.pad_batch(teacher_prompts, [c.token_ids for c in comps], pad_id, device)
    return [align_completions(t, [len(p) for p in teacher_prompts], [len(p) for p in prompts],
                              [len(c.token_ids) for c in comps], old_logp)
            for t in batch_logprobs(teachers, t_ids, t_attn, t_resp, t_attn.sum(1).tolist(), num_micro,
                                    args.micro_batching, args.temperature)]


def teacher_metrics(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, row_teacher: torch.Tensor,
                    names: list[str], info) -> dict:
    """MOPD's per-teacher metrics, reduced over ranks: opd/teacher_token_frac/<name>, the teacher's share of the
    step's generated tokens, and opd/teacher_kl/<name>, the student's reverse KL to it on those tokens."""
    per = torch.stack([torch.stack([(mask * (row_teacher == k).to(mask)[:, None]).sum(),
                                    ((old_logp - teacher_logp) * mask * (row_teacher == k).to(mask)[:, None]).sum()])
                       for k in range(len(names))]).cpu()
    per = info.all_reduce(per)
    return {**{f"opd/teacher_token_frac/{n}": (per[k, 0] / per[:, 0].sum().clamp(min=1)).item()
               for k, n in enumerate(names)},
            **{f"opd/teacher_kl/{n}": (per[k, 1] / per[k, 0].clamp(min=1)).item() for k, n in enumerate(names)}}


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
    if args.reward_coef > 0 and args.num_generations < 2:
        raise ValueError("num_generations: the task reward's group advantage (--reward_coef) needs at least 2 "
                         "completions per prompt (with 1 every advantage is 0)")
    if args.advantage_estimator != "grpo" and args.advantage_scaling != "group":
        raise ValueError(f"advantage_scaling: applies to --advantage_estimator grpo only ({args.advantage_estimator} "
                         "has its own normalisation)")
    if args.advantage_estimator == "maxrl" and args.reward_model_path:
        raise ValueError("advantage_estimator: maxrl needs rewards 0 or 1 (a grader), not a reward model's scores")
    if args.policy_loss.startswith("dppo") and args.importance_level != "token":
        raise ValueError("importance_level: dppo_tv and dppo_kl mask single tokens (use --importance_level token)")
    if args.control_adv > 0 and args.loss != "pg":
        raise ValueError("control_adv: the fixed negative advantage replaces the teacher's in --loss pg only")
    if args.teachers and args.self_distillation:
        raise ValueError("self_distillation: the teacher is the student's start model; it does not combine with "
                         "--teachers")
    if args.teacher_context == "reference":
        if args.loss != "pg":
            raise ValueError(f"teacher_context: the teacher's own prompt works with --loss pg, not --loss {args.loss}")
        for key in ("{answer}", "{prompt}"):
            if key not in args.teacher_template:
                raise ValueError(f"teacher_template: has no {key} (the teacher reads the question and its reference "
                                 f"answer), got {args.teacher_template!r}")


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
    rm_path = resolve_model_path(args.reward_model_path, "reward_model_path") if args.reward_model_path else ""
    tokenizer = load_tokenizer(model_path)
    # the teachers: one (--teacher_model_name_or_path, or the student's start model with --self_distillation) or
    # several (--teachers, MOPD), each reading the student's token ids, so each passes the vocabulary check
    field = "teachers" if args.teachers else "teacher_model_name_or_path"
    teacher_paths = {name: model_path if args.self_distillation else resolve_model_path(path, field)
                     for name, path in parse_teachers(args.teachers, args.teacher_model_name_or_path).items()}
    vocab_sizes = set()
    for name, path in teacher_paths.items():
        where = f"{field} {name}" if args.teachers else field
        check_same_vocabulary(tokenizer, load_tokenizer(path), where)
        vocab_sizes.add(compared_vocab_size(AutoConfig.from_pretrained(model_path).vocab_size,  # padded embeddings:
                                            AutoConfig.from_pretrained(path).vocab_size, len(tokenizer), where))
    vocab_size = vocab_sizes.pop() if len(vocab_sizes) == 1 else len(tokenizer)  # the real tokens
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    # train / held-out / dev prompts and the grader (None with a reward model and no gold answers: no accuracy)
    train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer, rm_path)
    # MOPD: each train row's teacher; the split's rows are checked as in the file, so an error names the file's row
    if len(teacher_paths) > 1:
        teacher_routes(data_utils.load_rows(args.dataset, args.train_split), args.teacher_column, list(teacher_paths),
                       f"dataset {args.dataset!r} split {args.train_split!r}")
    routes = teacher_routes(train_data.rows, args.teacher_column, list(teacher_paths), "the train split")
    if args.teacher_context == "reference":  # the teacher's prompt: the student's with the gold answer in it
        if train_data.rows and "answer" not in train_data.rows[0]:
            raise ValueError("teacher_context: reference needs the gold answer column (--answer_key)")
        teacher_prompt_ids = [data_utils.encode_prompt(tokenizer, teacher_prompt_text(
            data_utils.format_prompt(row["prompt"], args.prompt_template), row["answer"], args.teacher_template),
            args.chat_template) for row in train_data.rows]
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    headline = "eval/accuracy" if reward_fn else "eval/reward"  # the held-out number printed at start and end

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.top_p < 1.0:  # with --tis none only (shared/cli.py)
        tracker.write("warning: top_p < 1 makes the trainer's log-probs differ from the sampler's; "
                      "val/sampler_kl and the TIS ratios show how much")
    if args.loss == "jsd" and args.beta > 0:  # TRL's GKD calls the JSD mix beta
        tracker.write(f"note: --beta {args.beta:g} is the KL coefficient to the start model (grpo.py's); the JSD mix "
                      f"is --jsd_beta ({args.jsd_beta:g})")
    tracker.write(task_summary(train_data, eval_data, dev_data, args.num_steps, args.batch_size))

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
    reward_model = load_reward_model(rm_path, tokenizer, info, dtype) if rm_path else None  # frozen
    # the reference is only loaded when the KL term is used (no NaN KL when beta = 0); LoRA: the policy, adapters off
    ref_policy = load_reference(policy, model_path, dtype, info, bool(args.lora_r)) if args.beta > 0 else None
    fp32_lm_head([policy, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
    # the teachers: frozen (eval mode, requires_grad False), outside the optimizer; ZeRO-3 partitions them
    teachers = [prepare_frozen(load_causal_lm(path, dtype), info, dtype) for path in teacher_paths.values()]
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

    def evaluate(step: int) -> dict:  # grader accuracy, pass@k, RM score on eval and dev (shared/evaluation.py)
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                    args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                    seed=eval_seed(args.seed), reward_model=reward_model,
                                    pad_id=tokenizer.pad_token_id, micro_batch_size=args.local_micro_batch_size)
        return {**metrics, **best.update(metrics, step, policy)}  # keeps the best policy (on dev) in output_dir/best

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG
    engines = {"policy": policy}
    resumable = {"sampler": sampler, "guard": guard, "best": best}  # saved and restored with each checkpoint
    start_step, state = ckpt.restore(engines, **resumable)
    first_eval = state.get("first_eval")
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    def rollout(step: int) -> tuple[list[int], list, list[str], list[float]]:
        """1. rollout and 2. reward: this rank's slice of the next num_prompts prompts, G samples each (global prompt i
        seeded by index i), scored. Returns its prompt indices, completions ([P_local * G]), texts and rewards."""
        with timer("generate"):
            global_idx = sampler.next_indices(args.num_prompts)
            local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
            outs = generator.generate([train_data.prompt_ids[i] for i in local_idx], n=args.num_generations,
                                      temperature=args.temperature, top_p=args.top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919 + step,
                                      index_offset=info.rank * args.local_num_prompts)
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU for training (the sync replaces the weights)
        return (local_idx, *score(step, local_idx, outs))

    def score(step: int, local_idx: list[int], outs: list) -> tuple[list, list[str], list[float]]:
        """2. reward of a rollout's samples: completions (prompt-major: [P_local * G]), texts, rewards."""
        comps = [c for group in outs for c in group]  # prompt-major: [P_local * G]
        rows = [train_data.rows[i] for i in local_idx for _ in range(args.num_generations)]
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        with timer("reward"):  # the reward model's score, else the grader's (raising: save step - 1, stop)
            texts = [decode(c.token_ids) for c in comps]
            scores = score_completions(reward_fn, reward_model, rows, prompts, comps, texts, tokenizer.pad_token_id,
                                       info, args.local_micro_batch_size, ckpt.user_code(step, engines, tracker))
        return comps, texts, scores

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:  # the held-out value before training, logged with the train set's size
        first_eval = tracker.log_start(evaluate(0), headline, len(train_data.rows), train_data.num_filtered)
    policy.train()
    local_idx: list[int] = []
    same_rows = args.teacher_context == "none"  # the teachers score the student's own rows (no prompt of their own)
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, first_eval=first_eval)
        # 1. rollout and 2. reward (rollout() above): this rank's slice of the global prompt batch, G samples each
        local_idx, comps, texts, scores = rollout(step)

        # 3. tensors: [prompt | completion | pad], response mask from lengths (pad == eos safe)
        prompts = [train_data.prompt_ids[i] for i in local_idx for _ in range(args.num_generations)]
        input_ids, attn, resp = data_utils.pad_batch(prompts, [c.token_ids for c in comps], tokenizer.pad_token_id,
                                                     info.device)
        lengths = attn.sum(1).tolist()  # tokens per row: --micro_batching groups rows by them

        # 4. log-probs before the update, one forward of each model: the student's (pi_old: the ratio, TIS and A_t) and
        # the teacher's (A_t), both log_softmax(logits / T) at the rollout temperature, and the reference's (KL term)
        mask = completion_mask(resp, torch.tensor([c.finished for c in comps]), args.mask_truncated_completions)
        sampler_logp = data_utils.sampler_logprobs([len(p) for p in prompts], [c.logprobs for c in comps], mask)
        # (each teacher scores every row; row i keeps its own teacher's, routes[i], MOPD). With --teacher_context
        # reference the teachers read [teacher prompt | the same completion tokens], moved onto the student's columns
        with timer("logprob"):  # micro-batches of the whole batch, laid out as in training; zeros for a None
            num_micro = args.local_batch_size // args.local_micro_batch_size
            old_logp, ref_logp, *teacher_logps = batch_logprobs(
                [policy, ref_policy, *(teachers if same_rows else [])], input_ids, attn, resp, lengths, num_micro,
                args.micro_batching, args.temperature)
            if not same_rows:
                teacher_logps = context_teacher_logprobs(teachers, teacher_prompt_ids, local_idx, prompts, comps,
                                                         old_logp, tokenizer.pad_token_id, info.device, num_micro, args)
            row_teacher = torch.tensor([routes[i] for i in local_idx for _ in range(args.num_generations)])
            teacher_logp = select_teacher(teacher_logps, row_teacher.to(info.device))

        # 5. advantages per token: the teacher's A_t (or the control's -c) with --loss pg, plus reward_coef x the task
        # reward's advantage, computed on the global batch so that `batch` scaling uses every rank's rewards
        adv_tok = opd_advantages(teacher_logp, old_logp, mask, args.control_adv) if args.loss == "pg" else 0 * mask
        all_scores = torch.tensor(sum(info.gather_objects(scores), []), dtype=torch.float32)
        all_scores = all_scores.view(args.num_prompts, args.num_generations)
        zero_std_groups = (all_scores.std(1) == 0).float().mean().item()
        task_adv = {}  # the task reward's advantage metrics, with --reward_coef
        if args.reward_coef > 0:
            token_counts = None
            if args.advantage_estimator == "reinforce_pp_baseline":  # whitening weighs completions by trained tokens
                token_counts = torch.tensor(sum(info.gather_objects(mask.sum(1).tolist()), []))
                token_counts = token_counts.view(args.num_prompts, args.num_generations)
            all_adv = compute_advantages(all_scores, args.advantage_scaling, estimator=args.advantage_estimator,
                                         token_counts=token_counts)
            adv = all_adv.view(-1)[info.rank * args.local_batch_size : (info.rank + 1) * args.local_batch_size]
            adv_tok = adv_tok + args.reward_coef * adv.to(info.device)[:, None] * mask
            task_adv = {"val/advantages_mean": all_adv.mean().item(), "val/advantages_std": all_adv.std().item()}

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
                        divergence, masses = torch.zeros_like(m_mask), {}
                        if args.loss == "pg":
                            logp, entropy = micro_batch_logprobs(policy, input_ids[idx], attn[idx], resp[idx],
                                                                 args.micro_batching, args.temperature, True)
                        else:  # both models' whole distributions on the completion positions, in chunks
                            divergence, logp, entropy, masses = distribution_losses(
                                policy, teachers, row_teacher[idx], input_ids[idx], attn[idx], resp[idx],
                                args.temperature, vocab_size, args.loss, args.jsd_beta, args.topk, args.topk_tail)
                        logp_old = old_logp[idx]
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
                        per_token = pg * w + divergence  # the divergence: --loss jsd / fkl_topk, same aggregator
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
                                         "loss/divergence_avg": mm(divergence),
                                         "val/ratio": mm(ratio), "val/ratio_var": mm((ratio - mm(ratio)) ** 2),
                                         **{f"opd/{k}": mm(v) for k, v in masses.items()}}.items():
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
                      "optim/grad_norm": sum(grad_norms) / max(len(grad_norms), 1)})
        on = adv_tok[mask.bool()].tolist() or [0.0]  # this rank's generated tokens: the teacher's view, the advantages
        local.update({"opd/teacher_kl": ((old_logp - teacher_logp) * mask).sum().item() / max(len(on), 1),
                      "opd/adv_mean": sum(on) / len(on), "opd/adv_abs_mean": sum(map(abs, on)) / len(on)})
        metrics = info.mean_over_ranks(local)
        if len(teachers) > 1:  # MOPD: each teacher's share of the step's generated tokens and its reverse KL there
            metrics.update(teacher_metrics(old_logp, teacher_logp, mask, row_teacher, list(teacher_paths), info))
        ext = info.gather_objects((min(on), max(on)))
        metrics.update({"opd/adv_min": min(e[0] for e in ext), "opd/adv_max": max(e[1] for e in ext)})
        metrics.update({"val/frac_reward_zero_std": zero_std_groups, **task_adv, "lr": scheduler.get_last_lr()[0],
                        "episode": step * args.batch_size, "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
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
    metrics.update(check_ranks(policy, info, local_idx))
    metrics.update(check_engine(generator, policy, eval_data.prompt_ids[:4], info, args.max_new_tokens))
    tracker.log_end(metrics, args.num_steps, headline, first_eval)
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
