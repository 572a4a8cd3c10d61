"""The command line: parsing and validating a script's flags, and running its `main` with one-line errors.

Every script ends with `run_cli(main, Args)`: tyro parses the command line into the flat `Args` dataclass
(parse_cli), check_args validates it before anything is written, and configuration errors are one line
`error: ...` (exit status 2) instead of a traceback.

A numeric flag's allowed range is declared beside it in the script, with annotated_types markers that tyro leaves
alone (--help, parsing and defaults are as for a plain `float` / `int`):

    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    learning_rate: Annotated[float, Gt(0)] = 1e-4
    save_every: Annotated[int, Ge(0)] = 25
    eta: Annotated[float, Interval()] = -1.0  # any real number

check_args reads them (declared_ranges). A numeric flag that declares no range is only checked to be finite, so a
copied script with a new flag runs; tests/test_cli.py checks that every numeric flag of this repository's scripts
declares one.
"""

from __future__ import annotations

import math
import os
import types
import typing
from pathlib import Path

import annotated_types

from shared.distributed import NonFiniteError, end_process_group, exact_div

Range = tuple  # (low, low included, high, high included); None is unbounded


def derive_sizes(args, world_size: int) -> None:
    """The batch sizes of an RL script, from its per-rank flags, into args (saved with it in args.json):
        local_batch_size = local_num_prompts * num_generations    completions per rank per step
        batch_size = local_batch_size * world_size; num_prompts = local_num_prompts * world_size
        local_minibatch_size = local_batch_size / num_minibatches  completions per optimizer step and rank
        gradient_accumulation_steps = local_minibatch_size / local_micro_batch_size
        num_steps = total_episodes // batch_size
    The micro-batch is a memory cap: a minibatch smaller than it is one micro-batch. One-line errors name the flag."""
    args.world_size = world_size
    args.local_batch_size = args.local_num_prompts * args.num_generations
    args.batch_size = args.local_batch_size * world_size
    args.num_prompts = args.local_num_prompts * world_size
    args.local_minibatch_size = exact_div(args.local_batch_size, args.num_minibatches,
                                          "num_minibatches: local_num_prompts * num_generations / num_minibatches")
    args.local_micro_batch_size = min(args.local_micro_batch_size, args.local_minibatch_size)
    args.gradient_accumulation_steps = exact_div(args.local_minibatch_size, args.local_micro_batch_size,
                                                 "local_micro_batch_size: local minibatch / local_micro_batch_size")
    args.num_steps = args.total_episodes // args.batch_size
    if args.num_steps < 1:
        raise ValueError(f"total_episodes: {args.total_episodes} is smaller than one batch ({args.batch_size})")


def _metadata(hint) -> list:
    """The `Annotated[...]` metadata of a type hint, also inside a union (`Annotated[float, Gt(0)] | None`)."""
    if typing.get_origin(hint) is typing.Annotated:
        return [*hint.__metadata__, *_metadata(typing.get_args(hint)[0])]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(hint) for m in _metadata(arg)]
    return []


def _declared_range(hint) -> Range | None:
    """The allowed range its annotated_types markers (Gt, Ge, Lt, Le, Interval) give a field; None without any.
    `Interval()` declares an unbounded range: any (finite) real number. Several bounds on one side: the tightest."""
    bounds, declared = [], False
    for m in _metadata(hint):
        if isinstance(m, annotated_types.Interval):
            declared = True
            bounds += list(m)  # its Gt / Ge / Lt / Le, one per bound given
        elif isinstance(m, (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)):
            declared = True
            bounds.append(m)
    if not declared:
        return None
    low, low_in, high, high_in = None, False, None, False
    for b in bounds:
        if isinstance(b, (annotated_types.Gt, annotated_types.Ge)):
            v, inclusive = (b.gt, False) if isinstance(b, annotated_types.Gt) else (b.ge, True)
            if low is None or v > low or (v == low and not inclusive):
                low, low_in = v, inclusive
        else:
            v, inclusive = (b.lt, False) if isinstance(b, annotated_types.Lt) else (b.le, True)
            if high is None or v < high or (v == high and not inclusive):
                high, high_in = v, inclusive
    return low, low_in, high, high_in


def declared_ranges(args_cls) -> dict[str, Range]:
    """Field name -> (low, low included, high, high included), for every field of an Args class that declares a
    range (None: unbounded on that side)."""
    hints = typing.get_type_hints(args_cls, include_extras=True)
    ranges = {name: _declared_range(hint) for name, hint in hints.items()}
    return {name: rng for name, rng in ranges.items() if rng is not None}


def literal_choices(args_cls) -> dict[str, tuple]:
    """Field name -> allowed values, for every `Literal[...]` field of an Args class."""
    hints = typing.get_type_hints(args_cls)
    return {name: typing.get_args(t) for name, t in hints.items() if typing.get_origin(t) is typing.Literal}


def check_args(args) -> None:
    """Start-up checks of every script's flags, before anything is written: each fixed-choice (`Literal`) flag
    holds one of its choices (tyro checks them on the command line; this guards `Args(...)` built in code), each
    numeric flag is finite and within the range declared beside it (`Annotated[float, Interval(gt=0, le=1)]`: a
    one-line error naming it and the range), `--tis` (a correction) only with `--top_p 1` and `--tis_mask_low`
    below `--tis_cap` (a mask mode's kept range [1/C, C] not empty either), `--prompt_template` with `{prompt}`,
    `best_metric` of the form `name[:min|:max]`, no empty `--stop` string, a built-in dataset name
    (`builtin:sums-N`), and `output_dir` a directory that can be created (`--resume` is checked by
    shared/checkpoint.py's Checkpointer, also before anything is written). Runtime-computed fields (hidden from
    --help) are skipped."""
    import dataclasses

    for name, choices in literal_choices(type(args)).items():
        if getattr(args, name) not in choices:
            raise ValueError(f"{name}: {getattr(args, name)!r} is not one of {', '.join(map(str, choices))}")
    ranges = declared_ranges(type(args))
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if "Suppress" in str(f.type) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name}: must be a finite number, got {value}")
        if f.name not in ranges:
            continue
        low, low_in, high, high_in = ranges[f.name]
        too_low = low is not None and (value < low if low_in else value <= low)
        too_high = high is not None and (value > high if high_in else value >= high)
        if too_low or too_high:
            lo = "-inf" if low is None else f"{low}"
            hi = "inf" if high is None else f"{high}"
            interval = f"{'[' if low_in else '('}{lo}, {hi}{']' if high_in else ')'}"
            raise ValueError(f"{f.name}: must be in {interval}, got {value}")
    tis = getattr(args, "tis", "none")  # the sampler/trainer mismatch correction of the RL scripts
    if tis != "none" and getattr(args, "top_p", 1.0) < 1:
        raise ValueError("top_p: the sampler's log-probs are then those of the renormalised nucleus, the trainer's of the "
                         "whole vocabulary, and --tis would weigh by their ratio (use --top_p 1, or --tis none)")
    if getattr(args, "tis_mask_low", 0.0) >= getattr(args, "tis_cap", float("inf")):
        raise ValueError(f"tis_mask_low: must be below --tis_cap ({args.tis_mask_low} >= {args.tis_cap})")
    if tis.endswith("_mask") and not getattr(args, "tis_mask_low", 0.0) and getattr(args, "tis_cap", 2.0) <= 1:
        raise ValueError(f"tis_cap: a mask keeps ratios in [1/C, C], empty for C = {args.tis_cap} <= 1 (use C > 1, or "
                         "--tis_mask_low below C)")
    if isinstance(getattr(args, "stop", None), (tuple, list)):  # `--stop ""` would cut every text to nothing
        from shared.generation import check_stop_strings

        check_stop_strings(args.stop)
    template = getattr(args, "prompt_template", None)
    if isinstance(template, str) and "{prompt}" not in template:
        raise ValueError(f"prompt_template: must contain {{prompt}}, where each row's prompt goes (got {template!r}: "
                         "every prompt would be the same text)")
    if getattr(args, "best_metric", None) is not None:
        from shared.checkpoint import BestModel

        BestModel.parse(args.best_metric)  # BestModel itself is built after output_dir is written
    dataset = getattr(args, "dataset", None)
    if isinstance(dataset, str) and dataset.startswith("builtin:"):
        from shared.task import num_terms

        num_terms(dataset)  # `builtin:sums-N` with N in range
    out = getattr(args, "output_dir", None)
    if out:
        path = Path(out).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"output_dir: {out} exists and is not a directory")
        parent = next((p for p in [path, *path.parents] if p.exists()), None)
        if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
            raise ValueError(f"output_dir: cannot create {out} ({parent} is not a writable directory)")


# flags of earlier versions: their new name, or the file that has the feature now (README, "Renamed flags")
RENAMED = {
    "num_samples_per_prompt": "--num_generations is its name now",
    "num_ppo_epochs": "--num_iterations is its name now",
    "kl_coef": "--beta is its name now",
    "cliprange": "--epsilon_low and --epsilon_high are its names now (one per side)",
    "base_actor_learning_rate": "--learning_rate is its name now (repulse.py: the policy's, as in every script)",
    "actor_learning_rate": "--proposal_learning_rate is its name now (repulse.py: the proposal's)",
    "loss_type": "--objective is its name now (repulse.py: neg_training or reinforce)",
    # the implicit PRM's scale is --prm_beta in implicit_prm.py and prime.py; not a plain rename (renamed_flag): --beta
    # is the KL coefficient (and DPO's temperature) in every script that has it, opd.py's JSD mix is --jsd_beta
    "beta": "--prm_beta is its name in implicit_prm.py now (the implicit PRM's scale; prime.py's name)",
    # evaluate.py's old names; not plain renames (renamed_flag): scripts/ tools still take --split and --num_prompts
    "split": "--eval_split names evaluate.py's split now, as in the training scripts (training split: --train_split)",
    "num_prompts": ("--eval_num_prompts names evaluate.py's prompt count now, as in the training scripts (prompts per "
                    "step: --local_num_prompts)"),
    "async_steps": "use algorithms/grpo_async.py or algorithms/ppo_async.py (generation overlaps training there)",
    "dynamic_sampling": "use algorithms/dapo.py (DAPO's dynamic sampling)",
    "max_refill_rounds": "use algorithms/dapo.py (DAPO's dynamic sampling)",
    **{name: "use algorithms/ppo_rlhf.py (PPO with a reward model; ppo.py's reward-model flags are there)"
       for name in ("reward_model_path", "critic_model_path", "kl_placement", "adaptive_kl", "kl_target", "kl_horizon",
                    "non_stop_penalty", "penalty_reward_value")},
}


class CommandLineError(Exception):
    """A command line tyro rejected (a value not among a flag's choices, a bad number, an unknown flag)."""


def _rejected(event, args_cls) -> str:
    """One line naming the flag for a tyro parse-error event (tyro._errors: private, hence the getattr defaults)."""
    import dataclasses
    import difflib

    kind = type(event).__name__
    lowered = getattr(getattr(event, "argument", None), "lowered", None)
    flag = "/".join(getattr(lowered, "name_or_flags", None) or ()) or "argument"
    metavar = getattr(lowered, "metavar", None) or "a value"
    if kind == "InvalidChoice":
        return f"{flag}: {event.value!r} is not one of {', '.join(event.choices)}"
    if kind == "InstantiationFailure":  # a value that does not convert (an int, a float)
        return f"{flag}: {str(event.message).splitlines()[0].strip()} (expected {metavar})"
    if kind == "BadValue" and getattr(event, "offending_value", None) is None:
        return f"{flag}: expected {metavar} after it"
    if kind == "BadValue":
        return f"{flag}: takes no value, got {event.offending_value!r}"
    if kind == "UnrecognizedArgs":
        tokens = list(event.tokens)
        flags = [t.split("=")[0] for t in tokens if t.startswith("-")]
        if not flags:
            return f"unexpected argument {tokens[0]!r}; see --help"
        known = [f.name for f in dataclasses.fields(args_cls) if "Suppress" not in str(f.type)]
        known += [f"no_{f.name}" for f in dataclasses.fields(args_cls) if str(f.type) == "bool"]
        name = flags[0].lstrip("-").replace("-", "_")
        if name in RENAMED and RENAMED[name].split()[0].lstrip("-") in known + ["use"]:
            return f"{flags[0]}: {RENAMED[name]} (README, renamed flags)"
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        return f"{flags[0]}: unknown flag" + (f"; did you mean --{close[0]}?" if close else "; see --help")
    return f"the command line was rejected ({kind}); see --help"


def _box_first_paragraph(text: str) -> str:
    """The first paragraph of tyro's error box on one line (used only if tyro stops calling the hook)."""
    rows = []
    for line in text.splitlines()[1:]:
        inner = line.strip().strip("│").strip()
        if not inner or set(inner) <= set("─╰╯"):
            break
        rows.append(inner)
    return " ".join(rows) or "the command line was rejected; see --help"


def parse_cli(args_cls, argv: list[str] | None = None):
    """`tyro.cli(args_cls)` whose rejected command lines raise CommandLineError with one line naming the flag
    (`--loss_type: 'sigmod' is not one of sigmoid, ...`) instead of printing tyro's multi-line error box.

    tyro reports each rejection to a parse-error hook just before printing its box; the hook raises instead. The
    hook API (tyro._errors.on_parse_error) is private, so tyro is pinned (requirements.txt), and should a later
    tyro stop calling it, its box is captured and reduced to its first paragraph. `--help` is untouched."""
    import contextlib
    import io
    import sys

    import tyro

    try:
        from tyro._errors import on_parse_error
    except ImportError:
        on_parse_error = None

    def reject(event):
        raise CommandLineError(_rejected(event, args_cls))

    hook = on_parse_error(reject) if on_parse_error else contextlib.nullcontext()
    captured = io.StringIO()  # tyro's own output on stderr: its error box, or warnings (passed on)
    try:
        with contextlib.redirect_stderr(captured), hook:
            args = tyro.cli(args_cls, args=argv, use_underscores=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise CommandLineError(_box_first_paragraph(captured.getvalue())) from None
        sys.stderr.write(captured.getvalue())
        raise
    sys.stderr.write(captured.getvalue())
    return args


def run_cli(main, args_cls) -> None:
    """`main(parse_cli(Args))` after `check_args`, with a rejected command line (parse_cli), configuration and data
    errors (ValueError, e.g. DataError, a bad flag, a missing model) and a diverged run printed as one line
    `error: ...` (exit status 2) instead of a traceback or tyro's error box. Library INFO/WARNING output is hidden
    unless `--verbose` (shared/console.py). Set CLEANRLHF_TRACEBACK=1 to see the traceback. A run that finishes, or
    stops at a checkpoint after SIGTERM / SIGINT (exit status 143 / 130 kept), ends the process group
    (end_process_group)."""
    import signal
    import sys

    from shared.console import quiet_libraries

    stop_status = None
    try:
        args = parse_cli(args_cls)
        quiet_libraries(getattr(args, "verbose", False))
        check_args(args)
        main(args)
    except (CommandLineError, ValueError, NonFiniteError) as e:
        if os.environ.get("CLEANRLHF_TRACEBACK"):
            raise
        from tqdm.std import tqdm

        for bar in list(getattr(tqdm, "_instances", [])):  # end the progress bar's line first
            bar.close()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SystemExit as e:
        # a stop at a checkpoint after SIGTERM / SIGINT (shared/checkpoint.py): every rank agreed on it and exits
        # here, so the group can be ended as after a finished run; any other exit passes through untouched
        if e.code not in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            raise
        stop_status = e.code
    # Only after a finished or stopped run, where every rank gets here: after an error other ranks may never reach
    # the barrier. Outside the handler above, so a teardown failure is a traceback, not a one-line `error:`.
    end_process_group()
    if stop_status is not None:
        sys.exit(stop_status)
