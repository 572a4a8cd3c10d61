"""scripts/tools/record_test_suite.py's junit parser and the `test_suite` table of scripts/tools/docs_tables.py."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, next((ROOT / "scripts").glob(f"**/{name}.py")))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record, docs_tables = _load("record_test_suite"), _load("docs_tables")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests">
  <testsuite name="pytest" errors="1" failures="1" skipped="2" tests="6" time="125.5">
    <testcase classname="tests.test_a" name="test_ok" time="0.25"/>
    <testcase classname="tests.test_a.TestK" name="test_slow[2]" time="61.0"/>
    <testcase classname="tests.test_b" name="test_bad" time="3.5">
      <failure message="AssertionError: 1 != 2&#10;assert 1 == 2">long traceback</failure>
    </testcase>
    <testcase classname="tests.test_b" name="test_fixture" time="0.5">
      <error message="failed on setup with &quot;ValueError: no model&quot;">trace</error>
    </testcase>
    <testcase classname="tests.test_c" name="test_gpu" time="0.0">
      <skipped type="pytest.skip" message="no CUDA device">skip</skipped>
    </testcase>
    <testcase classname="tests.test_c" name="test_known" time="7.0">
      <skipped type="pytest.xfail" message="known"/>
    </testcase>
  </testsuite>
</testsuites>
"""


def test_junit_parser_counts_failures_and_orders_the_slowest():
    r = record.parse_junit(JUNIT, slowest=3)
    assert r["counts"] == {"passed": 2, "failed": 1, "skipped": 2, "errors": 1}
    assert r["failing"] == [
        {"test": "tests/test_b.py::test_bad", "outcome": "failed", "message": "AssertionError: 1 != 2"},
        {"test": "tests/test_b.py::test_fixture", "outcome": "error",
         "message": 'failed on setup with "ValueError: no model"'}]
    assert r["total_time_s"] == 125.5
    assert r["slowest"] == [{"test": "tests/test_a.py::TestK::test_slow[2]", "time_s": 61.0},
                            {"test": "tests/test_c.py::test_known", "time_s": 7.0},
                            {"test": "tests/test_b.py::test_bad", "time_s": 3.5}]
    assert r["by_file"] == {"tests/test_a.py": 61.25, "tests/test_c.py": 7.0, "tests/test_b.py": 4.0}
    assert list(r["by_file"]) == ["tests/test_a.py", "tests/test_c.py", "tests/test_b.py"]  # slowest file first


def _result(**over) -> dict:
    r = record.parse_junit(JUNIT)
    return {"command": "python scripts/tools/record_test_suite.py", "test_command": "bash scripts/test.sh",
            "pytest_args": [], "exit_status": 1, **r, "uncommitted_changes": [],
            "env": {"device": "CPU X x2", "time": "2026-01-02 03:04:05", "git_commit": "abc1234",
                    "loadavg_at_start": [0.5, 0, 0], "loadavg_at_end": [2.04, 0, 0]}, **over}


def test_the_table_gives_counts_provenance_failures_and_the_five_slowest():
    text = docs_tables.test_suite(_result())
    lines = text.splitlines()
    assert lines[0] == ("2 passed, 1 failed, 2 skipped, 1 errors in 2 min 6 s, exit status 1, load average 0.5 at the "
                        "start and 2.0 at the end: `python scripts/tools/record_test_suite.py`, CPU X x2.")
    assert "subset" not in text and "uncommitted" not in text
    assert "- `tests/test_b.py::test_bad` (failed): AssertionError: 1 != 2" in lines
    assert "- `tests/test_b.py::test_fixture` (error): failed on setup with \"ValueError: no model\"" in lines
    rows = [x for x in lines if x.startswith("| `")]
    assert len(rows) == 5 and rows[0] == "| `tests/test_a.py::TestK::test_slow[2]` | 61.0 |"


def test_the_table_says_first_when_the_run_was_a_subset_and_names_uncommitted_files():
    d = _result(pytest_args=["-k", "resume and not slow", "tests/test_docs.py"], failing=[], exit_status=0,
                uncommitted_changes=["README.md", "shared/x.py"])
    d["counts"] = {"passed": 3, "failed": 0, "skipped": 0, "errors": 0}
    lines = docs_tables.test_suite(d).splitlines()
    assert lines[0] == "**A subset, not the whole suite**: pytest args `-k 'resume and not slow' tests/test_docs.py`."
    assert lines[2].startswith("3 passed, 0 failed, 0 skipped in 2 min 6 s, exit status 0")
    assert "The tested tree had uncommitted changes in 2 tracked files: `README.md`, `shared/x.py`." in lines
    d["uncommitted_changes"] = [f"f{i}.py" for i in range(12)]
    assert "`f9.py` and 2 more (listed in the file)." in docs_tables.test_suite(d)
    assert "Failing:" not in lines


def test_the_brief_version_names_the_failing_tests_and_leaves_out_the_slowest():
    """README's block (test_suite_brief): the full table's first line, the failing tests by name, no timings."""
    text = docs_tables.test_suite_brief(_result())
    assert text.splitlines()[0] == docs_tables.test_suite(_result()).splitlines()[0]
    assert text.endswith("Failing: `tests/test_b.py::test_bad` (failed), `tests/test_b.py::test_fixture` (error).")
    assert "| slowest" not in text and "61.0" not in text
    d = _result(failing=[], exit_status=0, uncommitted_changes=["README.md"])
    assert "Failing" not in docs_tables.test_suite_brief(d)
    assert "uncommitted changes in 1 tracked files: `README.md`" in docs_tables.test_suite_brief(d)
