"""The built-in tiny models are built deterministically (shared/tiny.py: BUILD_ENV), so every machine starts from the
same weights: the hashes of the builds here must be the ones recorded in shared/tiny.py, and benchmarks name them."""

import json
import sys
from pathlib import Path

import pytest

from shared import tiny

ROOT = Path(__file__).resolve().parents[1]


def test_random_init_build_has_the_recorded_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path))
    path = tiny.builtin_tiny()
    record = json.loads((path / "build.json").read_text())
    assert record["weights_sha256"] == tiny.weights_sha256(path)
    assert record["weights_sha256"] == tiny.EXPECTED_SHA256["tiny"], (
        "builtin:tiny is not the recorded build: another CPU architecture or library version, or a changed recipe "
        "(then bump BUILTIN_VERSION, record the new hashes and re-measure stored results)")
    assert record["build_env"] == tiny.BUILD_ENV and record["version"] == tiny.BUILTIN_VERSION


def test_the_parent_process_settings_do_not_reach_the_build(tmp_path, monkeypatch):
    """The build runs in a child with BUILD_ENV, whatever threads or kernels the caller (a test worker with one
    thread, a benchmark with all cores) set for itself."""
    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert tiny.weights_sha256(tiny.builtin_tiny()) == tiny.EXPECTED_SHA256["tiny"]


def test_sft_warm_start_has_the_recorded_hash():
    """builtin:tiny-sft (sft.py's default run from builtin:tiny), in the shared cache that the end-to-end tests use."""
    path = tiny.builtin_tiny_sft()
    assert tiny.weights_sha256(path) == tiny.EXPECTED_SHA256["tiny-sft"], (
        "builtin:tiny-sft is not the recorded build: a change to sft.py's default run (or to the stack) moved it; "
        "bump BUILTIN_VERSION, record the new hashes and re-measure the stored results that start from it")
    assert json.loads((path / "build.json").read_text())["expected_sha256"] == tiny.EXPECTED_SHA256["tiny-sft"]


def test_an_unexpected_build_is_reported(tmp_path, monkeypatch, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"not the recorded weights")
    monkeypatch.setitem(tiny.EXPECTED_SHA256, "tiny", "0" * 64)
    tiny.write_build_record(tmp_path, "tiny")
    assert "warning: builtin:tiny built with weights" in capsys.readouterr().err
    assert json.loads((tmp_path / "build.json").read_text())["expected_sha256"] == "0" * 64


def test_benchmarks_name_the_builtin_models_they_ran_on(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_common as bc

    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path / "cache"))
    tiny.builtin_tiny()
    path = bc.write_result("x", {"env": {"cuda": False}}, tmp_path / "out", latest=False)
    models = json.loads(path.read_text())["env"]["builtin_models"]
    assert models == {"builtin:tiny": {"weights_sha256": tiny.EXPECTED_SHA256["tiny"], "expected": True}}
    # a benchmark whose runs used their own cache names that cache's builds
    path = bc.write_result("x", {"env": {"cuda": False}}, tmp_path / "out", latest=False, cache=tmp_path / "none")
    assert json.loads(path.read_text())["env"]["builtin_models"] == {}


@pytest.mark.parametrize("name", ["tiny", "tiny-sft", "tiny-rm", "tiny-cf-rm"])
def test_recorded_hashes_are_sha256(name):
    assert len(tiny.EXPECTED_SHA256[name]) == 64 and int(tiny.EXPECTED_SHA256[name], 16) >= 0
