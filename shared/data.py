"""Datasets, prompt formatting, tokenization and batching.

Sources (`dataset` argument):
  - "builtin": the built-in running-sums task (shared/task.py), splits "train" / "test"; "builtin:sums-N" the
    same task with N terms (N = 3..12; "builtin" is "builtin:sums-4");
  - a local file: *.jsonl, *.json (a list of objects, or JSON lines) or *.parquet. Split `s` reads the sibling
    file `<stem>.<s><suffix>` when it exists; a file with no such siblings at all is split by `holdout_split`
    (a fixed 10% held out for evaluation, disjoint from training; said at start; under 10 rows, all of it is
    used for both, with a warning);
  - a hub dataset: "org/name" or "org/name:config" (e.g. "openai/gsm8k:main"), loaded with `datasets`.

Every row is validated: a missing key, an empty or non-string field, a NaN or infinite number, a malformed JSON
line, a lone surrogate in a JSON string or a non-UTF-8 file raises one ValueError naming the dataset, split and row;
so does a local path that does not exist (a path is never sent to the hub) or a hub dataset that cannot be loaded.
Prompts longer than `max_prompt_length` tokens are dropped and counted (the caller logs the count).

Preference data (dpo.py, rm.py) is loaded by `load_preferences`, with the bad-row policy documented there.

Tokenization keeps exactly one BOS: with a chat template the template's text is tokenized with
`add_special_tokens=False`; without one the tokenizer adds its BOS (if it has one) once.
"""

from __future__ import annotations

import json
import math
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
        check_unicode(row, f"{path}: row {i}")
    return rows


def check_unicode(row: dict, where: str) -> None:
    """A JSON row's text must be valid Unicode: a lone surrogate (`"\\ud800"` unpaired) is an error naming the row and
    field (tokenizers and the UTF-8 files written later cannot take it)."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        for key, value in row.items():
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{where}: field {key!r} holds a lone surrogate ({e.object[e.start:e.end]!r}), "
                                "not valid Unicode text") from None


HOLDOUT_FRACTION = 0.1
MIN_HOLDOUT_ROWS = 10
_noticed: set = set()


def holdout_split(rows: list[dict], split: str, name: str) -> list[dict]:
    """A single local file with no `<stem>.<split>` siblings: hold out a fixed, disjoint slice for evaluation.

    10% of the rows (at least 1), chosen by a fixed shuffle that depends only on the number of rows (so every run,
    seed and rank agrees), form every split but "train"; "train" gets the rest. Said once per file on stderr, with
    the sizes. A file of fewer than MIN_HOLDOUT_ROWS rows (a smoke test) is not split: all of it is used for both,
    said as a warning."""
    n = len(rows)
    if n < MIN_HOLDOUT_ROWS:
        _notice(name, f"warning: dataset {name} has {n} rows (< {MIN_HOLDOUT_ROWS}) and no {Path(name).stem}.train "
                      "/ .test files: all of it is used for training AND evaluation (held-out metrics are on "
                      "training data)")
        return rows
    order = list(range(n))
    random.Random(n).shuffle(order)
    k = max(1, round(HOLDOUT_FRACTION * n))
    held = sorted(order[:k])
    _notice(name, f"dataset {name}: no {Path(name).stem}.train / .test files, so a fixed {k} of its {n} rows "
                  f"({HOLDOUT_FRACTION:.0%}) are held out for evaluation and the other {n - k} are trained on")
    held_set = set(held)
    keep = [i for i in range(n) if i not in held_set] if split == "train" else held
    return Rows([rows[i] for i in keep], numbers=keep)


class Rows(list):
    """Rows of one split that are a subset of their file, with `numbers`: each row's index in the file, which
    errors name (so "row 7" is row 7 of the file whichever split it fell in)."""

    def __init__(self, rows: list[dict], numbers: list[int]):
        super().__init__(rows)
        self.numbers = numbers


def _groups(rows: list[dict], key) -> list[list[int]]:
    """Row indices grouped by key(row) (rows of one prompt stay together), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(json.dumps(key(row), sort_keys=True, default=str), []).append(i)
    return list(groups.values())


def dev_split(rows: list[dict], num_dev: int, part: str, name: str, key=None) -> list[dict]:
    """Carve the dev slice (model selection: output_dir/best) out of the training split: min(num_dev, 10%) of its
    prompts, with all their rows (`key(row)` names a row's prompt; default: every row its own), chosen by a shuffle
    that depends only on the number of rows (every run, seed and rank agrees). `part` "dev" returns the slice,
    "train" the rest. A split of fewer than MIN_HOLDOUT_ROWS prompts keeps no dev slice. The reported held-out
    split is never used for selection (selecting on it would overstate its accuracy). The scripts say the slice's
    size in their data line at start."""
    groups = _groups(rows, key) if key else [[i] for i in range(len(rows))]
    n = len(groups)
    k = 0 if n < MIN_HOLDOUT_ROWS or num_dev <= 0 else min(num_dev, max(1, int(HOLDOUT_FRACTION * n)))
    if k == 0:
        return rows if part == "train" else Rows([], [])
    random.Random(f"dev:{n}").shuffle(groups)
    dev = {i for g in groups[:k] for i in g}
    keep = [i for i in range(len(rows)) if (i in dev) == (part == "dev")]
    numbers = row_numbers(rows)
    return Rows([rows[i] for i in keep], numbers=[numbers[i] for i in keep])


def sample_rows(rows: list[dict], limit: int | None) -> list[dict]:
    """At most `limit` rows, drawn by a fixed-seed sample (not the first rows: files are often sorted by source or
    difficulty) and kept in file order; the same rows for every run, seed and rank."""
    n = len(rows)
    if not limit or n <= limit:
        return rows
    keep = sorted(random.Random(f"sample:{n}").sample(range(n), limit))
    numbers = row_numbers(rows)
    return Rows([rows[i] for i in keep], numbers=[numbers[i] for i in keep])


def row_numbers(rows: list[dict]) -> list[int]:
    return list(getattr(rows, "numbers", range(len(rows))))


def _notice(key: str, message: str) -> None:
    """One line on stderr, once per process and only on rank 0."""
    import os
    import sys

    if key not in _noticed and os.environ.get("RANK", "0") == "0":
        _noticed.add(key)
        print(f"[cleanrlhf] {message}", file=sys.stderr, flush=True)


def load_rows(dataset: str, split: str) -> list[dict]:
    """Raw rows of one split of a dataset (see module docstring for the accepted sources)."""
    if builtin_task.is_builtin(dataset):
        return builtin_task.builtin_split(split, builtin_task.num_terms(dataset))
    path = Path(dataset)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        # a local file holds one split; `split` may pick a sibling file "<stem>.<split><suffix>" if it exists
        sibling = path.with_name(f"{path.stem}.{split}{path.suffix}")
        chosen = sibling if sibling.exists() else path
        if not chosen.exists():
            raise DataError(f"dataset file {chosen} does not exist")
        rows = _read_local(chosen)
        if chosen == path and not list(path.parent.glob(f"{path.stem}.*{path.suffix}")):
            return holdout_split(rows, split, str(path))  # one file, no split files: never eval on train rows
        return rows
    if path.exists():
        raise DataError(f"dataset {dataset!r}: unsupported file type (use .jsonl, .json or .parquet)")
    name, _, config = dataset.partition(":")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or ("/" not in name and path.suffix):
        raise DataError(f"dataset {dataset!r} does not exist (a local .jsonl/.json/.parquet file, or a hub name "
                        "org/name[:config])")
    import datasets

    try:
        return list(datasets.load_dataset(name, config or None, split=split))
    except (FileNotFoundError, ConnectionError) as e:  # not on the hub, or no network: one line naming it
        raise DataError(f"dataset {dataset!r} split {split!r}: {' '.join(str(e).split())}") from None


def has_column(dataset: str, splits: tuple[str, ...], key: str) -> bool:
    """Whether every row of these splits has column `key` (e.g. a gold answer); False for an empty key."""
    return bool(key) and all(key in row for split in splits for row in load_rows(dataset, split))


def select_fields(rows: list[dict], where: str, keys: dict[str, str]) -> list[dict]:
    """Validate and rename fields: keys maps our name ('prompt', 'answer', ...) to the dataset's column.

    Returns new dicts with our names plus every original column (for reward functions that need them)."""
    if not rows:
        raise DataError(f"{where}: no rows")
    out = []
    for i, row in zip(row_numbers(rows), rows):
        new = dict(row)
        for ours, theirs in keys.items():
            if theirs not in row:
                raise DataError(f"{where} row {i}: missing key {theirs!r} (has {sorted(row)})")
            value = row[theirs]
            if isinstance(value, float) and not math.isfinite(value):
                raise DataError(f"{where} row {i}: field {theirs!r} is {value}, expected text or a finite number")
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
    """Fill the prompt template, e.g. '[MATH_TASK] Problem:\\n{prompt}\\n\\nSolution:' (VinePPO; docs/graders.md)."""
    return template.replace("{prompt}", text)


def encode_prompt(tokenizer, text: str | list[dict], use_chat_template: bool) -> list[int]:
    """Token ids of a prompt with exactly one BOS (if the tokenizer has one).

    `text` may also be a conversation (a list of {"role", "content"} messages), rendered with the chat
    template and ending with the generation prompt of the assistant turn."""
    if isinstance(text, list) or use_chat_template:
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the tokenizer has no chat template (needed for chat_template or conversational data)")
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False).input_ids
    else:
        ids = tokenizer(text, add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]  # a template or text that already carried a BOS: keep one
    return ids


def encode_response(tokenizer, text: str, finished: bool = True) -> list[int]:
    """Response token ids followed by EOS (SFT / preference data); no BOS. `finished` False: a response cut off at a
    length limit, without EOS (as a sampled completion that hit max_new_tokens has none)."""
    return tokenizer(text, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if finished else [])


@dataclass
class PromptData:
    rows: list[dict]
    prompt_ids: list[list[int]]
    num_filtered: int = 0  # prompts dropped for being longer than max_prompt_length


def load_prompts(dataset: str, split: str, tokenizer, prompt_key: str = "prompt", answer_key: str = "answer",
                 prompt_template: str = "{prompt}", use_chat_template: bool = False, max_prompt_length: int = 512,
                 response_key: str | None = None, limit: int | None = None, num_dev: int = 0,
                 part: str = "train") -> PromptData:
    """Load, validate, format and tokenize one split. Rows get 'prompt', 'answer' (unless answer_key is empty) and
    'response' (if response_key is given). `limit`: a fixed sample of that many rows (`sample_rows`). `num_dev` > 0:
    the split minus its dev slice (`part` "train") or the dev slice itself (`part` "dev", possibly empty)."""
    keys = {"prompt": prompt_key}
    if answer_key:
        keys["answer"] = answer_key
    if response_key:
        keys["response"] = response_key
    where = f"dataset {dataset!r} split {split!r}"
    rows = select_fields(load_rows(dataset, split), where, keys)
    if num_dev or part == "dev":  # num_dev 0: no dev slice, so part "dev" is empty
        rows = dev_split(rows, num_dev, part, f"dataset {dataset!r} split {split!r}")
        if not rows:
            return PromptData([], [], 0)
    rows = sample_rows(rows, limit)
    kept_rows, kept_ids = [], []
    for row in rows:
        ids = encode_prompt(tokenizer, format_prompt(row["prompt"], prompt_template), use_chat_template)
        if len(ids) <= max_prompt_length:
            kept_rows.append(row)
            kept_ids.append(ids)
    if not kept_rows and part != "dev":  # a dev slice may end up empty: then there is no best checkpoint
        raise DataError(f"{where}: all {len(rows)} prompts are longer than max_prompt_length={max_prompt_length}")
    return PromptData(kept_rows, kept_ids, len(rows) - len(kept_rows))


@dataclass
class PreferenceData:
    rows: list[dict]
    prompt_ids: list[list[int]]
    chosen_ids: list[list[int]]     # response tokens + EOS
    rejected_ids: list[list[int]]
    num_identical: int = 0          # rows skipped because chosen == rejected
    num_too_long: int = 0           # rows skipped for max_prompt_length / max_seq_length

    def __len__(self) -> int:
        return len(self.rows)


def _check_messages(value, where: str, field_name: str) -> list[dict]:
    if not value:
        raise DataError(f"{where}: field {field_name!r} is an empty conversation")
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: field {field_name!r} message {j} is not a {{'role', 'content'}} text message")
    return value


def _preference_text(row: dict, key: str, where: str, allow_blank: bool = False):
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} (has {sorted(row)})")
    value = row[key]
    if isinstance(value, list):
        return _check_messages(value, where, key)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} is a {type(value).__name__}, expected text or a list of messages")
    if not value.strip() and not (allow_blank and value):
        raise DataError(f"{where}: field {key!r} is empty")
    return value


def load_preferences(dataset: str, split: str, tokenizer, prompt_key: str = "prompt", chosen_key: str = "chosen",
                     rejected_key: str = "rejected", prompt_template: str = "{prompt}",
                     response_template: str = "{response}", use_chat_template: bool = False,
                     max_prompt_length: int = 512, max_seq_length: int = 1024, limit: int | None = None,
                     num_dev: int = 0, part: str = "train") -> PreferenceData:
    """Load and tokenize (prompt, chosen, rejected) pairs.

    Row formats ("builtin": the built-in task's pairs, shared/task.py::builtin_preferences):
      - text: `prompt`, `chosen`, `rejected` are strings (chosen/rejected are the responses only);
      - conversational (TRL style): `chosen` / `rejected` are lists of {"role", "content"} messages ending
        with the assistant reply; the prompt is the `prompt` column (text or messages) if present, else the
        messages before the reply, which must be the same in chosen and rejected. Rendered with the chat template.

    Bad-row policy: a missing, non-text or empty prompt/chosen/rejected field, or a malformed conversation,
    is an error naming the row (the file is broken; silently training on part of it would hide that). A
    row whose chosen and rejected responses are identical carries no preference: it is skipped and counted
    (`num_identical`), as are rows over max_prompt_length / max_seq_length (`num_too_long`). If no row is
    left, that is an error."""
    where = f"dataset {dataset!r} split {split!r}"
    raw = builtin_task.preferences(dataset, split) if builtin_task.is_builtin(dataset) else load_rows(dataset, split)
    if not raw:
        raise DataError(f"{where}: no rows")
    if num_dev or part == "dev":  # the dev slice (or the rest): as in load_prompts
        raw = dev_split(raw, num_dev, part, f"dataset {dataset!r} split {split!r}",
                        key=lambda r: r.get(prompt_key, r.get(chosen_key, [])[:-1]))
        if not raw:
            return PreferenceData([], [], [], [])
    raw = sample_rows(raw, limit)
    numbers = row_numbers(raw)
    out = PreferenceData([], [], [], [])
    for i, row in zip(numbers, raw):
        at = f"{where} row {i}"
        blank_ok = dataset == builtin_task.COUNTERFACTUAL  # its counterfactuals include a response of blanks only
        chosen = _preference_text(row, chosen_key, at, blank_ok)
        rejected = _preference_text(row, rejected_key, at, blank_ok)
        if isinstance(chosen, list) != isinstance(rejected, list):
            raise DataError(f"{at}: {chosen_key!r} and {rejected_key!r} must both be text or both be conversations")
        if isinstance(chosen, list):
            if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
                raise DataError(f"{at}: the last message of {chosen_key!r} and {rejected_key!r} must be the assistant's")
            if prompt_key in row:
                prompt = _preference_text(row, prompt_key, at)
            else:
                if chosen[:-1] != rejected[:-1]:
                    raise DataError(f"{at}: chosen and rejected conversations differ before the last reply "
                                    f"and there is no {prompt_key!r} column")
                prompt = chosen[:-1]
                if not prompt:
                    raise DataError(f"{at}: the conversation has no prompt before the reply")
            chosen, rejected = chosen[-1]["content"], rejected[-1]["content"]
            for key, text in ((chosen_key, chosen), (rejected_key, rejected)):
                if not text.strip():
                    raise DataError(f"{at}: field {key!r} has an empty reply")
        else:
            prompt = _preference_text(row, prompt_key, at)
        if isinstance(prompt, str):
            prompt = format_prompt(prompt, prompt_template)
        p = encode_prompt(tokenizer, prompt, use_chat_template)
        c = encode_response(tokenizer, response_template.replace("{response}", chosen))
        r = encode_response(tokenizer, response_template.replace("{response}", rejected))
        if c == r:
            out.num_identical += 1
            continue
        if len(p) > max_prompt_length or len(p) + max(len(c), len(r)) > max_seq_length:
            out.num_too_long += 1
            continue
        out.rows.append({**row, "prompt": prompt,
                         "chosen": chosen, "rejected": rejected})
        out.prompt_ids.append(p)
        out.chosen_ids.append(c)
        out.rejected_ids.append(r)
    if not out.rows and part != "dev":  # an empty dev slice: no best checkpoint
        raise DataError(f"{where}: no usable pair ({out.num_identical} with identical chosen and rejected, "
                        f"{out.num_too_long} over max_prompt_length={max_prompt_length} / "
                        f"max_seq_length={max_seq_length})")
    return out


@dataclass
class UnpairedData:
    rows: list[dict]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # response tokens + EOS
    desirable: list[bool]
    num_too_long: int = 0            # rows skipped for max_prompt_length / max_seq_length

    def __len__(self) -> int:
        return len(self.rows)


def load_unpaired(dataset: str, split: str, tokenizer, prompt_key: str = "prompt", completion_key: str = "completion",
                  label_key: str = "label", prompt_template: str = "{prompt}", response_template: str = "{response}",
                  use_chat_template: bool = False, max_prompt_length: int = 512, max_seq_length: int = 1024,
                  limit: int | None = None, num_dev: int = 0, part: str = "train") -> UnpairedData:
    """Load and tokenize unpaired (prompt, completion, label) examples, TRL's unpaired preference format (KTO).

    Row formats: text (`prompt` and `completion` strings, the completion the response only) or conversational
    (`prompt` a list of {"role", "content"} messages, `completion` a list ending with the assistant reply, rendered
    with the chat template); `label` is true (desirable) or false (undesirable).

    Bad-row policy: a missing, non-text or empty prompt/completion, a malformed conversation, or a label that is not
    true/false is an error naming the row. Rows over max_prompt_length / max_seq_length are skipped and counted
    (`num_too_long`). If no row is left, that is an error."""
    where = f"dataset {dataset!r} split {split!r}"
    raw = load_rows(dataset, split)
    if not raw:
        raise DataError(f"{where}: no rows")
    if num_dev or part == "dev":  # the dev slice (or the rest), grouped by prompt: as in load_prompts
        raw = dev_split(raw, num_dev, part, where, key=lambda r: r.get(prompt_key))
        if not raw:
            return UnpairedData([], [], [], [])
    raw = sample_rows(raw, limit)
    out = UnpairedData([], [], [], [])
    for i, row in zip(row_numbers(raw), raw):
        at = f"{where} row {i}"
        prompt, completion = _preference_text(row, prompt_key, at), _preference_text(row, completion_key, at)
        if label_key not in row:
            raise DataError(f"{at}: missing key {label_key!r} (has {sorted(row)})")
        if not isinstance(row[label_key], bool):
            raise DataError(f"{at}: field {label_key!r} is {row[label_key]!r}, expected true or false")
        if isinstance(completion, list):
            if completion[-1]["role"] != "assistant":
                raise DataError(f"{at}: the last message of {completion_key!r} must be the assistant's")
            if isinstance(prompt, str):
                raise DataError(f"{at}: {completion_key!r} is a conversation, so {prompt_key!r} must be one too")
            completion = completion[-1]["content"]
            if not completion.strip():
                raise DataError(f"{at}: field {completion_key!r} has an empty reply")
        if isinstance(prompt, str):
            prompt = format_prompt(prompt, prompt_template)
        p = encode_prompt(tokenizer, prompt, use_chat_template)
        c = encode_response(tokenizer, response_template.replace("{response}", completion))
        if len(p) > max_prompt_length or len(p) + len(c) > max_seq_length:
            out.num_too_long += 1
            continue
        out.rows.append({**row, "prompt": prompt, "completion": completion})
        out.prompt_ids.append(p)
        out.completion_ids.append(c)
        out.desirable.append(row[label_key])
    if not out.rows and part != "dev":  # an empty dev slice: no best checkpoint
        raise DataError(f"{where}: no usable example ({out.num_too_long} over max_prompt_length={max_prompt_length} "
                        f"/ max_seq_length={max_seq_length})")
    return out


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


def sampler_logprobs(prompt_lens: list[int], logprobs: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """The generator's log-probs of each completion's tokens, [B, L-1] like the trainer's (position t predicts token
    t+1, so completion token k of a row with a p-token prompt sits at column p - 1 + k), 0 elsewhere."""
    out = torch.zeros_like(like)
    for i, (p, lp) in enumerate(zip(prompt_lens, logprobs)):
        out[i, p - 1 : p - 1 + len(lp)] = torch.tensor(lp, dtype=out.dtype)
    return out


def micro_batches(rows: list[int], lengths: list[int], num: int, layout: str) -> list[list[int]]:
    """Split `rows` (indices into a padded batch) into exactly `num` micro-batches (grpo's --micro_batching; the PPO
    family uses `padded`).

    `lengths[i]` is the token count (prompt + completion) of batch row i. The number of micro-batches never
    depends on the lengths: DeepSpeed's gradient-accumulation boundary and ZeRO-3's per-forward collectives
    count on the same number of forwards on every rank.
      padded: consecutive slices of `rows` as given, len(rows) / num rows each (the order the caller drew)
      sorted: the same slices of `rows` ordered by length, longest first (ties keep their order), so that each
              micro-batch holds rows of similar length and its padding can be cut to its own longest row
      packed: rows given, longest first, to the micro-batch with the fewest tokens so far (ties: the first),
              so that every micro-batch holds about sum(lengths) / num tokens; row counts may differ"""
    if num < 1 or len(rows) % num:
        raise ValueError(f"micro_batches: {len(rows)} rows do not split into {num} micro-batches of equal size")
    size = len(rows) // num
    if layout == "padded":
        return [list(rows[k * size : (k + 1) * size]) for k in range(num)]
    by_length = sorted(rows, key=lambda i: -lengths[i])  # stable: equal lengths keep the caller's order
    if layout == "sorted":
        return [by_length[k * size : (k + 1) * size] for k in range(num)]
    if layout == "packed":
        out, tokens = [[] for _ in range(num)], [0] * num
        for i in by_length:
            k = tokens.index(min(tokens))
            out[k].append(i)
            tokens[k] += lengths[i]
        return out
    raise ValueError(f"micro_batching: expected padded, sorted or packed, got {layout!r}")


def pack_rows(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """First-fit decreasing: place sequences of `lengths` tokens into as few rows of `width` tokens as this finds,
    longest first, each into the first row with room. Returns (row, offset of its first token) per sequence."""
    if lengths and max(lengths) > width:
        raise ValueError(f"pack_rows: a sequence of {max(lengths)} tokens does not fit a row of {width}")
    used: list[int] = []
    place = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        row = next((r for r, u in enumerate(used) if u + lengths[i] <= width), len(used))
        if row == len(used):
            used.append(0)
        place[i] = (row, used[row])
        used[row] += lengths[i]
    return place
