"""Tests for shared/graders.py: extraction and grading as the VinePPO reference code does them, plus
normalisation details, the sympy sandbox and robustness to garbage input."""

import time

import pytest

from shared.graders import (
    extract_gsm8k_answer,
    extract_math_answer,
    grade,
    grade_gsm8k,
    grade_math,
    gsm8k_gold_from_solution,
    latex_to_text,
    math_equal,
    math_gold_from_solution,
    remove_gsm8k_calculator_annotations,
    should_allow_eval,
    strip_math_string,
    symbolic_equal,
)

# ---------------------------------------------------------------------------------------------------------- GSM8K

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_gsm8k_gold_and_calculator_annotations():
    assert gsm8k_gold_from_solution(GSM8K_SOLUTION) == "72"
    assert gsm8k_gold_from_solution("lots of work\n#### 1,234 ") == "1,234"  # commas kept as in the gold
    assert "<<" not in remove_gsm8k_calculator_annotations(GSM8K_SOLUTION)
    assert "48/2 = 24 clips" in remove_gsm8k_calculator_annotations(GSM8K_SOLUTION)
    with pytest.raises(ValueError):
        gsm8k_gold_from_solution("no answer line")


def test_gsm8k_commas_removed_from_prediction():
    assert grade_gsm8k("She pays 1,234 dollars.\n#### 1,234", "1234")
    assert grade("gsm8k", "She pays 1,234 dollars.\n#### 1,234", "1234") == 1.0


def test_gsm8k_same_number_matches_but_no_tolerance():
    # the VinePPO reference compared strings (18.0 != 18, $18 != 18); the same number matches here, nothing close does
    assert grade_gsm8k("#### 18.0", "18") and grade_gsm8k("#### $18", "18") and grade_gsm8k("#### 1,234", "1,234")
    assert grade("gsm8k", "#### 18.01", "18") == 0.0 and grade("gsm8k", "#### 18 apples", "18") == 0.0
    assert grade("gsm8k", "#### 18", "18") == 1.0


def test_gsm8k_missing_hashes_is_none_and_zero_reward():
    assert extract_gsm8k_answer("The answer is 72.") is None
    assert not grade_gsm8k("The answer is 72.", "72")
    assert grade("gsm8k", "The answer is 72.", "72") == 0.0


def test_gsm8k_uses_last_hashes_and_full_gold_solution():
    assert extract_gsm8k_answer("#### 5\nwait, no\n#### 72 ") == "72"
    assert grade("gsm8k", "#### 72", GSM8K_SOLUTION) == 1.0  # full solution accepted as gold too


# ------------------------------------------------------------------------------------------- MATH normalisation


@pytest.mark.parametrize(
    "raw, expected",
    [
        (r"\frac12", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (".5", "0.5"),
        ("3/4", r"\frac{3}{4}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"5\text{ cm}", "5"),
        (r"90^\circ", "90"),
        (r"\$10.00", "10"),
        (r"\left( 1, 2 \right]", "(1,2]"),
        (r"10\%", "10%"),
        ("2j", "2i"),
        ("infinity", r"\infty"),
        (r"x\in[1,2]", "[1,2]"),
        (r"\text{Evelyn}", "Evelyn"),
    ],
)
def test_strip_math_string(raw, expected):
    assert strip_math_string(raw) == expected


# ----------------------------------------------------------------------------------------------- MATH equality


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"\frac12", "0.5"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("(1, 2]", "(1,2]"),
        (r"(\frac12, 2]", "(0.5,2]"),
        ("x = 3", "3"),
        ("3", "x=3"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        ("y=2x+1", "2x-y+1=0"),
        ("x^2+2x+1", "(x+1)^2"),
        (r"10\%", "0.1"),
        (r"2\frac{1}{4}", r"\frac{9}{4}"),
        (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix}1\\\frac{4}{2}\end{pmatrix}"),
    ],
)
def test_math_equal_equivalences(pred, gold):
    assert math_equal(strip_math_string(pred), strip_math_string(gold))


@pytest.mark.parametrize(
    "pred, gold",
    [("3", "4"), (r"\frac{1}{3}", "0.33"), ("(1,2]", "[1,2)"), ("x+1", "x+2"), ("(1,2)", "(1,2,3)")],
)
def test_math_equal_rejects(pred, gold):
    assert not math_equal(strip_math_string(pred), strip_math_string(gold))


def test_grade_math_end_to_end_equivalences():
    sol = r"Thus the probability is $\boxed{\dfrac{1}{2}}$."
    assert grade("math", r"So we get $\boxed{0.5}$.", sol) == 1.0
    assert grade("math", r"So we get $\boxed{\frac12}$.", sol) == 1.0
    assert grade("math", r"So we get $\boxed{\frac13}$.", sol) == 0.0
    union = r"$\boxed{(-\infty, 1) \cup (2, \infty)}$"
    assert grade("math", r"\boxed{(2,\infty)\cup(-\infty,1)}", union) == 1.0


# --------------------------------------------------------------------------------------------- MATH extraction


def test_extraction_precedence():
    final = "The answer is 7. \\boxed{6}\nFinal Answer: The final answer is $5$. I hope it is correct. 9"
    assert extract_math_answer("", final) == ["5"]
    assert extract_math_answer("", "The answer is 7, i.e. \\boxed{6}. Then 9") == ["6"]
    assert extract_math_answer("", "We find 3 apples, so the answer is 7.\n Check: 9") == ["7"]
    assert extract_math_answer("", "We find 3 apples and then 1,234.5 pears") == ["1234.5"]
    assert extract_math_answer("", "```output\n42\n```\nthen 9") == ["42"]
    assert extract_math_answer("", "no numbers at all") == []


def test_boxed_nested_braces_and_multiple_boxes():
    assert extract_math_answer("", r"so $x = \boxed{\frac{1}{2}}$.") == [r"\frac{1}{2}"]
    text = r"first \boxed{\sqrt{\frac{3}{4}}} then \boxed{ 2 }"
    assert extract_math_answer("", text) == [r"\sqrt{\frac{3}{4}}", "2"]
    assert extract_math_answer("", r"\boxed{3 \text{ and } 4}") == ["3", "4"]


def test_gold_comes_from_solution_boxed_not_answer_field():
    item = {
        "problem": "Compute the value.",
        "solution": r"We have $\frac{2}{4} = \boxed{\frac{1}{2}}$. The answer is 7 in some other unit.",
        "answer": "7",  # a separate (here deliberately wrong) answer field: must be ignored
    }
    assert math_gold_from_solution(item["problem"], item["solution"]) == [r"\frac{1}{2}"]
    assert grade("math", r"\boxed{1/2}", item["solution"], question=item["problem"]) == 1.0
    assert grade("math", r"\boxed{7}", item["solution"], question=item["problem"]) == 0.0


def test_separated_by_commas_keeps_last_len_gold_predictions():
    q = "Find all real solutions, separated by commas."
    sol = r"Factoring gives $x = \boxed{1, -2}$."
    assert math_gold_from_solution(q, sol) == ["1", "-2"]
    assert extract_math_answer(q, r"\boxed{-2,1}") == ["-2", "1"]
    assert grade_math(q, r"\boxed{-2,1}", sol)
    # A stray early box is dropped: only the last len(gold) = 2 (de-duplicated) predictions are kept.
    assert grade_math(q, r"first \boxed{3}, finally \boxed{1, -2} \boxed{1}", sol)
    assert not grade_math(q, r"\boxed{1}", sol)  # gold -2 unmatched
    assert not grade_math(q, r"\boxed{1, -2, 3}", sol)  # last two are -2, 3
    # Without the phrase the comma answer stays one tuple-like string.
    assert extract_math_answer("Find x.", r"\boxed{1, -2}") == ["1,-2"]


# ----------------------------------------------------------------------------------------- sympy sandbox / guards


def test_latex_to_text():
    assert latex_to_text(r"\frac{\sqrt{3}}{2}") == "(sqrt(3))/(2)"
    assert latex_to_text(r"2\frac{1}{4}") == "2+(1)/(4)"  # mixed number
    assert latex_to_text(r"\sqrt[3]{x}") == "root(x,3)"
    assert latex_to_text(r"3\pi \cdot 2").replace(" ", "") == "3pi*2"


def test_guards_refuse_unsafe_or_slow_text():
    assert should_allow_eval("2*sqrt(3)+pi")
    assert not should_allow_eval("__import__('os').system('true')")
    assert not should_allow_eval("x.y")  # attribute access
    assert not should_allow_eval("abcd+1")  # more than two unknown letters
    assert not should_allow_eval("(x+1)^100000")
    assert not symbolic_equal("__import__('os').system('true')", "0")


def test_symbolic_equal_pathological_times_out_and_pool_recovers():
    assert symbolic_equal(r"\frac{1}{2}", "0.5")  # warm the worker so start-up is not timed below
    # Refused by the guards before sympy ever sees it.
    t0 = time.monotonic()
    assert not symbolic_equal("(x+1)^{100000}", "1", timeout=2)
    assert time.monotonic() - t0 < 1.0
    # Passes the guards (single-digit exponents) but is 9^(9^8): sympy would compute it for a very long time.
    tower = "(((((((9^9)^9)^9)^9)^9)^9)^9)^9"
    t0 = time.monotonic()
    assert not symbolic_equal(tower, "1", timeout=2)
    assert time.monotonic() - t0 < 8.0
    # The killed worker is replaced and grading goes on.
    assert symbolic_equal(r"2\sqrt{2}", r"\sqrt{8}")
    assert grade("math", r"\boxed{\frac{9}{4}}", r"\boxed{2\frac{1}{4}}") == 1.0


# ------------------------------------------------------------------------------------------- reward entry point


def test_truncated_response_gets_zero_for_both_tasks():
    assert grade("gsm8k", "#### 72", "72", finished=True) == 1.0
    assert grade("gsm8k", "#### 72", "72", finished=False) == 0.0
    assert grade("math", r"\boxed{5}", r"\boxed{5}", finished=True) == 1.0
    assert grade("math", r"\boxed{5}", r"\boxed{5}", finished=False) == 0.0


GARBAGE = ["", " ", "}", "{", r"\boxed{", r"\boxed{}}}", "ü∞√ 日本語", r"\frac", r"\frac{", r"\sqrt[", "^^^",
           "{" * 300, r"\boxed{" + "{" * 2000, "\x00", "####", "#### ", r"\boxed{\frac{1}{0}}", r"\boxed{x==3}",
           r"\boxed{=}", r"\boxed{(,)}", r"\boxed{\begin{pmatrix}\end{pmatrix}}", r"\boxed{\\\\}", "9" * 5000,
           r"\boxed{" + "9" * 5000 + "}", r"\boxed{1/0}", r"\boxed{\text{}}", r"The final answer is $$. I hope"]


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_grade_never_raises_on_garbage(task):
    for text in GARBAGE:
        for gold in ["", "5", r"\boxed{5}", "#### 5", text]:
            assert grade(task, text, gold, question=text) in (0.0, 1.0)
            assert grade(task, text, gold, question="separated by commas") in (0.0, 1.0)


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError):
        grade("mmlu", "x", "y")


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_symbolic_grading_works_from_a_caller_without_a_main_guard(tmp_path, how):
    """A user's script that calls the `math` reward at top level (no `if __name__ == "__main__":`), or code fed on
    stdin: the sympy worker must start without re-importing (re-running) the caller, and grade correctly."""
    import os
    import subprocess
    import sys

    code = ("from shared.rewards import math_reward\n"
            "print('ran', flush=True)\n"
            "print(math_reward(['q'], [r'The answer is $\\frac{1}{2}$'], ['\\\\boxed{0.5}'], [True]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    if how == "script":
        path = tmp_path / "user_reward.py"
        path.write_text(code)
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120)
    else:
        proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["ran", "[1.0]"]  # the script body ran once, and 1/2 == 0.5 symbolically


# ---------------------------------------------------------------- the hand-written table (tests/grader_cases.py)
def _cases():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from grader_cases import CASES, PROTOCOL

    return CASES, PROTOCOL


def test_grader_table_has_the_required_coverage():
    cases, protocol = _cases()
    assert len(cases) >= 60
    notes = [c[5] for c in cases]
    assert len(set(notes)) == len(notes) and set(protocol) <= set(notes)
    golds = " ".join(c[2] for c in cases if c[0] == "math")
    for needle in (r"\dfrac", "%", r"\text", "pmatrix", r"\cup", "(2, 5]", "-3", "1000", r"\boxed"):
        assert needle in golds or any(needle in c[3] for c in cases), needle


@pytest.mark.parametrize("case", _cases()[0], ids=lambda c: c[5])
def test_grader_table(case):
    """Bare MATH gold answers and gold solutions both work; GSM8K answers with commas and dollars. `math` gives the
    human verdict except on the documented protocol cases (tests/grader_cases.py PROTOCOL); `math_verify` (our
    extraction, math-verify's equivalence) gives it on every case."""
    task, question, gold, response, expected, note = case
    protocol = _cases()[1]
    want = (not expected) if note in protocol else expected
    assert bool(grade(task, response, gold, question=question)) == want
    if task == "math":
        assert bool(grade("math_verify", response, gold, question=question)) == expected


def test_math_verify_checker_times_out_instead_of_hanging():
    from shared.graders import math_verify_equal

    start = time.time()
    assert not math_verify_equal("9^{9^{9^{9}}}", "1", timeout=3.0)
    assert time.time() - start < 30


def _new_grader_worker():
    """End the grader's worker process (a fresh one starts on the next call): math-verify logs its "Timeout is
    disabled" warnings once per process, and a worker started inside a test writes to that test's captured fds."""
    from shared import graders

    with graders._POOL_LOCK:
        if graders._POOL is not None:
            graders._POOL.terminate()
            graders._POOL = None


@pytest.mark.parametrize("verbose", [False, True])
def test_math_verify_reward_prints_nothing_of_math_verify_unless_verbose(capfd, verbose):
    """`--reward_fn math_verify` runs math-verify with its own timeouts off, and it logs "Timeout is disabled ..."
    (logger math_verify.parser / math_verify.grader, in the grader's worker process): not shown in a run without
    --verbose (run_cli's quiet_libraries(False)), shown with --verbose. conftest.py undoes quiet_libraries."""
    from shared.console import quiet_libraries
    from shared.rewards import load_reward_fn

    quiet_libraries(verbose)
    _new_grader_worker()  # started below, inside the capture, with math-verify's warning not yet logged
    try:
        capfd.readouterr()
        reward_fn = load_reward_fn("math_verify", "builtin")
        # different strings, so that math-verify (not the string-equality shortcut) decides
        completions = [r"so \boxed{\frac{1}{2}}", r"\boxed{3}"]
        assert reward_fn(["q", "q"], completions, ["0.5", "4"], [True, True]) == [1.0, 0.0]
    finally:
        _new_grader_worker()  # the worker's stderr is this test's capture: end it here
    out, err = capfd.readouterr()
    if verbose:
        assert "Timeout is disabled" in err, (out, err)
    else:
        assert out == "" and err == "", (out, err)
