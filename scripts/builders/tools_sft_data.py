"""The SFT data of `builtin:tiny-tools-sft`: `builtin:sums-10` written with a calculator call.

    python scripts/builders/tools_sft_data.py            # seconds; writes the two files below
    python algorithms/sft.py --dataset shared/builtin_models/tools_sft/sums10.jsonl --tool_results --reward_fn builtin \
        --max_new_tokens 64                      # the recipe of builtin:tiny-tools-sft (shared/tiny.py)

Each row is a problem of `builtin:sums-10` (shared/task.py) with its response in grpo_tools.py's syntax
(shared/tools.py `tool_response`): one call on the whole sum, then the answer: "3+4+5=" -> "<<3+4+5=12>>\\n12".
sft.py's `--tool_results` leaves the result ("12>>") out of the loss. One call per running sum (`--per_line`,
"<<3+4=7>>\\n<<7+5=12>>\\n12") was tried first: sft.py's recipe on it gave a model that made its nine calls
well-formed but, in most sampled episodes, added the wrong term of the prompt at some line (one short run, not
stored); the single call only asks it to copy.
Writes shared/builtin_models/tools_sft/sums10.train.jsonl (the first 5,000 problems of the train split) and
sums10.test.jsonl (the 500 held-out problems, the task's test split).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared import task  # noqa: E402
from shared.tools import tool_response  # noqa: E402

TERMS, TRAIN_ROWS = 10, 5000
OUT = ROOT / "shared" / "builtin_models" / "tools_sft"


def rows(split: str, limit: int | None = None, per_line: bool = False) -> list[dict]:
    out = []
    for row in task.builtin_split(split, TERMS)[:limit]:
        out.append({"prompt": row["prompt"], "response": tool_response(task.prompt_terms(row["prompt"]), per_line),
                    "answer": row["answer"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per_line", action="store_true", help="one call per running sum (not the committed data)")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for split, limit in (("train", TRAIN_ROWS), ("test", None)):
        path = a.out / f"sums10.{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(split, limit, a.per_line)))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
