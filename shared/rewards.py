"""Reward functions for verifiable tasks, chosen by name or imported by path.

A reward function is called once per batch with five arguments, in this order:

    fn(prompts: list[str], completions: list[str], answers: list[str], finished: list[bool],
       rows: list[dict]) -> list[float]

`finished[i]` is False when completion i hit the length limit; `rows[i]` is the dataset row (every column,
so graders can read metadata). Any parameter names work when the function takes all five positionally
(`def r(p, c, a, f, rows)`); a function whose parameters are some of these names (`def r(completions, answers)`,
`def r(completions, **kwargs)`) gets just those, by keyword. The signature is checked once, when the run starts.

`reward_fn` values:
  - "builtin": the built-in running-sums task (shared/task.py);
  - "gsm8k" / "math": the graders of shared/graders.py (the VinePPO protocol; a MATH gold may be a solution or a
    bare answer);
  - "math_verify": the same MATH answer extraction with math-verify's equivalence check (it matched the human
    verdict on all of tests/grader_cases.py, "math" on all but two protocol cases: docs/bench/graders/);
  - "package.module:function" or "path/to/file.py:function": your own function.
Every result is checked: one finite number per completion, within float32's range (the trainer's), or a one-line
error naming the function; so is a file or module that fails to import (a syntax error, a missing package).
`probe_reward_fn` makes that check once at start-up, before the run writes anything.

Each built-in grader also has an answer extractor, `fn(prompt, completion) -> str | None` (`load_answer_fn`): the
answer as that grader reads it, normalised so that answers it grades alike compare equal (algorithms/evaluate.py
votes with them for maj@k). A custom reward function has none.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
from pathlib import Path
from typing import Callable

RewardFn = Callable[..., list]
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def builtin_reward(prompts, completions, answers, finished, rows=None, **_):
    from shared import task

    return [task.grade(c, a, f) for c, a, f in zip(completions, answers, finished)]


def gsm8k_reward(prompts, completions, answers, finished, rows=None, **_):
    from shared import graders

    return [graders.grade("gsm8k", c, graders.gsm8k_gold_from_solution(a) if "####" in a else a, finished=f)
            for c, a, f in zip(completions, answers, finished)]


def math_reward(prompts, completions, answers, finished, rows=None, **_):
    from shared import graders

    return [graders.grade("math", c, a, question=p, finished=f)
            for p, c, a, f in zip(prompts, completions, answers, finished)]


def math_verify_reward(prompts, completions, answers, finished, rows=None, **_):
    from shared import graders

    return [graders.grade("math_verify", c, a, question=p, finished=f)
            for p, c, a, f in zip(prompts, completions, answers, finished)]


BUILTIN = {"builtin": builtin_reward, "gsm8k": gsm8k_reward, "math": math_reward, "math_verify": math_verify_reward}


def builtin_answer(prompt: str, completion: str) -> str | None:
    from shared import task

    return task.extract_answer(completion)


def gsm8k_answer(prompt: str, completion: str) -> str | None:
    """The text after the last `####`, as a number when it is one (`$1,234.` -> `1234`: the grader's number match),
    else lower-cased without commas (its string match)."""
    from shared import graders

    answer = graders.extract_gsm8k_answer(completion)
    if answer is None:
        return None
    number = graders._gsm8k_number(answer)
    return format(number, ".15g") if number is not None else answer.strip().replace(",", "").lower()


def math_answer(prompt: str, completion: str) -> str | None:
    """The Minerva-extracted, normalised candidate answers, joined with ', ' (None when there is none)."""
    from shared import graders

    return ", ".join(graders.extract_math_answer(prompt, completion)) or None


ANSWER_FNS = {"builtin": builtin_answer, "gsm8k": gsm8k_answer, "math": math_answer, "math_verify": math_answer}


def reward_fn_name(spec: str, dataset: str = "builtin") -> str:
    """`spec` with "auto" resolved by dataset name (builtin, gsm8k or math)."""
    if spec != "auto":
        return spec
    lowered = dataset.lower()
    spec = "builtin" if dataset.startswith("builtin") else "gsm8k" if "gsm8k" in lowered else "math" if "math" in lowered else ""
    if not spec:
        raise ValueError(f"reward_fn: cannot infer a grader for dataset {dataset!r}; pass --reward_fn")
    return spec


def load_answer_fn(spec: str, dataset: str = "builtin"):
    """The answer extractor of a built-in grader (module docstring), or None for a custom reward function."""
    return ANSWER_FNS.get(reward_fn_name(spec, dataset))


def load_reward_fn(spec: str, dataset: str = "builtin") -> RewardFn:
    """Resolve `spec` (see module docstring); "auto" picks by dataset name."""
    spec = reward_fn_name(spec, dataset)
    if spec in BUILTIN:
        return BUILTIN[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"reward_fn: {spec!r} is not one of {sorted(BUILTIN)} nor 'module:function'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise ValueError(f"reward_fn: file {target} does not exist")
    try:  # the user's file or module: a syntax error or a failed import is one line naming it
        if target.endswith(".py"):
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as e:  # noqa: BLE001 - the user's code: name it, keep the cause
        raise ValueError(f"reward_fn: importing {target} raised {type(e).__name__}: {' '.join(str(e).split())}") from e
    if not hasattr(module, attr):
        raise ValueError(f"reward_fn: {target} has no attribute {attr!r}")
    return getattr(module, attr)


ARGUMENTS = ("prompts", "completions", "answers", "finished", "rows")


@functools.lru_cache(maxsize=None)
def call_style(fn: RewardFn) -> tuple[str, tuple[str, ...]]:
    """How to call `fn` (module docstring): ("keywords", the names it takes) when every parameter it requires is one
    of ARGUMENTS, else ("positional", ARGUMENTS) when it takes five positional arguments; a one-line error otherwise."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature: documented order
        return "positional", ARGUMENTS
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in named if p.default is p.empty]
    if any(p.kind == p.VAR_KEYWORD for p in params):
        if all(r in ARGUMENTS for r in required):
            return "keywords", ARGUMENTS
    elif required and all(r in ARGUMENTS for r in required):
        return "keywords", tuple(p.name for p in named if p.name in ARGUMENTS)
    try:
        inspect.signature(fn).bind(*ARGUMENTS)
        return "positional", ARGUMENTS
    except TypeError:
        pass
    raise ValueError(f"reward_fn {name}: its parameters ({', '.join(p.name for p in params)}) can take neither the five "
                     f"arguments (prompts, completions, answers, finished, rows) in order nor some of them by name")


def compute_rewards(fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str],
                    finished: list[bool], rows: list[dict]) -> list[float]:
    """Call a reward function (as `call_style` says) and validate its output shape and values."""
    values = dict(prompts=prompts, completions=completions, answers=answers, finished=finished, rows=rows)
    style, names = call_style(fn)
    name = getattr(fn, "__name__", repr(fn))
    try:
        out = fn(**{k: values[k] for k in names}) if style == "keywords" else fn(*(values[k] for k in ARGUMENTS))
    except Exception as e:  # noqa: BLE001 - the user's code: name it, keep the cause
        raise ValueError(f"reward_fn {name} raised {type(e).__name__}: {e}") from e
    if hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != len(completions):
        got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
        raise ValueError(f"reward_fn {name}: returned {got} values for {len(completions)} completions")
    values = []
    for i, v in enumerate(out):
        if not isinstance(v, numbers.Real) or not math.isfinite(v):  # numpy scalars too (np.float32 is no float)
            raise ValueError(f"reward_fn {name}: value {i} is {v!r}, expected a finite number")
        if abs(v) > FLOAT32_MAX:  # the trainer's tensors are float32: such a reward is inf there
            raise ValueError(f"reward_fn {name}: value {i} is {v!r}, beyond float32's range (+-{FLOAT32_MAX:.4g}) "
                             "in which rewards are trained")
        values.append(float(v))
    return values


def score_completions(reward_fn: RewardFn | None, reward_model, rows: list[dict], prompt_ids: list[list[int]],
                      completions: list, texts: list[str], pad_id: int, info, micro_batch_size: int,
                      user_code=contextlib.nullcontext()) -> list[float]:
    """One reward per completion: the reward model's normalised score of prompt + completion when there is one
    (shared/scalar.py), else reward_fn's on the texts, called inside `user_code` (the scripts' `ckpt.user_code`: a
    reward function that raises stops the run after saving the previous step)."""
    if reward_model is not None:
        from shared.scalar import score_sequences

        return score_sequences(reward_model, prompt_ids, [c.token_ids for c in completions], pad_id, info,
                               micro_batch_size).tolist()
    with user_code:
        return compute_rewards(reward_fn, [x["prompt"] for x in rows], texts, [x["answer"] for x in rows],
                               [c.finished for c in completions], rows)


def probe_reward_fn(fn: RewardFn, rows: list[dict]) -> list[float]:
    """Call the reward function once on two dataset rows (their gold answers as completions, one marked
    truncated) so a wrong signature, shape or value fails at start-up, not after the first rollout; its two values."""
    rows = (rows * 2)[:2]
    return compute_rewards(fn, [r["prompt"] for r in rows], [str(r.get("answer", "")) for r in rows],
                    [str(r.get("answer", "")) for r in rows], [True, False], rows)


def check_labels(values: list[float], fn: RewardFn) -> list[float]:
    """`values` when every one is 0 or 1: the outcome labels a PRM or a verifier is trained on (prime.py,
    implicit_prm.py, genrm.py), whose cross-entropy means nothing for other values; else a one-line error naming
    the function and the first other value."""
    bad = next((v for v in values if v not in (0.0, 1.0)), None)
    if bad is not None:
        raise ValueError(f"reward_fn {getattr(fn, '__name__', repr(fn))}: returned {bad!r}; the labels this script "
                         "trains on must be 0 or 1 (a grader's verdict)")
    return values
