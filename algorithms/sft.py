"""SFT: supervised fine-tuning (behaviour cloning) on (prompt, response) pairs. Docs: docs/sft.md

The loss is the cross-entropy of the response tokens only (the prompt contributes nothing), reduced
per sequence then over the batch ("per_instance_non_pad_tokens_then_batch" in VinePPO's
`mle_trainer.py`) or as one token mean. Every RL script here starts from an SFT checkpoint; with no flags
this script warm-starts the built-in tiny model on the built-in task, which is exactly how the default
RL starting point `builtin:tiny-sft` is produced.

Launch:
    python algorithms/sft.py                                   # CPU, built-in task, about a minute
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/sft.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset openai/gsm8k:main --prompt_key question \
        --response_key answer --prompt_template $'[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:' \
        --response_template $'\\n{response}\\n' --learning_rate 1e-5 --total_episodes 14000
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, default_dtype, full_named_parameters, init_distributed, load_causal_lm,
                                load_tokenizer, prepare, seed_everything)
from shared.evaluation import evaluate_accuracy
from shared.generation import completion_decoder, make_generator
from shared.logprobs import forward_logprobs
from shared.lora import add_lora, check_lora
from shared.rewards import load_reward_fn, probe_reward_fn
from shared.tools import encode_segments, model_token_mask
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "sft"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (model init, data order)"""
    output_dir: str = "runs/sft"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny"
    """hub name or local path of the model; `builtin:tiny` is the random-init built-in tiny Llama"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for accuracy evaluation"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    response_key: str = "response"
    """dataset column holding the target response"""
    answer_key: str = "answer"
    """dataset column holding the gold answer (for held-out accuracy)"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt text; `{prompt}` is replaced by the dataset prompt"""
    response_template: str = "{response}"
    """template applied to the response text (VinePPO uses `\\n{response}\\n`)"""
    tool_results: bool = False
    """responses in the calculator syntax (`<<3+4=` `7>>`): tool results tokenised alone, not trained (grpo_tools.py)"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    max_seq_length: Annotated[int, Ge(1)] = 512
    """examples whose prompt+response exceed this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader for held-out accuracy: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["hf", "vllm"] = "hf"
    """generation backend for held-out evaluation: `hf` (default here: no engine start for a short run) or `vllm`"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    vllm_enable_sleep: bool = False
    """put vLLM to sleep during training to free GPU memory (GPU only)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""
    lora_r: Annotated[int, Ge(0)] = 0
    """LoRA rank: train rank-r adapters on the model, frozen otherwise (0: off, every weight trains)"""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA alpha: the adapters' update B A is scaled by lora_alpha / lora_r"""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input in training forwards (0 keeps log-probs deterministic)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: `all-linear` (attention and MLP linears, not the output head) or names (`q_proj,v_proj`)"""

    # reliability (shared/checkpoint.py; docs/sft.md#reliability)
    save_every: Annotated[int, Ge(0)] = 100
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
    """dev-slice metric that selects output_dir/best (higher is better; `name:min`: lower is better; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 20480
    """number of training examples to consume (epochs = total_episodes / dataset size)"""
    learning_rate: Annotated[float, Gt(0)] = 3e-3
    """peak learning rate (linear warm-up, cosine decay to 10%)"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """examples per forward pass on each rank (HF `per_device_train_batch_size`)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    loss_reduction: Literal["seq_mean", "token_mean"] = "seq_mean"
    """`seq_mean`: per-sequence token mean, then batch mean (VinePPO); `token_mean`: one mean over the step's tokens, all ranks"""
    eval_every: Annotated[int, Ge(0)] = 100
    """evaluate held-out accuracy every this many optimizer steps (0: only at the end)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 200
    """held-out prompts per evaluation (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train examples held out of training (<= 10%; needs answers) whose accuracy selects output_dir/best (0: none)"""
    eval_temperature: Annotated[float, Ge(0)] = 1.0
    """sampling temperature for held-out evaluation (0 = greedy)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """generation length limit for evaluation"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept like EOS; rewards see the text before it (EOS always stops)"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: the loss
def sequence_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 chunk_size: int = 512):
    """Per-token negative log-likelihood of the response tokens, [B, L-1] (0 at other positions), and the mask.
    The log-probs are shared/logprobs.py's, the LM head run on the response positions only
    (docs/performance.md#memory-of-the-log-probs)."""
    logp, _ = forward_logprobs(model, input_ids, attention_mask, response_mask, 1.0, chunk_size=chunk_size)
    return -logp, response_mask[:, 1:].bool().to(logp.dtype)  # position t predicts token t+1


def reduce_loss(nll: torch.Tensor, mask: torch.Tensor, reduction: str, num_seqs: int, num_tokens_global: int,
                world_size: int = 1) -> torch.Tensor:
    """This micro-batch's share of the optimizer-step loss (sum over micro-batches = the step's loss).

    seq_mean:   (1/num_seqs) Σ_i [Σ_t nll·m / Σ_t m]            -- each sequence weighs the same (VinePPO SFT)
    token_mean: (world_size/num_tokens_global) Σ_{i,t} nll·m     -- each token of the step, on any rank, the same
    num_seqs counts the optimizer step's sequences on this rank (every rank has as many); num_tokens_global its
    response tokens on all ranks. Data parallelism averages gradients over ranks, hence the world_size factor:
    the step's loss is the same on 2 ranks as on 1 rank accumulating both halves."""
    if reduction == "seq_mean":
        return ((nll * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    if reduction == "token_mean":
        return (nll * mask).sum() * world_size / max(num_tokens_global, 1)
    raise ValueError(f"loss_reduction: expected seq_mean or token_mean, got {reduction!r}")


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
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

    # data: validated before anything is written (a bad row, model path or grader stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path)  # --lora_* flags against the model, before anything is written
    where = f"dataset {args.dataset!r} split {args.train_split!r}"
    raw = data_utils.load_rows(args.dataset, args.train_split)
    rows = data_utils.select_fields(data_utils.dev_split(raw, args.dev_num_prompts, "train", where), where,
                                    {"prompt": args.prompt_key, "response": args.response_key})
    examples, dropped = [], 0
    for row in rows:
        p = data_utils.encode_prompt(tokenizer, data_utils.format_prompt(row["prompt"], args.prompt_template),
                                     args.chat_template)
        text = args.response_template.replace("{response}", row["response"])
        if args.tool_results:  # keep: 1 on trained tokens, 0 on the tool's results
            r, keep = encode_segments(tokenizer, text)
        else:
            r = data_utils.encode_response(tokenizer, text)
            keep = [1] * len(r)
        if len(p) > args.max_prompt_length or len(p) + len(r) > args.max_seq_length:
            dropped += 1
            continue
        examples.append((p, r, keep))
    if not examples:
        raise data_utils.DataError(f"dataset {args.dataset!r}: all {len(rows)} examples are longer than "
                                   f"max_prompt_length={args.max_prompt_length} / max_seq_length={args.max_seq_length}")
    eval_data = data_utils.load_prompts(args.dataset, args.eval_split, tokenizer, args.prompt_key, args.answer_key,
                                        args.prompt_template, args.chat_template, args.max_prompt_length,
                                        limit=args.eval_num_prompts)
    dev_data = data_utils.PromptData([], [])  # selects output_dir/best; never the reported eval set
    if args.dev_num_prompts and all(args.answer_key in r for r in raw):
        dev_data = data_utils.load_prompts(args.dataset, args.train_split, tokenizer, args.prompt_key, args.answer_key,
                                           args.prompt_template, args.chat_template, args.max_prompt_length,
                                           num_dev=args.dev_num_prompts, part="dev")
    reward_fn = load_reward_fn(args.reward_fn, args.dataset)
    probe_reward_fn(reward_fn, eval_data.rows)
    sampler = data_utils.PromptSampler(len(examples), args.seed)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    tracker.write(f"{len(examples)} training examples ({dropped} over-long dropped), {len(eval_data.rows)} eval "
                  f"prompts, {len(dev_data.rows)} dev prompts, {args.num_steps} steps")

    # models and optimizer
    dtype = default_dtype(info.device)
    model = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    model = add_lora(model, args)  # --lora_r > 0: only LoRA adapters train (shared/lora.py); else unchanged
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
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))

    # generation engine (evaluation only)
    generator = make_generator(args.generator, model_path=model_path, model=model.module, tokenizer=tokenizer,
                               dtype=dtype, seed=local_seed, max_model_len=args.max_seq_length, world_size=info.world_size,
                               zero_stage=info.zero_stage, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                               enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop)

    def run_eval(step: int) -> None:
        generator.sync_weights(full_named_parameters(model, info))
        metrics = evaluate_accuracy(generator, {"eval": eval_data, "dev": dev_data}, reward_fn,
                                    completion_decoder(tokenizer, args.stop), info, 1, args.eval_temperature,
                                    args.max_new_tokens, seed=args.seed + 7)
        generator.sleep(level=2)  # --vllm_enable_sleep: free the GPU until the next evaluation, which syncs first
        metrics.update(best.update(metrics, step, model))  # keeps the best model (on dev) in output_dir/best
        tracker.log(metrics, step)
        tracker.write(f"[step {step}] held-out accuracy {metrics['eval/accuracy']:.3f}")

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG
    engines = {"model": model}
    start_step, _ = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
    if start_step == 0:
        tracker.log({"data/train_examples": len(examples), "data/skipped_too_long": dropped}, 0)

    # training loop
    timer = Timer()
    model.train()
    for step in range(start_step + 1, args.num_steps + 1):
        with timer("train"):
            global_idx = sampler.next_indices(args.batch_size)
            local_idx = global_idx[info.rank * args.local_batch_size : (info.rank + 1) * args.local_batch_size]
            batch = [examples[i] for i in local_idx]
            num_tokens = info.all_reduce(torch.tensor([sum(sum(keep) for _, _, keep in batch)])).item()  # all ranks
            loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)  # the loss's device (GPU: no sync)
            for m in range(args.gradient_accumulation_steps):
                micro = batch[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                input_ids, attn, resp = data_utils.pad_batch([p for p, _, _ in micro], [r for _, r, _ in micro],
                                                             tokenizer.pad_token_id, info.device)
                nll, mask = sequence_nll(model, input_ids, attn, resp)
                if args.tool_results:  # the tool's tokens are context, never targets
                    mask = mask * model_token_mask(resp, [keep for _, _, keep in micro])[:, 1:].to(mask.dtype)
                loss = reduce_loss(nll, mask, args.loss_reduction, len(batch), num_tokens, info.world_size)
                guard.backward(model, loss)
                grad_norm = guard.step(model)  # a non-finite loss or gradient skips the step (counted)
                loss_sum += loss.detach().double()
        if step % 10 == 0 or step == args.num_steps:
            stats = torch.tensor([loss_sum.item()], dtype=torch.float64)
            info.all_reduce(stats)
            metrics = {"loss/sft": stats[0].item() / info.world_size, "lr": scheduler.get_last_lr()[0],
                       "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                       "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
            tracker.log(metrics, step)
        tracker.progress(1, loss=loss_sum.item())
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with ckpt.user_code(step, engines, tracker, trained=True, sampler=sampler, guard=guard, best=best):
                run_eval(step)  # a grader that raises: checkpoint this step, then a one-line error

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, sampler=sampler, guard=guard, best=best)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)
    with ckpt.user_code(args.num_steps, engines, tracker, trained=True, sampler=sampler, guard=guard, best=best):
        run_eval(args.num_steps)

    final = save_hf(model, tokenizer, os.path.join(args.output_dir, "final"), info)
    ckpt.finish()
    tracker.close()
    return str(final)


if __name__ == "__main__":
    run_cli(main, Args)
