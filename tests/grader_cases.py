r"""Hand-written grading cases: (task, question, gold, response, expected, what it checks).

`expected` is what a careful human grader says. `gold` is what a dataset's answer column holds: a bare answer
(MATH-500's `answer`), a full solution with `\boxed{}` (MATH's `solution`) or a GSM8K answer ending in `#### N`.
Used by tests/test_graders.py (our grader must get every case right) and scripts/experiments/compare_graders.py (ours vs
math-verify, results in docs/bench/graders/).
"""

# Cases where our grader keeps the VinePPO reference protocol against the human verdict (the protocol's published
# numbers depend on them); the test expects the protocol's answer there.
PROTOCOL = {
    "a radical's decimal is not exact": "numbers within 1e-3 are equal (the numeric fallback's tolerance)",
    "power vs its value": "exponents of two or more digits are never evaluated (sympy can hang on them)",
}

MATH_Q = "Compute the value."
COMMAS_Q = "Find all solutions, separated by commas."

CASES = [
    # bare gold answers (MATH-500 `answer` column), fractions
    ("math", MATH_Q, r"\frac{14}{3}", r"So the answer is $\boxed{\frac{14}{3}}$.", True, "bare gold, boxed fraction"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{\dfrac{14}{3}}$", True, r"\dfrac"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{\tfrac{14}{3}}$", True, r"\tfrac"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{14/3}$", True, "a/b"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{\frac{28}{6}}$", True, "unreduced fraction"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{4\frac{2}{3}}$", True, "mixed number"),
    ("math", MATH_Q, r"\frac{14}{3}", r"$\boxed{4.67}$", False, "rounded decimal is not exact"),
    ("math", MATH_Q, r"\frac{14}{3}", r"The answer is 3", False, "wrong last number"),
    ("math", MATH_Q, r"\frac{14}{3}", r"We get $x = \boxed{\frac{14}{3}}$", True, "boxed inside an equation"),
    ("math", MATH_Q, r"\dfrac{14}{3}", r"$\boxed{\frac{14}{3}}$", True, r"\dfrac in the gold"),
    ("math", MATH_Q, r"\frac{14}{3}", r"so the answer is $\boxed{\frac{14", False, "truncated response"),
    # decimals vs fractions
    ("math", MATH_Q, r"\frac{1}{2}", r"$\boxed{0.5}$", True, "decimal for a fraction"),
    ("math", MATH_Q, r"0.5", r"$\boxed{\frac12}$", True, r"\frac12 for a decimal"),
    ("math", MATH_Q, r"1.5", r"$\boxed{\frac{3}{2}}$", True, "fraction for a decimal"),
    ("math", MATH_Q, r"\frac{1}{3}", r"$\boxed{0.3}$", False, "a wrong decimal"),
    # negative numbers
    ("math", MATH_Q, r"-3", r"$\boxed{-3}$", True, "negative integer"),
    ("math", MATH_Q, r"-3", r"$\boxed{3}$", False, "sign matters"),
    ("math", MATH_Q, r"-\frac{1}{2}", r"$\boxed{-0.5}$", True, "negative fraction vs decimal"),
    ("math", MATH_Q, r"-\frac{1}{2}", r"$\boxed{\frac{-1}{2}}$", True, "sign inside the fraction"),
    # percent, units, degrees, dollars
    ("math", MATH_Q, r"10\%", r"$\boxed{10\%}$", True, "percent"),
    ("math", MATH_Q, r"10", r"$\boxed{10\%}$", True, "percent sign vs bare gold"),
    ("math", MATH_Q, r"5", r"$\boxed{5\text{ cm}}$", True, "units in the response"),
    ("math", MATH_Q, r"5\text{ cm}", r"$\boxed{5}$", True, "units in the gold"),
    ("math", MATH_Q, r"12", r"$\boxed{12 \text{ inches}}$", True, "units with a space"),
    ("math", MATH_Q, r"90^\circ", r"$\boxed{90}$", True, "degrees in the gold"),
    ("math", MATH_Q, r"90", r"$\boxed{90^{\circ}}$", True, "degrees in the response"),
    ("math", MATH_Q, r"\$18.90", r"$\boxed{18.90}$", True, "dollar sign in the gold"),
    ("math", MATH_Q, r"18.90", r"$\boxed{\$18.9}$", True, "dollar sign and trailing zero"),
    # thousands separators
    ("math", MATH_Q, r"1000", r"$\boxed{1,000}$", True, "thousands comma"),
    ("math", MATH_Q, r"1000000", r"$\boxed{1{,}000{,}000}$", True, "LaTeX thousands separator"),
    ("math", MATH_Q, r"10,080", r"$\boxed{10080}$", True, "comma in the gold"),
    # intervals, tuples, unions
    ("math", MATH_Q, r"(2, 5]", r"$\boxed{(2,5]}$", True, "half-open interval"),
    ("math", MATH_Q, r"(2, 5]", r"$\boxed{[2,5)}$", False, "other half-open interval"),
    ("math", MATH_Q, r"(-\infty, 3)", r"$\boxed{(-\infty,3)}$", True, "infinite interval"),
    ("math", MATH_Q, r"[1, 4] \cup [6, 9]", r"$\boxed{[1,4]\cup[6,9]}$", True, "union of intervals"),
    ("math", MATH_Q, r"(1, 2)", r"$\boxed{(1,2)}$", True, "point"),
    ("math", MATH_Q, r"(1, 2)", r"$\boxed{(2,1)}$", False, "point, coordinates swapped"),
    # matrices and vectors
    ("math", MATH_Q, r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"$\boxed{\begin{pmatrix}1\\2\end{pmatrix}}$", True,
     "vector"),
    ("math", MATH_Q, r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
     r"$\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 5 \end{pmatrix}}$", False, "matrix, one entry wrong"),
    ("math", MATH_Q, r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
     r"$\boxed{\begin{pmatrix}1&2\\3&4\end{pmatrix}}$", True, "matrix, spacing"),
    # \text{} answers
    ("math", MATH_Q, r"\text{(C)}", r"$\boxed{\text{(C)}}$", True, "multiple choice"),
    ("math", MATH_Q, r"\text{(C)}", r"$\boxed{(C)}$", True, "multiple choice without \\text"),
    ("math", MATH_Q, r"\text{Tuesday}", r"$\boxed{\text{Tuesday}}$", True, "word answer"),
    ("math", MATH_Q, r"\text{Tuesday}", r"$\boxed{\text{Monday}}$", False, "wrong word"),
    # several boxes
    ("math", MATH_Q, r"2", r"Not $\boxed{1}$; the answer is $\boxed{2}$", True, "the last box counts"),
    ("math", MATH_Q, r"3", r"First $\boxed{3}$, but correcting: $\boxed{4}$", False, "the last box is wrong"),
    ("math", COMMAS_Q, r"3, 5", r"$\boxed{5, 3}$", True, "comma-separated solutions, any order"),
    ("math", COMMAS_Q, r"3, 5", r"$\boxed{3}$", False, "one of two solutions"),
    # radicals, pi, symbolic
    ("math", MATH_Q, r"\sqrt{2}", r"$\boxed{\sqrt2}$", True, r"\sqrt2"),
    ("math", MATH_Q, r"2\sqrt{3}", r"$\boxed{\sqrt{12}}$", True, "equal radicals"),
    ("math", MATH_Q, r"\sqrt{2}", r"$\boxed{1.414}$", False, "a radical's decimal is not exact"),
    ("math", MATH_Q, r"\frac{\sqrt{3}}{2}", r"$\boxed{\frac{\sqrt3}{2}}$", True, "radical in a fraction"),
    ("math", MATH_Q, r"2\pi", r"$\boxed{2 \pi}$", True, "pi"),
    ("math", MATH_Q, r"\infty", r"$\boxed{\infty}$", True, "infinity"),
    ("math", MATH_Q, r"x^2+2x+1", r"$\boxed{(x+1)^2}$", True, "factored polynomial"),
    ("math", MATH_Q, r"x^2+2x+1", r"$\boxed{x^2+2x+2}$", False, "different polynomial"),
    ("math", MATH_Q, r"2^{10}", r"$\boxed{1024}$", True, "power vs its value"),
    ("math", MATH_Q, r"5", r"$\boxed{x = 5}$", True, "variable assignment"),
    ("math", MATH_Q, r"y = 2x + 3", r"$\boxed{y=2x+3}$", True, "equation answer"),
    # no box
    ("math", MATH_Q, r"7", r"I think the answer is 7.", True, "'the answer is' without a box"),
    ("math", MATH_Q, r"0", r"", False, "empty response"),
    # gold solutions (MATH `solution` column): the gold is the solution's last box
    ("math", MATH_Q, r"Adding, $3x = 14$, so $x = \boxed{\frac{14}{3}}$.", r"$\boxed{\frac{14}{3}}$", True,
     "gold solution"),
    ("math", MATH_Q, r"There are $2 \cdot 5 = \boxed{10}$ ways.", r"The answer is 10.", True,
     "gold solution, unboxed response"),
    ("math", MATH_Q, r"There are $2 \cdot 5 = \boxed{10}$ ways.", r"$\boxed{5}$", False,
     "gold solution; a number of the solution is not its answer"),
    ("math", "What is 12+7?", "12 + 7 = 19\n#### 19", "12 + 7 = 19", True,
     "GSM8K-format gold with the math grader (docs/real_models.md)"),
    ("math", "What is 12+7?", "12 + 7 = 19\n#### 19", "12 + 7 = 20", False, "GSM8K-format gold, wrong sum"),
    ("math", MATH_Q, "Adding gives 14.\nThe answer is 14.", "$\\boxed{14}$", True, "unboxed gold solution"),
    # GSM8K `#### N` answers
    ("gsm8k", "", "She pays 2 * 617 = <<2*617=1234>>1234.\n#### 1234", "2*617=1234\n#### 1,234", True,
     "comma in the response"),
    ("gsm8k", "", "#### 1,234", "#### 1234", True, "GSM8K comma in the gold"),
    ("gsm8k", "", "#### 18", "#### $18", True, "dollar sign"),
    ("gsm8k", "", "#### 18", "#### 18.00", True, "trailing zeros"),
    ("gsm8k", "", "#### 18", "#### 18.", True, "trailing period"),
    ("gsm8k", "", "#### -3", "#### -3", True, "negative"),
    ("gsm8k", "", "#### 5", "#### 5\n#### 6", False, "the last #### counts"),
    ("gsm8k", "", "#### 18", "#### 81", False, "wrong number"),
    ("gsm8k", "", "#### 18", "The total is 18", False, "no #### line (the GSM8K format asks for one)"),
]
