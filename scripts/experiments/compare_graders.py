"""Experiment (not a test): Our graders vs math-verify on the hand-written grading cases of tests/grader_cases.py.

    python scripts/experiments/compare_graders.py       # writes docs/bench/graders/<device>_<time>.json

Three graders, each scored against the human verdict of every case (GSM8K and MATH; gold answers and solutions):
  - `math`: `--reward_fn math` / `gsm8k` (shared/graders.py: the VinePPO protocol with its documented differences);
  - `math_verify`: `--reward_fn math_verify`: the same extraction (the response's candidate answers, the gold's box
    or bare answer) with math-verify's `verify` as the equivalence check, in our sandboxed worker (GSM8K cases: the
    gsm8k grader);
  - `math-verify end to end`: math-verify alone, its own extraction too (`parse` the gold, `parse` the response,
    `verify`); a bare MATH gold is parsed as `$gold$`; a GSM8K response without `####` scores 0 as ours.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_common as bc  # noqa: E402


def math_verify_end_to_end(task: str, question: str, gold: str, response: str) -> bool:
    from math_verify import parse, verify

    from shared import graders

    if task == "gsm8k":
        pred = graders.extract_gsm8k_answer(response)
        if pred is None:
            return False
        return verify(parse(graders.gsm8k_gold_from_solution(gold) if "####" in gold else gold), parse(pred))
    gold_parsed = parse(gold if graders.is_math_solution(gold) else f"${gold}$")
    return bool(verify(gold_parsed, parse(response)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "graders")
    a = p.parse_args()
    from grader_cases import CASES, PROTOCOL

    from shared import graders

    contenders = {
        "math": lambda t, q, g, r: bool(graders.grade(t, r, g, question=q)),
        "math_verify": lambda t, q, g, r: bool(graders.grade("math_verify" if t == "math" else t, r, g, question=q)),
        "math-verify end to end": math_verify_end_to_end,
    }
    results = {}
    for name, fn in contenders.items():
        wrong, start = [], time.perf_counter()
        for task, question, gold, response, expected, note in CASES:
            try:
                got = bool(fn(task, question, gold, response))
            except Exception as e:  # noqa: BLE001 - a crashing grader is a wrong verdict, named
                got = f"raised {type(e).__name__}"
            if got != expected:
                wrong.append({"case": note, "task": task, "gold": gold, "response": response, "expected": expected,
                              "got": got})
        results[name] = {"correct": len(CASES) - len(wrong), "wrong": wrong,
                         "seconds": round(time.perf_counter() - start, 2)}
        print(f"{name:26s} {len(CASES) - len(wrong)}/{len(CASES)}  wrong: {[w['case'] for w in wrong]}")
    out = {"benchmark": "graders", "env": bc.environment(),
           "command": "python scripts/experiments/compare_graders.py",
           "math_verify_version": importlib.metadata.version("math-verify"),
           "num_cases": len(CASES), "num_math": sum(c[0] == "math" for c in CASES),
           "num_gsm8k": sum(c[0] == "gsm8k" for c in CASES), "protocol_cases": PROTOCOL, "results": results}
    print(bc.write_result("graders", out, a.results, latest=False))


if __name__ == "__main__":
    main()
