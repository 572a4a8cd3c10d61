r"""Reasoning-step segmentation for VinePPO (docs/vineppo.md, "How states are built and rolled out").

A *step* is a contiguous chunk of a response. A splitter returns character boundaries
``b = [0, i_1, ..., len(response)]``; the steps are ``response[b[k]:b[k+1]]``, so ``"".join(steps) == response``
exactly. VinePPO estimates values at the step boundaries: its states are ``S_0 = prompt`` and
``S_j = prompt + steps[0] + ... + steps[j-1]``, each valued by the mean reward of K fresh rollouts, and every token
of step j receives that step's advantage.

Splitters (pick one by name with ``get_splitter``); the first two follow the VinePPO reference code
(github.com/McGill-NLP/VinePPO, under ``src/treetune``):

* ``split_gsm8k``: GSM8K original format (``tasks/gsm8k.py::split_solution_into_intermediate_steps``).
* ``split_math``: MATH (``tasks/math_extract_steps_inplace.py::split_solution_inplace``).
* ``split_lines``: the built-in running-sums task (``shared/task.py``): one line per step.

Conventions shared by all three: the empty response gives ``[0]`` (no steps); otherwise boundaries are strictly
increasing (no empty steps). ``StepSplitError`` means the response cannot be segmented; VinePPO then drops the
trajectory and counts ``parse_failed``.
"""

from __future__ import annotations

import re
from typing import Callable


class StepSplitError(ValueError):
    """The response cannot be split into steps; the caller drops the trajectory and counts ``parse_failed``."""


def steps_from_boundaries(response: str, boundaries: list[int]) -> list[str]:
    """The steps ``response[b[k]:b[k+1]]`` for boundaries ``[0, ..., len(response)]`` (non-decreasing)."""
    if not boundaries or boundaries[0] != 0 or boundaries[-1] != len(response):
        raise ValueError(f"boundaries must start at 0 and end at len(response)={len(response)}, got {boundaries}")
    if any(a > b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be non-decreasing, got {boundaries}")
    return [response[a:b] for a, b in zip(boundaries, boundaries[1:])]


def _boundaries(response: str, parts: list[str]) -> list[int]:
    """Cumulative boundaries of `parts` (empty parts dropped), checked to reassemble `response` exactly."""
    if "".join(parts) != response:
        raise StepSplitError("internal error: the steps do not reassemble the response")
    bounds = [0]
    for part in parts:
        if part:
            bounds.append(bounds[-1] + len(part))
    return bounds


def _newline_parts(text: str) -> list[str]:
    """Split at every "\n"; each later part starts with its "\n"."""
    first, *rest = text.split("\n")
    return [first] + ["\n" + line for line in rest]


# -- built-in task -----------------------------------------------------------------------------------------------


def split_lines(response: str) -> list[int]:
    """One step per line of the built-in task: ``"7\n12\n13" -> [0, 1, 4, 7]`` (steps "7", "\n12", "\n13").

    Each step after the first starts with its "\n". A response that starts with "\n" keeps it in the first step,
    a trailing "\n" is a step of its own, and the empty response gives ``[0]``.
    """
    return _boundaries(response, _newline_parts(response))


# -- GSM8K -------------------------------------------------------------------------------------------------------

GSM8K_ANSWER_PREFIX = "\n#### "


def split_gsm8k(response: str) -> list[int]:
    """GSM8K steps: one step per line, the "\n" starting each later step.

    Leading empty (whitespace-only) lines are merged into the first non-empty step, and the last non-empty step
    absorbs everything after it: trailing empty lines and the ``"\n#### <answer>"`` part. A response containing
    ``"\n#### "`` more than once raises ``StepSplitError`` (the reference fails to unpack it and drops it).
    Without an answer part, trailing empty lines stay separate steps, as in the reference.
    """
    if not response:
        return [0]
    pieces = response.split(GSM8K_ANSWER_PREFIX)
    if len(pieces) > 2:
        raise StepSplitError(f"response contains {GSM8K_ANSWER_PREFIX!r} {len(pieces) - 1} times")
    steps = _newline_parts(pieces[0])
    first = next((i for i, s in enumerate(steps) if s.strip()), None)
    if first:  # some leading steps are empty
        steps = ["".join(steps[: first + 1])] + steps[first + 1 :]
    if len(pieces) == 2:
        # No non-empty step at all: the whole response is one step (reference: index 0).
        last = next((i for i in reversed(range(len(steps))) if steps[i].strip()), 0)
        steps = steps[:last] + ["".join(steps[last:]) + GSM8K_ANSWER_PREFIX + pieces[1]]
    # If every line is empty and there is no answer, the reference's first step is "" (a repeated boundary);
    # `_boundaries` drops it so boundaries stay strictly increasing.
    return _boundaries(response, steps)


# -- MATH --------------------------------------------------------------------------------------------------------

# Step 1: math spans, replaced in this order (a later pattern may enclose an earlier placeholder).
_MATH_SPANS = [re.compile(p, re.DOTALL) for p in (
    r"\[asy\].*?\[/asy\]",
    r"\$\\begin\{tabular\}.*?\\end\{tabular\}\$",
    r"\\begin\{tabular\}.*?\\end\{tabular\}",
    r"\\\(.*?\\\)",
    r"\\\[.*?\\\]",
    r"\$\$.*?\$\$",
    r"(?<!\\)\$.*?[^\\]\$(?!\$)",  # inline $...$ with at least one character inside
    r"\\begin\{([^}]*)\}.*?\\end\{\1\}",
)]
# Placeholders are 60 characters like the reference's, because steps 2 and 5 measure lengths on disguised text.
_PLACEHOLDER_LEN = 60
# Step 2: sentence ends (a "." followed by whitespace and a capital), not after one- or two-letter abbreviations.
_SENTENCE_END = re.compile(r"(?<!\b[A-Za-z]\.)(?<!\s[A-Za-z]\.)(?<!\s[A-Za-z][A-Za-z]\.)(?<=\.)(?=\s+[A-Z])")
# Step 3: math whose content ends a sentence.
_PERIOD_CLOSINGS = (".$", ".$$", ".\\)", ".\\]")
# Step 4: a part that is only an opening delimiter is merged.
_LONE_OPENING = re.compile(r"\$|\$\$|\\\(|\\\[|\\begin\{[^}]*\}|\[asy\]")
# Step 5: cut points (regex, characters back from the match end) for parts longer than _MAX_PART_LEN.
_MAX_PART_LEN = 100
_LANGUAGE_CUTS = [(re.compile(","), 0), (re.compile(r"\sand\s"), 1), (re.compile(":"), 0), (re.compile(r"\sto\s"), 1)]
_MATH_CUTS = [(re.compile(p), 0) for p in (r",\$", r",\\\)", r",\\\]", "=", r"\\equiv", r"\+", r"\\cancelto")]


class _Disguise:
    """Math spans hidden behind fixed-length placeholders ``s + 58 digits + s`` (s: a character absent from the
    response). Unlike the reference (one md5-named placeholder per distinct span, revealed in a single pass),
    every occurrence gets its own placeholder and `reveal` also undoes nested placeholders."""

    def __init__(self, sentinel: str):
        self.sentinel, self.spans = sentinel, []
        self.pattern = re.compile(re.escape(sentinel) + r"(\d{%d})" % (_PLACEHOLDER_LEN - 2) + re.escape(sentinel))

    def hide(self, text: str) -> str:
        for span in _MATH_SPANS:
            text = span.sub(self._store, text)
        return text

    def _store(self, match: re.Match) -> str:
        self.spans.append(match.group(0))
        return f"{self.sentinel}{len(self.spans) - 1:0{_PLACEHOLDER_LEN - 2}d}{self.sentinel}"

    def reveal(self, text: str) -> str:
        while self.sentinel in text:
            text = self.pattern.sub(lambda m: self.spans[int(m.group(1))], text)
        return text


def _sentinel_for(text: str) -> str:
    for code in range(0xE000, 0xF900):  # Unicode private-use area
        if chr(code) not in text:
            return chr(code)
    raise StepSplitError("no free placeholder character")


def _merge_bad_parts(parts: list[str], is_bad: Callable[[str], bool]) -> list[str]:
    """Merge each bad part into the next one (the last one into the previous one), re-checking the merged part.
    A single remaining part is kept (the reference would pop boundary 0 there and fail on responses < 20 chars)."""
    i = 0
    while i < len(parts) and len(parts) > 1:
        if not is_bad(parts[i]):
            i += 1
        elif i == len(parts) - 1:
            parts[i - 1] += parts.pop(i)
        else:
            parts[i] += parts.pop(i + 1)
    return parts


def _middle_cut(text: str, cuts: list, min_len: int, length: Callable[[str], int] = len) -> int | None:
    """Step 5: for the first cut pattern whose occurrence nearest the middle of `text` leaves both halves at least
    `min_len` long (as measured by `length`), that position; else None."""
    for pattern, back in cuts:
        positions = [m.end() - back for m in pattern.finditer(text)]
        if not positions:
            continue
        pos = min(positions, key=lambda p: abs(2 * p - len(text)))  # first one on ties, as in the reference
        if min(length(text[:pos]), length(text[pos:])) >= min_len:
            return pos
    return None


def _language_cut(part: str, sentinel: str) -> int | None:
    """Cut at language punctuation outside math (halves >= 40 characters once math is restored)."""
    disguise = _Disguise(sentinel)
    hidden = disguise.hide(part)
    pos = _middle_cut(hidden, _LANGUAGE_CUTS, 40, lambda s: len(disguise.reveal(s)))
    return None if pos is None else len(disguise.reveal(hidden[:pos]))


def _break_long_part(part: str, sentinel: str) -> list[str]:
    """Step 5: split a part > 100 characters near its middle, repeatedly, language punctuation first.

    Reference quirk kept so the boundaries match: after a math cut at offset c of a piece of length n, the language
    attempt is skipped for pieces starting (offset within `part`) in [min c, max n) over all math cuts so far."""
    cuts, math_range = [0, len(part)], None
    i = 0
    while i < len(cuts) - 1:
        start, piece = cuts[i], part[cuts[i] : cuts[i + 1]]
        cut = None
        if len(piece) > _MAX_PART_LEN:
            if math_range is None or not math_range[0] <= start < math_range[1]:
                cut = _language_cut(piece, sentinel)
            if cut is None:
                cut = _middle_cut(piece, _MATH_CUTS, 20)
                if cut is not None:
                    lo, hi = math_range or (cut, 0)
                    math_range = (min(lo, cut), max(hi, len(piece)))
        if cut is None:
            i += 1
        else:
            cuts.insert(i + 1, start + cut)
    return [part[a:b] for a, b in zip(cuts, cuts[1:])]


def split_math(response: str) -> list[int]:
    """MATH steps, in the reference's five stages (the "Step 1" to "Step 5" comments above).

    Wherever the reference succeeds this returns its boundaries (checked against it on thousands of generated
    strings). Where it fails, this still splits: a response < 20 characters is one step (the reference drops
    boundary 0 and fails), and nested math spans (e.g. ``$x$`` inside ``\\begin{align}``) are restored fully
    (the reference restores one level and fails its final check). The empty response gives ``[0]``.
    """
    if not response:
        return [0]
    sentinel = _sentinel_for(response)
    disguise = _Disguise(sentinel)
    hidden = disguise.hide(response)  # 1. no split can happen inside a math span

    # 2. Sentence ends, then every "\n"; merge parts < 20 characters not ending with "." into the next one
    # (a lone "\n" is one of them). Lengths are of the disguised text; the last part is never merged here.
    parts = [p for sentence in _SENTENCE_END.split(hidden) for p in _newline_parts(sentence)]
    i = 0
    while i < len(parts) - 1:
        if len(parts[i]) < 20 and not parts[i].endswith("."):
            parts[i] += parts.pop(i + 1)
        else:
            i += 1

    # 3. Also split right after math whose content ends with ".$", ".$$", ".\)" or ".\]"; then merge parts that are
    # < 20 characters (math restored) and do not end with such math.
    split_parts = []
    for part in parts:
        start = 0
        for m in disguise.pattern.finditer(part):
            if disguise.reveal(m.group(0)).endswith(_PERIOD_CLOSINGS) and m.end() < len(part):
                split_parts.append(part[start : m.end()])
                start = m.end()
        split_parts.append(part[start:])

    def short_without_period(p: str) -> bool:
        text = disguise.reveal(p)
        return len(text) < 20 and not text.endswith(_PERIOD_CLOSINGS)

    parts = _merge_bad_parts(split_parts, short_without_period)

    # 4. Restore math, splitting before every "\n" inside (display) math; merge parts that are a lone opening
    # delimiter (after strip()), shorter than 3 characters, or "\n".
    restored = []
    for part in parts:
        pieces, start = [""], 0
        for m in disguise.pattern.finditer(part):
            first, *rest = _newline_parts(disguise.reveal(m.group(0)))
            pieces[-1] += part[start : m.start()] + first
            pieces += rest
            start = m.end()
        pieces[-1] += part[start:]
        restored += pieces
    parts = _merge_bad_parts(restored, lambda p: len(p) < 3 or _LONE_OPENING.fullmatch(p.strip()) is not None)

    # 5. Parts > 100 characters: split near the middle, language punctuation first, else math operators; repeat.
    parts = [piece for p in parts for piece in (_break_long_part(p, sentinel) if len(p) > _MAX_PART_LEN else [p])]
    return _boundaries(response, parts)


_SPLITTERS = {"gsm8k": split_gsm8k, "math": split_math, "lines": split_lines}


def get_splitter(name: str) -> Callable[[str], list[int]]:
    """The splitter called `name`: 'gsm8k', 'math' or 'lines' (the built-in task)."""
    if name not in _SPLITTERS:
        raise ValueError(f"unknown step splitter name={name!r}; expected one of {sorted(_SPLITTERS)}")
    return _SPLITTERS[name]


def step_token_starts(token_ids: list[int], char_boundaries: list[int], decode) -> list[int]:
    """Token index where each step starts, from the steps' character boundaries [0, ..., len(text)].

    Token i belongs to the step containing its start offset len(decode(ids[:i])) (the VinePPO reference maps
    tokens through their start offsets); binary search keeps this at O(steps * log tokens) decodes. Steps that
    would start inside the same token are merged, so the result is strictly increasing and starts at 0."""
    starts = []
    for b in char_boundaries[:-1]:
        lo, hi = 0, len(token_ids)
        while lo < hi:  # first i with len(decode(ids[:i])) >= b
            mid = (lo + hi) // 2
            if len(decode(token_ids[:mid])) >= b:
                hi = mid
            else:
                lo = mid + 1
        if lo < len(token_ids) and (not starts or lo > starts[-1]):
            starts.append(lo)
    return starts or [0]
