"""Stage 1 of linguistic calibration: the summary-distillation SFT data of `builtin:tiny-lc-sft` (docs/calibration.md).

    python scripts/builders/lc_sft_data.py                               # ~2 min on 2 cores; writes the two files below
    python algorithms/sft.py --model_name_or_path builtin:tiny-sft --dataset shared/builtin_models/lc_sft/sums.jsonl \
        --reward_fn algorithms/calibration.py:reader_accuracy   # the recipe of builtin:tiny-lc-sft (shared/tiny.py)

For every prompt of the built-in task: M = 10 samples from `builtin:tiny-sft` at temperature 1 (its own beliefs), then
one target response = the lines of the first sample whose answer is the most frequent one, and a confidence line that
lists the distinct answers by count with 10 * count percent (`13@70;14@30`, at most 4: calibration.py's
summary_line). This is the paper's recipe (M paragraphs summarised into one text whose percentages "reflect the
proportion of beliefs") with counting in place of the summarising LM. The gold answer is never used for the target.
Writes shared/builtin_models/lc_sft/sums.train.jsonl (the train split) and sums.test.jsonl (the held-out split, for
sft.py's held-out accuracy; their targets are never trained on).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "algorithms"))

from calibration import summary_line  # noqa: E402
from shared import task  # noqa: E402
from shared.distributed import load_causal_lm, load_tokenizer  # noqa: E402
from shared.models import resolve_model_path  # noqa: E402


def distill(samples: list[str]) -> str:
    """Target response from M sampled responses: the first modal sample's lines, then the confidence line."""
    answers = [task.extract_answer(s) if s.strip() else None for s in samples]
    answers = [a if a is not None and a.isdigit() else None for a in answers]
    line = summary_line(answers)
    if not line:  # no sample ends on a number: the first sample, no confidence line (reads as no answer)
        return samples[0].strip()
    mode = line.split("@")[0]
    body = next(s for s, a in zip(samples, answers) if a == mode)
    return body.strip() + "\n" + line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-sft")
    p.add_argument("--num_samples", type=int, default=10, help="M: samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--batch_prompts", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "shared" / "builtin_models" / "lc_sft")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    path = resolve_model_path(a.model)
    tok, model = load_tokenizer(path), load_causal_lm(path, torch.float32).eval()
    a.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = task.builtin_split(split)
        with open(a.out / f"sums.{split}.jsonl", "w") as f:
            for start in range(0, len(rows), a.batch_prompts):
                batch = rows[start : start + a.batch_prompts]
                ids = torch.tensor([tok(r["prompt"])["input_ids"] for r in batch])  # equal lengths: no padding
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                         top_k=0, max_new_tokens=a.max_new_tokens, num_return_sequences=a.num_samples,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
                texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
                for i, r in enumerate(batch):
                    samples = texts[i * a.num_samples : (i + 1) * a.num_samples]
                    f.write(json.dumps({"prompt": r["prompt"], "response": distill(samples), "answer": r["answer"]})
                            + "\n")
                print(f"[lc_sft_data] {split}: {start + len(batch)}/{len(rows)}", flush=True)


if __name__ == "__main__":
    main()
