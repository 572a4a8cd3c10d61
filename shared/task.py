"""The built-in verifiable task: running sums of single digits, written one step per line.

    prompt   "3+4+5+1="
    response "7\\n12\\n13"      (3+4, then +5, then +1; the last line is the answer)

Every single step is easy, the chain is not: a 0.67 M-parameter model warm-started for a minute gets roughly
half of the held-out problems right when sampling, which leaves room for RL to show learning within
minutes on a CPU. Steps are lines, so VinePPO's states are line prefixes exactly as for GSM8K.

The full problem space (10^NUM_TERMS digit tuples) is shuffled once with a fixed seed; the first
`TEST_SIZE` problems are the held-out split and the rest is the train split, so the splits are disjoint.

Preference pairs for dpo.py / rm.py (`builtin_preferences`): for every problem and every step k, `chosen` is
the correct response and `rejected` the same chain with one arithmetic slip at line k (off by 1-3; later
lines are computed correctly from the wrong value, so the final answer is wrong too), e.g. "7\n13\n14" for
"3+4+5+1=". `rejected_step` is k, the unit a unit-level reward model should blame. Three pairs per problem
(28,500 train, 1,500 test), in a fixed shuffled order; deterministic.

`builtin:counterfactual` is the 4-term task whose preference pairs are in the format of DRCA's counterfactuals
(`counterfactual_preferences`): responses with a line blanked, or cut after a blanked line, ranked by the per-line
grader (`line_grade`), so a reward model trained on them can score a response with a unit removed (DRCA,
docs/drca.md). Its prompts and answers are `builtin`'s.

`builtin:sums-N` (N = 3..12) is the same task with N terms, so a response has N-1 steps: more chances to slip
mid-chain and more credit to assign (VinePPO vs PPO, docs/vineppo.md). `builtin` is `builtin:sums-4`, row for row.
Responses grow to about 3(N-1) characters: pass `--max_new_tokens` accordingly (16 fits N = 4 and 5 only).
"""

from __future__ import annotations

import itertools
import random
import re

NUM_TERMS = 4
TEST_SIZE = 500
SPLIT_SEED = 1234
# the task family `builtin:sums-N` (N terms, N-1 steps per response); `builtin` is `builtin:sums-4`
MIN_TERMS, MAX_TERMS = 3, 12
COUNTERFACTUAL = "builtin:counterfactual"  # the 4-term task with counterfactual-format preference pairs
SAMPLED_TRAIN_SIZE = 50_000  # train problems when 10^N is too large to enumerate (N >= 6)
_FAMILY = re.compile(r"builtin:sums-(\d+)")


def is_builtin(dataset: str) -> bool:
    """`builtin` or `builtin:sums-N` (a data error for N outside 3..12 is raised by `num_terms`)."""
    return dataset == "builtin" or dataset.startswith("builtin:")


def num_terms(dataset: str) -> int:
    """Number of terms of a built-in dataset name: `builtin` -> 4, `builtin:sums-8` -> 8."""
    if dataset in ("builtin", COUNTERFACTUAL):
        return NUM_TERMS
    m = _FAMILY.fullmatch(dataset)
    if not m or not MIN_TERMS <= int(m.group(1)) <= MAX_TERMS:
        raise ValueError(f"dataset: {dataset!r} is not a built-in task; expected `builtin` or `builtin:sums-N` with "
                         f"N in {MIN_TERMS}..{MAX_TERMS}")
    return int(m.group(1))


def make_example(digits: tuple[int, ...] | list[int]) -> dict:
    sums = list(itertools.accumulate(digits))[1:]
    return {
        "prompt": "+".join(str(d) for d in digits) + "=",
        "response": "\n".join(str(s) for s in sums),
        "answer": str(sums[-1]),
    }


def corrupt(digits, k: int, delta: int) -> list[int]:
    """The running sums with one slip: line k is off by delta and later lines continue from the wrong value."""
    sums, total = [], digits[0]
    for i, d in enumerate(digits[1:]):
        total += d
        if i == k:
            total = total + delta if total + delta >= 0 else total - delta
        sums.append(total)
    return sums


def builtin_split(split: str, terms: int = NUM_TERMS) -> list[dict]:
    """Rows with keys prompt / response / answer for split 'train' or 'test' of the `terms`-term task."""
    return [make_example(p) for p in _split_problems(split, terms)]


def _split_problems(split: str, terms: int = NUM_TERMS) -> list[tuple[int, ...]]:
    """N <= 5: all 10^N digit tuples, shuffled once; the first TEST_SIZE are the test split, the rest train (N = 3:
    500 train problems). N >= 6: distinct tuples drawn from one seeded stream, the first TEST_SIZE the test split
    and the next SAMPLED_TRAIN_SIZE the train split. Disjoint and deterministic either way; N = 4 is `builtin`."""
    if split not in ("train", "test"):
        raise ValueError(f"built-in task has splits 'train' and 'test', not {split!r}")
    if terms <= 5:
        problems = list(itertools.product(range(10), repeat=terms))
        random.Random(SPLIT_SEED if terms == NUM_TERMS else f"sums-{terms}:{SPLIT_SEED}").shuffle(problems)
        return problems[:TEST_SIZE] if split == "test" else problems[TEST_SIZE:]
    rng, seen, problems = random.Random(f"sums-{terms}:{SPLIT_SEED}"), set(), []
    while len(problems) < TEST_SIZE + (SAMPLED_TRAIN_SIZE if split == "train" else 0):
        p = tuple(rng.randrange(10) for _ in range(terms))
        if p not in seen:
            seen.add(p)
            problems.append(p)
    return problems[:TEST_SIZE] if split == "test" else problems[TEST_SIZE:]


def builtin_preferences(split: str, terms: int = NUM_TERMS) -> list[dict]:
    """Preference rows (prompt, answer, chosen, rejected, rejected_step): one pair per problem and step."""
    rows = []
    for problem in _split_problems(split, terms):
        ex = make_example(problem)
        rng = random.Random(SPLIT_SEED + int("".join(map(str, problem))))
        for k in range(terms - 1):
            wrong = corrupt(problem, k, rng.choice([-3, -2, -1, 1, 2, 3]))
            rows.append({"prompt": ex["prompt"], "answer": ex["answer"], "chosen": ex["response"],
                         "rejected": "\n".join(str(v) for v in wrong), "rejected_step": k})
    random.Random(SPLIT_SEED + 1).shuffle(rows)
    return rows


def preferences(dataset: str, split: str) -> list[dict]:
    """The preference rows of a built-in dataset: `builtin_preferences`, or `counterfactual_preferences` for
    `builtin:counterfactual`."""
    if dataset == COUNTERFACTUAL:
        return counterfactual_preferences(split)
    return builtin_preferences(split, num_terms(dataset))


def counterfactual_preferences(split: str) -> list[dict]:
    """Preference pairs for a reward model that has to score DRCA's counterfactuals, ranked by the per-line grader
    (`line_grade`; `chosen_grade` > `rejected_grade`). Per problem of the 4-term task, three pairs: one of whole
    responses as `builtin_preferences` (the correct one against one slip at a random line), and two drawn from the
    comparisons DRCA's credits make, d_k = R - R~_k: a base response (correct 1/3, one slip 1/2, two slips 1/6;
    slips as in `corrupt`, off by 1-3) and, in one of DRCA's two formats, its counterfactuals (line k blanked with
    spaces: `mask`; the response cut after its blanked line k: `truncate`); a pair is two of {the whole response,
    its counterfactuals} with different grades (truncate's counterfactual of the first line is blanks only: the
    preference loader accepts it for this dataset alone). Deterministic, in a fixed shuffled order (28,500 train
    pairs, 1,500 test)."""
    rows = []
    steps = NUM_TERMS - 1
    for problem in _split_problems(split, NUM_TERMS):
        ex = make_example(problem)
        correct = [int(v) for v in ex["response"].split("\n")]
        rng = random.Random(f"counterfactual:{SPLIT_SEED}:{''.join(map(str, problem))}")

        def slipped(ks: list[int]) -> list[int]:
            total, out = problem[0], []
            for i, d in enumerate(problem[1:]):
                total += d
                if i in ks:
                    delta = rng.choice([-3, -2, -1, 1, 2, 3])
                    total = total + delta if total + delta >= 0 else total - delta
                out.append(total)
            return out

        def add(a: str, b: str) -> None:
            ga, gb = line_grade(ex["prompt"], a), line_grade(ex["prompt"], b)
            (c, gc), (r, gr) = sorted([(a, ga), (b, gb)], key=lambda t: -t[1])
            rows.append({"prompt": ex["prompt"], "answer": ex["answer"], "chosen": c, "rejected": r,
                         "chosen_grade": gc, "rejected_grade": gr})

        add(ex["response"], "\n".join(map(str, slipped([rng.randrange(steps)]))))
        made = 0
        while made < 2:
            u = rng.random()
            values = correct if u < 1 / 3 else slipped(rng.sample(range(steps), 1 if u < 5 / 6 else 2))
            lines, mode = [str(v) for v in values], rng.choice(["mask", "truncate"])
            pool = ["\n".join(lines)]
            for k in range(steps):
                cf = lines[:k] + [" " * len(lines[k])] + (lines[k + 1 :] if mode == "mask" else [])
                pool.append("\n".join(cf))
            grades = [line_grade(ex["prompt"], y) for y in pool]
            options = [(i, j) for i in range(len(pool)) for j in range(i) if grades[i] != grades[j]]
            if options:  # (two slips can leave every variant graded alike: draw another base)
                i, j = rng.choice(options)
                add(pool[i], pool[j])
                made += 1
    random.Random(SPLIT_SEED + 2).shuffle(rows)
    return rows


def extract_answer(completion: str) -> str | None:
    """The last non-empty line of the completion, or None if there is none."""
    lines = [line.strip() for line in completion.strip().split("\n") if line.strip()]
    return lines[-1] if lines else None


def grade(completion: str, answer: str, finished: bool = True) -> float:
    """1.0 if the last line equals the answer and the response ended with EOS, else 0.0."""
    if not finished:
        return 0.0
    return float(extract_answer(completion) == answer.strip())


def prompt_terms(prompt: str) -> list[int]:
    """The digits of a running-sums prompt ("3+4+5+1=" -> [3, 4, 5, 1]; the last such sum in the text, so a template
    around it is fine); ValueError if there is none."""
    found = re.findall(r"\d+(?:\+\d+)+=", prompt)
    if not found:
        raise ValueError(f"not a running-sums prompt: {prompt!r}")
    return [int(t) for t in found[-1][:-1].split("+")]


def line_points(prompt: str, text: str) -> list[int]:
    """The per-line grader (which line is wrong), for responses and DRCA's counterfactuals (a line blanked with
    spaces, or the response cut after a blanked line). Line i (0-based) gets two checks, +1 if passed, -1 if not:
    its value (the true running sum i) and its step (the line above it plus term i + 1; line 0: term 0 plus term 1).
    A blank line gets nothing; the step of a line below a blank or unparsable one is not checked (0); a line beyond
    the last step gets -2; an unparsable line (anything but an integer) fails both checks. A slip at line k: +2 per
    line before it, -2 at k, 0 after it (wrong value, right step from the wrong line above)."""
    terms = prompt_terms(prompt)
    sums = list(itertools.accumulate(terms))[1:]
    lines = text.split("\n")
    while lines and not lines[-1].strip():  # trailing blank lines: nothing
        lines.pop()
    points, values = [], []
    for i, line in enumerate(lines):
        v = int(line.strip()) if re.fullmatch(r"-?\d+", line.strip()) else None
        values.append(v)
        if not line.strip():
            points.append(0)
        elif i >= len(sums):
            points.append(-2)
        else:
            above = terms[0] if i == 0 else values[i - 1]
            step = 0 if above is None else (1 if v == above + terms[i + 1] else -1)  # unchecked below a blank
            points.append((1 if v == sums[i] else -1) + step)
    return points


def line_grade(prompt: str, text: str) -> float:
    """The per-line grader's score: sum of line_points / (2 x steps), 1.0 for a correct complete response, in
    [-1, 1] for one of the right length (missing lines score 0, extra lines -2 each)."""
    return sum(line_points(prompt, text)) / (2 * (len(prompt_terms(prompt)) - 1))


def step_boundaries(response: str) -> list[int]:
    """Character offsets [0, i_1, ..., len] splitting a response into lines; each later step starts with its '\\n'."""
    cuts = [0] + [i for i, ch in enumerate(response) if ch == "\n" and i > 0] + [len(response)]
    return sorted(set(cuts))


# ---- chat sums: the real-model benchmark's task (docs/real_models.md), in GSM8K's columns -------------------------
CHAT_SUMS_OPERANDS = 20  # a + b with a, b in 0..19: 400 problems
CHAT_SUMS_TEST_SIZE = 100


def chat_sums_split(split: str) -> list[dict]:
    """Two-operand sums asked as chat questions, with GSM8K's columns and answer format:
    {"question": "What is 12+7?", "answer": "12 + 7 = 19\\n#### 19"}. The 400 problems are shuffled once with a fixed
    seed; the first 100 are the 'test' split, the other 300 'train' (disjoint, deterministic)."""
    if split not in ("train", "test"):
        raise ValueError(f"chat sums have splits 'train' and 'test', not {split!r}")
    problems = list(itertools.product(range(CHAT_SUMS_OPERANDS), repeat=2))
    random.Random(SPLIT_SEED).shuffle(problems)
    chosen = problems[:CHAT_SUMS_TEST_SIZE] if split == "test" else problems[CHAT_SUMS_TEST_SIZE:]
    return [{"question": f"What is {a}+{b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in chosen]
