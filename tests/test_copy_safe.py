"""A copied script runs with new flags of its own, with no edit in shared/ (the CleanRL workflow: copy
algorithms/grpo.py to my_grpo.py, add `entropy_coef: float = 0.01` to its Args, run it).

Each script is copied out of the repository, five new fields (a float, an int, a str, a bool and a fixed choice)
are added to its Args, and the copy runs one step on the built-in tiny model with the new flags given on the
command line. A numeric flag that declares no range (shared/cli.py) is only checked to be finite. The copies run one
after another in one Python process, each as `python my_<script>.py ...` runs it (tests/test_e2e.py run_batch), so the
libraries are imported once."""

import ast
import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

NEW_FIELDS = '''    my_float: float = 0.01
    """a float flag of the copy"""
    my_int: int = 0
    """an int flag of the copy"""
    my_str: str = "x"
    """a str flag of the copy"""
    my_flag: bool = False
    """a boolean flag of the copy"""
    my_choice: Literal["a", "b"] = "a"
    """a fixed-choice flag of the copy"""
'''
NEW_FLAGS = ["--my_float", "0.5", "--my_int", "3", "--my_str", "y", "--my_flag", "--my_choice", "b"]
NEW_VALUES = {"my_float": 0.5, "my_int": 3, "my_str": "y", "my_flag": True, "my_choice": "b"}

# held-out evaluation, dev slice and checkpoints kept small or off: one step, then the end-of-run evaluation
EVAL = ["--eval_every", "0", "--eval_num_prompts", "8", "--eval_num_samples", "2", "--dev_num_prompts", "8",
        "--save_every", "0"]
RL = ["--generator", "hf", "--total_episodes", "16", "--local_num_prompts", "4", "--local_micro_batch_size", "16",
      "--num_minibatches", "1", "--max_new_tokens", "8", *EVAL, "--no_save_model"]
# each script's smallest one-step run (tests/test_e2e.py, tests/resume_runs.py); the output file to expect
ONE_STEP = {
    "sft": (["--generator", "hf", "--total_episodes", "16", "--local_micro_batch_size", "16", "--eval_every", "0",
             "--eval_num_prompts", "8", "--dev_num_prompts", "8", "--max_new_tokens", "8", "--save_every", "0"],
            "metrics.jsonl"),
    "rm": (["--total_episodes", "16", "--local_micro_batch_size", "16", "--eval_every", "0", "--eval_num_pairs", "16",
            "--dev_num_prompts", "8", "--num_sample_pairs", "2", "--save_every", "0"], "metrics.jsonl"),
    "dpo": (["--generator", "hf", "--total_episodes", "16", "--local_micro_batch_size", "16", *EVAL,
             "--eval_num_pairs", "16", "--num_sample_completions", "2", "--max_new_tokens", "8", "--no_save_model"],
            "metrics.jsonl"),
    "kto": (["--generator", "hf", "--total_episodes", "16", "--local_micro_batch_size", "16", *EVAL,
             "--eval_num_pairs", "16", "--num_sample_completions", "2", "--max_new_tokens", "8", "--no_save_model"],
            "metrics.jsonl"),
    "grpo": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "dapo": ([*RL, "--num_generations", "4", "--num_iterations", "1", "--max_refill_rounds", "1"], "metrics.jsonl"),
    "grpo_tools": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "calibration": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    # the async files generate with vLLM only
    "grpo_async": ([*RL[2:], "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "ppo": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "ppo_async": ([*RL[2:], "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "ppo_rlhf": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "vineppo": ([*RL, "--num_generations", "4", "--num_iterations", "1", "--num_mc_rollouts", "2"],
                "metrics.jsonl"),
    "drca": ([*RL, "--num_generations", "4", "--num_iterations", "1", "--localisation_num_pairs", "4"],
             "metrics.jsonl"),
    "repulse": (["--generator", "hf", "--total_episodes", "40", "--num_generations", "20", "--local_micro_batch_size",
                 "20", "--eval_every", "0", "--eval_num_samples", "40", "--save_every", "0", "--no_save_model"],
                "metrics.jsonl"),
    "restem": (["--generator", "hf", "--total_episodes", "16", "--local_num_prompts", "4", "--num_generations",
                "4", "--num_epochs", "1", "--local_micro_batch_size", "16", "--max_new_tokens", "8",
                "--eval_num_prompts", "8", "--eval_num_samples", "2", "--dev_num_prompts", "8", "--save_every", "0"],
               "metrics.jsonl"),
    "genrm": (["--local_num_prompts", "8", "--num_generations", "2", "--total_episodes", "16",
               "--local_micro_batch_size", "16", "--max_new_tokens", "12", "--eval_num_prompts", "4",
               "--eval_num_samples", "2", "--dev_num_prompts", "4", "--eval_every", "0", "--save_every", "0"],
              "metrics.jsonl"),
    "prime": ([*RL, "--num_generations", "4", "--num_iterations", "1", "--oversample_factor", "1"], "metrics.jsonl"),
    "opd": ([*RL, "--num_generations", "4", "--num_iterations", "1"], "metrics.jsonl"),
    "implicit_prm": (["--generator", "hf", "--total_episodes", "8", "--local_num_prompts", "4", "--num_generations",
                      "2", "--local_micro_batch_size", "8", "--max_new_tokens", "8", "--eval_num_prompts", "2",
                      "--dev_num_prompts", "8", "--localisation_num_pairs", "2", "--save_every", "0"], "metrics.jsonl"),
    # unit_rm.py: rm.py's run; unit_ppo.py: ppo_rlhf.py's, on a unit RM's files ({unit_rm}: made by the test)
    "unit_rm": (["--total_episodes", "16", "--local_micro_batch_size", "16", "--eval_every", "0",
                 "--eval_num_pairs", "16", "--dev_num_prompts", "8", "--num_sample_pairs", "2", "--save_every", "0"],
                "metrics.jsonl"),
    "unit_ppo": ([*RL, "--num_generations", "4", "--num_iterations", "1", "--reward_model_path", "{unit_rm}"],
                 "metrics.jsonl"),
    # an evaluation tool, not a trainer: a few prompts, no training; its metrics go to summary.json
    "evaluate": (["--generator", "hf", "--eval_num_prompts", "4", "--num_samples", "2", "--k", "1", "2",
                  "--max_new_tokens", "8", "--num_bootstrap", "10"], "summary.json"),
    "evaluate_text": (["--generator", "hf", "--eval_num_prompts", "4", "--max_new_tokens", "8", "--num_bootstrap", "10"],
                      "summary.json"),
    "evaluate_gcg": (["--generator", "hf", "--eval_num_prompts", "2", "--gcg_steps", "2", "--gcg_search_width", "8",
                      "--num_samples", "2", "--max_new_tokens", "8", "--num_bootstrap", "10"], "summary.json"),
}
SCRIPTS = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__")


def test_every_script_has_a_one_step_run():
    assert sorted(ONE_STEP) == SCRIPTS


def copy_with_new_fields(script: str, dest: Path) -> Path:
    """algorithms/<script>.py copied to dest/my_<script>.py, NEW_FIELDS added after Args's first field (and its
    docstring), `Literal` imported where the script does not import it."""
    src = (ROOT / "algorithms" / f"{script}.py").read_text()
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    first = next(i for i, n in enumerate(cls.body) if isinstance(n, ast.AnnAssign))
    after = cls.body[first]
    if first + 1 < len(cls.body) and isinstance(cls.body[first + 1], ast.Expr) and isinstance(
            cls.body[first + 1].value, ast.Constant) and isinstance(cls.body[first + 1].value.value, str):
        after = cls.body[first + 1]
    lines = src.splitlines(keepends=True)
    lines.insert(after.end_lineno, NEW_FIELDS)
    copied = "".join(lines)
    imports_literal = any(isinstance(n, ast.ImportFrom) and n.module == "typing" and
                          any(a.name == "Literal" for a in n.names) for n in tree.body)
    if not imports_literal:  # after `from __future__ import ...`, which must come first
        future = next((n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"), None)
        at = future.end_lineno if future else 0
        lines = copied.splitlines(keepends=True)
        lines.insert(at, "from typing import Literal\n")
        copied = "".join(lines)
    path = dest / f"my_{script}.py"
    path.write_text(copied)
    return path


@pytest.fixture(scope="module")
def copied_runs(tmp_path_factory):
    """Every script copied with the new fields, and every copy run with its one-step flags and the new flags, one
    after another in one Python process (tests/test_e2e.py run_batch: as `python my_<script>.py ...`, torch and
    vLLM imported once instead of once per copy); script -> (its result, its output_dir)."""
    from tests.test_e2e import run_batch

    base = tmp_path_factory.mktemp("copies")
    runs, outs = {}, {}
    for script in SCRIPTS:
        work = base / script
        work.mkdir()
        copy = copy_with_new_fields(script, work)
        flags, _ = ONE_STEP[script]
        if "{unit_rm}" in flags:  # builtin:tiny-rm's weights with a unit normaliser for unit_ppo.py's defaults
            from shared.models import resolve_model_path

            rm = work / "unit_rm"
            shutil.copytree(resolve_model_path("builtin:tiny-rm"), rm)
            (rm / "unit_normalizer.json").write_text(json.dumps(
                {"method": "peak", "tau": 0.5, "model": "builtin:tiny-sft", "aggregation": "avg", "mu": [0.1, 0.0],
                 "sigma": [0.0, 5.0]}))
            flags = [str(rm) if f == "{unit_rm}" else f for f in flags]
        outs[script] = work / "run"
        runs[script] = [str(copy), "--output_dir", str(outs[script]), *flags, *NEW_FLAGS]
    results = run_batch(runs, base / "batch")
    return {script: (results[script], outs[script]) for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_copied_script_with_new_flags_runs(script, copied_runs):
    from tests.test_e2e import check_batch_run

    result, out = copied_runs[script]
    _, written = ONE_STEP[script]
    output = check_batch_run(result)  # exit status 0, a clean exit
    assert "Traceback" not in output, output[-6000:]
    assert (out / written).is_file() and (out / written).read_text().strip(), f"{written} missing or empty"
    config = json.loads((out / "args.json").read_text())  # the run's flags (shared/tracking.py, evaluate.py)
    assert {k: config[k] for k in NEW_VALUES} == NEW_VALUES
