"""RePULSe: Reducing the Probability of Undesirable Low-reward Sequences, with its baselines. Docs: docs/repulse.md

Paper: S. Zhao, A. Li, R. Brekelmans, R. Grosse, "Reducing the Probability of Undesirable Outputs in Language
Models Using Probabilistic Inference", NeurIPS 2025, https://arxiv.org/abs/2510.21184. Reference code:
github.com/Silent-Zebra/RePULSe @ a6e8812 (a fork of OpenRLHF).

Plain RL lowers the probability of a bad output only when it is sampled, so rare bad outputs stop being
pushed down (the tail problem). RePULSe trains a proposal LM q_xi to sample from the low-reward target

    sigma_theta(s|x) ∝ p_theta(s|x) exp(beta r(x,s))        (code's sign: beta < 0 targets LOW reward)

and adds to the policy's RL loss alpha times a "-SFT" term that pushes log p_theta down on the q samples,
self-normalised-importance-weighted towards sigma_theta. Three models: p_theta (trained,
--learning_rate), q_xi (a copy of the initial model trained with Contrastive Twist Learning and
the proposal-centric twist log psi_t = log q(s_t|.) - sg log p(s_t|.), --proposal_learning_rate), and a
frozen p_0 for the KL penalty (loaded only when --beta > 0). Per step (docs/repulse.md, "The math, as implemented"):
    S_p ~ p, S_q ~ q (same prompts, N each); R = r' - c_KL sum_t (log p - log p_0); b = RLOO baseline
    1) q step: CTL loss on S_q (own Adam, grad clip)
    2) p step: mean[mean_t(-log p) (R - b)] + alpha mean[w mean_t(log p)] on S_p / S_q (own Adam, grad clip)
Losses use per-token MEANS and average over all J*N samples, as the reference, so its alpha transfers
(alpha_eff = alpha / N). Delta from REINFORCE/RLOO (the p step with alpha = 0, grpo.py's sampling
plumbing): the proposal, its CTL step and the weighted negative term. Modes (docs/repulse.md):
    --objective reinforce --alpha 0                                      REINFORCE (RLOO)
    --objective reinforce --reward_transform minus_alpha_exp_beta_r      r' = r - alpha exp(beta r)
    --use_base_as_proposal                                               p_theta as the proposal (ablation)
    (defaults)                                                           RePULSe
--total_episodes counts every completion sampled for training (p and q), the paper's x-axis, so RePULSe
gets half as many p updates as the baselines for the same budget (the paper's compute matching).

With no flags: the toy (shared/toy.py): builtin:tiny-sft, the prompt "This man is a", 2 generated tokens,
a classifier-like reward (lowest, in [-4, -3.3], when a "bad" character appears; `--reward_fn toy`: an
indicator reward); the exact log P(bad) of p_theta is computed by enumerating the ~100-token vocabulary after
every step. Launch:
    python algorithms/repulse.py                                    # CPU toy, RePULSe, about 75 s
    python algorithms/repulse.py --objective reinforce --alpha 0    # the REINFORCE baseline on the toy
    python scripts/experiments/repulse_toy.py                                   # the three methods x 3 seeds + plot
    python scripts/experiments/repulse_toy.py --paper --hours 3                 # the paper's toy settings, resumable (hours)
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/repulse.py   # several processes
    # the paper's settings on SmolLM-135M-Instruct with a reward model: docs/repulse.md, "Usage"
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared import toy
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, exact_div, full_named_parameters,
                                init_distributed, load_causal_lm, load_tokenizer, prepare,
                                prepare_frozen, seed_everything)
from shared.generation import HFGenerator, completion_decoder, make_generator, stop_token_ids
from shared.logprobs import forward_logprobs as lean_logprobs, fp32_lm_head
from shared.rewards import load_reward_fn, probe_reward_fn, score_completions
from shared.scalar import load_reward_model
from shared.models import resolve_model_path
from shared.toy import exact_log_prob_bad
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "repulse"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (init, data order, sampling)"""
    output_dir: str = "runs/repulse"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint of p_theta (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """hub name or local path of the initial LM (p_theta, q_xi and p_0 all start from it)"""
    dataset: str = "toy"
    """`toy` (the single prompt of shared/toy.py), `builtin`, a local .jsonl/.json/.parquet file, or a hub dataset"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for evaluation (the toy uses its single prompt)"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """dataset column holding the answer given to a verifiable reward function"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """`toy_classifier`, `toy` (shared/toy.py), `builtin`, `gsm8k`, `math`, `math_verify`, `module:function`; `auto` by dataset"""
    reward_model_path: str = ""
    """score prompt + completion with this reward model (rm.py, genrm.py, implicit_prm.py; HF classifier) instead"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["hf", "vllm"] = "hf"
    """backend sampling p_theta: `hf` (model.generate) or `vllm`; q_xi is always sampled with `hf` (one engine/rank)"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    vllm_enable_sleep: bool = False
    """put vLLM to sleep during training to free GPU memory (GPU only)"""
    fp32_lm_head: bool = False
    """run the LM head's matmul in fp32 in both the trainer and the sampler: less mismatch, a slower head"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the training forwards"""
    save_model: bool = True
    """save the final p_theta as an HF checkpoint in output_dir/final"""

    # reliability (shared/checkpoint.py; docs/repulse.md#reliability)
    save_every: Annotated[int, Ge(0)] = 20
    """save a resumable checkpoint in output_dir/checkpoints every this many steps (0: only on SIGTERM/SIGINT/stop_after_steps)"""
    keep_checkpoints: Annotated[int, Ge(1)] = 2
    """how many of the most recent checkpoints to keep in output_dir/checkpoints"""
    resume: str = "auto"
    """`auto`: resume the latest checkpoint if any; `yes`: must; `no`: must not; `overwrite`: start afresh; or a checkpoint dir"""
    stop_after_steps: Annotated[int, Ge(0)] = 0
    """save a checkpoint and exit after this many steps of this invocation (0: run to the end); for time-limited jobs"""
    max_nonfinite_steps: Annotated[int, Ge(0)] = 10
    """optimizer steps with a non-finite loss or gradient are skipped and counted; abort the run after this many"""
    best_metric: str = "dev/p_bad:min"
    """dev metric that picks output_dir/best (`name:min`: lower is better, as the default, exact on the toy; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 30_000
    """completions sampled for training, from p and q together (RePULSe: 2N per prompt per step)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """Adam learning rate of the policy p_theta (constant; the reference code's `base_actor_learning_rate`)"""
    proposal_learning_rate: Annotated[float, Gt(0)] = 3e-4
    """Adam learning rate of the proposal q_xi (constant; the reference code's `actor_learning_rate`)"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm, applied to each model separately"""
    num_generations: Annotated[int, Ge(1)] = 250
    """N: samples per prompt, from p and (separately) from q; the reference's `duplicate_rollout_batch_by`; > 1"""
    local_num_prompts: Annotated[int, Ge(1)] = 1
    """prompts per rank per step (local_batch_size = local_num_prompts * num_generations)"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 250
    """completions per forward/backward on each rank (HF `per_device_train_batch_size`)"""
    max_new_tokens: Annotated[int, Ge(1)] = 2
    """completion length limit T (the toy's exact P(bad) needs T <= 2)"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    objective: Literal["neg_training", "reinforce"] = "neg_training"
    """`neg_training`: RL term + alpha * weighted -SFT term (RePULSe, p-proposal); `reinforce`: RL term only"""
    alpha: Annotated[float, Ge(0)] = 10.0
    """alpha: weight of the negative term (code units: the term is a mean over J*N samples, alpha_eff = alpha/N)"""
    target_dist_beta: Annotated[float, Interval()] = -10.0  # any real number
    """beta (code sign): log phi = beta * r, sigma ∝ p exp(beta r); beta < 0 targets low reward (paper's -beta)"""
    use_base_as_proposal: bool = False
    """use p_theta itself as the proposal (ablation): S_q := S_p, weights ≈ softmax(beta r), no q model"""
    reward_transform: Literal["none", "minus_alpha_exp_beta_r"] = "none"
    """`none` or `minus_alpha_exp_beta_r`: r' = r - rew_trans_alpha * exp(rew_trans_beta * r) in the RL term only"""
    rew_trans_alpha: Annotated[float | None, Interval()] = None  # any real number
    """alpha of the reward transform (default: --alpha)"""
    rew_trans_beta: Annotated[float | None, Interval()] = None  # any real number
    """beta of the reward transform (default: --target_dist_beta)"""
    beta: Annotated[float, Ge(0)] = 0.0
    """c_KL = 1/beta_KL: fixed coefficient of the summed k1 KL(p_theta || p_0) subtracted from the return"""
    code_compat_unmasked_neg_weights: bool = False
    """reproduce the reference's UNMASKED sum of log p_theta in the negative term's weights (see docs/repulse.md)"""
    eta: Annotated[float, Interval()] = -1.0  # any real number
    """bad-output threshold for evaluation: P(bad) = fraction of held-out samples with r < eta"""
    cvar_level: Annotated[float, Interval(gt=0, le=1)] = 0.01
    """a: CVaR_a = mean of the k = max(1, floor(a M)) lowest rewards among the M held-out samples"""
    eval_every: Annotated[int, Ge(0)] = 20
    """evaluate by held-out sampling every this many steps (0: only before and after training)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 500
    """held-out prompts per evaluation (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts held out (<= 10%) that pick output_dir/best (0: none); the toy's one prompt is its own dev set"""
    eval_num_samples: Annotated[int, Ge(1)] = 1000
    """samples per held-out prompt"""
    sample_every: Annotated[int, Ge(0)] = 20
    """log a table of sample completions (p and q) every this many steps"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_prompts: tyro.conf.Suppress[int] = 0
    samples_per_step: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: algorithm-local pure functions (docs/repulse.md; all tensors of one rank, samples prompt-major [J*N])
def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                     chunk_size: int = 512, entropy_out: list | None = None) -> torch.Tensor:
    """log pi(token_{t+1} | prefix) at temperature 1 where mask[:, t] = 1 (mask [B, L-1], aligned with the output: the
    response mask resp[:, 1:]), [B, L-1], 0 elsewhere: shared/logprobs.py's lean forward pass. With entropy_out, the
    policy's entropy at the same positions ([B, L-1], detached) is appended to it."""
    response_mask = torch.nn.functional.pad(mask, (1, 0))  # [B, L]: the token each kept position predicts
    logp, entropy = lean_logprobs(model, input_ids, attention_mask, response_mask, 1.0, entropy_out is not None,
                                  chunk_size=chunk_size)
    if entropy_out is not None:
        entropy_out.append(entropy.detach())
    return logp


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over response tokens, [B] (the reference's length normalisation)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def rloo_baseline(returns: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline b_i = (sum_k R_k - R_i) / (N - 1) per prompt; returns [J, N]."""
    n = returns.shape[-1]
    if n < 2:
        raise ValueError("num_generations: the RLOO baseline needs at least 2 samples per prompt")
    return (returns.sum(-1, keepdim=True) - returns) / (n - 1)


def transform_reward(r: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """`minus_alpha_exp_beta_r`: r' = r - alpha exp(beta r); beta = -1, alpha = 1 gives r - e^{-r}."""
    return r - alpha * torch.exp(beta * r)


def kl_return(reward: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
              beta: float) -> torch.Tensor:
    """R = r' - c_KL sum_t m_t (log p_old - log p_0) (k1 estimator, no gradient), [B]."""
    return reward - beta * ((logp_old - logp_ref) * mask).sum(-1)


def snis_weights(logp_sum: torch.Tensor, log_phi: torch.Tensor, logq_sum: torch.Tensor) -> torch.Tensor:
    """Self-normalised importance weights towards sigma ∝ p phi from samples of q, detached.

    All inputs [J, N]: log w~ = log p + log phi - log q, softmax over the N samples of each prompt."""
    return torch.softmax((logp_sum + log_phi - logq_sum).detach().float(), dim=-1)


def neg_weight_logp_sum(logp: torch.Tensor, mask: torch.Tensor, unmasked: bool) -> torch.Tensor:
    """Sum of log p_theta over a sample's response, as used in the negative term's weights, [B].

    Masked (default): sum_t m_t log p_t, the paper's log p(s|x). unmasked=True reproduces the reference code:
    it sums the last A = max response length positions ending at each response's last token, so
    a shorter response also counts the log-probs of its last prompt tokens (the reference's right-aligned
    batch; prompt positions before the sequence start, the reference's zero padding, are not modelled)."""
    if not unmasked:
        return (logp * mask).sum(-1)
    lengths = mask.sum(-1).long()
    end = mask.shape[-1] - torch.flip(mask, dims=[-1]).argmax(-1)  # one past the last response position
    width = int(lengths.max().item())
    pos = torch.arange(mask.shape[-1], device=mask.device)[None, :]
    window = ((pos >= (end - width)[:, None]) & (pos < end[:, None])).to(logp.dtype)
    return (logp * window).sum(-1)


def ctl_weights(logp: torch.Tensor, logq_old: torch.Tensor, log_phi: torch.Tensor, mask: torch.Tensor,
                num_generations: int):
    """The two detached SNIS weights of the CTL estimator, on q samples, [J*N] and [J*N, T].

    logp = log p_theta (current, no grad), logq_old = log q at sampling time, both [J*N, T] per response token.
    w_sigma = softmax_i(sum_t lp + log phi - sum_t lq_old)                        (full-sequence target)
    w_pi_t  = softmax_i(cumsum_t lp + log psi_t - cumsum_t lq_old), log psi_t = lq_t - lp_t (q current = q old)
            = softmax_i(sum_{k<t} (lp_k - lq_k))                                    (prefix weight for pi_t)"""
    lp, lq = logp * mask, logq_old * mask
    N = num_generations
    w_sigma = snis_weights(lp.sum(-1).view(-1, N), log_phi.view(-1, N), lq.sum(-1).view(-1, N)).view(-1)
    log_psi = lq - lp
    log_w_pi = lp.cumsum(-1) + log_psi - lq.cumsum(-1)  # [J*N, T]
    w_pi = torch.softmax(log_w_pi.view(-1, N, lp.shape[-1]).detach().float(), dim=1).view_as(lp)
    return w_sigma, w_pi


def ctl_loss(logq: torch.Tensor, logp: torch.Tensor, w_sigma: torch.Tensor, w_pi: torch.Tensor,
             mask: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """CTL with the proposal-centric twist (paper Eqs. 6-7; reference `CTLLoss`): gradient only through log q.

    sum_i masked_mean_t( -(w_sigma_i - w_pi_it) log psi_it ) / num_seqs, log psi = log q - sg log p.
    The -w_sigma term is E_sigma[grad log psi]; the +w_pi term is E_pi_t[grad log psi_t] (zero in expectation)."""
    log_psi = (logq - logp.detach()) * mask
    per_token = -(w_sigma[:, None] - w_pi) * log_psi
    return masked_mean(per_token, mask).sum() / num_seqs


def rl_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """REINFORCE with a baseline: sum_i masked_mean_t(-log p_it) (R_i - b_i) / num_seqs."""
    return (masked_mean(-logp, mask) * advantages.detach()).sum() / num_seqs


def neg_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The "-SFT" term: sum_i w_i masked_mean_t(log p_it) / num_seqs; minimising it lowers log p on the
    weighted (low-reward) samples. With num_seqs = J*N this is (1/N) x the SNIS estimate."""
    return (weights.detach() * masked_mean(logp, mask)).sum() / num_seqs


def tail_metrics(rewards: torch.Tensor, eta: float, level: float) -> dict:
    """P(bad) = fraction with r < eta; CVaR_a = mean of the k = max(1, floor(a M)) lowest rewards."""
    k = max(1, int(math.floor(level * rewards.numel())))
    return {"p_bad": (rewards < eta).float().mean().item(), "cvar": rewards.sort().values[:k].mean().item()}


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.num_generations < 2:
        raise ValueError("num_generations: RLOO and the SNIS weights need at least 2 samples per prompt")
    if args.use_base_as_proposal and args.objective != "neg_training":
        raise ValueError("use_base_as_proposal: only meaningful with --objective neg_training")


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    validate(args)
    info = init_distributed()
    sample_q = args.objective == "neg_training" and not args.use_base_as_proposal  # separate proposal samples
    args.world_size = info.world_size
    args.local_batch_size = args.local_num_prompts * args.num_generations
    args.batch_size = args.local_batch_size * info.world_size
    args.num_prompts = args.local_num_prompts * info.world_size
    args.samples_per_step = args.batch_size * (2 if sample_q else 1)
    # the micro-batch is a memory cap: a batch smaller than it is one micro-batch
    args.local_micro_batch_size = min(args.local_micro_batch_size, args.local_batch_size)
    grad_accum_q = exact_div(args.local_batch_size, args.local_micro_batch_size,
                             "local_micro_batch_size: local_num_prompts * num_generations / local_micro_batch_size")
    grad_accum_p = grad_accum_q * (2 if sample_q else 1)  # the p step sees S_p (RL term) and S_q (neg term)
    args.num_steps = args.total_episodes // args.samples_per_step
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one step ({args.samples_per_step})")
    rt_alpha = args.alpha if args.rew_trans_alpha is None else args.rew_trans_alpha
    rt_beta = args.target_dist_beta if args.rew_trans_beta is None else args.rew_trans_beta

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for init and data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: the toy's single prompt, or prompts of a dataset; validated before anything is written
    model_path = resolve_model_path(args.model_name_or_path)
    rm_path = resolve_model_path(args.reward_model_path, "reward_model_path") if args.reward_model_path else ""
    tokenizer = load_tokenizer(model_path)
    if args.dataset == "toy":
        rows = toy.toy_rows()
        ids = [data_utils.encode_prompt(tokenizer, data_utils.format_prompt(r["prompt"], args.prompt_template),
                                        args.chat_template) for r in rows]
        train_data = eval_data = data_utils.PromptData(rows, ids)
        dev_data = eval_data if args.dev_num_prompts else data_utils.PromptData([], [])  # fresh samples, own seed
    else:
        load = lambda split, limit=None, part=None: data_utils.load_prompts(  # noqa: E731
            args.dataset, split, tokenizer, args.prompt_key, args.answer_key, args.prompt_template,
            args.chat_template, args.max_prompt_length, limit=limit, num_dev=args.dev_num_prompts if part else 0,
            part=part or "train")
        train_data, eval_data = load(args.train_split, part="train"), load(args.eval_split, args.eval_num_prompts)
        dev_data = load(args.train_split, part="dev")  # selects output_dir/best; never the reported eval set
    sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    reward_spec = (toy.REWARDS[0] if args.dataset == "toy" else "auto") if args.reward_fn == "auto" else args.reward_fn
    toy_reward = reward_spec in toy.REWARDS
    reward_fn = toy.make_toy_reward(tokenizer, reward_spec) if toy_reward else load_reward_fn(reward_spec, args.dataset)
    probe_reward_fn(reward_fn, train_data.rows)
    bad_ids = toy.bad_token_ids(tokenizer) if toy_reward and not args.reward_model_path else None
    exact = bad_ids is not None and args.dataset == "toy" and args.max_new_tokens <= 2

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    tracker.write(f"{len(train_data.rows)} train prompts, {len(eval_data.rows)} eval prompts, {len(dev_data.rows)} dev "
                  f"prompts, {args.num_steps} steps "
                  f"of {args.samples_per_step} samples ({'p and q' if sample_q else 'p only'})")

    # models and optimizers: p_theta, q_xi (a copy of the initial LM), frozen p_0 and reward model
    dtype = default_dtype(info.device)

    def trainable(lr: float, grad_accum: int):
        model = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
        optim = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                 fused=True)
        return prepare(model, optim, None, info, args.local_micro_batch_size, grad_accum, args.max_grad_norm, dtype)[0]

    policy = trainable(args.learning_rate, grad_accum_p)
    proposal = trainable(args.proposal_learning_rate, grad_accum_q) if sample_q else None
    ref_policy = prepare_frozen(load_causal_lm(model_path, dtype), info, dtype) if args.beta > 0 else None
    fp32_lm_head([policy, proposal, ref_policy], args.fp32_lm_head)  # --fp32_lm_head: fp32 output layers
    reward_model = load_reward_model(rm_path, tokenizer, info, dtype) if rm_path else None  # frozen
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))  # p_theta

    # generation engines: p with the chosen backend, q with HF generate on the live proposal
    generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                               dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                               world_size=info.world_size, zero_stage=info.zero_stage,
                               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                               enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop, fp32_lm_head=args.fp32_lm_head)
    stop_ids = stop_token_ids(model_path, tokenizer)  # EOS and generation_config's eos ids
    q_generator = HFGenerator(proposal.module, tokenizer, synced_gpus=info.zero_stage == 3, stop_token_ids=stop_ids,
                              stop=args.stop) if sample_q else None
    # tokens that end a completion when sampled first, for the exact P(bad): stop ids and single-token stop strings
    end_ids = stop_ids + ([t for t in range(len(tokenizer)) if t not in stop_ids
                           and any(s in tokenizer.decode([t]) for s in args.stop)] if args.stop and exact else [])
    decode = completion_decoder(tokenizer, args.stop)  # text for rewards and logs: EOS skipped, cut at --stop
    mb = args.local_micro_batch_size

    def batched(fn, *tensors):  # fn over micro-batches of rows, concatenated
        return torch.cat([fn(*(t[s : s + mb] for t in tensors)) for s in range(0, tensors[0].shape[0], mb)])

    def score(prompt_rows, prompt_ids, comps) -> torch.Tensor:  # the reward model's or the reward function's
        texts = [decode(c.token_ids) for c in comps]
        return torch.tensor(score_completions(reward_fn, reward_model, prompt_rows, prompt_ids, comps, texts,
                                              tokenizer.pad_token_id, info, mb), dtype=torch.float32)

    def rollout(gen, prompt_idx, data, n, seed, offset, on_reward_error=None):
        """Sample n completions per prompt; tensors [B, L] and the [B, L-1] response mask, rewards [B].
        `on_reward_error`: ckpt.user_code(...), so a reward function that raises saves a checkpoint and stops."""
        outs = gen.generate([data.prompt_ids[i] for i in prompt_idx], n=n, temperature=1.0, top_p=1.0,
                            max_new_tokens=args.max_new_tokens, seed=seed, index_offset=offset)
        comps = [c for group in outs for c in group]
        rows = [data.rows[i] for i in prompt_idx for _ in range(n)]
        input_ids, attn, resp = data_utils.pad_batch([data.prompt_ids[i] for i in prompt_idx for _ in range(n)],
                                                     [c.token_ids for c in comps], tokenizer.pad_token_id, info.device)
        mask = resp[:, 1:].float()  # position t predicts token t+1; EOS included
        with on_reward_error or contextlib.nullcontext():
            r = score(rows, [data.prompt_ids[i] for i in prompt_idx for _ in range(n)], comps)
        return comps, input_ids, attn, mask, r

    def logprobs(model, input_ids, attn, mask):  # no grad; every token when the neg weights read prompt positions
        scored = attn[:, 1:] if args.code_compat_unmasked_neg_weights else mask
        with torch.no_grad():
            return batched(lambda i, a, m: forward_logprobs(model, i, a, m), input_ids, attn, scored)

    def evaluate(step: int, on_reward_error=None) -> dict:  # on_reward_error: makes a fresh ckpt.user_code
        """Sampling from p_theta on the held-out set (eval/) and the dev slice (dev/, selects output_dir/best):
        P(bad), CVaR, mean reward and return; exact log P(bad) on the toy."""
        out = {}
        if exact:
            out["exact/log_p_bad"] = exact_log_prob_bad(policy, eval_data.prompt_ids[0], bad_ids, end_ids,
                                                        args.max_new_tokens)
        out |= measure(eval_data, "eval", args.seed + 1_000_003, on_reward_error)
        if dev_data.rows:
            out |= measure(dev_data, "dev", args.seed + 2_000_003, on_reward_error)
            if exact:  # the toy: the exact P(bad); the sampled fraction is 0, so constant, once P(bad) << 1/samples
                out["dev/p_bad_sampled"], out["dev/p_bad"] = out["dev/p_bad"], math.exp(out["exact/log_p_bad"])
        return {**out, **best.update(out, step, policy)}  # keeps the best p_theta (on dev) in output_dir/best

    def measure(data, prefix: str, seed: int, on_reward_error) -> dict:
        per_rank = math.ceil(len(data.rows) / info.world_size)
        own = list(range(info.rank * per_rank, min(len(data.rows), (info.rank + 1) * per_rank)))
        # every rank evaluates per_rank prompts (its own, then copies of prompt 0 whose results are dropped), so all
        # ranks make the same generate calls and forwards, as ZeRO-3 requires (the toy has 1 prompt for 2+ ranks)
        idx = own + [0] * (per_rank - len(own))
        keep = len(own) * args.eval_num_samples
        _, ids, attn, mask, r = rollout(generator, idx, data, args.eval_num_samples, seed=seed,
                                        offset=info.rank * per_rank,
                                        on_reward_error=on_reward_error() if on_reward_error else None)
        ret = r
        if ref_policy is not None:
            ret = kl_return(r, logprobs(policy, ids, attn, mask).cpu(), logprobs(ref_policy, ids, attn, mask).cpu(),
                            mask.cpu(), args.beta)
        r, ret = r[:keep], ret[:keep]
        r = torch.cat([torch.tensor(x) for x in info.gather_objects(r.tolist())])
        ret = torch.cat([torch.tensor(x) for x in info.gather_objects(ret.tolist())])
        tail = tail_metrics(r, args.eta, args.cvar_level)
        return {f"{prefix}/p_bad": tail["p_bad"], f"{prefix}/cvar": tail["cvar"],
                f"{prefix}/mean_reward": r.mean().item(), f"{prefix}/mean_return": ret.mean().item(),
                f"{prefix}/num_samples": float(r.numel())}

    # TRY NOT TO MODIFY: resume: p_theta and q_xi (weights, optimizers), data position, RNG
    engines = {"policy": policy, **({"proposal": proposal} if proposal is not None else {})}
    resumable = {"sampler": sampler, "guard": guard, "best": best}  # saved and restored with each checkpoint
    start_step, state = ckpt.restore(engines, **resumable)
    first = state.get("first")
    if start_step:  # the engine was built from model_path: give it the resumed weights
        generator.sync_weights(full_named_parameters(policy, info))

    # training loop
    timer = Timer()
    start = time.time()
    if start_step == 0:
        metrics = evaluate(0)
        if exact:
            metrics["exact/log_q_bad"] = metrics["exact/log_p_bad"]
        tracker.log({**metrics, "episode": 0, "data/train_prompts": len(train_data.rows),
                     "data/skipped_too_long": train_data.num_filtered}, 0)
        tracker.write("[step 0] " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        first = metrics
    policy.train()
    N = args.num_generations
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, first=first)
        # 1. rollouts (no grad): S_p ~ p_theta and S_q ~ q_xi on the same prompts, N each (a reward function that
        # raises saves step - 1 and stops the run)
        with timer("generate"):
            global_idx = sampler.next_indices(args.num_prompts)
            local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
            offset = info.rank * args.local_num_prompts
            comps_p, ids_p, attn_p, mask_p, r_p = rollout(generator, local_idx, train_data, N,
                                                          args.seed * 7_919 + step, offset,
                                                          ckpt.user_code(step, engines, tracker))
            if sample_q:
                comps_q, ids_q, attn_q, mask_q, r_q = rollout(q_generator, local_idx, train_data, N,
                                                              args.seed * 7_919 + step + 500_000_003, offset,
                                                              ckpt.user_code(step, engines, tracker))
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU; the sync after the update reloads it
        r_p, mask_p = r_p.to(info.device), mask_p
        # 2. log-probs at sampling time (the current p and q, before either update)
        with timer("logprob"):
            lp_old = logprobs(policy, ids_p, attn_p, mask_p)  # [B, L-1] log p_theta on S_p
            lref = logprobs(ref_policy, ids_p, attn_p, mask_p) if ref_policy is not None else lp_old
            if sample_q:
                lq_old = logprobs(proposal, ids_q, attn_q, mask_q)  # log q at sampling time
                lpq = logprobs(policy, ids_q, attn_q, mask_q)  # log p_theta on S_q (pre-update)
                r_q = r_q.to(info.device)
            else:  # p-proposal: S_q := S_p, log q_old := log p_old
                ids_q, attn_q, mask_q, r_q, lq_old, lpq, comps_q = ids_p, attn_p, mask_p, r_p, lp_old, lp_old, comps_p
        # 3. return with KL penalty and reward transform (p samples only), RLOO baseline per prompt
        r_prime = transform_reward(r_p, rt_alpha, rt_beta) if args.reward_transform != "none" else r_p
        R = kl_return(r_prime, lp_old, lref, mask_p, args.beta)
        adv = (R.view(-1, N) - rloo_baseline(R.view(-1, N))).view(-1)
        # 4. SNIS weights of the negative term towards sigma ∝ p exp(beta r) (log phi never transformed)
        log_phi_q = args.target_dist_beta * r_q
        if args.objective == "neg_training":
            lp_sum = neg_weight_logp_sum(lpq, mask_q, args.code_compat_unmasked_neg_weights)
            w_neg = snis_weights(lp_sum.view(-1, N), log_phi_q.view(-1, N),
                                 (lq_old * mask_q).sum(-1).view(-1, N)).view(-1)
        else:
            w_neg = torch.zeros_like(r_p)

        # 5. q step (CTL), its own optimizer, before the p step
        stats = {"ctl": 0.0, "rl": 0.0, "neg": 0.0}
        norms_q, norms_p, entropies = [], [], []  # entropies: p_theta's, [B, L-1] per micro-batch of the p step
        with timer("train"):
            if sample_q:
                w_sigma, w_pi = ctl_weights(lpq, lq_old, log_phi_q, mask_q, N)
                for s in range(0, args.local_batch_size, mb):
                    sl = slice(s, s + mb)
                    logq = forward_logprobs(proposal, ids_q[sl], attn_q[sl], mask_q[sl])
                    loss = ctl_loss(logq, lpq[sl], w_sigma[sl], w_pi[sl], mask_q[sl], args.local_batch_size)
                    guard.backward(proposal, loss)
                    norm = guard.step(proposal)  # a non-finite loss or gradient skips the step (counted)
                    norms_q += [norm] if norm is not None else []
                    stats["ctl"] += loss.item()
            # 6. p step: RL term on S_p (+ neg term on the same rows for p-proposal), then neg term on S_q
            for s in range(0, args.local_batch_size, mb):
                sl = slice(s, s + mb)
                logp = forward_logprobs(policy, ids_p[sl], attn_p[sl], mask_p[sl], entropy_out=entropies)
                loss = rl_loss(logp, mask_p[sl], adv[sl], args.local_batch_size)
                stats["rl"] += loss.item()
                if args.use_base_as_proposal:
                    neg = neg_loss(logp, mask_p[sl], w_neg[sl], args.local_batch_size)
                    stats["neg"] += neg.item()
                    loss = loss + args.alpha * neg
                guard.backward(policy, loss)
                norm = guard.step(policy)
                norms_p += [norm] if norm is not None else []
            if sample_q:
                for s in range(0, args.local_batch_size, mb):
                    sl = slice(s, s + mb)
                    logp = forward_logprobs(policy, ids_q[sl], attn_q[sl], mask_q[sl])
                    neg = neg_loss(logp, mask_q[sl], w_neg[sl], args.local_batch_size)
                    stats["neg"] += neg.item()
                    guard.backward(policy, args.alpha * neg)
                    norm = guard.step(policy)
                    norms_p += [norm] if norm is not None else []

        # 7. weight sync: push the updated p_theta into its generation engine (HF: no-op)
        with timer("sync"):
            generator.sync_weights(full_named_parameters(policy, info))

        # 8. log (reduced over ranks once per step)
        bad_p, bad_q = (r_p < args.eta).float().mean().item(), (r_q < args.eta).float().mean().item()
        ess = (1.0 / (w_neg.view(-1, N) ** 2).sum(-1)).mean().item() / N if args.objective == "neg_training" else 0.0
        local = {
            "objective/scores": r_p.mean().item(),
            "objective/returns": R.mean().item(),
            "objective/kl": ((lp_old - lref) * mask_p).sum(-1).mean().item(),
            "objective/frac_bad": bad_p,
            "objective/entropy": (torch.cat(entropies) * mask_p).sum().item() / mask_p.sum().clamp(min=1).item(),
            "loss/policy_avg": stats["rl"], "loss/neg_avg": stats["neg"], "loss/proposal_avg": stats["ctl"],
            "proposal/scores": r_q.mean().item(), "proposal/frac_bad": bad_q, "proposal/ess_frac": ess,
            "val/advantages_std": adv.std().item(),
            "val/sequence_lengths": mask_p.sum(-1).mean().item(),
            "optim/grad_norm_p": sum(norms_p) / max(len(norms_p), 1),
            "optim/grad_norm_q": sum(norms_q) / max(len(norms_q), 1),
        }
        metrics = info.mean_over_ranks(local)
        metrics.update({"episode": step * args.samples_per_step, "optim/nonfinite_skipped": guard.skipped,
                        **timer.pop()})
        if exact:
            metrics["exact/log_p_bad"] = exact_log_prob_bad(policy, eval_data.prompt_ids[0], bad_ids, end_ids,
                                                            args.max_new_tokens)
            model_q = proposal if sample_q else policy
            metrics["exact/log_q_bad"] = exact_log_prob_bad(model_q, eval_data.prompt_ids[0], bad_ids, end_ids,
                                                            args.max_new_tokens)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"):
                metrics.update(evaluate(step, lambda: ckpt.user_code(step, engines, tracker, trained=True,
                                                                     **resumable, first=first)))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, reward=metrics["objective/scores"], log_p_bad=metrics.get("exact/log_p_bad"))
        if args.sample_every and step % args.sample_every == 0:
            rows = [{"model": "p", "completion": decode(comps_p[i].token_ids), "reward": r_p[i].item()}
                    for i in range(0, len(comps_p), max(1, N // 4))]
            rows += [{"model": "q", "completion": decode(comps_q[i].token_ids), "reward": r_q[i].item(),
                      "weight": w_neg[i].item()} for i in w_neg.topk(min(4, len(w_neg))).indices.tolist()]
            tracker.log_samples(rows, step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, **resumable, first=first)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)

    metrics = evaluate(args.num_steps, lambda: ckpt.user_code(args.num_steps, engines, tracker, trained=True,
                                                              **resumable, first=first))
    metrics["time/total"] = time.time() - start
    final = ""  # saved before the end-of-run checks, so a failure there loses nothing
    if args.save_model:
        final = str(save_hf(policy, tokenizer, os.path.join(args.output_dir, "final"), info))
    metrics.update(check_ranks(policy, info, local_idx))
    if proposal is not None:
        metrics["check/proposal_ranks_identical_weights"] = check_ranks(proposal, info, [])["check/ranks_identical_weights"]
    tracker.log(metrics, args.num_steps)
    summary = " ".join(f"{k} {first[k]:.4g} -> {metrics[k]:.4g}" for k in
                       ("exact/log_p_bad", "eval/p_bad", "eval/mean_reward") if k in metrics)
    tracker.write(f"{summary} in {metrics['time/total']:.0f}s")
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
