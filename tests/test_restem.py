"""restem.py: the filter, the loss and the candidate choice against hand-computed numbers, and a tiny run that
restarts from the base every iteration."""

import json
import math
from pathlib import Path

import pytest
import torch

from algorithms.restem import choose_checkpoint, filter_correct, sequence_mean_nll
from shared.logprobs import forward_logprobs


def test_filter_keeps_only_correct_and_at_most_the_cap_per_prompt_the_first_ones():
    rewards = [[1.0, 0.0, 1.0, 1.0],   # three correct, cap 2: the first two (samples 0 and 2)
               [0.0, 0.0, 0.5, 0.99],  # none reaches 1.0
               [2.0, 1.0, 0.0, 1.0]]   # >= threshold counts, the cap keeps samples 0 and 1
    assert filter_correct(rewards, 1.0, 2) == [(0, 0), (0, 2), (2, 0), (2, 1)]
    assert filter_correct(rewards, 1.0, 10) == [(0, 0), (0, 2), (0, 3), (2, 0), (2, 1), (2, 3)]
    assert filter_correct(rewards, 0.5, 1) == [(0, 0), (1, 2), (2, 0)]
    assert filter_correct([[1.0] * 12], 1.0, 10) == [(0, k) for k in range(10)]  # VinePPO's cap of 10


def test_loss_is_the_mean_of_per_sequence_token_means_not_a_global_token_mean():
    logp = torch.tensor([[-1.0, -3.0, -7.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # sequence 1: (1 + 3) / 2 = 2; sequence 2: 6 / 3 = 2; mean 2. A global token mean would be 10 / 5 = 2 too:
    assert sequence_mean_nll(logp, mask, 2).item() == pytest.approx(2.0)
    logp = torch.tensor([[-4.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # (4 + 1) / 2 = 2.5, while the global token mean is 7 / 4 = 1.75
    assert sequence_mean_nll(logp, mask, 2).item() == pytest.approx(2.5)
    assert ((-logp * mask).sum() / mask.sum()).item() == pytest.approx(1.75)
    # micro-batches summed give the step's loss (num_seqs counts the whole step)
    parts = sequence_mean_nll(logp[:1], mask[:1], 2) + sequence_mean_nll(logp[1:], mask[1:], 2)
    assert parts.item() == pytest.approx(2.5)


def _full_logits_logprobs(model, input_ids, attention_mask, temperature):
    """The straightforward computation restem.py had before: float32 logits of every position, [B, L-1, V]."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    return logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


@pytest.mark.parametrize("chunk", [1, 4, 512])
def test_lean_loss_equals_the_full_logits_loss_in_value_and_gradient(tiny_model, chunk):
    """The M-step loss from the lean log-probs (LM head on the completion positions only, in chunks) is the same
    number, with the same parameter gradients, as the per-sequence token-mean NLL from full float32 logits; so is
    the logged KL to the base (here: a second model). Rows of different prompt and completion lengths, right-padded,
    temperature 0.6; chunks of 1, 4 (which does not divide the 14 completion tokens) and 512."""
    from transformers import LlamaForCausalLM

    from shared import data

    model, tok = tiny_model
    prompts = [tok(x).input_ids for x in ["1+2=", "12+30+4+50=", "7=", "3+4+5="]]
    completions = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id]
                   for x in ["3", "96\n1\n2", "", "12\n"]]
    ids, attn, resp = data.pad_batch(prompts, completions, tok.pad_token_id)
    mask = resp[:, 1:].float()
    T, num_seqs = 0.6, 6  # the step's sequences on this rank: this micro-batch is a share of the loss

    ref_loss = sequence_mean_nll(_full_logits_logprobs(model, ids, attn, T), mask, num_seqs)
    loss = sequence_mean_nll(forward_logprobs(model, ids, attn, resp, T, False, chunk)[0], mask, num_seqs)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref_loss, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)

    torch.manual_seed(1)
    other = LlamaForCausalLM(model.config)
    with torch.no_grad():
        kl = ((forward_logprobs(model, ids, attn, resp, T, False, chunk)[0] - forward_logprobs(other, ids, attn, resp, T, False, chunk)[0])
              * mask).sum()
        ref_kl = ((_full_logits_logprobs(model, ids, attn, T) - _full_logits_logprobs(other, ids, attn, T))
                  * mask).sum()
    assert kl.item() != 0
    torch.testing.assert_close(kl, ref_kl, atol=1e-5, rtol=1e-5)


def test_choose_checkpoint_paper_original_stops_at_the_first_non_improvement():
    assert choose_checkpoint([0.30, 0.32, 0.31, 0.35], "restem_paper_original") == 1  # the second checkpoint
    assert choose_checkpoint([0.30, 0.32, 0.31, 0.35], "choose_best") == 3
    assert choose_checkpoint([0.30, 0.30, 0.40], "restem_paper_original") == 0  # strictly better only
    assert choose_checkpoint([0.1, 0.2, 0.3], "restem_paper_original") == 2
    assert choose_checkpoint([0.5], "restem_paper_original") == 0
    assert choose_checkpoint([0.3, 0.5, 0.5], "choose_best") == 1  # the first of ties
    with pytest.raises(ValueError, match="early_stop"):
        choose_checkpoint([0.1], "last")


TINY = ["--generator", "hf", "--total_episodes", "96", "--local_num_prompts", "12", "--num_generations", "4",
        "--local_micro_batch_size", "8", "--num_epochs", "2", "--max_new_tokens", "8", "--eval_num_prompts", "8",
        "--eval_num_samples", "2", "--dev_num_prompts", "20", "--early_stop", "choose_best"]


def test_every_iteration_restarts_from_the_base_with_a_fresh_optimizer(tmp_path, monkeypatch):
    """Two iterations: every training engine is built from the base's weights with an empty optimizer (iteration
    2 included, although iteration 1 trained), and the KL to the base is exactly 0 at each iteration's first step,
    before its update; candidate 0 (the base) scores the same dev accuracy every iteration."""
    import tyro
    from safetensors.torch import load_file

    from algorithms import restem
    from shared.models import resolve_model_path

    base = load_file(f"{resolve_model_path('builtin:tiny-sft')}/model.safetensors")
    built = []
    real_prepare = restem.prepare

    def recording_prepare(model, optimizer, *a, **kw):
        params = dict(model.named_parameters())
        built.append((all(torch.equal(params[k].cpu(), v) for k, v in base.items() if k in params),
                      len(optimizer.state)))
        return real_prepare(model, optimizer, *a, **kw)

    monkeypatch.setattr(restem, "prepare", recording_prepare)
    out = tmp_path / "run"
    restem.main(tyro.cli(restem.Args, args=["--output_dir", str(out), *TINY], use_underscores=True))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # engines: start-up (base), iteration 1 (base), its choice, iteration 2 (base), its choice
    assert len(built) == 5 and all(empty == 0 for _, empty in built)
    assert built[0][0] and built[1][0] and built[3][0]
    first_steps = [r for r in rows if r.get("restem/step_in_iteration") == 1]
    assert len(first_steps) == 2 and all(r["objective/kl"] == 0.0 for r in first_steps)
    # the policy's token-mean entropy on the trained completions, logged with the loss (every RL script logs it)
    vocab = json.loads(Path(resolve_model_path("builtin:tiny-sft"), "config.json").read_text())["vocab_size"]
    assert all(0 < r["objective/entropy"] < math.log(vocab) for r in first_steps)
    starts = [r for r in rows if "restem/kept" in r]
    assert len(starts) == 2 and starts[0]["restem/candidate_dev_accuracy"] == starts[1]["restem/candidate_dev_accuracy"]
    assert starts[0]["restem/candidate_dev_accuracy"] == rows[0]["dev/accuracy"]  # the base, as at step 0
    assert (out / "final" / "model.safetensors").exists() and (out / "best" / "best.json").exists()
