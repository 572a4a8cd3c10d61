"""Every script's `Args`: each field typed, defaulted and documented, and `--help` shows them all (style.md S4)."""

import ast
import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__")
SHARED_VOCABULARY = ["model_name_or_path", "dataset", "output_dir", "seed", "total_episodes", "learning_rate",
                     "track", "generator",
                     # reliability flags (shared/checkpoint.py), the same in every script
                     "save_every", "keep_checkpoints", "resume", "stop_after_steps", "max_nonfinite_steps",
                     "best_metric"]
NO_GENERATION = {"rm"}  # trains on fixed pairs and never samples: no `generator` flag
# two trained models, two learning rates, named as in the RePULSe reference code (p_theta: base actor, q_xi: actor)
RENAMED = {"repulse": {"learning_rate": "base_actor_learning_rate"}}


def documented_fields(script: str) -> dict[str, str]:
    """Field name -> its docstring (the string literal right after the annotated assignment)."""
    tree = ast.parse((ROOT / "algorithms" / f"{script}.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args")
    docs = {}
    for prev, node in zip(cls.body, cls.body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[prev.target.id] = node.value.value
    return docs


def public_fields(script: str):
    args = importlib.import_module(f"algorithms.{script}").Args
    return [f for f in dataclasses.fields(args) if "Suppress" not in str(f.type)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_field_is_typed_defaulted_and_documented(script):
    docs = documented_fields(script)
    for f in public_fields(script):
        assert f.default is not dataclasses.MISSING, f"{script}.{f.name} has no default"
        assert docs.get(f.name, "").strip(), f"{script}.{f.name} has no docstring"
    names = {f.name for f in public_fields(script)}
    vocabulary = set(SHARED_VOCABULARY) - ({"generator"} if script in NO_GENERATION else set())
    vocabulary = {RENAMED.get(script, {}).get(v, v) for v in vocabulary}
    assert vocabulary <= names, f"{script} misses {vocabulary - names}"
    assert script not in NO_GENERATION or "generator" not in names


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_field(script):
    out = subprocess.run([sys.executable, f"algorithms/{script}.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stderr
    for f in public_fields(script):
        assert f"--{f.name}" in out.stdout, f"--{f.name} missing from {script} --help"
    assert "world_size" not in out.stdout  # runtime-computed fields are hidden


def test_importing_a_script_has_no_side_effects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for script in SCRIPTS:
        importlib.import_module(f"algorithms.{script}")
    assert list(tmp_path.iterdir()) == []
