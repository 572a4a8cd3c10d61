"""Example reward functions: `--reward_fn examples/rewards.py:exact_number` (README, "Your reward").

A reward function is called once per batch of completions with lists of equal length (shared/rewards.py):

    prompts      the dataset's prompt column (--prompt_key), before --prompt_template and the chat template
    completions  the decoded completions, special tokens (EOS) skipped, cut before a --stop string
    answers      the dataset's gold-answer column (--answer_key), as text
    finished     False where a completion hit --max_new_tokens
    rows         the dataset rows, every column

and returns one finite number per completion. A function that names some of these parameters gets just those, by
keyword. The same function grades the held-out set: `eval/accuracy` is its mean score, `eval/pass@k` counts a
completion as correct when it scores above 0.5.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
ANSWER_LINE = re.compile(r"^#### *(-?\d[\d,]*(?:\.\d+)?) *$", re.M)


def last_number(text: str) -> float | None:
    """The last number in `text` (`1,234` reads as 1234), or None."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def exact_number(completions: list[str], answers: list[str], finished: list[bool]) -> list[float]:
    """1 when a finished completion's last number equals the gold answer's last number (GSM8K's `... #### 18` gold
    reads as 18), else 0."""
    out = []
    for c, a, f in zip(completions, answers, finished):
        got, gold = last_number(c), last_number(a)
        out.append(float(f and got is not None and got == gold))
    return out


def answer_format(completions: list[str], finished: list[bool]) -> list[float]:
    """A format reward: 1 when a finished completion has a line `#### <number>` (what GSM8K's grader reads), else 0.
    It does not look at the answer: add it to a correctness reward, never use it alone."""
    return [float(f and ANSWER_LINE.search(c) is not None) for c, f in zip(completions, finished)]


def exact_number_short(completions: list[str], answers: list[str], finished: list[bool],
                       budget: int = 50, per_word: float = 0.01) -> list[float]:
    """exact_number minus `per_word` for every word past `budget` words, never below 0: a correct answer of 60 words
    scores 0.9. Held-out, a correct completion still counts for pass@k only while it scores above 0.5."""
    return [max(0.0, r - per_word * max(0, len(c.split()) - budget))
            for r, c in zip(exact_number(completions, answers, finished), completions)]
