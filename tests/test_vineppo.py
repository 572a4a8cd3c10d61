"""Unit tests of vineppo.py's pure functions: step advantages, back-fill, token advantages, states."""

import random

import pytest

from algorithms.vineppo import (Args, backfill_values, dedup_states, response_advantages, step_advantages, step_states,
                                token_advantages)
from shared.steps import step_token_starts


def test_worked_example_from_the_spec():
    v = [3 / 9, 5 / 9, 8 / 9]
    assert step_advantages(v, 1.0) == pytest.approx([2 / 9, 3 / 9, 1 / 9])
    assert step_advantages(v, 0.0)[-1] == pytest.approx(-8 / 9)  # truncated / wrong: the last step pays


def test_step_advantages_telescope_to_return_minus_first_value():
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, 8)
        v, ret = [rng.random() for _ in range(n)], float(rng.random() > 0.5)
        assert sum(step_advantages(v, ret)) == pytest.approx(ret - v[0])


def test_backfill_beyond_the_cap_is_the_trajectorys_own_return():
    assert backfill_values([0.2, 0.5, None, None], 1.0) == [0.2, 0.5, 1.0, 1.0]
    # ... so the capped steps get zero advantage and the last rolled-out step gets R - V
    assert step_advantages(backfill_values([0.2, 0.5, None, None], 1.0), 1.0) == pytest.approx([0.3, 0.5, 0.0, 0.0])


def test_token_advantages_are_piecewise_constant_and_eos_takes_the_last_step():
    adv = token_advantages([0, 1, 4], [0.1, 0.2, 0.3], num_tokens=8)  # "7\n12\n13" + EOS
    assert adv == [0.1, 0.2, 0.2, 0.2, 0.3, 0.3, 0.3, 0.3]


def test_step_token_starts_on_the_character_tokenizer(tiny_model):
    _, tok = tiny_model
    ids = tok("7\n12\n13", add_special_tokens=False).input_ids + [tok.eos_token_id]
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    assert step_token_starts(ids, [0, 1, 4, 7], decode) == [0, 1, 4]
    # multi-character tokens: a token belongs to the step containing its start offset
    fake = lambda pieces: (lambda x: "".join(pieces[: len(x)]))  # noqa: E731
    assert step_token_starts([0, 1, 2], [0, 1, 3, 5], fake(["ab", "cd", "e"])) == [0, 1, 2]  # starts 0, 2, 4
    # two step starts inside one token ("abc"): the steps merge, starts stay strictly increasing
    assert step_token_starts([0, 1], [0, 1, 2, 4], fake(["abc", "d"])) == [0, 1]


def test_identical_states_are_deduplicated_and_share_an_index():
    s0, s1a, s1b = ("p0", ()), ("p0", (5,)), ("p0", (6,))
    unique, idx = dedup_states([[s0, s1a], [s0, s1a], [s0, s1b, None], [("p1", ())]])
    assert unique == [s0, s1a, s1b, ("p1", ())]
    assert idx == [[0, 1], [0, 1], [0, 2, None], [3]]


def test_invalid_config_is_rejected():
    from shared.cli import check_args

    with pytest.raises(ValueError, match="num_mc_rollouts"):  # the range declared beside the flag (Ge(1))
        check_args(Args(num_mc_rollouts=0))

    with pytest.raises(ValueError, match="max_step_for_value_estimation"):
        check_args(Args(max_step_for_value_estimation=-1))  # its range, declared beside the flag


def test_step_states_by_hand_with_a_failed_split_and_the_cap():
    """Character "tokens" (decode = join): starts per response, state keys (prompt index, the tokens before the
    step), None past the cap, and a response the splitter rejects counted and without states."""
    from shared.steps import StepSplitError

    def split(text):  # a line per step; "x" cannot be split
        if "x" in text:
            raise StepSplitError(text)
        return [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"] + [len(text)]

    decode = lambda ids: "".join(ids)  # noqa: E731
    ids = [list("7\n12"), list("x"), list("3\n4\n5")]
    starts, keys, failed = step_states(ids, ["".join(x) for x in ids], [10, 10, 11], split, decode, cap=None)
    assert starts == [[0, 2], None, [0, 2, 4]] and failed == 1
    assert keys == [[(10, ()), (10, ("7", "\n"))], [], [(11, ()), (11, ("3", "\n")), (11, ("3", "\n", "4", "\n"))]]
    _, capped, _ = step_states(ids, ["".join(x) for x in ids], [10, 10, 11], split, decode, cap=1)
    assert capped[2] == [(11, ()), (11, ("3", "\n")), None]  # S_2 past the cap: not rolled out


def test_response_advantages_by_hand():
    """Two responses after 2-token prompts (their completions start at column 1): the first with states valued 0.5
    and 0.75 and reward 1 (steps at tokens 0 and 2 of 3), the second's split failed (kept 0, no advantage)."""
    import torch

    mask = torch.zeros(2, 5)
    adv, kept = response_advantages([[0, 2], None], [[0, 1], []], [0.5, 0.75], [1.0, 0.0], [1, 1], [3, 2], mask)
    # A_0 = V(S_1) - V(S_0) = 0.25 on tokens 0-1, A_1 = R - V(S_1) = 0.25 on token 2
    assert adv.tolist() == [[0.0, 0.25, 0.25, 0.25, 0.0], [0.0] * 5] and kept.tolist() == [1.0, 0.0]
    adv, _ = response_advantages([[0, 2]], [[0, None]], [0.5], [1.0], [0], [3], torch.zeros(1, 3))
    assert adv.tolist() == [[0.5, 0.5, 0.0]]  # S_1 past the cap: back-filled with R, so its step gets R - R = 0
