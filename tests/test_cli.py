"""Every script's `Args`: each field typed, defaulted and documented, and `--help` shows them all;
fixed-choice flags are `Literal`s, and a bad flag is one line `error: ...` (exit status 2) before anything is
written."""

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__")
SHARED_VOCABULARY = ["model_name_or_path", "dataset", "output_dir", "seed", "total_episodes", "learning_rate",
                     "report_to", "project", "verbose", "generator",
                     # reliability flags (shared/checkpoint.py), the same in every script
                     "save_every", "keep_checkpoints", "resume", "stop_after_steps", "max_nonfinite_steps",
                     "best_metric"]
NO_GENERATION = {"rm", "unit_rm"}  # trains on fixed pairs and never samples: no `generator` flag
# evaluate.py and evaluate_text.py train nothing: the data, model and generation vocabulary only (no optimizer,
# checkpoints or tracker)
EVAL_ONLY = {"evaluate", "evaluate_text", "evaluate_gcg"}
EVAL_VOCABULARY = {"model_name_or_path", "dataset", "output_dir", "seed", "verbose", "generator"}
# flags a script names otherwise (none: repulse.py's policy learning rate is --learning_rate as everywhere)
RENAMED: dict[str, dict[str, str]] = {}


def documented_fields(script: str) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the annotated assignment)."""
    tree = ast.parse((ROOT / "algorithms" / f"{script}.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    docs = {}
    for prev, node in zip(cls.body, cls.body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = node.value.value
    return docs


def public_fields(script: str):
    args = importlib.import_module(f"algorithms.{script}").Args
    return [f for f in dataclasses.fields(args) if "Suppress" not in str(f.type)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_is_typed_defaulted_and_documented(script):
    docs = documented_fields(script)
    for f in public_fields(script):
        assert f.default is not dataclasses.MISSING, f"{script}.{f.name} has no default"
        assert docs.get(f.name, "").strip(), f"{script}.{f.name} has no docstring"
    names = {f.name for f in public_fields(script)}
    vocabulary = set(SHARED_VOCABULARY) - ({"generator"} if script in NO_GENERATION else set())
    vocabulary = EVAL_VOCABULARY if script in EVAL_ONLY else vocabulary
    vocabulary = {RENAMED.get(script, {}).get(v, v) for v in vocabulary}
    assert vocabulary <= names, f"{script} misses {vocabulary - names}"
    assert script not in NO_GENERATION or "generator" not in names


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_field(script):
    out = subprocess.run([sys.executable, f"algorithms/{script}.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    for f in public_fields(script):
        assert f"--{f.name}" in out.stdout, f"--{f.name} missing from {script} --help"
    for name, choices in CHOICES[script].items():  # tyro shows a fixed-choice flag as --name {a,b,c}
        assert f"--{name} {{{','.join(choices)}}}" in out.stdout, f"--{name}'s choices missing from {script} --help"
    assert "world_size" not in out.stdout  # runtime-computed fields are hidden


MAX_HELP_CHARS = 130  # a flag's help is one line; longer explanations and measurements belong in docs/<script>.md


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_docstring_is_one_short_line(script):
    """--help stays readable: each field's docstring (its help text) is one line of at most MAX_HELP_CHARS."""
    long = {name: len(doc) for name, doc in documented_fields(script).items()
            if len(doc) > MAX_HELP_CHARS or "\n" in doc}
    assert not long, f"{script}: help longer than {MAX_HELP_CHARS} characters or on several lines: {long}"


# Labels of notes kept outside the repository: pitfall numbers (P7, U6), abbreviations (SFFD for
# vwxyzjn/summarize_from_feedback_details, VINE for the VinePPO code), design-spec sections, issue numbers.
OUTSIDE_LABELS = re.compile(r"\b[PU]\d+\b|\bSFFD\b|\bVINE\b|\bspec §|\.md §|\bissue #\d|\(#\d|#\d+\.\d|"
                            r"building_blocks|pitfalls|style\.md|sft_restem\.md|Tests this implementation should have")
URL = re.compile(r"(https?://|github\.com/)\S+")


def test_scripts_and_shared_cite_no_labels_defined_outside_the_repository():
    """A reader who only has the repository must be able to follow every comment and docstring: no pitfall numbers,
    abbreviations of reference code, spec sections or issue numbers in algorithms/ and shared/ (URLs are skipped)."""
    files = [*sorted((ROOT / "algorithms").glob("*.py")), *sorted((ROOT / "shared").glob("*.py"))]
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)!r}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1)
             for m in OUTSIDE_LABELS.finditer(URL.sub("", line))]
    assert not found, found
    # the pattern catches what it is meant to, and leaves URLs and papers' section numbers alone
    for text in ["(pitfalls P7)", "(SFFD)", "VINE clamp", "(spec §2.7)", "drca.md §2.2", "issue #19", "(#16)",
                 "#16.3:", "building_blocks §5", "style.md S4"]:
        assert OUTSIDE_LABELS.search(URL.sub("", text)), text
    for text in ["https://github.com/org/repo/issues/12#issue-3", "DeepSeekMath §4.1.2", "p_0 and P(bad)",
                 "pytorch/pytorch#190489", "checker: str = 'vine'"]:
        assert not OUTSIDE_LABELS.search(URL.sub("", text)), text


# --- fixed-choice flags: `Literal[...]` fields, checked by the parser ----------------------------------------------
# Every flag whose valid values are a fixed set, with its choices in declaration order. Flags taking a fixed set OR
# free text stay `str` and are checked at start-up: reward_fn (or module:function), resume (or a checkpoint
# directory), best_metric (name[:min|:max]), drca's unit_pattern (or a regex).
GENERATOR = {"generator": ("vllm", "hf")}
LORA_SYNC = {"lora_sync": ("merged", "adapter")}  # the RL scripts with LoRA and a vLLM engine synced in training
TIS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask")  # --tis, every script
CHOICES = {
    "sft": {"generator": ("hf", "vllm"), "loss_reduction": ("seq_mean", "token_mean")},
    "rm": {},
    "dpo": {**GENERATOR, **LORA_SYNC, "loss_type": ("sigmoid", "cdpo", "robust", "hinge", "ipo", "dpop", "simpo", "orpo"),
            "pair_source": ("offline", "self_generated")},
    "kto": {**GENERATOR, **LORA_SYNC, "example_source": ("offline", "self_generated")},
    "grpo": {**GENERATOR, **LORA_SYNC, "advantage_estimator": ("grpo", "rloo", "reinforce_pp_baseline", "maxrl"),
             "advantage_scaling": ("group", "batch", "none"),
             "loss_aggregation": ("seq_mean", "token_mean", "global_token", "constant"),
             "importance_level": ("token", "sequence"), "policy_loss": ("clip", "cispo", "dppo_tv", "dppo_kl", "sapo"),
             "kl_estimator": ("k1", "k2", "k3"), "tis": TIS, "micro_batching": ("padded", "sorted", "packed")},
    "ppo": {**GENERATOR, **LORA_SYNC, "tis": TIS},
    "vineppo": {**GENERATOR, **LORA_SYNC, "step_splitter": ("auto", "lines", "gsm8k", "math"), "tis": TIS},
    "restem": {**GENERATOR, "early_stop": ("restem_paper_original", "choose_best")},
    "repulse": {"generator": ("hf", "vllm"), "objective": ("neg_training", "reinforce"),
                "reward_transform": ("none", "minus_alpha_exp_beta_r")},
    "drca": {**GENERATOR, **LORA_SYNC, "kl_placement": ("reward", "loss"), "tis": TIS,
             "unit_extraction": ("regex", "entropy"), "entropy_boundary": ("before", "after"),
             "entropy_source": ("policy", "reference"), "counterfactual": ("truncate", "mask"),
             "unitless_fallback": ("terminal", "zeros"), "scorer": ("auto", "rm", "line_grader")},
    "evaluate": GENERATOR,
    "evaluate_text": {**GENERATOR, "perplexity_of": ("completion", "reference")},
    "evaluate_gcg": GENERATOR,
    "genrm": {"generator": ("hf", "vllm"), "verifier": ("direct", "cot"), "verdict_format": ("auto", "paper", "short"),
              "loss_type": ("nll", "bce")},
    "implicit_prm": GENERATOR,
}
# the variant files: dapo.py, grpo_tools.py and calibration.py keep grpo.py's choices; the async files generate with
# vLLM only
CHOICES["dapo"] = CHOICES["grpo"]
CHOICES["grpo_tools"] = {**CHOICES["grpo"], "tool_turns": ("inline", "chat")}
CHOICES["calibration"] = {**CHOICES["grpo"], "reader": ("parser", "lm")}
CHOICES["grpo_async"] = {**CHOICES["grpo"], "generator": ("vllm",)}
CHOICES["ppo_async"] = {**CHOICES["ppo"], "generator": ("vllm",), "tis": CHOICES["ppo"]["tis"]}
CHOICES["ppo_rlhf"] = {**CHOICES["ppo"], "kl_placement": ("reward", "loss")}
# prime.py: grpo.py's choices without the advantage estimators (PRIME's RLOO is its own); the PRM's update order
CHOICES["prime"] = {**{k: v for k, v in CHOICES["grpo"].items() if k not in ("advantage_estimator", "advantage_scaling")},
                    "prm_update": ("before", "after")}
# opd.py: grpo.py's choices and the distillation loss
CHOICES["opd"] = {**CHOICES["grpo"], "loss": ("pg", "jsd", "fkl_topk"), "teacher_context": ("none", "reference")}
# unit_rm.py keeps rm.py's (none); unit_ppo.py keeps ppo_rlhf.py's and places the unit rewards
CHOICES["unit_rm"] = CHOICES["rm"]
CHOICES["unit_ppo"] = {**CHOICES["ppo_rlhf"], "reward_placement": ("segment_normalization", "every_segment_last",
                                                                   "same_segment_last", "segment_last_avg")}
REPORT_TO = {"report_to": ("none", "wandb", "trackio")}  # every training script
CHOICES = {script: {**choices, **({} if script in EVAL_ONLY else REPORT_TO)} for script, choices in CHOICES.items()}
CHOICE_FIELDS = [(script, name) for script in SCRIPTS for name in CHOICES[script]]


@pytest.mark.parametrize("script", SCRIPTS)
def test_fixed_choice_flags_are_literals(script):
    from shared.cli import literal_choices

    args_cls = importlib.import_module(f"algorithms.{script}").Args
    assert literal_choices(args_cls) == CHOICES[script]
    for name, choices in CHOICES[script].items():
        assert getattr(args_cls(), name) in choices  # the default is one of them


@pytest.mark.parametrize("script, name", CHOICE_FIELDS)
def test_a_wrong_choice_is_a_one_line_error_before_anything_is_written(script, name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    choices = ", ".join(CHOICES[script][name])
    for flag in ([f"--{name}", "Bogus"], [f"--{name}=Bogus"], [f"--{name.replace('_', '-')}", "Bogus"]):
        code, err = run_cli_in_process(script, [*flag, "--output_dir", "run"], monkeypatch, capsys)
        assert (code, err) == (2, f"error: --{name}: 'Bogus' is not one of {choices}\n")
        assert list(tmp_path.iterdir()) == []
    # an Args built in code is checked at start-up too (check_args, which run_cli calls before main)
    from shared.cli import check_args

    args = importlib.import_module(f"algorithms.{script}").Args(**{name: "Bogus"})
    with pytest.raises(ValueError, match=f"^{name}: 'Bogus' is not one of {choices}$"):
        check_args(args)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_rejected_command_line_is_one_line_naming_the_flag(script, tmp_path, monkeypatch, capsys):
    """tyro's own rejections (an unknown or misspelt flag, a value that is not a number, a missing value, a stray
    word) are one line `error: ...` with exit status 2 too, not tyro's multi-line box."""
    monkeypatch.chdir(tmp_path)
    flag, near, real = ("num_samples", "num_sample", "temperature") if script in EVAL_ONLY else (
        "total_episodes", "total_episode", "max_grad_norm")
    cases = [([f"--{near}", "8"], f"error: --{near}: unknown flag; did you mean --{flag}?\n"),
             ([f"--{near.replace('_', '-')}=8"], f"error: --{near.replace('_', '-')}: unknown flag; did you mean "
                                                  f"--{flag}?\n"),
             (["--xyzzy", "1"], "error: --xyzzy: unknown flag; see --help\n"),
             (["--seed", "abc"], "error: --seed: invalid literal for int() with base 10: 'abc' (expected INT)\n"),
             ([f"--{real}", "x"], f"error: --{real}: could not convert string to float: 'x' (expected FLOAT)\n"),
             (["--seed"], "error: --seed: expected INT after it\n"),
             (["stray"], "error: unexpected argument 'stray'; see --help\n"),
             (["--verbose", "yes"], "error: unexpected argument 'yes'; see --help\n")]
    for argv, expected in cases:
        code, err = run_cli_in_process(script, [*argv, "--output_dir", "run"], monkeypatch, capsys)
        assert (code, err) == (2, expected), argv
        assert list(tmp_path.iterdir()) == []


def test_help_still_exits_0(monkeypatch, capsys):
    code, err = run_cli_in_process("dpo", ["--help"], monkeypatch, capsys)
    assert code == 0 and err == ""


def test_a_rejected_command_line_is_one_line_without_tyros_hook(tmp_path, monkeypatch, capsys):
    """The hook that turns tyro's rejections into one line is private tyro API (tyro is pinned); without it, the
    first paragraph of tyro's error box is the line."""
    import tyro._errors

    monkeypatch.delattr(tyro._errors, "on_parse_error")
    monkeypatch.chdir(tmp_path)
    code, err = run_cli_in_process("dpo", ["--loss_type", "sigmod", "--output_dir", "run"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "--loss_type" in err and "'sigmod'" in err and "'dpop'" in err, err
    code, err = run_cli_in_process("dpo", ["--los_type", "ipo", "--output_dir", "run"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "--los_type" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, flag, value", [("sft", "generator", "vlm"), ("vineppo", "step_splitter", "lins")])
def test_a_wrong_choice_fails_as_a_command(script, flag, value, tmp_path):
    """The two choices once caught only after output_dir was written, as users run them."""
    out = subprocess.run([sys.executable, f"algorithms/{script}.py", f"--{flag}", value, "--output_dir",
                          str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    choices = ", ".join(CHOICES[script][flag])
    assert (out.returncode, out.stderr) == (2, f"error: --{flag}: {value!r} is not one of {choices}\n")
    assert list(tmp_path.iterdir()) == []


def test_importing_a_script_has_no_side_effects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for script in SCRIPTS:
        importlib.import_module(f"algorithms.{script}")
    assert list(tmp_path.iterdir()) == []


# --- start-up validation of numeric and path flags (shared/cli.py check_args, called by run_cli) ----------------
def numeric_fields(script: str):
    args = importlib.import_module(f"algorithms.{script}").Args()
    return [(f.name, getattr(args, f.name)) for f in public_fields(script)
            if isinstance(getattr(args, f.name), (int, float)) and not isinstance(getattr(args, f.name), bool)]


def run_cli_in_process(script: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """Run the script's CLI entry in this process, for a command line that must be rejected before main (which
    would write output_dir); return (exit status, stderr)."""
    from shared.cli import run_cli

    def main(args):
        raise AssertionError(f"{script} {argv}: accepted, main ran")

    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as e:
        run_cli(main, importlib.import_module(f"algorithms.{script}").Args)
    return e.value.code, capsys.readouterr().err


def numeric_flags(script: str) -> list[str]:
    """Every public flag typed `int` or `float` (also `float | None`), by its type, whatever its default."""
    import types
    import typing

    args_cls = importlib.import_module(f"algorithms.{script}").Args
    hints = typing.get_type_hints(args_cls)  # Annotated[...] stripped
    names = []
    for f in public_fields(script):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        base = set(typing.get_args(hint)) - {type(None)} if union else {hint}
        if base and base <= {int, float}:
            names.append(f.name)
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_declares_an_allowed_range_that_holds_its_default(script):
    """The project's own scripts stay fully checked: every numeric flag declares its range beside it
    (`Annotated[float, Interval(gt=0, le=1)]`; `Interval()`: any real number). A flag without one is only checked
    to be finite (test_a_numeric_flag_without_a_range_is_only_checked_to_be_finite), so a copied script runs."""
    from shared.cli import check_args, declared_ranges

    ranges = declared_ranges(importlib.import_module(f"algorithms.{script}").Args)
    names = numeric_flags(script)
    assert {name for name, _ in numeric_fields(script)} <= set(names)
    assert [n for n in names if n not in ranges] == [], f"{script}: numeric flags without a declared range"
    check_args(importlib.import_module(f"algorithms.{script}").Args())


INF = None  # unbounded
# (low, low included, high, high included), written by hand for representative flags; every script that has the flag
EXPECTED_RANGES = {
    "top_p": (0, False, 1, True), "generation_top_p": (0, False, 1, True), "epsilon_low": (0, True, 1, True),
    "seed": (0, True, 2**31 - 1, True), "save_every": (0, True, INF, False), "eval_every": (0, True, INF, False),
    "learning_rate": (0, False, INF, False), "critic_learning_rate": (0, False, INF, False),
    "proposal_learning_rate": (0, False, INF, False), "local_micro_batch_size": (1, True, INF, False),
    "total_episodes": (1, True, INF, False), "temperature": (0, False, INF, False),
    "eval_temperature": (0, True, INF, False), "gamma": (0, True, 1, True), "lam": (0, True, 1, True),
    "warmup_ratio": (0, True, 1, False), "lora_dropout": (0, True, 1, False), "label_smoothing": (0, True, 0.5, False),
    "confidence": (0, False, 1, False), "cvar_level": (0, False, 1, True), "cliprange_value": (0, False, INF, False),
    "response_skip_tokens": (-1, True, INF, False),
    "penalty_reward_value": (INF, False, INF, False), "rew_trans_alpha": (INF, False, INF, False),
    "max_grad_norm": (0, True, INF, False), "epsilon_high": (0, True, INF, False), "beta": (0, True, INF, False),
    "prm_beta": (0, False, INF, False), "jsd_beta": (0, True, 1, True),  # the implicit PRM's scale; GKD's JSD mix
}


def test_declared_ranges_equal_the_former_registrys():
    from shared.cli import declared_ranges

    own = {("genrm", "local_micro_batch_size"): (2, True, None, False)}  # half Yes, half No: at least 2 rows
    seen = set()
    for script in SCRIPTS:
        ranges = declared_ranges(importlib.import_module(f"algorithms.{script}").Args)
        for name, expected in EXPECTED_RANGES.items():
            if name in ranges:
                assert ranges[name] == own.get((script, name), expected), (script, name, ranges[name])
                seen.add(name)
    assert seen == set(EXPECTED_RANGES), set(EXPECTED_RANGES) - seen


def test_a_numeric_flag_without_a_range_is_only_checked_to_be_finite():
    """A flag added to a copied script (`entropy_coef: float = 0.01`) needs no edit in shared/: no range, any finite
    value; the markers are read wherever they sit (`Annotated[float | None, ...]`, `Annotated[float, ...] | None`)."""
    from typing import Annotated, Optional

    from annotated_types import Ge, Gt, Interval, Le

    from shared.cli import check_args, declared_ranges

    @dataclasses.dataclass
    class Args:
        entropy_coef: float = 0.01
        my_int: int = 0
        a: Annotated[Optional[float], Gt(0)] = None
        b: Optional[Annotated[int, Interval(ge=2, lt=5)]] = None
        c: Annotated[float, Ge(0), Ge(1), Le(3)] = 2.0  # the tightest bound on each side

    assert declared_ranges(Args) == {"a": (0, False, None, False), "b": (2, True, 5, False), "c": (1, True, 3, True)}
    check_args(Args(entropy_coef=-1e9, my_int=-7, a=0.5, b=4))
    with pytest.raises(ValueError, match=r"^entropy_coef: must be a finite number, got nan$"):
        check_args(Args(entropy_coef=float("nan")))
    for bad, message in [({"a": 0.0}, r"^a: must be in \(0, inf\), got 0.0$"),
                         ({"b": 5}, r"^b: must be in \[2, 5\), got 5$"),
                         ({"c": 0.5}, r"^c: must be in \[1, 3\], got 0.5$")]:
        with pytest.raises(ValueError, match=message):
            check_args(Args(**bad))


# the cases the review listed, by hand: (flag, bad value) for every script that has the flag
BAD_VALUES = [("learning_rate", "0"), ("learning_rate", "-1e-5"), ("proposal_learning_rate", "0"),
              ("critic_learning_rate", "-0.1"), ("top_p", "0"), ("top_p", "1.5"), ("generation_top_p", "0"),
              ("temperature", "0"), ("temperature", "-1"), ("local_micro_batch_size", "0"),
              ("local_micro_batch_size", "-4"), ("local_num_prompts", "0"), ("total_episodes", "0"),
              ("num_minibatches", "-1"), ("max_new_tokens", "0"), ("gamma", "1.5"), ("lam", "-0.1"),
              ("vllm_gpu_memory_utilization", "0"), ("warmup_ratio", "1"), ("cliprange_value", "0"), ("seed", "-1"),
              ("eval_every", "-5"), ("max_grad_norm", "-1"), ("learning_rate", "nan"), ("beta", "inf"),
              ("seed", "2147483648")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_out_of_range_flags_are_one_line_errors_before_anything_is_written(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    names = dict(numeric_fields(script))
    cases = [(f, v) for f, v in BAD_VALUES if f in names]
    assert len(cases) >= 5, cases
    for flag, value in cases:
        out = tmp_path / "run"
        code, err = run_cli_in_process(script, [f"--{flag}", value, "--output_dir", str(out)], monkeypatch, capsys)
        assert code == 2, (flag, value, err)
        assert err.startswith(f"error: {flag}: must be") and err.count("\n") == 1, (flag, value, err)
        assert not out.exists()
    # and every numeric flag just outside its declared range, named in the error
    from shared.cli import check_args, declared_ranges

    args_cls = importlib.import_module(f"algorithms.{script}").Args
    ranges = declared_ranges(args_cls)
    for name, value in names.items():
        low, low_in, high, high_in = ranges[name]
        for bad in ([] if low is None else [low - 1 if low_in else low]) + ([] if high is None else
                                                                           [high + 1 if high_in else high]):
            bad = type(value)(bad)
            with pytest.raises(ValueError, match=f"^{name}: must be in"):
                check_args(dataclasses.replace(args_cls(), **{name: bad}))


@pytest.mark.parametrize("script", ["grpo", "sft", "rm", "evaluate"])
def test_output_dir_that_is_a_file_is_an_error(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file")
    code, err = run_cli_in_process(script, ["--output_dir", "taken"], monkeypatch, capsys)
    assert (code, err) == (2, "error: output_dir: taken exists and is not a directory\n")
    code, err = run_cli_in_process(script, ["--output_dir", "taken/run"], monkeypatch, capsys)
    assert code == 2 and err.startswith("error: output_dir: cannot create taken/run"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_an_unknown_builtin_task_is_an_error_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli_in_process("grpo", ["--dataset", "builtin:sums-20", "--output_dir", "run"], monkeypatch, capsys)
    assert (code, err) == (2, "error: dataset: 'builtin:sums-20' is not a built-in task; expected `builtin` or "
                              "`builtin:sums-N` with N in 3..12\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - EVAL_ONLY))  # evaluate.py keeps no best checkpoint
def test_a_malformed_best_metric_is_an_error_before_anything_is_written(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli_in_process(script, ["--best_metric", "eval/accuracy:highest", "--output_dir", "run"],
                                   monkeypatch, capsys)
    assert (code, err) == (2, "error: best_metric: expected `name`, `name:min` or `name:max`, got "
                              "'eval/accuracy:highest'\n")
    assert list(tmp_path.iterdir()) == []
    code, err = run_cli_in_process(script, ["--best_metric", "dve/accuracy", "--output_dir", "run"], monkeypatch, capsys)
    assert (code, err) == (2, "error: best_metric: expected a held-out metric, dev/<name> or eval/<name>, got "
                              "'dve/accuracy'\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, argv, message", [
    ("ppo", ["--num_samples_per_prompt", "4"], "error: --num_samples_per_prompt: --num_generations is its name now"),
    ("vineppo", ["--num_ppo_epochs", "1"], "error: --num_ppo_epochs: --num_iterations is its name now"),
    ("drca", ["--kl_coef", "0.1"], "error: --kl_coef: --beta is its name now"),
    ("opd", ["--kl_coef", "0.1"], "error: --kl_coef: --beta is its name now"),  # the KL coefficient, as grpo.py's
    ("implicit_prm", ["--beta", "0.1"], "error: --beta: --prm_beta is its name in implicit_prm.py now"),
    ("grpo", ["--prm_beta", "0.1"], "error: --prm_beta: unknown flag"),
    ("ppo", ["--cliprange", "0.1"], "error: --cliprange: --epsilon_low and --epsilon_high are its names now"),
    ("ppo", ["--reward_model_path", "runs/rm/final"], "error: --reward_model_path: use algorithms/ppo_rlhf.py"),
    ("ppo", ["--kl_placement", "reward"], "error: --kl_placement: use algorithms/ppo_rlhf.py"),
    ("grpo", ["--dynamic_sampling"], "error: --dynamic_sampling: use algorithms/dapo.py"),
    ("sft", ["--kl_coef", "0.1"], "error: --kl_coef: unknown flag"),  # sft never had one: no rename to point at
])
def test_a_renamed_flag_names_its_new_name_or_file(script, argv, message, tmp_path, monkeypatch, capsys):
    """Commands written for earlier versions get a one-line error that says what to write now (README table)."""
    from shared.cli import run_cli

    mod = importlib.import_module(f"algorithms.{script}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv, "--output_dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as e:
        run_cli(mod.main, mod.Args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_prompt_template_without_its_placeholder_is_a_one_line_error(script, tmp_path, monkeypatch, capsys):
    """A template without {prompt} (e.g. an unset shell variable: `--prompt_template "$TEMPLATE"`) would make every
    prompt the same text and train on it without complaint: refused at start-up, nothing written."""
    if "prompt_template" not in {f.name for f in dataclasses.fields(importlib.import_module(f"algorithms.{script}").Args)}:
        pytest.skip(f"{script} has no --prompt_template")
    monkeypatch.chdir(tmp_path)
    for template in ("", "Solve it step by step."):
        out = tmp_path / "run"
        code, err = run_cli_in_process(script, ["--prompt_template", template, "--output_dir", str(out)], monkeypatch,
                                       capsys)
        assert code == 2 and err.startswith("error: prompt_template: must contain {prompt}"), err
        assert err.count("\n") == 1 and not out.exists()
