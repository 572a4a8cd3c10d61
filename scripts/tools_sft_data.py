"""The SFT data of `builtin:tiny-tools-sft`: `builtin:sums-10` written with one calculator call per line.

    python scripts/tools_sft_data.py            # seconds; writes the two files below
    python algorithms/sft.py --dataset shared/builtin_models/tools_sft/sums10.jsonl --tool_results --reward_fn builtin \
        --max_new_tokens 128                     # the recipe of builtin:tiny-tools-sft (shared/tiny.py)

Each row is a problem of `builtin:sums-10` (shared/task.py) with its response in grpo_tools.py's syntax
(shared/tools.py `tool_response`): "3+4+5=" -> "<<3+4=7>>\\n<<7+5=12>>\\n12". sft.py's `--tool_results` leaves
the results ("7>>", "12>>") out of the loss. Writes shared/builtin_models/tools_sft/sums10.train.jsonl (the first
5,000 problems of the train split) and sums10.test.jsonl (the 500 held-out problems, the task's test split).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import task  # noqa: E402
from shared.tools import tool_response  # noqa: E402

TERMS, TRAIN_ROWS = 10, 5000
OUT = ROOT / "shared" / "builtin_models" / "tools_sft"


def rows(split: str, limit: int | None = None) -> list[dict]:
    out = []
    for row in task.builtin_split(split, TERMS)[:limit]:
        out.append({"prompt": row["prompt"], "response": tool_response(task.prompt_terms(row["prompt"])),
                    "answer": row["answer"]})
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for split, limit in (("train", TRAIN_ROWS), ("test", None)):
        path = OUT / f"sums10.{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(split, limit)))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
