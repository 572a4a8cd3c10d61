"""Evaluate a checkpoint: greedy accuracy, sampled accuracy, pass@k, maj@k, with bootstrap CIs. Docs: docs/evaluate.md

Not a training algorithm: the held-out evaluation of the training scripts, run on its own. The same prompts,
templates, stop rules, graders, chunks and seeds (shared/evaluation.py), so for the checkpoint a grpo, ppo, vineppo
or drca run saved and that run's settings, `eval/accuracy` and `eval/pass@<n>` equal its last held-out numbers.
  accuracy  mean grade of the n = --num_samples samples of every prompt (the training scripts' eval/accuracy)
  pass@k    Chen et al. 2021 (https://arxiv.org/abs/2107.03374), Eq. 1: 1 - C(n-c, k) / C(n, k), c = correct samples
  maj@k     majority vote over the extracted answers of k samples, averaged over the n // k disjoint blocks of k;
            ties count the fraction of the tied answers that are correct
  bon       best-of-k with each of --verifiers (a GenRM, an implicit PRM or a scalar reward model): in each of the
            n // k disjoint blocks the top-scored sample, ties to the first; wvote: the weighted vote (an answer's
            weight is the sum of its samples' p(Yes), or of sigmoid(score) for the other verifiers)
  CI        percentile bootstrap over prompts (--num_bootstrap resamples, seed --seed)
Every completion goes to output_dir/completions.jsonl with its extracted answer and grade, the metrics to
summary.json. Interrupted (a kill, --stop_after_prompts), the same command continues: finished prompts are read
back, never generated again, and the result equals an uninterrupted run's.

Launch:
    python algorithms/evaluate.py                                                # builtin:tiny-sft, built-in task
    python algorithms/evaluate.py --model_name_or_path runs/grpo/final --output_dir runs/grpo/eval --k 1 4
    python algorithms/evaluate.py --model_name_or_path runs/grpo/final --generator hf    # HF generate, no vLLM
    python algorithms/evaluate.py --num_samples 16 --k 1 4 16 --verifiers genrm=runs/genrm/final rm=runs/rm/final
    accelerate launch --config_file scripts/accelerate/zero0.yaml --num_processes 8 algorithms/evaluate.py \
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --chat_template --dataset openai/gsm8k:main \
        --prompt_key question --answer_key answer --reward_fn gsm8k --max_new_tokens 512 --num_samples 16 --k 1 4 16 \
        --prompt_template $'{prompt}\\nSolve it step by step, then give the final answer on the last line as "#### <number>".'
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro
from annotated_types import Ge, Gt, Interval

from shared import data as data_utils
from shared.cli import run_cli
from shared.distributed import default_dtype, init_distributed, load_causal_lm, load_tokenizer, seed_everything
from shared.evaluation import (EVAL_CHUNK, best_of_n, bootstrap_ci, eval_seed, generate_chunks, maj_at_k, pass_at_k,
                               prompt_chunks, weighted_vote_at_k)
from shared.generation import completion_decoder, make_generator
from shared.models import resolve_model_path
from shared.rewards import compute_rewards, load_answer_fn, load_reward_fn, probe_reward_fn
from shared.tracking import duration


@dataclass
class Args:
    # common args
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1  # numpy takes seeds < 2**32; each rank adds rank * 100003
    """seed of the run to reproduce (samples: seed + 1000003, as in the scripts' held-out evaluation); also seeds the bootstrap"""
    output_dir: str = "runs/evaluate"
    """where completions.jsonl (completions, answers, grades), summary.json and args.json go; the same command there resumes"""
    model_name_or_path: str = "builtin:tiny-sft"
    """the model: a checkpoint the scripts save (runs/grpo/final or best), a local HF checkpoint, a hub name, or `builtin:*`"""
    dataset: str = "builtin"
    """`builtin`, a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    eval_split: str = "test"
    """split to evaluate (as in the training scripts)"""
    eval_num_prompts: Annotated[int, Ge(1)] = 500
    """prompts evaluated: a fixed-seed sample of the split, the same rows as a training run's (all rows if it has fewer)"""
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
    """grader: `auto` (by dataset), `builtin`, `gsm8k`, `math`, `math_verify` (with maj@k), or `module:function` (no maj@k)"""
    stop: tuple[str, ...] = ()
    """stop strings: a completion ends at the token completing one; graders see the text before it (EOS always stops)"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend: `vllm` (in-process engine) or `hf` (model.generate)"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""

    # evaluation args
    num_samples: Annotated[int, Ge(1)] = 4
    """n: sampled completions per prompt (a training run's --eval_num_samples); pass@k and maj@k need k <= n"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature of the n samples (a training run's --eval_temperature)"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling of the n samples (the training scripts evaluate with 1.0)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; a completion that hits it is truncated and graded 0 by the built-in graders"""
    greedy: bool = True
    """also generate one greedy completion per prompt (eval/greedy_accuracy)"""
    k: tuple[int, ...] = (1, 4)
    """the k of pass@k and maj@k, each at most num_samples"""
    num_bootstrap: Annotated[int, Ge(0)] = 1000
    """bootstrap resamples of the prompts for the confidence intervals (0: no intervals)"""
    confidence: Annotated[float, Interval(gt=0, lt=1)] = 0.95
    """confidence level of the bootstrap intervals"""
    chunk_size: Annotated[int, Ge(1)] = EVAL_CHUNK
    """prompts per generate call, saved after each; the seeding unit: completions depend on it (64, as the training scripts)"""
    stop_after_prompts: Annotated[int, Ge(0)] = 0
    """stop after about this many prompts of this invocation, at the end of a call (0: run to the end); rerun to continue"""
    verifiers: tuple[str, ...] = ()
    """best-of-k selectors, `name=path` each: a GenRM or implicit-PRM checkpoint, or a scalar reward model (rm.py)"""
    verifier_micro_batch_size: Annotated[int, Ge(1)] = 64
    """samples per verifier forward"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0
    model_files: tyro.conf.Suppress[str] = ""


# flags that change the completions: a resumed evaluation must keep them (the others only change the summary)
RESULT_FLAGS = ("model_name_or_path", "model_files", "dataset", "eval_split", "eval_num_prompts", "prompt_key", "answer_key",
                "prompt_template", "chat_template", "max_prompt_length", "reward_fn", "stop", "generator",
                "num_samples", "temperature", "top_p", "max_new_tokens", "greedy", "seed", "chunk_size", "verifiers")


# ALGO LOGIC: the metrics, from the per-prompt records
def summarize(records: list[dict], ks: list[int], votes: bool, num_bootstrap: int, confidence: float,
              seed: int) -> dict:
    """Point estimates and bootstrap intervals from the records of every prompt, in prompt order.

    Per prompt: greedy accuracy, accuracy = mean grade of its n samples, pass@k (Chen et al.) with c = samples graded
    > 0.5, and maj@k on the samples' extracted answers (`votes`: the grader extracts answers; only finished
    completions vote). Each metric is the mean over prompts; eval/accuracy is summed as the training scripts do
    (shared/evaluation.py), so the two agree exactly."""
    grades = torch.tensor([[s["grade"] for s in r["samples"]] for r in records], dtype=torch.float64)  # [P, n]
    n = grades.shape[1]
    correct = (grades > 0.5).tolist()
    per_prompt = {}
    if "greedy" in records[0]:
        per_prompt["eval/greedy_accuracy"] = np.array([r["greedy"]["grade"] for r in records], dtype=np.float64)
    per_prompt["eval/accuracy"] = grades.mean(1).numpy()
    for k in ks:
        per_prompt[f"eval/pass@{k}"] = np.array([pass_at_k(n, sum(c), k) for c in correct])
    if votes:  # a truncated completion does not vote (the graders give it 0 whatever its answer)
        answers = [[s["answer"] if s["finish_reason"] == "stop" else None for s in r["samples"]] for r in records]
        for k in ks:
            per_prompt[f"eval/maj@{k}"] = np.array([maj_at_k(a, c, k) for a, c in zip(answers, correct)])
    for name in records[0]["samples"][0].get("scores", {}):  # best-of-k and weighted vote of every verifier
        scores = [[s["scores"][name] for s in r["samples"]] for r in records]
        weights = [[s["weights"][name] for s in r["samples"]] for r in records]
        for k in ks:
            per_prompt[f"eval/bon/{name}@{k}"] = np.array([best_of_n(v, c, k) for v, c in zip(scores, correct)])
            if votes:
                per_prompt[f"eval/wvote/{name}@{k}"] = np.array([weighted_vote_at_k(a, w, c, k) for a, w, c
                                                                 in zip(answers, weights, correct)])
    metrics = {name: float(v.mean()) for name, v in per_prompt.items()}
    metrics["eval/accuracy"] = (grades.sum() / grades.numel()).item()
    ci = bootstrap_ci(per_prompt, num_bootstrap, confidence, seed) if num_bootstrap else {}
    return {"metrics": metrics, "ci": ci}


def validate(args: Args) -> None:
    """One-line errors naming the flag, before anything is written (check_args has checked the ranges)."""
    if not args.k:
        raise ValueError("k: give at least one k (e.g. --k 1 4)")
    names = [v.partition("=")[0] for v in args.verifiers]
    for v in args.verifiers:
        if not v.partition("=")[0] or not v.partition("=")[2]:
            raise ValueError(f"verifiers: expected name=path, got {v!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"verifiers: a name is given twice ({', '.join(names)})")
    for k in args.k:
        if not 1 <= k <= args.num_samples:
            raise ValueError(f"k: {k} is not in [1, num_samples={args.num_samples}] (pass@k and maj@k need k <= n "
                             f"samples)")


def model_files(path: str) -> str:
    """What identifies the model's weights without reading them: each weight file's name, size and mtime (a hub
    name stands for itself). A resumed evaluation refuses a model whose files changed."""
    p = Path(path)
    if not p.is_dir():
        return path
    files = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".pt", ".json"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def read_records(out: Path, truncate: bool) -> dict[int, dict]:
    """Records of finished prompts in output_dir (completions.jsonl and the ranks' completions.rank<r>.jsonl), by
    prompt index. A torn last line (a kill mid-write) is ignored, and cut off when `truncate`."""
    records: dict[int, dict] = {}
    for path in [out / "completions.jsonl", *sorted(out.glob("completions.rank*.jsonl"))]:
        if not path.exists():
            continue
        good = 0
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    break
                if not line.endswith(b"\n"):
                    break
                records.setdefault(record["index"], record)
                good += len(line)
        if truncate and good < path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)
    return records


def check_resume(out: Path, args: Args) -> dict[int, dict]:
    """The finished prompts of an earlier invocation with the same RESULT_FLAGS; a one-line error when they differ.
    Writes nothing (run on rank 0 only)."""
    records = read_records(out, truncate=False)
    if not records:
        return {}
    if not (out / "args.json").exists():
        raise ValueError(f"output_dir: {out} holds completions but no args.json (their settings are unknown); "
                         f"use another --output_dir")
    before = json.loads((out / "args.json").read_text())
    now = json.loads(json.dumps(asdict(args), default=str))
    differ = [k for k in RESULT_FLAGS if before.get(k) != now[k]]
    changed = [f"--{k} {before.get(k)!r} (now {now[k]!r})" for k in differ if k != "model_files"]
    if "model_files" in differ and "model_name_or_path" not in differ:
        changed.insert(0, f"the weight files of {args.model_name_or_path} changed")
    if changed:
        raise ValueError(f"output_dir: {out} holds an evaluation with other settings: {', '.join(changed)}; rerun "
                         f"with its settings, or use another --output_dir")
    return records


def work_calls(num_prompts: int, done: set[int], chunk_size: int) -> list[range]:
    """The generate calls still to make: the fixed chunks of chunk_size prompts that hold an unfinished prompt. A chunk
    is the seeding unit (one random stream per call: shared/evaluation.py), so it is generated whole, and only its
    unfinished prompts are kept."""
    return [c for c in prompt_chunks(num_prompts, chunk_size) if any(i not in done for i in c)]


def main(args: Args) -> dict | None:
    # TRY NOT TO MODIFY: derived sizes; every check runs before anything is written
    start = time.time()
    validate(args)
    info = init_distributed()
    args.world_size = info.world_size
    ks = sorted(set(args.k))

    # TRY NOT TO MODIFY: seeding (a prompt's samples depend only on the seed and its chunk: shared/evaluation.py)
    seed_everything(args.seed)
    sampling_seed = eval_seed(args.seed)

    # data: validated before anything is written (a bad row, model path or grader stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    args.model_files = model_files(model_path)
    tokenizer = load_tokenizer(model_path)
    data = data_utils.load_prompts(args.dataset, args.eval_split, tokenizer, args.prompt_key, args.answer_key,
                                   args.prompt_template, args.chat_template, args.max_prompt_length,
                                   limit=args.eval_num_prompts)
    reward_fn = load_reward_fn(args.reward_fn, args.dataset)
    probe_reward_fn(reward_fn, data.rows)
    answer_fn = load_answer_fn(args.reward_fn, args.dataset)
    decode = completion_decoder(tokenizer, args.stop)
    num_prompts = len(data.rows)

    # resume: rank 0 reads what an earlier invocation finished (a one-line error if its settings differ)
    out = Path(args.output_dir)
    found = None
    if info.is_main:
        try:
            found = {"done": sorted(check_resume(out, args))}
        except ValueError as e:
            found = {"error": str(e)}
    found = info.broadcast_object(found)
    if "error" in found:
        raise ValueError(found["error"])
    done = set(found["done"])
    if info.is_main:  # from here on output_dir is written
        out.mkdir(parents=True, exist_ok=True)
        read_records(out, truncate=True)  # a torn last line of a killed invocation
        if not done:
            (out / "args.json").write_text(json.dumps(asdict(args), indent=2, default=str))
    info.barrier()
    calls = work_calls(num_prompts, done, args.chunk_size)
    num_rounds = math.ceil(len(calls) / info.world_size)
    mine = calls[info.rank :: info.world_size]  # round j: call j * world_size + rank on every rank
    if info.is_main:
        print(f"{num_prompts} prompts ({data.num_filtered} over max_prompt_length dropped), {args.num_samples} samples"
              f"{' + greedy' if args.greedy else ''} each; {num_prompts - len(done)} to generate"
              + (f" ({len(done)} done before)" if done else ""), flush=True)

    # generation engine (only when there is something to generate)
    generator = None
    if calls:
        dtype = default_dtype(info.device)
        model = load_causal_lm(model_path, dtype).to(info.device) if args.generator == "hf" else None
        generator = make_generator(args.generator, model_path=model_path, model=model, tokenizer=tokenizer,
                                   dtype=dtype, seed=sampling_seed,
                                   max_model_len=args.max_prompt_length + args.max_new_tokens,
                                   world_size=info.world_size, zero_stage=0,
                                   gpu_memory_utilization=args.vllm_gpu_memory_utilization, stop=args.stop)
    verifiers = {}
    for spec in args.verifiers if calls else ():  # frozen, each scores every sample of a call (shared/verifier.py)
        from shared.scalar import load_reward_model

        name, _, path = spec.partition("=")
        verifiers[name] = load_reward_model(resolve_model_path(path, "verifiers"), tokenizer, info,
                                            default_dtype(info.device))

    # the loop: generate -> grade -> append; every rank appends to its own file, rank 0 merges at the end
    bar = None
    if info.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_prompts, initial=len(done), desc="evaluate", dynamic_ncols=True,
                   bar_format="{desc}: prompt {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")
    generated, running = 0, torch.zeros(2, dtype=torch.float64)  # prompts generated here; grade sum, samples
    part = out / f"completions.rank{info.rank}.jsonl"
    for j in range(num_rounds):
        call = mine[j] if j < len(mine) else None
        lines, error = [], None
        if call is not None:
            try:
                lines = run_call(generator, data, call, done, args, sampling_seed, reward_fn, answer_fn, decode,
                                 verifiers, tokenizer.pad_token_id, info)
            except ValueError as e:  # the grader raised: every rank still joins the all_reduce below, then all raise
                error = e
        if lines:
            with open(part, "a") as f:  # one write per call: a kill leaves at most a torn last line
                f.write("".join(json.dumps(r) + "\n" for r in lines))
                f.flush()
                os.fsync(f.fileno())
        stats = torch.tensor([len(lines), sum(s["grade"] for r in lines for s in r["samples"]),
                              sum(len(r["samples"]) for r in lines), error is not None], dtype=torch.float64)
        info.all_reduce(stats)
        if error is not None:
            raise error
        if stats[3] > 0:
            raise ValueError("the reward function failed on another rank")
        generated += int(stats[0])
        running += stats[1:3]
        if bar is not None:
            bar.set_postfix_str(f"accuracy={(running[0] / running[1]).item():.3g}", refresh=False)
            bar.update(int(stats[0]))
        if args.stop_after_prompts and generated >= args.stop_after_prompts and j + 1 < num_rounds:
            if bar is not None:
                bar.close()
            print(f"stopped: {len(done) + generated} of {num_prompts} prompts done in {duration(time.time() - start)}; "
                  f"the same command continues", flush=True)
            return None
    if bar is not None:
        bar.close()
    info.barrier()

    # TRY NOT TO MODIFY: rank 0 merges the ranks' files in prompt order and writes the summary
    if not info.is_main:
        return None
    records = read_records(out, truncate=False)
    missing = [i for i in range(num_prompts) if i not in records]
    if missing:
        raise RuntimeError(f"prompts {missing[:5]} have no record after generation")
    ordered = [records[i] for i in range(num_prompts)]
    tmp = out / "completions.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    tmp.replace(out / "completions.jsonl")
    for path in out.glob("completions.rank*.jsonl"):
        path.unlink()
    summary = summarize(ordered, ks, answer_fn is not None, args.num_bootstrap, args.confidence, args.seed)
    summary = {**summary, "num_prompts": num_prompts, "num_samples": args.num_samples, "k": ks,
               "confidence": args.confidence, "num_bootstrap": args.num_bootstrap,
               "model_path": model_path, "args": json.loads(json.dumps(asdict(args), default=str))}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")
    shown = ", ".join(f"{name.split('/', 1)[1]} {value:.3f}" + (" [{:.3f}, {:.3f}]".format(*summary["ci"][name])
                                                                 if name in summary["ci"] else "")
                      for name, value in summary["metrics"].items())
    print(f"done: {num_prompts} prompts in {duration(time.time() - start)}"
          + (f" ({len(done)} from an earlier run)" if done else "") + f"; {shown}; wrote {out / 'completions.jsonl'}, "
          "summary.json", flush=True)
    return summary


def run_call(generator, data, call: range, done: set[int], args: Args, seed: int, reward_fn, answer_fn,
             decode, verifiers: dict | None = None, pad_id: int = 0, info=None) -> list[dict]:
    """Greedy and sampled completions of the prompts of one call, graded (and scored by each verifier): one record
    per prompt not yet done."""
    greedy = (generate_chunks(generator, data.prompt_ids, [call], 1, 0.0, 1.0, args.max_new_tokens, seed)
              if args.greedy else [[] for _ in call])
    sampled = generate_chunks(generator, data.prompt_ids, [call], args.num_samples, args.temperature, args.top_p,
                              args.max_new_tokens, seed)
    keep = [(i, g + s) for i, g, s in zip(call, greedy, sampled) if i not in done]
    rows = [data.rows[i] for i, comps in keep for _ in comps]
    comps = [c for _, group in keep for c in group]
    texts = [decode(c.token_ids) for c in comps]
    grades = compute_rewards(reward_fn, [x["prompt"] for x in rows], texts, [x["answer"] for x in rows],
                             [c.finished for c in comps], rows)
    scored = {}  # name -> (scores, vote weights) of the sampled completions, in order
    if verifiers:
        from shared.scalar import score_sequences
        from shared.verifier import GenerativeVerifier

        flat = [(data.prompt_ids[i], c.token_ids) for i, group in keep for c in group[1 if args.greedy else 0:]]
        for name, verifier in verifiers.items():
            v = score_sequences(verifier, [p for p, _ in flat], [r for _, r in flat], pad_id, info,
                                args.verifier_micro_batch_size).double().cpu()
            weights = v if isinstance(verifier, GenerativeVerifier) else torch.sigmoid(v)
            scored[name] = (v.tolist(), weights.tolist())
    records, pos, spos = [], 0, 0
    for i, group in keep:
        entries = []
        for j, c in enumerate(group):
            answer = answer_fn(rows[pos]["prompt"], texts[pos]) if answer_fn is not None else None
            entries.append({"completion": texts[pos], "answer": answer, "grade": grades[pos],
                            "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids)})
            if scored and (j > 0 or not args.greedy):
                entries[-1]["scores"] = {name: v[0][spos] for name, v in scored.items()}
                entries[-1]["weights"] = {name: v[1][spos] for name, v in scored.items()}
                spos += 1
            pos += 1
        record = {"index": i, "prompt": data.rows[i]["prompt"], "gold": data.rows[i]["answer"]}
        if args.greedy:
            record["greedy"] = entries[0]
        record["samples"] = entries[1:] if args.greedy else entries
        records.append(record)
    return records


if __name__ == "__main__":
    run_cli(main, Args)
