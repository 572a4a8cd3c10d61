"""KTO: Kahneman-Tversky Optimization, on unpaired desirable / undesirable examples. Docs: docs/kto.md

Paper: Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306. No reward model and no pairs: each example
(x, y) carries one label, desirable or not, and the policy's log-likelihood ratio to a frozen reference is pushed
above a reference point z0 on desirable examples and below it on undesirable ones. With r(x, y) = s_theta(y) -
s_ref(y) (s: the sum of response-token log-probs) and z0 = max(0, mean over the batch of r(x, y')), where y' is
another example's completion given this prompt (a mismatched pair; the KL estimate of the paper's Eq. 7):

    desirable    w_d (1 - sigmoid(beta (r(x, y) - z0)))
    undesirable  w_u (1 - sigmoid(beta (z0 - r(x, y))))

(TRL's KTOTrainer with loss_type="kto"; z0 carries no gradient.) Examples come from an unpaired dataset (TRL's
prompt/completion/label format, read when the train split has a `--label_key` column), from a preference dataset,
each pair giving one desirable and one undesirable example (`--example_source offline`, TRL's
unpair_preference_dataset), or from the starting policy's own samples labelled by the grader
(`--example_source self_generated`: every sample is an example, reward >= --correct_threshold is desirable; no
prompt needs both a correct and an incorrect sample, as a pair would).

Delta from DPO (algorithms/dpo.py; `diff` the two files): unpaired labelled examples in place of pairs, each
batch row's second sequence the mismatched (x, y') for z0, and the loss above; the held-out and dev pairs are
still scored as DPO's (implicit-reward accuracy); unpaired held-out and dev examples by KTO's loss and rewards.

Launch:
    python algorithms/kto.py                                    # CPU, built-in pairs unpaired, about 1.5 minutes
    python algorithms/kto.py --example_source self_generated --logit_temperature 0.6
    python algorithms/kto.py --dataset examples.jsonl            # unpaired rows: {"prompt", "completion", "label": true}
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/kto.py \
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
    exp_name: str = "kto"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (data order, sampling)"""
    output_dir: str = "runs/kto"
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
    """held-out split: task accuracy (needs answers), implicit-reward accuracy (pairs) or KTO's loss (unpaired)"""
    prompt_key: str = "prompt"
    """column holding the prompt (text or messages; optional for conversational chosen/rejected)"""
    chosen_key: str = "chosen"
    """column holding the preferred response (text, or a conversation ending with the assistant reply)"""
    rejected_key: str = "rejected"
    """column holding the dispreferred response"""
    completion_key: str = "completion"
    """unpaired data (TRL's format): the column holding the response (text, or a conversation ending with the reply)"""
    label_key: str = "label"
    """unpaired data: the column holding true (desirable) or false; a train split with it in any row is unpaired"""
    answer_key: str = "answer"
    """column holding the gold answer (held-out accuracy; grading of self-generated examples)"""
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
    """grader (held-out accuracy, self-generated examples): `auto`, `builtin`, `gsm8k`, `math`, `math_verify` or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend for self-generated examples and evaluation: `vllm` (colocated) or `hf`"""
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

    # reliability (shared/checkpoint.py; docs/kto.md#reliability)
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
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none); no answers: see docs/kto.md"""

    # algorithm args
    beta: Annotated[float, Ge(0)] = 0.1
    """beta: strength of the implicit KL to the reference (TRL's KTOConfig 0.1)"""
    desirable_weight: Annotated[float, Gt(0)] = 1.0
    """w_d: weight of the desirable examples' loss (TRL's default; with unequal counts, the paper's Eq. 8 range)"""
    undesirable_weight: Annotated[float, Gt(0)] = 1.0
    """w_u: weight of the undesirable examples' loss (TRL's default)"""
    logit_temperature: Annotated[float, Gt(0)] = 1.0
    """divide policy and reference logits by this (VinePPO DPO+ uses its sampling temperature 0.6; TRL 1)"""
    precompute_ref_logps: bool = True
    """compute reference log-probs once before training (no reference model in memory) instead of on the fly"""
    total_episodes: Annotated[int, Ge(1)] = 28800
    """number of labelled examples to consume (epochs = total_episodes / number of examples)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    """peak learning rate (linear warm-up, cosine decay to 10%); 1e-6 to 5e-7 suits 0.5B-7B models"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up (VinePPO 3%)"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """examples per forward pass on each rank (each with its mismatched (x, y') for z0: 2x sequences)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""

    # self-generated examples (example_source=self_generated)
    example_source: Literal["offline", "self_generated"] = "offline"
    """`offline`: the dataset's pairs, unpaired (chosen desirable, rejected not); `self_generated`: sample and grade"""
    num_generation_prompts: Annotated[int, Ge(0)] = 2048
    """train prompts to sample from for self-generated examples (0: all)"""
    num_generations: Annotated[int, Ge(1)] = 16
    """samples per prompt for self-generated examples (every one is an example)"""
    generation_temperature: Annotated[float, Gt(0)] = 0.6
    """sampling temperature for self-generated examples (dpo.py's 0.6)"""
    generation_top_p: Annotated[float, Interval(gt=0, le=1)] = 0.9
    """nucleus sampling for self-generated examples (dpo.py's 0.9)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit (self-generated examples and evaluation)"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""
    correct_threshold: Annotated[float, Interval()] = 0.5  # any real number
    """a sample is desirable if its reward is >= this (dpo.py's 0.5)"""

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
    """held-out pairs for implicit-reward accuracy (unpaired data: examples for KTO's loss; 0: skip); a fixed-seed sample"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts kept out of training (<= 10%) whose accuracy (offline: and pair accuracy) picks output_dir/best"""
    num_sample_completions: Annotated[int, Ge(0)] = 4
    """held-out completions written to samples.jsonl (and printed) at each evaluation"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: sequence log-probs, the KTO loss and its reference point, unpaired examples
def sequence_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   temperature: float = 1.0, chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """s(y) = sum over response tokens of log pi(y_t | x, y_<t) from logits / temperature, and |y|; both [B].
    The per-token log-probs are shared/logprobs.py's, the LM head run on the response positions only
    (docs/performance.md#memory-of-the-log-probs)."""
    logp, _ = forward_logprobs(model, input_ids, attention_mask, response_mask, temperature, chunk_size=chunk_size)
    mask = response_mask[:, 1:].bool().to(logp.dtype)  # position t predicts token t+1
    return (logp * mask).sum(1), mask.sum(1)


def kto_loss(logratios: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """Per-example loss, [B], of KTO (Ethayarajh et al. 2024, Eq. 7; TRL's `kto`) from r = s_theta(y) - s_ref(y):
    desirable: w_d (1 - sigmoid(beta (r - z0))); undesirable: w_u (1 - sigmoid(beta (z0 - r))). z0 is detached."""
    z0 = z0.detach()
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios))))


def reference_point(kl_logratios: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean of s_theta(y') - s_ref(y') over mismatched pairs (x, y')), detached: the paper's biased KL
    estimate (TRL: the batch mean, averaged over ranks, then clamped at 0; the caller averages over ranks)."""
    return kl_logratios.detach().mean().clamp(min=0)


def kl_partners(n: int, chunk: int, seed: int) -> list[int]:
    """The example whose completion each example's mismatched pair (x, y') takes: in a fixed seeded order, within
    consecutive chunks of `chunk` examples, each example takes the completion of the one before it and the first
    the last's (TRL's rotation (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})). A chunk of one keeps its own."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    partner = list(range(n))
    for s in range(0, n, chunk):
        part = order[s : s + chunk]
        for j, i in enumerate(part):
            partner[i] = part[j - 1]
    return partner


def unpair(pairs: data_utils.PreferenceData) -> tuple[list[dict], list[list[int]], list[list[int]], list[bool]]:
    """Each pair gives a desirable (x, y_w) and an undesirable (x, y_l) example (TRL's unpair_preference_dataset):
    (rows, prompt_ids, completion_ids, desirable)."""
    n = len(pairs)
    return (pairs.rows + pairs.rows, pairs.prompt_ids + pairs.prompt_ids, pairs.chosen_ids + pairs.rejected_ids,
            [True] * n + [False] * n)


def with_partners(examples: data_utils.UnpairedData, chunk: int, seed: int) -> data_utils.PreferenceData:
    """Unpaired examples as rows of (x, y) and their mismatched (x, y') for z0 (kl_partners), with `labels`."""
    partner = kl_partners(len(examples), chunk, seed)
    d = data_utils.PreferenceData(examples.rows, examples.prompt_ids, examples.completion_ids,
                                  [examples.completion_ids[j] for j in partner])
    d.labels = torch.tensor(examples.desirable, dtype=torch.bool)
    return d


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""
    if args.beta <= 0:
        raise ValueError(f"beta: must be > 0, got {args.beta}")
    if args.local_micro_batch_size < 2:
        raise ValueError("local_micro_batch_size: z0 needs at least 2 examples per micro-batch (mismatched pairs)")


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

    # data: held-out prompts (task accuracy), held-out pairs (implicit-reward accuracy), training pairs (unpaired
    # below) or the prompts to sample examples from; validated before anything is written (bad-row policy:
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
    # unpaired data (TRL's prompt/completion/label format): a train split with a `label_key` column in any row (a
    # row without it is then an error naming that row)
    unpaired = args.example_source == "offline" and any(args.label_key in row for row in
                                                        data_utils.load_rows(args.dataset, args.train_split))
    load_unpaired = lambda split, **kw: data_utils.load_unpaired(  # noqa: E731
        args.dataset, split, tokenizer, args.prompt_key, args.completion_key, args.label_key, args.prompt_template,
        args.response_template, args.chat_template, args.max_prompt_length, args.max_seq_length, **kw)
    # task accuracy needs gold answers: a plain prompt/chosen/rejected dataset is evaluated on its pairs only
    graded = args.eval_num_prompts > 0 and data_utils.has_column(args.dataset, (args.eval_split,), args.answer_key)
    eval_data = load_prompts(args.eval_split, args.eval_num_prompts) if graded else None
    held_out = None
    if args.eval_num_pairs and unpaired:  # held-out examples, each with its mismatched pair: KTO's loss and rewards
        held_out = with_partners(load_unpaired(args.eval_split, limit=args.eval_num_pairs), args.local_micro_batch_size,
                                 args.seed)
    elif args.eval_num_pairs:
        held_out = data_utils.load_preferences(args.dataset, args.eval_split, limit=args.eval_num_pairs, **load)
    # the dev slice (selects output_dir/best, never the reported eval set): prompts of the train split, with their
    # pairs (or unpaired examples) when offline (grouped by prompt, so no dev prompt is trained on)
    dev_pairs = data_utils.PreferenceData([], [], [], [])
    if unpaired:
        train_examples = load_unpaired(args.train_split, num_dev=args.dev_num_prompts)
        if len(set(train_examples.desirable)) < 2:
            raise ValueError(f"dataset {args.dataset!r}: every one of the {len(train_examples)} training examples is "
                             f"{'desirable' if train_examples.desirable[0] else 'undesirable'}; KTO needs both")
        dev_pairs = with_partners(load_unpaired(args.train_split, num_dev=args.dev_num_prompts, part="dev"),
                                  args.local_micro_batch_size, args.seed)
        dev_data = unique_prompts(dev_pairs, args.answer_key)  # task accuracy on them, if they carry answers
    elif args.example_source == "offline":
        train_pairs = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts,
                                                  **load)
        dev_pairs = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts,
                                                part="dev", **load)
        dev_data = unique_prompts(dev_pairs, args.answer_key)  # task accuracy on them, if they carry answers
    else:
        prompts = load_prompts(args.train_split, args.num_generation_prompts or None, part="train")
        dev_data = load_prompts(args.train_split, None, part="dev")
    needs_grader = graded or args.example_source == "self_generated"
    reward_fn = load_reward_fn(args.reward_fn, args.dataset) if needs_grader else None
    if reward_fn is not None:
        probe_reward_fn(reward_fn, (eval_data or prompts).rows)
    elif args.best_metric == "dev/accuracy":  # no grader: the dev pairs' implicit-reward accuracy selects best/,
        args.best_metric = "dev/rewards/margins" if unpaired else "dev/rewards/accuracies"  # unpaired: its margin

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
    if args.eval_num_prompts or args.example_source == "self_generated" or has_dev and reward_fn is not None:
        generator = make_generator(args.generator, model_path=model_path, model=policy.module, tokenizer=tokenizer,
                                   dtype=dtype, seed=local_seed, max_model_len=args.max_seq_length,
                                   world_size=info.world_size, zero_stage=info.zero_stage,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                                   enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop, lora_sync=args.lora_sync)
    pad_id = tokenizer.pad_token_id
    timer = Timer()

    # training examples: the dataset's pairs unpaired, or sampled from the starting policy and graded; sampled
    # examples are kept in output_dir/checkpoints/self_generated_examples.pt, so a resumed run trains on the same ones
    examples_file = Path(args.output_dir) / "checkpoints" / "self_generated_examples.pt"
    saved_examples = ckpt.path.parent / examples_file.name if ckpt.path is not None else None  # the resumed run's
    if unpaired:
        rows, prompt_ids, completion_ids, desirable = (train_examples.rows, train_examples.prompt_ids,
                                                       train_examples.completion_ids, train_examples.desirable)
        tracker.write(f"{len(rows)} unpaired training examples ({train_examples.num_too_long} over-long skipped)")
        setup = {"data/train_examples": len(rows), "data/skipped_too_long": train_examples.num_too_long}
    elif args.example_source == "offline":
        rows, prompt_ids, completion_ids, desirable = unpair(train_pairs)
        tracker.write(f"{len(rows)} training examples from {len(train_pairs)} pairs ({train_pairs.num_identical} with "
                      f"identical chosen/rejected and {train_pairs.num_too_long} over-long skipped)")
        setup = {"data/train_examples": len(rows), "data/skipped_identical": train_pairs.num_identical,
                 "data/skipped_too_long": train_pairs.num_too_long}
    elif saved_examples is not None and saved_examples.exists():
        saved = safe_load(saved_examples)  # plain lists and numbers: a crafted file is refused, not run
        rows, prompt_ids, completion_ids, desirable = (saved[k] for k in ("rows", "prompt_ids", "completion_ids",
                                                                          "desirable"))
        setup = saved["setup"]
        tracker.write(f"{len(rows)} self-generated examples from {saved_examples}")
    else:
        with timer("generate_examples"):
            n = len(prompts.rows)
            per_rank = math.ceil(n / info.world_size)
            mine = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
            outs = generator.generate([prompts.prompt_ids[i] for i in mine], n=args.num_generations,
                                      temperature=args.generation_temperature, top_p=args.generation_top_p,
                                      max_new_tokens=args.max_new_tokens, seed=args.seed * 7_919,
                                      index_offset=info.rank * per_rank)
            generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU; each evaluation syncs the weights first
            local_examples, stats = [], torch.zeros(3, dtype=torch.float64)  # prompts, samples, desirable
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
                local_examples += [(i, c.token_ids, r >= args.correct_threshold) for c, r in zip(group, rewards)
                                   if len(prompts.prompt_ids[i]) + len(c.token_ids) <= args.max_seq_length]
                stats += torch.tensor([1, len(group), sum(r >= args.correct_threshold for r in rewards)],
                                      dtype=torch.float64)
            failed = info.all_reduce(torch.tensor([float(error is not None)]), "max").item()
            if failed:
                raise error or ValueError("the reward function failed on another rank while generating examples")
            info.all_reduce(stats)
            all_examples = [e for part in info.gather_objects(local_examples) for e in part]
        if len({d for _, _, d in all_examples}) < 2:
            raise ValueError(f"example_source=self_generated: every one of the {len(all_examples)} samples is "
                             f"{'desirable' if all_examples and all_examples[0][2] else 'undesirable'}; KTO needs both")
        rows = [prompts.rows[i] for i, _, _ in all_examples]
        prompt_ids = [prompts.prompt_ids[i] for i, _, _ in all_examples]
        completion_ids, desirable = [c for _, c, _ in all_examples], [d for _, _, d in all_examples]
        setup = {"examples/sample_accuracy": stats[2].item() / stats[1].item(), "examples/num": len(rows),
                 "data/train_examples": len(rows), **timer.pop()}
        tracker.write(f"{len(rows)} self-generated examples from {int(stats[0].item())} prompts x "
                      f"{args.num_generations} samples (desirable {setup['examples/sample_accuracy']:.3f})")
    if args.example_source == "self_generated" and info.is_main and (ckpt.path is None or not examples_file.exists()):
        examples_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rows": rows, "prompt_ids": prompt_ids, "completion_ids": completion_ids, "desirable": desirable,
                    "setup": setup}, examples_file.with_suffix(".tmp"))
        examples_file.with_suffix(".tmp").rename(examples_file)
    # each example's second sequence: the same prompt with another example's completion, for z0
    partner = kl_partners(len(rows), args.local_micro_batch_size, args.seed)
    train = data_utils.PreferenceData(rows, prompt_ids, completion_ids, [completion_ids[j] for j in partner])
    labels = torch.tensor(desirable, dtype=torch.bool)
    setup["data/desirable_fraction"] = labels.float().mean().item()
    sampler = data_utils.PromptSampler(len(train), args.seed)
    tracker.write(f"{args.num_steps} steps of {args.batch_size} examples ({args.total_episodes / len(train):.2f} epochs); "
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
    if not args.precompute_ref_logps or ref_path != model_path:
        if args.lora_r and ref_path == model_path:  # LoRA: the policy with its adapters disabled (no second copy)
            ref_model = adapters_disabled(policy)
        else:
            ref_model = prepare_frozen(load_causal_lm(ref_path, dtype), info, dtype)
    if args.precompute_ref_logps:
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

    def loss_and_stats(d, idx, labels, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example KTO losses of the examples idx (labels: desirable or not) and their summed stats: examples,
        loss, desirable examples, desirable / undesirable rewards, desirable / undesirable logps, z0 (times the
        examples)."""
        input_ids, attn, resp = pair_batch(d, idx)  # [(x, y); (x, y')]: the examples, then their mismatched pairs
        logps, _ = sequence_logps(policy, input_ids, attn, resp, args.logit_temperature)
        pol, pol_kl = logps[: len(idx)], logps[len(idx) :]
        ref, ref_kl = ref_for(d, idx, cache, input_ids, attn, resp)
        # z0: the mismatched pairs' mean log-ratio, the mean over ranks of each rank's mean (TRL's gathered `kl`)
        z0 = reference_point(info.all_reduce((pol_kl - ref_kl).detach().mean().reshape(1).cpu()) / info.world_size)
        desirable = labels[idx].to(pol.device)
        losses = kto_loss(pol - ref, desirable, z0.to(pol.device), args.beta, args.desirable_weight,
                          args.undesirable_weight)
        with torch.no_grad():  # TRL's implicit rewards: beta * (s_theta - s_ref)
            r, w = args.beta * (pol - ref), desirable.to(pol.dtype)
            stats = torch.tensor([len(idx), losses.sum().item(), w.sum().item(), (r * w).sum().item(),
                                  (r * (1 - w)).sum().item(), (pol * w).sum().item(), (pol * (1 - w)).sum().item(),
                                  z0.item() * len(idx)], dtype=torch.float64)
        return losses, stats

    def stats_to_metrics(stats: torch.Tensor, prefix: str) -> dict:
        n, n_d = stats[0].item(), stats[2].item()
        n_u = n - n_d
        mean_d = lambda x: x / n_d if n_d else float("nan")  # noqa: E731  (a batch without desirable examples)
        mean_u = lambda x: x / n_u if n_u else float("nan")  # noqa: E731
        return {f"{prefix}loss/kto": stats[1].item() / n, f"{prefix}rewards/chosen": mean_d(stats[3].item()),
                f"{prefix}rewards/rejected": mean_u(stats[4].item()),
                f"{prefix}rewards/margins": mean_d(stats[3].item()) - mean_u(stats[4].item()),
                f"{prefix}logps/chosen": mean_d(stats[5].item()), f"{prefix}logps/rejected": mean_u(stats[6].item()),
                f"{prefix}kl": stats[7].item() / n, f"{prefix}data/desirable_fraction": n_d / n}

    def pair_stats(d, idx, cache) -> torch.Tensor:
        """Summed stats of the held-out or dev pairs idx, scored as DPO's: pairs, reward acc, chosen/rejected
        rewards, chosen/rejected logps."""
        input_ids, attn, resp = pair_batch(d, idx)
        logps, _ = sequence_logps(policy, input_ids, attn, resp, args.logit_temperature)
        pol_w, pol_l = logps[: len(idx)], logps[len(idx) :]
        ref_w, ref_l = ref_for(d, idx, cache, input_ids, attn, resp)
        chosen_r, rejected_r = args.beta * (pol_w - ref_w), args.beta * (pol_l - ref_l)
        return torch.tensor([len(idx), (chosen_r > rejected_r).sum().item(), chosen_r.sum().item(),
                             rejected_r.sum().item(), pol_w.sum().item(), pol_l.sum().item()], dtype=torch.float64)

    def pair_metrics(d, cache, prefix: str) -> dict:
        """Implicit-reward accuracy and margins on the pairs d (each rank a slice)."""
        n = len(d)
        per_rank = math.ceil(n / info.world_size)
        mine = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
        stats = torch.zeros(6, dtype=torch.float64)
        with torch.no_grad():
            for s in range(0, per_rank, args.local_micro_batch_size):
                idx = mine[s : s + args.local_micro_batch_size]
                if not idx:  # ZeRO-3: every rank runs the same number of forwards
                    pair_stats(d, [0], cache)
                    continue
                stats += pair_stats(d, idx, cache)
        info.all_reduce(stats)
        v = (stats / stats[0]).tolist()
        return {f"{prefix}rewards/accuracies": v[1], f"{prefix}rewards/chosen": v[2],
                f"{prefix}rewards/rejected": v[3], f"{prefix}rewards/margins": v[2] - v[3],
                f"{prefix}logps/chosen": v[4], f"{prefix}logps/rejected": v[5]}

    def example_metrics(d, cache, prefix: str) -> dict:
        """KTO's loss and implicit rewards on the held-out or dev examples d of unpaired data (each rank a slice)."""
        n = len(d)
        per_rank = math.ceil(n / info.world_size)
        mine = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
        stats = torch.zeros(8, dtype=torch.float64)
        with torch.no_grad():
            for s in range(0, per_rank, args.local_micro_batch_size):
                idx = mine[s : s + args.local_micro_batch_size]
                _, part = loss_and_stats(d, idx or [0], d.labels, cache)  # ZeRO-3: every rank runs the forwards
                stats += part if idx else 0
        info.all_reduce(stats)
        return stats_to_metrics(stats, prefix)

    def evaluate(step: int) -> dict:
        """Task accuracy with the grader and implicit-reward accuracy on pairs, on the held-out set (eval/) and the
        dev slice (dev/); the best policy on dev."""
        metrics = {}
        policy.eval()
        scores = example_metrics if unpaired else pair_metrics  # unpaired data: KTO's loss; pairs: DPO's accuracy
        if held_out is not None:
            metrics.update(scores(held_out, held_out_ref, "eval/"))
        if len(dev_pairs):
            metrics.update(scores(dev_pairs, dev_ref, "dev/"))
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
                                                    ("eval/accuracy", "eval/rewards/margins" if unpaired else
                                                     "eval/rewards/accuracies") if k in metrics))
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
                losses, stats = loss_and_stats(train, idx, labels, ref_cache)
                guard.backward(policy, losses.sum() / args.local_batch_size)  # mean over the step
                grad_norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                window += stats
        if step % 10 == 0 or step == args.num_steps:
            info.all_reduce(window)
            metrics = {**stats_to_metrics(window, ""), "lr": scheduler.get_last_lr()[0],
                       "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                       "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
            tracker.log(metrics, step)
            tracker.progress(0, loss=metrics["loss/kto"])
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
