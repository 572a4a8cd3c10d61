"""GenRM: a generative verifier, the language model trained to say whether a solution is correct. Docs: docs/genrm.md

Paper: Zhang et al. 2024, "Generative Verifiers: Reward Modeling as Next-Token Prediction" (ICLR 2025,
https://arxiv.org/abs/2408.15240). The verifier reads a question x and a candidate solution y, then the question
I = "Is the answer correct?", and answers with a verdict token; its score is r(x, y) = p(Yes | x, y, I).
    L(theta) = NLL(verdict | x, y, I) + sft_coef * NLL(y+ | x)          (paper §3; each term a token mean)
The first term trains verification on (x, y, Yes/No) with labels from the task's grader on a policy's own samples,
balanced Yes/No in every batch; the second is SFT on the correct samples (the paper's "unifying generation and
verification"; --sft_coef 0 drops it). `--verifier cot` (GenRM-CoT): the target is a verification rationale, then I,
then the verdict; on the built-in task the rationales are written by a program that knows the expected running sums
(reference-guided grading, as the authors' data), one line per response line: "given expected Y|N". At score time K
rationales are sampled (--num_rationales, --rationale_temperature) and r is the mean of their p(Yes); a rationale
that never reaches I scores 0. `--loss_type bce --sft_coef 0` is the paper's baseline, a discriminative verifier
trained by a classification loss on the same labelled solutions: a scalar logit z = log p(Yes) - log p(No) (a linear
head on the last hidden state, initialised from the two verdicts' output rows), BCE(sigmoid(z), label), and the
score sigmoid(z) = p(Yes) / (p(Yes) + p(No)); its held-out p(Yes) metrics are that score.

Delta from SFT (algorithms/sft.py, its base): the training set is built first, by sampling a policy on the training
prompts and grading the samples (or read from --data_path); each step trains on a balanced verification batch plus an
SFT batch; held-out metrics are the verifier's (p(Yes) by label, AUROC, best-of-N over the policy's held-out samples),
not the policy's accuracy. output_dir/final is an HF causal LM whose config.json holds the prompt format, verdict
strings and mode, so `--reward_model_path output_dir/final` of grpo.py scores completions by p(Yes), and
algorithms/evaluate.py's --verifiers selects best-of-N with it.

Launch:
    python algorithms/genrm.py                                 # CPU, built-in task, verifier of builtin:tiny-sft
    python algorithms/genrm.py --verifier cot                  # GenRM-CoT, programmatic rationales
    python algorithms/genrm.py --loss_type bce --sft_coef 0    # the discriminative baseline on the same data
    python algorithms/grpo.py --reward_model_path runs/genrm/final     # RL with the verifier's p(Yes) as reward
    accelerate launch --config_file scripts/accelerate/zero2.yaml algorithms/genrm.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --chat_template --dataset openai/gsm8k:main \
        --prompt_key question --answer_key answer --reward_fn gsm8k --max_new_tokens 512 --learning_rate 1e-6 \
        --prompt_template $'{prompt}\\nSolve it step by step, then give the final answer on the last line as "#### <number>".'
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared import task
from shared.checkpoint import BestModel, Checkpointer, save_hf
from shared.cli import run_cli
from shared.distributed import (NonFiniteGuard, default_dtype, init_distributed, load_causal_lm, load_tokenizer,
                                prepare, seed_everything)
from shared.evaluation import best_of_n, eval_seed, generate_chunks, maj_at_k, pass_at_k, prompt_chunks, shard
from shared.generation import completion_decoder, make_generator
from shared.logprobs import forward_logprobs
from shared.models import resolve_model_path
from shared.rewards import check_labels, compute_rewards, load_answer_fn, load_reward_fn, probe_reward_fn
from shared.tracking import Timer, Tracker
from shared.verifier import GenerativeVerifier, text_ids


@dataclass
class Args:
    # common args
    exp_name: str = "genrm"
    """the name of this experiment (prefix of the run name)"""
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the experiment (policy samples, data order)"""
    output_dir: str = "runs/genrm"
    """where metrics.jsonl, samples.jsonl and the verifier's HF checkpoint (output_dir/final) are written"""
    model_name_or_path: str = "builtin:tiny-sft"
    """the model the verifier is trained from"""
    policy_name_or_path: str = ""
    """the policy whose graded samples are the training and held-out data (empty: model_name_or_path)"""
    data_path: str = ""
    """a .jsonl of labelled solutions (prompt, completion, label 0/1; optional rationale, finished) instead of sampling"""
    dataset: str = "builtin"
    """`builtin` (`builtin:sums-N`: N = 3..12 terms), a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    train_split: str = "train"
    """dataset split whose prompts the policy answers for the training data"""
    eval_split: str = "test"
    """held-out split: the policy's samples there measure the verifier"""
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
    max_seq_length: Annotated[int, Ge(1)] = 512
    """--data_path rows whose prompt + completion exceed this many tokens are dropped (and counted)"""
    reward_fn: str = "auto"
    """grader giving the labels: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify`, or `module:function`"""
    report_to: Literal["none", "wandb", "trackio"] = "none"
    """also log metrics (same names as output_dir/metrics.jsonl) to Weights & Biases or trackio (local-first)"""
    project: str = "cleanrlhf"
    """wandb / trackio project name"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers, DeepSpeed, accelerate)"""
    generator: Literal["hf", "vllm"] = "hf"
    """backend sampling the policy: `hf` (model.generate; no engine start) or `vllm`"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""
    gradient_checkpointing: bool = True
    """recompute each layer's activations in the backward pass: less memory, ~1/3 more compute (docs/performance.md)"""

    # reliability (shared/checkpoint.py; docs/genrm.md#reliability)
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
    best_metric: str = "dev/auroc"
    """dev metric that selects output_dir/best (higher is better; `name:min`: lower is better; empty: none)"""

    # algorithm args
    verifier: Literal["direct", "cot"] = "direct"
    """`direct`: the verdict right after the question; `cot`: a verification rationale first (built-in task or data rationales)"""
    verdict_format: Literal["auto", "paper", "short"] = "auto"
    """`paper`: 'Verification: Is the answer correct (Yes/No)?' ' Yes'/' No'; `short`: 'Correct? ' 'Y'/'N'; `auto`: paper if 1-token"""
    sft_coef: Annotated[float, Ge(0)] = 1.0
    """lambda: weight of the SFT loss on correct solutions (paper §3; 0: verification only)"""
    loss_type: Literal["nll", "bce"] = "nll"
    """`nll`: GenRM, the verdict's NLL; `bce`: the paper's discriminative baseline, BCE on log p(Yes) - log p(No)"""
    balance: bool = True
    """draw every verification batch half Yes, half No (else in proportion to the labels)"""
    local_num_prompts: Annotated[int, Ge(1)] = 512
    """training prompts the policy answers, per rank (the training data: local_num_prompts x num_generations samples)"""
    num_generations: Annotated[int, Ge(1)] = 8
    """samples of the policy per training prompt"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature of the policy's samples"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit of the policy's samples; a truncated one is labelled No by the graders"""
    stop: tuple[str, ...] = ()
    """stop strings of the policy's samples (`--stop '</answer>'`); graders see the text before it"""
    total_episodes: Annotated[int, Ge(1)] = 32768
    """verification examples to train on (steps = total_episodes / batch size)"""
    learning_rate: Annotated[float, Gt(0)] = 1e-3
    """peak learning rate (linear warm-up, cosine decay to 10%)"""
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.03
    """fraction of optimizer steps used for linear warm-up"""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay"""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """gradient clipping norm"""
    local_micro_batch_size: Annotated[int, Ge(2)] = 64
    """verification examples per forward on each rank (plus as many correct solutions for the SFT term)"""
    gradient_accumulation_steps: Annotated[int, Ge(1)] = 1
    """micro-batches per optimizer step"""
    num_rationales: Annotated[int, Ge(1)] = 8
    """K: rationales sampled per solution when a CoT verifier scores (mean of their p(Yes))"""
    rationale_temperature: Annotated[float, Gt(0)] = 0.7
    """sampling temperature of the rationales at score time"""
    max_rationale_tokens: Annotated[int, Ge(1)] = 64
    """length limit of a rationale (with the question it ends in); one that hits it scores 0"""
    eval_every: Annotated[int, Ge(0)] = 100
    """measure the verifier on the held-out samples every this many steps (0: only at the start and end)"""
    eval_num_prompts: Annotated[int, Ge(0)] = 100
    """held-out prompts (a fixed-seed sample of the eval split, the same for every run)"""
    dev_num_prompts: Annotated[int, Ge(0)] = 100
    """dev slice: train prompts never trained on (<= 10%) whose samples select output_dir/best (0: none)"""
    eval_num_samples: Annotated[int, Ge(1)] = 4
    """policy samples per held-out prompt: best-of-N is measured for N = 1, 2, 4, ... up to this"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    batch_size: tyro.conf.Suppress[int] = 0
    num_steps: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: verification data, loss and metrics
SHORT = {"question": "\nCorrect? ", "yes": "Y", "no": "N", "cot_prompt": "\nCheck:\n"}  # one character each (spec)
PAPER = {"question": "\nVerification: Is the answer correct (Yes/No)?", "yes": " Yes", "no": " No",
         "cot_prompt": "\nVerification: Let's verify step by step.\n"}  # GenRM's released data format


def verdict_strings(tokenizer, fmt: str) -> dict:
    """The question and verdict strings: `paper` ones when asked, or (`auto`) when ' Yes' and ' No' are one token each;
    else the one-character `short` ones (a character tokenizer spells ' Yes' in four tokens)."""
    one_token = all(len(text_ids(tokenizer, PAPER[k])) == 1 for k in ("yes", "no"))
    return PAPER if fmt == "paper" or (fmt == "auto" and one_token) else SHORT


def builtin_rationale(prompt: str, completion: str) -> str:
    """Reference-guided verification of a running-sums response, one line per step: 'given expected Y|N' (the
    expected running sum from the prompt's digits); a missing line is '- expected N', an extra one 'given - N'.
    "3+4+5+1=", "7\\n13\\n14" -> "7 7 Y\\n13 12 N\\n14 13 N"."""
    sums = list(itertools.accumulate(task.prompt_terms(prompt)))[1:]
    given = [line.strip() or "-" for line in completion.strip().split("\n")] if completion.strip() else []
    lines = []
    for g, e in itertools.zip_longest(given, sums):
        g, e = "-" if g is None else g, "-" if e is None else str(e)
        lines.append(f"{g} {e} {'Y' if g == e else 'N'}")
    return "\n".join(lines)


def rationale_agrees(rationale: str, label: int) -> bool:
    """A rationale is kept only if its conclusion (every line Y) equals the grader's label (spec: one that
    contradicts the grader would teach the wrong verdict; a truncated response is such a case)."""
    return all(line.endswith(" Y") for line in rationale.split("\n")) == bool(label)


def verify_example(prompt_ids: list[int], response_ids: list[int], label: int, fmt: dict, tokenizer,
                   rationale: str | None = None) -> tuple[list[int], list[int]]:
    """(context, target) of one verification example: direct, x y I -> verdict; CoT, x y C -> rationale I verdict."""
    verdict = text_ids(tokenizer, fmt["yes"] if label else fmt["no"])
    if rationale is None:
        return prompt_ids + response_ids + text_ids(tokenizer, fmt["question"]), verdict
    return (prompt_ids + response_ids + text_ids(tokenizer, fmt["cot_prompt"]),
            text_ids(tokenizer, rationale + fmt["question"]) + verdict)


def genrm_loss(logp_verify: torch.Tensor, mask_verify: torch.Tensor, logp_sft: torch.Tensor, mask_sft: torch.Tensor,
               sft_coef: float, num_verify_tokens: float, num_sft_tokens: float):
    """This micro-batch's share of L = NLL_verify + sft_coef * NLL_sft, each a token mean over the optimizer step's
    target tokens (num_*_tokens: that step's counts, scaled to one rank as in sft.py's token_mean). Returns the loss
    and the two terms. sft_coef 0 leaves the SFT term out of the graph (no gradient from it at all)."""
    loss_verify = -(logp_verify * mask_verify).sum() / max(num_verify_tokens, 1.0)
    loss_sft = -(logp_sft * mask_sft).sum() / max(num_sft_tokens, 1.0)
    loss = loss_verify + sft_coef * loss_sft if sft_coef > 0 else loss_verify
    return loss, loss_verify.detach(), loss_sft.detach()


def bce_loss(logp_yes: torch.Tensor, logp_no: torch.Tensor, labels: torch.Tensor,
             num_examples: float) -> torch.Tensor:
    """This micro-batch's share of the discriminative verifier's loss, mean over the optimizer step's num_examples:
    binary cross-entropy of the label on the scalar logit z = log p(Yes) - log p(No) (a linear head on the last
    hidden state whose weight is the difference of the two verdicts' output rows), sigmoid(z) = p(Yes) / (p(Yes) +
    p(No)). logp_*: [B] summed log-probabilities of each verdict; labels [B] in {0, 1}."""
    z = logp_yes - logp_no
    loss = torch.nn.functional.binary_cross_entropy_with_logits(z, labels.float(), reduction="sum")
    return loss / max(num_examples, 1.0)


def auroc(scores: list[float], labels: list[int]) -> float:
    """Area under the ROC curve: the probability that a random correct solution scores above a random incorrect one
    (ties count one half); NaN when one class is absent."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def read_labelled(path: str) -> list[dict]:
    """Rows of a --data_path file: prompt (str), completion (str), label (0 or 1), optional rationale (str) and
    finished (bool, default true; false: the completion was cut off at a length limit and gets no EOS, as a sampled
    one); a bad row, or a missing file, is a one-line error naming it."""
    rows = []
    if not os.path.isfile(path):
        raise data_utils.DataError(f"data_path: {path} does not exist")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise data_utils.DataError(f"data_path: {path} row {n} is not valid UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise data_utils.DataError(f"data_path: {path} row {n} is not JSON ({e.msg})") from None
            for key in ("prompt", "completion"):
                if not isinstance(row.get(key) if isinstance(row, dict) else None, str):
                    raise data_utils.DataError(f"data_path: {path} row {n}: field {key!r} must be a string")
            if row.get("label") not in (0, 1, True, False):
                raise data_utils.DataError(f"data_path: {path} row {n}: field 'label' must be 0 or 1, got "
                                           f"{row.get('label')!r}")
            if not isinstance(row.get("rationale", ""), str):
                raise data_utils.DataError(f"data_path: {path} row {n}: field 'rationale' must be a string")
            if not isinstance(row.get("finished", True), bool):
                raise data_utils.DataError(f"data_path: {path} row {n}: field 'finished' must be true or false")
            data_utils.check_unicode(row, f"data_path: {path} row {n}")
            rows.append({**row, "label": int(row["label"])})
    if not rows or len({r["label"] for r in rows}) < 2:
        raise data_utils.DataError(f"data_path: {path} needs rows of both labels (0 and 1)")
    return rows


def main(args: Args) -> str:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    info = init_distributed()
    args.world_size = info.world_size
    args.local_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    args.batch_size = args.local_batch_size * info.world_size
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")

    # TRY NOT TO MODIFY: seeding (same seed on every rank for data order, then a per-rank seed)
    seed_everything(args.seed)
    local_seed = args.seed + info.rank * 100003

    # data: validated before anything is written (a bad row, model path or grader stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    policy_path = resolve_model_path(args.policy_name_or_path or args.model_name_or_path, "policy_name_or_path")
    tokenizer = load_tokenizer(model_path)
    fmt = verdict_strings(tokenizer, args.verdict_format)
    verdict_ids = (text_ids(tokenizer, fmt["no"]), text_ids(tokenizer, fmt["yes"]))  # indexed by the label
    builtin_cot = args.verifier == "cot" and task.is_builtin(args.dataset) and not args.data_path
    labelled = read_labelled(args.data_path) if args.data_path else None
    if args.loss_type == "bce" and args.verifier == "cot":
        raise ValueError("loss_type: bce (a discriminative verifier) scores the verdict right after the question; "
                         "use it with --verifier direct")
    if args.verifier == "cot" and not builtin_cot and not all(r.get("rationale") for r in labelled or [{}]):
        raise ValueError("verifier: cot needs rationales: the built-in task writes them, a --data_path file gives "
                         "each row a 'rationale'")
    load = lambda split, limit=None, part="train": data_utils.load_prompts(  # noqa: E731
        args.dataset, split, tokenizer, args.prompt_key, args.answer_key, args.prompt_template, args.chat_template,
        args.max_prompt_length, limit=limit, num_dev=args.dev_num_prompts if split == args.train_split else 0,
        part=part)
    train_data = load(args.train_split, args.local_num_prompts * info.world_size)
    eval_data, dev_data = load(args.eval_split, args.eval_num_prompts), load(args.train_split, part="dev")
    reward_fn = load_reward_fn(args.reward_fn, args.dataset)
    check_labels(probe_reward_fn(reward_fn, train_data.rows), reward_fn)  # the verifier's labels must be 0 or 1
    answer_fn = load_answer_fn(args.reward_fn, args.dataset)

    # TRY NOT TO MODIFY: tracking and checkpoints (a resumed run continues its files; shared/checkpoint.py)
    ckpt = Checkpointer(args, info)
    run_name = info.broadcast_object(f"{args.exp_name}__{args.seed}__{int(time.time())}")
    tracker = Tracker(args, args.output_dir, run_name, info.is_main, args.num_steps, args.report_to,
                      args.project, resume=ckpt.tracker_state)

    # the policy's samples, graded: every rank samples its shard of the prompts, then all hold all of them
    dtype = default_dtype(info.device)
    decode = completion_decoder(tokenizer, args.stop)

    def sample_and_grade(generator, data, n: int, seed: int) -> list[dict]:
        """n graded samples of every prompt of `data`: {prompt (index), ids, text, label}, prompt-major."""
        mine = shard(prompt_chunks(len(data.rows)), info.rank, info.world_size)
        outs = generate_chunks(generator, data.prompt_ids, mine, n, args.temperature, 1.0, args.max_new_tokens, seed,
                               num_calls=math.ceil(len(prompt_chunks(len(data.rows))) / info.world_size))
        idx = [i for c in mine for i in c for _ in range(n)]
        comps = [c for group in outs for c in group]
        texts = [decode(c.token_ids) for c in comps]
        rows = [data.rows[i] for i in idx]
        grades = check_labels(compute_rewards(reward_fn, [x["prompt"] for x in rows], texts,
                                              [x["answer"] for x in rows], [c.finished for c in comps], rows), reward_fn)
        local = [{"prompt": i, "ids": c.token_ids, "text": t, "label": int(g), "finished": c.finished}
                 for i, c, t, g in zip(idx, comps, texts, grades)]
        return sorted(sum(info.gather_objects(local), []), key=lambda s: s["prompt"])  # stable: sampling order kept

    with torch.no_grad():
        policy = load_causal_lm(policy_path, dtype).to(info.device)
        generator = make_generator(args.generator, model_path=policy_path, model=policy, tokenizer=tokenizer,
                                   dtype=dtype, seed=local_seed, max_model_len=args.max_prompt_length + args.max_new_tokens,
                                   world_size=info.world_size, zero_stage=0,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization, stop=args.stop)
        train_samples = sample_and_grade(generator, train_data, args.num_generations, args.seed * 7_919) \
            if labelled is None else []
        held_out = {prefix: sample_and_grade(generator, data, args.eval_num_samples, eval_seed(args.seed))
                    for prefix, data in (("eval", eval_data), ("dev", dev_data)) if data.rows}
        generator.sleep(level=2)
        del generator, policy

    # verification examples (context, target, label) and SFT examples (prompt, correct solution)
    examples, sft_examples, dropped, too_long = [], [], 0, 0
    if labelled is None:
        for s in train_samples:
            prompt = train_data.rows[s["prompt"]]["prompt"]
            rationale = builtin_rationale(prompt, s["text"]) if builtin_cot else None
            if rationale is not None and not rationale_agrees(rationale, s["label"]):
                dropped += 1
                continue
            examples.append((*verify_example(train_data.prompt_ids[s["prompt"]], s["ids"], s["label"], fmt, tokenizer,
                                             rationale), s["label"]))
            if s["label"]:
                sft_examples.append((train_data.prompt_ids[s["prompt"]], s["ids"]))
    else:
        for r in labelled:
            p = data_utils.encode_prompt(tokenizer, data_utils.format_prompt(r["prompt"], args.prompt_template),
                                         args.chat_template)
            y = data_utils.encode_response(tokenizer, r["completion"], r.get("finished", True))
            if len(p) > args.max_prompt_length or len(p) + len(y) > args.max_seq_length:
                too_long += 1
                continue
            examples.append((*verify_example(p, y, r["label"], fmt, tokenizer,
                                             r.get("rationale") if args.verifier == "cot" else None), r["label"]))
            if r["label"]:
                sft_examples.append((p, y))
    if ckpt.start_step == 0 and labelled is None:
        tracker.log_samples([{"prompt": train_data.rows[s["prompt"]]["prompt"], "completion": s["text"],
                              "answer": train_data.rows[s["prompt"]]["answer"], "finished": s["finished"],
                              "label": s["label"]} for s in train_samples[:16]], 0)
    yes = [i for i, e in enumerate(examples) if e[2]]
    no = [i for i, e in enumerate(examples) if not e[2]]
    if not yes or not no:
        raise ValueError(f"the training data has {len(yes)} correct and {len(no)} incorrect solutions ({too_long} "
                         "--data_path rows over max_prompt_length / max_seq_length dropped); GenRM needs both (more "
                         "prompts or samples, or another policy)")
    samplers = {"sampler": data_utils.PromptSampler(len(examples), args.seed),  # --no_balance
                "yes_sampler": data_utils.PromptSampler(len(yes), args.seed + 1),
                "no_sampler": data_utils.PromptSampler(len(no), args.seed + 2),
                "sft_sampler": data_utils.PromptSampler(len(sft_examples), args.seed + 3)}
    tracker.write(f"{len(examples)} verification examples ({len(yes)} Yes, {len(no)} No; {dropped} rationales "
                  f"contradicting the grader, {too_long} rows over max_prompt_length / max_seq_length dropped), {len(sft_examples)} SFT examples; held-out "
                  f"{len(eval_data.rows)} x {args.eval_num_samples} samples; verdicts {fmt['yes']!r}/{fmt['no']!r}; "
                  f"{args.num_steps} steps of {args.batch_size}")

    # models and optimizer
    model = load_causal_lm(model_path, dtype, args.gradient_checkpointing).to(info.device)
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
    # what scoring needs, saved in config.json (shared/verifier.py reads it back)
    verifier_config = {"genrm_mode": args.verifier, "genrm_question": fmt["question"], "genrm_yes": fmt["yes"],
                       "genrm_no": fmt["no"], "genrm_cot_prompt": fmt["cot_prompt"],
                       "genrm_num_rationales": args.num_rationales if args.verifier == "cot" else 1,
                       "genrm_temperature": args.rationale_temperature,
                       "genrm_max_rationale_tokens": args.max_rationale_tokens, "genrm_seed": args.seed,
                       "genrm_loss_type": args.loss_type}
    verifier = GenerativeVerifier(model, tokenizer, SimpleNamespace(**verifier_config), info.zero_stage)
    best = BestModel(args.best_metric, args.output_dir, info, tokenizer, tracker, "dev" in held_out)

    def run_eval(step: int) -> dict:
        """The verifier on the policy's held-out samples: p(Yes) by label, AUROC, best-of-N against its baselines."""
        metrics = {}
        model.eval()
        for prefix, samples in held_out.items():
            data = eval_data if prefix == "eval" else dev_data
            mine = shard(samples, info.rank, info.world_size)
            out = verifier.score([data.prompt_ids[s["prompt"]] for s in mine], [s["ids"] for s in mine],
                                 tokenizer.pad_token_id, info, args.local_micro_batch_size, with_no=True,
                                 seed=args.seed + 17)
            scores = sum(info.gather_objects(list(zip(out["p_yes"].tolist(), out["p_no"].tolist(),
                                                      out["no_verdict"].tolist()))), [])
            order = sum(info.gather_objects(mine), [])  # the same order as `scores`
            labels = [s["label"] for s in order]
            p_yes = [x[0] if args.loss_type == "nll" else x[0] / max(x[0] + x[1], 1e-30) for x in scores]  # the score
            mean = lambda v: sum(v) / max(len(v), 1)  # noqa: E731
            metrics |= {f"{prefix}/auroc": auroc(p_yes, labels),
                        f"{prefix}/p_yes_correct": mean([p for p, y in zip(p_yes, labels) if y]),
                        f"{prefix}/p_yes_incorrect": mean([p for p, y in zip(p_yes, labels) if not y]),
                        f"{prefix}/p_no": mean([x[1] for x in scores]),
                        f"{prefix}/p_verdict": mean([x[0] + x[1] for x in scores]),
                        f"{prefix}/no_verdict_frac": mean([x[2] for x in scores]),
                        f"{prefix}/policy_accuracy": mean(labels)}
            n = args.eval_num_samples
            by_prompt = {}
            for s, p in zip(order, p_yes):
                by_prompt.setdefault(s["prompt"], []).append((p, s["label"], s["text"]))
            for k in [2**j for j in range(int(math.log2(n)) + 1)]:
                groups = [by_prompt[i] for i in sorted(by_prompt)]
                metrics[f"{prefix}/bon/acc@{k}"] = mean([best_of_n([g[0] for g in grp], [g[1] for g in grp], k)
                                                         for grp in groups])
                metrics[f"{prefix}/bon/pass@{k}"] = mean([pass_at_k(n, sum(g[1] for g in grp), k) for grp in groups])
                if answer_fn is not None:  # the grader's answers, finished or not (a truncated one is rarely a vote)
                    metrics[f"{prefix}/bon/maj@{k}"] = mean([maj_at_k(
                        [answer_fn(data.rows[i]["prompt"], g[2]) for g in by_prompt[i]],
                        [bool(g[1]) for g in by_prompt[i]], k) for i in sorted(by_prompt)])
        model.train()
        metrics |= best.update(metrics, step, model, verifier_config)  # keeps the best verifier (on dev) in best/
        tracker.log(metrics, step)
        return metrics

    # TRY NOT TO MODIFY: resume: weights, optimizer, LR scheduler, data position, RNG
    engines = {"model": model}
    start_step, _ = ckpt.restore(engines, guard=guard, best=best, **samplers)
    timer = Timer()
    if start_step == 0:
        first = run_eval(0)
        tracker.log({"data/verify_examples": len(examples), "data/yes": len(yes), "data/no": len(no),
                     "data/sft_examples": len(sft_examples), "data/rationales_dropped": dropped,
                     "genrm/verdict_tokens": len(text_ids(tokenizer, fmt["yes"]))}, 0)
        tracker.write(f"[step 0] held-out auroc {first['eval/auroc']:.3f}, best-of-{args.eval_num_samples} "
                      f"{first[f'eval/bon/acc@{2 ** int(math.log2(args.eval_num_samples))}']:.3f}")

    # training loop
    model.train()
    for step in range(start_step + 1, args.num_steps + 1):
        with timer("train"):
            # 1. a verification batch (half Yes, half No with --balance) and an SFT batch of correct solutions
            B, half = args.batch_size, args.batch_size // 2
            if args.balance:
                picked = ([yes[i] for i in samplers["yes_sampler"].next_indices(half)]
                          + [no[i] for i in samplers["no_sampler"].next_indices(B - half)])
                picked = [picked[j] for j in torch.randperm(B, generator=torch.Generator().manual_seed(step)).tolist()]
            else:
                picked = samplers["sampler"].next_indices(B)
            sft_picked = samplers["sft_sampler"].next_indices(B) if args.sft_coef > 0 else []
            lo, hi = info.rank * args.local_batch_size, (info.rank + 1) * args.local_batch_size
            batch = [examples[i] for i in picked[lo:hi]]
            sft_batch = [sft_examples[i] for i in sft_picked[lo:hi]]
            counts = info.all_reduce(torch.tensor([float(sum(len(t) for _, t, _ in batch)),
                                                   float(sum(len(r) for _, r in sft_batch))])) / info.world_size
            stats = torch.zeros(3, dtype=torch.float64)
            for m in range(args.gradient_accumulation_steps):
                sl = slice(m * args.local_micro_batch_size, (m + 1) * args.local_micro_batch_size)
                micro, sft_micro = batch[sl], sft_batch[sl]
                # 2. one forward over both sub-batches: position t predicts token t+1, targets only (bce: every
                # verification context twice, with the Yes and with the No verdict as its target)
                verify = [(c, t) for c, t, _ in micro] if args.loss_type == "nll" else \
                    [(c, verdict_ids[1]) for c, _, _ in micro] + [(c, verdict_ids[0]) for c, _, _ in micro]
                contexts = [c for c, _ in verify] + [p for p, _ in sft_micro]
                targets = [t for _, t in verify] + [r for _, r in sft_micro]
                input_ids, attn, resp = data_utils.pad_batch(contexts, targets, tokenizer.pad_token_id, info.device)
                logp, _ = forward_logprobs(model, input_ids, attn, resp, 1.0)
                mask = resp[:, 1:].float()
                v = len(verify)
                if args.loss_type == "nll":
                    loss, loss_v, loss_s = genrm_loss(logp[:v], mask[:v], logp[v:], mask[v:], args.sft_coef,
                                                      counts[0].item(), counts[1].item())
                else:  # the verdict term is the classifier's BCE; the SFT term is genrm_loss's
                    seq = (logp[:v] * mask[:v]).sum(1)  # log p(verdict) of each (context, verdict)
                    loss_v = bce_loss(seq[: v // 2], seq[v // 2 :], torch.tensor([y for _, _, y in micro]),
                                      args.local_batch_size)
                    loss_sft = -(logp[v:] * mask[v:]).sum() / max(counts[1].item(), 1.0)
                    loss = loss_v + args.sft_coef * loss_sft if args.sft_coef > 0 else loss_v
                    loss_v, loss_s = loss_v.detach(), loss_sft.detach()
                guard.backward(model, loss)
                grad_norm = guard.step(model)  # a non-finite loss or gradient skips the step (counted)
                stats += torch.tensor([loss.item(), loss_v.item(), loss_s.item()], dtype=torch.float64)
        if step % 10 == 0 or step == args.num_steps:
            info.all_reduce(stats)
            stats /= info.world_size
            tracker.log({"loss/total": stats[0].item(), "genrm/loss_verify": stats[1].item(),
                         "genrm/loss_sft": stats[2].item(), "lr": scheduler.get_last_lr()[0],
                         "episode": step * args.batch_size, "optim/grad_norm": grad_norm,
                         "optim/nonfinite_skipped": guard.skipped, **timer.pop()}, step)
        tracker.progress(1, loss=stats[0].item())
        if args.eval_every and step % args.eval_every == 0 and step != args.num_steps:
            with timer("eval"):
                run_eval(step)

        # TRY NOT TO MODIFY: checkpoint every save_every steps, at stop_after_steps, and on SIGTERM/SIGINT
        if ckpt.step_end(step):
            ckpt.save(step, engines, tracker, guard=guard, best=best, **samplers)
            if ckpt.stopping:
                break
    if ckpt.stopping:
        return ckpt.stop(tracker)
    last = run_eval(args.num_steps)
    tracker.write(f"held-out auroc {last['eval/auroc']:.3f}, p(Yes) correct {last['eval/p_yes_correct']:.3f} / "
                  f"incorrect {last['eval/p_yes_incorrect']:.3f}")
    final = save_hf(model, tokenizer, os.path.join(args.output_dir, "final"), info, verifier_config)
    ckpt.finish()
    tracker.close()
    return str(final)


if __name__ == "__main__":
    run_cli(main, Args)
