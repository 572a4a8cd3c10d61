"""Datasets, prompt formatting, tokenization and batching.

Sources (`dataset` argument):
  - "builtin": the built-in running-sums task (shared/task.py), splits "train" / "test";
  - a local file: *.jsonl, *.json (a list of objects, or JSON lines) or *.parquet;
  - a hub dataset: "org/name" or "org/name:config" (e.g. "openai/gsm8k:main"), loaded with `datasets`.

Every row is validated: a missing key, an empty or non-string field, a malformed JSON line or a
non-UTF-8 file raises one ValueError naming the dataset, split and row. Prompts longer than
`max_prompt_length` tokens are dropped and counted (the caller logs the count).

Tokenization keeps exactly one BOS: with a chat template the template's text is tokenized with
`add_special_tokens=False`; without one the tokenizer adds its BOS (if it has one) once (pitfalls P5).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared import task as builtin_task


class DataError(ValueError):
    pass


def _read_local(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line} is not valid UTF-8 ({e.reason})") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    else:
        rows = []
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {i} is not valid JSON: {e.msg}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} is a {type(row).__name__}, expected a JSON object")
    return rows


def load_rows(dataset: str, split: str) -> list[dict]:
    """Raw rows of one split of a dataset (see module docstring for the accepted sources)."""
    if dataset == "builtin":
        return builtin_task.builtin_split(split)
    path = Path(dataset)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        # a local file holds one split; `split` may pick a sibling file "<stem>.<split><suffix>" if it exists
        sibling = path.with_name(f"{path.stem}.{split}{path.suffix}")
        chosen = sibling if sibling.exists() else path
        if not chosen.exists():
            raise DataError(f"dataset file {chosen} does not exist")
        return _read_local(chosen)
    if path.exists():
        raise DataError(f"dataset {dataset!r}: unsupported file type (use .jsonl, .json or .parquet)")
    import datasets

    name, _, config = dataset.partition(":")
    return list(datasets.load_dataset(name, config or None, split=split))


def select_fields(rows: list[dict], where: str, keys: dict[str, str]) -> list[dict]:
    """Validate and rename fields: keys maps our name ('prompt', 'answer', ...) to the dataset's column.

    Returns new dicts with our names plus every original column (for reward functions that need them)."""
    if not rows:
        raise DataError(f"{where}: no rows")
    out = []
    for i, row in enumerate(rows):
        new = dict(row)
        for ours, theirs in keys.items():
            if theirs not in row:
                raise DataError(f"{where} row {i}: missing key {theirs!r} (has {sorted(row)})")
            value = row[theirs]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str):
                raise DataError(f"{where} row {i}: field {theirs!r} is a {type(value).__name__}, expected text")
            if not value.strip():
                raise DataError(f"{where} row {i}: field {theirs!r} is empty")
            new[ours] = value
        out.append(new)
    return out


def format_prompt(text: str, template: str) -> str:
    """Fill the prompt template, e.g. '[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:' (VinePPO, graders.md §1)."""
    return template.replace("{prompt}", text)


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids of a prompt with exactly one BOS (if the tokenizer has one)."""
    if use_chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text, add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]  # a template or text that already carried a BOS: keep one
    return ids


def encode_response(tokenizer, text: str) -> list[int]:
    """Response token ids followed by EOS (SFT / preference data); no BOS."""
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


@dataclass
class PromptData:
    rows: list[dict]
    prompt_ids: list[list[int]]
    num_filtered: int = 0  # prompts dropped for being longer than max_prompt_length


def load_prompts(dataset: str, split: str, tokenizer, prompt_key: str = "prompt", answer_key: str = "answer",
                 prompt_template: str = "{prompt}", use_chat_template: bool = False, max_prompt_length: int = 512,
                 response_key: str | None = None, limit: int | None = None) -> PromptData:
    """Load, validate, format and tokenize one split. Rows get 'prompt', 'answer' (and 'response')."""
    keys = {"prompt": prompt_key, "answer": answer_key}
    if response_key:
        keys["response"] = response_key
    where = f"dataset {dataset!r} split {split!r}"
    rows = select_fields(load_rows(dataset, split), where, keys)
    if limit:
        rows = rows[:limit]
    kept_rows, kept_ids = [], []
    for row in rows:
        ids = encode_prompt(tokenizer, format_prompt(row["prompt"], prompt_template), use_chat_template)
        if len(ids) <= max_prompt_length:
            kept_rows.append(row)
            kept_ids.append(ids)
    if not kept_rows:
        raise DataError(f"{where}: all {len(rows)} prompts are longer than max_prompt_length={max_prompt_length}")
    return PromptData(kept_rows, kept_ids, len(rows) - len(kept_rows))


@dataclass
class PromptSampler:
    """Epoch-wise shuffled prompt indices, identical on every rank (seeded), with a resumable position.

    `next_indices(n)` returns the next n indices of the global batch; each rank then takes its slice,
    so ranks see different prompts and no prompt repeats within an epoch."""

    num_items: int
    seed: int
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def _perm(self) -> list[int]:
        order = list(range(self.num_items))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_indices(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = self._perm()
            if self.position >= self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._perm()
            take = min(n - len(out), self.num_items - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._order = state["epoch"], state["position"], []


def pad_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device=None):
    """Right-padded [prompt | response | pad] batch.

    Returns input_ids, attention_mask and response_mask (1 on response tokens, EOS included), all [B, L].
    Masks come from lengths, never from comparing ids with pad_id, so pad_token_id == eos_token_id is safe."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L = max(lengths)
    B = len(prompts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_mask[i, len(p) : len(p) + len(r)] = 1
    if device is not None:
        input_ids, attention_mask, response_mask = (t.to(device) for t in (input_ids, attention_mask, response_mask))
    return input_ids, attention_mask, response_mask
