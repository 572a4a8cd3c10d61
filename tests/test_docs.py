"""Docs against their data: every generated table in README.md and docs/*.md equals what scripts/docs_tables.py
renders from the stored JSON it names, and the docs link to nothing outside the repository."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)


@pytest.mark.parametrize("path", docs_tables.markdown_files(), ids=lambda p: p.name)
def test_generated_tables_match_their_data_files(path):
    old, new = docs_tables.render_file(path)
    assert old == new, f"{path.name}: a generated table differs from its data (run python scripts/docs_tables.py)"


def test_a_generated_table_names_an_existing_file_and_a_known_renderer(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text("<!-- table real_model_prompts docs/bench/none.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="does not exist"):
        docs_tables.render_file(page)
    page.write_text("<!-- table nope docs/bench/none.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="unknown table"):
        docs_tables.render_file(page)


def test_the_real_model_page_has_its_measured_tables():
    text = (ROOT / "docs" / "real_models.md").read_text()
    assert text.count("<!-- table real_model_") == 2 and "| held-out accuracy" in text and "| prompt template" in text


def test_docs_link_only_inside_the_repository():
    """A clone has no ../shared: no page, script docstring or --help text may point there."""
    for path in [*docs_tables.markdown_files(), *sorted((ROOT / "algorithms").glob("*.py"))]:
        assert "../shared" not in path.read_text(), f"{path.name} points at ../shared, which is not in a clone"
    for path in docs_tables.markdown_files():
        for target in re.findall(r"\]\(([^)]+)\)", path.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            assert ROOT in resolved.parents or resolved == ROOT, f"{path.name} links outside the repository: {target}"


def test_docs_and_help_cite_no_design_notes_missing_from_a_clone():
    """The scripts, shared/ and the docs once cited design notes kept outside the repository ("pitfalls P8",
    "building_blocks.md §2", "style.md S5"); a reader of a clone cannot follow them, so none may remain."""
    pattern = re.compile(r"pitfalls [PU]\d|building_blocks(\.md)? §|style\.md S\d")
    files = [*docs_tables.markdown_files(), *sorted((ROOT / "algorithms").glob("*.py")),
             *sorted((ROOT / "shared").glob("*.py"))]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in pattern.finditer(p.read_text())]
    assert not found, found



def _documented_defaults(page: str) -> list[tuple[str, str]]:
    """(flag, documented default) from an algorithm page's flag tables: rows whose first cell holds `--flag`s and
    whose second cell is their default(s): "0.2, 0.28", "`group` (default) / `batch`", "on" / "off"."""
    out = []
    lines = page.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        header = i + 1 < len(lines) and lines[i + 1].startswith("|---")
        if len(cells) < 3 or not cells[0].startswith("`--") or header:
            continue
        flags = re.findall(r"`--([a-z_0-9]+)`", cells[0])
        if not flags or "/ `--no_" in cells[0] and len(flags) == 2 and flags[1] == "no_" + flags[0]:
            flags = flags[:1]
        value = cells[1]
        m = re.search(r"`?([^`/]+?)`? \(default\)", value)
        values = [m.group(1).strip()] if m else [v.strip().strip("`") for v in value.split(",")]
        if len(values) == len(flags):
            out += list(zip(flags, values))
    return out


@pytest.mark.parametrize("name", ["grpo", "drca", "dpo", "ppo", "vineppo", "rm", "sft", "repulse", "restem"])
def test_flag_tables_state_the_code_defaults(name):
    """A docs flag table that names a default must give the one in the script's Args (grpo.md once said
    num_iterations 1 while the code used 2)."""
    import importlib

    args = importlib.import_module(f"algorithms.{name}").Args()
    rows = _documented_defaults((ROOT / "docs" / f"{name}.md").read_text())
    if name in ("grpo", "drca"):
        assert len(rows) >= 8  # the parser reads these pages' tables (the test would pass vacuously otherwise)
    wrong = []
    for flag, doc in rows:
        if not hasattr(args, flag):
            continue
        code = getattr(args, flag)
        if isinstance(code, bool):
            ok = doc in (("on", "true", "True") if code else ("off", "false", "False"))
        elif isinstance(code, (int, float)):
            try:
                ok = float(doc) == float(code)
            except ValueError:
                ok = False
        else:
            ok = doc == str(code)
        if not ok:
            wrong.append(f"--{flag}: docs {doc!r}, code {code!r}")
    assert not wrong, wrong
