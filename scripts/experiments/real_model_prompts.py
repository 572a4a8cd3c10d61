"""Experiment (not a test): Which prompt template and grader give a real chat model a reward signal?

    python scripts/experiments/real_model_prompts.py                       # SmolLM2-135M-Instruct, chat sums, ~6 min on CPU
    python scripts/experiments/real_model_prompts.py --model Qwen/Qwen2.5-0.5B-Instruct --gpu

On the 100 held-out chat-sums questions (or the first --num_prompts rows of any --dataset) (shared/task.py, GSM8K format: "What is 12+7?" / "12 + 7 = 19\\n#### 19"),
asked through the chat template, each (prompt template, grader) pair is scored with the grader the training scripts
use: held-out accuracy when sampling (T = 1 and T = 0.7, 4 samples per prompt) and greedily, the share of
completions that end their turn within 32 tokens, that contain GSM8K's "####" answer line, and their mean length.
An RL run only learns where some samples are rewarded: a pair at ~0% gives GRPO nothing to work with.
Writes docs/bench/real_model_prompts/<device>_<time>.json; docs/real_models.md quotes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_common as bc  # noqa: E402

# (name, prompt template, --reward_fn)
PAIRS = [
    ("gsm8k_hash_line", "{prompt}\nGive the final answer on the last line in the form '#### <number>'.", "gsm8k"),
    ("gsm8k_format_example", "{prompt}\nReply in this format:\n<your reasoning>\n#### <number>", "gsm8k"),
    ("math_plain", "{prompt}", "math"),
    ("math_the_answer_is", "{prompt} End with 'The answer is <number>.'", "math"),
    ("math_number_only", "{prompt} Answer with the number only.", "math"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--gpu", action="store_true", help="require a CUDA device (bf16)")
    p.add_argument("--dataset", default="chat_sums", help="`chat_sums` (built in) or any dataset the scripts accept")
    p.add_argument("--split", default="test")
    p.add_argument("--prompt_key", default="question")
    p.add_argument("--answer_key", default="answer")
    p.add_argument("--num_prompts", type=int, default=100)
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "real_model_prompts")
    a = p.parse_args()
    env = bc.environment(require_gpu=a.gpu)

    import torch

    from shared import data
    from shared.distributed import default_dtype, load_tokenizer
    from shared.generation import VLLMGenerator, completion_decoder, stop_token_ids
    from shared.models import resolve_model_path
    from shared.rewards import compute_rewards, load_reward_fn
    from shared.task import chat_sums_split

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    dtype = default_dtype(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    gen = VLLMGenerator(path, tok, dtype, seed=0, max_model_len=512, stop_token_ids=stop_token_ids(path, tok))
    decode = completion_decoder(tok)
    if a.dataset == "chat_sums":
        rows = chat_sums_split(a.split)[: a.num_prompts]
    else:
        rows = data.select_fields(data.load_rows(a.dataset, a.split), a.dataset,
                                  {"question": a.prompt_key, "answer": a.answer_key})[: a.num_prompts]
    results = []
    for name, template, grader in PAIRS:
        prompts = [data.encode_prompt(tok, data.format_prompt(r["question"], template), True) for r in rows]
        reward_fn = load_reward_fn(grader)
        entry = {"name": name, "prompt_template": template, "reward_fn": grader}
        for label, temperature, n in (("sampled_t1", 1.0, a.samples), ("sampled_t0.7", 0.7, a.samples),
                                      ("greedy", 0.0, 1)):
            outs = gen.generate(prompts, n=n, temperature=temperature, top_p=1.0, max_new_tokens=a.max_new_tokens,
                                seed=1)
            comps = [c for g in outs for c in g]
            texts = [decode(c.token_ids) for c in comps]
            flat = [r for r in rows for _ in range(n)]
            scores = compute_rewards(reward_fn, [r["question"] for r in flat], texts, [r["answer"] for r in flat],
                                     [c.finished for c in comps], flat)
            entry[label] = {"accuracy": sum(scores) / len(scores),
                            "finished": sum(c.finished for c in comps) / len(comps),
                            "has_hash_line": sum("####" in t for t in texts) / len(texts),
                            "mean_tokens": sum(len(c.token_ids) for c in comps) / len(comps), "n": len(comps),
                            "example": texts[0]}
            print(f"{name:22s} {label:13s} accuracy {entry[label]['accuracy']:.3f} finished "
                  f"{entry[label]['finished']:.2f} '####' {entry[label]['has_hash_line']:.2f}", flush=True)
        results.append(entry)
    out = bc.write_result("real_model_prompts", {
        "benchmark": "real_model_prompts", "env": env, "model": a.model,
        "command": "python " + " ".join(sys.argv),
        "data": f"{a.dataset} split {a.split}, first {len(rows)} rows, chat template",
        "max_new_tokens": a.max_new_tokens, "results": results}, a.results, latest=False)
    print(out)


if __name__ == "__main__":
    main()
