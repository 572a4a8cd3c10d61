"""Evaluate free text: BLEU, BERTScore, perplexity, reward-model scores and an LLM judge. Docs: docs/evaluate_text.md

Not a training algorithm: evaluate.py's sibling for tasks without a grader (preferences, a reward model, open
answers). One completion per prompt (greedy, or --num_samples samples with --no_greedy) on any prompt dataset, with
or without reference responses; or, with --predictions_path, the completions of a predictions file scored again
without generating. Every completion and each of its scores go to output_dir/predictions.jsonl, the means to
summary.json.
  bleu        sacrebleu's corpus BLEU (Papineni et al. 2002, https://aclanthology.org/P02-1040/) and sentence BLEU
  bertscore   bert_score's F1 (Zhang et al. 2020, https://arxiv.org/abs/1904.09675) with --bertscore_model
  perplexity  exp(mean NLL) of the completion (or reference) given the prompt, under --perplexity_model
  reward      mean normalised score (r - mean) / std of each --verifiers model (rm.py stores mean and std)
  judge       pointwise rubric scores 1-10 (factual accuracy, logical soundness, efficiency) and the pairwise win
              rate against --judge_baseline_path, asked in both orders (a tie where the two orders disagree), from
              any OpenAI-compatible endpoint (--judge_base_url; a local model through `vllm serve`)
  CI          percentile bootstrap over prompts (--num_bootstrap resamples, seed --seed)
A judge call that fails is retried with exponential backoff and counted (judge/failed), a reply that does not parse
is counted (judge/unparsed); neither is scored.

Launch:
    python algorithms/evaluate_text.py                               # builtin:tiny-sft, references, builtin:tiny-rm
    python algorithms/evaluate_text.py --model_name_or_path runs/dpo/final --output_dir runs/dpo/eval_text
    python algorithms/evaluate_text.py --predictions_path runs/dpo/eval_text/predictions.jsonl \
        --output_dir runs/dpo/eval_text_judged --judge_base_url http://127.0.0.1:8000/v1 \
        --judge_baseline_path runs/sft/eval_text/predictions.jsonl
    python algorithms/evaluate_text.py --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --chat_template \
        --dataset data/my_qa.jsonl --prompt_key question --response_key answer --max_new_tokens 512 \
        --max_prompt_length 512 --bertscore_model roberta-large --bertscore_num_layers 17 \
        --perplexity_model Qwen/Qwen2.5-1.5B-Instruct --verifiers rm=runs/rm/final
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
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
from shared.evaluation import EVAL_CHUNK, bootstrap_ci, eval_seed, generate_chunks, prompt_chunks
from shared.generation import completion_decoder, make_generator
from shared.models import resolve_model_path
from shared.tracking import duration


@dataclass
class Args:
    # common args
    seed: Annotated[int, Interval(ge=0, le=2**31 - 1)] = 1
    """seed of the samples (seed + 1000003, as in the scripts' held-out evaluation) and of the bootstrap"""
    output_dir: str = "runs/evaluate_text"
    """where predictions.jsonl (completions and their scores), summary.json and args.json go"""
    model_name_or_path: str = "builtin:tiny-sft"
    """the model: a checkpoint the scripts save (runs/dpo/final), a local HF checkpoint, a hub name, or `builtin:*`"""
    dataset: str = "builtin"
    """`builtin`, a local .jsonl/.json/.parquet file, or a hub dataset `org/name[:config]`"""
    eval_split: str = "test"
    """split to evaluate (as in the training scripts)"""
    eval_num_prompts: Annotated[int, Ge(1)] = 500
    """prompts evaluated: a fixed-seed sample of the split, the same rows as a training run's (all rows if it has fewer)"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt"""
    response_key: str = "response"
    """dataset column holding the reference response (BLEU, BERTScore); empty: no references"""
    prompt_template: str = "{prompt}"
    """template applied to the prompt; `{prompt}` is replaced"""
    chat_template: bool = False
    """wrap the prompt with the tokenizer's chat template (as a user turn)"""
    max_prompt_length: Annotated[int, Ge(1)] = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    stop: tuple[str, ...] = ()
    """stop strings: a completion ends at the token completing one; it is scored cut before it (EOS always stops)"""
    verbose: bool = False
    """show library INFO/WARNING logs (vLLM, transformers)"""
    generator: Literal["vllm", "hf"] = "vllm"
    """generation backend: `vllm` (in-process engine) or `hf` (model.generate)"""
    vllm_gpu_memory_utilization: Annotated[float, Interval(gt=0, le=1)] = 0.3
    """fraction of GPU memory vLLM may take (GPU only)"""

    # generation args
    predictions_path: str = ""
    """score this predictions file (a predictions.jsonl written here, or rows with prompt, completion) instead of generating"""
    greedy: bool = True
    """one greedy completion per prompt; --no_greedy: --num_samples samples at --temperature and --top_p"""
    num_samples: Annotated[int, Ge(1)] = 1
    """sampled completions per prompt (with --no_greedy)"""
    temperature: Annotated[float, Gt(0)] = 1.0
    """sampling temperature (with --no_greedy)"""
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    """nucleus sampling (with --no_greedy)"""
    max_new_tokens: Annotated[int, Ge(1)] = 16
    """completion length limit; a completion that hits it is scored as it stands (finished: false)"""
    chunk_size: Annotated[int, Ge(1)] = EVAL_CHUNK
    """prompts per generate call, the seeding unit (64, as the training scripts' evaluation)"""

    # reference, model and reward metrics
    bertscore_model: str = ""
    """BERTScore's encoder: a local model directory, a hub name or `builtin:*` (empty: no BERTScore)"""
    bertscore_num_layers: Annotated[int, Ge(0)] = 0
    """BERTScore reads this layer's embeddings (0: the model's last layer; roberta-large: 17, bert_score's choice)"""
    perplexity_model: str = ""
    """perplexity under this model (a checkpoint, hub name or `builtin:*`; empty: none)"""
    perplexity_of: Literal["completion", "reference"] = "completion"
    """whose text the perplexity is of, given the prompt: the completion, or the dataset's reference response"""
    metric_micro_batch_size: Annotated[int, Ge(1)] = 32
    """texts per forward of the BERTScore, perplexity and reward models"""
    verifiers: tuple[str, ...] = ("rm=builtin:tiny-rm",)
    """reward models, `name=path` each: rm.py's or any scalar RM (normalised score), a GenRM or implicit PRM"""
    num_bootstrap: Annotated[int, Ge(0)] = 1000
    """bootstrap resamples of the prompts for the confidence intervals (0: no intervals)"""
    confidence: Annotated[float, Interval(gt=0, lt=1)] = 0.95
    """confidence level of the bootstrap intervals"""

    # LLM judge args
    judge_base_url: str = ""
    """an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (`vllm serve`); empty: no judge"""
    judge_model: str = ""
    """the model the endpoint serves (empty: the first one it lists)"""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the endpoint's key (unset: the key `EMPTY`, which `vllm serve` accepts)"""
    judge_criteria: tuple[str, ...] = ("factual_accuracy", "logical_soundness", "efficiency")
    """pointwise rubric scores asked of the judge (the names in RUBRICS; none: no pointwise scores)"""
    judge_baseline_path: str = ""
    """a baseline's predictions file: each completion is compared with its baseline on the same prompt, in both orders"""
    judge_max_tokens: Annotated[int, Ge(1)] = 512
    """length limit of the judge's reply"""
    judge_temperature: Annotated[float, Ge(0)] = 0.0
    """the judge's sampling temperature (0: greedy)"""
    judge_max_retries: Annotated[int, Ge(0)] = 3
    """retries of a failed judge call, after 1, 2, 4, ... x --judge_backoff seconds; then it is counted as failed"""
    judge_backoff: Annotated[float, Ge(0)] = 1.0
    """seconds before the first retry (doubled for each next one)"""
    judge_timeout: Annotated[float, Gt(0)] = 120.0
    """seconds a judge call may take"""
    judge_workers: Annotated[int, Ge(1)] = 8
    """judge calls in flight at once"""
    judge_structured: bool = False
    """constrain each reply to a score or verdict with vLLM's structured outputs (a vLLM endpoint; for small judges)"""

    # to be filled at runtime
    world_size: tyro.conf.Suppress[int] = 0


# ALGO LOGIC: the judge's rubrics and the parsing of its replies
RUBRICS = {
    "factual_accuracy": "Factual accuracy: is every statement in the response true, and is its final answer correct?",
    "logical_soundness": "Logical soundness: does each step of the response follow from the question and the steps "
                         "before it, without contradictions or gaps?",
    "efficiency": "Efficiency: does the response reach its answer directly, without repetition, detours or "
                  "irrelevant text?",
}
POINTWISE = ("You are an impartial judge. Grade the response below on one criterion.\n{rubric}\n\n[Question]\n{prompt}"
             "\n\n{reference}[Response]\n{completion}\n\nGive a short justification, then end your reply with a line "
             "\"Score: N\", where N is an integer from 1 (worst) to 10 (best).")
PAIRWISE = ("You are an impartial judge. Which of the two responses below answers the question better (more accurate, "
            "sound and concise)? Their order says nothing about their quality.\n\n[Question]\n{prompt}\n\n{reference}"
            "[Response A]\n{a}\n\n[Response B]\n{b}\n\nGive a short justification, then end your reply with a line "
            "\"Verdict: A\", \"Verdict: B\" or \"Verdict: tie\".")
SCORE_RANGE = (1, 10)
VERDICTS = ("A", "B", "tie")
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(\d+(?:\.\d+)?)", re.I)
_VERDICT = re.compile(r"verdict\s*[:=]\s*\**\s*\[?\(?\s*(a|b|tie)\b", re.I)


def parse_score(reply: str | None, low: int = SCORE_RANGE[0], high: int = SCORE_RANGE[1]) -> float | None:
    """The judge's score: the number after the last `Score:` (or a reply that is only a number), None when there is
    none or it is outside [low, high]."""
    if reply is None:
        return None
    found = _SCORE.findall(reply)
    text = found[-1] if found else reply.strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if low <= value <= high and math.isfinite(value) else None


def parse_verdict(reply: str | None) -> str | None:
    """'A', 'B' or 'tie' after the last `Verdict:` (or a reply that is only one of them); None otherwise."""
    if reply is None:
        return None
    found = _VERDICT.findall(reply)
    text = (found[-1] if found else reply.strip().strip(".*\"'")).lower()
    return {"a": "A", "b": "B", "tie": "tie"}.get(text)


def combine_orders(first: str | None, second: str | None) -> float | None:
    """The model's score against the baseline from the two orders (AlpacaEval's position-bias control): `first` is
    the verdict with the model as A, `second` with the model as B. Both prefer the model: 1; both the baseline: 0;
    a tie in either or orders that disagree: 0.5. None when a verdict is missing (failed or unparsed)."""
    if first is None or second is None:
        return None
    a = {"A": 1.0, "B": 0.0, "tie": 0.5}[first]
    b = {"A": 0.0, "B": 1.0, "tie": 0.5}[second]
    return a if a == b else 0.5


class Judge:
    """An OpenAI-compatible chat endpoint; `ask` returns the reply, or None after `max_retries` retries with
    exponential backoff (the error kept in `errors`). Counts its calls, retries and failures (thread-safe)."""

    def __init__(self, args: Args):
        import threading

        import openai

        key = os.environ.get(args.judge_api_key_env) or "EMPTY"
        self.client = openai.OpenAI(base_url=args.judge_base_url, api_key=key, max_retries=0,
                                    timeout=args.judge_timeout)
        self.args, self.lock = args, threading.Lock()
        self.calls = self.retries = self.failed = 0
        self.errors: list[str] = []
        self.model = args.judge_model

    def check(self) -> None:
        """Start-up: the endpoint answers and serves the model (a one-line ValueError otherwise)."""
        models, error = None, None
        for attempt in range(self.args.judge_max_retries + 1):
            try:
                models = [m.id for m in self.client.models.list().data]
                break
            except Exception as e:  # noqa: BLE001 (connection refused, timeout, HTTP error)
                error = " ".join(str(e).split())
                time.sleep(self.args.judge_backoff * 2**attempt)
        if models is None:
            raise ValueError(f"judge_base_url: {self.args.judge_base_url} does not answer ({error}, "
                             f"{self.args.judge_max_retries + 1} tries); start the endpoint or fix the URL")
        if not models:
            raise ValueError(f"judge_base_url: {self.args.judge_base_url} serves no model")
        if not self.model:
            self.model = models[0]
        elif self.model not in models:
            raise ValueError(f"judge_model: {self.model!r} is not served by {self.args.judge_base_url} "
                             f"(it serves {', '.join(models)})")

    def ask(self, prompt: str, choices: tuple[str, ...] = ()) -> str | None:
        """The reply to one question; `choices` (with --judge_structured): the only replies vLLM may give."""
        import openai

        extra = {"structured_outputs": {"choice": list(choices)}} if self.args.judge_structured and choices else None
        for attempt in range(self.args.judge_max_retries + 1):
            with self.lock:
                self.calls += 1
                self.retries += attempt > 0
            try:
                reply = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.args.judge_max_tokens, temperature=self.args.judge_temperature, extra_body=extra)
                return reply.choices[0].message.content or ""
            except openai.APIStatusError as e:  # an HTTP error: retried if the server may recover (429, 5xx)
                error = f"HTTP {e.status_code}: {' '.join(str(e.message).split())[:300]}"
                if e.status_code != 429 and e.status_code < 500:
                    break
            except Exception as e:  # noqa: BLE001 (connection refused or reset, timeout)
                error = " ".join(str(e).split())[:300]
            if attempt < self.args.judge_max_retries:
                time.sleep(self.args.judge_backoff * 2**attempt)
        with self.lock:
            self.failed += 1
            self.errors.append(error)
        return None


def reference_block(reference: str | None) -> str:
    return f"[Reference answer]\n{reference}\n\n" if reference is not None else ""


def run_judge(judge: Judge, preds: list[dict], baseline: dict | None, criteria: tuple[str, ...], workers: int) -> dict:
    """Ask every pointwise and pairwise question (threads), store each reply and parsed value in its prediction's
    record (`judge`, and `scores` where it parsed), and return the counts."""
    jobs = []  # (prediction, key, prompt text)
    for p in preds:
        for c in criteria:
            jobs.append((p, c, POINTWISE.format(rubric=RUBRICS[c], prompt=p["prompt"],
                                                reference=reference_block(p.get("reference")),
                                                completion=p["completion"])))
        if baseline is not None:
            other = baseline[(p["index"], p["sample"])]["completion"]
            ref = reference_block(p.get("reference"))
            jobs.append((p, "pair/model_first", PAIRWISE.format(prompt=p["prompt"], reference=ref,
                                                                a=p["completion"], b=other)))
            jobs.append((p, "pair/baseline_first", PAIRWISE.format(prompt=p["prompt"], reference=ref,
                                                                   a=other, b=p["completion"])))
    from tqdm.auto import tqdm

    scores = tuple(str(v) for v in range(SCORE_RANGE[0], SCORE_RANGE[1] + 1))
    choices = [VERDICTS if key.startswith("pair/") else scores for _, key, _ in jobs]
    with ThreadPoolExecutor(workers) as pool:
        replies = list(tqdm(pool.map(judge.ask, [j[2] for j in jobs], choices), total=len(jobs), desc="judge",
                            dynamic_ncols=True))
    unparsed = 0
    for (p, key, _), reply in zip(jobs, replies):
        value = parse_verdict(reply) if key.startswith("pair/") else parse_score(reply)
        p.setdefault("judge", {})[key] = {"reply": reply, "parsed": value}
        unparsed += reply is not None and value is None
        if not key.startswith("pair/") and value is not None:
            p["scores"][f"judge/{key}"] = value
    for p in preds if baseline is not None else ():
        win = combine_orders(p["judge"]["pair/model_first"]["parsed"], p["judge"]["pair/baseline_first"]["parsed"])
        if win is not None:
            p["scores"]["judge/win_rate"] = win
    return {"judge/calls": judge.calls, "judge/retries": judge.retries, "judge/failed": judge.failed,
            "judge/unparsed": unparsed, "judge/questions": len(jobs)}


# ALGO LOGIC: the reference and model metrics
def bleu(completions: list[str], references: list[str]) -> tuple[float, list[float]]:
    """sacrebleu's corpus BLEU over all pairs and each pair's sentence BLEU (0-100, sacrebleu's default 13a
    tokenisation; sentence BLEU with its default exponential smoothing)."""
    import sacrebleu

    corpus = sacrebleu.corpus_bleu(completions, [references]).score
    return corpus, [sacrebleu.sentence_bleu(c, [r]).score for c, r in zip(completions, references)]


def bertscore_f1(completions: list[str], references: list[str], model_path: str, num_layers: int,
                 batch_size: int, device) -> list[float]:
    """bert_score's F1 of each completion against its reference, from the embeddings of layer `num_layers` (0: the
    last) of `model_path`, without idf weighting or baseline rescaling (bert_score.score's defaults). Through
    bert_score's own functions, with the tokenizer's length limit set to the model's context, so that any local
    model directory serves (bert_score.score reads an unset limit as 10^30 and fails)."""
    from collections import defaultdict

    from bert_score.utils import bert_cos_score_idf, get_model, get_tokenizer
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    layers = num_layers or config.num_hidden_layers
    tokenizer = get_tokenizer(model_path, False)
    context = getattr(config, "max_position_embeddings", None) or 512
    tokenizer.model_max_length = min(tokenizer.model_max_length, context)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = get_model(model_path, layers).to(device)
    idf = defaultdict(lambda: 1.0)
    idf[tokenizer.sep_token_id] = 0
    idf[tokenizer.cls_token_id] = 0
    scores = bert_cos_score_idf(model, references, completions, tokenizer, idf, verbose=False, device=device,
                                batch_size=batch_size).cpu()  # [N, 3]: precision, recall, F1
    return scores[:, 2].tolist()


def perplexities(model, contexts: list[list[int]], texts: list[list[int]], pad_id: int,
                 micro_batch_size: int) -> list[float | None]:
    """exp(mean negative log-likelihood of the text's tokens given the context's) for each pair; None for an empty
    text. HF `evaluate`'s perplexity is the same with the context one BOS token."""
    from shared.data import pad_batch

    device = next(model.parameters()).device
    out: list[float | None] = []
    with torch.no_grad():
        for b in range(0, len(texts), micro_batch_size):
            ctx, txt = contexts[b : b + micro_batch_size], texts[b : b + micro_batch_size]
            ids, attn, mask = pad_batch(ctx, [t or [pad_id] for t in txt], pad_id, device)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
            mask = mask[:, 1:].float()
            nll = -(logp * mask).sum(1) / mask.sum(1).clamp(min=1)
            out += [math.exp(v) if t else None for v, t in zip(nll.tolist(), txt)]
    return out


# ALGO LOGIC: the summary, from the per-prediction records
def summarize(preds: list[dict], corpus: dict, num_bootstrap: int, confidence: float, seed: int) -> dict:
    """Mean over predictions of each score (a score missing from a prediction, e.g. an unparsed judge reply, is left
    out of its mean; `<name>/count` says how many it has), corpus-level metrics as given, and bootstrap intervals
    over prompts of the per-prompt means (prompts that have the score)."""
    names = sorted({k for p in preds for k in p["scores"]})
    metrics, per_prompt = dict(corpus), {}
    for name in names:
        values = [p["scores"][name] for p in preds if name in p["scores"]]
        metrics[f"eval/{name}"] = float(np.mean(values))
        metrics[f"eval/{name}/count"] = len(values)
        by_prompt: dict[int, list[float]] = {}
        for p in preds:
            if name in p["scores"]:
                by_prompt.setdefault(p["index"], []).append(p["scores"][name])
        per_prompt[f"eval/{name}"] = np.array([np.mean(v) for v in by_prompt.values()])
    ci = {}
    if num_bootstrap:
        for name, values in per_prompt.items():  # each on its own prompts, so one resampling per metric
            ci.update(bootstrap_ci({name: values}, num_bootstrap, confidence, seed))
    return {"metrics": metrics, "ci": ci}


def validate(args: Args) -> None:
    """One-line errors naming the flag, before anything is written (check_args has checked the ranges)."""
    names = [v.partition("=")[0] for v in args.verifiers]
    for v in args.verifiers:
        if not v.partition("=")[0] or not v.partition("=")[2]:
            raise ValueError(f"verifiers: expected name=path, got {v!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"verifiers: a name is given twice ({', '.join(names)})")
    for c in args.judge_criteria:
        if c not in RUBRICS:
            raise ValueError(f"judge_criteria: {c!r} is not one of {', '.join(RUBRICS)}")
    if args.judge_baseline_path and not args.judge_base_url:
        raise ValueError("judge_baseline_path: a pairwise comparison needs a judge (--judge_base_url)")
    if args.perplexity_of == "reference" and args.perplexity_model and not args.response_key:
        raise ValueError("perplexity_of: `reference` needs references (--response_key)")


def read_predictions(path: str, flag: str, with_reference: bool) -> list[dict]:
    """Rows of a predictions file: `prompt`, `completion` (text), and `reference` when `with_reference`; `index` and
    `sample` (default: the row number and 0) and `finished` (default true) are kept. A one-line error naming the
    row otherwise, or for a file with no predictions."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{flag}: {path} does not exist")
    preds = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"{flag}: {path} line {i} is not JSON") from None
        for key in ("prompt", "completion") + (("reference",) if with_reference else ()):
            if not isinstance(row.get(key), str):
                hint = " (--response_key '': score without references)" if key == "reference" else ""
                raise ValueError(f"{flag}: {path} line {i} has no text {key!r}{hint}")
        pred = {"index": int(row.get("index", len(preds))), "sample": int(row.get("sample", 0)),
                "prompt": row["prompt"], "completion": row["completion"], "finished": bool(row.get("finished", True))}
        if with_reference:
            pred["reference"] = row["reference"]
        preds.append(pred)
    if not preds:
        raise ValueError(f"{flag}: {path} holds no predictions")
    keys = [(q["index"], q["sample"]) for q in preds]
    if len(set(keys)) < len(keys):
        raise ValueError(f"{flag}: {path} holds a prediction twice (the same index and sample)")
    return preds


def main(args: Args) -> dict:
    # TRY NOT TO MODIFY: every check runs before anything is written
    start = time.time()
    validate(args)
    info = init_distributed()
    args.world_size = info.world_size
    if info.world_size > 1:
        raise ValueError("evaluate_text.py runs on one process (launch it with python, not accelerate)")
    seed_everything(args.seed)
    sampling_seed = eval_seed(args.seed)

    # data: the predictions file, or the prompts to generate for (a bad row, model path or file stops here, one line)
    model_path = resolve_model_path(args.model_name_or_path)
    tokenizer = load_tokenizer(model_path)
    with_reference = bool(args.response_key)
    data = None
    if args.predictions_path:
        preds = read_predictions(args.predictions_path, "predictions_path", with_reference)
    else:
        data = data_utils.load_prompts(args.dataset, args.eval_split, tokenizer, args.prompt_key, "",
                                       args.prompt_template, args.chat_template, args.max_prompt_length,
                                       response_key=args.response_key or None, limit=args.eval_num_prompts)
        preds = []
    baseline = None
    if args.judge_baseline_path:
        rows = read_predictions(args.judge_baseline_path, "judge_baseline_path", False)
        baseline = {(r["index"], r["sample"]): r for r in rows}
    metric_paths = {flag: resolve_model_path(getattr(args, flag), flag)
                    for flag in ("bertscore_model", "perplexity_model") if getattr(args, flag)}
    verifier_paths = {v.partition("=")[0]: resolve_model_path(v.partition("=")[2], "verifiers")
                      for v in args.verifiers}
    from shared.scalar import check_same_tokenizer

    for path in verifier_paths.values():  # they score the policy's token ids
        check_same_tokenizer(path, tokenizer, "verifiers")
    if baseline is not None:  # every completion to judge has its baseline on the same prompt and sample
        wanted = ([(p["index"], p["sample"]) for p in preds] if data is None else
                  [(i, j) for i in range(len(data.rows)) for j in range(1 if args.greedy else args.num_samples)])
        missing = [k for k in wanted if k not in baseline]
        if missing:
            raise ValueError(f"judge_baseline_path: {args.judge_baseline_path} has no prediction for (index, sample) "
                             f"{missing[0]} ({len(missing)} missing); generate it on the same prompts and samples")
    judge = None
    if args.judge_base_url:
        judge = Judge(args)
        judge.check()  # the endpoint answers, before anything is generated or written

    # generation: one greedy completion per prompt, or num_samples samples
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "args.json").write_text(json.dumps(asdict(args), indent=2, default=str))
    dtype = default_dtype(info.device)
    if data is not None:
        n = 1 if args.greedy else args.num_samples
        print(f"{len(data.rows)} prompts ({data.num_filtered} over max_prompt_length dropped), "
              f"{'1 greedy completion' if args.greedy else f'{n} samples'} each", flush=True)
        model = load_causal_lm(model_path, dtype).to(info.device) if args.generator == "hf" else None
        generator = make_generator(args.generator, model_path=model_path, model=model, tokenizer=tokenizer,
                                   dtype=dtype, seed=sampling_seed,
                                   max_model_len=args.max_prompt_length + args.max_new_tokens, world_size=1,
                                   zero_stage=0, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                                   stop=args.stop)
        decode = completion_decoder(tokenizer, args.stop)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(data.rows), desc="generate", dynamic_ncols=True)
        for call in prompt_chunks(len(data.rows), args.chunk_size):
            groups = generate_chunks(generator, data.prompt_ids, [call], n, 0.0 if args.greedy else args.temperature,
                                     1.0 if args.greedy else args.top_p, args.max_new_tokens, sampling_seed)
            for i, group in zip(call, groups):
                for j, c in enumerate(group):
                    pred = {"index": i, "sample": j, "prompt": data.rows[i]["prompt"],
                            "completion": decode(c.token_ids), "finished": c.finished}
                    if with_reference:
                        pred["reference"] = data.rows[i]["response"]
                    preds.append(pred)
            bar.update(len(call))
        bar.close()
        del generator, model
        write_predictions(out, preds)  # before scoring: a failed judge leaves them to score again

    # scoring: every metric from the texts alone, so a predictions file scores as its generation did
    for p in preds:
        p["scores"] = {}
    corpus = {}
    if with_reference:
        corpus["eval/bleu"], sentence = bleu([p["completion"] for p in preds], [p["reference"] for p in preds])
        for p, v in zip(preds, sentence):
            p["scores"]["sentence_bleu"] = v
    if "bertscore_model" in metric_paths:
        if not with_reference:
            raise ValueError("bertscore_model: BERTScore needs references (--response_key)")
        f1 = bertscore_f1([p["completion"] for p in preds], [p["reference"] for p in preds],
                          metric_paths["bertscore_model"], args.bertscore_num_layers, args.metric_micro_batch_size,
                          info.device)
        for p, v in zip(preds, f1):
            p["scores"]["bertscore_f1"] = v
    prompt_ids = [data_utils.encode_prompt(tokenizer, data_utils.format_prompt(p["prompt"], args.prompt_template),
                                           args.chat_template) for p in preds]
    if "perplexity_model" in metric_paths:
        lm_path = metric_paths["perplexity_model"]
        lm_tokenizer = load_tokenizer(lm_path)
        lm = load_causal_lm(lm_path, dtype).to(info.device).eval()
        key = "completion" if args.perplexity_of == "completion" else "reference"
        contexts = [data_utils.encode_prompt(lm_tokenizer, data_utils.format_prompt(p["prompt"], args.prompt_template),
                                             args.chat_template) for p in preds]
        texts = [lm_tokenizer(p[key], add_special_tokens=False).input_ids for p in preds]
        for p, v in zip(preds, perplexities(lm, contexts, texts, lm_tokenizer.pad_token_id,
                                            args.metric_micro_batch_size)):
            if v is not None:
                p["scores"]["perplexity"] = v
        del lm
    for name, path in verifier_paths.items():  # each scores prompt + completion (+ EOS when finished)
        from shared.scalar import load_reward_model, score_sequences

        rm = load_reward_model(path, tokenizer, info, dtype)
        responses = [data_utils.encode_response(tokenizer, p["completion"], p["finished"]) for p in preds]
        scores = score_sequences(rm, prompt_ids, responses, tokenizer.pad_token_id, info,
                                 args.metric_micro_batch_size).double().cpu().tolist()
        for p, v in zip(preds, scores):
            p["scores"][f"reward/{name}"] = v
        del rm
    counts = {}
    if judge is not None:
        counts = run_judge(judge, preds, baseline, args.judge_criteria, args.judge_workers)
        if judge.errors:
            counts["judge/first_error"] = judge.errors[0]

    # TRY NOT TO MODIFY: the predictions with their scores, and the summary
    write_predictions(out, preds)
    summary = summarize(preds, corpus, args.num_bootstrap, args.confidence, args.seed)
    summary["metrics"].update({k: v for k, v in counts.items() if not isinstance(v, str)})
    summary = {**summary, **({"judge/first_error": counts["judge/first_error"]} if "judge/first_error" in counts
                             else {}),
               "num_prompts": len({p["index"] for p in preds}), "num_predictions": len(preds),
               "confidence": args.confidence, "num_bootstrap": args.num_bootstrap, "model_path": model_path,
               "judge_model": judge.model if judge else None,
               "args": json.loads(json.dumps(asdict(args), default=str))}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "summary.json")
    shown = ", ".join(f"{name.split('/', 1)[1]} {value:.3g}" for name, value in summary["metrics"].items()
                      if not name.endswith("/count"))
    print(f"done: {len(preds)} predictions in {duration(time.time() - start)}; {shown}; wrote "
          f"{out / 'predictions.jsonl'}, summary.json", flush=True)
    return summary


def write_predictions(out: Path, preds: list[dict]) -> None:
    tmp = out / "predictions.jsonl.tmp"
    tmp.write_text("".join(json.dumps(p) + "\n" for p in preds))
    tmp.replace(out / "predictions.jsonl")


if __name__ == "__main__":
    run_cli(main, Args)
