"""README.md against the code: its first commands, the self-contained GPU block and its caveat, what the default
run optimises, the metrics it says to watch, the reward-function contract with its example file, the CPU recipe
against the stored run it links, and the statements on defaults, the GSM8K grader and `--tis`."""

import importlib
import json
import re
import shlex
from pathlib import Path

import pytest

from tests.test_docs import _script_argv, _shell_commands

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SCRIPTS = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__")


def _args(script: str):
    return importlib.import_module(f"algorithms.{script}").Args()


def _section(start: str, end: str) -> str:
    return README[README.index(start) : README.index(end, README.index(start))]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_the_readme_stays_short():
    """200 lines besides the algorithm table's rows, one per script (the table grows with the collection)."""
    rows = [line for line in README.splitlines() if re.match(r"^\| \[`\w+\.py`\]\(algorithms/", line)]
    assert len(rows) >= 20 and len(README.splitlines()) - len(rows) <= 200


def test_the_first_block_sets_up_and_runs_the_default_then_the_tests():
    first = _bash_blocks(README)[0]
    assert "bash scripts/setup.sh" in first and "algorithms/grpo.py " in first.split("#")[0] + " "
    assert "bash scripts/test.sh" in first


def test_every_bash_block_defines_the_variables_it_uses():
    """A block pasted alone into a fresh shell works: each `$VAR` it reads is assigned in the same block."""
    missing = []
    for block in _bash_blocks(README):
        defined = set(re.findall(r"^([A-Z_]+)=", block, re.M))
        used = set(re.findall(r"\$\{?([A-Z_]+)", block))
        missing += [f"${v} in: {block.splitlines()[0][:60]}" for v in used - defined]
    assert not missing, missing


def test_the_never_run_caveat_stands_beside_the_gpu_command():
    """The sentence on what was never run here is in the paragraph right above the one-GPU training block."""
    gpu = README.index("--vllm_enable_sleep")
    block_start = README.rindex("```bash", 0, gpu)
    paragraph = README[README.rindex("\n\n", 0, block_start - 2) : block_start]
    assert "Never run" in paragraph and "vLLM on a GPU" in paragraph and "hub model" in paragraph


def test_the_default_dataset_of_every_script_is_the_one_the_readme_names():
    """'With no flags every script runs ... on the built-in task, but X, on its Y task (`--dataset Y`)'."""
    intro = README[: README.index("## What the default")]
    for script in SCRIPTS:
        dataset = _args(script).dataset
        if dataset != "builtin":
            assert f"`{script}.py`" in intro and f"`--dataset {dataset}`" in intro, script


def test_the_gsm8k_grader_reads_after_the_last_marker_as_the_readme_says():
    from shared import graders

    assert "after the last `####`" in README
    assert graders.extract_gsm8k_answer("#### 1\nso #### 2") == "2"
    assert graders.grade("gsm8k", "5 + 5 = 10\n#### 12\n#### 10", "10") == 1.0


def test_the_readme_names_exactly_the_scripts_with_a_mismatch_correction():
    line = next(x for x in README.split("\n- ") if x.startswith("[mismatch.md]")).split("\n\n")[0]
    named = set(re.findall(r"\b([a-z_]+)(?=,| and |\.$)", line.split(" in ", 1)[1].replace("\n", " ").strip()))
    have = {s for s in SCRIPTS if hasattr(_args(s), "tis")}
    assert named == have, (named, have)


def test_what_the_default_optimises_states_grpo_s_defaults():
    """Every `--flag value` of the section equals grpo.py's Args, and the section names the flags of the formula."""
    text = _section("## What the default optimises", "**What to watch**")
    pairs = re.findall(r"`--([a-z_]+) ([^`]+)`", text)
    args = _args("grpo")
    assert {f for f, _ in pairs} >= {"loss_aggregation", "epsilon_low", "epsilon_high", "tis", "tis_cap",
                                      "num_iterations", "num_minibatches", "beta"}
    for flag, value in pairs:
        code = getattr(args, flag)
        assert (float(value) == float(code)) if isinstance(code, (int, float)) else value == code, (flag, value, code)


def test_the_metrics_to_watch_are_five_that_grpo_logs():
    text = _section("**What to watch**", "## Quick start")
    names = re.findall(r"^- `([a-z_]+/[a-z_@0-9]+)`", text, re.M)
    source = "".join((ROOT / p).read_text() for p in ("algorithms/grpo.py", "shared/mismatch.py", "shared/generation.py"))
    assert len(names) == 5
    for name in names:
        assert f'"{name}"' in source, name
        assert f"`{name}`" in (ROOT / "docs/grpo.md").read_text() or name.startswith("val/sampler")


def test_the_cpu_recipe_is_the_command_of_the_linked_stored_runs():
    """README's chat-model command is the stored runs' grpo.py command, less each run's --output_dir and --seed,
    with the data file at the path the first command writes."""
    stored = json.loads((ROOT / "docs/bench/real_model_grpo/cpu_20261127_164252.json").read_text())
    assert "docs/bench/real_model_grpo/cpu_20261127_164252.json" in (ROOT / "docs/real_models.md").read_text()
    recipe = next(c for c in _shell_commands(README) if "builtin:smollm2-135m" in c)
    mine = _script_argv(recipe)[1]
    for run in stored["seeds"].values():
        words = shlex.split(run["grpo_command"])[2:]
        for flag in ("--output_dir", "--seed"):
            i = words.index(flag)
            del words[i : i + 2]
        words[words.index("--dataset") + 1] = "data/" + Path(words[words.index("--dataset") + 1]).name
        assert mine == words


@pytest.fixture()
def example():
    from shared.rewards import load_reward_fn

    return lambda name: load_reward_fn(f"{ROOT / 'examples' / 'rewards.py'}:{name}")


def test_the_example_rewards_load_and_score_through_the_scripts_loader(example):
    """examples/rewards.py through shared/rewards.py's loader, call and check, as a script runs it."""
    from shared.rewards import compute_rewards, probe_reward_fn

    assert "[examples/rewards.py](examples/rewards.py)" in README
    rows = [{"prompt": "What is 12+7?", "answer": "12 + 7 = 19\n#### 19"}, {"prompt": "What is 2+2?", "answer": "4"}]
    completions = ["12 + 7 = 19\n#### 19", "It is 5.", "#### 4", "1,000,000"]
    answers = [rows[0]["answer"], "4", "4", "1000000"]
    prompts = [r["prompt"] for r in rows] * 2
    call = lambda name, finished: compute_rewards(example(name), prompts, completions, answers, finished,  # noqa: E731
                                                  rows * 2)
    assert call("exact_number", [True] * 4) == [1.0, 0.0, 1.0, 1.0]
    assert call("exact_number", [True, True, False, True]) == [1.0, 0.0, 0.0, 1.0]  # cut at the limit: 0
    assert call("answer_format", [True] * 4) == [1.0, 0.0, 1.0, 0.0]
    long = " ".join(["word"] * 60) + " 19"
    scores = compute_rewards(example("exact_number_short"), prompts[:2], [long, "19"], ["19", "19"], [True, True],
                             rows)
    assert scores == [pytest.approx(1 - 0.01 * 11), 1.0]
    for name in ("exact_number", "answer_format", "exact_number_short"):
        probe_reward_fn(example(name), rows)  # the start-up check every script makes


class _WordTokenizer:
    """Enough of a tokenizer for shared/data.py and shared/generation.py: one id per word, no BOS."""
    bos_token_id = None
    vocab = ["<eos>", "7", "</a>", "more"]

    def __call__(self, text, add_special_tokens=True):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=[len(w) for w in text.split()])

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


def test_the_reward_arguments_are_what_the_readme_says(tmp_path):
    """`prompts`: the prompt column before the template; `answers`: the gold column as text; `rows`: every column;
    `completions`: special tokens skipped, cut before a --stop string (what the scripts pass to compute_rewards)."""
    from shared.data import load_prompts
    from shared.generation import completion_decoder

    for split in ("train", "test"):
        (tmp_path / f"my.{split}.jsonl").write_text(json.dumps({"q": "What is 3+4?", "a": 7, "level": 2}) + "\n")
    data = load_prompts(str(tmp_path / "my.jsonl"), "test", _WordTokenizer(), prompt_key="q", answer_key="a",
                        prompt_template="Question: {prompt}\nAnswer:")
    (row,) = data.rows
    assert row["prompt"] == "What is 3+4?" and row["answer"] == "7" and row["level"] == 2
    assert "prompts`: the dataset's prompt column, before `--prompt_template`" in README
    decode = completion_decoder(_WordTokenizer(), ("</a>",))
    assert decode([1, 2, 3, 0]) == "7 "
    assert "special tokens (EOS) skipped, cut before a `--stop` string" in README


def test_the_held_out_set_is_graded_by_the_same_function():
    """eval/accuracy is the reward function's mean over held-out samples, pass@k counts scores above 0.5
    (shared/evaluation.py's evaluate_set, which every training script's evaluation calls)."""
    import inspect

    from shared import evaluation

    source = inspect.getsource(evaluation.evaluate_set)
    assert "compute_rewards(reward_fn" in source and "(g > 0.5).sum()" in source
    assert 'f"{prefix}/accuracy": (stats[0] / stats[2])' in source  # the sum of scores over the samples
    assert "`eval/accuracy` is its mean and `eval/pass@k` counts\nscores above 0.5" in README
