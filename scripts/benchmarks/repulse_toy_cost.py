"""Benchmark (not a test): what would the RePULSe toy cost on a real pretrained model?

    python scripts/benchmarks/repulse_toy_cost.py                                   # builtin:smollm2-135m on this machine
    python scripts/benchmarks/repulse_toy_cost.py --model builtin:tiny-sft          # the toy's model, for scale

The paper's toy (scripts/experiments/repulse_toy.py --paper) runs repulse.py on one prompt, 2-token completions, N = 500 samples
per step, 250k samples per run, with the exact log P(bad) (repulse.py::exact_log_prob_bad) as its measure. This
script times, on one model, the pieces a step and an evaluation are made of, with the scripts' own functions and
the toy's shapes (the prompt "This man is a", 2 new tokens, shared/toy.py's bad set):
  - `generate`: sampling N completions of 2 tokens with the HF backend (shared/generation.py::HFGenerator);
  - `train`: one forward and backward of repulse.py::forward_logprobs over the N sequences, then one AdamW step;
  - `exact`: the exact log P(bad): one forward per first token of the vocabulary (chunks of `--chunk`); on a large
    vocabulary only `--exact_chunks` chunks are timed and the rest extrapolated (said in the JSON).
It then computes a run's and the sweep's cost at the paper's budget: REINFORCE makes 500 p updates (one generate,
one train), RePULSe 250 steps with a generate and a train for each of p and q; the exact log P(bad) of p at the
paper's 50 evaluation points (every 5,000 samples) and at the start. Writes docs/bench/repulse_toy_cost/<device>_<time>.json
(rendered into docs/repulse.md by scripts/tools/docs_tables.py). An estimate from timed pieces, not a timed run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_common as bc  # noqa: E402

sys.path.insert(0, str(bc.ROOT))


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    import torch

    from algorithms.repulse import exact_log_prob_bad, forward_logprobs
    from shared import toy
    from shared.distributed import load_causal_lm, load_tokenizer
    from shared.generation import HFGenerator, stop_token_ids
    from shared.models import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--num_samples", type=int, default=500, help="N, completions per step (the paper's 500)")
    p.add_argument("--chunk", type=int, default=1024, help="first tokens per forward of the exact log P(bad)")
    p.add_argument("--exact_chunks", type=int, default=2, help="chunks of the exact log P(bad) timed when there are more")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", type=Path, default=bc.ROOT / "docs/bench/repulse_toy_cost")
    a = p.parse_args()
    torch.manual_seed(0)

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.float32)
    model.eval()
    prompt = tok(toy.PROMPT, add_special_tokens=False)["input_ids"]
    bad = toy.bad_token_ids(tok)
    stops = stop_token_ids(path, tok)
    N = a.num_samples

    generator = HFGenerator(model, tok, stop_token_ids=stops)
    generate_s = timed(lambda: generator.generate([prompt], n=N, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0),
                       a.repeats)

    ids = torch.tensor([prompt], dtype=torch.long).expand(N, -1)
    ids = torch.cat([ids, torch.randint(0, len(tok), (N, 2))], dim=1)
    attn = torch.ones_like(ids)
    mask = torch.zeros(N, ids.shape[1] - 1)
    mask[:, -2:] = 1.0  # the two completion tokens
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step():
        model.train()
        logp = forward_logprobs(model, ids, attn, mask)
        (-(logp * mask).sum() / N).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()

    train_s = timed(train_step, a.repeats)

    V = len(tok)
    n_chunks = math.ceil((V - len(bad) - len(stops)) / a.chunk)
    if n_chunks <= a.exact_chunks:  # a small vocabulary: time the whole computation
        exact_s = timed(lambda: exact_log_prob_bad(model, prompt, bad, stops, 2, a.chunk), a.repeats)
        exact_how = "timed whole"
    else:  # the first token's forward, then `exact_chunks` chunks of second-token forwards, extrapolated
        x = torch.tensor([prompt])
        with torch.no_grad():
            first_s = timed(lambda: model(input_ids=x), a.repeats)
            g = torch.arange(a.chunk)
            x2 = torch.cat([x.expand(a.chunk, -1), g[:, None]], dim=1)
            chunk_s = timed(lambda: model(input_ids=x2, logits_to_keep=1), a.exact_chunks)
        exact_s = first_s + n_chunks * chunk_s
        exact_how = f"first-token forward + {n_chunks} chunks x the median of {a.exact_chunks} timed chunks"

    steps_reinforce, steps_repulse, evals = 250_000 // N, 250_000 // (2 * N), 250_000 // 5000 + 1
    run_reinforce = steps_reinforce * (generate_s + train_s) + evals * exact_s
    run_repulse = steps_repulse * 2 * (generate_s + train_s) + evals * exact_s
    sweep_runs = {"reinforce-like (REINFORCE, r - e^-r)": 2, "RePULSe-like (RePULSe, p-proposal; 4 alphas)": 8}
    sweep_seed = 2 * run_reinforce + 8 * run_repulse  # one seed of the paper sweep (10 configurations)
    result = {"benchmark": "repulse_toy_cost", "env": bc.environment(), "command": bc.invocation(),
              "settings": {"model": a.model, "vocab": V, "bad_tokens": len(bad), "prompt_tokens": len(prompt),
                           "num_samples": N, "chunk": a.chunk, "repeats": a.repeats},
              "seconds": {"generate": generate_s, "train": train_s, "exact_log_p_bad": exact_s},
              "exact_how": exact_how,
              "per_run_hours": {"reinforce": run_reinforce / 3600, "repulse": run_repulse / 3600},
              "sweep": {"runs_per_seed": sweep_runs, "hours_per_seed": sweep_seed / 3600,
                        "hours_3_seeds": 3 * sweep_seed / 3600},
              "budget": {"samples": 250_000, "p_updates_reinforce": steps_reinforce, "steps_repulse": steps_repulse,
                         "exact_evaluations": evals}}
    out = bc.write_result("repulse_toy_cost", result, a.results, latest=False)
    print(f"[cost] {a.model}: generate {generate_s:.2f} s, train {train_s:.2f} s, exact log P(bad) {exact_s:.1f} s "
          f"({exact_how}); a REINFORCE run {run_reinforce / 3600:.1f} h, a RePULSe run {run_repulse / 3600:.1f} h, "
          f"3 seeds of the sweep {3 * sweep_seed / 3600:.0f} h; wrote {out}")


if __name__ == "__main__":
    main()
