"""The built-in verifiable task: running sums of single digits, written one step per line.

    prompt   "3+4+5+1="
    response "7\\n12\\n13"      (3+4, then +5, then +1; the last line is the answer)

Every single step is easy, the chain is not: a 0.6 M-parameter model warm-started for a minute gets roughly
half of the held-out problems right when sampling, which leaves room for RL to show learning within
minutes on a CPU. Steps are lines, so VinePPO's states are line prefixes exactly as for GSM8K.

The full problem space (10^NUM_TERMS digit tuples) is shuffled once with a fixed seed; the first
`TEST_SIZE` problems are the held-out split and the rest is the train split, so the splits are disjoint.
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


def builtin_split(split: str) -> list[dict]:
    """Rows with keys prompt / response / answer for split 'train' or 'test'."""
    if split not in ("train", "test"):
        raise ValueError(f"built-in task has splits 'train' and 'test', not {split!r}")
    problems = list(itertools.product(range(10), repeat=NUM_TERMS))
    random.Random(SPLIT_SEED).shuffle(problems)
    chosen = problems[:TEST_SIZE] if split == "test" else problems[TEST_SIZE:]
    return [make_example(p) for p in chosen]


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
