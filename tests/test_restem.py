"""restem.py: the filter, the loss and the candidate choice against hand-computed numbers, and a tiny run that
restarts from the base every iteration (sft_restem.md "Tests this implementation should have")."""

import json

import pytest
import torch

from algorithms.restem import choose_checkpoint, filter_correct, sequence_mean_nll


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


def test_choose_checkpoint_paper_original_stops_at_the_first_non_improvement():
    assert choose_checkpoint([0.30, 0.32, 0.31, 0.35], "restem_paper_original") == 1  # the second checkpoint
    assert choose_checkpoint([0.30, 0.32, 0.31, 0.35], "choose_best") == 3
    assert choose_checkpoint([0.30, 0.30, 0.40], "restem_paper_original") == 0  # strictly better only
    assert choose_checkpoint([0.1, 0.2, 0.3], "restem_paper_original") == 2
    assert choose_checkpoint([0.5], "restem_paper_original") == 0
    assert choose_checkpoint([0.3, 0.5, 0.5], "choose_best") == 1  # the first of ties
    with pytest.raises(ValueError, match="early_stop"):
        choose_checkpoint([0.1], "last")


TINY = ["--generator", "hf", "--total_episodes", "96", "--local_num_prompts", "12", "--num_samples_per_prompt", "4",
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
    starts = [r for r in rows if "restem/kept" in r]
    assert len(starts) == 2 and starts[0]["restem/candidate_dev_accuracy"] == starts[1]["restem/candidate_dev_accuracy"]
    assert starts[0]["restem/candidate_dev_accuracy"] == rows[0]["dev/accuracy"]  # the base, as at step 0
    assert (out / "final" / "model.safetensors").exists() and (out / "best" / "best.json").exists()
