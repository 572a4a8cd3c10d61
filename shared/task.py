"""The built-in verifiable task: running sums of single digits, written one step per line.

    prompt   "3+4+5+1="
    response "7\\n12\\n13"      (3+4, then +5, then +1; the last line is the answer)

Every single step is easy, the chain is not: a 0.6 M-parameter model warm-started for a minute gets roughly
half of the held-out problems right when sampling, which leaves room for RL to show learning within
minutes on a CPU. Steps are lines, so VinePPO's states are line prefixes exactly as for GSM8K.

The full problem space (10^NUM_TERMS digit tuples) is shuffled once with a fixed seed; the first
`TEST_SIZE` problems are the held-out split and the rest is the train split, so the splits are disjoint.

Preference pairs for dpo.py / rm.py (`builtin_preferences`): for every problem and every step k, `chosen` is
the correct response and `rejected` the same chain with one arithmetic slip at line k (off by 1-3; later
lines are computed correctly from the wrong value, so the final answer is wrong too), e.g. "7\n13\n14" for
"3+4+5+1=". `rejected_step` is k, the unit a unit-level reward model should blame. Three pairs per problem
(28,500 train, 1,500 test), in a fixed shuffled order; deterministic.
"""

from __future__ import annotations

import itertools
import random

NUM_TERMS = 4
TEST_SIZE = 500
SPLIT_SEED = 1234


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


def builtin_split(split: str) -> list[dict]:
    """Rows with keys prompt / response / answer for split 'train' or 'test'."""
    return [make_example(p) for p in _split_problems(split)]


def _split_problems(split: str) -> list[tuple[int, ...]]:
    if split not in ("train", "test"):
        raise ValueError(f"built-in task has splits 'train' and 'test', not {split!r}")
    problems = list(itertools.product(range(10), repeat=NUM_TERMS))
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[:TEST_SIZE] if split == "test" else problems[TEST_SIZE:]


def builtin_preferences(split: str) -> list[dict]:
    """Preference rows (prompt, answer, chosen, rejected, rejected_step): one pair per problem and step."""
    rows = []
    for problem in _split_problems(split):
        ex = make_example(problem)
        rng = random.Random(SPLIT_SEED + int("".join(map(str, problem))))
        for k in range(NUM_TERMS - 1):
            wrong = corrupt(problem, k, rng.choice([-3, -2, -1, 1, 2, 3]))
            rows.append({"prompt": ex["prompt"], "answer": ex["answer"], "chosen": ex["response"],
                         "rejected": "\n".join(str(v) for v in wrong), "rejected_step": k})
    random.Random(SPLIT_SEED + 1).shuffle(rows)
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
