"""Unit tests of rm.py and the shared scoring helper (docs/rm.md, Implementation details)."""

import math

import pytest
import torch

from algorithms.rm import bradley_terry_loss, init_reward_head, score_pairs
from shared import data, task
from shared.scalar import score_last_token, use_distinct_pad_token


@pytest.fixture(scope="module")
def reward_model(tiny_model):
    from transformers import LlamaForSequenceClassification

    _, tok = tiny_model
    torch.manual_seed(0)
    from shared.tiny import tiny_config

    cfg = tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    cfg.num_labels = 1
    model = LlamaForSequenceClassification(cfg).eval()
    init_reward_head(model)
    return model, tok


def test_bradley_terry_loss_matches_hand_computed_values():
    r_w, r_l = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    expected = [math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.0))]
    torch.testing.assert_close(bradley_terry_loss(r_w, r_l), torch.tensor(expected))
    margin = torch.tensor([0.5, 2.0])  # -log sigmoid(r_w - r_l - m)
    expected_m = [math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(3.0))]
    torch.testing.assert_close(bradley_terry_loss(r_w, r_l, margin), torch.tensor(expected_m))
    centred = bradley_terry_loss(r_w, r_l, None, 0.01)  # + eta (r_w + r_l)^2
    torch.testing.assert_close(centred, torch.tensor([expected[0] + 0.01 * 1.0, expected[1] + 0.0]))


def test_reward_head_init():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=8, num_labels=1)
    model = LlamaForSequenceClassification(cfg)
    init_reward_head(model)
    assert model.score.weight.std().item() == pytest.approx(1 / math.sqrt(513), rel=0.15)
    assert model.score.bias is None or (model.score.bias == 0).all()


def test_score_is_read_at_the_last_non_pad_token_whatever_the_padding(reward_model):
    """Extra right padding and pad == eos must not move the score."""
    model, tok = reward_model
    prompts = [data.encode_prompt(tok, "3+4=", False), data.encode_prompt(tok, "1+2+3=", False)]
    responses = [data.encode_response(tok, "7"), data.encode_response(tok, "3\n6")]
    ids, attn, _ = data.pad_batch(prompts, responses, tok.pad_token_id)
    with torch.no_grad():
        base = score_last_token(model, ids, attn)
        # the same sequences alone, with 5 extra pads, and with pad == eos
        alone = torch.stack([score_last_token(model, *data.pad_batch([p], [r], tok.pad_token_id)[:2])[0]
                             for p, r in zip(prompts, responses)])
        ids2, attn2 = torch.nn.functional.pad(ids, (0, 5), value=tok.pad_token_id), torch.nn.functional.pad(attn, (0, 5))
        padded = score_last_token(model, ids2, attn2)
        ids3, attn3, _ = data.pad_batch(prompts, responses, tok.eos_token_id)
        model.config.pad_token_id = tok.eos_token_id
        eos_pad = score_last_token(model, ids3, attn3)
        model.config.pad_token_id = tok.pad_token_id
        # the value at the EOS position computed by hand
        last = attn.sum(1) - 1
        assert (ids[torch.arange(2), last] == tok.eos_token_id).all()
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
        manual = model.score(hidden[torch.arange(2), last]).squeeze(-1)
    for other in (alone, padded, eos_pad, manual):
        torch.testing.assert_close(other, base, atol=1e-5, rtol=1e-5)


def test_chosen_and_rejected_in_one_forward_equal_separate_forwards(reward_model):
    model, tok = reward_model
    rows = task.builtin_preferences("test")[:6]
    p = [data.encode_prompt(tok, r["prompt"], False) for r in rows]
    c = [data.encode_response(tok, r["chosen"]) for r in rows]
    rj = [data.encode_response(tok, r["rejected"] + "\n1") for r in rows]  # different lengths
    with torch.no_grad():
        r_w, r_l = score_pairs(model, p, c, rj, tok.pad_token_id, "cpu")
        sep_w = score_last_token(model, *data.pad_batch(p, c, tok.pad_token_id)[:2])
        sep_l = score_last_token(model, *data.pad_batch(p, rj, tok.pad_token_id)[:2])
    torch.testing.assert_close(r_w, sep_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_l, sep_l, atol=1e-5, rtol=1e-5)


def test_untrained_reward_model_is_at_chance_on_balanced_pairs(reward_model):
    """Accuracy ~ 0.5 and loss ~ log 2 at init: the head is small and chosen/rejected are shuffled in."""
    model, tok = reward_model
    rows = task.builtin_preferences("test")[:200]
    p = [data.encode_prompt(tok, r["prompt"], False) for r in rows]
    a = [data.encode_response(tok, r["chosen"]) for r in rows]
    b = [data.encode_response(tok, r["rejected"]) for r in rows]
    swap = torch.rand(len(rows), generator=torch.Generator().manual_seed(0)) < 0.5  # balanced: half swapped
    w = [y if s else x for x, y, s in zip(a, b, swap)]
    l_ = [x if s else y for x, y, s in zip(a, b, swap)]
    with torch.no_grad():
        r_w, r_l = score_pairs(model, p, w, l_, tok.pad_token_id, "cpu")
    assert 0.4 < (r_w > r_l).float().mean().item() < 0.6
    assert bradley_terry_loss(r_w, r_l).mean().item() == pytest.approx(math.log(2), abs=0.05)


def test_stored_stats_normalise_scores(reward_model, tmp_path):
    """With reward_mean / reward_std in the config, the eval set's normalised scores have mean 0 and std 1."""
    model, tok = reward_model
    rows = task.builtin_preferences("test")[:64]
    p = [data.encode_prompt(tok, r["prompt"], False) for r in rows]
    resp = [data.encode_response(tok, r["chosen"]) for r in rows] + [data.encode_response(tok, r["rejected"])
                                                                      for r in rows]
    ids, attn, _ = data.pad_batch(p + p, resp, tok.pad_token_id)
    with torch.no_grad():
        raw = score_last_token(model, ids, attn, normalize=False).double()
    model.config.reward_mean, model.config.reward_std = raw.mean().item(), raw.std(unbiased=False).item()
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        normed = score_last_token(loaded, ids, attn).double()
    model.config.reward_mean = model.config.reward_std = None
    assert normed.mean().item() == pytest.approx(0.0, abs=1e-4)
    assert normed.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)


def test_preference_tokenization_has_one_bos_and_one_eos(tiny_model):
    _, tok = tiny_model
    pairs = data.load_preferences("builtin", "test", tok, limit=20)
    for p, c, r in zip(pairs.prompt_ids, pairs.chosen_ids, pairs.rejected_ids):
        for seq in (p + c, p + r):
            assert seq.count(tok.bos_token_id) == 1 and seq[0] == tok.bos_token_id
            assert seq.count(tok.eos_token_id) == 1 and seq[-1] == tok.eos_token_id


def test_use_distinct_pad_token(tiny_model):
    import copy

    _, tok = tiny_model
    tok = copy.deepcopy(tok)
    assert use_distinct_pad_token(tok) is None  # pad already differs from EOS: unchanged
    tok.pad_token = tok.eos_token
    assert use_distinct_pad_token(tok) == "<unk>" and tok.pad_token_id not in (tok.eos_token_id, None)


def test_rm_checkpoint_trained_with_pad_equal_eos_scores_the_same_in_hf_classifier_forward(tiny_path, tmp_path):
    """A base whose tokenizer pads with EOS (SmolLM2, Llama-3): HF's own sequence-classification forward (TRL, vLLM,
    OpenRLHF) reads the rightmost non-pad token. rm.py's checkpoint must score there what rm.py scored (the EOS
    token): it read the token before EOS, 0.16 apart in a measured case."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_path, base)
    tok = AutoTokenizer.from_pretrained(base)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "pad_token_id": tok.eos_token_id}))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "algorithms/rm.py", "--model_name_or_path", str(base), "--output_dir",
                           str(tmp_path / "rm"), "--total_episodes", "64", "--local_micro_batch_size", "32",
                           "--eval_num_pairs", "16", "--eval_every", "0", "--save_every", "0"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = tmp_path / "rm" / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    rm_tok = AutoTokenizer.from_pretrained(final)
    assert rm_tok.pad_token_id != rm_tok.eos_token_id and model.config.pad_token_id == rm_tok.pad_token_id
    assert rm_tok.get_vocab() == tok.get_vocab()  # still the policy's tokenizer
    pairs = data.load_preferences("builtin", "test", rm_tok, limit=8)
    ids, attn, _ = data.pad_batch(pairs.prompt_ids, pairs.chosen_ids, rm_tok.pad_token_id)  # HF-style right padding
    with torch.no_grad():
        ours = score_last_token(model, ids, attn, normalize=False)
        theirs = model(input_ids=ids, attention_mask=attn).logits.squeeze(-1)
    assert torch.allclose(ours, theirs, atol=1e-5)
