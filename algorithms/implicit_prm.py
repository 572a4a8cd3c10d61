"""Implicit PRM: a process reward model trained from outcome labels only (cross-entropy loss). Docs: docs/implicit_prm.md

Paper: Yuan et al. 2024, "Free Process Rewards without Process Labels" (https://arxiv.org/abs/2412.01981); code:
PRIME-RL/ImplicitPRM (`CETrainer.loss_fn`). The outcome reward is parameterised by a causal LM pi_phi and a frozen
reference pi_ref (both start as the same model):
    r_phi(y) = beta * sum_t d_t,   d_t = log pi_phi(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t)
and trained on response-level labels l in {0, 1}; the process reward of a step (here: a line) comes for free as
beta * sum of d_t over the step's tokens, with no step labels.

Default objective (minimised; beta = --prm_beta = 0.05 as ImplicitPRM's run_ce.sh, prime.py's name):
    L(phi) = mean_i BCE(sigmoid(beta * (s_phi(y_i) - s_ref(y_i))), l_i),   s(y) = sum of the response's token log-probs

Delta from rm.py (algorithms/rm.py): the reward is a log-likelihood ratio of a causal LM to its frozen copy (no
scalar head), trained on (response, 0/1 label) rows, not on pairs; with no data file the rows are the start model's
own samples on the task's training prompts, graded by the task's grader (num_generations per prompt).
The saved model (output_dir/final) is an HF causal LM whose config.json also holds `implicit_prm_reference` (the
reference's absolute path, or its builtin or hub name) and `implicit_prm_beta`: a response's score is then beta *
sum_t d_t per line, the minimum over its lines (line_rewards below).

Launch:
    python algorithms/implicit_prm.py                          # CPU, built-in task, tiny model, a few minutes
    python algorithms/implicit_prm.py --data_path labelled.jsonl   # rows {"prompt": ..., "response": ..., "label": 0 or 1}
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/implicit_prm.py   # several processes
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
from shared import task as builtin_task
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, check_ranks, default_dtype, init_distributed, load_causal_lm,
                                load_tokenizer, prepare, prepare_frozen, seed_everything, unwrap)
from shared.generation import completion_decoder, make_generator
from shared.localisation import load_slips, localisation_metrics
from shared.logprobs import forward_logprobs
from shared.models import resolve_model_path
from shared.prompts import load_prompt_task
from shared.rewards import check_labels, compute_rewards, probe_reward_fn
from shared.tracking import Timer, Tracker
from shared.units import line_spans


@dataclass
class Args:
    # common args
    exp_name: str = "implicit_prm"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (sampling, data order)"""
    output_dir: str = "runs/implicit_prm"
    """where metrics.jsonl, samples.jsonl and the trained PRM (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """the start of pi_phi and its frozen reference pi_ref, and the sampler of the labelled responses"""
    dataset: str = "builtin"
    """prompts to sample and grade: `builtin` (`builtin:sums-N`), a .jsonl/.json/.parquet file, or a hub dataset"""
    data_path: str = ""
    """a .jsonl of labelled responses {"prompt", "response", "label": 0 or 1, optional "finished"} instead of sampling"""
    train_split: str = "train"
    """split to train on (of --dataset, or of --data_path: its sibling `<stem>.<split>.jsonl` or a 90% slice)"""
    eval_split: str = "test"
    """held-out split for the held-out metrics (of --dataset, or of --data_path)"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """dataset column holding the gold answer given to the grader"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    max_seq_length: Annotated[int, Ge(1)] = 512
    """--data_path rows whose prompt + response exceed this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader of the samples: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend of the sampling: `vllm` (in-process engine) or `hf` (model.generate)"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""

    # reliability (shared/checkpoint.py; docs/implicit_prm.md#reliability)
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
    best_metric: str = "dev/loss:min"
    """dev metric that picks output_dir/best (`name:min`: lower is better; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 32768
    """labelled responses to consume over the run (epochs = total_episodes / training rows)"""
    local_num_prompts: Annotated[int, Ge(1)] = 1024
    """training prompts sampled on each rank (without --data_path)"""
    num_generations: Annotated[int, Ge(1)] = 4
    """samples per prompt, graded 0/1 (without --data_path); the held-out and dev prompts get as many"""
    prm_beta: Annotated[float, Gt(0)] = 0.05
    """beta of r = beta * log pi_phi(y) / pi_ref(y) (ImplicitPRM's run_ce.sh: 0.05)"""
    learning_rate: Annotated[float, Gt(0)] = 5e-4
    """AdamW peak learning rate (linear warm-up, cosine decay to 10%; ImplicitPRM at 8B: 5e-7)"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """labelled responses per forward/backward on each rank"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature of the labelled responses (the PRM's log-probs are at temperature 1)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """length limit of the sampled responses; one that hits it is labelled 0 by the graders"""
    stop: tuple[str, ...] = ()
    """stop strings of the sampling (`--stop '</answer>'`): end a response, kept like EOS"""
    eval_every: Annotated[int, Ge(0)] = 50
    """evaluate on the held-out and dev rows (and slip pairs) every this many steps (0: only before and after)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 200
    """held-out prompts sampled num_generations times each for the held-out rows (without --data_path)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts kept out of training (<= 10%), whose rows pick output_dir/best (0: none)"""
    localisation_num_pairs: Annotated[int, Ge(0)] = 500
    """built-in task only: held-out slip pairs on which prm/localisation is measured (0: off)"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: algorithm-local pure functions
def implicit_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """d_t = log pi_phi(y_t) - log pi_ref(y_t) on response tokens, 0 elsewhere [B, T]; beta * d_t is the token's
    process reward and beta * sum_t d_t = beta * (s_phi(y) - s_ref(y)) the outcome reward r_phi(y)."""
    return (logp - ref_logp) * mask


def ce_loss(d: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """BCE(sigmoid(beta * sum_t d_t), l), mean over rows (ImplicitPRM `CETrainer.loss_fn`), from the logit."""
    return F.binary_cross_entropy_with_logits(beta * (d * mask).sum(1), labels.float())


def line_rewards(d: list[float], spans: list[tuple[int, int]], beta: float) -> list[float]:
    """Process reward of each line: beta * the sum of d_t over its tokens (the lines partition the tokens)."""
    return [beta * sum(d[a:b]) for a, b in spans]


def dpo_accuracy(scores: list[float], labels: list[float], groups: list[int]) -> float:
    """Per prompt, the share of response pairs whose scores order as their labels, weighted by |l_i - l_j|, 0.5 for
    a prompt with no label difference; mean over prompts (verl recipe/prime `compute_dpo_accuracy`)."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    out = []
    for rows in by_group.values():
        pairs = [(i, j) for a, i in enumerate(rows) for j in rows[a + 1 :]]
        w = sum(abs(labels[i] - labels[j]) for i, j in pairs)
        hit = sum(abs(labels[i] - labels[j]) for i, j in pairs
                  if ((scores[i] - scores[j]) > 0) == ((labels[i] - labels[j]) > 0))
        out.append(0.5 if w == 0 else hit / w)
    return sum(out) / max(len(out), 1)


def held_out_metrics(prefix: str, rewards: list[float], labels: list[float], groups: list[int], beta: float) -> dict:
    """The CE loss, accuracy (sigmoid(r) > 0.5 against the label), dpo_acc and the mean reward r of the correct and
    the incorrect responses of one labelled set, given each response's r = beta * sum_t d_t."""
    r, lab = torch.tensor(rewards, dtype=torch.float64), torch.tensor(labels, dtype=torch.float64)
    mean = lambda x: x.mean().item() if len(x) else float("nan")  # noqa: E731
    return {f"{prefix}/loss": F.binary_cross_entropy_with_logits(r, lab).item(),
            f"{prefix}/acc": ((r > 0).double() == lab).double().mean().item(),
            f"{prefix}/dpo_acc": dpo_accuracy(rewards, labels, groups),
            f"{prefix}/reward_correct": mean(r[lab == 1]), f"{prefix}/reward_incorrect": mean(r[lab == 0])}


def load_labelled(path: str, split: str, tokenizer, args: Args, part: str = "train") -> dict:
    """Rows {"prompt", "response", "label", optional "finished"} of --data_path, checked (one error naming the row and
    field), tokenized; a response gets EOS unless "finished" is false (cut off at a length limit, as a sampled one);
    rows over max_prompt_length / max_seq_length dropped. part: the split minus its dev slice ("train") or the slice
    ("dev")."""
    rows = data_utils.load_rows(path, split)
    where = f"data_path {path!r} split {split!r}"
    for i, row in zip(data_utils.row_numbers(rows), rows):
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str) or (key == "prompt" and not row[key].strip()):
                raise data_utils.DataError(f"{where}: row {i}: field {key!r} is {row.get(key)!r}, expected text")
        if row.get("label") not in (0, 1):
            raise data_utils.DataError(f"{where}: row {i}: field 'label' is {row.get('label')!r}, expected 0 or 1")
        if not isinstance(row.get("finished", True), bool):
            raise data_utils.DataError(f"{where}: row {i}: field 'finished' is {row['finished']!r}, expected true or "
                                       "false")
    if split == args.train_split:
        rows = data_utils.dev_split(rows, args.dev_num_prompts, part, where, key=lambda r: r["prompt"])
    out = {"prompt_ids": [], "response_ids": [], "labels": [], "groups": [], "dropped": 0}
    groups: dict[str, int] = {}
    for row in rows:
        ids = data_utils.encode_prompt(tokenizer, data_utils.format_prompt(row["prompt"], args.prompt_template),
                                       args.chat_template)
        response = data_utils.encode_response(tokenizer, row["response"], row.get("finished", True))
        if len(ids) > args.max_prompt_length or len(ids) + len(response) > args.max_seq_length:
            out["dropped"] += 1
            continue
        out["prompt_ids"].append(ids)
        out["response_ids"].append(response)
        out["labels"].append(float(row["label"]))
        out["groups"].append(groups.setdefault(row["prompt"], len(groups)))
    return out


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")

    # TRY NOT TO MODIFY: seeding (same seed on every rank for data order, then a per-rank seed for sampling)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003

    # data: the labelled file, or the prompts and grader of the samples; validated before anything is written
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    decode = completion_decoder(tokenizer, args.stop)
    if args.data_path:
        sets = {"train": load_labelled(args.data_path, args.train_split, tokenizer, args),
                "dev": load_labelled(args.data_path, args.train_split, tokenizer, args, part="dev"),
                "eval": load_labelled(args.data_path, args.eval_split, tokenizer, args)}
        if not sets["train"]["labels"]:
            raise data_utils.DataError(f"data_path {args.data_path!r}: no training rows")
    else:
        train_data, eval_data, dev_data, reward_fn = load_prompt_task(args, tokenizer)
        check_labels(probe_reward_fn(reward_fn, train_data.rows), reward_fn)  # the PRM's labels must be 0 or 1
    slips = (load_slips(args, tokenizer) if args.localisation_num_pairs and builtin_task.is_builtin(args.dataset)
             else None)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)

    # models: pi_phi (trained) and pi_ref (frozen), both from model_path
    dtype = default_dtype(info.device)
    prm = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
    ref = prepare_frozen(load_causal_lm(model_path, dtype), info, dtype)

    # labelled responses: the reference's own samples, graded (the same on resume: seeded, from the frozen model)
    timer = Timer()
    if not args.data_path:
        generator = make_generator(args.generator, model_path=model_path, model=unwrap(ref), tokenizer=tokenizer,
                                   dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                                   world_size=info.world_size, zero_stage=info.zero_stage, stop=args.stop,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization)

        def sample(data: data_utils.PromptData, idx: list[int], seed: int) -> dict:
            """num_generations graded samples of the prompts idx (this rank's share; every rank gets all rows)."""
            per_rank = math.ceil(len(idx) / info.world_size)
            local = idx[info.rank * per_rank : (info.rank + 1) * per_rank]
            outs = generator.generate([data.prompt_ids[i] for i in local], n=args.num_generations,
                                      temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens,
                                      seed=seed, index_offset=info.rank * per_rank) if local else []
            comps = [(i, c) for i, group in zip(local, outs) for c in group]
            rows = [data.rows[i] for i, _ in comps]
            labels = compute_rewards(reward_fn, [r["prompt"] for r in rows], [decode(c.token_ids) for _, c in comps],
                                     [r["answer"] for r in rows], [c.finished for _, c in comps], rows)
            check_labels(labels, reward_fn)
            local_rows = [(data.prompt_ids[i], c.token_ids, float(lab), i) for (i, c), lab in zip(comps, labels)]
            every = sum(info.gather_objects(local_rows), [])
            return {"prompt_ids": [r[0] for r in every], "response_ids": [r[1] for r in every],
                    "labels": [r[2] for r in every], "groups": [r[3] for r in every], "dropped": data.num_filtered}

        with timer("generate"):
            order = data_utils.PromptSampler(len(train_data.rows), args.seed).next_indices(
                min(len(train_data.rows), args.local_num_prompts * info.world_size))
            sets = {"train": sample(train_data, order, args.seed * 7_919),
                    "dev": sample(dev_data, list(range(len(dev_data.rows))), args.seed * 7_919 + 1),
                    "eval": sample(eval_data, list(range(len(eval_data.rows))), args.seed * 7_919 + 2)}
        del generator
    train = sets["train"]
    tracker.write(f"{len(train['labels'])} training rows ({sum(train['labels']):.0f} labelled 1; {train['dropped']} "
                  f"over max_prompt_length / max_seq_length dropped), {len(sets['dev']['labels'])} dev rows, "
                  f"{len(sets['eval']['labels'])} held-out rows, {args.num_steps} steps of {args.batch_size}")

    optimizer = torch.optim.AdamW(prm.parameters(), lr=args.learning_rate, weight_decay=0.0, betas=(0.9, 0.95),
                                  fused=True)
    warmup = max(1, math.ceil(args.warmup_ratio * args.num_steps))

    def lr_lambda(step: int) -> float:  # linear warm-up, cosine decay to 10% of the peak (ImplicitPRM's schedule)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    prm, optimizer, scheduler = prepare(prm, optimizer, scheduler, info, args.local_micro_batch_size,
                                        args.gradient_accumulation_steps, args.max_grad_norm, dtype)
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(sets["dev"]["labels"]))
    # the reference as a run in any directory finds it: a local directory's absolute path, else the name as given
    reference = (os.path.abspath(model_path) if os.path.isdir(os.path.expanduser(args.model_name_or_path))
                 else args.model_name_or_path)
    extra_config = {"implicit_prm_reference": reference, "implicit_prm_beta": args.prm_beta}
    sampler = data_utils.PromptSampler(len(train["labels"]), args.seed)

    def batch_d(prompt_ids: list, response_ids: list, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """d [B, T] of (prompt, response) rows and their response mask; the gradient reaches pi_phi only."""
        input_ids, attn, resp = data_utils.pad_batch(prompt_ids, response_ids, tokenizer.pad_token_id, info.device)
        mask = resp[:, 1:].float()  # position t predicts token t+1: the response, EOS included
        with torch.no_grad():
            ref_logp = forward_logprobs(ref, input_ids, attn, resp, 1.0)[0]
        with torch.set_grad_enabled(with_grad):
            logp = forward_logprobs(prm, input_ids, attn, resp, 1.0)[0]
        return implicit_rewards(logp, ref_logp, mask), mask

    def slip_credits(prompts, responses):
        """Line spans of held-out slip responses and their process rewards (shared/localisation.py)."""
        spans, credits = [], []
        for a in range(0, len(prompts), args.local_micro_batch_size):
            chunk = responses[a : a + args.local_micro_batch_size]
            d, mask = batch_d(prompts[a : a + args.local_micro_batch_size], chunk, False)
            for row, m, ids in zip(d, mask, chunk):
                spans.append(line_spans(decode, ids))
                credits.append(line_rewards(row[m.bool()].tolist(), spans[-1], args.prm_beta))
        return spans, credits

    def evaluate(step: int) -> dict:
        """Held-out metrics of the eval and dev rows (each rank scores its share) and slip localisation."""
        prm.eval()
        metrics = {}
        for prefix in ("eval", "dev"):
            s = sets[prefix]
            n = len(s["labels"])
            if not n:
                continue
            per_rank = math.ceil(n / info.world_size)
            idx = list(range(info.rank * per_rank, min(n, (info.rank + 1) * per_rank)))
            padded = [idx[j % len(idx)] if idx else 0 for j in range(per_rank)]  # forwards in step under ZeRO-3
            rewards = []
            for a in range(0, per_rank, args.local_micro_batch_size):
                rows = padded[a : a + args.local_micro_batch_size]
                d, mask = batch_d([s["prompt_ids"][i] for i in rows], [s["response_ids"][i] for i in rows], False)
                rewards += (args.prm_beta * (d * mask).sum(1)).tolist()
            every = sum(info.gather_objects(list(zip(idx, rewards[: len(idx)]))), [])
            r = [v for _, v in sorted(every)]
            metrics |= held_out_metrics(prefix, r, s["labels"], s["groups"], args.prm_beta)
        if slips is not None:
            metrics |= {k.replace("eval/", "prm/"): v for k, v in localisation_metrics(slips, info, decode,
                                                                                        slip_credits).items()}
        prm.train()
        return {**metrics, **best.update(metrics, step, prm, extra_config)}

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG
    engines = {"prm": prm}
    resumable = {"sampler": sampler, "guard": guard, "best": best}
    start_step, state = ckpt.restore(engines, **resumable)
    first_eval = state.get("first_eval")

    # training loop
    start = time.time()
    if start_step == 0:
        metrics = evaluate(0)
        tracker.log({**metrics, **timer.pop()}, 0)
        first_eval = metrics.get("eval/loss", float("nan"))
        tracker.write(f"[step 0] held-out CE loss {first_eval:.4f}")
    prm.train()
    for step in range(start_step + 1, args.num_steps + 1):
        ckpt.step_start(tracker, **resumable, first_eval=first_eval)
        idx = sampler.next_indices(args.batch_size)[info.rank * args.local_batch_size :
                                                    (info.rank + 1) * args.local_batch_size]
        stats = {"loss": 0.0, "acc": 0.0}
        rewards, labels = [], []
        grad_norm = None
        with timer("train"):
            for m in range(args.gradient_accumulation_steps):
                rows = idx[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                d, mask = batch_d([train["prompt_ids"][i] for i in rows], [train["response_ids"][i] for i in rows],
                                  True)
                lab = torch.tensor([train["labels"][i] for i in rows], device=info.device)
                loss = ce_loss(d, lab, mask, args.prm_beta) / args.gradient_accumulation_steps
                guard.backward(prm, loss)
                norm = guard.step(prm)  # a non-finite loss or gradient skips the step (counted)
                grad_norm = norm if norm is not None else grad_norm
                stats["loss"] += loss.item()
                rewards += (args.prm_beta * (d.detach() * mask).sum(1)).tolist()
                labels += lab.tolist()
        r, lab = torch.tensor(rewards), torch.tensor(labels)
        local = {"prm/loss": stats["loss"], "prm/acc": ((r > 0).float() == lab).float().mean().item(),
                 "prm/reward_correct": r[lab == 1].mean().item() if (lab == 1).any() else 0.0,
                 "prm/reward_incorrect": r[lab == 0].mean().item() if (lab == 0).any() else 0.0,
                 "optim/grad_norm": grad_norm or 0.0}
        metrics = {**info.mean_over_ranks(local), "lr": scheduler.get_last_lr()[0], "episode": step * args.batch_size,
                   "optim/nonfinite_skipped": guard.skipped, **timer.pop()}
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"), ckpt.user_code(step, engines, tracker, trained=True, **resumable, first_eval=first_eval):
                metrics.update(evaluate(step))
            metrics.update(timer.pop())
        tracker.log(metrics, step)
        tracker.progress(1, loss=metrics["prm/loss"])

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
    # output_dir/final: the PRM with the reference and beta in its config (what a best-of-N scorer needs)
    final = str(save_hf(prm, tokenizer, os.path.join(args.output_dir, "final"), info, extra_config))
    metrics.update(check_ranks(prm, info, idx))
    tracker.log(metrics, args.num_steps)
    last = metrics.get("eval/loss", float("nan"))
    tracker.write(f"held-out CE loss {first_eval:.4f} -> {last:.4f}, prm/localisation "
                  f"{metrics.get('prm/localisation', float('nan')):.3f} in {metrics['time/total']:.0f}s")
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
