"""The layout the project promises: shared/ is plumbing with no import circle and never imports an algorithm, and
no algorithm file imports another (each reads on its own, and a copy runs without the others)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, package: str) -> set[str]:
    """The modules of `package` that a file imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
            out |= {a.name for a in node.names} if node.module == package else {node.module.split(".")[1]}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")}
    return out


def import_graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p, "shared") - {p.stem} for p in (ROOT / "shared").glob("*.py")}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_shared_has_no_import_circle():
    assert find_circle(import_graph()) is None, find_circle(import_graph())


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"b"}}) is None


def test_shared_never_imports_an_algorithm_and_no_algorithm_imports_another():
    for p in (ROOT / "shared").glob("*.py"):
        assert not _imports(p, "algorithms"), p.name
    for p in (ROOT / "algorithms").glob("*.py"):
        assert not _imports(p, "algorithms"), p.name
