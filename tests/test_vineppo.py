"""Unit tests of vineppo.py's pure functions: step advantages, back-fill, token advantages, states."""

import random

import pytest

from algorithms.vineppo import Args, backfill_values, dedup_states, step_advantages, token_advantages, validate
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
    with pytest.raises(ValueError, match="num_mc_rollouts"):
        validate(Args(num_mc_rollouts=0))
    from shared.cli import check_args

    with pytest.raises(ValueError, match="max_step_for_value_estimation"):
        check_args(Args(max_step_for_value_estimation=-1))  # its range, declared beside the flag
