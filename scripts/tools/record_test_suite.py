"""Run the test suite as CI does (`bash scripts/test.sh`) and store its outcome for README's "Tests" section.

    python scripts/tools/record_test_suite.py                      # the whole suite -> docs/results/test_suite.json
    python scripts/tools/record_test_suite.py -- -k resume tests/  # a subset: the args after -- go to pytest (recorded)

Writes the command, its exit status, the counts, each failing test with the first line of its message, pytest's
total time, the 60 slowest tests (where the time budget goes), the seconds of each test file (setup included;
`--dist loadfile` runs a file on one worker), the machine (load at start and end) and the uncommitted changes of
the tracked tree; then `python scripts/tools/docs_tables.py` renders it. Exits with the test command's status.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_common import ROOT, environment, invocation  # noqa: E402


def _test_id(classname: str, name: str) -> str:
    """pytest's node id from junit's classname ("tests.test_x.TestY") and name: the module is the dotted path up to
    the first part named test_*."""
    parts = classname.split(".")
    i = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
    if i is None:
        return f"{classname}::{name}"
    return "::".join(["/".join(parts[: i + 1]) + ".py", *parts[i + 1 :], name])


def _first_line(element: ET.Element) -> str:
    text = element.get("message") or element.text or ""
    return next((line.strip() for line in text.splitlines() if line.strip()), element.tag)


def parse_junit(xml_text: str, slowest: int = 60) -> dict:
    """Counts, failing tests (with their first message line) and the slowest tests of a pytest junit report. A
    testcase with an <error> (e.g. in a fixture) counts as an error, else one with a <failure> as failed, else one with
    <skipped> (xfail included) as skipped, else passed."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failing, times = [], []
    for case in (c for s in suites for c in s.iter("testcase")):
        test = _test_id(case.get("classname", ""), case.get("name", ""))
        times.append((float(case.get("time") or 0), test))
        bad = case.find("error") if case.find("error") is not None else case.find("failure")
        if bad is not None:
            counts["errors" if bad.tag == "error" else "failed"] += 1
            failing.append({"test": test, "outcome": "error" if bad.tag == "error" else "failed",
                            "message": _first_line(bad)})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    times.sort(key=lambda x: -x[0])
    by_file: dict[str, float] = {}  # with --dist loadfile a file runs on one worker: the files bound the wall time
    for s, t in times:
        by_file[t.split("::")[0]] = by_file.get(t.split("::")[0], 0.0) + s
    return {"counts": counts, "failing": failing,
            "total_time_s": sum(float(s.get("time") or 0) for s in suites),
            "slowest": [{"test": t, "time_s": s} for s, t in times[:slowest]],
            "by_file": {f: round(s, 3) for f, s in sorted(by_file.items(), key=lambda x: -x[1])}}


def uncommitted_changes() -> list[str]:
    """Tracked files that differ from the commit (`git status --porcelain --untracked-files=no`)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                         text=True).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/results/test_suite.json")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (put them after --)")
    a = p.parse_args()
    env, changes = environment(), uncommitted_changes()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        rc = subprocess.run(["bash", "scripts/test.sh", "--junitxml", str(junit), *a.pytest_args], cwd=ROOT).returncode
        if not junit.exists():
            sys.exit(f"the test command wrote no junit report (exit status {rc}); nothing recorded")
        report = parse_junit(junit.read_text())
    env["loadavg_at_end"] = list(os.getloadavg())
    result = {"command": invocation(), "test_command": shlex.join(["bash", "scripts/test.sh", *a.pytest_args]),
              "pytest_args": a.pytest_args, "exit_status": rc, **report, "uncommitted_changes": changes, "env": env}
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}: {report['counts']}, exit status {rc}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
