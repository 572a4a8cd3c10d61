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

