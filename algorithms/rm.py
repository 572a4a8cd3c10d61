"""Reward modeling: a Bradley-Terry scalar reward model trained on preference pairs. Docs: docs/rm.md

A language-model backbone with a linear head `Linear(H, 1)` scores `prompt + response` at its last non-pad
token (the EOS). On pairs (x, y_w, y_l) the model is trained to rank the chosen response above the rejected
one (Bradley & Terry 1952; Ouyang et al. 2022, https://arxiv.org/abs/2203.02155):

    loss = -mean log sigmoid(r_w - r_l - margin) + center_rewards_coefficient * mean((r_w + r_l)^2)

The checkpoint is a plain HF `AutoModelForSequenceClassification`, with the mean and std of its scores on
the held-out pairs stored in config.json (`reward_mean`, `reward_std`, OpenRLHF's normalisation), so it is
the reward model of ppo.py / grpo.py (`--reward_model_path`) as is: `shared/scalar.py::score_last_token`
reads the score at the last non-pad token and normalises it with those stats.

With no flags it trains on the built-in preference pairs (correct running sums vs the same chain with one
arithmetic slip), starting from the built-in SFT warm start, and reports held-out pairwise accuracy.

Launch:
    python algorithms/rm.py                                     # CPU, built-in pairs, about 3.5 minutes
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/rm.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset trl-lib/ultrafeedback_binarized \
        --eval_split test --learning_rate 1e-5 --total_episodes 60000 --local_micro_batch_size 4 \
        --gradient_accumulation_steps 4 --max_seq_length 1024
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, enable_gradient_checkpointing,
                                init_distributed, load_tokenizer, prepare, seed_everything)
from shared.lora import add_lora, check_lora
from shared.scalar import head, load_scalar_model, score_last_token, use_distinct_pad_token
from shared.models import resolve_model_path
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "rm"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (head init, data order)"""
    output_dir: str = "runs/rm"
    """where metrics.jsonl, samples.jsonl and the final reward model (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """backbone: hub name or local path (causal LM or sequence classifier); `builtin:tiny-sft` is the built-in warm start"""
    dataset: str = "builtin"
    """`builtin` (pairs; `builtin:sums-N`: N = 3..12 terms), a .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to train on"""
    eval_split: str = "test"
    """held-out split for pairwise accuracy (and the normalisation stats)"""
    prompt_key: str = "prompt"
    """column holding the prompt (text or messages; optional for conversational chosen/rejected)"""
    chosen_key: str = "chosen"
    """column holding the preferred response (text, or a conversation ending with the assistant reply)"""
    rejected_key: str = "rejected"
    """column holding the dispreferred response"""
    margin_key: str = ""
    """optional column with a per-pair margin m in log sigmoid(r_w - r_l - m) (Llama 2); empty: no margin"""
    prompt_template: str = "{prompt}"
    """template applied to text prompts; `{prompt}` is replaced by the dataset prompt"""
    response_template: str = "{response}"
    """template applied to each response text"""
    chat_template: bool = False
    """wrap text prompts with the tokenizer's chat template (conversational rows always use it)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """pairs whose prompt is longer than this many tokens are skipped (and counted)"""
    max_seq_length: Annotated[int, Ge(1)] = 512
    """pairs whose prompt + longer response exceed this many tokens are skipped (and counted)"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""
    lora_r: Annotated[int, Ge(0)] = 0
    """LoRA rank: rank-r adapters on the backbone (the score head trains in full), the rest frozen (0: off, all weights train)"""
    lora_alpha: Annotated[int, Ge(1)] = 32
    """LoRA alpha: the adapters' update B A is scaled by lora_alpha / lora_r"""
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """dropout on the adapters' input in training forwards (0 keeps log-probs deterministic)"""
    lora_target_modules: str = "all-linear"
    """layers that get adapters: `all-linear` (attention and MLP linears, not the output head) or names (`q_proj,v_proj`)"""

    # reliability (shared/checkpoint.py; docs/rm.md#reliability)
    save_every: Annotated[int, Ge(0)] = 250
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
    """dev metric that picks output_dir/best, saved with its reward_mean/std (`name:min`: lower is better; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 128000
    """number of preference pairs to consume (epochs = total_episodes / number of pairs)"""
    learning_rate: Annotated[float, Gt(0)] = 3e-4
    """peak learning rate (linear warm-up, cosine decay to 10%); 1e-5 suits 0.5B-7B backbones"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """pairs per forward pass on each rank (chosen and rejected go through one forward: 2x sequences)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    center_rewards_coefficient: Annotated[float, Ge(0)] = 0.0
    """eta in eta * mean((r_w + r_l)^2), which keeps rewards centred at 0 (TRL suggests 0.01); 0 disables it"""
    eval_every: Annotated[int, Ge(0)] = 250
    """evaluate held-out pairwise accuracy every this many optimizer steps (0: only at the end)"""
    eval_num_pairs: Annotated[int, Ge(0)] = 500
    """held-out pairs per evaluation, a fixed-seed sample (the final one also sets reward_mean / reward_std)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts held out with all their pairs (<= 10%) whose pair accuracy selects output_dir/best (0: none)"""
    num_sample_pairs: Annotated[int, Ge(0)] = 4
    """held-out pairs whose scores are written to samples.jsonl at each evaluation"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: head init and the Bradley-Terry loss
def init_reward_head(model) -> None:
    """Head weight ~ N(0, 1/sqrt(H+1)), bias 0 (open-instruct `reward_modeling.py`,
    vwxyzjn/summarize_from_feedback_details `reward.py`)."""
    layer = head(model)
    torch.nn.init.normal_(layer.weight, std=1 / math.sqrt(layer.weight.shape[1] + 1))
    if layer.bias is not None:
        torch.nn.init.zeros_(layer.bias)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                       center_coef: float = 0.0) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_w - r_l - m) + eta (r_w + r_l)^2, [B] (TRL `RewardTrainer.compute_loss`)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def score_pairs(model, prompts: list[list[int]], chosen: list[list[int]], rejected: list[list[int]], pad_id: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of chosen and rejected in one right-padded forward of 2B sequences: (r_w [B], r_l [B])."""
    input_ids, attn, _ = data_utils.pad_batch(prompts + prompts, chosen + rejected, pad_id, device)
    scores = score_last_token(model, input_ids, attn, normalize=False)
    return scores[: len(prompts)], scores[len(prompts) :]


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    if args.center_rewards_coefficient < 0:
        raise ValueError(f"center_rewards_coefficient: must be >= 0, got {args.center_rewards_coefficient}")
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")

    # TRY NOT TO MODIFY: seeding (same seed on every rank for init and data order)
    seed_everything(args.seed)

    # data: (prompt, chosen, rejected) token ids, validated before anything is written (bad-row policy in
    # shared/data.py::load_preferences)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    check_lora(args, model_path, seq_cls=True)  # --lora_* flags against the model, before anything is written
    load = dict(tokenizer=tokenizer, prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                rejected_key=args.rejected_key, prompt_template=args.prompt_template,
                response_template=args.response_template, use_chat_template=args.chat_template,
                max_prompt_length=args.max_prompt_length, max_seq_length=args.max_seq_length)
    train = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts, **load)
    dev = data_utils.load_preferences(args.dataset, args.train_split, num_dev=args.dev_num_prompts, part="dev",
                                      **load)  # selects output_dir/best; never the reported eval set
    held_out = data_utils.load_preferences(args.dataset, args.eval_split, limit=args.eval_num_pairs, **load)

    def margins(d: data_utils.PreferenceData) -> list[float] | None:
        if not args.margin_key:
            return None
        out = []
        for i, row in enumerate(d.rows):
            value = row.get(args.margin_key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise data_utils.DataError(f"dataset {args.dataset!r}: pair {i}: margin column {args.margin_key!r} "
                                           f"is {value!r}, expected a finite number")
            out.append(float(value))
        return out

    train_margin, held_out_margin, dev_margin = margins(train), margins(held_out), margins(dev)
    sampler = data_utils.PromptSampler(len(train), args.seed)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    tracker.write(f"{len(train)} training pairs ({train.num_identical} identical chosen/rejected and "
                  f"{train.num_too_long} over-long skipped), {len(held_out)} held-out pairs, {len(dev)} dev pairs, "
                  f"{args.num_steps} steps")

    # model: backbone + scalar head; any stored normalisation is dropped (this run measures its own)
    dtype = default_dtype(info.device)
    model = load_scalar_model(model_path, dtype)
    model.config.reward_mean = model.config.reward_std = None
    # pad != EOS in the saved checkpoint, so HF's own classifier forward reads the score at EOS, where this script
    # reads it (shared/scalar.py::use_distinct_pad_token); the vocabulary, and so the policy's ids, are unchanged
    new_pad = use_distinct_pad_token(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    if new_pad is not None:
        tracker.write(f"pad token {new_pad!r} (the tokenizer padded with its EOS token)")
    if not any(a.endswith("ForSequenceClassification") for a in model.config.architectures or []):
        init_reward_head(model)  # a causal-LM backbone gets a fresh head; a trained RM keeps its own
    model = add_lora(model, args, seq_cls=True)  # LoRA: adapters on the backbone, the score head in full
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.to(info.device)
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
    pad_id = tokenizer.pad_token_id
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(len(dev)))  # output_dir/best

    def score_set(d: data_utils.PreferenceData, d_margin, prefix: str, num_samples: int) -> tuple[dict, list]:
        """Pairwise accuracy, margin, loss and the mean / std of all scores (chosen and rejected pooled: OpenRLHF's
        normalisation stats) on the pairs d (each rank scores a slice); the first num_samples pairs' scores."""
        n = len(d)
        mine = list(range(info.rank, n, info.world_size))
        sums = torch.zeros(6, dtype=torch.float64)  # count, correct, margin, loss, sum r, sum r^2
        samples = []
        # every rank runs the same number of forwards (ZeRO-3 gathers shards in each): a rank with fewer pairs
        # (e.g. 487 pairs on 8 ranks) scores a dummy pair for the batches it lacks and discards it
        n_batches = int(info.all_reduce(torch.tensor([math.ceil(len(mine) / args.local_micro_batch_size)]),
                                        "max").item())
        with torch.no_grad():
            for b in range(n_batches):
                idx = mine[b * args.local_micro_batch_size : (b + 1) * args.local_micro_batch_size]
                if not idx:
                    score_pairs(model, [[pad_id]], [[pad_id]], [[pad_id]], pad_id, info.device)
                    continue
                r_w, r_l = score_pairs(model, [d.prompt_ids[i] for i in idx], [d.chosen_ids[i] for i in idx],
                                       [d.rejected_ids[i] for i in idx], pad_id, info.device)
                m = None if d_margin is None else torch.tensor([d_margin[i] for i in idx], device=r_w.device)
                loss = bradley_terry_loss(r_w, r_l, m, args.center_rewards_coefficient)
                both = torch.cat([r_w, r_l]).double().cpu()
                sums += torch.tensor([len(idx), (r_w > r_l).sum().item(), (r_w - r_l).sum().item(),
                                      loss.sum().item(), both.sum().item(), (both**2).sum().item()], dtype=torch.float64)
                for j, i in enumerate(idx):
                    if i < num_samples:
                        samples.append({"prompt": str(d.rows[i]["prompt"]), "chosen": d.rows[i]["chosen"],
                                        "rejected": d.rows[i]["rejected"], "score_chosen": r_w[j].item(),
                                        "score_rejected": r_l[j].item()})
        info.all_reduce(sums)
        samples = [x for part in info.gather_objects(samples) for x in part]
        count = sums[0].item()
        mean = sums[4].item() / (2 * count)
        std = math.sqrt(max(sums[5].item() / (2 * count) - mean**2, 0.0))
        return {f"{prefix}/accuracy": sums[1].item() / count, f"{prefix}/margin": sums[2].item() / count,
                f"{prefix}/loss": sums[3].item() / count, f"{prefix}/reward_mean": mean,
                f"{prefix}/reward_std": std}, samples

    def evaluate(step: int) -> dict:
        """score_set on the held-out pairs (eval/, reported) and the dev slice (dev/, selects output_dir/best)."""
        model.eval()
        metrics, samples = score_set(held_out, held_out_margin, "eval", args.num_sample_pairs)
        if len(dev):
            metrics |= score_set(dev, dev_margin, "dev", 0)[0]
        model.train()
        stats = {"reward_mean": metrics["eval/reward_mean"],  # normalisation of this model's scores
                 "reward_std": max(metrics["eval/reward_std"], 1e-6)}
        metrics.update(best.update(metrics, step, model, extra_config=stats))  # the best model in output_dir/best
        tracker.log(metrics, step)
        tracker.log_samples(samples, step)
        tracker.write(f"[step {step}] held-out pairwise accuracy {metrics['eval/accuracy']:.3f}, "
                      f"margin {metrics['eval/margin']:.2f}")
        return metrics

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG, this rank's loss window
    engines = {"model": model}
    start_step, state = ckpt.restore(engines, sampler=sampler, guard=guard, best=best)
    window = state.get("window", torch.zeros(6, dtype=torch.float64))  # pairs, loss, correct, margin, chosen, rejected

    # training loop
    timer = Timer()
    model.train()
    if start_step == 0:
        tracker.log({"data/train_pairs": len(train), "data/skipped_identical": train.num_identical,
                     "data/skipped_too_long": train.num_too_long}, 0)
        evaluate(0)
    local_idx: list[int] = []
    for step in range(start_step + 1, args.num_steps + 1):
        with timer("train"):
            global_idx = sampler.next_indices(args.batch_size)
            local_idx = global_idx[info.rank * args.local_batch_size : (info.rank + 1) * args.local_batch_size]
            for m in range(args.gradient_accumulation_steps):
                idx = local_idx[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                r_w, r_l = score_pairs(model, [train.prompt_ids[i] for i in idx], [train.chosen_ids[i] for i in idx],
                                       [train.rejected_ids[i] for i in idx], pad_id, info.device)
                margin = None if train_margin is None else torch.tensor([train_margin[i] for i in idx],
                                                                        device=r_w.device)
                losses = bradley_terry_loss(r_w, r_l, margin, args.center_rewards_coefficient)
                guard.backward(model, losses.sum() / args.local_batch_size)  # mean over the step
                grad_norm = guard.step(model)  # a non-finite loss or gradient skips the step (counted)
                with torch.no_grad():
                    window += torch.tensor([len(idx), losses.sum().item(), (r_w > r_l).sum().item(),
                                            (r_w - r_l).sum().item(), r_w.sum().item(), r_l.sum().item()],
                                           dtype=torch.float64)
        if step % 10 == 0 or step == args.num_steps:
            info.all_reduce(window)
            n = window[0].item()
            metrics = {"loss/rm": window[1].item() / n, "rm/accuracy": window[2].item() / n,
                       "rm/margin": window[3].item() / n, "rm/chosen": window[4].item() / n,
                       "rm/rejected": window[5].item() / n, "lr": scheduler.get_last_lr()[0],
                       "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                       "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
            tracker.log(metrics, step)
            tracker.progress(0, loss=metrics["loss/rm"])
            window.zero_()
        tracker.progress(1)
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            evaluate(step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, local={"window": window}, sampler=sampler, guard=guard, best=best)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)
    final_metrics = evaluate(args.num_steps)
    # the stats make scores normalised ((r - mean) / std) wherever shared/scalar.py::score_last_token reads them
    stats = {"reward_mean": final_metrics["eval/reward_mean"], "reward_std": max(final_metrics["eval/reward_std"], 1e-6)}
    final = save_hf(model, tokenizer, os.path.join(args.output_dir, "final"), info, extra_config=stats)
    tracker.log(check_ranks(model, info, local_idx), args.num_steps)  # after the save: a failure here loses nothing
    tracker.write(f"saved {final} (reward_mean {stats['reward_mean']:.3f}, reward_std {stats['reward_std']:.3f})")
    ckpt.finish()
    tracker.close()
    return str(final)


if __name__ == "__main__":
    run_cli(main, Args)
