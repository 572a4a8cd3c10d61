"""Docs against their data: every generated table in README.md and docs/*.md equals what scripts/tools/docs_tables.py
renders from the stored JSON it names, and the docs link to nothing outside the repository."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "tools" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)


@pytest.mark.parametrize("path", docs_tables.markdown_files(), ids=lambda p: p.name)
def test_generated_tables_match_their_data_files(path):
    old, new = docs_tables.render_file(path)
    assert old == new, f"{path.name}: a generated table differs from its data (run python scripts/tools/docs_tables.py)"


def test_a_generated_table_names_an_existing_file_and_a_known_renderer(tmp_path, monkeypatch):
    page = tmp_path / "p.md"
    page.write_text("<!-- table real_model_prompts docs/bench/none.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="does not exist"):
        docs_tables.render_file(page)
    page.write_text("<!-- table nope docs/bench/none.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="unknown table"):
        docs_tables.render_file(page)


def test_a_block_may_read_several_files_and_only_a_multi_file_renderer_gets_them(tmp_path, monkeypatch):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text('{"x": 1}')
    b.write_text('{"x": 2}')
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    monkeypatch.setitem(docs_tables.RENDERERS, "sum_x", lambda ds: f"sum {sum(d['x'] for d in ds)} of {len(ds)}")
    monkeypatch.setattr(docs_tables, "MULTI", {"sum_x"})
    page = tmp_path / "p.md"
    page.write_text("<!-- table sum_x a.json,\n     b.json -->\nold\n<!-- end table -->\n")
    expected = ("<!-- table sum_x a.json,\n     b.json -->\nsum 3 of 2 Data: [a.json](a.json), [b.json](b.json).\n"
                "<!-- end table -->\n")  # a caption links the data files it does not name
    assert docs_tables.render_file(page)[1] == expected
    page.write_text("<!-- table sum_x a.json,none.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="none.json, which does not exist"):
        docs_tables.render_file(page)
    page.write_text("<!-- table graders a.json,b.json -->\nold\n<!-- end table -->\n")
    with pytest.raises(SystemExit, match="reads one file, the block names 2"):
        docs_tables.render_file(page)


def _blocks():
    """(page, renderer, [data files], rendered text) of every generated block in README.md and docs/*.md."""
    out = []
    for path in docs_tables.markdown_files():
        for m in docs_tables.BLOCK.finditer(path.read_text()):
            out.append((path.name, m.group(2), re.split(r",\s*", m.group(3)), m.group(4)))
    return out


def test_every_generated_table_names_the_command_that_regenerates_it():
    """Issue #17: the command that regenerates a table stands beside it (the renderer writes it from the file)."""
    missing = [f"{page}: {name}" for page, name, _, text in _blocks()
               if not re.search(r"`python (scripts|algorithms)/", text)]
    assert not missing, missing


def test_every_json_under_docs_is_read_by_a_table():
    """A stored measurement no page renders is either stale (replaced by a newer file) or a number the docs state by
    hand: neither may stay. Every JSON file under docs/ must be the data of some generated block."""
    used = {source for _, _, sources, _ in _blocks() for source in sources}
    # the files a rendered file copied rows from (`--reuse FILE` in its command) stay, so that command pastes
    todo = set(used)
    while todo:  # and the files those copied from
        found = {m for source in todo if (ROOT / source).is_file()
                 for m in re.findall(r"--reuse[ =](\S+?\.json)", (ROOT / source).read_text())}
        todo, used = found - used, used | found
    stored = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.json")}
    assert stored - used == set(), f"JSON under docs/ that no table reads: {sorted(stored - used)}"
    assert used - stored == set(), f"files a table or a --reuse command names, missing: {sorted(used - stored)}"


def test_every_reuse_file_a_page_names_exists():
    """A rendered command that copies rows (`--reuse FILE`) must paste: the file it names is kept."""
    for path in docs_tables.markdown_files():
        for name in re.findall(r"--reuse[ =](\S+?\.json)", path.read_text()):
            assert (ROOT / name).is_file(), f"{path.name} names --reuse {name}, which is not in the repository"


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


@pytest.mark.parametrize("name", ["grpo", "dapo", "grpo_tools", "grpo_async", "drca", "dpo", "ppo", "ppo_rlhf", "ppo_async", "vineppo",
                                  "rm", "sft", "repulse", "evaluate", "restem", "calibration", "genrm", "prime",
                                  "implicit_prm", "opd", "kto"])
def test_flag_tables_state_the_code_defaults(name):
    """A docs flag table that names a default must give the one in the script's Args (grpo.md once said
    num_iterations 1 while the code used 2)."""
    import importlib

    args = importlib.import_module(f"algorithms.{name}").Args()
    rows = _documented_defaults((ROOT / "docs" / f"{name}.md").read_text())
    if name in ("grpo", "drca", "evaluate"):
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


def test_a_summary_with_env_prints_its_command_and_machine_and_an_older_one_says_it_has_none():
    old = {"seeds": [1], "extra": [], "per_seed": [
        {"seed": 1, "ppo_initial_accuracy": 0.5, "ppo_final_accuracy": 0.7, "ppo_initial_reward": 0.1,
         "ppo_final_reward": 0.3, "ppo_minutes": 6.0, "drca_initial_accuracy": 0.5, "drca_final_accuracy": 0.6,
         "drca_initial_reward": 0.1, "drca_final_reward": 0.2, "drca_minutes": 7.0}],
        **{f"{a}_{k}": {"mean": v, "min": v, "max": v} for a, k, v in [
            ("ppo", "final_accuracy", 0.7), ("ppo", "final_reward", 0.3), ("ppo", "minutes", 6.0),
            ("drca", "final_accuracy", 0.6), ("drca", "final_reward", 0.2), ("drca", "minutes", 7.0)]},
        "drca_minus_ppo_final_accuracy": {"mean": -0.1, "per_seed": [-0.1]}}
    text = docs_tables.drca_vs_ppo(old)
    assert "`python scripts/experiments/compare_drca_ppo.py --seeds 1` (this file records no machine" in text
    new = {**old, "command": "python scripts/experiments/compare_drca_ppo.py --seeds 1",
           "env": {"device": "CPU X x2", "time": "2026-01-01 00:00:00", "git_commit": "abc1234"}}
    text = docs_tables.drca_vs_ppo(new)
    assert text.endswith("`python scripts/experiments/compare_drca_ppo.py --seeds 1`, CPU X x2.")  # no time, no commit
    assert "abc1234" not in text and "2026" not in text
    assert "Both arms train on the score of builtin:tiny-rm; " in docs_tables.drca_vs_ppo(new)
    kl = docs_tables.drca_vs_ppo({**new, "extra": ["--reward_model_path", "builtin:tiny-cf-rm", "--kl_coef", "0.1"]})
    assert "Both arms train on the score of builtin:tiny-cf-rm with the KL coefficient eta = 0.1 (drca.py's " in kl


def test_grpo_default_batch_of_the_restem_comparison_is_grpo_s_default():
    """docs_tables.restem_vs_grpo reads an older GRPO headline file's samples as step x GRPO_DEFAULT_BATCH."""
    import importlib

    a = importlib.import_module("algorithms.grpo").Args()
    assert a.local_num_prompts * a.num_generations == docs_tables.GRPO_DEFAULT_BATCH


def test_default_run_results_before_the_defaults_changed_name_the_flags_they_ran_with():
    """A default-run benchmark measured before the scripts' defaults changed (DEFAULTS_CHANGED) gives, under its
    table, the flags its runs used that are no longer defaults; one measured after, or a benchmark that passes its
    settings explicitly, adds nothing."""
    env = {"git_commit": "abc1234"}
    old = docs_tables.ran_with({"benchmark": "headline", "env": {**env, "time": "2026-11-26 01:57:08"}})
    new = docs_tables.ran_with({"benchmark": "headline", "env": {**env, "time": "2026-11-26 03:55:50"}})
    explicit = docs_tables.ran_with({"benchmark": "grpo", "env": {**env, "time": "2026-11-22 10:01:43"}})
    assert "`--local_micro_batch_size 256`" in old and "`--no_gradient_checkpointing`" in old
    assert new == explicit == ""


def test_a_rendered_command_names_a_renamed_flag_by_its_name_now():
    """Stored commands keep the flags they ran with; a caption shows them through shared/cli.py's RENAMED, so that
    it runs as shown. Only plain renames (`--NEW is its name now`) map; a flag split in two or moved to another
    file stays, and so does a word that is no flag."""
    from shared.cli import RENAMED

    assert docs_tables.renamed_flag("kl_coef") == "beta" and docs_tables.renamed_flag("num_ppo_epochs") == "num_iterations"
    assert docs_tables.renamed_flag("cliprange") is None and docs_tables.renamed_flag("async_steps") is None
    assert docs_tables.renamed_flag("beta") is None
    text = "`--total_episodes 9 --kl_coef 0 --num_samples_per_prompt 4` and `objective/kl_coef`, --cliprange 0.2"
    assert docs_tables.current_flags(text) == ("`--total_episodes 9 --beta 0 --num_generations 4` and "
                                               "`objective/kl_coef`, --cliprange 0.2")
    # a rename of one script's flag whose old name another script still has: only the first script's commands change
    assert docs_tables.current_flags("python algorithms/repulse.py --loss_type reinforce") == \
        "python algorithms/repulse.py --objective reinforce"
    assert docs_tables.current_flags("python algorithms/dpo.py --loss_type ipo") == "python algorithms/dpo.py --loss_type ipo"
    assert docs_tables.current_flags("--loss_type ipo") == "--loss_type ipo"
    for page in docs_tables.markdown_files():
        for _, name, _, block in [b for b in _blocks() if b[0] == page.name]:
            plain = [f for f in RENAMED if docs_tables.renamed_flag(f)]
            stale = [f for f in plain if re.search(rf"--{f}(?![\w-])", block)]
            assert docs_tables.current_flags(block) == block or not stale, (page.name, name, stale)


def test_captions_name_no_commit_and_no_time():
    """A caption gives the file, the command with the flags the run used, and the machine; the commit, the time and
    the rest stay in the stored JSON."""
    import json

    found = []
    for page, name, sources, text in _blocks():
        for source in sources:
            env = json.loads((ROOT / source).read_text()).get("env") or {}
            for key in ("git_commit", "time"):
                if env.get(key) and str(env[key]) in text:
                    found.append(f"{page}: {name} shows {key} {env[key]}")
        found += [f"{page}: {name}: {m.group(0)}" for m in re.finditer(r"\bcommit [0-9a-f]{7}\b", text)]
        if not all(Path(s).name in text for s in sources):
            found.append(f"{page}: {name} does not name its data file")
    assert not found, found


def test_headline_table_names_a_script_it_cannot_describe():
    """A default-run benchmark of a script without a metric description is an error naming it, not a KeyError."""
    with pytest.raises(ValueError, match="no metric description for my_grpo"):  # a copied script's benchmark
        docs_tables.results_overview([{"benchmark": "headline", "results": {"grpo": {}, "my_grpo": {}}}])


def _headline_files(*names):
    import json

    return [{**json.loads((ROOT / n).read_text()), "_path": n} for n in names]


def test_results_overview_has_default_runs_only_in_short_rows_and_names_what_is_not_measured():
    """README's table: one row per script with a stored default run (`python algorithms/<script>.py`, no flags), in
    OVERVIEW's order, with the same start, end and minutes as its page's table (`headline_<script>`); rows of at most
    140 characters; each file named under it with its command and machine; the scripts without a default run named
    with their pages; a file measured another way (other flags, another benchmark) is refused."""
    files = _headline_files("docs/bench/headline/cpu_20261126_035550.json",
                            "docs/bench/headline/cpu_20261126_115515.json")
    over = docs_tables.results_overview(files)
    rows = [line for line in over.split("\n") if line.startswith("| `python")]
    assert [r.split("`")[1] for r in rows] == [f"python algorithms/{n}.py" for n in docs_tables.OVERVIEW
                                              if any(n in d["results"] for d in files)]
    assert all(len(r) <= 140 for r in rows), [len(r) for r in rows]
    page = docs_tables.headline_runs(files[0], "grpo").split("\n")
    mean_row = next(line for line in page if line.startswith("| mean"))
    start_end, minutes = mean_row.split(" | ")[1], mean_row.split(" | ")[-1].strip(" |")
    grpo = next(r for r in rows if "algorithms/grpo.py" in r)
    assert f"| {start_end} | {minutes} |" in grpo
    assert "No default run stored for" in over and "[ppo_async.py](docs/ppo_async.md)" in over
    assert "`python scripts/experiments/bench_headline.py --seeds 1 2 3" in over and "cpu_20261126_035550.json" in over
    assert "load at most" not in over and "load:" not in over and "peak RSS" not in over and "commit" not in over
    restem = _headline_files("docs/bench/restem/cpu_20261125_013545.json")
    with pytest.raises(ValueError, match="no default-run file"):
        docs_tables.results_overview([*files, *restem])
    with pytest.raises(ValueError, match="no default-run file"):
        docs_tables.results_overview([*files, {"benchmark": "packing", "_path": "x.json"}])


def test_the_readme_results_table_reads_default_runs_only():
    """The README block names only bench_headline.py files run without --flags (the other measurements stay on
    their pages, which render them)."""
    import json

    block = next(b for b in _blocks() if b[0] == "README.md" and b[1] == "results_overview")
    for source in block[2]:
        d = json.loads((ROOT / source).read_text())
        assert d.get("benchmark") == "headline" and not d.get("flags"), source


# ---------------------------------------------------------------- commands in the README and docs
def _shell_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks, continuation lines joined, comments dropped, `VAR=...` assignments
    substituted into the later commands of the page."""
    import shlex

    out, env = [], {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip()
            m = re.match(r"^([A-Z_]+)=(\$?'.*'|\".*\")$", line)
            if m:
                value = m.group(2)
                env[m.group(1)] = shlex.split(value[1:] if value.startswith("$") else value)[0].encode().decode(
                    "unicode_escape") if value.startswith("$") else shlex.split(value)[0]
                continue
            for name, value in env.items():  # "$VAR" is one word; a bare $VAR splits into words, as in bash
                line = line.replace(f'"${name}"', shlex.quote(value)).replace(f"${name}", value)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def _script_argv(command: str) -> tuple[str, list[str]] | None:
    """(script, argv) of a `python algorithms/<script>.py ...` or `accelerate launch ... algorithms/<script>.py ...`
    command, up to a shell comment; None for other commands."""
    import shlex

    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for i, w in enumerate(words):
        m = re.fullmatch(r"algorithms/(\w+)\.py", w)
        if m:
            return m.group(1), [x for x in words[i + 1 :] if x not in ("...",)]
    return None


PLACEHOLDER = re.compile(r"(?<=\s)<[^<>]*>(?=\s|$)")  # `--total_episodes <3 x the pairs>`: a value to fill in
OMITTED = re.compile(r"\[the [^\]]*\]")  # `[the GSM8K flags above]`: flags given in an earlier command


def _with_placeholders_filled(command: str) -> str:
    """A page's command with each `<placeholder>` value written as `1` (parsed as text or as a number alike) and each
    `[the ... flags]` stand-in dropped, so the rest of the command line is checked."""
    return OMITTED.sub("", PLACEHOLDER.sub("1", command))


def _caption_commands(text: str) -> list[str]:
    """The `python algorithms/<script>.py ...` commands of a rendered table (its rows and caption)."""
    return re.findall(r"`(python algorithms/\w+\.py[^`]*)`", text)


def _all_script_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script, argv) of every script command in README.md, docs/*.md and the scripts' docstrings (their
    ```bash blocks) and in every rendered table."""
    out = []
    for page, text in _pages_with_commands().items():
        for c in _shell_commands(text):
            parsed = _script_argv(_with_placeholders_filled(c))
            if parsed:
                out.append((page, *parsed))
    for page, name, _, text in _blocks():
        for c in _caption_commands(text):
            parsed = _script_argv(_with_placeholders_filled(c))
            if parsed:
                out.append((f"{page} ({name} table)", *parsed))
    return out


def test_the_readme_commands_parse_against_each_script_s_flags():
    """Every script command of the README (the quick start included, with its hub names) is a command line each
    script accepts: the flag names, their values and choices (parsed, not run)."""
    import importlib

    from shared.cli import parse_cli

    commands = [c for c in map(_script_argv, _shell_commands((ROOT / "README.md").read_text())) if c]
    assert len(commands) >= 3 and {"grpo", "evaluate"} <= {s for s, _ in commands}
    for script, argv in commands:
        parse_cli(importlib.import_module(f"algorithms.{script}").Args, argv)


def test_every_page_and_caption_command_parses_against_its_script_s_flags():
    """Every `python algorithms/<script>.py ...` or `accelerate launch ... algorithms/<script>.py ...` command of
    README.md, docs/*.md, the scripts' docstrings and the rendered tables parses against that script's flags (names,
    values, choices; not run). A renamed flag fails with its one-line error naming the new name."""
    import contextlib
    import importlib
    import io

    from shared.cli import CommandLineError, parse_cli

    commands = _all_script_commands()
    pages = {where.split(" (")[0] for where, _, _ in commands}
    assert len(commands) >= 90 and {"README.md", "docs/grpo.md", "docs/real_models.md", "docs/repulse.md"} <= pages
    assert any("table)" in where for where, _, _ in commands)
    broken = []
    for where, script, argv in commands:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                parse_cli(importlib.import_module(f"algorithms.{script}").Args, argv)
        except (CommandLineError, SystemExit) as e:
            broken.append(f"{where}: {script}.py {' '.join(argv)[:100]}: {e}")
    assert not broken, "\n".join(broken)


def test_the_command_check_reads_variables_placeholders_and_captions():
    text = ('```bash\nM="--model_name_or_path builtin:smollm2-135m --chat_template"\n'
            'T=$\'{prompt}\\nEnd with "#### <n>".\'\npython algorithms/grpo.py $M --prompt_template "$T" \\\n'
            '    --total_episodes <the pairs x 3> [the GSM8K flags above]\n```\n')
    (command,) = _shell_commands(text)
    script, argv = _script_argv(_with_placeholders_filled(command))
    assert script == "grpo" and argv == ["--model_name_or_path", "builtin:smollm2-135m", "--chat_template",
                                         "--prompt_template", '{prompt}\nEnd with "#### <n>".', "--total_episodes", "1"]
    assert _caption_commands("x `python algorithms/grpo.py --seed <k>` for each seed (`python scripts/b.py`)") == [
        "python algorithms/grpo.py --seed <k>"]


def _pages_with_commands() -> dict[str, str]:
    pages = {str(p.relative_to(ROOT)): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    for p in sorted((ROOT / "algorithms").glob("*.py")):  # docstrings: their Launch sections hold commands too
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        pages[str(p.relative_to(ROOT))] = "```bash\n" + "\n".join(
            line for line in doc.splitlines() if line.startswith(("    ", "\t"))) + "\n```"
    return pages


def gsm8k_without_its_answer_line(command: str) -> bool:
    """A command that trains or evaluates with the GSM8K grader (`--reward_fn gsm8k`, or `auto` on a gsm8k dataset)
    whose prompt template does not ask for the `#### <answer>` line the grader reads. A model fine-tuned to GSM8K's
    format (VinePPO's `*-sft-GSM8K` checkpoints) writes the line unasked, and so does one sft.py trains on GSM8K's
    solutions (`--response_key answer`: each ends with it)."""
    parsed = _script_argv(command)
    if not parsed:
        return False
    argv = parsed[1]
    value = lambda flag, default="": argv[argv.index(flag) + 1] if flag in argv[:-1] else default  # noqa: E731
    grader = value("--reward_fn", "auto")
    if not (grader == "gsm8k" or (grader == "auto" and "gsm8k" in value("--dataset").lower())):
        return False
    return ("####" not in value("--prompt_template") and "sft-GSM8K" not in value("--model_name_or_path")
            and "--response_key" not in argv)


def test_gsm8k_commands_ask_for_the_answer_line_the_grader_reads():
    """Every command in README, docs and docstrings that uses the GSM8K grader has a prompt template with `####`."""
    bad = [f"{page}: {c[:120]}" for page, text in _pages_with_commands().items()
           for c in _shell_commands(text) if gsm8k_without_its_answer_line(c)]
    assert not bad, bad


def test_the_gsm8k_check_catches_a_command_without_the_template():
    assert gsm8k_without_its_answer_line("python algorithms/grpo.py --dataset openai/gsm8k:main --reward_fn gsm8k")
    assert gsm8k_without_its_answer_line("python algorithms/ppo.py --dataset openai/gsm8k:main")  # auto: gsm8k
    assert not gsm8k_without_its_answer_line("python algorithms/grpo.py --dataset openai/gsm8k:main --prompt_template "
                                             "'{prompt} End with #### <n>.'")
    assert not gsm8k_without_its_answer_line("python algorithms/grpo.py --dataset openai/gsm8k:main --reward_fn math")


STALE = re.compile(r"\bissue #?\d+|spec §|Status: issue|\bv[1-9] (build|start model)\b|lent so far|commit [0-9a-f]{7}\b")
# A page states the present; how a number or a default came to be belongs in docs/changelog.md.
HISTORY = re.compile(
    r"\bnow\b|\bre-?measured\b|\bmeasured again\b|\bre-?ran\b|\bearlier (build|start model|measurement|runs?|settings|"
    r"variants|ones|experiment)\b|\bfirst measurement\b|\bdefaults of then\b|\bno longer\b|\bused to\b|"
    r"\bbefore the (fix|change)\b|\bthis session\b|\bnot (been )?run yet\b|\bhas not run\b|\bnone stored yet\b|"
    r"\bsupersede[ds]?\b|\bbecame the default\b|\bbefore results were kept\b|\b(was|were) split from\b|\(was \d|"
    r"\bwhen this was written\b|\bat the time\b|\bpreviously\b|\bformerly\b|\bolder versions\b|\bthen and now\b|"
    r"\bsince the (fix|change)\b|\bfrom before\b|\bpredates?\b|\bnothing changed\b",
    re.I)


def _prose(text: str) -> str:
    """A page without its generated blocks (whose captions name commits and builds on purpose), its line breaks
    collapsed into spaces, so that a phrase split across two lines of the source is one phrase."""
    return " ".join(re.sub(r"<!-- table .*?<!-- end table -->", " ", text, flags=re.S).split())


def test_prose_sees_a_phrase_split_across_a_line_break():
    text = "Sleep mode is untested on a GPU (the one GPU lent so\nfar had no vLLM).\n<!-- table x a.json -->\nv2 build\n<!-- end table -->"
    assert "lent so far" not in text and not STALE.search(text.split("<!--")[0])  # the raw text hides it
    assert STALE.search(_prose(text)).group(0) == "lent so far"
    assert "v2 build" not in _prose(text)
    assert HISTORY.search(_prose("the runs were re-measured\nat the commit")).group(0) == "re-measured"
    assert HISTORY.search(_prose("it no\nlonger does")).group(0) == "no longer"


def test_prose_keeps_no_history_a_reader_cannot_follow():
    """Commit hashes belong in the rendered captions of stored results; issue numbers, build nicknames ("v2 build")
    and notes on this project's machines ("the one GPU lent so far") in none of the pages. No page but the changelog
    narrates history ("now", "re-measured", "an earlier build", "no longer", "used to"): it states the present."""
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in docs_tables.markdown_files()
             for m in STALE.finditer(_prose(p.read_text()))]
    assert not found, found
    assert STALE.search("measured at commit 6ba6b38") and STALE.search("Status: issue 3 in progress")
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "changelog.md"]
    found = []
    for p in pages:
        prose = _prose(p.read_text())
        found += [f"{p.relative_to(ROOT)}: ...{prose[max(0, m.start() - 60):m.end() + 20]}..." for m in HISTORY.finditer(prose)]
    assert not found, "\n".join(found)


SKELETON = ["Overview", "Usage", "Flags", "Logged metrics", "Implementation details", "Results", "Reliability"]


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__"))
def test_every_algorithm_page_has_the_same_skeleton(name):
    """docs/<script>.md for every algorithms/<script>.py, with CleanRL's sections as its H2 headings, in this order
    (subsections under them are free). No length bound: a page is as long as what its script needs said."""
    page = ROOT / "docs" / f"{name}.md"
    assert page.exists(), f"algorithms/{name}.py has no docs/{name}.md"
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a shell comment is no heading
    assert re.findall(r"^## (.+?)\s*$", text, flags=re.M) == SKELETON


def test_the_pages_name_every_script_that_takes_a_reward_model():
    """docs/running.md and docs/rm.md list the scripts with `--reward_model_path`: exactly those whose Args have it."""
    import re

    have = {p.name for p in (ROOT / "algorithms").glob("*.py") if "reward_model_path: str" in p.read_text()}
    for page in ("running.md", "rm.md"):
        text = (ROOT / "docs" / page).read_text()
        start = text.index("`--reward_model_path`")  # its first mention is the list, closed by a parenthesis
        named = set(re.findall(r"\w+\.py", text[start : text.index(")", start + 25)]))
        assert named == have, (page, sorted(have ^ named))


def test_the_models_table_names_every_builtin_model():
    """docs/running.md's Models table names every `builtin:` model that shared/models.py resolves, and no other."""
    from shared.models import BUILTIN_MODELS

    text = (ROOT / "docs" / "running.md").read_text()
    table = text[text.index("## Models"):text.index("## Tests")]
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("|")]
    assert set(re.findall(r"`(builtin:[\w-]+)`", " ".join(first_cells))) == set(BUILTIN_MODELS)


def test_a_generated_list_of_scripts_is_the_code_s():
    """A `<!-- scripts FLAG -->` list on a page holds the scripts whose Args have FLAG (scripts/tools/docs_tables.py renders
    it; the check of generated blocks keeps it current), and a wrong list is rewritten."""
    found = docs_tables.scripts_with("micro_batching")
    assert "grpo.py" in found and "sft.py" not in found
    assert docs_tables.scripts_with("tis", "=", "none") == [s for s in docs_tables.scripts_with("tis")
                                                            if docs_tables.script_defaults(s[:-3])["tis"] == "none"]
    page = ROOT / "docs" / "micro_batching.md"
    text = page.read_text()
    stale = re.sub(r"(<!-- scripts micro_batching -->).*?(<!-- end scripts -->)", r"\1sft.py\2", text)
    assert stale != text
    page.write_text(stale)
    try:
        old, new = docs_tables.render_file(page)
        assert "sft.py<!--" in old and "sft.py<!--" not in new and new == text
    finally:
        page.write_text(text)


def smollm2_scripts() -> set[str]:
    """The algorithms/*.py that some test runs on builtin:smollm2-135m: a test or fixture that names the model (or a
    module constant that does, directly or through another) and launches `algorithms/<name>.py` or `script("<name>")`."""
    import ast

    found = set()
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        src = p.read_text()
        if "smollm2-135m" not in src:
            continue
        tree = ast.parse(src)
        assigns = [(t.id, ast.get_source_segment(src, n)) for n in tree.body if isinstance(n, ast.Assign)
                   for t in n.targets if isinstance(t, ast.Name)]
        smol: set[str] = set()
        while more := {name for name, seg in assigns if "smollm2-135m" in seg
                       or any(re.search(rf"\b{s}\b", seg) for s in smol)} - smol:
            smol |= more
        for n in tree.body:
            seg = ast.get_source_segment(src, n) if isinstance(n, ast.FunctionDef) else ""
            if (("smollm2-135m" in seg or any(re.search(rf"\b{s}\b", seg) for s in smol))
                    and re.search(r"\b(run|script|Popen|check_call|check_output)\(|algorithms/\{name\}\.py", seg)):
                found |= set(re.findall(r"algorithms/(\w+)\.py", seg) + re.findall(r"\bscript\(\"(\w+)\"", seg))
                if "algorithms/{name}.py" in seg:  # a plan of run_batch: out("<name>") is `algorithms/<name>.py ...`
                    found |= set(re.findall(r"\bout\(\"(\w+)\"\)", seg))
    return {f"{n}.py" for n in found}


def test_the_pages_name_the_scripts_the_ci_runs_on_the_chat_model():
    """real_models.md and running.md's Models table name exactly the scripts a test runs on builtin:smollm2-135m, and
    real_models.md names every other script as not run there."""
    ran = smollm2_scripts()
    assert {"grpo.py", "sft.py", "rm.py"} <= ran
    text = (ROOT / "docs" / "real_models.md").read_text()
    section = text[text.index("## The scripts on the chat model"):]
    runs, not_run = section.split("Not run on it in CI:", 1)
    runs = set(re.findall(r"\w+\.py", runs[:runs.index("(")]))
    not_run = set(re.findall(r"\w+\.py", not_run[:not_run.index("(")]))
    assert runs == ran, sorted(runs ^ ran)
    every = {p.name for p in (ROOT / "algorithms").glob("*.py")} - {"__init__.py"}
    evaluation = {n for n in every if n.startswith("evaluate")}  # no training run to make
    assert not_run == every - ran - evaluation, sorted(not_run ^ (every - ran - evaluation))
    row = next(line for line in (ROOT / "docs" / "running.md").read_text().splitlines()
               if line.startswith("| `builtin:smollm2-135m`"))
    assert set(re.findall(r"\w+\.py", row.split("|")[-2])) == ran  # the last cell ("<|im_end|>" holds bars)


def test_the_repository_layout_names_every_file():
    """docs/running.md's Repository layout names every algorithm, shared module and entry of scripts/, and nothing
    that is not there."""
    text = (ROOT / "docs" / "running.md").read_text()
    block = text[text.index("## Repository layout"):]
    block = block[block.index("```"):block.index("```", block.index("```") + 3)]
    parts = dict(re.findall(r"^(\w+)/ +(.*?)(?=^\w+/ |\Z)", block.removeprefix("```\n"), flags=re.M | re.S))
    for folder in ("algorithms", "shared", "scripts"):
        have = {p.name for p in (ROOT / folder).iterdir() if not p.name.startswith(("_", ".")) and p.name != "README.md"}
        entries = parts[folder]
        while re.search(r"\([^()]*\)", entries):  # what an entry says of itself, in parentheses, names other files
            entries = re.sub(r"\([^()]*\)", "", entries)
        named = set(re.findall(r"[\w.-]+\.(?:py|sh)\b|\b[a-z_]+/", entries))
        named = {n.rstrip("/") for n in named}
        assert have - named == set(), (folder, sorted(have - named))
        assert {n for n in named if "." in n} - have == set(), (folder, sorted({n for n in named if "." in n} - have))


def test_scripts_readme_names_every_file_in_its_folder():
    """scripts/README.md names each file of scripts/<kind>/ on that folder's entry, and no file that is not there."""
    block = (ROOT / "scripts" / "README.md").read_text().split("```")[1]
    parts = dict(re.findall(r"^([\w.,+ ]+?)/? {2,}(.*?)(?=^\S|\Z)", block.lstrip("\n"), flags=re.M | re.S))
    kinds = [p for p in (ROOT / "scripts").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]
    assert {k.name for k in kinds} <= set(parts), sorted({k.name for k in kinds} - set(parts))
    for kind in kinds:
        have = {p.name for p in kind.iterdir() if not p.name.startswith(("_", "."))}
        named = {n.rstrip("/") for n in re.findall(r"[\w.-]+\.(?:py|sh|yaml)\b|\b[a-z_]+/", parts[kind.name])}
        named = {n for n in named if "." in n or (kind / n).is_dir()}  # "shared/builtin_models/" is not an entry
        assert have == named, (kind.name, sorted(have - named), sorted(named - have))


def test_evaluate_md_names_the_scripts_that_evaluate_with_another_seed():
    """evaluate.md says which training scripts sample their held-out evaluation with `seed + 7`, not eval_seed: exactly
    the scripts whose code does."""
    have = {p.name for p in (ROOT / "algorithms").glob("*.py") if "seed=args.seed + 7" in p.read_text()}
    text = (ROOT / "docs" / "evaluate.md").read_text()
    sentence = text[text.index("the one every RL script evaluates with;"):]
    assert set(re.findall(r"\w+\.py", sentence[: sentence.index("evaluate with `seed + 7`")])) == have


def test_no_command_holds_a_placeholder_for_flags():
    """A command on a page pastes as it stands: no `[the ... flags]` standing for flags written elsewhere."""
    found = [f"{p.name}: {m.group(0)}" for p in docs_tables.markdown_files()
             for block in re.findall(r"```.*?```", p.read_text(), flags=re.S)
             for m in re.finditer(r"\[the [^\]]*flags[^\]]*\]", block)]
    assert not found, found
