"""Render the measured tables of README.md and docs/*.md from the JSON files the benchmark scripts wrote.

    python scripts/tools/docs_tables.py           # rewrite every generated block in place
    python scripts/tools/docs_tables.py --check   # exit 1 if a block differs from what its data file gives (a test runs this)

A generated block in a markdown file looks like

    <!-- table real_model_grpo docs/bench/real_model_grpo/cpu_20261123_120000.json -->
    ...markdown made by RENDERERS["real_model_grpo"] from that file...
    <!-- end table -->

so every number in it comes from a stored file, named beside it, and a docs edit cannot drift from the data.

A renderer in MULTI reads several files, named in the comment separated by commas (the comment may wrap after a
comma):

    <!-- table bench_ratios docs/bench/generation/cpu_20261122_095825.json,
         docs/bench/grpo/cpu_20261122_100143.json -->

and gets the list of their contents, each with its path under the key "_path".

A list of scripts is generated from the code too: `<!-- scripts FLAG -->...<!-- end scripts -->` (inline) holds the
algorithms/*.py whose Args have the field FLAG, `<!-- scripts FLAG=VALUE -->` those where its default is VALUE, and
`<!-- scripts FLAG!=VALUE -->` those that have it with another default ("grpo.py, dapo.py and prime.py").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from shared.cli import RENAMED  # noqa: E402  (the flags a stored command may name by an old name)
BLOCK = re.compile(r"(<!-- table (\S+) ([^\s,]+(?:,\s*[^\s,]+)*) -->\n)(.*?)(<!-- end table -->)", re.S)
SCRIPTS_BLOCK = re.compile(r"(<!-- scripts (\w+)(?:(!?=)(\S+))? -->)(.*?)(<!-- end scripts -->)", re.S)
# the order lists of scripts name them in: the README's algorithm table's order, then any other file by name
SCRIPT_ORDER = ("sft", "rm", "unit_rm", "dpo", "kto", "grpo", "dapo", "grpo_async", "grpo_tools", "opd", "prime", "calibration",
                "ppo", "ppo_async", "ppo_rlhf", "drca", "unit_ppo", "vineppo", "repulse", "restem", "genrm",
                "implicit_prm", "evaluate")



# Runs of these benchmarks are the scripts' default runs (plus flags). Files recorded before this time ran other
# defaults (no gradient checkpointing, grpo/ppo/vineppo/drca micro-batch 256, not 64): their tables say so.
DEFAULTS_CHANGED = "2026-11-26 03:25:25"
DEFAULT_RUN_BENCHMARKS = ("headline", "async", "grpo_variants")
OLD_DEFAULTS = ("every run with `--no_gradient_checkpointing`, and grpo, ppo, vineppo and drca with "
                "`--local_micro_batch_size 256`")


def ran_with(d: dict) -> str:
    """'' for most files; for a default-run benchmark measured before DEFAULTS_CHANGED, the flags its runs used that
    are no longer the scripts' defaults (a caption gives the command with the flags the run used)."""
    old = d.get("benchmark") in DEFAULT_RUN_BENCHMARKS and str(d["env"].get("time", "9")) < DEFAULTS_CHANGED
    return f"; {OLD_DEFAULTS}" if old else ""


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
                 f"new tokens. `{d['command']}`, {d['env']['device']}.")
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
                     f"{r['peak_rss_mb'] / 1024:.1f} GiB" + (f"; {re.sub(r' at commit [0-9a-f]{7,}', '', r['note'])}" if r.get("note") else ""))
    lines += ["", f"`{d['command']}`, {d['env']['device']}{ran_with(d)}."]
    return "\n".join(lines)


def graders(d: dict) -> str:
    lines = ["| grader | agrees with the human verdict | where it does not | seconds |", "|---|---|---|---|"]
    for name, r in d["results"].items():
        wrong = ", ".join(f"{w['case']} (says {w['got']})" for w in r["wrong"]) or "-"
        lines.append(f"| `{name}` | {r['correct']} / {d['num_cases']} | {wrong} | {r['seconds']:.1f} |")
    lines += ["", f"{d['num_math']} MATH and {d['num_gsm8k']} GSM8K cases; math-verify {d['math_verify_version']}. "
                  f"`{d['command']}`, {d['env']['device']}{ran_with(d)}."]
    return "\n".join(lines)


def hf_memory(d: dict) -> str:
    st = d["settings"]
    return "\n".join([
        "| generate call | generated tokens | peak RSS before | peak RSS after | growth |", "|---|---|---|---|---|",
        f"| {st['num_prompts']} prompts x {st['n']} samples x {st['max_new_tokens']} new tokens, vocabulary "
        f"{st['vocab']:,} | {d['generated_tokens']:,} | {d['peak_rss_before_mb']:.0f} MB | {d['peak_rss_mb']:.0f} MB | "
        f"+{d['peak_rss_growth_mb']:.0f} MB |", "",
        f"`python scripts/benchmarks/bench_hf_memory.py`, {d['env']['device']}{ran_with(d)}."])


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
                  f"{d['env']['device']}{ran_with(d)}."]
    return "\n".join(lines)


HEADLINE_WHAT = {"sft": "held-out grader accuracy (1 sample per prompt)",
                 "grpo": "held-out grader accuracy (4 samples per prompt)",
                 "dpo": "held-out grader accuracy (4 samples per prompt); the loss is DPO-Positive (`--loss_type dpop`, "
                        "the default)",
                 "rm": "held-out pairwise accuracy",
                 "drca": "held-out grader accuracy (4 samples per prompt); responses and counterfactuals scored by the "
                         "task's per-line grader (`--scorer auto` on the built-in task), not a reward model",
                 "ppo_rlhf": "held-out mean normalised score of the reward model it trains on (`builtin:tiny-rm`, 4 "
                             "samples per prompt)",
                 "ppo": "held-out grader accuracy (4 samples per prompt)",
                 "ppo_async": "held-out grader accuracy (4 samples per prompt); each batch generated by the weights of "
                              "one update before (`--tis token_truncate`)",
                 "prime": "held-out grader accuracy (4 samples per prompt)",
                 "implicit_prm": "held-out slip pairs: share whose lowest line reward is the slipped line"}


def _wall_minutes(run: dict) -> float:
    """A stored run's wall minutes over all its invocations (scripts/experiments/bench_headline.py wall_minutes)."""
    return (run["wall_s_this_invocation"] + run.get("wall_s_earlier_invocations", 0.0)) / 60


def _spread3(x: dict) -> str:
    """mean (min-max) over seeds; a single run says so."""
    if x.get("n") == 1:
        return f"{x['mean']:.3f} (1 seed)"
    return f"{x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"


def _spread_of(xs: list[float]) -> str:
    """_spread3 of a list of per-seed values."""
    return _spread3({"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)})


def _start_sha(d: dict) -> str:
    """The weights' hash of the start model (builtin:tiny-sft) a stored file ran from."""
    return d["env"]["builtin_models"]["builtin:tiny-sft"]["weights_sha256"]


def _start(r: dict, value: str) -> str:
    """The `start` cell: the first held-out evaluation, which for sft.py comes after its first eval_every steps."""
    steps = {x["curve"][0]["step"] for x in r["seeds"].values()}
    return value if steps == {0} else f"{value} (step {min(steps)})"


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
                     f"{_wall_minutes(x):.1f} |")
    means = " | ".join(f"{_start(r, format(r['start'][k]['mean'], '.3f'))} -> {_spread3(r['final'][k])}" for k in keys)
    at_best = _spread3(r["at_best"][keys[0]]) if r.get("at_best") else "-"
    lines.append(f"| mean (min-max) | {means} | | {at_best} | {r['minutes']['mean']:.1f} |")
    lines += ["", f"`{r['command']} --seed <k>` for each seed (`{d['command']}`), {d['env']['device']}"
                  f"{ran_with(d)}." + _reused_note([r["seeds"]])]
    return "\n".join(lines)


ACC4_SHORT = "held-out accuracy, 4 samples per prompt"


# --- README's results table: one row per training script's default run --------------------------------------------
OVERVIEW = ("sft", "grpo", "dpo", "rm", "drca", "dapo", "grpo_async", "ppo", "ppo_rlhf", "ppo_async", "vineppo",
            "restem", "repulse", "genrm", "prime")  # the rows in order: algorithms/<name>.py, its page docs/<name>.md
OVERVIEW_METRIC = {"sft": "held-out accuracy, 1 sample per prompt", "grpo": ACC4_SHORT, "dpo": ACC4_SHORT,
                   "rm": "held-out pairwise accuracy", "drca": ACC4_SHORT, "dapo": ACC4_SHORT,
                   "grpo_async": ACC4_SHORT, "ppo": ACC4_SHORT,
                   "ppo_rlhf": "held-out score of `builtin:tiny-rm`, 4 samples", "ppo_async": ACC4_SHORT,
                   "vineppo": ACC4_SHORT, "restem": ACC4_SHORT,
                   "genrm": "held-out AUROC of p(Yes)", "prime": ACC4_SHORT}  # repulse's default run measures log P(bad)
OVERVIEW_LEGEND = ("Accuracy: the task's grader, mean over the held-out prompts and samples; dpo.py's default loss is "
                   "DPO-Positive (`--loss_type dpop`); drca.py's default scorer on the built-in task is its per-line "
                   "grader (`--scorer auto`); ppo_rlhf.py trains on the reward model it is scored by. Minutes: the "
                   "whole process, mean over seeds (start-up, evaluations and saving included; the first seed of the "
                   "first RL script of a file also built the SFT warm start in its fresh cache, and for drca the "
                   "reward model it loads).")


def _reused_note(seed_maps: list[dict]) -> str:
    """' Copied with `--reuse`: <script> seed <k> (measured in <file>, on the same start models); ...' for the runs a
    bench_headline.py file took from an earlier one, '' when it ran them all."""
    earlier = {}
    for seeds in seed_maps:
        for seed, x in seeds.items():
            if "measured_in" in x:
                m = x["measured_in"]
                script = x["command"].split()[1].removeprefix("algorithms/")
                earlier.setdefault(m["file"], []).append(f"{script} seed {seed}")
    if not earlier:
        return ""
    return " Copied with `--reuse`: " + "; ".join(f"{', '.join(runs)} (measured in {file}, on the same start models)"
                                                  for file, runs in earlier.items()) + "."


def results_overview(files: list[dict]) -> str:
    """README's results table: the default run (`python algorithms/<script>.py`, no flags) of every script of OVERVIEW
    that a bench_headline.py file of the block has, one short row each (the last file that has a script wins), each
    file named under the table with its command and machine; then every training script (algorithms/*.py with a
    --learning_rate) without a stored default run, whose pages give what was measured instead. A file that is not a default-run benchmark is an error."""
    rows: dict[str, tuple[dict, dict]] = {}  # script: (its result, its file)
    for d in files:
        if d.get("benchmark") != "headline" or d.get("flags"):
            raise ValueError(f"results_overview: {d['_path']} is no default-run file (bench_headline.py without "
                             "--flags); its page renders it")
        for name, r in d["results"].items():
            if name not in OVERVIEW_METRIC:
                raise ValueError(f"results_overview: no metric description for {name} (add it to OVERVIEW_METRIC)")
            rows[name] = (r, d)
    lines = ["| script (default run) | metric | start -> end: mean (min-max) over seeds | minutes |",
             "|---|---|---|---|"]
    used: list[dict] = []
    for name in OVERVIEW:
        if name not in rows:
            continue
        r, d = rows[name]
        if not any(d is u for u in used):
            used.append(d)
        ref = next(i for i, u in enumerate(used, 1) if u is d)
        k = r["metrics"][0]
        lines.append(f"| `{r['command']}` [{ref}] | {OVERVIEW_METRIC[name]} | "
                     f"{_start(r, format(r['start'][k]['mean'], '.3f'))} -> {_spread3(r['final'][k])} | "
                     f"{r['minutes']['mean']:.1f} |")
    missing = [n for n in (s.removesuffix(".py") for s in scripts_with("learning_rate")) if n not in rows]
    legend, notes = OVERVIEW_LEGEND, []
    if missing:
        legend += (" No default run stored for " + ", ".join(f"[{n}.py](docs/{n}.md)" for n in missing)
                   + ": their pages give what was measured.")
    for i, d in enumerate(used, 1):
        mine = [r for r, dd in rows.values() if dd is d]
        seeds = sorted({s for r in mine for s in r["seeds"]})
        reused = [f"{r['command'].split()[-1].removeprefix('algorithms/')} seeds "
                  + ", ".join(s for s, x in r["seeds"].items() if "measured_in" in x)
                  for r in mine if any("measured_in" in x for x in r["seeds"].values())]
        copied = f" ({'; '.join(reused)}: copied with `--reuse` from the files this one names)" if reused else ""
        notes.append(f"- [{i}] Seeds {', '.join(seeds)}{copied}: `{d['command']}`, {d['env']['device']}, "
                     f"[{d['_path'].rsplit('/', 1)[1]}]({d['_path']}).")
    return "\n\n".join(["\n".join(lines), legend, "\n".join(notes)])


def lora_learning(files: list[dict]) -> str:
    """README's LoRA learning check: grpo.py's default run in full fine-tuning (the first file) and with LoRA (the
    second, bench_headline.py --flags), the same seeds: held-out accuracy start -> end and the gain ratio per seed."""
    (full, df), (lora, dl) = [(d["results"]["grpo"], d) for d in files]
    k = "eval/accuracy"
    seeds = [s for s in full["seeds"] if s in lora["seeds"]]
    gain = lambda x: x["final"][k] - x["start"][k]  # noqa: E731
    goal = 0.5  # the LoRA goal: LoRA's held-out gain at least half of full fine-tuning's, at the same samples
    lines = ["| seed | full fine-tuning: start -> end | LoRA: start -> end | LoRA gain / full gain | goal (>= "
             f"{goal}) | minutes, full / LoRA |", "|---|---|---|---|---|---|"]
    met = 0
    for s in seeds:
        f, lo = full["seeds"][s], lora["seeds"][s]
        ratio = gain(lo) / gain(f)
        met += ratio >= goal
        lines.append(f"| {s} | {f['start'][k]:.3f} -> {f['final'][k]:.3f} | {lo['start'][k]:.3f} -> "
                     f"{lo['final'][k]:.3f} | {ratio:.2f} | {'met' if ratio >= goal else 'missed'} | "
                     f"{_wall_minutes(f):.1f} / {_wall_minutes(lo):.1f} |")
    pooled = sum(gain(lora["seeds"][s]) for s in seeds) / sum(gain(full["seeds"][s]) for s in seeds)
    lines.append(f"| mean (min-max) | {full['start'][k]['mean']:.3f} -> {_spread3(full['final'][k])} | "
                 f"{lora['start'][k]['mean']:.3f} -> {_spread3(lora['final'][k])} | {pooled:.2f} (mean gains) | "
                 f"{'met' if pooled >= goal else 'missed'} | {full['minutes']['mean']:.1f} / {lora['minutes']['mean']:.1f} |")
    lines += ["", f"Held-out grader accuracy ({k}); a gain is a run's end minus its own start. Goal (LoRA's gain at "
                  f"least {goal} of full fine-tuning's, the same seed and samples): met in {met} of {len(seeds)} "
                  "seeds."]
    for what, r, d in (("Full fine-tuning", full, df), ("LoRA", lora, dl)):
        lines += ["", f"{what}: `{d['command']}` ({d['_path']}), {d['env']['device']}"
                      f"{ran_with(d)}, peak RSS at most {r['peak_rss_mb']['max']:.0f} MB."]
    return "\n".join(lines)


def dpo_losses(files: list[dict]) -> str:
    """docs/dpo.md: dpo.py's default run, the same run with another --loss_type (bench_headline.py, one file per
    loss, --flags) and kto.py's default run, the same seeds: held-out task and pair accuracy, start -> end."""
    lines = ["| run | held-out accuracy: start -> end | held-out pair accuracy, end | minutes |", "|---|---|---|---|"]
    notes = []
    for d in files:
        r = d["results"].get("dpo") or d["results"]["kto"]
        flags = d.get("flags") or ""
        lines.append(f"| `{r['command'].split(' --seed')[0]}` | {r['start']['eval/accuracy']['mean']:.3f} -> "
                     f"{_spread3(r['final']['eval/accuracy'])} | {_spread3(r['final']['eval/rewards/accuracies'])} | "
                     f"{r['minutes']['mean']:.1f} |")
        notes.append(f"{r['command'].split(' --seed')[0].removeprefix('python algorithms/')}: `{d['command']}`, "
                     f"{d['env']['device']}")
    seeds = sorted({s for d in files for r in d["results"].values() for s in r["seeds"]})
    return "\n".join(lines + ["", f"Seeds {', '.join(seeds)}, mean (min-max); task accuracy by the grader, 4 samples per "
                               "held-out prompt; pair accuracy: the implicit reward ranks the chosen response first; minutes: a run's "
                               "wall time on 2 cores shared with other jobs (upper bounds). "
                               + "; ".join(notes) + "."])


def lora_memory(d: dict) -> str:
    """scripts/benchmarks/bench_lora_memory.py: what LoRA saves on builtin:smollm2-135m, full fine-tuning vs LoRA."""
    a, runs = d["model_alone"], d["grpo_runs"]
    mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "-"  # noqa: E731
    lines = ["| | full fine-tuning | LoRA |", "|---|---|---|",
             f"| trainable parameters | {a['full']['trainable_parameters']:,} | {a['lora']['trainable_parameters']:,} |",
             f"| gradients (fp32) | {mib(a['full']['gradient_bytes'])} | {mib(a['lora']['gradient_bytes'])} |",
             f"| AdamW state (fp32) | {mib(a['full']['optimizer_state_bytes'])} | "
             f"{mib(a['lora']['optimizer_state_bytes'])} |"]
    f, lo = runs["full"][0], runs["lora"][0]
    lines += [f"| GRPO process peak RSS ({d['settings']['steps']} steps, vLLM engine included) | {f['peak_rss_mb']:.0f} MB "
              f"| {lo['peak_rss_mb']:.0f} MB |",
              f"| resumable checkpoint | {mib(f['checkpoint_bytes'])} | {mib(lo['checkpoint_bytes'])} |",
              f"| final/ export | {mib(f['final_bytes'])} | {mib(lo['final_bytes'])} (adapter/ "
              f"{mib(lo['adapter_bytes'])}) |",
              f"| weight sync into vLLM, mean per step | {f['mean_sync_s']:.3f} s | {lo['mean_sync_s']:.3f} s |",
              f"| process wall time | {f['wall_s']:.0f} s | {lo['wall_s']:.0f} s |"]
    r = d["settings"]["lora_r"]
    lines += ["", f"{d['model']}, fp32, LoRA r = {r}, alpha {d['settings']['lora_alpha']}, all linear layers. "
                  f"`{d['command'].strip()}`, {d['env']['device']}{ran_with(d)}, "
                  f"1-minute load average at the start {d['env']['loadavg_at_start'][0]:.1f}, at the end "
                  f"{d['loadavg_at_end'][0]:.1f} (times depend on it, memory does not)."]
    return "\n".join(lines)



def lora_sync(d: dict) -> str:
    """scripts/benchmarks/bench_lora_sync.py: --lora_sync merged against adapter on builtin:smollm2-135m: the sync into vLLM, the
    engine's memory, generation of a fixed batch, and where the adapter sync pays off."""
    st, m, a = d["settings"], d["modes"]["merged"], d["modes"]["adapter"]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    rate = {k: sum(r["generated_tokens"]) / sum(r["generate_s"]) for k, r in d["modes"].items()}
    batch = f"{st['num_prompts']} prompts x {st['num_generations']}, {st['max_new_tokens']} new tokens"
    lines = ["| | `merged` (default) | `adapter` |", "|---|---|---|",
             f"| weight sync into vLLM, median of {st['syncs']} | {m['sync_median_s']:.3f} s | "
             f"{a['sync_median_s']:.3f} s |",
             f"| data per sync | {mib(m['bytes_per_sync'])} (every weight) | {mib(a['bytes_per_sync'])} (A and B, "
             "peft format) |",
             f"| generation of the batch ({batch}), median of {st['gen_repeats']} | {m['generate_median_s']:.2f} s "
             f"| {a['generate_median_s']:.2f} s |",
             f"| generated tokens per second | {rate['merged']:.1f} | {rate['adapter']:.1f} |",
             f"| engine build | {m['engine_build_s']:.1f} s | {a['engine_build_s']:.1f} s |",
             f"| process RSS growth over the engine's build | {m['engine_rss_growth_mb']:.0f} MB | "
             f"{a['engine_rss_growth_mb']:.0f} MB |",
             f"| vLLM's LoRA buffers (adapter slots of its LoRA layers) | - | {mib(a['vllm_lora_buffer_bytes'])} |",
             f"| largest log-prob difference, engine vs trainer | {m['max_logprob_diff_vs_trainer']:.1e} | "
             f"{a['max_logprob_diff_vs_trainer']:.1e} |"]
    saved = m["sync_median_s"] - a["sync_median_s"]
    extra = 1 / rate["adapter"] - 1 / rate["merged"]  # seconds more per generated token with the adapter
    even = (f"the adapter sync saves {saved:.2f} s per sync and costs {1000 * extra:.0f} ms per generated token, so it "
            f"is faster only for a step that generates fewer than {saved / extra:.0f} tokens between two syncs"
            if extra > 0 else f"the adapter sync saves {saved:.2f} s per sync and generation is not slower")
    load = d["env"]["loadavg_at_start"][0], d["loadavg_at_end"][0]
    lines += ["", f"{d['model']}, {d['dtype']}, LoRA r = {st['lora_r']}, alpha {st['lora_alpha']}, all linear layers; "
                  f"both engines in one process (peak RSS {d['peak_rss_mb']:.0f} MB), built one after the other in this "
                  f"order, then taking turns. Greedy "
                  f"completions of the batch's prompts equal between the modes: {d['greedy_equal_fraction']:.0%}. "
                  f"On this machine {even} (at this batch's shape). `{d['command']}`, {d['env']['device']}"
                  f"{ran_with(d)}, 1-minute load average at the start {load[0]:.1f}, at the end "
                  f"{load[1]:.1f} (times depend on it, memory does not)."]
    return "\n".join(lines)


GRPO_DEFAULT_BATCH = 512  # grpo.py's default batch in one process, 64 prompts x 8 completions (tests/test_docs.py);
# a headline file from before bench_headline.py stored `samples` per evaluation has only the step


def prime_vs_grpo(files: list[dict]) -> str:
    """docs/prime.md: PRIME's default run (bench_headline.py, the second file) against GRPO's (bench_grpo_variants.py's
    `default`, the first file) and, with a third file, grpo.py's RLOO estimator (bench_grpo_variants.py's `rloo`) at
    equal generated samples: held-out accuracy at every sample count all curves hold, mean (min-max) over the seeds
    all have; the start models must be the same build."""
    arms = {"grpo.py": (files[0], files[0]["results"]["default"]), "prime.py": (files[1], files[1]["results"]["prime"])}
    if len(files) > 2:
        arms = {"grpo.py": arms["grpo.py"], "grpo.py --advantage_estimator rloo": (files[2], files[2]["results"]["rloo"]),
                "prime.py": arms["prime.py"]}
    if len({_start_sha(d) for d, _ in arms.values()}) != 1:
        raise SystemExit("prime_vs_grpo: the files started from different builds of builtin:tiny-sft")
    k = "eval/accuracy"
    n_of = lambda pt: pt.get("generated_samples", pt.get("samples"))  # noqa: E731
    seeds = [s for s in arms["prime.py"][1]["seeds"] if all(s in r["seeds"] for _, r in arms.values())]
    at = lambda run, n: next((pt[k] for pt in run["curve"] if n_of(pt) == n), None)  # noqa: E731
    counts = sorted(set.intersection(*({n_of(pt) for pt in r["seeds"][seeds[0]]["curve"]} for _, r in arms.values())))
    others = [name for name in arms if name != "prime.py"]
    lines = ["| generated samples | " + " | ".join(f"{name}: held-out accuracy" for name in arms) + " | "
             + " | ".join(f"prime - {name.split(' --advantage_estimator ')[-1].replace('.py', '')}" for name in others)
             + " |", "|---" * (1 + len(arms) + len(others)) + "|"]
    for n in counts:
        acc = {name: [at(r["seeds"][s], n) for s in seeds] for name, (_, r) in arms.items()}
        if any(None in xs for xs in acc.values()):
            continue
        diffs = [_spread_of([b - a for a, b in zip(acc[name], acc["prime.py"])]) for name in others]
        lines.append(f"| {n:,} | " + " | ".join(_spread_of(xs) for xs in acc.values()) + " | " + " | ".join(diffs) + " |")
    (dg, grpo), (dp, prime) = arms["grpo.py"], arms["prime.py"]
    rloo = arms.get("grpo.py --advantage_estimator rloo")
    lines += ["", f"Seeds {', '.join(seeds)}, one start model (builtin:tiny-sft), 4 samples per held-out prompt; "
                  f"generated samples: every completion sampled for training, those the accuracy filter dropped "
                  f"included. grpo.py: `python algorithms/grpo.py --seed <k>` ({_provenance(dg, '')[:-1]}); "
                  + (f"RLOO: `{rloo[1]['command']} --seed <k>` ({_provenance(rloo[0], '')[:-1]}); " if rloo else "")
                  + f"prime.py: `{prime['command']} --seed <k>` ({_provenance(dp, '')[:-1]}); minutes per run: grpo "
                  f"{grpo['minutes']['mean']:.1f}, " + (f"rloo {rloo[1]['minutes']['mean']:.1f}, " if rloo else "")
                  + f"prime {prime['minutes']['mean']:.1f} (other jobs shared the cores)."]
    return "\n".join(lines)


def opd_vs_grpo(files: list[dict]) -> str:
    """docs/opd.md: opd.py and its fixed-negative-advantage control (scripts/experiments/bench_opd.py, the second file) against
    grpo.py's default run (bench_grpo_variants.py's `default`, the first file), held-out accuracy against training
    samples from the same start; the teacher's accuracy measured the same way; samples each needs to reach 90% of it."""
    dg, do = files
    if _start_sha(dg) != _start_sha(do):
        raise SystemExit("opd_vs_grpo: the two files started from different builds of builtin:tiny-sft")
    k = "eval/accuracy"
    arms = {"grpo.py": dg["results"]["default"], "opd.py": do["results"]["opd"],
            f"control (`--control_adv {do['control_adv']:g}`)": do["results"]["control"]}
    curves = {name: {s: {pt.get("generated_samples", pt.get("samples")): pt[k] for pt in run["curve"]}
                     for s, run in arm["seeds"].items()} for name, arm in arms.items()}
    mean_at = lambda c, n: (lambda xs: sum(xs) / len(xs) if None not in xs else None)(  # noqa: E731
        [run.get(n) for run in c.values()])
    counts = sorted({n for c in curves.values() for run in c.values() for n in run})
    lines = ["| training samples | " + " | ".join(f"{name}: held-out accuracy" for name in arms) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for n in counts:
        cells = [_spread_of([run[n] for run in c.values()]) if all(n in run for run in c.values()) else "" for c in
                 curves.values()]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    t = do["teacher"][k]
    target = 0.9 * t["mean"]
    reach = {}
    for name, c in curves.items():
        hit = next((n for n in counts if (m := mean_at(c, n)) is not None and m >= target), None)
        reach[name] = hit
    said = "; ".join(f"{name} {f'{n:,}' if n is not None else 'not within ' + f'{max(max(r) for r in c.values()):,}'}"
                     for (name, n), c in zip(reach.items(), curves.values()))
    g, o = reach["grpo.py"], reach["opd.py"]
    ratio = f"opd.py needs {o / g:.2f}x grpo.py's samples" if g and o else "so no ratio of the two"
    opd_run = next(iter(do["results"]["opd"]["seeds"].values()))
    lines += ["", f"The teacher `{do['teacher']['model']}`, evaluated the same way: {_spread3(t)}; 90% of it: "
                  f"{target:.3f}. First evaluation at which the mean over seeds reaches it: {said} ({ratio}). "
                  f"Seeds {', '.join(curves['opd.py'])}, one start model (builtin:tiny-sft), 500 held-out prompts, 4 "
                  f"samples each; training samples: completions sampled for training. grpo.py: `python "
                  f"algorithms/grpo.py --seed <k>` ({_provenance(dg, '')[:-1]}); opd.py and the control: "
                  f"`{re.sub(r' --seed [0-9]+', '', opd_run['command'])} --seed <k>` and the same with `--control_adv "
                  f"{do['control_adv']:g}` (c: the mean |A_t| of the opd runs' first batch), teacher: "
                  f"`python algorithms/evaluate.py --model_name_or_path {do['teacher']['model']} --eval_num_prompts 500 "
                  f"--seed <k>` ({_provenance(do, '')[:-1]}); minutes per run: grpo "
                  f"{arms['grpo.py']['minutes']['mean']:.1f}, opd {do['results']['opd']['minutes']['mean']:.1f}, "
                  f"control {do['results']['control']['minutes']['mean']:.1f} (other jobs shared the cores)."]
    return "\n".join(lines)


def restem_vs_grpo(files: list[dict]) -> str:
    """docs/restem.md: RestEM (bench_headline.py, the second file) against GRPO's default run (the first file) at equal
    training samples: GRPO's held-out accuracy read off its curve at RestEM's total samples, per seed."""
    (grpo, dg), (rest, dr) = [(d["results"][n], d) for d, n in zip(files, ("grpo", "restem"))]
    k = "eval/accuracy"
    samples = lambda pt: pt.get("samples", pt["step"] * GRPO_DEFAULT_BATCH)  # noqa: E731
    seeds = [s for s in rest["seeds"] if s in grpo["seeds"]]
    n = {samples(rest["seeds"][s]["curve"][-1]) for s in seeds}
    if len(n) != 1:
        raise SystemExit(f"restem_vs_grpo: the RestEM runs end at different sample counts {sorted(n)}")
    n = n.pop()
    rows, gains, ends = [], {"grpo": [], "restem": []}, {"grpo": [], "restem": []}
    for s in seeds:
        g, r = grpo["seeds"][s], rest["seeds"][s]
        at = next((pt for pt in g["curve"] if samples(pt) == n), None)
        if at is None:
            raise SystemExit(f"restem_vs_grpo: GRPO seed {s} has no evaluation at {n} samples")
        gg, rg = at[k] - g["start"][k], r["final"][k] - r["start"][k]
        gains["grpo"].append(gg)
        gains["restem"].append(rg)
        ends["grpo"].append(at[k])
        ends["restem"].append(r["final"][k])
        rows.append(f"| {s} | {g['start'][k]:.3f} -> {at[k]:.3f} (step {at['step']}) | {gg:+.3f} | "
                    + " -> ".join(f"{pt[k]:.3f}" for pt in r["curve"])
                    + f" | {rg:+.3f} | {rg - gg:+.3f} | {_wall_minutes(r):.1f} |")
    m = lambda xs: sum(xs) / len(xs)  # noqa: E731
    sp = lambda xs: f"{m(xs):+.3f} ({min(xs):+.3f} to {max(xs):+.3f})"  # noqa: E731
    diffs = [b - a for a, b in zip(gains["grpo"], gains["restem"])]
    after = ", ".join(f"{pt['samples']:,}" for pt in rest["seeds"][seeds[0]]["curve"][1:])
    lines = [f"| seed | GRPO: start -> at {n:,} samples | GRPO gain | RestEM: start -> after each iteration ({after} "
             "samples) | RestEM gain | RestEM gain - GRPO gain | RestEM minutes |", "|---|---|---|---|---|---|---|",
             *rows,
             f"| mean (min-max) | {m([grpo['seeds'][s]['start'][k] for s in seeds]):.3f} -> {m(ends['grpo']):.3f} | "
             f"{sp(gains['grpo'])} | {m([rest['seeds'][s]['start'][k] for s in seeds]):.3f} -> {m(ends['restem']):.3f} "
             f"| {sp(gains['restem'])} | {sp(diffs)} | {rest['minutes']['mean']:.1f} |"]
    wins = sum(x > 0 for x in diffs)
    lines += ["", f"Held-out grader accuracy (500 prompts x 4 samples, T = 1). RestEM's gain is larger than GRPO's in "
                  f"{wins} of {len(diffs)} seeds. GRPO's full default run ({samples(grpo['seeds'][seeds[0]]['curve'][-1]):,} "
                  f"samples) ends at {_spread3(grpo['final'][k])}."]
    for what, d in (("GRPO", dg), ("RestEM", dr)):
        r = d["results"]["grpo" if what == "GRPO" else "restem"]
        lines += ["", f"{what}: `{r['command']} --seed <k>` (`{d['command']}`, {d['_path']}), {d['env']['device']}"
                      f"{ran_with(d)}."]
    return "\n".join(lines)

# --- scripts/benchmarks/bench_{generation,grpo,preference,vineppo}.py: several measurement sets, one file per benchmark ------
def g3(x: float) -> str:
    """Three significant digits, trailing zeros kept (0.640, 1.03, 11.1)."""
    return f"{x:#.3g}".rstrip(".")


def _bench_sets(ds: list[dict]) -> list[tuple[str, dict[str, list[dict]]]]:
    """[(commit, {benchmark: [files, most repeats first]})] in the order the block names the commits: the first
    commit is the set the tables report, the others are compared by their medians."""
    sets: dict[str, dict[str, list[dict]]] = {}
    for d in ds:
        sets.setdefault(d["env"]["git_commit"], {}).setdefault(d["benchmark"], []).append(d)
    for by_bench in sets.values():
        for files in by_bench.values():
            files.sort(key=lambda d: -d["settings"]["repeats"])
    return list(sets.items())


def _compare_to_trl(s: dict) -> str:
    if s["max"] < 1:
        return f"ours faster in every repeat ({100 * (1 - s['median']):.0f}% at the median)"
    if s["min"] > 1:
        return f"ours slower in every repeat ({100 * (s['median'] - 1):.0f}% at the median)"
    return "parity: repeats on both sides of 1"


def _pct2(x: float) -> str:
    return f"{100 * x:#.2g}".rstrip(".") + "%"


# (benchmark, comparison, target text, (op, threshold) or None, value of a file, format, note(file, value), source)
BENCH_RATIO_ROWS = [
    ("generation", "generation: ours_vllm / raw_same tokens/s", ">= 0.9", (">=", 0.9),
     lambda d: d["ratios"]["ours_vllm/raw_same tokens/s"], g3, None, "generation `ratios`"),
    ("generation", "generation: ours_vllm / raw_plain tokens/s", ">= 0.9", (">=", 0.9),
     lambda d: d["ratios"]["ours_vllm/raw_plain tokens/s"], g3,
     lambda d, s: f"{'per-request seeds and ' if d['settings'].get('per_request_seeds', True) else ''}log-probs "
                  + (f"cost {100 * (1 - s['median']):.0f}% at the median" if s["median"] < 0.995
                     else "cost nothing measurable"),
     "generation `ratios`"),
    ("generation", "generation: vLLM / HF tokens/s (64 x 8 sequences)", ">= 5", (">=", 5),
     lambda d: d["ratios"]["ours_vllm/ours_hf tokens/s"], g3,
     lambda d, s: f"HF is faster on {d['settings']['model']}" if s["median"] < 1 else "", "generation `ratios`"),
    ("grpo", "GRPO step time: ours (vLLM) / TRL (HF generate)", "<= 0.7", ("<=", 0.7),
     lambda d: d["ratios"]["ours/trl step time"], g3, lambda d, s: _compare_to_trl(s), "grpo `ratios`"),
    ("grpo", "GRPO step time: ours (HF generate) / TRL (HF generate)", "<= 0.7", ("<=", 0.7),
     lambda d: d["ratios"]["ours_hf/trl step time"], g3, lambda d, s: _compare_to_trl(s), "grpo `ratios`"),
    ("grpo", "weight sync / GRPO step (ours, vLLM)", "<= 2% (GPU); CPU reported", ("<=", 0.02),
     lambda d: d["contenders"]["ours"]["sync_fraction"], _pct2, lambda d, s: "on CPU",
     "grpo `contenders.ours.sync_fraction`"),
    ("preference", "DPO step time: ours / TRL", "<= 0.7", ("<=", 0.7),
     lambda d: d["ratios"]["dpo: ours/trl step time"], g3, lambda d, s: _compare_to_trl(s), "preference `ratios`"),
    ("preference", "RM step time: ours / TRL", "<= 0.7", ("<=", 0.7),
     lambda d: d["ratios"]["rm: ours/trl step time"], g3, lambda d, s: _compare_to_trl(s), "preference `ratios`"),
    ("vineppo", "VinePPO / PPO iteration time", "<= 2", ("<=", 2),
     lambda d: d["iteration"]["ratio_vineppo_over_ppo"], g3, None, "vineppo `iteration.ratio_vineppo_over_ppo`"),
    ("vineppo", "MC phase: no dedup / dedup (prefix caching on)", "reported", None,
     lambda d: d["mc"]["ratios"]["no_dedup/dedup (prefix caching on)"], g3,
     lambda d, s: f"dedup keeps {100 * d['mc']['cells']['prefix_on/dedup']['unique_state_frac']['median']:.0f}% "
                  "of the states", "vineppo `mc.ratios`"),
    ("vineppo", "MC phase: prefix caching off / on (no dedup)", "reported", None,
     lambda d: d["mc"]["ratios"]["prefix off/on (no dedup)"], g3,
     lambda d, s: "no gain on CPU: 128-token KV blocks" if s["median"] < 1.05 else "", "vineppo `mc.ratios`"),
]


# the goals of the real-model set (builtin:smollm2-135m, `--smollm2`): row label -> (target text, rule)
SMOLLM2_GOALS = {
    "generation: vLLM / HF tokens/s (64 x 8 sequences)": (">= 3", (">=", 3)),
    "GRPO step time: ours (vLLM) / TRL (HF generate)": ("<= 0.5", ("<=", 0.5)),
    "GRPO step time: ours (HF generate) / TRL (HF generate)": ("reported", None),
    "DPO step time: ours / TRL": ("<= 0.8", ("<=", 0.8)),
    "RM step time: ours / TRL": ("<= 0.8", ("<=", 0.8)),
    "weight sync / GRPO step (ours, vLLM)": ("<= 2%", ("<=", 0.02)),
}


def _bench_command(d: dict, repeats: bool = True) -> str:
    """The command that wrote a benchmark file: its preset flag, parts and (optionally) repeats."""
    st = d["settings"]
    parts = st.get("parts")
    return (f"python scripts/benchmarks/bench_{d['benchmark']}.py" + (" --smollm2" if st.get("smollm2") else "")
            + (f" --parts {','.join(parts)}" if parts and parts != ["iteration", "mc"] else "")
            + (f" --repeats {st['repeats']}" if repeats else ""))


SETS = "ABCDEFGH"  # bench_ratios: the sets of files of one table, by the order the block names them


def bench_ratios(ds: list[dict]) -> str:
    """performance.md's ratio table: min / median / max over the repeats of the first set, medians of the others.
    A set measured with `--smollm2` is held to the real-model goals (SMOLLM2_GOALS)."""
    (main, files), *others = _bench_sets(ds)
    real = any(d["settings"].get("smollm2") for fs in files.values() for d in fs)
    lines = ["| comparison | repeats | target | min | median | max | met? | "
             + "".join(f"median, set {SETS[i]} | " for i in range(1, len(others) + 1)) + "source (JSON key) |",
             "|---" * (8 + len(others)) + "|"]
    for bench, label, target, rule, get, fmt, note, key in BENCH_RATIO_ROWS:
        if real:
            target, rule = SMOLLM2_GOALS.get(label, (target, rule))
        for i, d in enumerate(files.get(bench, [])):
            try:
                s = get(d)
            except KeyError:  # a part the file did not run (bench_vineppo.py --parts iteration)
                continue
            shown = label.replace("64 x 8", f"{d['settings']['num_prompts']} x {d['settings']['n']}") \
                if bench == "generation" else label
            if rule is None:
                met = "-"
            else:
                ok = s["median"] >= rule[1] if rule[0] == ">=" else s["median"] <= rule[1]
                met = "yes" if ok else "**no**"
            text = note(d, s) if note else ""
            met += f" ({text})" if text else ""
            rest = [fmt(get(o[bench][0])["median"]) if bench in o else "-" for _, o in others] if i == 0 else \
                ["(see above)"] * len(others)
            lines.append(f"| {shown} | {d['settings']['repeats']} | {target} | {fmt(s['min'])} | {fmt(s['median'])} | "
                         f"{fmt(s['max'])} | {met} | " + "".join(f"{x} | " for x in rest) + f"{key} |")
    lines += ["", "Files (repeats, 1-minute load average at the start):"]
    for i, (_, by_bench) in enumerate([(main, files), *others]):
        runs = sorted((d for fs in by_bench.values() for d in fs), key=lambda d: d["_path"])
        lines.append(f"- set {SETS[i]}{' (min, median, max)' if i == 0 else ''}: " + "; ".join(
            f"[{d['_path'].removeprefix('docs/')}]({d['_path'].removeprefix('docs/')}) ({d['settings']['repeats']}, "
            f"{d['env']['loadavg_at_start'][0]:.2f})" for d in runs))
    e = {**ds[0]["env"], "trl": next((d["env"]["trl"] for d in ds if d["env"].get("trl")), None)}
    commands = sorted({_bench_command(d, repeats=False) + " --repeats <repeats>" for d in ds})
    lines += ["", f"Each file: {', '.join(f'`{c}`' for c in commands)}, {e['device']}; torch "
                  f"{e['torch']}, transformers {e['transformers']}, vllm {e['vllm']}, trl {e['trl']}, deepspeed "
                  f"{e['deepspeed']}."]
    return "\n".join(lines)


GRPO_PHASES = {"generate": "generate ({batch} completions)", "reward": "reward (grader)",
               "logprob": "logprob (old log-probs, no grad)", "train": "train ({opt} optimizer steps)",
               "sync": "sync (weights into the engine)", "other": "other (tensors, advantages, logging)"}


def bench_grpo_phases(d: dict) -> str:
    """Where a GRPO step's time goes: medians of our scripts' own timers, vLLM and HF backends."""
    st, c = d["settings"], d["contenders"]
    runs = [(name, c[name]["phases_median_s"]) for name in ("ours", "ours_hf")
            if c.get(name, {}).get("phases_median_s")]
    head = " | ".join(f"{'ours (vLLM)' if n == 'ours' else 'ours (HF)'}: seconds | share" for n, _ in runs)
    lines = [f"| phase | {head} |", "|---" * (1 + 2 * len(runs)) + "|"]
    for key, label in GRPO_PHASES.items():
        cells = " | ".join(f"{ph[key]:.3f} | {100 * ph[key] / sum(ph.values()):.0f}%" for _, ph in runs)
        lines.append(f"| {label.format(batch=st['batch'], opt=st['optimizer_steps_per_iteration'])} | {cells} |")
    lines += ["", f"Medians over the timed steps of {st['repeats']} repeats; share: of the sum of the phase medians. "
                  f"`{_bench_command(d, repeats=False)}`, {d['env']['device']}"
                  f"{ran_with(d)}."]
    return "\n".join(lines)


def bench_vineppo_phases(d: dict) -> str:
    """bench_vineppo.py: PPO's and VinePPO's iteration split by phase (medians)."""
    c, st = d["iteration"]["contenders"], d["settings"]
    ppo, vine = c["ppo"]["phases_median_s"], c["vineppo"]["phases_median_s"]
    labels = {"generate": "trajectories (generate)", "reward": "reward (grader)",
              "value_estimation": "Monte Carlo values", "logprob": "old / reference log-probs (and PPO's values)",
              "train": "training", "sync": "weight sync", "other": "other"}
    lines = ["| phase | PPO | VinePPO |", "|---|---|---|"]
    for k, label in labels.items():
        cell = lambda ph: f"{ph[k]:.2f} s" if k in ph else "-"  # noqa: E731
        lines.append(f"| {label} | {cell(ppo)} | {cell(vine)} |")
    lines.append(f"| iteration (median step) | {c['ppo']['step_s']['median']:.2f} s | "
                 f"{c['vineppo']['step_s']['median']:.2f} s |")
    u = c["vineppo"]["unique_state_frac"]
    lines += ["", f"{st['num_prompts']} prompts x {st['num_samples_per_prompt']} samples, {st['max_new_tokens']} new "
                  f"tokens, K = {st['num_mc_rollouts']}, {st['num_ppo_epochs']} epochs x {st['num_minibatches']} "
                  f"minibatches; medians over the timed steps of {st['repeats']} repeats; deduplication kept "
                  f"{100 * u['min']:.0f}-{100 * u['max']:.0f}% of the states. `{_bench_command(d, repeats=False)}`, "
                  f"{d['env']['device']}{ran_with(d)}."]
    return "\n".join(lines)


# --- compare_*.py, value_prediction.py, repulse_toy.py: summary files (older ones record no env) -----------------
def _provenance(d: dict, command: str) -> str:
    e = d.get("env")
    if e:
        kernels = f" (ATen kernels {e['aten_cpu_capability']})" if e.get("aten_cpu_capability") else ""
        return f"`{d.get('command', command)}`, {e['device']}{kernels}{ran_with(d)}."
    return f"`{command}` (this file records no machine)."


def optimizer_bench(d: dict) -> str:
    """scripts/benchmarks/bench_optimizer.py: one AdamW step per implementation, and DeepSpeed's all-reduce in one process."""
    names = {"adamw_for_loop": "AdamW, `foreach=False` (per-tensor loop; PyTorch's CPU default)",
             "adamw_foreach": "AdamW, `foreach=True`",
             "adamw_fused": "AdamW, `fused=True` (transformers' default; the scripts')",
             "deepspeed_all_reduce_world_1": "DeepSpeed backward all-reduce, 1 process, ZeRO-0 (the scripts skip "
                                             "it)"}
    lines = ["| per optimizer step | min | median | max |", "|---|---|---|---|"]
    for key, label in names.items():
        s = d["seconds"][key]
        lines.append(f"| {label} | {s['min']:.3f} s | {s['median']:.3f} s | {s['max']:.3f} s |")
    r = d["ratios"]["adamw_for_loop/adamw_fused"]["median"]
    lines += ["", f"{d['model']} ({d['num_parameters'] / 1e6:.1f} M parameters, fp32), {d['settings']['repeats']} "
                  f"alternating repeats; the per-tensor loop takes {r:.1f}x the fused step (median of the per-repeat "
                  f"ratios); saved per optimizer step, fused and no all-reduce: "
                  f"{d['saved_per_optimizer_step_s']:.2f} s. " + _provenance(d, "python scripts/benchmarks/bench_optimizer.py")]
    return "\n".join(lines)


def ppo_vs_vineppo(d: dict) -> str:
    rows, n = d["per_seed"], len(d["per_seed"])
    steps = lambda x: "not reached" if x is None else str(x)  # noqa: E731
    lines = ["| seed | start | PPO final | VinePPO final | gradient steps to PPO's final accuracy (PPO / VinePPO) | "
             "wall time (PPO / VinePPO) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['initial_accuracy']:.3f} | {r['ppo_final_accuracy']:.3f} | "
                     f"{r['vineppo_final_accuracy']:.3f} | {steps(r['ppo_steps_to_target'])} / "
                     f"{steps(r['vineppo_steps_to_target'])} | {r['ppo_seconds'] / 60:.1f} / "
                     f"{r['vineppo_seconds'] / 60:.1f} min |")
    mean = lambda k: sum(r[k] for r in rows) / n  # noqa: E731
    wall = sum(r["vineppo_seconds"] / r["ppo_seconds"] for r in rows) / n
    med = d["median_step_ratio"]
    lines.append(f"| mean | {mean('initial_accuracy'):.3f} | {mean('ppo_final_accuracy'):.3f} | "
                 f"{mean('vineppo_final_accuracy'):.3f} | VinePPO reached it in "
                 f"{d['seeds_where_vineppo_reached_ppo_final']} of {n} seeds (median step ratio "
                 f"{'-' if med is None else f'{med:.1f}'}) | "
                 f"{mean('ppo_seconds') / 60:.1f} / {mean('vineppo_seconds') / 60:.1f} min (VinePPO {wall:.1f}x) |")
    lines += ["", "Held-out accuracy; wall time: the whole run. "
              + _provenance(d, "python scripts/experiments/compare_ppo_vineppo.py --seeds " + " ".join(map(str, d["seeds"])))]
    return "\n".join(lines)


def value_prediction(d: dict) -> str:
    k = d["k"]
    critic, mc = d["mae_critic"], d[f"mae_mc_k{k}"]
    lines = ["| estimator | mean absolute error |", "|---|---|",
             f"| PPO's critic | {critic:.3f} |", f"| VinePPO's estimate, K = {k} rollouts | **{mc:.3f}** |", "",
             f"{d['num_states']} states"
             + (f" of {d['num_prompts']} responses" if "num_prompts" in d else "")
             + f"; ground truth: {d['k_truth']} Monte Carlo rollouts per state (mean value "
             f"{d['mean_truth_value']:.3f}); the MC estimate's error is {100 * (1 - mc / critic):.0f}% below the "
             "critic's. " + _provenance(d, f"python scripts/experiments/value_prediction.py --policy {d['policy']} --critic "
                                          f"{d['critic']}")]
    return "\n".join(lines)


def vineppo_vs_ppo(d: dict) -> str:
    """scripts/experiments/compare_vineppo_ppo_grpo.py: per seed and algorithm, the final held-out accuracy and the gradient steps
    and training minutes to first reach PPO's final accuracy of that seed."""
    st, algos = d["settings"], list(d["per_seed"][0]["algorithms"])
    names = {"ppo": "PPO", "vineppo": f"VinePPO (K = {st['vineppo_k']})", "grpo": "GRPO"}
    reach = lambda x, f: "never" if x is None else f(x)  # noqa: E731
    minutes = lambda x: f"{x / 60:.1f}"  # noqa: E731
    lines = ["| seed | algorithm | start | final | gradient steps to PPO's final | training minutes to PPO's final |",
             "|---|---|---|---|---|---|"]
    for s in d["per_seed"]:
        for algo in algos:
            r = s["algorithms"][algo]
            lines.append(f"| {s['seed']} | {names.get(algo, algo)} | {r['initial_accuracy']:.3f} | "
                         f"{r['final_accuracy']:.3f} | {reach(r['gradient_steps_to_target'], str)} / "
                         f"{r['final_gradient_steps']} | {reach(r['train_seconds_to_target'], minutes)} / "
                         f"{minutes(r['total_train_seconds'])} |")
    g = d["goal"]
    lines += ["", f"Target of each seed: PPO's final held-out accuracy ({st['eval']}, every {st['eval_every']} rollout "
                  f"steps = {st['eval_every'] * st['gradient_steps_per_rollout_step']} gradient steps); \"x / y\": "
                  f"to the target / in the whole run. {st['rollout_steps']} rollout steps of "
                  f"{st['prompts_per_step']} prompts x {st['completions_per_prompt']} completions, "
                  f"{st['gradient_steps_per_rollout_step']} gradient steps each, lr {st['learning_rate']:g}; same SFT "
                  f"start (weights {d['sft_start']['weights_sha256'][:12]}). Training minutes: the training steps' "
                  f"phases, without evaluation and set-up. VinePPO within 1/3 of PPO's gradient steps on every seed: "
                  f"{'yes' if g['vineppo_within_a_third_of_ppo_steps_on_every_seed'] else 'no'}. "
                  + _reused_ppo(d) + _provenance(d, "python scripts/experiments/compare_vineppo_ppo_grpo.py")]
    return "\n".join(lines)


def _window_mean(points: list[dict], end: int, width: int) -> float | None:
    """Mean held-out accuracy of a curve's evaluations at rollout steps in (end - width, end]."""
    xs = [p["accuracy"] for p in points if end - width < p["step"] <= end]
    return sum(xs) / len(xs) if xs else None


def _first_window_reach(points: list[dict], target: float, width: int) -> dict | None:
    """The first evaluation at which the mean over the window (step - width, step] reaches target (None if never)."""
    return next((p for p in points if p["step"] >= width and _window_mean(points, p["step"], width) >= target), None)


def vineppo_plateau(d: dict, width: int = 10) -> str:
    """compare_vineppo_ppo_grpo.py's curves, smoothed: each run's mean held-out accuracy over the evaluations of the
    last `width` rollout steps of each half of the run, and the gradient steps after which that windowed mean first
    reaches PPO's end-of-run windowed mean (a target less at the mercy of one evaluation's noise than the main table's
    single final evaluation)."""
    st = d["settings"]
    half, end = st["rollout_steps"] // 2, st["rollout_steps"]
    names = {"ppo": "PPO", "vineppo": f"VinePPO (K = {st['vineppo_k']})", "grpo": "GRPO"}
    g = st["gradient_steps_per_rollout_step"]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"| seed | algorithm | accuracy, rollout steps {half - width + 1}-{half} | accuracy, rollout steps "
             f"{end - width + 1}-{end} | second half's gain | gradient steps to PPO's accuracy of steps "
             f"{end - width + 1}-{end} |", "|---|---|---|---|---|---|"]
    for s in d["per_seed"]:
        target = _window_mean(d["curves"][f"ppo_seed{s['seed']}"], end, width)
        for algo in s["algorithms"]:
            pts = d["curves"][f"{algo}_seed{s['seed']}"]
            a, b = _window_mean(pts, half, width), _window_mean(pts, end, width)
            hit = _first_window_reach(pts, target, width)
            lines.append(f"| {s['seed']} | {names.get(algo, algo)} | {f(a)} | {f(b)} | "
                         f"{'-' if a is None or b is None else f'{b - a:+.3f}'} | "
                         f"{'never' if hit is None else hit['step'] * g} / {end * g} |")
    lines += ["", f"Rollout steps of {g} gradient steps; an accuracy: the mean of the held-out evaluations in those "
                  f"{width} rollout steps ({st['eval']}, every {st['eval_every']} rollout steps); the last column: "
                  f"gradient steps until the mean over the preceding {width} rollout steps' evaluations first reaches "
                  f"PPO's mean over its last {width}. From the curves of "
                  f"[`{d['_path'].removeprefix('docs/')}`]({d['_path'].removeprefix('docs/')}), the runs of the table "
                  f"above: " + _provenance(d, "python scripts/experiments/compare_vineppo_ppo_grpo.py")]
    return "\n".join(lines)


def _reused_ppo(d: dict) -> str:
    """The caption's clause for PPO runs copied from another work directory (`--ppo_from`), with their sessions."""
    src = d.get("ppo_runs_from")
    if not src:
        return ""
    return f"The PPO runs are those of `{src['dir']}` (same start weights and PPO flags, checked). "


def vineppo_value_table(d: dict) -> str:
    """scripts/experiments/compare_vineppo_ppo_grpo.py (value_prediction.py per seed): MAE and pairwise ranking accuracy of PPO's
    critic and of the K-rollout MC estimate against the ground truth, per step position, mean over seeds."""
    k, vp = d["settings"]["vineppo_k"], d["value_prediction"]
    mc = f"mc_k{k}"
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"| step position | states (all seeds) | MAE: critic | MAE: MC, K = {k} | ranking accuracy: critic | "
             "ranking accuracy: MC |", "|---|---|---|---|---|---|"]
    for r in vp["per_position_mean_over_seeds"]:
        pos = "all (pooled)" if r["position"] == "all" else f"S_{r['position']}"
        lines.append(f"| {pos} | {r['num_states']} | {f(r['mae']['critic'])} | {f(r['mae'][mc])} | "
                     f"{f(r['ranking_accuracy']['critic'])} | {f(r['ranking_accuracy'][mc])} |")
    first = vp["per_seed"][0]
    better = d["goal"]["mc_beats_critic_at_every_position"]
    lines += ["", f"Mean over {len(vp['per_seed'])} seeds; states at the step boundaries of {first['num_prompts']} "
                  f"held-out responses of each seed's final PPO policy; ground truth: {first['k_truth']} rollouts per "
                  "state. Ranking accuracy: pairs of states at the same position whose ground truths differ, ordered "
                  f"as the truth orders them (ties in the estimate count half). MC better on both at every position: "
                  f"{'yes' if better else 'no'}. " + _provenance(d, "python scripts/experiments/compare_vineppo_ppo_grpo.py")]
    return "\n".join(lines)


def drca_vs_ppo(d: dict) -> str:
    def pair(r, arm, key, other):
        a, b = r[f"{arm}_final_{key}"], r[f"{other}_final_{key}"]
        end = f"**{a:.3f}**" if a > b else f"{a:.3f}"
        return f"{r[f'{arm}_initial_{key}']:.3f} → {end}"

    lines = ["| seed | PPO accuracy | DRCA accuracy | PPO RM reward | DRCA RM reward | minutes PPO / DRCA |",
             "|---|---|---|---|---|---|"]
    for r in d["per_seed"]:
        lines.append(f"| {r['seed']} | {pair(r, 'ppo', 'accuracy', 'drca')} | {pair(r, 'drca', 'accuracy', 'ppo')} | "
                     f"{pair(r, 'ppo', 'reward', 'drca')} | {pair(r, 'drca', 'reward', 'ppo')} | "
                     f"{r['ppo_minutes']:.1f} / {r['drca_minutes']:.1f} |")
    m = lambda k: d[k]["mean"]  # noqa: E731
    lines.append(f"| mean | {m('ppo_final_accuracy'):.3f} | {m('drca_final_accuracy'):.3f} | "
                 f"{m('ppo_final_reward'):.3f} | {m('drca_final_reward'):.3f} | "
                 f"{m('ppo_minutes'):.1f} / {m('drca_minutes'):.1f} |")
    diff = d["drca_minus_ppo_final_accuracy"]
    per_seed = ", ".join(f"{100 * x:+.1f}" for x in diff["per_seed"])
    extra = d.get("extra", [])
    rm = extra[extra.index("--reward_model_path") + 1] if "--reward_model_path" in extra else "builtin:tiny-rm"
    scorer = ("the per-line grader (`--scorer line_grader`)" if "line_grader" in extra else rm)
    flag = next((f for f in ("--beta", "--kl_coef") if f in extra), None)  # --kl_coef: its name before --beta
    kl = f" with the KL coefficient eta = {extra[extra.index(flag) + 1]} (drca.py's default: 0.01)" if flag else ""
    lines += ["", f"Both arms train on the score of {scorer}{kl}; \"RM reward\" is {rm}'s held-out mean normalised score. "
                  f"DRCA minus PPO, final accuracy: {100 * diff['mean']:+.1f} points (per seed {per_seed}); final RM "
                  f"reward: {m('drca_final_reward') - m('ppo_final_reward'):+.3f}. "
              + _provenance(d, f"python scripts/experiments/compare_drca_ppo.py --seeds {' '.join(map(str, d['seeds']))}"
                               + (f" --extra {' '.join(d['extra'])}" if d.get("extra") else ""))]
    return "\n".join(lines)


REPULSE_METHODS = {"reinforce": "REINFORCE (RLOO)", "reward_transform": "REINFORCE, r − e^{−r}",
                   "repulse": "RePULSe"}


def repulse_toy(d: dict) -> str:
    minus = lambda x, f=".2f": format(x, f).replace("-", "−")  # noqa: E731
    lines = ["| method | p updates | final exact log P(bad), per seed | mean | held-out mean reward |",
             "|---|---|---|---|---|"]
    for key, m in d["methods"].items():
        lines.append(f"| {REPULSE_METHODS.get(key, key)} | {m['p_updates']} | "
                     f"{', '.join(minus(x) for x in m['final_log_p_bad'])} | {minus(m['final_log_p_bad_mean'])} | "
                     f"{m['heldout_mean_reward_mean']:.3f} |")
    first = next(iter(d["methods"].values()))
    t = d.get("target")
    gap = -t["log_p_bad_gap_nats (reinforce - repulse)"] if t else 0.0
    lines.append("")
    lines.append(f"{len(first['seeds'])} seeds, {first['samples']:,} samples per run, initial exact log P(bad) "
                 f"{minus(first['initial_log_p_bad'])}."
                 + (f" RePULSe minus REINFORCE, mean final log P(bad): {minus(gap, '+.2f')} "
                    f"nat; held-out reward {100 * t['relative_reward_difference']:.1f}% lower; target met: "
                    f"{'yes' if t['met'] else 'no'}." if t else "")
                 + " Flags of every run: `" + " ".join(d["common_flags"]) + "`. "
                 + _provenance(d, "python scripts/experiments/repulse_toy.py"))
    return "\n".join(lines)


def repulse_toy_paper(d: dict) -> str:
    """scripts/experiments/repulse_toy.py --paper: per config, final exact log P(bad) per seed, held-out mean reward, and the
    goal against REINFORCE seed by seed (>= 1 nat lower at mean reward within 5%)."""
    minus = lambda x, f=".2f": format(x, f).replace("-", "−")  # noqa: E731
    lines = ["| config | p updates | final exact log P(bad), per seed | mean | held-out mean reward | "
             "REINFORCE minus this, per seed (nats) | goal met on every seed |", "|---|---|---|---|---|---|---|"]
    for name, runs in d["runs"].items():
        if not runs:
            lines.append(f"| {name} | - | not run yet | - | - | - | - |")
            continue
        seeds = sorted(runs, key=int)
        lpb = [runs[s]["final_log_p_bad"] for s in seeds]
        rew = [runs[s]["heldout_mean_reward"] for s in seeds]
        g = d["goal"].get(name)
        gaps = ", ".join(minus(g["per_seed"][s]["log_p_bad_gap_nats (reinforce - this)"], "+.2f")
                         for s in g["seeds_compared"]) if g and g["seeds_compared"] else "-"
        met = ("yes" if g["met_on_every_seed"] else "no") if g and g["seeds_compared"] else "-"
        lines.append(f"| {name} | {runs[seeds[0]]['p_updates']} | {', '.join(minus(x) for x in lpb)} | "
                     f"{minus(sum(lpb) / len(lpb))} | {sum(rew) / len(rew):.3f} | {gaps} | {met} |")
    first = next((r for runs in d["runs"].values() for r in runs.values()), None)
    status = "complete" if d["complete"] else f"incomplete, {len(d['pending'])} runs pending"
    machines = finishing_machines(d)
    where = ("Runs finished on " + "; ".join(f"{m}: {n}" for m, n in machines.items()) + ". ") if machines else ""
    lines += ["", (f"Seeds {', '.join(map(str, d['settings']['seeds']))}, {first['samples']:,} samples per run, initial "
                   f"exact log P(bad) {minus(first['initial_log_p_bad'])}; " if first else "")
              + f"{status}. Flags of every run: `{shlex.join(d['settings']['common_flags'])}`. " + where
              + "Last invocation: " + _provenance(d, "python scripts/experiments/repulse_toy.py --paper")]
    return "\n".join(lines)


def finishing_machines(d: dict) -> dict[str, int]:
    """repulse_toy --paper: how many runs each machine finished (a run's finished_under names its device, or the time
    of the invocation whose env does), with torch's version, e.g. {"CPU AMD EPYC x2 (torch 2.13.0+cpu)": 22}."""
    envs = {(inv.get("env") or {}).get("time"): inv.get("env") or {} for inv in d.get("invocations", [])}
    count: dict[str, int] = {}
    for runs in d["runs"].values():
        for r in runs.values():
            by = r.get("finished_under") or {}
            env = envs.get(by.get("invocation_time"), {})
            device = by.get("device") or env.get("device") or "machine not recorded"
            key = f"{device} (torch {env['torch']})" if env.get("torch") else device
            count[key] = count.get(key, 0) + 1
    return count


def repulse_toy_cost(d: dict) -> str:
    """scripts/benchmarks/repulse_toy_cost.py: the toy's step and evaluation pieces timed on one model, a run's cost computed."""
    st, sec = d["settings"], d["seconds"]
    lines = ["| piece | seconds |", "|---|---|",
             f"| sample N = {st['num_samples']} completions of 2 tokens (HF backend) | {sec['generate']:.2f} |",
             f"| one forward + backward over them and an AdamW step | {sec['train']:.2f} |",
             f"| exact log P(bad) ({st['vocab']:,}-token vocabulary, {st['bad_tokens']:,} bad tokens) | "
             f"{sec['exact_log_p_bad']:.1f} |"]
    h, b = d["per_run_hours"], d["budget"]
    lines += ["", f"{st['model']}, fp32, prompt of {st['prompt_tokens']} tokens; exact log P(bad): {d['exact_how']}. "
                  f"Computed from these: a REINFORCE run ({b['p_updates_reinforce']} p updates, {b['exact_evaluations']} "
                  f"exact evaluations) {h['reinforce']:.1f} h, a RePULSe run ({b['steps_repulse']} steps of p and q) "
                  f"{h['repulse']:.1f} h, the paper sweep's 10 configurations {d['sweep']['hours_per_seed']:.0f} h per "
                  f"seed, {d['sweep']['hours_3_seeds']:.0f} h for 3 seeds (estimates from timed pieces, not a timed "
                  f"run). " + _provenance(d, "python scripts/benchmarks/repulse_toy_cost.py")]
    return "\n".join(lines)


def memory_estimate(d: dict) -> str:
    """scripts/benchmarks/estimate_memory.py: estimated peak GPU memory of one GRPO process (arithmetic, not measured)."""
    st = d["settings"]
    by = {(r["model"], r["micro_batch"], r["lora_r"], r["lean_logprobs"]): r for r in d["rows"]}
    lora = st["lora_r"]
    lines = ["| model (parameters) | micro-batch | full fine-tuning, full logits (the old log-probs) | full fine-tuning, lean "
             f"log-probs | LoRA r={lora}, lean log-probs | of which logits (full / lean) | of which activations |",
             "|---|---|---|---|---|---|---|"]
    for (model, b, r, lean), row in by.items():
        if r or lean:
            continue
        full, lean_row, lora_row = row, by[(model, b, 0, True)], by[(model, b, lora, True)]
        lines.append(f"| {model} ({row['params'] / 1e9:.2f} B) | {b} | {full['total_gb']:.0f} GB | "
                     f"{lean_row['total_gb']:.0f} GB | {lora_row['total_gb']:.0f} GB | "
                     f"{full['terms_gb']['logits']:.0f} / {lean_row['terms_gb']['logits']:.1f} GB | "
                     f"{full['terms_gb']['activations']:.1f} GB |")
    lines += ["", f"**Estimates, computed, not measured**: one GPU, sequences of {st['seq_len']} tokens "
                  f"({st['completion_len']} completion), {st['num_completions']} completions generated at once (KV "
                  f"cache), gradient checkpointing {'on' if st['gradient_checkpointing'] else 'off'}, bf16 weights "
                  f"with fp32 master weights, fp32 gradient accumulation and Adam, beta {st['beta']} (no reference "
                  f"copy), a colocated vLLM copy, lean log-probs in chunks of {st['logits_chunk']:,} tokens. "
                  f"`{d['command'].strip()}` (formulas in its docstring)"
                  f"{ran_with(d)}."]
    return "\n".join(lines)


def memory_measured(d: dict) -> str:
    """estimate_memory.py --compare: the trainer-alone estimate of each configuration gpu_bench.py measured."""
    lines = ["| model | micro-batch x tokens | measured peak | estimate | estimate / measured | of which training "
             "state (24 bytes per parameter) |", "|---|---|---|---|---|---|"]
    for r in d["compare"]["rows"]:
        lines.append(f"| {r['model']} | {r['micro_batch']} x {r['seq_len']:,} | {r['measured_gib']:.2f} GiB | "
                     f"{r['estimate_gib']:.2f} GiB | {r['estimate_gib'] / r['measured_gib']:.2f} | "
                     f"{r['training_state_gib']:.2f} GiB |")
    lines += ["", f"Measured: `torch.cuda.max_memory_allocated()` of the trainer alone (no vLLM engine, no reference), "
                  f"from `{d['compare']['file']}` (scripts/benchmarks/gpu_bench.py); estimate: the same configuration by the formulas "
                  f"of scripts/benchmarks/estimate_memory.py without the engine's terms. `{d['command'].strip()}`"
                  f"{ran_with(d)}."]
    return "\n".join(lines)


def gpu_bench(d: dict) -> str:
    """scripts/benchmarks/gpu_bench.py: GRPO training steps and HF-backend generation on one GPU, bf16."""
    env, st = d["env"], d["settings"]
    lines = ["| model (parameters) | micro-batch x tokens | step time | tokens/s | MFU (datasheet peak) | MFU (measured "
             "matmul peak) | peak memory |", "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        for t in r.get("train", []):
            head = f"| {r['model']} ({r['parameters'] / 1e9:.2f} B) | {t['micro_batch']} x {t['seq_len']:,} | "
            if "oom" in t:
                lines.append(head + "out of memory | | | | |")
                continue
            lines.append(head + f"{1000 * t['step_s']:.0f} ms | {t['tokens_per_s']:,.0f} | {pct(t['mfu_datasheet'])} | "
                         f"{pct(t['mfu_measured_matmul'])} | {t['peak_allocated_gib']:.1f} GiB |")
    lines += ["", "| model | HF generation: prompts x samples x new tokens | seconds | tokens/s | peak memory |",
              "|---|---|---|---|---|"]
    for r in d["results"]:
        g = r.get("generate") or {}
        if "tokens_per_s" in g:
            lines.append(f"| {r['model']} | {g['prompts']} x {g['samples']} x {g['new_tokens']} ({g['prompt_len']}-token "
                         f"prompts) | {g['seconds']:.1f} | {g['tokens_per_s']:,.0f} | {g['peak_allocated_gib']:.1f} GiB |")
    attn = sorted({r.get("attention", "?") for r in d["results"]})
    lines += ["", f"{env['gpu']} ({env['gpu_memory_gib']:.0f} GiB), bf16, attention {', '.join(attn)}; a bf16 8192^3 "
                  f"matmul ran at {env['matmul_bf16_tflops']:.0f} TFLOP/s (datasheet {env['datasheet_bf16_tflops']}). "
                  f"Training: one micro-batch of {st['seq_len']:,}-token rows ({st['prompt_len']} prompt) per optimizer "
                  f"step, gradient checkpointing on, median of {st['steps']} steps after 2 warm-up steps; peak memory = "
                  f"`max_memory_allocated` (weights and optimizer state included). torch {env['torch']}, transformers "
                  f"{env['transformers']}, deepspeed {env['deepspeed']}. `{d['command']}` (run by scripts/benchmarks/gpu_check.sh)."]
    return "\n".join(lines)


def gpu_tests(d: dict) -> str:
    """The GPU tests' outcome, as scripts/benchmarks/gpu_check.sh stored it in gpu_bench.py's JSON."""
    t = d["tests"]
    lines = ["| test (tests/test_gpu.py) | outcome |", "|---|---|"]
    outcome = {**{n: "passed" for n in t["passed_tests"]}, **{n: "**failed**" for n in t["failed_tests"]}}
    lines += [f"| `{n.split('::', 1)[1]}` | {v} |" for n, v in sorted(outcome.items())]
    lines += ["", f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped; {d['env']['gpu']}: "
                  f"`bash scripts/benchmarks/gpu_check.sh`, which ran `pytest -m gpu` and stored its report "
                  f"with `{d['command']}`."]
    return "\n".join(lines)


def test_suite(d: dict) -> str:
    """scripts/tools/record_test_suite.py: the counts of the recorded run (a subset says so first), its failing tests and
    its 5 slowest tests."""
    c, e = d["counts"], d["env"]
    minutes = lambda t: f"{round(t) // 60} min {round(t) % 60} s"  # noqa: E731
    lines = [f"**A subset, not the whole suite**: pytest args `{shlex.join(d['pytest_args'])}`.", ""] \
        if d["pytest_args"] else []
    errors = f", {c['errors']} errors" if c["errors"] else ""
    lines.append(f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped{errors} in "
                 f"{minutes(d['total_time_s'])}, exit status {d['exit_status']}, load average "
                 f"{e['loadavg_at_start'][0]:.1f} at the start and {e['loadavg_at_end'][0]:.1f} at the end: "
                 + _provenance(d, "python scripts/tools/record_test_suite.py"))
    changed = d["uncommitted_changes"]
    if changed:
        more = f" and {len(changed) - 10} more (listed in the file)" if len(changed) > 10 else ""
        lines += ["", f"The tested tree had uncommitted changes in {len(changed)} tracked files: "
                  + ", ".join(f"`{f}`" for f in changed[:10]) + more + "."]
    if d["failing"]:
        lines += ["", "Failing:", ""]
        lines += [f"- `{f['test']}` ({f['outcome']}): {f['message'][:200].replace('`', chr(39))}" for f in d["failing"]]
    lines += ["", "| slowest test | seconds |", "|---|---|"]
    lines += [f"| `{t['test'].replace('|', chr(92) + '|')}` | {t['time_s']:.1f} |" for t in d["slowest"][:5]]
    return "\n".join(lines)


def test_suite_brief(d: dict) -> str:
    """README's lines for scripts/tools/record_test_suite.py: `test_suite`'s text without its slowest tests (the counts,
    provenance, a subset or uncommitted files if any) and the failing tests by name (docs/running.md has them all)."""
    first = test_suite({**d, "failing": [], "slowest": []}).split("\n\n| slowest")[0]
    failing = [f"`{f['test']}` ({f['outcome']})" for f in d["failing"]]
    return first + ("\n\nFailing: " + ", ".join(failing) + "." if failing else "")


def drca_localisation(d: dict) -> str:
    """scripts/experiments/drca_localisation.py: the share of held-out slips whose lowest DRCA credit is the slipped line."""
    st = d["settings"]
    per_line = sorted({k for r in d["rows"] for k in r.get("per_slipped_line", {})}, key=int)
    lines = ["| counterfactual | slips located (`eval/localisation`) | a line picked at random |"
             + "".join(f" slip at line {int(k) + 1} |" for k in per_line), "|---|---|---|" + "---|" * len(per_line)]
    lines += [f"| `{r['counterfactual']}` | {r['localisation']:.3f} | {r['chance']:.3f} |"
              + "".join(f" {r['per_slipped_line'][k]:.3f} |" for k in per_line) for r in d["rows"]]
    acc = st.get("reward_model_heldout_pair_accuracy")
    scorer = ("the per-line grader (`--scorer line_grader`)" if st.get("scorer") == "line_grader"
              else f"reward model {st['reward_model']}"
              + (f" (its own held-out pairwise accuracy {acc:.3f})" if acc is not None else ""))
    lines += ["", f"{st['num_pairs']:,} held-out slip pairs, policy {st['model']}, responses and counterfactuals scored "
                  f"by {scorer}, dataset {st['dataset']}. `{d['command']}`, {d['env']['device']}"
                  f"{ran_with(d)}."]
    return "\n".join(lines)


def calibration_compare(d: dict) -> str:
    """scripts/experiments/compare_calibration.py: the summary-distillation start, grpo.py (accuracy reward) and calibration.py,
    held-out accuracy, ECE, Brier and log-loss by the built-in reader: mean (min-max) over seeds."""
    names = {"start": f"start (`{d['start']}`, no RL)", "grpo": "grpo.py, accuracy reward",
             "calibration": "calibration.py, the reader's log-score"}
    keys = ("accuracy", "ece", "ece_20eq", "brier", "brier_multi", "log_loss")

    def cell(arm: str, mode: str, key: str) -> str:
        xs = [r[mode][key] for r in d["runs"][arm].values()]
        return f"{sum(xs) / len(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if len(xs) > 1 else f"{xs[0]:.3f}"

    lines = []
    for mode, what in (("sampled", "one sample per prompt at T = 1"), ("greedy", "greedy")):
        lines += [f"| arm ({mode}) | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {names[arm]} | " + " | ".join(cell(arm, mode, k) for k in keys) + " |" for arm in names]
        lines.append("")
    seeds = ", ".join(map(str, d["seeds"]))
    train = "; ".join(f"`{c}`" for c in d["train_commands"].values())
    seeds = f"seeds {seeds}, mean (min-max)" if len(d["seeds"]) > 1 else f"seed {seeds}"
    lines.append(f"500 held-out prompts; {seeds}; {d['total_episodes']:,} episodes per run. "
                 f"Trained by {train}. `{d['command']}`, {d['env']['device']}.")
    return "\n".join(lines)


def tools_compare(d: dict) -> str:
    """scripts/experiments/compare_tools.py: grpo_tools.py (calculator) against grpo.py (no tool) on builtin:sums-10 at equal
    episodes: held-out accuracy before and after, mean (min-max) over seeds; the tools arm's call statistics."""
    def spread(arm: str, key: str) -> str:
        xs = [r[key] for r in d["runs"] if r["arm"] == arm]
        return f"{sum(xs) / len(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})" if len(xs) > 1 else f"{xs[0]:.3f}"

    names = {"tools": "grpo_tools.py, calculator", "no_tool": "grpo.py, no tool"}
    arms = [a for a in names if any(r["arm"] == a for r in d["runs"])]
    lines = ["| arm | seeds | held-out accuracy at the start | after training | minutes per run |", "|---|---|---|---|---|"]
    for arm in arms:
        runs = [r for r in d["runs"] if r["arm"] == arm]
        minutes = [r["minutes"] for r in runs if r["minutes"] is not None]
        mins = f"{sum(minutes) / len(minutes):.1f}" if minutes else "n/a"
        lines.append(f"| {names[arm]} | {', '.join(str(r['seed']) for r in runs)} | {spread(arm, 'start_accuracy')} | "
                     f"{spread(arm, 'final_accuracy')} | {mins} |")
    if arms == list(names):  # both arms: the difference of the final accuracies, seed by seed
        final = {(r["arm"], r["seed"]): r["final_accuracy"] for r in d["runs"]}
        diff = [100 * (final["tools", s] - final["no_tool", s]) for s in d["seeds"] if ("no_tool", s) in final]
        lines.append(f"| calculator minus no tool, after training (seeds with both arms) | | | "
                     f"{sum(diff) / len(diff):+.1f} points ({min(diff):+.1f} to {max(diff):+.1f}) | |")
    if "tools" in arms:
        t = d["tools"]
        lines += ["", "| tools arm, over training (mean of the steps of a run; mean (min-max) over seeds) | value |",
                  "|---|---|"]
        for key, what in (("tools/wellformed_frac", "well-formed calls / all calls"),
                          ("tools/calls_per_episode", "calls per episode")):
            x = t[key]
            lines.append(f"| {what} | {x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f}) |")
        first = [r["train"][0] for r in d["runs"] if r["arm"] == "tools"]
        last = [r["train"][-1] for r in d["runs"] if r["arm"] == "tools"]
        for key, what in (("tools/wellformed_frac", "well-formed calls, first step -> last step"),
                          ("tools/calls_per_episode", "calls per episode, first step -> last step")):
            a, b = (sum(x[key] for x in xs) / len(xs) for xs in (first, last))
            lines.append(f"| {what} | {a:.3f} -> {b:.3f} |")
    cmds = "; ".join(f"`{r['command']}`" for r in d["runs"] if r["seed"] == d["seeds"][0])
    lines += ["", f"`{d['task']}`, 500 held-out prompts, 4 samples each at T = 1; {d['total_episodes']:,} sampled "
                  f"episodes per run. Runs: {cmds} (grpo.py from the no-tool SFT start `{d['no_tool_start']}`). "
                  f"`{d['command']}`, {d['env']['device']}."]
    return "\n".join(lines)


def sums_calibration(d: dict) -> str:
    """scripts/experiments/calibrate_sums.py: sampled held-out accuracy of builtin:sums-N after the SFT recipe, per N."""
    lines = ["| task | steps per response | held-out accuracy after SFT | minutes |", "|---|---|---|---|"]
    several_seeds = len({r["seed"] for r in d["runs"]}) > 1
    for r in sorted(d["runs"], key=lambda r: (r["terms"], r["seed"])):
        name = "builtin" if r["terms"] == 4 else f"builtin:sums-{r['terms']}"
        seed = f" (seed {r['seed']})" if several_seeds else ""
        lines.append(f"| `{name}`{seed} | {r['terms'] - 1} | {r['final_accuracy']:.3f} | {r['minutes']:.1f} |")
    lines += ["", f"sft.py's default recipe from `builtin:tiny` on each task, with `--max_new_tokens 3N`; sampled (T = 1, "
                  f"one sample) accuracy on the 500 held-out problems. `{d['command']}`, {d['env']['device']}"
                  f"{ran_with(d)}."]
    return "\n".join(lines)


def packing(d: dict) -> str:
    """bench_packing.py: grpo.py's log-prob and training phase times per --micro_batching layout."""
    st, c, r = d["settings"], d["contenders"], d["ratios"]
    span = lambda x: f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})"  # noqa: E731
    ratio = lambda k: f"{r[k]['median']:.2f} ({r[k]['min']:.2f}-{r[k]['max']:.2f})" if k in r else "1"  # noqa: E731
    lines = ["| `--micro_batching` | logprob phase, s | train phase, s | whole step, s | generate phase, s (the same "
             "work in every layout) | logprob / padded | train / padded | step / padded | peak RSS |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ("padded", "sorted", "packed"):
        x = c[name]
        lines.append(f"| `{name}` | {span(x['logprob_s'])} | {span(x['train_s'])} | {span(x['step_s'])} | "
                     f"{span(x['generate_s'])} | {ratio(f'{name}/padded logprob')} | {ratio(f'{name}/padded train')} | "
                     f"{ratio(f'{name}/padded step')} | "
                     f"{'-' if x['peak_rss_mb']['max'] is None else format(x['peak_rss_mb']['max'], ',.0f') + ' MB'} |")
    p = c["padded"]
    load = max(d["env"]["loadavg_at_start"][0], d.get("loadavg_at_end", [0])[0])
    load = (f"1-minute load average at most {load:.1f}" if "note" not in d["env"] else
            "summarised afterwards from the runs kept by an interrupted run (`--from_runs`), 1-minute load average "
            f"{d['env']['loadavg_at_start'][0]:.1f} then; no peak RSS")
    lines += ["", f"Phase and step times: median (min-max) over the {p['train_s']['n']} timed steps of "
                  f"{st['repeats']} repeats (the first step of each run dropped); ratios: per repeat, median phase "
                  f"time over `padded`'s in the same repeat, median (min-max) over the repeats. {st['model']}, "
                  f"{st['num_prompts']} prompts x {st['num_generations']} completions of up to "
                  f"{st['max_new_tokens']} new tokens (mean length {p['completion_length_mean']['median']:.0f}, "
                  f"{100 * (1 - p['stop_rate']['median']):.0f}% cut at the limit), {st['num_minibatches']} "
                  f"minibatches x {st['num_iterations']} passes, {st['gradient_accumulation_steps']} micro-batches of "
                  f"{st['micro_batch_size']} per optimizer step, beta {st['beta']:g}; {load}. " + _provenance(d, "python scripts/benchmarks/bench_packing.py")]
    return "\n".join(lines)


def grpo_variants(files: list[dict]) -> str:
    """scripts/experiments/bench_grpo_variants.py: held-out accuracy of each grpo.py variant against the default run, equal
    samples, mean (min-max) over seeds, and each seed's difference to the default run of the same seed. Several files
    (runs of the same start model, the default run in the first) make one table, variants in file order."""
    if len({_start_sha(d) for d in files}) != 1:
        raise SystemExit("grpo_variants: the files started from different builds of builtin:tiny-sft")
    k, res = "eval/accuracy", {name: r for d in files for name, r in d["results"].items()}
    span = lambda x: f"{x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"  # noqa: E731
    base = res.get("default")
    lines = ["| variant | flags | start | final | final - default, per seed | generated samples | at 102,400 generated "
             "| minutes |", "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if base and name != "default":
            diffs = [r["seeds"][s]["final"][k] - base["seeds"][s]["final"][k] for s in r["seeds"] if s in base["seeds"]]
            diff = " / ".join(f"{x:+.3f}" for x in diffs) + f" (better on {sum(x > 0 for x in diffs)} of {len(diffs)})"
        else:
            diff = "-"
        gen = r["generated_samples"]
        lines.append(f"| {name} | `{r['flags'] or '(none)'}` | {span(r['start'][k])} | **{span(r['final'][k])}** | "
                     f"{diff} | {gen['mean']:,.0f} | {span(r['at_equal_generated'])} | {r['minutes']['mean']:.1f} |")
    n = {len(r["seeds"]) for r in res.values()}
    cmd = "python scripts/experiments/bench_grpo_variants.py"
    prov = _provenance(files[0], cmd) if len(files) == 1 else \
        " ".join(f"{', '.join(d['results'])}: {_provenance(d, cmd)}" for d in files)
    lines += ["", f"`eval/accuracy` (500 held-out problems x 4 samples) before training and after 102,400 trained "
                  f"samples (200 steps of 64 prompts x 8 completions), mean (min-max) over {'/'.join(map(str, sorted(n)))} seeds; `at 102,400 "
                  "generated`: at the last evaluation (every 25 steps) before the run had generated 102,400 completions, "
                  "which differs from the final only for dynamic sampling; minutes: wall time of a run on 2 cores "
                  "(shared with other jobs, so upper bounds). " + prov]
    return "\n".join(lines)


def async_bench(d: dict) -> str:
    """scripts/experiments/bench_async.py: grpo.py --async_steps 1 against the synchronous default, step time on this machine
    and held-out accuracy at equal samples over seeds."""
    lines = []
    if "speed" in d:
        sp, c = d["speed"], d["speed"]["contenders"]
        med = lambda x: f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" if x.get("median") is not None else "-"  # noqa: E731
        lines += ["| `--async_steps` | step, s | generate (own time), s | waits for generation, s | train, s | sync, s |",
                  "|---|---|---|---|---|---|"]
        for name in ("sync", "async1"):
            x = c[name]
            lines.append(f"| {x['async_steps']} | {med(x['step_s'])} | {med(x['generate_s'])} | "
                         f"{med(x['generate_wait_s'])} | {med(x['train_s'])} | {med(x['sync_s'])} |")
        r = sp["async1/sync step"]
        st = sp["settings"]
        lines += ["", f"Step time of async over sync, per alternating repeat: {r['median']:.2f} (median; "
                      f"{r['min']:.2f}-{r['max']:.2f} over {r['n']} repeats). Median (min-max) over the timed steps: "
                      f"{st['steps']} steps per run, the first dropped, {st['repeats']} repeats, "
                      f"{st['num_prompts']} prompts x {st['num_generations']} completions of up to "
                      f"{st['max_new_tokens']} tokens, builtin:tiny-sft, no evaluation; with `--async_steps 1` "
                      "`generate` runs in the background, overlapped with training, and only the wait counts in the "
                      "step.", ""]
    variants = [n for n in d.get("learning", {}) if "seeds" in d["learning"][n]]
    if variants and variants != ["sync", "async1"]:  # --variants: one row per run, each async one against its pair
        le, k = d["learning"], "eval/accuracy"
        span = lambda x: f"{x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"  # noqa: E731
        pct = lambda x: "-" if x is None else f"{100 * x['mean']:.2f}%"  # noqa: E731
        num = lambda x: "-" if x is None else f"{x['mean']:.2g}"  # noqa: E731
        masked = any(le[n].get("off_policy_masked_mean") for n in variants)  # DeepSeek-V3.2's mask ran
        lines += ["| variant | flags | start | final | gain - its pair's gain, per seed | mean staleness | "
                  "tokens the TIS cap changed | mean \\|log pi_old - log mu\\| | "
                  + ("completions the off-policy mask dropped | " if masked else "") + "minutes |",
                  "|---|---|---|---|---|---|---|---|" + ("---|" if masked else "") + "---|"]
        for name in variants:
            r = le[name]
            diff = next((v for key, v in le.items() if key.startswith(f"{name}_minus_")), None)
            pair = next((key.split("_minus_")[1][: -len("_gain")] for key in le if key.startswith(f"{name}_minus_")),
                        None)
            cell = "-" if diff is None else (" / ".join(f"{x:+.3f}" for x in diff.values())
                                             + f" (vs {pair}; mean {sum(diff.values()) / len(diff):+.3f})")
            lines.append(f"| {name} | `{r['flags'] or '(none)'}` | {span(r['start'][k])} | **{span(r['final'][k])}** | "
                         f"{cell} | {r['staleness_mean']['mean']:.2f} | {pct(r.get('tis_clipfrac_mean'))} | "
                         f"{num(r.get('sampler_logprob_diff_mean'))} | "
                         + (f"{pct(r.get('off_policy_masked_mean'))} | " if masked else "")
                         + f"{r['minutes']['mean']:.1f} |")
        seeds = sorted({s for n in variants for s in le[n]["seeds"]})
        lines += ["", f"`eval/accuracy` before training and after the default run's 102,400 trained samples (200 steps "
                      f"of 64 prompts x 8 completions), mean (min-max) over seeds {', '.join(seeds)}, the same start "
                      "model for every run; a variant's gain (final - start) minus its pair's, seed by seed (the "
                      "synchronous run at the same settings, or the async run the variant adds a flag to: PAIRS in "
                      "scripts/experiments/bench_async.py); the TIS columns: means over a run's steps, then over seeds (`val/tis_clipfrac`, "
                      "`val/sampler_logprob_diff`)" + (", and the mask's share of all completions (`policy/off_policy_masked`)"
                                                 if masked else "") + "; minutes: a run's wall time (the machine's load: the file's `loadavg_at_end` "
                      "per run)."]
    elif "learning" in d:
        le, k = d["learning"], "eval/accuracy"
        lines += ["| seed | sync: start -> end | async (`--async_steps 1`): start -> end | async gain - sync gain | "
                  "mean staleness |", "|---|---|---|---|---|"]
        for seed, diff in le["async1_minus_sync_gain"].items():
            a, b = le["sync"]["seeds"][seed], le["async1"]["seeds"][seed]
            lines.append(f"| {seed} | {a['start'][k]:.3f} -> {a['final'][k]:.3f} | {b['start'][k]:.3f} -> "
                         f"{b['final'][k]:.3f} | {diff:+.3f} | {b['staleness_mean']:.2f} |")
        fa, fb = le["sync"]["final"][k], le["async1"]["final"][k]
        lines += [f"| mean (min-max) | -> {fa['mean']:.3f} ({fa['min']:.3f}-{fa['max']:.3f}) | -> {fb['mean']:.3f} "
                  f"({fb['min']:.3f}-{fb['max']:.3f}) | {fb['mean'] - fa['mean']:+.3f} (final) | |", "",
                  "The default run (102,400 samples, 200 steps) and the same with `--async_steps 1`, same seeds and "
                  "start model; the sync runs are those of the variant table (the same command, reused)."]
    lines += ["", _provenance(d, "python scripts/experiments/bench_async.py")]
    return "\n".join(lines)


def mismatch_bench(d: dict) -> str:
    """scripts/experiments/bench_mismatch.py: the mismatch corrections under one update of staleness, DPPO and MaxRL in sync,
    each against its baseline, over seeds."""
    if "real_model" in d:  # --real_model: the diagnostics of a sync and an async run of SmolLM2, step by step
        sync, stale = d["real_model"]["grpo"]["steps"], d["real_model"]["grpo_async"]["steps"]
        g = lambda r, key: "-" if r is None or key not in r else f"{r[key]:.3g}"  # noqa: E731
        g5 = lambda r, key: "-" if r is None or key not in r else f"{r[key]:.5g}"  # noqa: E731
        share = lambda r, key: "-" if r is None or key not in r else f"{100 * r[key]:.2g}%"  # noqa: E731
        lines = ["| step | KL(mu, pi_old): sync | async | mean abs log rho: sync | async | rho p99: sync | async | "
                 "rho min-max: sync | async | tokens truncated: sync | async |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        by_step = {r["step"]: r for r in stale}
        for r in sync:
            x = by_step.get(r["step"])
            lines.append(f"| {r['step']} | {g(r, 'val/sampler_kl')} | {g(x, 'val/sampler_kl')} | "
                         f"{g(r, 'val/sampler_logprob_diff')} | {g(x, 'val/sampler_logprob_diff')} | "
                         f"{g5(r, 'val/tis_ratio_p99')} | {g5(x, 'val/tis_ratio_p99')} | {g5(r, 'val/tis_ratio_min')}-"
                         f"{g5(r, 'val/tis_ratio_max')} | {g5(x, 'val/tis_ratio_min')}-{g5(x, 'val/tis_ratio_max')} | "
                         f"{share(r, 'val/tis_clipfrac')} | {share(x, 'val/tis_clipfrac')} |")
        return "\n".join(lines + ["", f"sync: `{d['real_model']['grpo']['command']}`; async: the same with "
                                       "algorithms/grpo_async.py (one update stale from step 2 on). " +
                                   _provenance(d, "python scripts/experiments/bench_mismatch.py --real_model")])
    v, k = d["variants"], d.get("final_minus_baseline", {})
    span = lambda x: f"{x['mean']:.3f} ({x['min']:.3f}-{x['max']:.3f})"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x['mean']:.2g}"  # noqa: E731
    share = lambda x: "-" if x is None else f"{100 * x['mean']:.2f}%"  # noqa: E731
    lines = ["| variant | script and flags | start | final | final - its baseline's, per seed | KL(mu, pi_old) | "
             "rho p99 | tokens corrected | completions corrected | grad norm | minutes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in v.items():
        diff = k.get(name)
        cell = "-" if not diff else (" / ".join(f"{x:+.3f}" for x in diff.values())
                                     + f" (vs {r['baseline']}; mean {sum(diff.values()) / len(diff):+.3f})")
        lines.append(f"| {name} | `{r['command']}` | {span(r['start'])} | **{span(r['final'])}** | {cell} | "
                     f"{num(r.get('val/sampler_kl_mean'))} | {num(r.get('val/tis_ratio_p99_mean'))} | "
                     f"{share(r.get('val/tis_clipfrac_mean'))} | {share(r.get('val/tis_seq_clipfrac_mean'))} | "
                     f"{num(r.get('optim/grad_norm_mean'))} | {r['minutes']['mean']:.1f} |")
    seeds = sorted({s for r in v.values() for s in r["seeds"]})
    lines += ["", f"`eval/accuracy` before training and after the default run's 102,400 trained samples, mean (min-max) "
                  f"over seeds {', '.join(seeds)}, one start model; the mismatch columns: means over a run's steps, then "
                  "over seeds (`val/sampler_kl`, `val/tis_ratio_p99`, `val/tis_clipfrac`, `val/tis_seq_clipfrac`, "
                  "`optim/grad_norm`); "
                  "minutes: a run's wall time (the machine's load: `loadavg_at_end` per run in the file).", ""]
    earlier = {}  # rows copied from an earlier summary (--reuse), grouped by where they were measured
    for name, r in v.items():
        if "measured_in" in r:
            m = r["measured_in"]
            earlier.setdefault((m["file"], m.get("git_commit"), m.get("time")), []).append(name)
    said = "".join(f"{', '.join(names)}: measured in {file} on the same start model, copied with `--reuse`; "
                   for (file, sha, when), names in earlier.items())
    lines.append((f"{said}the other rows and the file: " if earlier else "")
                 + _provenance(d, "python scripts/experiments/bench_mismatch.py"))
    return "\n".join(lines)

def bon(d: dict) -> str:
    """docs/genrm.md: best-of-N with every verifier on the same policy samples (scripts/experiments/bench_bon.py). Selectors that do
    not depend on the verifier's training seed (first sample, majority vote, pass@N) are one number; the others are
    the mean (min to max) over the seeds."""
    seeds = list(d["seeds"].values())
    ks = d["k"]
    one = lambda key: f"{seeds[0]['metrics'][key]:.3f}" if key in seeds[0]["metrics"] else "n/a"  # noqa: E731

    def spread(key: str) -> str:
        xs = [s["metrics"][key] for s in seeds if key in s["metrics"]]
        if not xs:
            return "not measured"
        return f"{sum(xs) / len(xs):.3f} ({min(xs):.3f} to {max(xs):.3f})"

    names = {"rm": "rm.py Bradley-Terry RM", "genrm_direct": "GenRM direct", "genrm_cot": "GenRM-CoT",
             "implicit_prm": "implicit PRM (min over lines)"}
    lines = ["| selector | " + " | ".join(f"N = {k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|",
             "| first sample | " + " | ".join(one("eval/pass@1") for _ in ks) + " |",
             "| majority vote | " + " | ".join(one(f"eval/maj@{k}") for k in ks) + " |"]
    for v in d["verifiers"]:
        lines.append(f"| best-of-N, {names.get(v, v)} | " + " | ".join(spread(f"eval/bon/{v}@{k}") for k in ks) + " |")
    for v in d["verifiers"]:
        lines.append(f"| weighted vote, {names.get(v, v)} | "
                     + " | ".join(spread(f"eval/wvote/{v}@{k}") for k in ks) + " |")
    if "implicit_prm" not in d["verifiers"]:
        lines.append("| best-of-N, implicit PRM | " + " | ".join("not measured" for _ in ks) + " |")
    lines.append("| pass@N (ceiling) | " + " | ".join(one(f"eval/pass@{k}") for k in ks) + " |")
    k = max(ks)
    first, ceiling = seeds[0]["metrics"]["eval/pass@1"], seeds[0]["metrics"][f"eval/pass@{k}"]
    closed = []
    for v in d["verifiers"]:
        xs = [(s["metrics"][f"eval/bon/{v}@{k}"] - first) / (ceiling - first) for s in seeds
              if f"eval/bon/{v}@{k}" in s["metrics"]]
        if xs and ceiling > first:
            closed.append(f"{names.get(v, v)} {sum(xs) / len(xs):+.2f} ({min(xs):+.2f} to {max(xs):+.2f})")
    lab = d.get("labelled")
    task = f"`{' '.join(d['extra'])}`" if d.get("extra") else "the built-in task"
    flags = [f"`{' '.join(d[key])}` for {script}" for key, script in (("train_flags", "genrm.py"), ("rm_flags", "rm.py"),
             ("implicit_prm_flags", "implicit_prm.py")) if d.get(key)]
    mm = lambda xs: f"{sum(xs) / len(xs):.3f} ({min(xs):.3f} to {max(xs):.3f})"  # noqa: E731
    lines += ["", f"{d['num_prompts']} held-out prompts of {task} x {d['num_samples']} samples of "
                  f"`{d['policy']}` at T = 1 (the same samples for every seed); best-of-N and votes in the "
                  f"{d['num_samples']} // N disjoint blocks of N, averaged; "
                  + (f"every verifier trained on the same {lab['num_rows']:,} graded samples of the policy "
                     f"({lab['prompts']} training prompts x {lab['num_rows'] // lab['prompts']}, {lab['num_correct']:,} "
                     f"correct), rm.py on their {lab['num_pairs']:,} (correct, incorrect) pairs of one prompt, "
                     if lab else "verifiers trained by their default runs ")
                  + f"with seeds {', '.join(d['seeds'])}" + (f" ({'; '.join(flags)})" if flags else "")
                  + (f"; the Bradley-Terry RM is `{d['rm_path']}` for every seed" if d.get("rm_path") else "")
                  + f". Fraction of the gap first sample -> pass@{k} closed at N = {k}: "
                  + ("; ".join(closed) or "none") + ". " + _provenance(d, "python scripts/experiments/bench_bon.py")]
    learned = [v for v in d["verifiers"] if v.startswith("genrm") and all(v in s.get("learning", {}) for s in seeds)]
    if learned:  # the verifiers' own runs: held-out AUROC and p(Yes) by label, first -> last evaluation
        lines += ["", "| genrm.py run | AUROC: start -> end | p(Yes) correct, end | p(Yes) incorrect, end | minutes (run clock) |",
                  "|---|---|---|---|---|"]
        for v in learned:
            get = lambda key, i: [s["learning"][v][key][i] for s in seeds]  # noqa: E731
            mins = [s["train_minutes"][v] for s in seeds if v in s.get("train_minutes", {})]
            lines.append(f"| `python algorithms/genrm.py{' --verifier cot' if v == 'genrm_cot' else ''}"
                         f"{' --data_path <the shared rows>' if lab else ''}` | "
                         f"{sum(get('eval/auroc', 0)) / len(seeds):.3f} -> {mm(get('eval/auroc', 1))} | "
                         f"{mm(get('eval/p_yes_correct', 1))} | {mm(get('eval/p_yes_incorrect', 1))} | "
                         f"{(sum(mins) / len(mins)) if mins else float('nan'):.1f} |")
    end = lambda v, key: [s["learning"][v][key][1] for s in seeds]  # noqa: E731
    others = []
    if all("rm" in s.get("learning", {}) for s in seeds):
        others.append(f"rm.py's pair accuracy {mm(end('rm', 'eval/accuracy'))}")
    if all("implicit_prm" in s.get("learning", {}) for s in seeds):
        start = seeds[0]["learning"]["implicit_prm"]["eval/loss"][0]
        others.append(f"the implicit PRM's CE loss {start:.3f} -> {mm(end('implicit_prm', 'eval/loss'))}, accuracy "
                      f"(sign of r) {mm(end('implicit_prm', 'eval/acc'))}, dpo_acc (pairs of one prompt; 0.5 for a "
                      f"prompt whose samples share a label) {mm(end('implicit_prm', 'eval/dpo_acc'))}, mean r of the "
                      f"correct / incorrect rows {mm(end('implicit_prm', 'eval/reward_correct'))} / "
                      f"{mm(end('implicit_prm', 'eval/reward_incorrect'))}")
    if others:
        held = ("a 10% slice of the labelled rows that they hold out, split by row, not by prompt: a prompt's other "
                "samples are mostly trained on") if lab else "their own held-out data"
        lines += ["", f"Held-out metrics of the verifiers' own runs at the end of training (on {held}): "
                      + "; ".join(others) + "."]
    return "\n".join(lines)


def tuning(d: dict) -> str:
    """scripts/tools/tune.py --result_dir: every trial of the search, the best flags against the defaults over seeds."""
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from tune import tuning_table

    return tuning_table(d)


def _script_table(script: str, d: dict) -> str:
    """The table that scripts/<kind>/<script>.py's own `render` draws from its stored file (imported when rendered)."""
    import importlib

    sys.path.insert(0, str(next((ROOT / "scripts").glob(f"*/{script}.py")).parent))
    return importlib.import_module(script).render(d)


def opd_memory(d: dict) -> str:
    """scripts/benchmarks/bench_opd_memory.py: peak memory of opd.py's full-distribution losses, whole against chunked."""
    return _script_table("bench_opd_memory", d)


def free_text(d: dict) -> str:
    """scripts/experiments/compare_free_text.py: free-text metrics and judge win rates of the trained models against SFT."""
    return _script_table("compare_free_text", d)


def genrm_fair(d: dict) -> str:
    """scripts/experiments/genrm_fair.py: GenRM against the discriminative baseline on the same samples, within a prompt."""
    return _script_table("genrm_fair", d)


def fp32_lm_head(d: dict) -> str:
    """scripts/experiments/bench_fp32_lm_head.py: val/sampler_kl of grpo.py in bf16 with and without --fp32_lm_head."""
    return _script_table("bench_fp32_lm_head", d)


def opd_self_distillation(d: dict) -> str:
    """scripts/experiments/bench_opd_self_distillation.py: opd.py's self-distillation against grpo.py, equal samples."""
    return _script_table("bench_opd_self_distillation", d)


def unit_rewards_rm(d: dict) -> str:
    """scripts/experiments/compare_unit_rewards.py --part rm: pair accuracy and localisation of the bandit, unit and token RMs."""
    s3 = _spread3
    rows = [("rm.py (bandit, one unit)", d["bandit_rm"], "1"),
            ("unit_rm.py, tau 0.5", d["unit_rm"], None), ("unit_rm.py --tau 0 (token level)", d["token_rm"], None)]
    lines = ["| RM | units per response | held-out pair accuracy | localisation (lowest unit on the slipped line) | "
             "chance |", "|---|---|---|---|---|"]
    for name, r, units in rows:
        loc = s3(r["localisation"]) if "localisation" in r else "- (one unit)"
        chance = f"{r['localisation_chance']['mean']:.3f}" if "localisation_chance" in r else "-"
        units = units or f"{r['units_per_response']['mean']:.2f}"
        lines.append(f"| {name} | {units} | {s3(r['accuracy'])} | {loc} | {chance} |")
    seeds = ", ".join(map(str, d["seeds"]))
    return "\n".join([*lines, "", f"Mean (min-max) over seeds {seeds}. `{d['command']}`, {d['env']['device']}. Data: "
                                   "[unit_rewards_rm.json](results/unit_rewards_rm.json)."])


def unit_rewards_ppo(d: dict) -> str:
    """scripts/experiments/compare_unit_rewards.py --part ppo: held-out accuracy of unit_ppo.py, ppo_rlhf.py and drca.py by
    step; the RMs are --part rm's seed-1 models, or those the file names (`reward_models`, --reward_models builtin)."""
    arms = d.get("arms", ["unit_ppo", "ppo_rlhf", "drca"])
    rms = d.get("reward_models")
    flags = {"drca": ", `--scorer rm`", "unit_ppo_bandit": ", `--reward_placement segment_last_avg`"}
    script = lambda arm: "unit_ppo.py" if arm.startswith("unit_ppo") else f"{arm}.py"  # noqa: E731
    if rms and rms["unit_ppo"].startswith("builtin:"):
        heads = [f"{script(arm)} (`{rms[arm]}`{flags.get(arm, '')})" for arm in arms]
    else:
        heads = [{"unit_ppo": "unit_ppo.py (unit RM)", "ppo_rlhf": "ppo_rlhf.py (bandit rm.py RM)",
                  "drca": "drca.py (same RM, `--scorer rm`)",
                  "unit_ppo_bandit": "unit_ppo.py (unit RM, `--reward_placement segment_last_avg`)"}[arm] for arm in arms]
    lines = ["| rollout step (x 512 completions) | " + " | ".join(heads) + " |", "|---" * (len(arms) + 1) + "|"]
    for i, point in enumerate(d[arms[0]]["curve"]):
        cells = [_spread3(d[a]["curve"][i]["accuracy"]) for a in arms]
        lines.append(f"| {point['step']} | " + " | ".join(cells) + " |")
    seeds = ", ".join(map(str, d["seeds"]))
    path = d.get("_path", "docs/results/unit_rewards_ppo.json")
    return "\n".join([*lines, "", f"Held-out grader accuracy, mean (min-max) over seeds {seeds}. `{d['command']}`, "
                                   f"{d['env']['device']}. Data: [{Path(path).name}]({path.removeprefix('docs/')})."])


RENDERERS = {"unit_rewards_rm": unit_rewards_rm, "unit_rewards_ppo": unit_rewards_ppo, "tuning": tuning, "calibration_compare": calibration_compare, "async_bench": async_bench, "mismatch_bench": mismatch_bench, "grpo_variants": grpo_variants, "real_model_prompts": real_model_prompts, "real_model_grpo": real_model_grpo, "graders": graders,
             "results_overview": results_overview, "hf_memory": hf_memory,
             **{f"headline_{n}": (lambda d, n=n: headline_runs(d, n)) for n in HEADLINE_WHAT},
             "bench_ratios": bench_ratios, "bench_grpo_phases": bench_grpo_phases,
             "bench_vineppo_phases": bench_vineppo_phases, "ppo_vs_vineppo": ppo_vs_vineppo,
             "value_prediction": value_prediction, "vineppo_vs_ppo": vineppo_vs_ppo,
             "vineppo_value_table": vineppo_value_table, "vineppo_plateau": vineppo_plateau, "drca_vs_ppo": drca_vs_ppo, "repulse_toy": repulse_toy,
             "repulse_toy_paper": repulse_toy_paper,
             "memory_estimate": memory_estimate, "drca_localisation": drca_localisation,
             "repulse_toy_cost": repulse_toy_cost,
             "sums_calibration": sums_calibration, "logprob_memory": logprob_memory,
             "lora_learning": lora_learning, "lora_memory": lora_memory, "lora_sync": lora_sync, "optimizer_bench": optimizer_bench, "memory_measured": memory_measured,
             "gpu_bench": gpu_bench, "gpu_tests": gpu_tests, "test_suite": test_suite, "test_suite_brief": test_suite_brief, "restem_vs_grpo": restem_vs_grpo, "prime_vs_grpo": prime_vs_grpo, "packing": packing, "bon": bon,
             "tools_compare": tools_compare, "opd_vs_grpo": opd_vs_grpo, "dpo_losses": dpo_losses,
             "opd_memory": opd_memory, "free_text": free_text,
             "opd_self_distillation": opd_self_distillation, "genrm_fair": genrm_fair,
             "fp32_lm_head": fp32_lm_head}
MULTI = {"dpo_losses", "grpo_variants", "bench_ratios", "results_overview", "lora_learning", "restem_vs_grpo",
         "prime_vs_grpo", "opd_vs_grpo"}  # renderers that read several files (a list of their contents)


# an absolute path into a checkout's runs/ folder, as a benchmark recorded its command: shown from the repository root
MACHINE_PATH = re.compile(r"(?<![\w./-])/(?:[\w.+-]+/)+?runs/")


def renamed_flag(name: str) -> str | None:
    """The new name of a flag that shared/cli.py's RENAMED lists as a plain rename (its entry reads `--NEW is its
    name now`), else None: `kl_coef` -> `beta`; `cliprange` (two flags now) and `async_steps` (another file) -> None."""
    m = re.match(r"--(\w+) is its name now", RENAMED.get(name, ""))
    return m.group(1) if m else None


def script_defaults(script: str) -> dict[str, str]:
    """Flag name -> its default as written in algorithms/<script>.py's Args (a string's value without quotes, a
    Literal default as its value, anything else as its source text)."""
    import ast

    path = ROOT / "algorithms" / f"{script}.py"
    cls = next((n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Args"), None)
    out = {}
    for n in cls.body if cls else []:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            v = n.value
            out[n.target.id] = (str(v.value) if isinstance(v, ast.Constant) else ast.unparse(v)) if v else ""
    return out


def scripts_with(flag: str, op: str | None = None, value: str | None = None) -> list[str]:
    """The algorithms/*.py that have `flag` (op None), with default `value` (op "="), or another default ("!="), in
    SCRIPT_ORDER."""
    names = sorted((p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__"),
                   key=lambda n: (SCRIPT_ORDER.index(n) if n in SCRIPT_ORDER else len(SCRIPT_ORDER), n))
    out = []
    for n in names:
        d = script_defaults(n)
        if flag in d and (op is None or (d[flag] == value) == (op == "=")):
            out.append(f"{n}.py")
    return out


def english_list(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else "(none)"


def script_flags(script: str) -> set[str]:
    """The flag names of algorithms/<script>.py (its Args fields, read from the source); empty for no such file."""
    import ast

    path = ROOT / "algorithms" / f"{script}.py"
    if not path.exists():
        return set()
    cls = next((n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Args"), None)
    return {n.target.id for n in (cls.body if cls else []) if isinstance(n, ast.AnnAssign)}


def current_flags(text: str) -> str:
    """`text` with every stored command's renamed flag written by its name now (`--kl_coef 0` -> `--beta 0`): a
    rendered command must run as shown. Only whole flag words change (`objective/kl_coef` stays), and not a name
    that a script the text names still has (repulse.py's old `--loss_type` is dpo.py's loss: a dpo command keeps it;
    with no script named, a name any script still has stays)."""
    named = set(re.findall(r"(\w+)\.py\b", text)) or {p.stem for p in (ROOT / "algorithms").glob("*.py")}
    kept = set().union(*(script_flags(s) for s in named))

    def sub(m: re.Match) -> str:
        new = None if m.group(2) in kept else renamed_flag(m.group(2))
        return m.group(1) + (new if new else m.group(2))

    return re.sub(r"(?<![\w/-])(--)([a-z][a-z0-9_]*)(?![\w-])", sub, text)


def _data_links(page: Path, sources: list[str], table: str) -> str:
    """The table with a link to each data file it does not name yet, at the end of its caption (the last line)."""
    rel = lambda s: Path(os.path.relpath(ROOT / s, page.parent)).as_posix()  # noqa: E731
    missing = [s for s in sources if s not in table and rel(s) not in table]
    if not missing:
        return table
    links = "Data: " + ", ".join(f"[{Path(s).name}]({rel(s)})" for s in missing) + "."
    last = table.rsplit("\n", 1)[-1]
    return table + ("\n\n" if last.startswith("|") or not last.strip() else " ") + links


def render_file(path: Path) -> tuple[str, str]:
    """(current text, text with every generated block re-rendered)."""
    text = path.read_text()

    def sub(m: re.Match) -> str:
        name, sources = m.group(2), re.split(r",\s*", m.group(3))
        if name not in RENDERERS:
            raise SystemExit(f"error: {path}: unknown table {name!r} (known: {', '.join(RENDERERS)})")
        if name not in MULTI and len(sources) > 1:
            raise SystemExit(f"error: {path}: table {name} reads one file, the block names {len(sources)}")
        data = []
        for source in sources:
            data_path = ROOT / source
            if not data_path.exists():
                raise SystemExit(f"error: {path}: table {name} reads {source}, which does not exist")
            data.append({**json.loads(data_path.read_text()), "_path": source})
        table = current_flags(RENDERERS[name](data if name in MULTI else data[0]))
        return m.group(1) + _data_links(path, sources, MACHINE_PATH.sub("runs/", table)) + "\n" + m.group(5)

    def scripts(m: re.Match) -> str:
        found = scripts_with(m.group(2), m.group(3), m.group(4))
        if not found:
            raise SystemExit(f"error: {path}: no script has {m.group(2)}{m.group(3) or ''}{m.group(4) or ''}")
        return m.group(1) + english_list(found) + m.group(6)

    return text, SCRIPTS_BLOCK.sub(scripts, BLOCK.sub(sub, text))


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
              "(run python scripts/tools/docs_tables.py)", file=sys.stderr)
        sys.exit(1)
    print("up to date" if not stale else f"rewrote {', '.join(map(str, stale))}")


if __name__ == "__main__":
    main()
