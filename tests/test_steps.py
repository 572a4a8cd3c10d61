r"""Step segmentation for VinePPO (shared/steps.py), against the VinePPO reference code's splitters."""

import random

import pytest

from shared.steps import (
    StepSplitError,
    get_splitter,
    split_gsm8k,
    split_lines,
    split_math,
    steps_from_boundaries,
)

SPLITTERS = [split_gsm8k, split_math, split_lines]


def check_invariants(splitter, response):
    """Boundaries start at 0, end at len(response), strictly increase (empty response: [0]), steps reassemble."""
    b = splitter(response)
    assert all(isinstance(i, int) for i in b)
    assert b[0] == 0 and b[-1] == len(response)
    if response:
        assert all(x < y for x, y in zip(b, b[1:])), b
    else:
        assert b == [0]
    steps = steps_from_boundaries(response, b)
    assert "".join(steps) == response
    return steps


FIXED = [
    "",
    "\n",
    "\n\n\n",
    "7",
    "7\n12\n13",
    "7\n12\n13\n",
    "Natalia sold 48 clips.\nThen 24.\n#### 72",
    "\n\nNatalia sold 48 clips.\n\nThen 24.\n\n#### 72",
    "\n#### 5",
    "no answer here\n####5",
    "We have $x. Y$ so the value is 3. Then we add more words here.",
    "$$a\nb$$",
    "We note that\n\\begin{align}\na &= 1\\\\\nb &= 2\n\\end{align}\nThis gives the answer $\\boxed{3}$.",
    "[asy]\ndraw((0,0)--(1,1));\n[/asy]\nThe picture shows it. So the area is $\\frac{1}{2}$.",
    "unclosed $x + y = 3. Then \\( nothing closes here either\n\\[ still open",
    "\\begin{align} $x$ \n \\(y\\) \\end{align}. Nested math is restored fully.",  # placeholders inside placeholders
    "private-use characters \ue000\ue001 in the response do not clash with placeholders. Yes.",
    "x" * 250,
    "a = " + " + ".join(str(i) for i in range(60)) + " = 1770",
]


@pytest.mark.parametrize("splitter", SPLITTERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("response", FIXED)
def test_invariants_fixed(splitter, response):
    check_invariants(splitter, response)


TOKENS = ["The ", "we ", "So ", "x", " ", " ", "a", "value", ".", ". ", ", ", ":", " and ", " to ", "e.g. ", "Mr. ",
          "\n", "\n", "\n\n", "$", "$x$", "$x.$", "$$", "$$y = 1.$$", "\\(", "\\)", "\\[", "\\]", "\\[a+b=c.\\]", "=", "+",
          "\\equiv", "\\begin{align}", "\\end{align}", "[asy]", "[/asy]", "\\boxed{5}", "{", "}", "12", ",$", ",\\)",
          "\\cancelto", "\n#### ", "####", "\\begin{tabular}", "\\end{tabular}", "$$\n", "\n$$", "\\$", "A", "I"]


@pytest.mark.parametrize("splitter", SPLITTERS, ids=lambda f: f.__name__)
def test_invariants_random(splitter):
    rng = random.Random(1234)
    for _ in range(300):
        response = "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 80)))
        if splitter is split_gsm8k and response.count("\n#### ") > 1:
            with pytest.raises(StepSplitError):
                splitter(response)
            continue
        check_invariants(splitter, response)


# -- GSM8K -------------------------------------------------------------------------------------------------------


def test_gsm8k_answer_merged_into_last_step():
    response = "Natalia sold 48 clips.\nThen 24.\n#### 72"
    assert check_invariants(split_gsm8k, response) == ["Natalia sold 48 clips.", "\nThen 24.\n#### 72"]


def test_gsm8k_leading_blank_lines_merged_into_first_step():
    steps = check_invariants(split_gsm8k, "\n \nFirst.\nSecond.\n#### 2")
    assert steps == ["\n \nFirst.", "\nSecond.\n#### 2"]


def test_gsm8k_trailing_blank_lines_go_with_the_answer_step():
    steps = check_invariants(split_gsm8k, "A.\n\nB.\n\n\n#### 3")
    assert steps == ["A.", "\n", "\nB.\n\n\n#### 3"]  # an empty line in the middle stays a step (reference)


def test_gsm8k_without_answer_prefix_is_a_plain_line_split():
    assert check_invariants(split_gsm8k, "A.\nB.\n####4") == ["A.", "\nB.", "\n####4"]
    assert check_invariants(split_gsm8k, "A.\nB.\n") == ["A.", "\nB.", "\n"]


def test_gsm8k_answer_only_and_blank_responses():
    assert check_invariants(split_gsm8k, "\n#### 5") == ["\n#### 5"]
    assert check_invariants(split_gsm8k, "\n\n#### 5") == ["\n\n#### 5"]
    assert check_invariants(split_gsm8k, "\n\n") == ["\n", "\n"]  # reference: "", "\n", "\n" (empty step dropped)
    assert split_gsm8k("") == [0]


def test_gsm8k_two_answer_prefixes_raise():
    with pytest.raises(StepSplitError):
        split_gsm8k("A.\n#### 1\n#### 2")
    assert issubclass(StepSplitError, ValueError)


# -- MATH --------------------------------------------------------------------------------------------------------


def test_math_sentence_end_inside_inline_math_does_not_split():
    response = "We have $x. Y$ so the value is 3. Then we add more words here."
    steps = check_invariants(split_math, response)
    assert steps == ["We have $x. Y$ so the value is 3.", " Then we add more words here."]


def test_math_sentence_split_needs_whitespace_and_a_capital():
    steps = check_invariants(split_math, "First we compute the sum. Then we divide it by two.")
    assert steps == ["First we compute the sum.", " Then we divide it by two."]
    assert check_invariants(split_math, "First we compute the sum. then we divide it by two.") == [
        "First we compute the sum. then we divide it by two."]
    # no split after one- or two-letter abbreviations
    steps = check_invariants(split_math, "We ask Mr. Smith about the apples. He has three of them, e.g. A and B.")
    assert steps == ["We ask Mr. Smith about the apples.", " He has three of them, e.g. A and B."]
    # ... which includes two-letter words such as "it." (the sentence-end regex of split_math's step 2)
    assert len(check_invariants(split_math, "We ask Mr. Smith about it. He has three apples in total.")) == 1


def test_math_newline_split():
    steps = check_invariants(split_math, "First we compute the sum\nThen we divide it by two to get it.")
    assert steps == ["First we compute the sum", "\nThen we divide it by two to get it."]


def test_math_short_fragments_merged_into_next():
    # < 20 characters without a final "." merge into the next part; so do lone newlines
    steps = check_invariants(split_math, "Ok\nNow we compute the whole thing carefully.")
    assert steps == ["Ok\nNow we compute the whole thing carefully."]
    steps = check_invariants(split_math, "We compute the whole thing carefully.\n\nNow we divide it by two.")
    assert steps == ["We compute the whole thing carefully.", "\n\nNow we divide it by two."]


def test_math_short_or_empty_response_is_one_step():
    # Deviation: the reference fails on responses < 20 characters (it drops boundary 0); we return one step.
    assert split_math("") == [0]
    assert split_math("short") == [0, 5]
    assert split_math("$$a\nb$$") == [0, 3, 7]


def test_math_split_after_math_ending_a_sentence():
    steps = check_invariants(split_math, "Thus we get $x = 2.$ Next we need the other root of it.")
    assert steps == ["Thus we get $x = 2.$", " Next we need the other root of it."]


def test_math_long_part_split_near_middle_at_comma():
    response = ("We want to find the number of ways to choose the committee members, "
                "and we note that order does not matter here at all.")
    assert len(response) > 100
    steps = check_invariants(split_math, response)
    assert steps == [response[:67], response[67:]] and steps[0].endswith("members,")


def test_math_long_math_part_split_at_operator():
    response = "$" + " + ".join(f"x_{{{i}}}" for i in range(25)) + "$"  # no language punctuation outside math
    steps = check_invariants(split_math, response)
    assert len(steps) >= 2 and all(s[-1] == "+" for s in steps[:-1])
    assert all(len(s) >= 20 for s in steps)


def test_math_display_math_newlines_keep_opening_with_content():
    response = "We compute the following sum now:\n$$a\nb$$\nSo the answer is five."
    steps = check_invariants(split_math, response)
    assert steps == ["We compute the following sum now:", "\n$$a", "\nb$$\nSo the answer is five."]
    # an opening delimiter on its own line is never a step of its own
    response = "We compute the following sum now:\n$$\na + b + c + d\n= e + f\n$$\nSo the answer is five."
    steps = check_invariants(split_math, response)
    assert all(s.strip() not in ("$$", "$", "\\[", "\\(") for s in steps)
    assert "\n$$\na + b + c + d" in steps


def test_math_environment_lines_are_steps():
    response = "We note that\n\\begin{align}\na &= 1\\\\\nb &= 2\n\\end{align}\nThis gives the answer."
    steps = check_invariants(split_math, response)
    assert steps == ["We note that\n\\begin{align}", "\na &= 1\\\\", "\nb &= 2", "\n\\end{align}",
                     "\nThis gives the answer."]


def test_math_boxed_answer_stays_in_last_step():
    response = "So $x = 2$ and therefore we have it.\nThe final answer is $\\boxed{2}$."
    steps = check_invariants(split_math, response)
    assert steps == ["So $x = 2$ and therefore we have it.", "\nThe final answer is $\\boxed{2}$."]
    # a final boxed line shorter than 20 characters is merged into the previous step (split_math's step 3)
    steps = check_invariants(split_math, "First we add all of them up.\nAdding them gives the total count.\n$\\boxed{12}$")
    assert steps == ["First we add all of them up.", "\nAdding them gives the total count.\n$\\boxed{12}$"]


# -- built-in task, helpers --------------------------------------------------------------------------------------


def test_lines_builtin_task():
    assert split_lines("7\n12\n13") == [0, 1, 4, 7]
    assert check_invariants(split_lines, "7\n12\n13") == ["7", "\n12", "\n13"]
    assert split_lines("") == [0]
    assert check_invariants(split_lines, "\n7\n") == ["\n7", "\n"]


def test_steps_from_boundaries_validates():
    assert steps_from_boundaries("abc", [0, 1, 3]) == ["a", "bc"]
    assert steps_from_boundaries("", [0]) == []
    for bad in ([], [1, 3], [0, 2], [0, 2, 1, 3]):
        with pytest.raises(ValueError):
            steps_from_boundaries("abc", bad)


def test_get_splitter():
    assert get_splitter("gsm8k") is split_gsm8k
    assert get_splitter("math") is split_math
    assert get_splitter("lines") is split_lines
    with pytest.raises(ValueError, match="name='mmlu'"):
        get_splitter("mmlu")
