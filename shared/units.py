"""Text units of a response for DRCA (algorithms/drca.py; docs/drca.md, "Units"): where a response splits into the
units whose counterfactuals DRCA scores, as token spans. Segmentation only, as shared/steps.py is for VinePPO's
steps; the credits and rewards stay in drca.py. Follows the reference's `utils/unit_extraction.py`
(github.com/npnike10/LearningSegmentRewards), with its off-by-one offsets reproducible (`code_compat`).

    regex_units(text, pattern, max_units)           character spans: each match of `pattern` starts a unit
    entropy_units(entropy, threshold, max_units)    token spans split at entropy peaks
    char_offsets(decode, ids), char_span_to_tokens  characters <-> tokens
    line_spans(decode, ids)                         a response's lines as token spans (implicit PRM steps)
    think_prefix_length(pieces)                     tokens of a leading <think>...</think> block (no unit there)
    response_units(response, entropy, ...)          a response's unit token spans (drca.py's unit flags' values)
"""

from __future__ import annotations

import re

LABEL_PATTERN = r"^\*?[A-Z]{1,2}\.\s+"  # the reference's step labels: "A. ", "AB. ", "*A. "
UNIT_PATTERNS = {
    "labels": LABEL_PATTERN,
    "labels+digits": r"^\*?(?:[A-Z]{1,2}|\d{1,2})\.\s+",  # also "1. ", "12. " (the reference's docstring intent)
    "lines": r"^(?=\S)",  # every non-blank line starts a unit (the built-in task: one running sum per line)
}


def think_prefix_length(pieces: list[str]) -> int:
    """Tokens before the unit region: a leading `<think>...</think>` block (pieces = the response's tokens, each
    decoded with its special tokens) plus the whitespace-only tokens after it; 0 without one. An unterminated
    block covers the whole response. (The reference hard-codes 4 for Qwen3: <think>, \\n\\n, </think>, \\n\\n.)"""
    if not "".join(pieces).lstrip().startswith("<think>"):
        return 0
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        if "</think>" in text:
            end = i + 1
            while end < len(pieces) and not pieces[end].strip():
                end += 1
            return end
    return len(pieces)


def char_offsets(decode, ids: list[int], context: int = 8) -> list[int]:
    """offsets[i] = len(decode(ids[:i])), i = 0..n: token i covers characters [offsets[i], offsets[i+1]).
    Prefix decoding (not per-token decoding) keeps multi-byte characters split over tokens intact; a prefix
    ending inside a character decodes to a trailing U+FFFD, which is not counted.

    Linear time: the characters token i adds are len(decode(ids[i-c:i+1])) - len(decode(ids[i-c:i])), decoded
    with `context` tokens before it (as vLLM's incremental detokenizer), so split characters, leading-space and
    clean-up rules see the same neighbourhood as in the full prefix. If the total disagrees with the full decode
    (a tokenizer whose decoding depends on more context), the exact quadratic prefix decoding is used."""
    clean = lambda t: len(t.rstrip("\ufffd"))  # noqa: E731
    offsets = [0]
    for i in range(len(ids)):
        lo = max(0, i - context)
        added = clean(decode(ids[lo:i + 1])) - clean(decode(ids[lo:i])) if i > lo else clean(decode(ids[:1]))
        offsets.append(max(offsets[-1], offsets[-1] + added))
    if offsets[-1] != clean(decode(ids)):
        offsets = [0] + [0] * len(ids)
        for i in range(1, len(ids) + 1):
            offsets[i] = max(offsets[i - 1], clean(decode(ids[:i])))
    return offsets

def line_spans(decode, ids: list[int]) -> list[tuple[int, int]]:
    """Token spans [a, b) of a response's lines: a token belongs to the line its first character is on, so a
    line's terminating '\\n' is in it; tokens past the text (EOS) and trailing blank lines join the last line.
    A blank line is no line of its own either: it joins the line before it (leading ones the first line), so
    '7' '\\n\\n' '1' '2' is two lines, '7\\n\\n' and '12', as '7' '\\n' '\\n' '1' '2' is (GPT-2-style vocabularies
    hold tokens of several newlines)."""
    offsets, text = char_offsets(decode, ids), decode(ids)
    line_unit, unit, seen_text = [], 0, False  # line_unit[i]: the span of the text's line i
    for line in text.split("\n"):
        unit += bool(line.strip()) and seen_text
        seen_text = seen_text or bool(line.strip())
        line_unit.append(unit)
    spans, last = [], None
    for j in range(len(ids)):
        k = line_unit[min(text[: offsets[j]].count("\n"), len(line_unit) - 1)]
        if spans and k == last:
            spans[-1] = (spans[-1][0], j + 1)
        else:
            spans.append((j, j + 1))
        last = k
    return spans


def char_span_to_tokens(offsets: list[int], char_start: int, char_end: int) -> tuple[int, int]:
    """[first token touching char_start, last token touching char_end - 1] as a half-open token span.
    Zero-width tokens just before the first one (the leading bytes of a split character) are included."""
    n = len(offsets) - 1
    ts = next(i for i in range(n) if offsets[i + 1] > char_start)
    while ts > 0 and offsets[ts - 1] == offsets[ts]:
        ts -= 1
    te = next(j for j in range(1, n + 1) if offsets[j] >= char_end)
    return ts, te


def regex_units(text: str, pattern: str, max_units: int, code_compat: bool = False) -> list[tuple[int, int]]:
    """Character spans of the units: each match of `pattern` (multiline) starts one; at most max_units, the last
    running to the end of the text (so it absorbs later matches); text before the first match is in no unit.

    Default: unit k = [start_k, start_{k+1}) with trailing whitespace stripped. `code_compat` reproduces the
    reference: lines matched one by one after dropping blank lines, so each blank line shifts later offsets
    one character left (units lose their last character and start with "\\n"), unit k ends one character
    before the next start, the last unit is not stripped."""
    if code_compat:
        starts, pos = [], 0
        for line in [x for x in text.split("\n") if x]:
            if re.match(pattern, line):
                starts.append(pos)
                if len(starts) >= max_units:
                    break
            pos += len(line) + 1
        ends = [s - 1 for s in starts[1:]] + [len(text)]
        return [(s, e) for s, e in zip(starts, ends)]
    starts = [m.start() for m in re.finditer(pattern, text, re.M)][:max_units]
    spans = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(text)
        e = s + len(text[s:e].rstrip())
        if e > s:
            spans.append((s, e))
    return spans


def entropy_units(entropy: list[float], threshold: float, max_units: int, boundary: str = "before",
                  cap: bool = True) -> list[tuple[int, int]]:
    """Token spans tiling [0, n) split at entropy peaks (H_i > threshold); H_i is the entropy of the distribution
    that produced token i. `before`: a peak token starts a unit; `after` (the reference): it ends one.
    With `cap`, only the first max_units - 1 interior boundaries are kept (the last unit absorbs the rest)."""
    n = len(entropy)
    if n == 0:
        return []
    if boundary == "before":
        interior = [i for i in range(1, n) if entropy[i] > threshold]
    elif boundary == "after":
        interior = [i + 1 for i in range(n - 1) if entropy[i] > threshold]
    else:
        raise ValueError(f"entropy_boundary: expected before or after, got {boundary!r}")
    if cap:
        interior = interior[: max(max_units - 1, 0)]
    bounds = [0] + interior + [n]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def blank_token_id(tokenizer) -> int:
    """The token that blanks a unit in a counterfactual: " ", which must be one token (a ValueError naming the flag)."""
    ids = tokenizer.encode(" ", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"model_name_or_path: the tokenizer encodes ' ' as {ids}, not one token to blank units")
    return ids[0]


def unit_pattern_name(name: str, dataset: str) -> str:
    """`auto` resolved: lines on the built-in task, labels on any other `dataset`; any other name as it is."""
    return name if name != "auto" else "lines" if dataset.startswith("builtin") else "labels"


def unit_pattern(name: str, dataset: str) -> str:
    """The regex of a unit pattern (drca.py's `--unit_pattern`): a named pattern (UNIT_PATTERNS), `auto`
    (unit_pattern_name) or a raw regex, which must compile (a ValueError naming the flag)."""
    name = unit_pattern_name(name, dataset)
    try:
        return re.compile(UNIT_PATTERNS.get(name, name)).pattern
    except re.error as e:
        raise ValueError(f"unit_pattern: not a regular expression ({e})") from None


def response_units(response: list[int], entropy, tokenizer, decode, skip: int, extraction: str, pattern: str,
                   max_units: int, threshold: float, boundary: str = "before", cap: bool = True,
                   code_compat: bool = False) -> list[tuple[int, int]]:
    """Unit token spans [s, e) of one response (response-token coordinates): after `skip` tokens (-1: a leading think
    block), split by the regex `pattern` (extraction `regex`) or at entropy peaks above `threshold` (`entropy`:
    `entropy` holds the entropy at each response token, as shared/logprobs.py::response_entropies gives it), at most
    `max_units`. The last token (EOS or the length cut) is never in a unit; empty spans are dropped."""
    if skip < 0:
        skip = think_prefix_length([tokenizer.decode([t]) for t in response])
    text_ids = response[skip:-1]
    if not text_ids:
        return []
    if extraction == "entropy":
        spans = entropy_units(entropy[skip : skip + len(text_ids)].tolist(), threshold, max_units, boundary, cap)
    else:
        text, offsets = decode(text_ids), char_offsets(decode, text_ids)
        spans = [char_span_to_tokens(offsets, cs, ce) for cs, ce in regex_units(text, pattern, max_units, code_compat)]
    return [(skip + s, skip + e) for s, e in spans if e > s]
