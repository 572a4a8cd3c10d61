r"""Answer extraction and grading for GSM8K and MATH, following the VinePPO reference code
(github.com/McGill-NLP/VinePPO; "the reference" below).

* GSM8K (``McGill-NLP/VinePPO:src/treetune/tasks/gsm8k.py`` with ``use_original_format=True``): the answer is
  the text after the last ``####``; grading is an exact string match after removing commas from the prediction,
  or (not in the reference) the same number once commas, ``$`` and a trailing period are gone: ``$18 == 18.0 ==
  18`` but ``18.01 != 18``.
* MATH (``McGill-NLP/VinePPO:src/treetune/tasks/math_answer_exctraction.py`` and ``math_grader_minerva.py``):
  Minerva-style extraction of a *list* of candidate answers, ``strip_string`` normalisation, then ``eval_math``:
  numeric, string, tuple/interval/matrix and finally symbolic (sympy) equivalence.

Gold texts: a MATH gold may be a worked solution (MATH's ``solution``: its last ``\boxed{}`` is the answer) or a bare
answer (MATH-500's ``answer``), told apart by ``is_math_solution``; a GSM8K-format gold gives its ``####`` number.
tests/grader_cases.py holds 76 hand-written cases (tests/test_graders.py); scripts/experiments/compare_graders.py runs them
through math-verify too.

Differences from the reference, all on purpose:
* LaTeX is turned into sympy-readable text by a small converter in this file instead of ``pylatexenc``.
* All sympy work (parsing, ``simplify`` and the numeric fallback) runs in a single ``spawn`` worker process with a
  timeout, so a pathological answer can never hang the caller; the reference ran the ``N()`` fallback in-process.
  A worker that dies (the OOM killer, a SIGKILL) counts as a timeout, as one that runs out of time: the call grades
  as incorrect and a fresh worker serves the next one. The worker ignores SIGINT and SIGTERM (sent to the whole
  process group by Ctrl-C, ``scancel``, ``timeout``), so the caller finishes its step and checkpoint with it, and
  kills it at exit; it also exits by itself when the caller dies.
* Parsing is guarded (length limit, character allow-list, no builtins) on top of ``should_allow_eval``.
* Intervals/tuples must use the same bracket types (the reference accepted ``[1,2)`` for ``(1,2]``).
* An empty gold list (solution without an extractable answer) grades as incorrect.
* ``\boxed{5}%`` extracts ``5%`` (the reference kept a stray brace, ``5}``).
* A MATH gold that is a bare answer (MATH-500's ``answer`` column, no ``\boxed``) is used as it stands; the reference
  only took gold solutions, and passing it a bare ``\frac{14}{3}`` made the gold its last number, ``3``.
* ``1{,}000`` reads as ``1000``; a GSM8K answer also matches when it is the same number once commas, a leading
  ``$`` and a trailing period are removed (``$18``, ``18.00``, ``18.`` vs ``18``), where the reference compared strings.
* Kept from the reference on purpose (the protocol's graded numbers depend on them): numbers within 1e-3 are equal
  (``1.414`` for ``\sqrt{2}``), and exponents of two or more digits are not evaluated (``2^{10}`` is not ``1024``).

The worker is started with ``spawn`` but without re-importing the caller's ``__main__`` (which ``spawn`` does by
default), so a reward function called from a script without an ``if __name__ == "__main__":`` guard, a notebook or
stdin works too (`_main_hidden`).
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

# -- GSM8K (the reference's gsm8k.py) -----------------------------------------------------------------------------


def remove_gsm8k_calculator_annotations(solution: str) -> str:
    """Drop GSM8K calculator annotations ``<<48/2=24>>`` from a gold solution (the reference's preprocessing)."""
    return re.sub(r"<<.*?>>", "", solution, flags=re.DOTALL)


def gsm8k_gold_from_solution(solution: str) -> str:
    """Gold answer of a GSM8K ``answer`` field: the text after ``####``, stripped (commas kept as in the data)."""
    if "####" not in solution:
        raise ValueError("GSM8K gold solution has no '####' answer line")
    return solution.split("####")[-1].strip()


def extract_gsm8k_answer(text: str) -> str | None:
    """Predicted answer: ``None`` when the response has no ``####`` (unfinished), else the text after the last one."""
    if "####" not in text:
        return None
    return text.split("####")[-1].strip()


def _gsm8k_number(text: str) -> float | None:
    """The number a GSM8K answer states: commas, a leading ``$`` and a trailing period removed; None if not one."""
    text = text.strip().replace(",", "").rstrip(".").strip()
    text = text[1:] if text.startswith("$") else text
    try:
        return float(text)
    except ValueError:
        return None


def grade_gsm8k(completion: str, gold: str) -> bool:
    """The reference's exact match (``pred.strip().replace(',', '').lower() == gold.strip().lower()``), or the same
    number once commas, a ``$`` and a trailing period are removed from both (the reference fails ``$18``,
    ``18.00``, ``18.`` and a gold written ``1,234``)."""
    pred = extract_gsm8k_answer(completion)
    if pred is None:
        return False
    if "####" in gold:  # tolerate being handed the full gold solution instead of the extracted answer
        gold = gsm8k_gold_from_solution(gold)
    if pred.strip().replace(",", "").lower() == gold.strip().lower():
        return True
    p, g = _gsm8k_number(pred), _gsm8k_number(gold)
    return p is not None and g is not None and p == g


# -- MATH extraction (the reference's math_answer_exctraction.py) -------------------------------------------------


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{72}`` -> ``\frac{1}{72}`` (braced arguments are left alone)."""
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{"):
            out += sub
        elif len(sub) < 2:
            return s  # malformed: give up, like the reference
        elif sub[1] != "{":
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
        else:
            out += "{" + sub[0] + "}" + sub[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    r"""``3/4`` -> ``\frac{3}{4}`` when both sides are plain integers."""
    if len(s.split("/")) != 2:
        return s
    a, b = s.split("/")
    try:
        a = a if "sqrt" in a else str(int(a))
        b = b if "sqrt" in b else str(int(b))
        if f"{a}/{b}" == s:
            return "\\frac{" + a + "}{" + b + "}"
    except ValueError:
        pass
    return s


def strip_math_string(s: str) -> str:
    """Minerva ``strip_string`` normalisation of one answer, rule for rule as in the reference."""
    s = str(s).strip().replace("\n", "").rstrip(".").replace("\\!", "")
    s = s.replace("{,}", "")  # LaTeX thousands separator 1{,}000 (not in the reference: it graded 1{,}000 wrong)
    if s.startswith("\\text{") and s.endswith("}"):
        s = s.split("{", 1)[1][:-1]
    for frac in ("tfrac", "dfrac", "cfrac"):
        s = s.replace(frac, "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    unitless = re.sub(r"\\text{.*?}$", "", s).strip()  # trailing units like "5\text{ cm}"
    if unitless:
        s = unitless
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").strip()
    s = re.sub(r"\{(c|m)?m\}(\^(2|3))?", "", s).strip()
    s = re.sub(r"p\.m\.$", "", s).strip()
    s = re.sub(r"(\d)\s*t$", r"\1", s).strip()
    s = s.replace("\\$", "").replace("$", "").replace("x\\in", "").replace("\\%", "%")
    s = s.replace(" .", " 0.").replace("{.", "{0.").replace("\\cdot", "")
    s = s.replace("infinity", "\\infty")
    if "\\infty" not in s:
        s = s.replace("inf", "\\infty")
    s = s.replace("\\mathbf", "").replace("\\mathrm", "")
    s = re.sub(r"\\mbox{.*?}", "", s)
    if "j" in s and "i" not in s:
        s = s.replace("j", "i")
    # a.000b -> ab; (?<!\d) only makes the scan linear in long digit runs, the result is the reference's.
    s = re.sub(r"(?<!\d)(\d+)\.0+([^\d])", r"\1\2", s)
    s = re.sub(r"(?<!\d)(\d+)\.0+$", r"\1", s)
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    s = re.sub(r"\\sqrt(-?[0-9.a-zA-Z]+)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\sqrt\s+(\w+)$", r"\\sqrt{\1}", s)
    s = re.sub(r"\\tan(-?[0-9.a-zA-Z]+)", r"\\tan{\1}", s)
    s = re.sub(r"\\tan\s+(\w+)$", r"\\tan{\1}", s)
    s = s.replace(" ", "")
    s = _fix_a_slash_b(_fix_fracs(s))
    return re.sub(r"(\\|,|\.)+$", "", s)


def _extract_boxed(text: str) -> list[str]:
    r"""Contents of every ``\boxed{...}`` with brace matching; a ``}%`` suffix keeps the ``%``."""
    answers = []
    for piece in text.split("boxed{")[1:]:
        depth = 0
        for i, ch in enumerate(piece):
            depth += (ch == "{") - (ch == "}")
            if depth < 0:
                # the reference keeps piece[:i + 1] here, i.e. "5}" for "\boxed{5}%"; we keep the intended "5%".
                answers.append(piece[:i] + "%" if piece[i + 1 : i + 2] == "%" else piece[:i])
                break
    return answers


def _extract_raw_answers(text: str) -> list[str]:
    """The reference's ``extract_answer(text, exhaust=True)``: candidates in its order of precedence (below),
    each post-processed."""
    if "final answer is $" in text and "$. I hope" in text:
        raw = [text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()]
    elif "boxed" in text:
        raw = _extract_boxed(text)
    elif "he answer is" in text:
        raw = [text.split("he answer is")[-1].strip()]
    else:
        program_output = text.split("```output")[-1].split("```")[0].strip() if "```output" in text else ""
        if program_output:  # last ```output block, else the last number
            raw = [program_output]
        else:
            raw = re.findall(r"-?\d*\.?\d+", text.replace(",", ""))[-1:]
    out = []
    for ans in raw:
        ans = ans.strip().split("\n")[0].lstrip(":").rstrip(".").rstrip("/")
        out.append(strip_math_string(ans))
    return out


def _split_answers(question: str, answers: list[str]) -> list[str]:
    """The reference's multi-answer split: on commas for "separated by commas" questions, and on ``\text{ and }``."""
    out: list[str] = []
    for ans in answers:
        if "separated by commas" in question and all(ch not in ans for ch in "()[]"):
            out.extend(a.strip() for a in ans.split(","))
        elif re.search(r"\\text\{\s*and\s*\}", ans):
            out.extend(a.strip() for a in re.split(r"\\text\{\s*and\s*\}", ans))
        else:
            out.append(ans.strip())
    return out


def extract_math_answer(question: str, text: str) -> list[str]:
    """List of normalised candidate answers in ``text``; splits multi-answers as the reference's
    ``extract_math_answer``."""
    return _split_answers(question, _extract_raw_answers(text))


def is_math_solution(gold: str) -> bool:
    r"""True when a gold text is a worked solution, whose answer must be extracted: it boxes its answer (MATH's
    ``solution`` column), states it ("The answer is 5", a GSM8K ``#### 19`` line) or spans several lines. False
    for a bare answer (MATH-500's ``answer`` column: ``\frac{14}{3}``, ``(2, 5]``), which has none of these."""
    return any(k in gold for k in ("\\boxed", "\\fbox", "he answer is", "####")) or "\n" in gold.strip()


def math_gold_from_solution(question: str, solution: str) -> list[str]:
    r"""Gold answers of a MATH gold text: a solution's ``\boxed{}``, or a bare answer as it stands (only
    normalised). A bare answer must not go through the response extraction, whose last-number fallback would turn
    ``\frac{14}{3}`` into ``3``."""
    if "####" in solution:  # a GSM8K-format gold ("12 + 7 = 19\n#### 19") graded by the MATH grader
        solution = solution.split("####")[-1].strip()
    elif is_math_solution(solution):
        return extract_math_answer(question, solution)
    text = solution.strip()
    if text.startswith("$") and text.endswith("$"):
        text = text.strip("$")
    return _split_answers(question, [strip_math_string(text)]) if text else []


# -- LaTeX -> sympy text, guards, and the sandboxed sympy worker (the reference's math_grader*.py) ----------------

MAX_EXPR_CHARS = 400  # longer answers are not worth a sympy call
# Names our converter (or sympy) understands; removed before counting "unknown letters" (the reference's
# should_allow_eval).
_KNOWN_NAMES = ("binomial", "sqrt", "root", "asin", "acos", "atan", "acot", "sin", "cos", "tan", "cot", "sec",
                "csc", "log", "exp", "frac", "inf", "pi", "oo")
# "^{"/"^(" (compound exponents) and long exponents or factorials are refused as in the reference: slow for sympy.
_BAD_SUBSTRINGS = ("^{", "^(", "__", "import", "lambda", "eval", "exec", "open", "attr", "globals", "locals")
_BAD_REGEXES = (r"\^[0-9]+\^", r"\^-?[0-9][0-9]+", r"\*\*[0-9]+\*\*", r"\*\*-?[0-9][0-9]+", r"[0-9][0-9][0-9]+!",
                r"\.\s*[A-Za-z_]")  # the last one blocks attribute access
_ALLOWED_CHARS = re.compile(r"[0-9A-Za-z_+\-*/^().,! ]*")
# LaTeX commands with a sympy spelling other than their own name (\sin, \pi, ... pass through unchanged).
_COMMANDS = {"infty": "oo", "cdot": "*", "times": "*", "div": "/", "ln": "log", "arcsin": "asin", "arccos": "acos",
             "arctan": "atan", "cup": "U", "circ": "", "degree": "", "%": "/100", "$": "", "!": "", ",": "", ";": "",
             ":": "", " ": "", "left": "", "right": "", "displaystyle": "", "{": "(", "}": ")"}
_TEXT_COMMANDS = ("text", "textbf", "textit", "mathrm", "mathbf", "mathit", "mbox", "operatorname", "boxed")


def _read_arg(s: str, i: int) -> tuple[str, int]:
    """Read one LaTeX argument at ``s[i:]``: a balanced ``{...}`` group, a ``\\command`` or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return "", i
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += (s[j] == "{") - (s[j] == "}")
            if depth == 0:
                return s[i + 1 : j], j + 1
        return s[i + 1 :], len(s)  # unbalanced: take the rest
    if s[i] == "\\":
        m = re.match(r"\\([A-Za-z]+|.?)", s[i:], re.DOTALL)
        return m.group(0), i + len(m.group(0))
    return s[i], i + 1


def latex_to_text(s: str) -> str:
    r"""Best-effort LaTeX -> sympy-parsable text (``\frac{a}{b}`` -> ``(a)/(b)``, ``\sqrt`` -> ``sqrt()``, ...).

    Plays the role of the reference's pylatexenc-based ``_parse_latex``: ``^`` is kept (the guards look for it) and a
    digit followed by a fraction with a numeric numerator is a mixed number (``7\frac{3}{4}`` -> ``7+(3)/(4)``).
    """
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch == "\\":
            m = re.match(r"\\([A-Za-z]+|.?)", s[i:], re.DOTALL)
            name, i = m.group(1), i + len(m.group(0))
            if name in ("frac", "dfrac", "tfrac", "cfrac", "binom"):
                num, i = _read_arg(s, i)
                den, i = _read_arg(s, i)
                num, den = latex_to_text(num), latex_to_text(den)
                if name == "binom":
                    out.append(f"binomial({num},{den})")
                    continue
                if num[:1].isdigit() and re.search(r"(?<![\^\w.])\d+$", "".join(out)):
                    out.append("+")  # mixed number "2\frac{1}{4}", as the reference's _inject_implicit_mixed_number
                out.append(f"({num})/({den})")
            elif name == "sqrt":
                index = None
                if s[i : i + 1] == "[" and "]" in s[i:]:
                    index, i = s[i + 1 : s.index("]", i)], s.index("]", i) + 1
                arg, i = _read_arg(s, i)
                arg = latex_to_text(arg)
                out.append(f"sqrt({arg})" if index is None else f"root({arg},{latex_to_text(index)})")
            elif name in _TEXT_COMMANDS:
                arg, i = _read_arg(s, i)
                out.append(latex_to_text(arg))
            else:
                out.append(_COMMANDS.get(name, name))
        elif ch == "^":
            arg, i = _read_arg(s, i + 1)
            arg = latex_to_text(arg)
            out.append("^" + arg if re.fullmatch(r"-?[A-Za-z0-9.]+", arg) else f"^({arg})")
        elif ch == "{":
            arg, i = _read_arg(s, i)
            out.append(f"({latex_to_text(arg)})")
        else:
            out.append({"%": "/100", "$": "", "}": ")"}.get(ch, ch))
            i += 1
    return "".join(out).strip()


def should_allow_eval(expr: str) -> bool:
    """The reference's guard (``math_grader.py``) plus sandbox checks: refuse text that is long, odd or slow for
    sympy."""
    if len(expr) > MAX_EXPR_CHARS or not _ALLOWED_CHARS.fullmatch(expr):
        return False
    letters = expr
    for name in _KNOWN_NAMES:
        letters = letters.replace(name, "")
    if len({c for c in letters if c.isalpha()}) > 2:  # unknown text or functions of more than two variables
        return False
    if any(bad in expr for bad in _BAD_SUBSTRINGS):
        return False
    return not any(re.search(rx, expr) for rx in _BAD_REGEXES)


_SYMPY_NAMESPACE: dict = {}


def _sympy_parse(expr: str):
    """``parse_expr`` with implicit multiplication and a sympy-only namespace (no Python builtins)."""
    from sympy.parsing import sympy_parser as sp

    if not _SYMPY_NAMESPACE:
        exec("from sympy import *", _SYMPY_NAMESPACE)  # constant string, never model text
        _SYMPY_NAMESPACE["__builtins__"] = {}
    transformations = sp.standard_transformations + (sp.implicit_multiplication_application,)
    return sp.parse_expr(expr.replace("^", "**"), global_dict=dict(_SYMPY_NAMESPACE), transformations=transformations)


def _sympy_equal_worker(a: str, b: str) -> bool:
    """Runs in the worker process: ``simplify((a)-(b)) == 0``, else ``isclose(N(a), N(b), abs_tol=1e-3)``."""
    import sympy

    try:
        diff = re.sub(r"([0-9]) +([0-9])", r"\1+\2", f"({a})-({b})").replace(" ", "")  # "7 3/4" -> 7+3/4
        if sympy.simplify(_sympy_parse(diff)) == 0:
            return True
    except Exception:
        pass
    try:
        return math.isclose(float(sympy.N(_sympy_parse(a))), float(sympy.N(_sympy_parse(b))), abs_tol=1e-3)
    except Exception:
        return False


def _math_verify_worker(pred: str, gold: str, verbose: bool = True) -> bool:
    """Runs in the worker process: math-verify's `verify` of two extracted answers, each read as LaTeX. Its own
    signal-based timeouts are off (our worker's timeout kills a stuck call); only its LaTeX reader is used, which
    parses with a grammar into sympy and never evaluates the text as Python.
    Turning them off makes math-verify log "Timeout is disabled ..." warnings (once per worker process): hidden here,
    with its other INFO/WARNING logs, unless the caller runs with --verbose (shared/console.py; the spawned worker
    does not inherit the caller's logger levels)."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.NOTSET if verbose else logging.ERROR)

    latex_only = [LatexExtractionConfig()]  # its plain-expression reader would call sympy's eval-based parse_expr
    try:
        g = parse(f"${gold}$", extraction_config=latex_only, parsing_timeout=None)
        p = parse(f"${pred}$", extraction_config=latex_only, parsing_timeout=None)
        return bool(g and p and verify(g, p, timeout_seconds=None))
    except Exception:
        return False


def math_verify_equal(pred: str, gold: str, timeout: float = 15.0) -> bool:
    """Equivalence by math-verify (pip `math-verify`) instead of ours, in the same sandboxed worker and timeout."""
    pred, gold = str(pred).strip(), str(gold).strip()
    if pred == gold:
        return bool(pred)
    from shared.console import verbose

    return _call_with_timeout(_math_verify_worker, (pred, gold, verbose()), timeout)


class GraderWorkerError(RuntimeError):
    """The sympy worker process could not be started (a setup problem, so it is raised, not graded as 0)."""


# As the reference's SympySimplifier: one lazily created worker, killed and replaced when a call times out. A process
# of our own with a pipe, not a multiprocessing.Pool: a Pool worker killed while idle (SIGTERM to the process group,
# the OOM killer) dies holding the pool's queue lock, and every later call and the pool's terminate wait on that lock
# forever. Here the caller waits on the pipe and on the process's sentinel together, so a dead worker is seen at once.
# 'spawn' because forking a process that holds CUDA contexts or threads (trainer, vLLM) is unsafe.
_POOL = None  # the current _Worker, or None until the next call starts one
_POOL_BROKEN = False
_POOL_LOCK = threading.Lock()
POOL_START_TIMEOUT = 60.0  # seconds for a fresh worker to import sympy; not counted in the grading timeout
_WORKER_FUNCTIONS = ("_sympy_equal_worker", "_math_verify_worker")  # what the worker runs, by name


@contextmanager
def _main_hidden():
    """While a worker starts, hide ``__main__``'s file and spec: ``spawn`` would otherwise re-import the caller's main
    module in the worker (re-running a script that has no ``__main__`` guard, failing for stdin or a notebook). The
    worker needs nothing from it: it runs functions of this module only."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None  # multiprocessing reads main.__spec__.name, then main.__file__
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _exit_with_parent(parent: int, kernel: bool) -> None:
    """End the worker when its parent dies while the worker is busy (no end of file is read then): a thread polls
    the parent, and with `kernel` (Linux, a worker started by the main thread) the kernel kills the worker too, also
    inside a long sympy call that holds the GIL (PR_SET_PDEATHSIG: it fires when the parent's thread that started
    the worker ends, so not for a worker started by another thread)."""
    if kernel:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)

    def poll():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=poll, daemon=True).start()


def _worker_main(conn, parent: int, kernel: bool) -> None:
    """The worker process: run ``(name, args)`` requests from the pipe, answer ``("ok", result)`` or ``("error",
    repr)``; exit at end of file (the parent closed its end or died). SIGINT and SIGTERM are ignored: sent to the
    whole process group (Ctrl-C, ``scancel``, ``timeout``), they are for the parent, which finishes its step and its
    checkpoint with this worker still grading, then kills it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(parent, kernel)
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", globals()[name](*args) if name in _WORKER_FUNCTIONS else False)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            reply = ("error", repr(e))
        conn.send(reply)


class _WorkerLost(Exception):
    """The worker timed out or died during a call (graded as a timeout)."""


class _Worker:
    """One sympy worker process and the caller's end of its pipe."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        main_thread = threading.current_thread() is threading.main_thread()
        self.process = ctx.Process(target=_worker_main, args=(child, os.getpid(), main_thread), daemon=True,
                                   name="cleanrlhf-grader")
        with _main_hidden():
            self.process.start()
        child.close()

    def call(self, name: str, args: tuple, timeout: float):
        """``(status, value)`` of one request; `_WorkerLost` when no answer comes within `timeout` seconds or the
        worker dies (whichever is first)."""
        try:
            self.conn.send((name, args))
            ready = mp_connection.wait([self.conn, self.process.sentinel], timeout)
            if self.conn in ready:  # an answer, or end of file if the worker died
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        raise _WorkerLost

    def terminate(self) -> None:
        """Kill the worker (SIGKILL: it ignores SIGTERM) and reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()


def _end_worker() -> None:
    """At interpreter exit, kill the worker. Registered after multiprocessing's own exit hook (imported above), so it
    runs first (atexit is last in, first out): that hook would SIGTERM the worker, which ignores it, and join it."""
    global _POOL
    if _POOL is not None:
        _POOL.terminate()
        _POOL = None


atexit.register(_end_worker)


def _call_with_timeout(fn, args: tuple, timeout: float) -> bool:
    """``fn(*args)`` in the worker; False when it times out or the worker dies (either way a fresh worker serves the
    next call) or when `fn` raises. `GraderWorkerError` if a fresh worker cannot start."""
    global _POOL, _POOL_BROKEN
    with _POOL_LOCK:
        if _POOL_BROKEN:
            raise GraderWorkerError("sympy worker failed to start earlier")
        if _POOL is None:
            worker = None
            try:
                worker = _Worker()
                # Warm-up call: pays the sympy import once, outside any grading timeout.
                status, value = worker.call("_sympy_equal_worker", ("0", "0"), POOL_START_TIMEOUT)
                if status != "ok":
                    raise GraderWorkerError(value)
            except _WorkerLost as e:
                code = worker.process.exitcode  # None: still running (timed out)
                worker.terminate()
                if code in (-signal.SIGINT, -signal.SIGTERM):
                    return False  # a signal to the process group before the worker could ignore it: retried later
                _POOL_BROKEN = True  # fail fast from now on
                why = "timed out" if code is None else f"exited {code}"
                raise GraderWorkerError(f"sympy worker failed to start ({why})") from e
            except BaseException as e:
                if worker is not None:
                    worker.terminate()
                _POOL_BROKEN = True
                raise GraderWorkerError(f"sympy worker failed to start: {e!r}") from e
            _POOL = worker
        try:
            status, value = _POOL.call(fn.__name__, args, timeout)
        except _WorkerLost:
            _POOL.terminate()  # kills a stuck worker, reaps a dead one; a fresh one starts on the next call
            _POOL = None
            return False
        return bool(value) if status == "ok" else False


def symbolic_equal(a: str, b: str, timeout: float = 15.0) -> bool:
    """True if LaTeX answers ``a`` and ``b`` are equal under sympy; False on refusal, parse error or timeout."""
    try:
        if len(a) > MAX_EXPR_CHARS or len(b) > MAX_EXPR_CHARS:
            return False
        ta, tb = latex_to_text(a), latex_to_text(b)
        if not (ta and tb and should_allow_eval(ta) and should_allow_eval(tb)):
            return False
        return _call_with_timeout(_sympy_equal_worker, (ta, tb), timeout)
    except GraderWorkerError:
        raise
    except Exception:  # includes RecursionError on absurdly nested braces
        return False


# -- MATH comparison (the reference's math_grader_minerva.py: math_equal / is_correct / eval_math) ----------------


def _parse_digits(num: str) -> float | None:
    """``'1,234.5'`` -> 1234.5 and ``'23%'`` / ``'23\\%'`` -> 0.23; None if not a number."""
    num = num.replace(",", "")
    try:
        return float(num)
    except ValueError:
        if num.endswith("%"):
            try:
                return float(num[:-1].rstrip("\\")) / 100
            except ValueError:
                pass
    return None


_MATRIX_BEGIN = ("\\begin{pmatrix}", "\\begin{bmatrix}")
_MATRIX_END = ("\\end{pmatrix}", "\\end{bmatrix}")


def _matrix_rows(m: str) -> list[list[str]]:
    body = m[len("\\begin{pmatrix}") : -len("\\end{pmatrix}")]  # both kinds have the same length
    return [row.strip().split("&") for row in body.split("\\\\") if row.strip()]


def math_equal(pred: str, gold: str, timeout: float = 15.0) -> bool:
    """Equality of two answers: string, numeric (with %), tuple/interval, matrix, '=' and symbolic."""
    pred, gold = str(pred).strip(), str(gold).strip()
    if pred == gold:
        return True
    p_num, g_num = _parse_digits(pred), _parse_digits(gold)
    if p_num is not None and g_num is not None:
        # the reference's leniency: the gold may be a percentage of the prediction or vice versa.
        return any(math.isclose(p_num, g, abs_tol=1e-3) for g in (g_num / 100, g_num, g_num * 100))
    if not pred:
        return False
    bracketed = r"[(\[].+[)\]]"
    if re.fullmatch(bracketed, pred) and re.fullmatch(bracketed, gold) and (pred[0], pred[-1]) == (gold[0], gold[-1]):
        p_parts, g_parts = pred[1:-1].split(","), gold[1:-1].split(",")
        if len(p_parts) == len(g_parts) and all(math_equal(p, g, timeout) for p, g in zip(p_parts, g_parts)):
            return True
    if pred.startswith(_MATRIX_BEGIN) and pred.endswith(_MATRIX_END) and gold.startswith(_MATRIX_BEGIN) \
            and gold.endswith(_MATRIX_END):
        p_rows, g_rows = _matrix_rows(pred), _matrix_rows(gold)
        if len(p_rows) == len(g_rows) and all(
            len(pr) == len(gr) and all(math_equal(p, g, timeout) for p, g in zip(pr, gr))
            for pr, gr in zip(p_rows, g_rows)
        ):
            return True
    if pred.count("=") == 1 and gold.count("=") == 1:
        # Equations: compare lhs - (rhs), allowing either orientation.
        p_lhs, p_rhs = (x.strip() for x in pred.split("="))
        g_lhs, g_rhs = (x.strip() for x in gold.split("="))
        p_diff, g_diff = f"{p_lhs}-({p_rhs})", f"{g_lhs}-({g_rhs})"
        if symbolic_equal(p_diff, g_diff, timeout) or symbolic_equal(f"-({p_diff})", g_diff, timeout):
            return True
    elif pred.count("=") == 1 and len(pred.split("=")[0].strip()) <= 2 and "=" not in gold:
        if math_equal(pred.split("=")[1], gold, timeout):  # "x=3" vs "3"
            return True
    elif gold.count("=") == 1 and len(gold.split("=")[0].strip()) <= 2 and "=" not in pred:
        if math_equal(pred, gold.split("=")[1], timeout):
            return True
    return symbolic_equal(pred, gold, timeout)


def _is_correct(pred: str | list[str], gold: str | list[str], timeout: float, equal=None) -> bool:
    """The reference's ``is_correct``: lists match iff every prediction matches some gold and every gold is matched.
    `equal`: the element equivalence, ours (`math_equal`, the reference's float pre-check first) or
    `math_verify_equal`."""
    if isinstance(pred, list):
        pred_hit, gold_hit = set(), set()
        for i, p in enumerate(pred):
            for j, g in enumerate(gold):
                if _is_correct(p, g, timeout, equal):
                    pred_hit.add(i)
                    gold_hit.add(j)
        return len(pred_hit) == len(pred) and len(gold_hit) == len(gold)
    if equal is not None:
        return equal(pred, gold, timeout)
    if "\\cup" in pred and "\\cup" in gold:  # unions of intervals compare as lists
        return _is_correct(pred.split("\\cup"), gold.split("\\cup"), timeout)
    try:
        if abs(float(pred.replace(",", "")) - float(gold.replace(",", ""))) < 1e-3:
            return True
    except ValueError:
        pass
    return bool(gold and pred == gold) or math_equal(pred, gold, timeout)


def grade_math(question: str, completion: str, gold_solution: str, timeout: float = 15.0,
               checker: str = "vine") -> bool:
    """The reference's ``eval_math`` on the Minerva-extracted prediction list vs the gold's answer list (a
    solution's box or a bare answer); `checker` "vine" (ours) or "math_verify" decides when two answers are equal."""
    gold = list(dict.fromkeys(math_gold_from_solution(question, gold_solution)))  # de-duplicate, keep order
    if not gold:
        return False
    preds = list(dict.fromkeys(extract_math_answer(question, completion)))
    preds = preds[-len(gold) :]  # some completions box non-answers first; keep only the last len(gold)
    return _is_correct(preds, gold, timeout, math_verify_equal if checker == "math_verify" else None)


# -- Entry point used by the trainers ------------------------------------------------------------------------------


def grade(task: str, completion: str, gold: str, question: str = "", finished: bool = True) -> float:
    """Reward in {0.0, 1.0} for one completion; 0.0 if truncated (``finish_reason == 'length'``).

    ``task`` is ``'gsm8k'`` (``gold`` = the answer after ``####``), ``'math'`` (``gold`` = a gold solution or a bare
    answer, ``question`` = the problem text, needed for "separated by commas" questions) or ``'math_verify'`` (the
    same extraction, math-verify's equivalence). Never raises on bad model or gold text; raises ``ValueError`` for
    an unknown task and ``GraderWorkerError`` if the sympy worker cannot start.
    """
    if task not in ("gsm8k", "math", "math_verify"):
        raise ValueError(f"unknown task {task!r}; expected 'gsm8k', 'math' or 'math_verify'")
    if not finished:
        return 0.0
    try:
        if task == "gsm8k":
            return float(grade_gsm8k(completion, gold))
        return float(grade_math(question, completion, gold, checker="math_verify" if task == "math_verify" else "vine"))
    except GraderWorkerError:
        raise
    except Exception:
        return 0.0
