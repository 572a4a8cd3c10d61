"""Experiment (not a test): GenRM against the paper's discriminative baseline on the same labelled samples, measured
within a prompt and over distinct responses: one table for docs/genrm.md.

    python scripts/experiments/genrm_fair.py --seeds 1 2 3 --out_dir docs/bench/genrm_fair

Zhang et al. 2024 (https://arxiv.org/abs/2408.15240) compare GenRM with a discriminative verifier trained on the same
solutions. Here the policy (--policy) is sampled and graded once on --labelled_prompts training prompts x
--labelled_samples (scripts/experiments/bench_bon.py's labelled_data), and two data sets are written from those rows:
all of them (genrm.py then balances Yes / No in every batch) and the rows balanced within each prompt (as many
correct as incorrect samples of every prompt, the first in sampling order; prompts with one label only are dropped),
so that a prompt's difficulty no longer predicts the label. On each data set, with each seed, from the same start
(--policy): genrm.py's default GenRM (NLL of the verdict + SFT on the correct rows) and the discriminative verifier
(`--loss_type bce --sft_coef 0`: BCE on the scalar logit log p(Yes) - log p(No)). Each scores the same --num_samples
held-out samples of --num_prompts test prompts (evaluate.py, seed 1; one set for every seed and verifier): GenRM by
p(Yes), the discriminative one by p(Yes) / (p(Yes) + p(No)).

Measured per verifier: AUROC over all held-out samples; AUROC within a prompt (the mean over prompts whose samples
have both labels); best-of-N over samples (shared/evaluation.py best_of_n: the top-scored sample of each block of N);
best-of-N over distinct responses (identical strings merged, in order of first appearance, then blocks of N distinct
responses, a prompt with fewer than N distinct responses one block: the verifier must find the correct string among
different ones, and a correct answer repeated does not count again). References, computed exactly with no training:
the first sample, majority vote, a score that knows only the prompt's difficulty (the fraction of its held-out
samples that are correct), a random score per distinct response (its expected best-of-N), and pass@N.
Writes <out_dir>/cpu_<time>.json; `render(d)` is its table (docs/genrm.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts.bench_common import child_env, environment, invocation, run_child, write_result  # noqa: E402

ARMS = {  # name -> (data set, genrm.py flags)
    "genrm": ("all", []),
    "genrm_prompt_balanced": ("prompt_balanced", []),
    "disc": ("all", ["--loss_type", "bce", "--sft_coef", "0"]),
    "disc_prompt_balanced": ("prompt_balanced", ["--loss_type", "bce", "--sft_coef", "0"]),
}
LABELS = {"genrm": "GenRM (NLL + SFT), all rows, batches half Yes / half No",
          "genrm_prompt_balanced": "GenRM (NLL + SFT), rows balanced within each prompt",
          "disc": "discriminative (BCE), all rows, batches half Yes / half No",
          "disc_prompt_balanced": "discriminative (BCE), rows balanced within each prompt"}


# ---- pure functions (tests/test_genrm_baseline.py) -------------------------------------------------------------
def balance_within_prompt(rows: list[dict]) -> list[dict]:
    """The rows of every prompt cut to as many correct as incorrect ones, min(c, w) each, the first in their order;
    a prompt whose rows share one label keeps none. Prompts keep their order, rows their order within it."""
    by_prompt: dict = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], []).append(r)
    out = []
    for group in by_prompt.values():
        m = min(sum(r["label"] for r in group), sum(1 - r["label"] for r in group))
        seen = {0: 0, 1: 0}
        for r in group:
            if seen[r["label"]] < m:
                seen[r["label"]] += 1
                out.append(r)
    return out


def auroc(scores: list[float], labels: list[int]) -> float:
    """P(a random correct sample scores above a random incorrect one), ties one half; NaN if a label is absent."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def within_prompt_auroc(groups: list[tuple[list[float], list[int]]]) -> float:
    """The mean over prompts (scores, labels) of their own AUROC, over the prompts with both labels (NaN if none)."""
    values = [auroc(s, y) for s, y in groups if 0 < sum(y) < len(y)]
    return sum(values) / len(values) if values else float("nan")


def distinct_blocks(texts: list[str], k: int) -> list[list[int]]:
    """Indices of the first sample of every distinct text, in order of first appearance, cut into blocks of k
    consecutive ones (a remainder dropped); fewer than k distinct texts: one block of all of them."""
    first, seen = [], set()
    for i, t in enumerate(texts):
        if t not in seen:
            seen.add(t)
            first.append(i)
    if len(first) < k:
        return [first]
    return [first[s : s + k] for s in range(0, len(first) - k + 1, k)]


def distinct_best_of_n(texts: list[str], scores: list[float], correct: list, k: int) -> float:
    """Best-of-k over distinct responses: in each distinct block (distinct_blocks) the top-scored response, ties to the
    first; the mean of the picks' correctness."""
    blocks = distinct_blocks(texts, k)
    return sum(float(bool(correct[max(b, key=lambda i: (scores[i], -i))])) for b in blocks) / len(blocks)


def distinct_chance(texts: list[str], correct: list, k: int) -> float:
    """A random score per distinct response, best-of-k over distinct responses: the expected pick, the mean over
    distinct blocks of their fraction of correct responses."""
    blocks = distinct_blocks(texts, k)
    return sum(sum(bool(correct[i]) for i in b) / len(b) for b in blocks) / len(blocks)


def distinct_pass(texts: list[str], correct: list, k: int) -> float:
    """pass@k over distinct responses: the fraction of distinct blocks that hold a correct response."""
    blocks = distinct_blocks(texts, k)
    return sum(any(bool(correct[i]) for i in b) for b in blocks) / len(blocks)


def sample_chance_per_distinct(texts: list[str], correct: list, k: int) -> float:
    """A random score per distinct response (identical strings share it), best-of-k over samples: in each block of k
    samples every distinct string is equally likely to be picked; the mean over blocks of the fraction of the
    block's distinct strings that are correct."""
    out = []
    for s in range(0, len(texts) - k + 1, k):
        block = {t: bool(c) for t, c in zip(texts[s : s + k], correct[s : s + k])}
        out.append(sum(block.values()) / len(block))
    return sum(out) / len(out)


def selector_metrics(prompts: list[dict], scores: list[list[float]], ks: list[int]) -> dict:
    """AUROC over all samples and within a prompt, best-of-k over samples and over distinct responses, of one score
    per sample (scores[p][j] of prompts[p]["samples"][j])."""
    from shared.evaluation import best_of_n

    labels = [[int(s["grade"] > 0.5) for s in p["samples"]] for p in prompts]
    texts = [[s["completion"] for s in p["samples"]] for p in prompts]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    out = {"auroc": auroc([x for s in scores for x in s], [y for ys in labels for y in ys]),
           "auroc_within_prompt": within_prompt_auroc(list(zip(scores, labels)))}
    for k in ks:
        out[f"bon@{k}"] = mean([best_of_n(s, y, k) for s, y in zip(scores, labels)])
        out[f"bon_distinct@{k}"] = mean([distinct_best_of_n(t, s, y, k) for t, s, y in zip(texts, scores, labels)])
    return out


def reference_metrics(prompts: list[dict], ks: list[int], summary: dict) -> dict:
    """The rows that need no training: first sample, majority vote (evaluate.py's maj@k), the prompt-difficulty
    score, a random score per distinct response, pass@k; and the held-out samples' distinct-response counts."""
    labels = [[int(s["grade"] > 0.5) for s in p["samples"]] for p in prompts]
    texts = [[s["completion"] for s in p["samples"]] for p in prompts]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    difficulty = selector_metrics(prompts, [[mean(y)] * len(y) for y in labels], ks)
    first = {"auroc": float("nan"), "auroc_within_prompt": float("nan")}
    majority = dict(first)
    random = {"auroc": 0.5, "auroc_within_prompt": 0.5}
    ceiling = dict(first)
    for k in ks:
        first[f"bon@{k}"] = summary["eval/accuracy"]
        first[f"bon_distinct@{k}"] = mean([distinct_chance(t, y, 1) for t, y in zip(texts, labels)])
        majority[f"bon@{k}"] = summary[f"eval/maj@{k}"]
        majority[f"bon_distinct@{k}"] = float("nan")
        random[f"bon@{k}"] = mean([sample_chance_per_distinct(t, y, k) for t, y in zip(texts, labels)])
        random[f"bon_distinct@{k}"] = mean([distinct_chance(t, y, k) for t, y in zip(texts, labels)])
        ceiling[f"bon@{k}"] = summary[f"eval/pass@{k}"]
        ceiling[f"bon_distinct@{k}"] = mean([distinct_pass(t, y, k) for t, y in zip(texts, labels)])
    n_distinct = [len(set(t)) for t in texts]
    correct_distinct = [len({t for t, y in zip(ts, ys) if y}) for ts, ys in zip(texts, labels)]
    return {"first_sample": first, "majority_vote": majority, "prompt_difficulty": difficulty,
            "random_per_distinct": random, "pass": ceiling,
            "stats": {"mean_distinct_responses": mean(n_distinct), "mean_samples": mean([len(t) for t in texts]),
                      "max_distinct_correct_per_prompt": max(correct_distinct),
                      "mean_distinct_correct": mean([c for c in correct_distinct if c] or [0]),
                      "prompts_with_both_labels": sum(0 < sum(y) < len(y) for y in labels),
                      "accuracy": mean([y for ys in labels for y in ys])}}


# ---- running -----------------------------------------------------------------------------------------------------
def heldout_samples(work: Path, a) -> tuple[list[dict], dict]:
    """evaluate.py's --num_samples samples of --num_prompts test prompts (seed 1) with their grades, and its metrics."""
    ev = work / "heldout"
    if not (ev / "summary.json").exists():
        run_child(["algorithms/evaluate.py", "--model_name_or_path", a.policy, "--output_dir", str(ev),
                   "--eval_num_prompts", str(a.num_prompts), "--num_samples", str(a.num_samples), "--k", "1",
                   *map(str, a.k), "--no_greedy", "--num_bootstrap", "0"], work / "logs" / "heldout", env=child_env())
    records = [json.loads(x) for x in (ev / "completions.jsonl").read_text().splitlines() if x.strip()]
    return sorted(records, key=lambda r: r["index"]), json.loads((ev / "summary.json").read_text())["metrics"]


def score_heldout(path: Path, prompts: list[dict], loss_type: str) -> list[list[float]]:
    """Every held-out sample scored by the verifier at path: p(Yes) (nll) or p(Yes) / (p(Yes) + p(No)) (bce)."""
    import torch

    from shared import data as data_utils
    from shared.distributed import init_distributed, load_causal_lm, load_tokenizer
    from shared.verifier import GenerativeVerifier

    info = init_distributed()
    tokenizer = load_tokenizer(str(path))
    model = load_causal_lm(str(path), torch.float32).eval()
    verifier = GenerativeVerifier(model, tokenizer, model.config)
    ps, rs, owner = [], [], []
    for i, p in enumerate(prompts):
        pid = data_utils.encode_prompt(tokenizer, data_utils.format_prompt(p["prompt"], "{prompt}"), False)
        for s in p["samples"]:
            ps.append(pid)
            rs.append(data_utils.encode_response(tokenizer, s["completion"], s.get("finish_reason") == "stop"))
            owner.append(i)
    with torch.no_grad():
        out = verifier.score(ps, rs, tokenizer.pad_token_id, info, 64, with_no=True)
    yes, no = out["p_yes"].tolist(), out["p_no"].tolist()
    flat = yes if loss_type == "nll" else [y / max(y + n, 1e-30) for y, n in zip(yes, no)]
    scores: list[list[float]] = [[] for _ in prompts]
    for i, x in zip(owner, flat):
        scores[i].append(x)
    return scores


def main() -> None:
    from scripts.experiments.bench_bon import labelled_data

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--policy", default="builtin:tiny-sft", help="the policy sampled, and every verifier's start")
    p.add_argument("--num_prompts", type=int, default=100, help="held-out prompts (a fixed-seed sample)")
    p.add_argument("--num_samples", type=int, default=16, help="held-out samples per prompt")
    p.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--labelled_prompts", type=int, default=512, help="training prompts of the labelled samples")
    p.add_argument("--labelled_samples", type=int, default=8, help="samples per training prompt")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--train_flags", default="--eval_every 0", help="flags added to every genrm.py run (a shell line)")
    p.add_argument("--work_dir", default="runs/genrm_fair")
    p.add_argument("--out_dir", default=None, help="where the JSON goes (default runs/bench/genrm_fair)")
    a = p.parse_args()
    a.generator = "hf"
    env, t0 = environment(), time.time()
    work = Path(a.work_dir)
    labelled = labelled_data(work, a, [])
    records = [json.loads(x) for x in (work / "labelled" / "completions.jsonl").read_text().splitlines() if x.strip()]
    rows = [{"prompt": r["prompt"], "completion": s["completion"], "label": int(s["grade"] > 0.5),
             "finished": s["finish_reason"] == "stop"}  # a completion cut at the length limit gets no EOS
            for r in sorted(records, key=lambda r: r["index"]) for s in r["samples"]]
    balanced = balance_within_prompt(rows)
    data = {"all": work / "labelled_rows_all.jsonl", "prompt_balanced": work / "labelled_rows_prompt_balanced.jsonl"}
    for key, items in (("all", rows), ("prompt_balanced", balanced)):
        data[key].write_text("".join(json.dumps(r) + "\n" for r in items))
    prompts, summary = heldout_samples(work, a)
    result = {"benchmark": "genrm_fair", "command": invocation(), "env": env, "policy": a.policy,
              "num_prompts": a.num_prompts, "num_samples": a.num_samples, "k": a.k, "seeds": a.seeds,
              "train_flags": a.train_flags, "arms": {n: ARMS[n][1] for n in a.arms},
              "data": {"all": {"rows": len(rows), "correct": sum(r["label"] for r in rows),
                               "prompts": len({r["prompt"] for r in rows})},
                       "prompt_balanced": {"rows": len(balanced), "correct": sum(r["label"] for r in balanced),
                                           "prompts": len({r["prompt"] for r in balanced})}},
              "references": reference_metrics(prompts, a.k, summary), "runs": {}}
    for seed in a.seeds:  # seed-major: every arm of a seed, then the next seed (work_dir/partial.json after each)
        for name in a.arms:
            which, flags = ARMS[name]
            out = work / f"{name}_{seed}"
            if not (out / "final" / "config.json").exists():
                run_child(["algorithms/genrm.py", "--model_name_or_path", a.policy, "--data_path", str(data[which]),
                           *flags, *shlex.split(a.train_flags), "--seed", str(seed), "--output_dir", str(out),
                           "--resume", "no"], work / "logs" / f"{name}_{seed}", env=child_env())
            logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            loss_type = "bce" if "bce" in flags else "nll"
            m = selector_metrics(prompts, score_heldout(out / "final", prompts, loss_type), a.k)
            m["train_minutes"] = max(r.get("time", 0.0) for r in logged) / 60
            result["runs"].setdefault(name, {})[str(seed)] = m
            print(f"{name} seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()), flush=True)
        (work / "partial.json").write_text(json.dumps(result, indent=2, default=str))
    result["minutes"] = (time.time() - t0) / 60
    path = write_result("genrm_fair", result, Path(a.out_dir) if a.out_dir else None, latest=a.out_dir is None)
    print(f"wrote {path}")


# ---- the table (scripts/tools/docs_tables.py registers it) -------------------------------------------------------
def _cell(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    return f"{mean:.3f}" if len(xs) == 1 or min(xs) == max(xs) else f"{mean:.3f} ({min(xs):.3f} to {max(xs):.3f})"


def render(d: dict) -> str:
    """The comparison table of one genrm_fair JSON, with its caption and command."""
    ks = [min(d["k"]), max(d["k"])]
    cols = ["auroc", "auroc_within_prompt", *(f"bon@{k}" for k in ks), *(f"bon_distinct@{k}" for k in ks)]
    head = ["selector", "AUROC", "AUROC within a prompt", *(f"best-of-{k}, samples" for k in ks),
            *(f"best-of-{k}, distinct" for k in ks)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ref = d["references"]
    names = {"first_sample": "first sample", "majority_vote": "majority vote",
             "prompt_difficulty": "prompt difficulty (its held-out accuracy; no training)",
             "random_per_distinct": "random score per distinct response (expected)"}
    for key, label in names.items():
        lines.append("| " + " | ".join([label, *(_cell([ref[key][c]]) for c in cols)]) + " |")
    for name, seeds in d["runs"].items():
        lines.append("| " + " | ".join([LABELS[name], *(_cell([m[c] for m in seeds.values()]) for c in cols)]) + " |")
    ceiling = ["pass@N (ceiling)", "-", "-", *(_cell([ref["pass"][c]]) for c in cols[2:])]
    lines.append("| " + " | ".join(ceiling) + " |")
    st, da = ref["stats"], d["data"]
    minutes = {n: sum(m["train_minutes"] for m in s.values()) / len(s) for n, s in d["runs"].items()}
    caption = (f"{d['num_prompts']} held-out prompts x {d['num_samples']} samples of `{d['policy']}` at T = 1 (one set "
               f"for every verifier and seed; accuracy {st['accuracy']:.3f}; {st['mean_distinct_responses']:.1f} "
               f"distinct responses per prompt on average, {st['mean_distinct_correct']:.2f} distinct correct ones "
               f"among the prompts with a correct sample; {st['prompts_with_both_labels']} prompts with both labels, "
               "over which AUROC within a prompt is averaged). Best-of-N over samples: blocks of N samples; over "
               "distinct: identical strings merged, blocks of N distinct responses (fewer than N: one block). Every "
               f"verifier starts from `{d['policy']}` and trains on the same graded samples of the policy: all "
               f"{da['all']['rows']:,} rows ({da['all']['correct']:,} correct, {da['all']['prompts']} prompts), or the "
               f"{da['prompt_balanced']['rows']:,} rows balanced within each prompt "
               f"({da['prompt_balanced']['prompts']} prompts), seeds {', '.join(map(str, d['seeds']))} (mean, min "
               "to max); discriminative = `--loss_type bce --sft_coef 0`; every run genrm.py's defaults but "
               f"`{d['train_flags']}`; "
               + ", ".join(f"{n} {v:.1f}" for n, v in minutes.items()) + " minutes a run (run clock).")
    return "\n".join(lines) + f"\n\n{caption} `{d['command']}`, {d['env']['device']}.\n"


if __name__ == "__main__":
    main()
