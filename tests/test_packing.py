"""grpo.py --micro_batching {padded,sorted,packed}: the micro-batch plan (shared/data.py::micro_batches) and the
log-prob layouts (micro_batch_logprobs, packed_forward_logprobs, check_packing) against the padded computation,
on rows of very different prompt and completion lengths; attention does not cross packed sequences; and an
end-to-end run of grpo.py in each layout (slow)."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from algorithms.grpo import aggregate_loss, clipped_surrogate, completion_mask, kl_penalty
from shared.logprobs import check_packing, forward_logprobs, micro_batch_logprobs, packed_forward_logprobs
from shared import data
from shared.tiny import tiny_config

LAYOUTS = ["padded", "sorted", "packed"]
AGGREGATIONS = ["seq_mean", "token_mean", "global_token", "constant"]
# prompt and completion lengths of the 8 rows: 1 to 30 prompt tokens, 1 to 40 completion tokens
PROMPTS, COMPLETIONS = [1, 30, 4, 12, 2, 25, 7, 3], [40, 1, 3, 17, 33, 2, 9, 26]


# ---------------------------------------------------------------- the plan
def test_micro_batches_hand_computed():
    rows, lengths = [0, 1, 2, 3, 4, 5], [3, 9, 5, 9, 2, 7]
    assert data.micro_batches(rows, lengths, 2, "padded") == [[0, 1, 2], [3, 4, 5]]
    # by length, longest first, ties in the given order: 1 (9), 3 (9), 5 (7), 2 (5), 0 (3), 4 (2)
    assert data.micro_batches(rows, lengths, 2, "sorted") == [[1, 3, 5], [2, 0, 4]]
    # each row, longest first, to the micro-batch with fewer tokens (tie: the first): tokens 9|0, 9|9, 16|9,
    # 16|14, 16|17, 18|17
    assert data.micro_batches(rows, lengths, 2, "packed") == [[1, 5, 4], [3, 2, 0]]
    # a minibatch drawn by the random permutation: padded keeps its order, sorted reorders it
    assert data.micro_batches([5, 0, 4, 1], lengths, 2, "padded") == [[5, 0], [4, 1]]
    assert data.micro_batches([5, 0, 4, 1], lengths, 2, "sorted") == [[1, 5], [0, 4]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_number_of_micro_batches_never_depends_on_the_lengths(layout):
    rng = random.Random(0)
    for _ in range(200):
        num = rng.choice([1, 2, 4, 8])
        rows = rng.sample(range(64), num * rng.choice([1, 2, 3, 8]))
        lengths = [rng.choice([1, 2, 50, 400]) for _ in range(64)]
        plan = data.micro_batches(rows, lengths, num, layout)
        assert len(plan) == num and all(plan)  # exactly num, none empty
        assert sorted(sum(plan, [])) == sorted(rows)  # every row once
        if layout != "packed":
            assert {len(p) for p in plan} == {len(rows) // num}
    with pytest.raises(ValueError, match="micro_batches"):
        data.micro_batches([0, 1, 2], [1, 1, 1], 2, layout)


def test_packed_plan_balances_tokens():
    lengths = [400, 380, 20, 20, 10, 10, 5, 5]
    plan = data.micro_batches(list(range(8)), lengths, 2, "packed")
    tokens = [sum(lengths[i] for i in p) for p in plan]
    assert tokens == [425, 425]
    padded = [sum(lengths[i] for i in p) for p in data.micro_batches(list(range(8)), lengths, 2, "padded")]
    assert padded == [820, 30]


# ---------------------------------------------------------------- log-probs
@pytest.fixture(scope="module")
def batch(tiny_model):
    model, tok = tiny_model
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(5, len(tok), (n,), generator=g).tolist()  # noqa: E731
    prompts = [[tok.bos_token_id] + ids(n - 1) for n in PROMPTS]
    responses = [ids(n) for n in COMPLETIONS]
    return data.pad_batch(prompts, responses, tok.pad_token_id)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_entropies_equal_the_padded_computation(tiny_model, batch, layout):
    model, _ = tiny_model
    input_ids, attn, resp = batch
    ref_logp, ref_ent = forward_logprobs(model, input_ids, attn, resp, 0.7, True)
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7], [4, 1], [6], [7, 0, 3]):
        logp, ent = micro_batch_logprobs(model, input_ids[rows], attn[rows], resp[rows], layout, 0.7, True)
        assert logp.shape == ent.shape == (len(rows), input_ids.shape[1] - 1)
        torch.testing.assert_close(logp, ref_logp[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent[rows], atol=1e-5, rtol=0)
    # packed into rows as wide as the longest sequence (the default), here 3 rows for 4 sequences; and into one row
    # (rows 0, 1, 2, 3 of the batch: 41, 31, 7, 29 tokens; 7 goes after 31, in row 1)
    assert data.pack_rows([41, 31, 7, 29], 41) == [(0, 0), (1, 0), (1, 31), (2, 0)]
    logp, ent = packed_forward_logprobs(model, input_ids, attn, resp, 0.7, True, width=int(attn.sum()))
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_pack_rows_hand_computed():
    # longest first into the first row with room: 9 -> row 0 (9/10); 6 -> row 1 (6); 4 -> row 1 (10); 3 -> row 2;
    # 1 -> row 0 (10); 1 -> row 2 (4)
    assert data.pack_rows([4, 9, 1, 6, 3, 1], 10) == [(1, 6), (0, 0), (0, 9), (1, 0), (2, 0), (2, 3)]
    assert data.pack_rows([3, 3], 6) == [(0, 0), (0, 3)]
    with pytest.raises(ValueError, match="does not fit"):
        data.pack_rows([7], 6)


def _step(model, batch, layout, aggregation, num_micro=2, beta=0.1):
    """One optimizer step's loss and gradients as grpo.py's step 5 and 6 compute them (one minibatch of the 8 rows
    drawn in a fixed shuffled order, num_micro micro-batches): old log-probs from the no-grad pass of the layout
    (perturbed, so that ratios are not 1), advantages per row, the clipped surrogate and a KL term."""
    input_ids, attn, resp = batch
    model.zero_grad()
    lengths = attn.sum(1).tolist()
    finished = torch.tensor([True, False, True, True, False, True, True, True])
    mask = completion_mask(resp, finished, aggregation == "seq_mean")  # also a masked-out row
    old = torch.zeros_like(mask)
    with torch.no_grad():
        for idx in data.micro_batches(list(range(8)), lengths, 4, layout):  # as step 5: micro-batches of 2
            old[idx] = micro_batch_logprobs(model, input_ids[idx], attn[idx], resp[idx], layout, 1.0)[0]
    old = old + 0.1 * torch.sin(torch.arange(old.numel()).view_as(old).float()) * mask
    ref = old - 0.05 * mask
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, 0.0, -0.7, 1.5])[:, None].expand_as(mask)
    mb_idx = [3, 6, 0, 5, 1, 7, 2, 4]
    tokens = int(mask[mb_idx].sum())
    total = 0.0
    for idx in data.micro_batches(mb_idx, lengths, num_micro, layout):
        logp, _ = micro_batch_logprobs(model, input_ids[idx], attn[idx], resp[idx], layout, 1.0, True)
        pg, _, _ = clipped_surrogate(logp, old[idx], adv[idx], 0.2, 0.28, mask[idx])
        per_token = pg + beta * kl_penalty(logp, ref[idx], "k3", mask[idx])
        loss = aggregate_loss(per_token, mask[idx], aggregation, 8, tokens, tokens, 1, 40)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("layout", ["sorted", "packed"])
def test_step_loss_and_gradients_equal_the_padded_computation(tiny_model, batch, layout, aggregation):
    model, _ = tiny_model
    loss, grads = _step(model, batch, layout, aggregation)
    ref_loss, ref_grads = _step(model, batch, "padded", aggregation)
    assert loss == pytest.approx(ref_loss, abs=1e-5) and abs(ref_loss) > 1e-3
    assert max(g.abs().max().item() for g in ref_grads.values()) > 1e-3
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    # and the same as one micro-batch of all 8 rows, padded (the split does not change the step)
    one_loss, one_grads = _step(model, batch, "padded", aggregation, num_micro=1)
    assert loss == pytest.approx(one_loss, abs=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, one_grads[name], atol=1e-5, rtol=1e-5, msg=name)


# ---------------------------------------------------------------- attention stays inside each packed sequence
class _WithCache(torch.nn.Module):
    """The model with use_cache forced on: transformers then skips its packed-sequence detection and attention
    crosses packed sequences (the leak the tests below must detect)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kw):
        return self.model(**{**kw, "use_cache": True})

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


def _second_row_logprobs(model, first, second):
    input_ids, attn, resp = data.pad_batch([first[:1], second[:1]], [first[1:], second[1:]], 0)
    with torch.no_grad():
        return packed_forward_logprobs(model, input_ids, attn, resp, 1.0, width=len(first) + len(second))[0][
            1, : len(second) - 1]  # both sequences in one packed row


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_changing_one_packed_sequence_does_not_move_the_other(tiny_model, attn_implementation):
    _, tok = tiny_model
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
                                          attn_implementation=attn_implementation)
    a, a_changed, b = [1, 5, 9, 12, 7, 30, 8], [1, 22, 6, 6, 19, 4, 11], [1, 14, 3, 27, 9]
    base = _second_row_logprobs(model, a, b)
    assert (_second_row_logprobs(model, a_changed, b) - base).abs().max().item() == 0.0
    alone = forward_logprobs(model, *data.pad_batch([b[:1]], [b[1:]], 0), 1.0)[0][0]
    torch.testing.assert_close(base, alone.detach(), atol=1e-6, rtol=0)
    # the check above has teeth: with the leak, the second sequence's log-probs move
    leaky = _WithCache(model)
    assert (_second_row_logprobs(leaky, a_changed, b) - _second_row_logprobs(leaky, a, b)).abs().max().item() > 1e-3


def test_check_packing_passes_the_model_and_rejects_a_leaking_one(tiny_model):
    model, _ = tiny_model
    a, b = [1, 5, 9, 12, 7, 30, 8], [1, 14, 3, 27, 9]
    check_packing(model, [a, b], 1e-4)
    with pytest.raises(ValueError, match="micro_batching: packed: .* does not keep packed sequences apart"):
        check_packing(_WithCache(model), [a, b], 1e-4)


def test_flag_parses_and_defaults_to_padded():
    from algorithms.grpo import Args
    from shared.cli import parse_cli

    assert Args().micro_batching == "padded"
    assert parse_cli(Args, ["--micro_batching", "packed"]).micro_batching == "packed"


# ---------------------------------------------------------------- end to end
@pytest.mark.slow
def test_grpo_runs_in_every_layout_with_the_same_first_step(tmp_path):
    """grpo.py in each layout, 2 micro-batches per optimizer step and a KL reference: the same first rollout (same
    seed) gives the same first-step gradient norm, up to float rounding. From the warm start, so that rewards (and
    the gradient) are not all zero: a zero gradient plus rounding noise is a full Adam step, not a small one."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    first = {}
    for layout in LAYOUTS:
        out = tmp_path / layout
        cmd = [sys.executable, "algorithms/grpo.py", "--micro_batching", layout, "--output_dir", str(out),
               "--model_name_or_path", "builtin:tiny-sft", "--generator", "hf", "--total_episodes", "48",
               "--local_num_prompts", "4", "--num_generations", "4", "--local_micro_batch_size", "4",
               "--max_new_tokens", "24", "--beta", "0.05", "--eval_every", "0", "--eval_num_prompts", "4",
               "--eval_num_samples", "1", "--dev_num_prompts", "0", "--sample_every", "0", "--no_save_model"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "time/train" in r]
        assert len(steps) == 3 and all(r["optim/nonfinite_skipped"] == 0 for r in steps)
        first[layout] = steps[0]
    for layout in ("sorted", "packed"):
        assert first[layout]["objective/scores"] == first["padded"]["objective/scores"]
        assert first[layout]["val/sequence_lengths"] == first["padded"]["val/sequence_lengths"]
        assert first[layout]["optim/grad_norm"] == pytest.approx(first["padded"]["optim/grad_norm"], rel=1e-3)
        assert first[layout]["objective/kl"] == pytest.approx(first["padded"]["objective/kl"], abs=1e-4)


# ---------------------------------------------------------------- the benchmark's summary (scripts/benchmarks/bench_packing.py)
def test_bench_summary_ratios_are_per_repeat_medians_over_padded():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_packing", Path(__file__).resolve().parents[1] /
                                                  "scripts" / "benchmarks" / "bench_packing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(train, logprob):  # two timed steps of one repeat
        return {"step_s": [t + 1 for t in train], "phases_s": {ph: [0.0, 0.0] for ph in bench.PHASES} | {
            "train": train, "logprob": logprob}, "completion_length_mean": [90.0, 100.0, 110.0],
            "stop_rate": [0.9] * 3, "peak_rss_mb": 1000.0}

    runs = {"padded": [run([4.0, 6.0], [1.0, 1.0]), run([8.0, 8.0], [2.0, 2.0])],
            "sorted": [run([2.0, 3.0], [0.5, 0.5]), run([2.0, 2.0], [0.5, 1.5])],
            "packed": [{"error": "boom"}]}
    out = bench.summarize(runs)
    assert out["contenders"]["padded"]["train_s"] == {"min": 4.0, "median": 7.0, "max": 8.0, "n": 4}
    # per repeat: train medians 2.5 / 5 and 2 / 8; logprob 0.5 / 1 and 1 / 2
    assert out["ratios"]["sorted/padded train"] == {"min": 0.25, "median": 0.375, "max": 0.5, "n": 2}
    assert out["ratios"]["sorted/padded logprob"]["median"] == 0.5
    assert out["contenders"]["packed"] == {"error": "boom"} and "packed/padded train" not in out["ratios"]
