"""DPO: Direct Preference Optimization, with cDPO, robust DPO, IPO, hinge, DPO-Positive, SimPO and ORPO. Docs: docs/dpo.md

Paper: Rafailov et al. 2023, https://arxiv.org/abs/2305.18290. No reward model and no sampling during
training: on pairs (x, y_w, y_l) the policy's log-likelihood ratio to a frozen reference is pushed up on
the chosen response and down on the rejected one. With s(y) = sum of response-token log-probs,

    delta = [s_theta(y_w) - s_ref(y_w)] - [s_theta(y_l) - s_ref(y_l)]
    sigmoid (DPO)   -log sigmoid(beta delta)
    cdpo            -(1-eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)        (label smoothing)
    robust          [-(1-eps) log sigmoid(beta delta) + eps log sigmoid(-beta delta)] / (1 - 2 eps)
    hinge (SLiC)    relu(1 - beta delta)
    ipo             (delta' - 1/(2 beta))^2, delta' from length-averaged log-ratios (TRL) or summed
    dpop (DPO+)     cdpo on z = delta - lambda max(0, s_ref(y_w) - s_theta(y_w))   (Pal et al. 2024)

and two losses without a reference model, on length-averaged log-probs a(y) = s_theta(y) / |y|:

    simpo           -log sigmoid(beta (a(y_w) - a(y_l)) - gamma)                      (Meng et al. 2024; TRL's CPO)
    orpo            -a(y_w) - lambda log sigmoid(log odds(y_w) - log odds(y_l)),  odds(y) = e^a / (1 - e^a)  (Hong et al. 2024)

Pairs come from an offline preference dataset (`--pair_source offline`), or are generated from the
starting policy and graded (`--pair_source self_generated`, VinePPO's DPO+ baseline: sample, mark samples
with reward >= 0.5 correct, pair every correct with every incorrect sample of a prompt, subsample).
Reference log-probs are computed once before training and cached (`--precompute_ref_logps`, the default),
or by a frozen reference model on the fly.

With no flags it trains the built-in SFT warm start with DPO-Positive on the built-in preference pairs
(correct running sums vs one arithmetic slip) and reports held-out task accuracy and implicit-reward
accuracy. DPO-Positive is the default because plain DPO (`--loss_type sigmoid`) lowers the likelihood of the
chosen responses along with the rejected ones and, measured here, the task accuracy (docs/dpo.md).

Launch:
    python algorithms/dpo.py                                    # CPU, built-in pairs, about 1.5 minutes
    python algorithms/dpo.py --pair_source self_generated --loss_type dpop --logit_temperature 0.6
    python algorithms/dpo.py --loss_type simpo --beta 2.0 --simpo_gamma 1.0       # no reference model (SimPO; orpo too)
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/dpo.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \
        --eval_split test --learning_rate 5e-7 --total_episodes 60000 --local_micro_batch_size 4 \
        --gradient_accumulation_steps 4 --max_seq_length 1024 --eval_num_prompts 0
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Annotated, Literal
from pathlib import Path

import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, safe_load, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, full_named_parameters, init_distributed,
                                load_causal_lm, load_tokenizer, prepare, prepare_frozen, seed_everything)
from shared.evaluation import evaluate_accuracy
from shared.generation import completion_decoder, make_generator
from shared.logprobs import forward_logprobs
from shared.lora import adapters_disabled, add_lora, check_lora
from shared.rewards import compute_rewards, load_reward_fn, probe_reward_fn
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "dpo"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (data order, sampling)"""
    output_dir: str = "runs/dpo"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """policy to train: hub name or local path; `builtin:tiny-sft` is the built-in warm start"""
    ref_model_name_or_path: str = ""
    """frozen reference policy (default: the starting policy itself)"""
    dataset: str = "builtin"
    """`builtin` (task and pairs; `builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split: task accuracy (needs answers) and implicit-reward accuracy (needs pairs)"""
    prompt_key: str = "prompt"
    """column holding the prompt (text or messages; optional for conversational chosen/rejected)"""
    chosen_key: str = "chosen"
    """column holding the preferred response (text, or a conversation ending with the assistant reply)"""
    rejected_key: str = "rejected"
    """column holding the dispreferred response"""
    answer_key: str = "answer"
    """column holding the gold answer (held-out accuracy; grading of self-generated pairs)"""
    prompt_template: str = "{prompt}"
    """template applied to text prompts; `{prompt}` is replaced by the dataset prompt"""
    response_template: str = "{response}"
    """template applied to each offline response text"""
    chat_template: bool = False
    """wrap text prompts with the tokenizer's chat template (conversational rows always use it)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """pairs or prompts whose prompt is longer than this many tokens are skipped (and counted)"""
    max_seq_length: Annotated[int, Ge(1)] = 512
    """pairs whose prompt + longer response exceed this many tokens are skipped (and counted)"""
    reward_fn: str = "auto"
    """grader (held-out accuracy, self-generated pairs): `auto`, `builtin`, `gsm8k`, `math`, `math_verify` or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend for self-generated pairs and evaluation: `vllm` (colocated) or `hf`"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    vllm_enable_sleep: bool = False
    """put vLLM to sleep during training to free GPU memory (GPU only)"""
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

    # reliability (shared/checkpoint.py; docs/dpo.md#reliability)
    save_every: Annotated[int, Ge(0)] = 150
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
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none); `dev/rewards/accuracies` if no answers"""

    # algorithm args
    loss_type: Literal["sigmoid", "cdpo", "robust", "hinge", "ipo", "dpop", "simpo", "orpo"] = "dpop"
    """`sigmoid` (DPO), `cdpo`, `robust`, `hinge`, `ipo`, `dpop` (DPO-Positive; the default: docs/dpo.md), `simpo`, `orpo`"""
    beta: Annotated[float, Ge(0)] = 0.1
    """beta: strength of the implicit KL to the reference (TRL 0.1; VinePPO DPO+ 0.1 MATH / 0.3 GSM8K)"""
    label_smoothing: Annotated[float, Interval(ge=0, lt=0.5)] = 0.0
    """eps: probability that a label is flipped, for cdpo / robust / dpop (must be 0 for sigmoid, hinge, ipo)"""
    dpop_lambda: Annotated[float, Ge(0)] = 50.0
    """lambda of DPO-Positive: weight of max(0, s_ref(y_w) - s_theta(y_w)) (VinePPO 50)"""
    simpo_gamma: Annotated[float, Ge(0)] = 0.5
    """gamma of SimPO: the target margin of beta-scaled average log-probs (TRL's CPOConfig default)"""
    orpo_lambda: Annotated[float, Ge(0)] = 0.1
    """lambda of ORPO: weight of the log-odds-ratio term beside the chosen NLL (TRL's ORPOConfig `beta`, 0.1)"""
    ipo_length_normalize: bool = True
    """IPO on length-averaged log-ratios (TRL, confirmed with the IPO authors); off: summed (OpenRLHF; docs/dpo.md)"""
    logit_temperature: Annotated[float, Gt(0)] = 1.0
    """divide policy and reference logits by this (VinePPO DPO+ uses its sampling temperature 0.6; TRL 1)"""
    precompute_ref_logps: bool = True
    """compute reference log-probs once before training (no reference model in memory) instead of on the fly"""
    total_episodes: Annotated[int, Ge(1)] = 28800
    """number of preference pairs to consume (epochs = total_episodes / number of pairs)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """peak learning rate (linear warm-up, cosine decay to 10%); 1e-6 to 5e-7 suits 0.5B-7B models"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up (VinePPO 3%)"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """pairs per forward pass on each rank (chosen and rejected go through one forward: 2x sequences)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""

    # self-generated pairs (pair_source=self_generated)
    pair_source: Literal["offline", "self_generated"] = "offline"
    """`offline`: pairs from the dataset's chosen/rejected columns; `self_generated`: sample and grade (DPO+)"""
    num_generation_prompts: Annotated[int, Ge(0)] = 2048
    """train prompts to sample from for self-generated pairs (0: all)"""
    num_generations: Annotated[int, Ge(1)] = 16
    """samples per prompt for self-generated pairs (VinePPO 64)"""
    generation_temperature: Annotated[float, Gt(0)] = 0.6
    """sampling temperature for self-generated pairs (VinePPO 0.6)"""
    generation_top_p: Annotated[float, Interval(gt=0, le=1)] = 0.9
    """nucleus sampling for self-generated pairs (VinePPO 0.9)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit (self-generated pairs and evaluation)"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    correct_threshold: Annotated[float, Interval()] = 0.5  # any real number
    """a sample is correct if its reward is >= this (VinePPO 0.5)"""
    max_pairs_per_prompt: Annotated[int, Ge(1)] = 64
    """at most this many (correct, incorrect) pairs per prompt, drawn without replacement (VinePPO 64)"""

    # evaluation
    eval_every: Annotated[int, Ge(0)] = 150
    """evaluate every this many optimizer steps (0: only before and after training)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 500
    """held-out prompts for task accuracy, a fixed-seed sample, the same every run (0, or no answer column: skip)"""
    eval_num_samples: Annotated[int, Ge(1)] = 4
    """samples per held-out prompt"""
    eval_temperature: Annotated[float, Ge(0)] = 1.0
    """sampling temperature for held-out accuracy"""
    eval_num_pairs: Annotated[int, Ge(0)] = 500
    """held-out pairs for implicit-reward accuracy (0: skip; needs chosen/rejected columns in eval_split); a fixed-seed sample"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts kept out of training (<= 10%) whose accuracy (offline: and pair accuracy) picks output_dir/best"""
    num_sample_completions: Annotated[int, Ge(0)] = 4
    """held-out completions written to samples.jsonl (and printed) at each evaluation"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: sequence log-probs, the preference losses, self-generated pairs
def sequence_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   temperature: float = 1.0, chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """s(y) = sum over response tokens of log pi(y_t | x, y_<t) from logits / temperature, and |y|; both [B].
    The per-token log-probs are shared/logprobs.py's, the LM head run on the response positions only
    (docs/performance.md#memory-of-the-log-probs)."""
    logp, _ = forward_logprobs(model, input_ids, attention_mask, response_mask, temperature, chunk_size=chunk_size)
    mask = response_mask[:, 1:].bool().to(logp.dtype)  # position t predicts token t+1
    return (logp * mask).sum(1), mask.sum(1)


def preference_loss(pol_w: torch.Tensor, pol_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor,
                    loss_type: str, beta: float, label_smoothing: float = 0.0, dpop_lambda: float = 50.0,
                    len_w: torch.Tensor | None = None, len_l: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair loss, [B], from summed log-probs (docs/dpo.md's loss table). len_w/len_l make IPO length-averaged."""
    eps = label_smoothing
    delta = (pol_w - ref_w) - (pol_l - ref_l)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "cdpo":
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        if len_w is not None and len_l is not None:
            delta = (pol_w - ref_w) / len_w - (pol_l - ref_l) / len_l
        return (delta - 1 / (2 * beta)) ** 2
    if loss_type == "dpop":
        z = delta - dpop_lambda * torch.relu(ref_w - pol_w)
        return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)
    raise ValueError(f"loss_type: expected sigmoid, cdpo, robust, hinge, ipo or dpop, got {loss_type!r}")


REFERENCE_FREE = ("simpo", "orpo")  # losses on the policy's own length-averaged log-probs: no reference model


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reference_free_loss(avg_w: torch.Tensor, avg_l: torch.Tensor, loss_type: str, beta: float,
                        simpo_gamma: float = 0.5, orpo_lambda: float = 0.1,
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss, [B], from length-averaged log-probs a(y) = s_theta(y) / |y| (no reference model).
    simpo: -(1-eps) log sigmoid(z) - eps log sigmoid(-z), z = beta (a_w - a_l) - gamma  (TRL's CPO `simpo`)
    orpo:  -a_w - lambda log sigmoid(log odds_w - log odds_l), log odds = a - log(1 - e^a)  (TRL's ORPO, whose NLL
           term is the token mean over the batch's chosen responses: equal when the responses have one length)"""
    eps = label_smoothing
    if loss_type == "simpo":
        z = beta * (avg_w - avg_l) - simpo_gamma
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type == "orpo":
        log_odds = (avg_w - avg_l) - (log1mexp(avg_w) - log1mexp(avg_l))
        return -avg_w - orpo_lambda * F.logsigmoid(log_odds)
    raise ValueError(f"loss_type: expected simpo or orpo, got {loss_type!r}")


def make_pairs(samples: list[tuple[list[int], float]], threshold: float, max_pairs: int,
               rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """VinePPO DPO+ pairs of one prompt: every (correct, incorrect) pair of its samples, where correct means
    reward >= threshold, subsampled without replacement to at most max_pairs. [] if either side is empty."""
    correct = [ids for ids, r in samples if r >= threshold]
    wrong = [ids for ids, r in samples if r < threshold]
    pairs = [(c, w) for c in correct for w in wrong]
    return rng.sample(pairs, max_pairs) if len(pairs) > max_pairs else pairs


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.pair_source == "self_generated" and args.num_generations < 2:
        raise ValueError("num_generations: self-generated pairs need at least 2 samples per prompt")
    if args.beta <= 0:
        raise ValueError(f"beta: must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: must be in [0, 0.5), got {args.label_smoothing}")
    if args.label_smoothing and args.loss_type in ("sigmoid", "hinge", "ipo", "orpo"):
        raise ValueError(f"label_smoothing: not used by loss_type={args.loss_type}; use --loss_type cdpo "
                         "(conservative DPO), robust, dpop or simpo")
    if args.loss_type in REFERENCE_FREE and args.ref_model_name_or_path:
        raise ValueError(f"ref_model_name_or_path: loss_type={args.loss_type} uses no reference model")


def unique_prompts(pairs: data_utils.PreferenceData, answer_key: str) -> data_utils.PromptData:
    """The distinct prompts of `pairs` that carry a gold answer (column answer_key), for task accuracy."""
    seen: dict[tuple, dict] = {}
    for row, ids in zip(pairs.rows, pairs.prompt_ids):
        if answer_key and row.get(answer_key) not in (None, ""):
            seen.setdefault(tuple(ids), {**row, "answer": str(row[answer_key])})
    return data_utils.PromptData(list(seen.values()), [list(k) for k in seen])

def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    validate(args)
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")

    # TRY NOT TO MODIFY: seeding (same seed on every rank for init and data order)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003

    # data: held-out prompts (task accuracy), held-out pairs (implicit-reward accuracy), training pairs or the
    # prompts to sample them from; validated before anything is written (bad-row policy:
    # shared/data.py::load_preferences)
    model_path = resolve_model_path(args.model_name_or_path)
    ref_path = resolve_model_path(args.ref_model_name_or_path, "ref_model_name_or_path") \
        if args.ref_model_name_or_path else model_path
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    decode = completion_decoder(tokenizer, args.stop)  # text for rewards and logs: EOS skipped, cut at --stop
    load = dict(tokenizer=tokenizer, prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                rejected_key=args.rejected_key, prompt_template=args.prompt_template,
                response_template=args.response_template, use_chat_template=args.chat_template,
                max_prompt_length=args.max_prompt_length, max_seq_length=args.max_seq_length)
    load_prompts = lambda split, limit, part=None: data_utils.load_prompts(  # noqa: E731
        args.dataset, split, tokenizer, args.prompt_key, args.answer_key, args.prompt_template, args.chat_template,
        args.max_prompt_length, limit=limit, num_dev=args.dev_num_prompts if part else 0,
        part=part or "train")
    # task accuracy needs gold answers: a plain prompt/chosen/rejected dataset is evaluated on its pairs only
    graded = args.eval_num_prompts > 0 and data_utils.has_column(args.dataset, (args.eval_split,), args.answer_key)
    eval_data = load_prompts(args.eval_split, args.eval_num_prompts) if graded else None
    held_out = None
    if args.eval_num_pairs:
        held_out = data_utils.load_preferences(args.dataset, args.eval_split, limit=args.eval_num_pairs, **load)
    # the dev slice (selects output_dir/best, never the reported eval set): prompts of the train split, with their
    # pairs when offline (grouped by prompt, so no dev prompt is trained on)
    dev_pairs = data_utils.PreferenceData([], [], [], [])
    if args.pair_source == "offline":
        train = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts, **load)
        dev_pairs = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts,
                                                part="dev", **load)
        dev_data = unique_prompts(dev_pairs, args.answer_key)  # task accuracy on them, if they carry answers
    else:
        prompts = load_prompts(args.train_split, args.num_generation_prompts or None, part="train")
        dev_data = load_prompts(args.train_split, None, part="dev")
    needs_grader = graded or args.pair_source == "self_generated"
    reward_fn = load_reward_fn(args.reward_fn, args.dataset) if needs_grader else None
    if reward_fn is not None:
        probe_reward_fn(reward_fn, (eval_data or prompts).rows)
    elif args.best_metric == "dev/accuracy":
        args.best_metric = "dev/rewards/accuracies"  # no grader: the dev pairs' implicit-reward accuracy selects best/

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    if args.eval_num_prompts and not graded:
        tracker.write(f"no {args.answer_key!r} column in {args.eval_split!r}: no task accuracy; held-out pairs are "
                      "evaluated (eval/rewards/accuracies)")

    # models and optimizer
    dtype = default_dtype(info.device)
    policy = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    policy = add_lora(policy, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  fused=True)
    warmup = max(1, int(args.warmup_ratio * args.num_steps))

    def lr_lambda(step: int) -> float:  # linear warm-up, cosine decay to 10% of the peak
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    policy, optimizer, scheduler = prepare(policy, optimizer, scheduler, info, args.local_micro_batch_size,
                                           args.gradient_accumulation_steps, args.max_grad_norm, dtype)
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    has_dev = bool(len(dev_pairs) or (dev_data.rows and reward_fn is not None))
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, has_dev)  # output_dir/best
    generator = None
    if args.eval_num_prompts or args.pair_source == "self_generated" or has_dev and reward_fn is not None:
        generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                                   dtype=dtype, seed=local_seed, max_model_len=args.max_seq_length,
                                   world_size=info.world_size, zero_stage=info.zero_stage,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                                   enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop, lora_sync=args.lora_sync)
    pad_id = tokenizer.pad_token_id
    timer = Timer()

    # training pairs: offline from the dataset, or sampled from the starting policy and graded (DPO+); sampled
    # pairs are kept in output_dir/checkpoints/self_generated_pairs.pt, so a resumed run trains on the same pairs
    pairs_file = Path(args.output_dir) / "checkpoints" / "self_generated_pairs.pt"
    saved_pairs = ckpt.path.parent / pairs_file.name if ckpt.path is not None else None  # the resumed run's
    if args.pair_source == "offline":
        tracker.write(f"{len(train)} training pairs ({train.num_identical} with identical chosen/rejected and "
                      f"{train.num_too_long} over-long skipped)")
        setup = {"data/train_pairs": len(train), "data/skipped_identical": train.num_identical,
                 "data/skipped_too_long": train.num_too_long}
    elif saved_pairs is not None and saved_pairs.exists():
        saved = safe_load(saved_pairs)  # plain lists and numbers: a crafted file is refused, not run
        train = data_utils.PreferenceData(saved["rows"], saved["prompt_ids"], saved["chosen_ids"],
                                          saved["rejected_ids"])
        setup = saved["setup"]
        tracker.write(f"{len(train)} self-generated pairs from {saved_pairs}")
    else:
        with timer("generate_pairs"):
            n = len(prompts.rows)
            per_rank = math.ceil(n / info.world_size)
            mine = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
            outs = generator.generate([prompts.prompt_ids[i] for i in mine], n=args.num_generations,
                                      temperature=args.generation_temperature, top_p=args.generation_top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919,
                                      index_offset=info.rank * per_rank)
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU; each evaluation syncs the weights first
            local_pairs, stats = [], torch.zeros(4, dtype=torch.float64)  # prompts, samples, correct, usable
            error = None  # a reward function that raises on one rank: all ranks stop together (no hang)
            for i, group in zip(mine, outs):
                row = prompts.rows[i]
                try:
                    rewards = compute_rewards(reward_fn, [row["prompt"]] * len(group),
                                              [decode(c.token_ids) for c in group], [row["answer"]] * len(group),
                                              [c.finished for c in group], [row] * len(group))
                except ValueError as e:
                    error = e
                    break
                pairs = make_pairs([(c.token_ids, r) for c, r in zip(group, rewards)], args.correct_threshold,
                                   args.max_pairs_per_prompt, random.Random(args.seed * 1_000_003 + i))
                local_pairs += [(i, c, w) for c, w in pairs if len(prompts.prompt_ids[i]) + max(len(c), len(w))
                                <= args.max_seq_length]
                n_ok = sum(r >= args.correct_threshold for r in rewards)
                stats += torch.tensor([1, len(group), n_ok, float(bool(pairs))], dtype=torch.float64)
            failed = info.all_reduce(torch.tensor([float(error is not None)]), "max").item()
            if failed:
                raise error or ValueError("the reward function failed on another rank while generating pairs")
            info.all_reduce(stats)
            all_pairs = [p for part in info.gather_objects(local_pairs) for p in part]
        if not all_pairs:
            raise ValueError(f"pair_source=self_generated: no prompt had both a correct and an incorrect sample among "
                             f"{args.num_generations} (sample accuracy {stats[2].item() / stats[1].item():.3f})")
        train = data_utils.PreferenceData([prompts.rows[i] for i, _, _ in all_pairs],
                                          [prompts.prompt_ids[i] for i, _, _ in all_pairs],
                                          [c for _, c, _ in all_pairs], [w for _, _, w in all_pairs])
        setup = {"pairs/sample_accuracy": stats[2].item() / stats[1].item(),
                 "pairs/frac_prompts_with_pairs": stats[3].item() / stats[0].item(),
                 "pairs/num_pairs": len(train), "data/train_pairs": len(train), **timer.pop()}
        tracker.write(f"{len(train)} self-generated pairs from {int(stats[0].item())} prompts x "
                      f"{args.num_generations} samples (sample accuracy {setup['pairs/sample_accuracy']:.3f}, "
                      f"{setup['pairs/frac_prompts_with_pairs']:.2f} of prompts have a pair)")
    if args.pair_source == "self_generated" and info.is_main and (ckpt.path is None or not pairs_file.exists()):
        pairs_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rows": train.rows, "prompt_ids": train.prompt_ids, "chosen_ids": train.chosen_ids,
                    "rejected_ids": train.rejected_ids, "setup": setup}, pairs_file.with_suffix(".tmp"))
        pairs_file.with_suffix(".tmp").rename(pairs_file)
    sampler = data_utils.PromptSampler(len(train), args.seed)
    tracker.write(f"{args.num_steps} steps of {args.batch_size} pairs ({args.total_episodes / len(train):.2f} epochs); "
                  f"dev slice: {len(dev_data.rows)} prompts, {len(dev_pairs)} pairs")

    def pair_batch(d: data_utils.PreferenceData, idx: list[int]):
        """[chosen; rejected] of the pairs idx as one right-padded batch of 2B sequences."""
        prompts = [d.prompt_ids[i] for i in idx]
        return data_utils.pad_batch(prompts + prompts, [d.chosen_ids[i] for i in idx] +
                                    [d.rejected_ids[i] for i in idx], pad_id, info.device)

    # reference log-probs: cached once for every pair this run will touch, or a frozen model on the fly
    def reference_logps(model, d: data_utils.PreferenceData, indices: list[int]) -> dict[int, tuple[float, float]]:
        """{pair index: (s_ref(y_w), s_ref(y_l))}. Every rank runs the same number of forwards (ZeRO-3 needs
        it), each on its own slice, and the results are gathered."""
        per_rank = math.ceil(len(indices) / info.world_size)
        mine = indices[info.rank * per_rank : (info.rank + 1) * per_rank]
        mb = args.local_micro_batch_size
        out = {}
        with torch.no_grad():
            for s in range(0, per_rank, mb):
                idx = mine[s : s + mb] or indices[:1]  # a rank with nothing left still joins the forward
                input_ids, attn, resp = pair_batch(d, idx)
                logps, _ = sequence_logps(model, input_ids, attn, resp, args.logit_temperature)
                out.update({i: (logps[j].item(), logps[len(idx) + j].item()) for j, i in enumerate(idx)})
        merged = {}
        for part in info.gather_objects(out):
            merged.update(part)
        return merged

    ref_model = ref_cache = held_out_ref = dev_ref = None
    reference_free = args.loss_type in REFERENCE_FREE  # SimPO, ORPO: no reference model, no reference log-probs
    if not reference_free and (not args.precompute_ref_logps or ref_path != model_path):
        if args.lora_r and ref_path == model_path:  # LoRA: the policy with its adapters disabled (no second copy)
            ref_model = adapters_disabled(policy)
        else:
            ref_model = prepare_frozen(load_causal_lm(ref_path, dtype), info, dtype)
    if args.precompute_ref_logps and not reference_free:
        with timer("ref_logps"):
            order = data_utils.PromptSampler(len(train), args.seed)
            needed = args.num_steps * args.batch_size
            used = list(range(len(train))) if needed >= len(train) else sorted(set(order.next_indices(needed)))
            source = ref_model if ref_model is not None else policy  # before any update, policy == reference
            policy.eval()
            ref_cache = reference_logps(source, train, used)
            if held_out is not None:
                held_out_ref = reference_logps(source, held_out, list(range(len(held_out))))
            if len(dev_pairs):
                dev_ref = reference_logps(source, dev_pairs, list(range(len(dev_pairs))))
            policy.train()
        ref_model = None  # freed: training needs no reference model
        setup.update(timer.pop())

    def ref_for(d, idx, cache, input_ids, attn, resp) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is not None:
            ref = torch.tensor([cache[i] for i in idx], dtype=torch.float32, device=info.device)
            return ref[:, 0], ref[:, 1]
        with torch.no_grad():
            logps, _ = sequence_logps(ref_model, input_ids, attn, resp, args.logit_temperature)
        return logps[: len(idx)], logps[len(idx) :]

    def loss_and_stats(d, idx, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses of pairs idx and their summed stats: pairs, loss, reward acc, chosen/rejected rewards,
        chosen/rejected logps, dpop penalty."""
        input_ids, attn, resp = pair_batch(d, idx)
        logps, lengths = sequence_logps(policy, input_ids, attn, resp, args.logit_temperature)
        pol_w, pol_l = logps[: len(idx)], logps[len(idx) :]
        if reference_free:  # SimPO, ORPO: the rewards are beta times the average log-probs (TRL's CPO and ORPO)
            avg_w, avg_l = pol_w / lengths[: len(idx)], pol_l / lengths[len(idx) :]
            losses = reference_free_loss(avg_w, avg_l, args.loss_type, args.beta, args.simpo_gamma,
                                         args.orpo_lambda, args.label_smoothing)
            ref_w, ref_l = pol_w.detach(), pol_l.detach()  # no DPO-Positive penalty to log
            chosen_r, rejected_r = (args.beta * avg_w).detach(), (args.beta * avg_l).detach()
        else:
            ref_w, ref_l = ref_for(d, idx, cache, input_ids, attn, resp)
            ipo_lengths = (lengths[: len(idx)], lengths[len(idx) :]) if args.ipo_length_normalize else (None, None)
            losses = preference_loss(pol_w, pol_l, ref_w, ref_l, args.loss_type, args.beta, args.label_smoothing,
                                     args.dpop_lambda, *ipo_lengths)
            # TRL's implicit rewards: beta * (s_theta - s_ref)
            chosen_r, rejected_r = (args.beta * (pol_w - ref_w)).detach(), (args.beta * (pol_l - ref_l)).detach()
        with torch.no_grad():
            stats = torch.tensor([len(idx), losses.sum().item(), (chosen_r > rejected_r).sum().item(),
                                  chosen_r.sum().item(), rejected_r.sum().item(), pol_w.sum().item(),
                                  pol_l.sum().item(), torch.relu(ref_w - pol_w).sum().item()], dtype=torch.float64)
        return losses, stats

    def stats_to_metrics(stats: torch.Tensor, prefix: str) -> dict:
        n = stats[0].item()
        v = (stats / n).tolist()
        return {f"{prefix}loss/dpo": v[1], f"{prefix}rewards/accuracies": v[2], f"{prefix}rewards/chosen": v[3],
                f"{prefix}rewards/rejected": v[4], f"{prefix}rewards/margins": v[3] - v[4],
                f"{prefix}logps/chosen": v[5], f"{prefix}logps/rejected": v[6], f"{prefix}dpop/penalty": v[7]}

    def pair_metrics(d, cache, prefix: str) -> dict:
        """Implicit-reward accuracy, margins, loss on the pairs d (each rank a slice)."""
        n = len(d)
        per_rank = math.ceil(n / info.world_size)
        mine = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
        stats = torch.zeros(8, dtype=torch.float64)
        with torch.no_grad():
            for s in range(0, per_rank, args.local_micro_batch_size):
                idx = mine[s : s + args.local_micro_batch_size]
                if not idx:  # ZeRO-3: every rank runs the same number of forwards
                    loss_and_stats(d, [0], cache)
                    continue
                _, st = loss_and_stats(d, idx, cache)
                stats += st
        info.all_reduce(stats)
        return stats_to_metrics(stats, prefix)

    def evaluate(step: int) -> dict:
        """Task accuracy with the grader and implicit-reward accuracy on pairs, on the held-out set (eval/) and the
        dev slice (dev/); the best policy on dev."""
        metrics = {}
        policy.eval()
        if held_out is not None:
            metrics.update(pair_metrics(held_out, held_out_ref, "eval/"))
        if len(dev_pairs):
            metrics.update(pair_metrics(dev_pairs, dev_ref, "dev/"))
        if eval_data is not None or (dev_data.rows and reward_fn is not None):
            generator.sync_weights(full_named_parameters(policy, info))
        if reward_fn is not None:
            metrics.update(evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn, decode, info,
                                             args.eval_num_samples, args.eval_temperature, args.max_new_tokens,
                                             seed=args.seed + 7))
        if eval_data is not None:
            outs = generator.generate(eval_data.prompt_ids[: args.num_sample_completions], n=1, temperature=1.0, top_p=1.0,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed + step)
            if info.is_main:
                tracker.log_samples([{"prompt": eval_data.rows[i]["prompt"], "completion": decode(g[0].token_ids),
                                      "answer": eval_data.rows[i]["answer"]} for i, g in enumerate(outs)], step)
        if generator is not None:
            generator.sleep(level=2)  # until the next evaluation, which syncs the weights first
        policy.train()
        metrics.update(best.update(metrics, step, policy))  # keeps the best policy in output_dir/best
        tracker.log(metrics, step)
        tracker.write(f"[step {step}] " + ", ".join(f"{k} {metrics[k]:.3f}" for k in
                                                    ("eval/accuracy", "eval/rewards/accuracies") if k in metrics))
        return metrics

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG, this rank's loss window
    engines = {"policy": policy}
    start_step, state = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
    window = state.get("window", torch.zeros(8, dtype=torch.float64))  # per-rank sums since the last log
    if start_step == 0:
        tracker.log(setup, 0)
        evaluate(0)

    # training loop
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        with timer("train"):
            global_idx = sampler.next_indices(args.batch_size)
            local_idx = global_idx[info.rank * args.local_batch_size : (info.rank + 1) * args.local_batch_size]
            for m in range(args.gradient_accumulation_steps):
                idx = local_idx[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                losses, stats = loss_and_stats(train, idx, ref_cache)
                guard.backward(policy, losses.sum() / args.local_batch_size)  # mean over the step
                grad_norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                window += stats
        if step % 10 == 0 or step == args.num_steps:
            info.all_reduce(window)
            metrics = {**stats_to_metrics(window, ""), "lr": scheduler.get_last_lr()[0],
                       "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                       "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
            tracker.log(metrics, step)
            tracker.progress(0, loss=metrics["loss/dpo"])
            window.zero_()
        tracker.progress(1)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with ckpt.user_code(step, engines, tracker, trained=True, local={"window": window}, sampler=sampler,
                                guard=guard, best=best):
                evaluate(step)  # a grader that raises: checkpoint this step, then a one-line error

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, local={"window": window}, sampler=sampler, guard=guard, best=best)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)
    with ckpt.user_code(args.num_steps, engines, tracker, trained=True, local={"window": window}, sampler=sampler,
                        guard=guard, best=best):
        evaluate(args.num_steps)
    final = ""  # saved before the end-of-run rank check, so a failure there loses nothing
    if args.save_model:
        final = str(save_hf(policy, tokenizer, os.path.join(args.output_dir, "final"), info))
    tracker.log(check_ranks(policy, info, local_idx), args.num_steps)
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
