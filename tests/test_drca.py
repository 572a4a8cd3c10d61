"""DRCA's pure functions (docs/drca.md): units, counterfactuals, reward shaping and the PPO pieces."""

import pytest
import torch

from algorithms import drca, ppo, ppo_rlhf
from algorithms.drca import (compute_gae, counterfactual_response, masked_whiten, shaped_rewards,
                             unit_token_rewards)
from shared.units import (LABEL_PATTERN, UNIT_PATTERNS, char_offsets, char_span_to_tokens, entropy_units, regex_units,
                          think_prefix_length)
from shared.cli import check_args
from shared.localisation import slip_localisation


def units_text(text, spans):
    return [text[a:b] for a, b in spans]


# ---------------------------------------------------------------- unit extraction
def test_regex_units_on_the_spec_example():
    text = "Intro\nA. x.\n\nB. y.\nC. z."
    assert units_text(text, regex_units(text, LABEL_PATTERN, 10)) == ["A. x.", "B. y.", "C. z."]
    assert units_text(text, regex_units(text, LABEL_PATTERN, 2)) == ["A. x.", "B. y.\nC. z."]  # the N-th absorbs
    assert units_text(text, regex_units(text, LABEL_PATTERN, 1)) == ["A. x.\n\nB. y.\nC. z."]


def test_regex_units_blank_lines_recommended_vs_reference_offsets():
    text = "A. x\n\nB. y"
    assert units_text(text, regex_units(text, LABEL_PATTERN, 10)) == ["A. x", "B. y"]
    assert units_text(text, regex_units(text, LABEL_PATTERN, 10, code_compat=True)) == ["A. x", "\nB. y"]
    # without blank lines the reference's offsets are right (its unit ends before the "\n")
    text = "Intro\nA. x.\nB. y."
    assert units_text(text, regex_units(text, LABEL_PATTERN, 10, code_compat=True)) == ["A. x.", "B. y."]


def test_regex_label_sets():
    text = "1. one\n*A. two\nAB. three\nabc. no\nABC. no"
    assert units_text(text, regex_units(text, UNIT_PATTERNS["labels"], 10)) == ["*A. two", "AB. three\nabc. no\nABC. no"]
    assert units_text(text, regex_units(text, UNIT_PATTERNS["labels+digits"], 10))[0] == "1. one"
    assert regex_units("no labels here\nnor here", LABEL_PATTERN, 10) == []


def test_lines_pattern_gives_one_unit_per_line_of_the_builtin_task():
    text = "7\n12\n13"
    assert units_text(text, regex_units(text, UNIT_PATTERNS["lines"], 10)) == ["7", "12", "13"]
    assert units_text(text, regex_units(text, UNIT_PATTERNS["lines"], 2)) == ["7", "12\n13"]
    assert units_text("7\n\n 12\n", regex_units("7\n\n 12\n", UNIT_PATTERNS["lines"], 10)) == ["7\n\n 12"]


def test_entropy_units_on_the_spec_example():
    H = [0.1, 2.0, 0.2, 0.3, 1.9, 0.1, 0.1]
    assert entropy_units(H, 1.5, 10, "after", cap=False) == [(0, 2), (2, 5), (5, 7)]  # the reference
    assert entropy_units(H, 1.5, 10) == [(0, 1), (1, 4), (4, 7)]  # recommended: a peak starts a unit
    assert entropy_units(H, 1.5, 2) == [(0, 1), (1, 7)]
    assert entropy_units(H, 1.5, 2, "after", cap=False) == [(0, 2), (2, 5), (5, 7)]  # the reference ignores N
    assert entropy_units([3.0, 0.1], 1.5, 10) == [(0, 2)]  # a peak on the first token starts nothing new
    assert entropy_units([0.1, 0.1, 3.0], 1.5, 10, "after") == [(0, 3)]  # ... nor one on the last ("after")
    assert entropy_units([], 1.5, 10) == []
    with pytest.raises(ValueError, match="entropy_boundary"):
        entropy_units(H, 1.5, 10, "middle")


def test_think_prefix_is_detected_not_hard_coded():
    assert think_prefix_length(["<think>", "\n\n", "</think>", "\n\n", "A", "."]) == 4  # Qwen3, thinking off
    assert think_prefix_length(["<think>", "hm", "</", "think>", "\n", "A"]) == 5
    assert think_prefix_length(["A", ".", " ", "x"]) == 0
    assert think_prefix_length(["<think>", "still thinking"]) == 2  # unterminated: no text region


def test_char_offsets_with_a_char_tokenizer():
    from shared.tiny import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode("7\n12\n13", add_special_tokens=False)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    offsets = char_offsets(decode, ids)
    assert offsets == list(range(8))
    assert char_span_to_tokens(offsets, 2, 4) == (2, 4)


def prefix_offsets(decode, ids):
    """The definition, decoded prefix by prefix (quadratic): what char_offsets must equal."""
    offsets = [0]
    for i in range(1, len(ids) + 1):
        offsets.append(max(offsets[-1], len(decode(ids[:i]).rstrip("\ufffd"))))
    return offsets


def _byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["A. B. hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def test_char_offsets_equal_prefix_decoding_in_linear_time():
    """char_offsets decodes incrementally (decoding every prefix took 0.43 s for a 2,000-token response): it
    gives the same offsets on split multi-byte characters, emoji and long texts, decoding O(n) tokens in all."""
    import random

    tok = _byte_bpe()
    rng = random.Random(0)
    pieces = ["A. ", "B. ", "hello", " world", "café", " 日本語", "😀", "\n", "ü!", "  ", "x"]
    for n in (0, 1, 5, 60, 400):
        text = "".join(rng.choice(pieces) for _ in range(n))
        ids = tok.encode(text).ids
        decoded = []
        decode = lambda x: decoded.append(len(x)) or tok.decode(x)  # noqa: E731
        assert char_offsets(decode, ids) == prefix_offsets(tok.decode, ids), n
        assert sum(decoded) <= 20 * len(ids) + 1, (n, sum(decoded))  # quadratic: n(n+1)/2 tokens decoded
    # a SentencePiece-style decoder (a leading "▁" becomes a space, dropped at the start of a text)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.train_from_iterator(["A. x is 12\nB. y is 7 café"] * 10, trainers.BpeTrainer(vocab_size=80, show_progress=False,
                                                                                   special_tokens=["<unk>"]))
    text = "A. x is 12\nB. y  is 7 café\nA. y"
    ids = sp.encode(text).ids
    assert char_offsets(sp.decode, ids) == prefix_offsets(sp.decode, ids)


def test_char_offsets_by_prefix_decoding_keep_multibyte_characters():
    """A byte-level BPE splits é / 日 over several tokens: per-token decoding gives U+FFFD pieces of the wrong
    length; prefix decoding maps every unit to exactly the tokens that decode to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["A. B. hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    text = "A. café 日本\nB. ü!"
    ids = tok.encode(text).ids
    decode = lambda x: tok.decode(x)  # noqa: E731
    assert decode(ids) == text
    assert sum(len(tok.decode([i])) for i in ids) != len(text)  # per-token decoding miscounts
    offsets = char_offsets(decode, ids)
    assert offsets[0] == 0 and offsets[-1] == len(text) and offsets == sorted(offsets)
    for cs, ce in regex_units(text, LABEL_PATTERN, 10):
        ts, te = char_span_to_tokens(offsets, cs, ce)
        assert decode(ids[ts:te]) == text[cs:ce]


# ---------------------------------------------------------------- counterfactuals
def test_counterfactual_shapes_and_eos():
    resp, fill, eos = [10, 11, 12, 13, 14, 2], 0, 2
    cf = counterfactual_response(resp, 1, 3, "truncate", fill, eos)
    assert cf == [10, 0, 0, 2] and len(cf) == 3 + 1  # prompt + e + 1 tokens with the prompt in front
    cf = counterfactual_response(resp, 1, 3, "mask", fill, eos)
    assert cf == [10, 0, 0, 13, 14, 2] and len(cf) == len(resp)
    assert counterfactual_response(resp, 0, 5, "truncate", fill, eos) == [0] * 5 + [2]
    with pytest.raises(ValueError, match="counterfactual"):
        counterfactual_response(resp, 0, 1, "drop", fill, eos)


# ---------------------------------------------------------------- reward shaping
def batch():
    scores = torch.tensor([1.5, -0.7, 0.3])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]).float()
    last = torch.tensor([5, 6, 3])
    units = [[(1, 3), (3, 5)], [(2, 4), (4, 5), (5, 6)], [(1, 3)]]
    credits = [[0.4, -1.1], [2.0, 0.5, -0.25], [0.9]]
    return scores, mask, last, units, credits


def test_beta_zero_gives_exactly_ppo_rewards():
    scores, mask, last, units, credits = batch()
    logp, ref = torch.randn(3, 7), torch.randn(3, 7)
    raw = unit_token_rewards(scores, units, credits, last, 7, beta=0.0)
    ours, _ = shaped_rewards(raw, logp, ref, mask, beta=0.05, reward_clip=10.0)
    theirs = ppo_rlhf.score_rewards(scores, mask) - 0.05 * ppo_rlhf.kl_penalty(logp, ref, "k1") * mask  # ppo_rlhf.py
    torch.testing.assert_close(ours, theirs)


def test_sum_of_token_rewards_identity():
    scores, mask, last, units, credits = batch()
    beta = 0.8
    r = unit_token_rewards(scores, units, credits, last, 7, beta)
    for i in range(3):
        assert r[i].sum().item() == pytest.approx(beta * sum(credits[i]) + (1 - beta) * scores[i].item(), abs=1e-6)
    # spread uniformly on the unit, (1 - beta) R on the last action, 0 elsewhere
    torch.testing.assert_close(r[0], torch.tensor([0, 0.16, 0.16, -0.44, -0.44, 0.3, 0]))


def test_unitless_fallback():
    scores, mask, last, units, credits = batch()
    units[1], credits[1] = [], []
    r = unit_token_rewards(scores, units, credits, last, 7, 0.8, "terminal")
    assert r[1].tolist() == [0, 0, 0, 0, 0, 0, pytest.approx(-0.7)]
    r = unit_token_rewards(scores, units, credits, last, 7, 0.8, "zeros")
    assert r[1].abs().sum() == 0 and r[0].abs().sum() > 0  # the reference: trained on the KL penalty alone
    # no response with a unit at all: the reference falls back to plain PPO for the whole batch
    r = unit_token_rewards(scores, [[], [], []], [[], [], []], last, 7, 0.8, "zeros")
    torch.testing.assert_close(r, ppo.score_rewards(scores, mask))


def test_reward_clip_before_kl_and_kl_clamped():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    raw = torch.tensor([[25.0, -30.0, 1.0, 7.0]])
    logp, ref = torch.tensor([[0.0, -20.0, -1.0, 5.0]]), torch.tensor([[-15.0, 0.0, -1.5, 0.0]])
    r, kl = shaped_rewards(raw, logp, ref, mask, beta=0.1, reward_clip=10.0)
    assert kl.tolist() == [[10.0, -10.0, 0.5, 0.0]]  # k1 clamped to [-10, 10], 0 on padding
    torch.testing.assert_close(r, torch.tensor([[10.0 - 1.0, -10.0 + 1.0, 1.0 - 0.05, 0.0]]))


# ---------------------------------------------------------------- PPO pieces
def test_gae_gamma_lambda_one_is_reward_to_go():
    torch.manual_seed(0)
    _, mask, *_ = batch()
    rewards, values = torch.randn(3, 7) * mask, torch.randn(3, 7)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1]) * mask
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv + values * mask, to_go)


def test_whitening_over_masked_tokens():
    torch.manual_seed(0)
    _, mask, *_ = batch()
    w = masked_whiten(torch.randn(3, 7) * 5 + 3, mask)
    n = mask.sum()
    assert ((w * mask).sum() / n).item() == pytest.approx(0.0, abs=1e-5)
    assert (((w**2) * mask).sum() / n).item() == pytest.approx(1.0, abs=1e-4)
    assert (w * (1 - mask)).abs().sum() == 0


def test_credit_is_independent_of_mu_and_scales_with_one_over_sigma(tiny_model):
    from transformers import LlamaForSequenceClassification

    from shared.scalar import score_last_token

    _, tok = tiny_model
    torch.manual_seed(0)
    from shared.tiny import tiny_config

    rm = LlamaForSequenceClassification(tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
    rm.config.num_labels = 1
    rm.score = torch.nn.Linear(rm.config.hidden_size, 1, bias=False)
    rm.eval()
    prompt = tok.encode("3+4+5+1=")
    resp = tok.encode("7\n12\n13", add_special_tokens=False) + [tok.eos_token_id]
    cf = counterfactual_response(resp, 2, 4, "truncate", tok.encode(" ", add_special_tokens=False)[0],
                                 tok.eos_token_id)
    from shared.data import pad_batch

    ids, attn, _ = pad_batch([prompt, prompt], [resp, cf], tok.pad_token_id)

    def credit(mu, sigma):
        rm.config.reward_mean, rm.config.reward_std = mu, sigma
        with torch.no_grad():
            s = score_last_token(rm, ids, attn)
        return (s[0] - s[1]).item()

    d = credit(0.0, 1.0)
    assert d != 0
    assert credit(3.7, 1.0) == pytest.approx(d, rel=1e-5)
    assert credit(-2.0, 2.0) == pytest.approx(d / 2, rel=1e-5)


def test_validate_names_the_flag():
    for kwargs, flag in [({"drca_beta": 1.5}, "drca_beta"), ({"drca_beta": -0.1}, "drca_beta"),
                         ({"unit_extraction": "words"}, "unit_extraction"), ({"counterfactual": "x"}, "counterfactual"),
                         ({"unitless_fallback": "r"}, "unitless_fallback"), ({"max_units_per_sequence": 0},
                                                                              "max_units_per_sequence"),
                         ({"unit_pattern": "("}, "unit_pattern"), ({"reward_model_path": ""}, "reward_model_path"),
                         ({"entropy_source": "reference", "beta": 0.0}, "entropy_source")]:
        args = drca.Args(**kwargs)
        with pytest.raises(ValueError, match=f"^{flag}: "):
            check_args(args)  # the start-up checks in run_cli's order: fixed choices and ranges, then drca's own
            drca.validate(args)
    check_args(drca.Args(drca_beta=0.0))
    drca.validate(drca.Args(drca_beta=0.0))  # beta = 0 is allowed: plain PPO
    with pytest.raises(ValueError, match="^scorer: line_grader grades the built-in running sums only"):
        drca.validate(drca.Args(dataset="prompts.jsonl", scorer="line_grader"))


def test_scorer_auto_grades_the_builtin_task_and_uses_the_rm_elsewhere():
    """The default run learns only with informative credit (docs/drca.md): `auto` = the per-line grader on the
    built-in task (any builtin:sums-N), the reward model on any other dataset; an explicit choice is kept."""
    assert drca.Args().scorer == "auto" and drca.effective_scorer(drca.Args()) == "line_grader"
    assert drca.effective_scorer(drca.Args(dataset="builtin:sums-8")) == "line_grader"
    assert drca.effective_scorer(drca.Args(dataset="prompts.jsonl")) == "rm"
    assert drca.effective_scorer(drca.Args(scorer="rm")) == "rm"
    assert drca.effective_scorer(drca.Args(dataset="prompts.jsonl", scorer="line_grader")) == "line_grader"
    drca.validate(drca.Args(dataset="prompts.jsonl"))  # auto on a user dataset: the RM, no error


def test_slip_localisation_by_hand():
    """Localisation: the lowest credit on the unit holding the slip is a hit; chance = share of units on the slip."""
    spans = [(0, 2), (2, 5), (5, 8)]  # three lines; the slip is line 1's tokens [2, 5)
    assert slip_localisation([0.9, -0.3, 0.1], spans, (2, 5)) == (1.0, 1 / 3)
    assert slip_localisation([-0.5, -0.3, 0.1], spans, (2, 5)) == (0.0, 1 / 3)
    assert slip_localisation([0.2, 0.2, 0.2], spans, (0, 2)) == (1 / 3, 1 / 3)  # a tie: a unit picked among them
    assert slip_localisation([0.2, 0.2, 0.5], spans, (2, 5)) == (0.5, 1 / 3)
    assert slip_localisation([0.2, 0.1], [(0, 4), (4, 8)], (3, 5)) == (1.0, 1.0)  # the slip spans both units
    assert slip_localisation([], [], (2, 5)) == (0.0, 0.0)  # no unit: not located


def test_unit_pattern_resolves_names_and_rejects_a_bad_regex():
    """--unit_pattern: `auto` is lines on the built-in task and labels elsewhere; a raw regex must compile."""
    from shared.units import unit_pattern

    assert unit_pattern("auto", drca.Args().dataset) == UNIT_PATTERNS["lines"]
    assert unit_pattern("auto", "prompts.jsonl") == LABEL_PATTERN
    assert unit_pattern(r"^Step \d+:", "builtin") == r"^Step \d+:"
    with pytest.raises(ValueError, match="unit_pattern: not a regular expression"):
        drca.validate(drca.Args(unit_pattern="(unclosed"))


def test_line_grader_by_hand():
    """The per-line grader, +1/-1 for each line's value and its step from the line above."""
    from shared.task import line_grade, line_points

    p = "3+4+5+1="  # 7, 12, 13
    assert line_points(p, "7\n12\n13") == [2, 2, 2] and line_grade(p, "7\n12\n13") == 1.0
    assert line_points(p, "7\n13\n14") == [2, -2, 0]  # the slip at line 1; line 2 steps right from it
    assert line_points(p, "8\n13\n14") == [-2, 0, 0]
    assert line_points(p, "7\n  \n13") == [2, 0, 1]  # a blanked line: no points, the next step unchecked
    assert line_points(p, "7\n  ") == [2]  # truncate's counterfactual: the prefix and a blank
    assert line_points(p, "7\n12\n13\n5") == [2, 2, 2, -2]  # a line past the last step
    assert line_points(p, "x\n12\n13") == [-2, 1, 2]  # unparsable: both checks fail, the next step unchecked
    assert line_points(p, "--7\n12\n13") == [-2, 1, 2] and line_points(p, "-7\n12") == [-2, 0]
    assert line_grade("Q: 3+4+5+1=", "7\n12") == pytest.approx(4 / 6)  # a missing line scores 0
    with pytest.raises(ValueError, match="running-sums prompt"):
        line_points("hello", "7")


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_line_grader_credits_locate_every_held_out_slip(mode):
    """The per-line grader's upper bound holds by construction: with it scoring the counterfactuals, the
    single lowest credit d_k = R - R~_k is the slipped line, on all 1,500 held-out slip pairs, in both modes (the
    counterfactuals built in text as counterfactual_response builds them in tokens: the line blanked with spaces)."""
    from shared.task import builtin_preferences, line_grade

    for row in builtin_preferences("test"):
        lines, k = row["rejected"].split("\n"), row["rejected_step"]
        r = line_grade(row["prompt"], row["rejected"])
        credits = []
        for u in range(len(lines)):
            blank = " " * len(lines[u])
            cf = lines[:u] + [blank] + (lines[u + 1 :] if mode == "mask" else [])
            credits.append(r - line_grade(row["prompt"], "\n".join(cf)))
        spans = [(u, u + 1) for u in range(len(lines))]
        assert slip_localisation(credits, spans, (k, k + 1)) == (1.0, 1 / 3), (row, credits)


def test_counterfactual_preferences_rank_drca_counterfactuals_by_the_line_grader():
    """`builtin:counterfactual`'s pairs: whole responses as the built-in pairs, and the comparisons DRCA's
    credits make (a response against its counterfactuals in one format, the counterfactuals against each other),
    chosen graded above rejected by the per-line grader; train and test disjoint, deterministic; the preference
    loader and rm.py's dataset flag take the name."""
    from shared import data
    from shared.task import COUNTERFACTUAL, builtin_split, counterfactual_preferences, line_grade, preferences

    train, test = counterfactual_preferences("train"), counterfactual_preferences("test")
    assert (len(train), len(test)) == (28_500, 1_500) and test == counterfactual_preferences("test")
    assert preferences(COUNTERFACTUAL, "test") == test
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert {r["prompt"] for r in test} == {r["prompt"] for r in builtin_split("test")}
    for r in test:
        assert r["chosen_grade"] == line_grade(r["prompt"], r["chosen"]) > r["rejected_grade"]
        assert line_grade(r["prompt"], r["rejected"]) == r["rejected_grade"]
        assert r["chosen"] and r["rejected"]
    assert any(not r["chosen"].strip() or not r["rejected"].strip() for r in test)  # truncate's cut of line 0

    def blanked(y: str) -> bool:
        return any(not x.strip() for x in y.split("\n"))

    whole = [r for r in test if not blanked(r["chosen"]) and not blanked(r["rejected"])]
    assert len(whole) >= 500  # one pair of whole responses per problem (and some of the drawn ones)
    same_cf = [r for r in test if blanked(r["chosen"]) and blanked(r["rejected"])]
    cut = [y for r in test for y in (r["chosen"], r["rejected"]) if blanked(y) and not y.split("\n")[-1].strip()]
    assert len(same_cf) > 200 and len(cut) > 300  # counterfactuals against each other; truncate's format
    row = next(r for r in same_cf if len(r["chosen"].split("\n")) == len(r["rejected"].split("\n")) == 3)
    assert row["chosen"].replace(" ", "") != row["rejected"].replace(" ", "")  # which line to blank

    class Chars:  # a character-level tokenizer stand-in
        eos_token_id, bos_token_id = 0, None

        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [ord(c) for c in text]})()

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    pairs = data.load_preferences(COUNTERFACTUAL, "test", Chars())
    assert len(pairs.chosen_ids) == 1500 and pairs.chosen_ids[0][-1] == 0
    assert [ord(" ")] in [ids[:-1] for ids in pairs.chosen_ids + pairs.rejected_ids]  # a one-blank response loads
    with pytest.raises(data.DataError, match="is empty"):  # anywhere else a blank response is a broken row
        data._preference_text({"chosen": " "}, "chosen", "row 0")
