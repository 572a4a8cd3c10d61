"""RestEM: expert iteration (rejection-sampling fine-tuning from the base model). Docs: docs/restem.md

Paper: Singh et al. 2023, "Beyond Human Data: Scaling Self-Training for Problem-Solving with Language Models"
(https://arxiv.org/abs/2312.06585); the reference here is the VinePPO codebase's `restem_trainer.py` and
`math_restem_episode_generator.py` (McGill-NLP/VinePPO).
Each iteration:
  1. E-step: sample K completions for each of a batch of training prompts from the current policy, grade them,
     keep those with reward >= correct_threshold, at most max_responses_per_prompt per prompt (the first ones).
  2. M-step: start FROM THE BASE MODEL again (fresh weights, fresh AdamW and LR schedule) and fine-tune it on the
     kept samples for num_epochs with the per-sequence token-mean NLL, logits divided by the sampling temperature.
     Candidates: the base (epoch 0) and the model after every epoch, each scored on the dev slice.
  3. Pick the candidate (`restem_paper_original`: walk the candidates in order, advance while the dev accuracy
     strictly improves; `choose_best`: the best one); it is the sampling policy of the next iteration.

Delta from SFT (algorithms/sft.py): the training set is the policy's own graded samples, rebuilt every
iteration, and training restarts from the base each time; no reward model, no advantage, no KL term (the KL to
the base is only logged: 0 before the first update of every iteration).

Launch:
    python algorithms/restem.py                                # CPU, built-in task, tiny model, a few minutes
    python algorithms/restem.py --generator hf                 # HF generate instead of vLLM
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/restem.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --chat_template --dataset openai/gsm8k:main \
        --prompt_key question --answer_key answer --reward_fn gsm8k --max_new_tokens 512 --learning_rate 1e-6 \
        --prompt_template $'{prompt}\\nSolve it step by step, then give the final answer on the last line as "#### <number>".'
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
                                load_tokenizer, prepare, prepare_frozen, seed_everything)
from shared.evaluation import evaluate_accuracy
from shared.generation import check_engine, completion_decoder, make_generator
from shared.logprobs import forward_logprobs
from shared.models import resolve_model_path
from shared.rewards import compute_rewards, load_reward_fn, probe_reward_fn
from shared.tracking import Timer, Tracker


@dataclass
class Args:
    # common args
    exp_name: str = "restem"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (data order, sampling)"""
    output_dir: str = "runs/restem"
    """where metrics.jsonl, samples.jsonl and the final HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """the base model (every iteration restarts from it); `builtin:tiny-sft` is the tiny model warm-started by sft.py"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split to sample training prompts from"""
    eval_split: str = "test"
    """held-out split for evaluation"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    answer_key: str = "answer"
    """dataset column holding the gold answer given to the grader"""
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
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""

    # reliability (shared/checkpoint.py; docs/restem.md#reliability)
    save_every: Annotated[int, Ge(0)] = 50
    """save a resumable checkpoint every this many step slots (docs/restem.md; 0: only on SIGTERM/SIGINT or stop_after_steps)"""
    keep_checkpoints: Annotated[int, Ge(1)] = 2
    """how many of the most recent checkpoints to keep in output_dir/checkpoints"""
    resume: str = "auto"
    """`auto`: resume the latest checkpoint if any; `yes`: must; `no`: must not; `overwrite`: start afresh; or a checkpoint dir"""
    stop_after_steps: Annotated[int, Ge(0)] = 0
    """save a checkpoint and exit after this many steps of this invocation (0: run to the end); for time-limited jobs"""
    max_nonfinite_steps: Annotated[int, Ge(0)] = 10
    """optimizer steps with a non-finite loss or gradient are skipped and counted; abort the run after this many"""
    best_metric: str = "dev/accuracy"
    """dev metric that picks output_dir/best among the iterations' policies (`name:min`: lower is better; empty: none)"""

    # algorithm args
    total_episodes: Annotated[int, Ge(1)] = 8192
    """total completions to sample over the run (iterations = total_episodes / (num_prompts * num_generations))"""
    local_num_prompts: Annotated[int, Ge(1)] = 512
    """training prompts sampled per iteration on each rank (a new slice of the shuffled train split every iteration)"""
    num_generations: Annotated[int, Ge(1)] = 8
    """K: completions sampled per prompt in the E-step (VinePPO: 8)"""
    correct_threshold: Annotated[float, Interval()] = 1.0  # any real number
    """a completion is kept when its reward is >= this (VinePPO: 1.0, i.e. graded correct)"""
    max_responses_per_prompt: Annotated[int, Ge(1)] = 10
    """at most this many kept completions per prompt, the first ones in sampling order (VinePPO / paper: 10)"""
    num_epochs: Annotated[int, Ge(1)] = 3
    """M-step epochs over the kept samples, from the base model (VinePPO: 8)"""
    early_stop: Literal["restem_paper_original", "choose_best"] = "restem_paper_original"
    """candidate choice on the dev slice: advance while dev accuracy improves (and stop training there), or the best epoch"""
    learning_rate: Annotated[float, Gt(0)] = 2e-4
    """AdamW peak learning rate of every M-step (VinePPO, 1B models: 1e-6)"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of an iteration's planned steps used for linear warm-up (then linear decay to 0, VinePPO's WarmupDecayLR)"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(1)] = 64
    """sequences per forward/backward on each rank (HF `per_device_train_batch_size`)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature of the E-step; the trainer divides logits by it too (VinePPO: 0.6)"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling in the E-step (VinePPO: 0.9)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; completions that hit it get reward 0 from the graders"""
    stop: tuple[str, ...] = ()
    """stop strings (`--stop '</answer>'`): end a completion, kept and trained on like EOS; rewards see the text before it"""
    eval_num_prompts: Annotated[int, Ge(0)] = 500
    """held-out prompts per evaluation (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts never trained on (<= 10%) that choose each iteration's candidate and output_dir/best (0: last)"""
    eval_num_samples: Annotated[int, Ge(1)] = 4
    """samples per held-out (and dev) prompt: accuracy = mean correctness, pass@k over them"""
    eval_temperature: Annotated[float, Ge(0)] = 1.0
    """sampling temperature for evaluation"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_prompts: tyro.conf.Suppress[int] = 0
    num_em_iterations: tyro.conf.Suppress[int] = 0
    steps_per_iteration: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: algorithm-local pure functions
def filter_correct(rewards: list[list[float]], threshold: float, cap: int) -> list[tuple[int, int]]:
    """(prompt, sample) indices of the kept completions: reward >= threshold, the first `cap` of each prompt in
    sampling order (VinePPO `math_restem_episode_generator.py`). rewards: [P][K]."""
    kept = []
    for p, group in enumerate(rewards):
        ok = [k for k, r in enumerate(group) if r >= threshold]
        kept += [(p, k) for k in ok[:cap]]
    return kept


def sequence_mean_nll(logp: torch.Tensor, mask: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss  -(1/B) sum_i [sum_t logp_it m_it / sum_t m_it]  (B = num_seqs
    of the whole optimizer step on this rank): each sequence's token-mean NLL, then the mean over sequences
    (VinePPO `sequence_logp_reduction="mean"`; not a global token mean, which weighs long sequences more)."""
    per_seq = (logp * mask).sum(1) / mask.sum(1).clamp(min=1)
    return -per_seq.sum() / num_seqs


def choose_checkpoint(accuracies: list[float], method: str) -> int:
    """Index of the chosen candidate. restem_paper_original: start at the first, advance while the next one is
    strictly better, stop at the first that is not (VinePPO `evaluate_checkpoints`); choose_best: the argmax
    (the first of ties). [0.30, 0.32, 0.31, 0.35] -> 1 and 3."""
    if method == "restem_paper_original":
        chosen = 0
        for i in range(1, len(accuracies)):
            if accuracies[i] > accuracies[i - 1]:
                chosen = i
            else:
                break
        return chosen
    if method == "choose_best":
        return max(range(len(accuracies)), key=lambda i: (accuracies[i], -i))
    raise ValueError(f"early_stop: expected restem_paper_original or choose_best, got {method!r}")


def validate(args: Args) -> None:
    """One-line errors naming the flag, at start-up, for what the ranges beside the flags cannot say."""


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes (local_* is per rank)
    validate(args)
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_prompts = args.local_num_prompts * info.world_size
    args.num_em_iterations = args.total_episodes // (args.num_prompts * args.num_generations)
    if args.num_em_iterations < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one iteration "
                         f"({args.num_prompts} prompts x {args.num_generations} samples)")
    # an iteration trains at most num_epochs * ceil(kept / batch) steps, kept <= num_prompts * min(K, cap); steps
    # are slots on this fixed grid (iteration i owns steps i*S+1 .. (i+1)*S), so resume and the bar need no data
    max_kept = args.num_prompts * min(args.num_generations, args.max_responses_per_prompt)
    args.steps_per_iteration = args.num_epochs * math.ceil(max_kept / args.batch_size)
    args.num_steps = args.num_em_iterations * args.steps_per_iteration

    # TRY NOT TO MODIFY: seeding (same seed on all ranks for data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003  # a prime offset per rank, as vwxyzjn/summarize_from_feedback_details

    # data: validated before anything is written (a bad row, model path or grader stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    load = lambda split, limit=None, part="train": data_utils.load_prompts(  # noqa: E731
        args.dataset, split, tokenizer, args.prompt_key, args.answer_key, args.prompt_template, args.chat_template,
        args.max_prompt_length, limit=limit, num_dev=args.dev_num_prompts if split == args.train_split else 0,
        part=part)
    train_data, eval_data = load(args.train_split), load(args.eval_split, args.eval_num_prompts)
    dev_data = load(args.train_split, part="dev")  # chooses candidates and best/; never the reported eval set
    prompt_sampler = data_utils.PromptSampler(len(train_data.rows), args.seed)
    reward_fn = load_reward_fn(args.reward_fn, args.dataset)
    probe_reward_fn(reward_fn, train_data.rows)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)
    tracker.write(f"{len(train_data.rows)} train prompts ({train_data.num_filtered} over max_prompt_length dropped), "
                  f"{len(eval_data.rows)} eval prompts, {len(dev_data.rows)} dev prompts; {args.num_em_iterations} "
                  f"iterations of {args.num_prompts} prompts x {args.num_generations} samples, at most "
                  f"{args.steps_per_iteration} steps of {args.batch_size} each")

    # models: the frozen base (KL logging) and a policy engine built afresh from the base every iteration
    dtype = default_dtype(info.device)
    base = prepare_frozen(load_causal_lm(model_path, dtype), info, dtype)
    planned = {"steps": 1}  # the LR schedule's length: this iteration's planned steps (set once its data is known)

    def lr_lambda(step: int) -> float:  # linear warm-up, then linear decay to 0 (VinePPO: DeepSpeed WarmupDecayLR)
        warmup = max(1, math.ceil(args.warmup_ratio * planned["steps"]))
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (planned["steps"] - step) / max(1, planned["steps"] - warmup))

    def new_policy(weights: dict | None = None):
        """ALGO LOGIC: a fresh copy of the base model (or of `weights`) with a fresh AdamW and LR schedule."""
        model = load_causal_lm(model_path, dtype, args.gradient_checkpointing)
        if weights is not None:
            model.load_state_dict(weights, strict=False)  # parameters only; buffers come from the base
        optimizer = torch.optim.AdamW(model.to(info.device).parameters(), lr=args.learning_rate,
                                      weight_decay=args.weight_decay, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return prepare(model, optimizer, scheduler, info, args.local_micro_batch_size,
                       args.gradient_accumulation_steps, args.max_grad_norm, dtype)[0]

    policy = new_policy()
    seed_everything(local_seed)
    guard = NonFiniteGuard(args.max_nonfinite_steps)  # skips non-finite steps, aborts after max_nonfinite_steps
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, bool(dev_data.rows))

    # generation engine: vLLM is built once and gets each policy's weights in place; HF generates with the policy
    max_len = args.max_prompt_length + args.max_new_tokens
    vllm = None
    if args.generator == "vllm":
        vllm = make_generator("vllm", model_path=model_path, model=policy.module, tokenizer=tokenizer, dtype=dtype,
                              seed=local_seed, max_model_len=max_len, world_size=info.world_size,
                              zero_stage=info.zero_stage, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                              enable_sleep_mode=args.vllm_enable_sleep, stop=args.stop)
    decode = completion_decoder(tokenizer, args.stop)

    def generator_for(engine):
        """The generation engine serving `engine`'s current weights."""
        if vllm is None:
            return make_generator("hf", model_path=model_path, model=engine.module, tokenizer=tokenizer, dtype=dtype,
                                  seed=local_seed, max_model_len=max_len, world_size=info.world_size,
                                  zero_stage=info.zero_stage, stop=args.stop)
        vllm.sync_weights(full_named_parameters(engine, info))
        return vllm

    def evaluate(engine, sets: dict) -> dict:  # grader accuracy and pass@k (shared/evaluation.py), same seed always
        generator = generator_for(engine)
        metrics = evaluate_accuracy(generator, sets, reward_fn, decode, info, args.eval_num_samples,
                                    args.eval_temperature, args.max_new_tokens, seed=args.seed + 1_000_003)
        generator.sleep()  # --vllm_enable_sleep: free the GPU for training (level 1: the weights wait in CPU memory)
        return metrics

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR schedule, prompt position, RNG and the iteration's state
    S = args.steps_per_iteration
    state = {"iteration": 0, "phase": "sample", "first_eval": None}  # phase "train": mid-iteration, see below
    start_step, restored = ckpt.restore({"policy": policy}, sampler=prompt_sampler, guard=guard, best=best)
    state = restored.get("restem", state)
    kept_sampler = data_utils.PromptSampler(max(1, len(state.get("kept", []))),
                                            args.seed * 1_000_003 + state["iteration"])
    if state["phase"] == "train":
        planned["steps"] = state["planned_steps"]
        kept_sampler.load_state_dict(state["kept_sampler"])

    timer = Timer()
    start = time.time()
    if start_step == 0 and state["phase"] == "sample" and state["iteration"] == 0:
        metrics = evaluate(policy, {"eval": eval_data, "dev": dev_data})
        metrics.update(best.update(metrics, 0, policy))  # the base is a candidate for best/ too
        tracker.log({**metrics, "data/train_prompts": len(train_data.rows),
                     "data/skipped_too_long": train_data.num_filtered}, 0)
        tracker.write(f"[step 0] held-out accuracy {metrics['eval/accuracy']:.3f}")
        state["first_eval"] = metrics["eval/accuracy"]

    step = start_step
    while state["iteration"] < args.num_em_iterations:
        it = state["iteration"]
        first = it * S
        row: dict = {}
        if state["phase"] == "sample":
            # 1. E-step: K samples per prompt from the current policy (the previous iteration's choice)
            with timer("generate"):
                global_idx = prompt_sampler.next_indices(args.num_prompts)
                local_idx = global_idx[info.rank * args.local_num_prompts : (info.rank + 1) * args.local_num_prompts]
                generator = generator_for(policy)
                outs = generator.generate([train_data.prompt_ids[i] for i in local_idx],
                                          n=args.num_generations, temperature=args.temperature,
                                          top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                          seed=args.seed * 7_919 + it,
                                          index_offset=info.rank * args.local_num_prompts)
                generator.sleep()  # --vllm_enable_sleep: free the GPU while the M-step trains
            with timer("reward"):
                rows = [train_data.rows[i] for i in local_idx for _ in range(args.num_generations)]
                comps = [c for group in outs for c in group]
                texts = [decode(c.token_ids) for c in comps]
                scores = compute_rewards(reward_fn, [x["prompt"] for x in rows], texts, [x["answer"] for x in rows],
                                         [c.finished for c in comps], rows)
            K = args.num_generations
            grouped = [scores[p * K : (p + 1) * K] for p in range(len(local_idx))]
            local_kept = [(local_idx[p], outs[p][k].token_ids)
                          for p, k in filter_correct(grouped, args.correct_threshold, args.max_responses_per_prompt)]
            kept = sum(info.gather_objects(local_kept), [])  # every rank holds the whole training set
            gathered = info.gather_objects([sum(scores), len(scores), sum(any(r >= args.correct_threshold for r in g)
                                                                          for g in grouped)])
            row.update({"objective/scores": sum(g[0] for g in gathered) / sum(g[1] for g in gathered),
                        "restem/kept": len(kept), "restem/iteration": it,
                        "restem/prompts_with_correct": sum(g[2] for g in gathered) / args.num_prompts,
                        "episode": (it + 1) * args.num_prompts * K})
            tracker.log_samples([{"prompt": x["prompt"], "completion": t, "reward": r}
                                 for x, t, r in list(zip(rows, texts, scores))[::K][:8]], first)

            # 2. M-step set-up: a fresh copy of the base with a fresh optimizer; candidate 0 is the base itself
            steps_per_epoch = math.ceil(len(kept) / args.batch_size)
            planned["steps"] = max(1, args.num_epochs * steps_per_epoch)
            del policy
            policy = new_policy()
            kept_sampler = data_utils.PromptSampler(max(1, len(kept)), args.seed * 1_000_003 + it)
            accs = [evaluate(policy, {"dev": dev_data})["dev/accuracy"]] if dev_data.rows else []
            state = {**state, "phase": "train", "kept": kept, "s": 0, "planned_steps": planned["steps"],
                     "steps_per_epoch": steps_per_epoch, "accs": accs, "chosen": 0, "chosen_weights": None}
            if accs:
                row["restem/candidate_dev_accuracy"] = accs[0]
            tracker.log(row, first)
            row = {}

        # 3. M-step: one optimizer step on the kept samples (none if nothing was kept)
        kept, spe = state["kept"], state["steps_per_epoch"]
        done = not kept
        if kept:
            state["s"] += 1
            s = state["s"]
            step = first + s
            with timer("train"):
                global_idx = kept_sampler.next_indices(args.batch_size)
                local = [kept[i] for i in global_idx[info.rank * args.local_batch_size :
                                                     (info.rank + 1) * args.local_batch_size]]
                loss_sum, kl_sum, ent_sum, grad_norm = 0.0, 0.0, 0.0, None
                for m in range(args.gradient_accumulation_steps):
                    micro = local[m * args.local_micro_batch_size : (m + 1) * args.local_micro_batch_size]
                    input_ids, attn, resp = data_utils.pad_batch([train_data.prompt_ids[i] for i, _ in micro],
                                                                 [ids for _, ids in micro], tokenizer.pad_token_id,
                                                                 info.device)
                    mask = resp[:, 1:].float()  # position t predicts token t+1: the completion, EOS included
                    logp, entropy = forward_logprobs(policy, input_ids, attn, resp, args.temperature, True)
                    loss = sequence_mean_nll(logp, mask, len(local))
                    with torch.no_grad():  # KL(policy || base) per sequence before this step's update (k1, VinePPO)
                        base_logp = forward_logprobs(base, input_ids, attn, resp, args.temperature)[0]
                        kl_sum += ((logp.detach() - base_logp) * mask).sum().item() / len(local)
                        token_mean = ((entropy * mask).sum() / mask.sum().clamp(min=1)).item()
                        ent_sum += token_mean / args.gradient_accumulation_steps  # averaged over micro-batches
                    guard.backward(policy, loss)
                    norm = guard.step(policy)  # a non-finite loss or gradient skips the step (counted)
                    grad_norm = norm if norm is not None else grad_norm
                    loss_sum += loss.item()
            if s == 1 or s % 10 == 0:
                stats = info.gather_objects([loss_sum, kl_sum, ent_sum])
                row.update({"loss/nll": sum(x[0] for x in stats) / len(stats),
                            "objective/kl": sum(x[1] for x in stats) / len(stats),
                            "objective/entropy": sum(x[2] for x in stats) / len(stats),
                            "lr": policy.lr_scheduler.get_last_lr()[0], "optim/grad_norm": grad_norm,
                            "restem/step_in_iteration": s, "optim/nonfinite_skipped": guard.skipped, **timer.pop()})
            tracker.progress(1, loss=loss_sum)

            # 4. candidate at every epoch end, scored on the dev slice; restem_paper_original stops at the first
            #    candidate that does not improve (no later one can be chosen)
            if s % spe == 0 or s == state["planned_steps"]:
                if dev_data.rows:
                    with timer("eval"):
                        state["accs"].append(evaluate(policy, {"dev": dev_data})["dev/accuracy"])
                    row["restem/candidate_dev_accuracy"] = state["accs"][-1]
                    chosen = choose_checkpoint(state["accs"], args.early_stop)
                    if chosen == len(state["accs"]) - 1:
                        state["chosen"] = chosen
                        state["chosen_weights"] = {n: t.detach().cpu().clone()
                                                   for n, t in full_named_parameters(policy, info)}
                    done = args.early_stop == "restem_paper_original" and chosen < len(state["accs"]) - 1
                else:  # no dev slice: the last epoch is kept
                    state["chosen"] = s // spe
                    state["chosen_weights"] = {n: t.detach().cpu().clone()
                                               for n, t in full_named_parameters(policy, info)}
            done = done or s == state["planned_steps"]
        if done:
            # 5. the chosen candidate becomes the policy: sampler of the next iteration, evaluated on eval and dev
            weights = state["chosen_weights"]
            del policy
            policy = new_policy(weights)
            with timer("eval"):
                metrics = evaluate(policy, {"eval": eval_data, "dev": dev_data})
            metrics.update(best.update(metrics, first + S, policy))  # best/ among the iterations' choices, on dev
            row.update({**metrics, "restem/chosen_epoch": state["chosen"], "restem/iteration": it,
                        "restem/steps_trained": state["s"], **timer.pop()})
            tracker.write(f"[iteration {it + 1}/{args.num_em_iterations}] kept {len(kept)}, trained {state['s']} steps, "
                          f"chose epoch {state['chosen']}: held-out accuracy {metrics['eval/accuracy']:.3f}")
            state = {"iteration": it + 1, "phase": "sample", "first_eval": state["first_eval"]}
            tracker.progress(first + S - step)  # the iteration's unused slots
            step = first + S
        if row:
            tracker.log(row, step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            if state["phase"] == "train":
                state["kept_sampler"] = kept_sampler.state_dict()
            ckpt.save(step, {"policy": policy}, tracker, sampler=prompt_sampler, guard=guard, best=best, restem=state)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)

    metrics = {"time/total": time.time() - start, **check_engine(vllm, policy, eval_data.prompt_ids[:4], info,
                                                                 args.max_new_tokens)}
    tracker.log(metrics, args.num_steps)
    last = tracker.last_eval[0] if info.is_main and tracker.last_eval else float("nan")
    tracker.write(f"held-out accuracy {state['first_eval']:.3f} -> {last:.3f} in {metrics['time/total']:.0f}s")
    final = str(save_hf(policy, tokenizer, os.path.join(args.output_dir, "final"), info))
    ckpt.finish()
    tracker.close()
    return final


if __name__ == "__main__":
    run_cli(main, Args)
