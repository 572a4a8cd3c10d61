"""algorithms/evaluate.py and the estimators of shared/evaluation.py: pass@k against brute force over every k-subset,
maj@k by hand (ties included), the bootstrap interval, the chunked seeding shared with the training scripts, and
end-to-end runs: outputs, resume after an interruption, data-parallel ranks, bad input, and the agreement of a
grpo.py run's last held-out numbers with evaluate.py on its final checkpoint."""

import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from algorithms.evaluate import Args, main, summarize, work_calls
from shared.evaluation import (EVAL_CHUNK, bootstrap_ci, generate_chunks, maj_at_k, majority_vote, pass_at_k,
                               prompt_chunks, shard)
from shared.generation import Completion
from shared.rewards import gsm8k_answer, load_answer_fn, math_answer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------- pass@k (Chen et al. 2021, Eq. 1)
def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of the k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_equals_brute_force_over_every_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_large_n():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    # n = 200: the binomials have 60 digits; the product form stays exact to rounding
    exact = 1 - Fraction(math.comb(197, 100), math.comb(200, 100))
    assert pass_at_k(200, 3, 100) == pytest.approx(float(exact), rel=1e-12)
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)


# ---------------------------------------------------------------- maj@k
def test_majority_vote_by_hand():
    assert majority_vote(["5", "5", "3"], [True, True, False]) == 1.0
    assert majority_vote(["3", "3", "5"], [False, False, True]) == 0.0
    assert majority_vote(["5", "3"], [True, False]) == 0.5  # a tie: half the tied answers are correct
    assert majority_vote(["3", "5"], [False, True]) == 0.5  # ... whatever the order
    assert majority_vote(["1", "2", "3"], [False, True, False]) == pytest.approx(1 / 3)
    assert majority_vote(["1", "1", "2", "2", "3"], [False, False, True, True, True]) == 0.5  # 3 is not tied
    assert majority_vote([None, None, "5"], [False, False, True]) == 1.0  # no answer: no vote
    assert majority_vote([None, None], [False, False]) == 0.0
    assert majority_vote([], []) == 0.0


def test_maj_at_k_averages_disjoint_blocks():
    answers, correct = ["5", "5", "3", "3"], [True, True, False, False]
    assert maj_at_k(answers, correct, 2) == 0.5  # block (5, 5) right, block (3, 3) wrong
    assert maj_at_k(answers, correct, 4) == 0.5  # one block, a 2-2 tie
    assert maj_at_k(answers, correct, 1) == 0.5  # maj@1 is the fraction correct
    assert maj_at_k(["5", "3", "3", "5", "9"], [True, False, False, True, False], 2) == 0.5  # two ties; 5th unused
    assert maj_at_k(["7", "7", "7"], [True, True, True], 3) == 1.0
    with pytest.raises(ValueError, match="maj@k"):
        maj_at_k(["5"], [True], 2)


# ---------------------------------------------------------------- bootstrap
def test_bootstrap_ci_is_deterministic_and_contains_the_estimate():
    rng = np.random.default_rng(0)
    values = {"a": rng.integers(0, 2, 200).astype(float), "b": rng.random(200), "c": np.full(200, 0.25)}
    ci = bootstrap_ci(values, 500, 0.95, seed=3)
    assert ci == bootstrap_ci(values, 500, 0.95, seed=3)
    assert ci != bootstrap_ci(values, 500, 0.95, seed=4)
    for name, v in values.items():
        low, high = ci[name]
        assert low <= v.mean() <= high, name
    assert ci["c"] == [0.25, 0.25]
    wide, narrow = bootstrap_ci(values, 500, 0.99, 3)["a"], bootstrap_ci(values, 500, 0.5, 3)["a"]
    assert wide[0] < narrow[0] < narrow[1] < wide[1]
    # the definition: resamples of the prompt indices from default_rng(seed), percentiles of their means
    v = np.array([0.0, 1.0, 1.0, 0.5])
    means = v[np.random.default_rng(1).integers(0, 4, size=(50, 4))].mean(axis=1)
    assert bootstrap_ci({"v": v}, 50, 0.9, seed=1)["v"] == list(np.quantile(means, [0.05, 0.95]))


def _record(i, grades, answers, finished=None, greedy=None):
    finished = finished or [True] * len(grades)
    samples = [{"completion": "", "answer": a, "grade": g, "finish_reason": "stop" if f else "length",
                "num_tokens": 1} for g, a, f in zip(grades, answers, finished)]
    record = {"index": i, "prompt": "p", "gold": "1", "samples": samples}
    if greedy is not None:
        record["greedy"] = {"completion": "", "answer": None, "grade": greedy, "finish_reason": "stop", "num_tokens": 1}
    return record


def test_summarize_by_hand():
    records = [_record(0, [1.0, 0.0, 0.0, 1.0], ["1", "2", "2", "1"], greedy=1.0),
               _record(1, [0.0, 0.0, 0.0, 0.0], ["3", "3", "4", None], greedy=0.0),
               # the truncated samples carry the right answer but do not vote (the graders give them 0)
               _record(2, [1.0, 0.0, 0.0, 0.0], ["1", "1", "1", "5"], finished=[True, False, False, True], greedy=1.0)]
    s = summarize(records, [1, 2, 4], votes=True, num_bootstrap=200, confidence=0.9, seed=1)
    m = s["metrics"]
    assert m["eval/accuracy"] == 3 / 12 and m["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    assert m["eval/pass@1"] == pytest.approx(3 / 12)
    assert m["eval/pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + pass_at_k(4, 1, 2)) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    # maj@4: prompt 0 ties 1/2 -> 0.5; prompt 1 votes 3 -> 0; prompt 2: "1" and "5" tie (1 vote each) -> 0.5
    assert m["eval/maj@4"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    # maj@2: prompt 0 blocks (1,2) tie 0.5, (2,1) tie 0.5; prompt 2 blocks ("1" alone) 1, ("5" alone) 0
    assert m["eval/maj@2"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert set(s["ci"]) == set(m)
    assert "eval/maj@2" not in summarize(records, [2], votes=False, num_bootstrap=0, confidence=0.9, seed=1)["metrics"]


# ---------------------------------------------------------------- answers, chunks and seeds
def test_answer_extractors():
    assert gsm8k_answer("", "so #### $1,234.") == gsm8k_answer("", "#### 1234") == "1234"
    assert gsm8k_answer("", "no answer") is None and gsm8k_answer("", "#### Eighteen") == "eighteen"
    assert math_answer("What is x?", "so $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert load_answer_fn("auto", "builtin")("", "3\n7\n12") == "12"
    assert load_answer_fn("my_module.py:score", "builtin") is None


class FakeGenerator:
    """One random stream per call, like both backends: a completion's token is a function of the call's seed and
    first index, its position in the call and the call's length, so batching shows."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, index_offset=0):
        self.calls.append((index_offset, len(prompts)))
        return [[Completion([hash((seed, index_offset, len(prompts), i, k)) % 1000], [0.0], "stop") for k in range(n)]
                for i in range(len(prompts))]


def test_a_prompts_completions_do_not_depend_on_ranks_or_resume():
    """The chunks of every rank layout (and of an evaluation resumed with only the unfinished chunks) give each prompt
    the completions of the one-rank evaluation."""
    prompts = [[i] for i in range(150)]
    chunks = prompt_chunks(len(prompts))
    assert [len(c) for c in chunks] == [EVAL_CHUNK, EVAL_CHUNK, 150 - 2 * EVAL_CHUNK]
    whole = generate_chunks(FakeGenerator(), prompts, chunks, 2, 1.0, 1.0, 4, seed=7)
    for world in (2, 3, 4):
        merged = []
        for rank in range(world):
            gen = FakeGenerator()
            merged += generate_chunks(gen, prompts, shard(chunks, rank, world), 2, 1.0, 1.0, 4, seed=7,
                                      num_calls=math.ceil(len(chunks) / world))
            assert len(gen.calls) == math.ceil(len(chunks) / world)  # as many on every rank (ZeRO-3)
        assert [[c.token_ids for c in g] for g in merged] == [[c.token_ids for c in g] for g in whole]
    assert generate_chunks(FakeGenerator(), prompts, chunks[1:], 2, 1.0, 1.0, 4, seed=7) == whole[EVAL_CHUNK:]


def test_one_call_per_chunk_padded_with_empty_calls_for_zero3():
    prompts = [[i] for i in range(150)]
    chunks = prompt_chunks(len(prompts))
    gen = FakeGenerator()
    generate_chunks(gen, prompts, chunks[2:], 1, 1.0, 1.0, 4, seed=0, num_calls=2)
    assert gen.calls == [(128, 22), (0, 0)]  # one chunk, then an empty call: every rank makes as many calls
    gen = FakeGenerator()
    generate_chunks(gen, prompts, chunks, 1, 1.0, 1.0, 4, seed=0)
    assert gen.calls == [(0, 64), (64, 64), (128, 22)]


def test_work_calls():
    chunks = prompt_chunks(150, 64)
    assert work_calls(150, set(), 64) == chunks
    assert work_calls(150, {0, 1, 70}, 64) == chunks  # a chunk with a missing prompt: generated whole
    assert work_calls(150, set(range(64)), 64) == chunks[1:]
    assert work_calls(10, {0, 1, 2, 5}, 3) == [range(3, 6), range(6, 9), range(9, 10)]
    assert work_calls(10, set(range(10)), 3) == []


# ---------------------------------------------------------------- end to end
def evaluate(out: Path, *flags: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "algorithms/evaluate.py", "--output_dir", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if ok:
        output = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}"
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_outputs(out: Path, num_prompts: int, num_samples: int, ks: list[int]) -> dict:
    """completions.jsonl holds every prompt in order with its greedy and sampled completions, answers and grades;
    summary.json's metrics are those the records give."""
    assert sorted(p.name for p in out.iterdir()) == ["args.json", "completions.jsonl", "summary.json"]
    records = read_jsonl(out / "completions.jsonl")
    assert [r["index"] for r in records] == list(range(num_prompts))
    for r in records:
        assert len(r["samples"]) == num_samples and set(r["greedy"]) == set(r["samples"][0])
        for s in [r["greedy"], *r["samples"]]:
            assert s["grade"] == float(s["finish_reason"] == "stop" and s["answer"] == r["gold"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"] == summarize(records, ks, True, summary["num_bootstrap"], summary["confidence"],
                                           summary["args"]["seed"])["metrics"]
    for name, value in summary["metrics"].items():
        assert summary["ci"][name][0] <= value <= summary["ci"][name][1], name
    assert set(summary["metrics"]) == {"eval/greedy_accuracy", "eval/accuracy",
                                       *(f"eval/{m}@{k}" for m in ("pass", "maj") for k in ks)}
    return summary


def test_evaluate_hf_end_to_end(tmp_path):
    proc = evaluate(tmp_path / "hf", "--generator", "hf", "--eval_num_prompts", "10", "--k", "1", "2", "4")
    summary = check_outputs(tmp_path / "hf", 10, 4, [1, 2, 4])
    assert proc.stdout.count("\n") == 2 and proc.stdout.splitlines()[-1].startswith("done: 10 prompts")
    bar = [line for line in proc.stderr.splitlines() if line.strip()]  # text=True turned the bar's \r into \n
    assert bar and all(line.startswith("evaluate: prompt ") for line in bar), proc.stderr  # one bar, nothing else
    assert summary["metrics"]["eval/greedy_accuracy"] > 0.5  # the SFT warm start solves most prompts greedily


def run_in_process(out: Path, monkeypatch, capsys, *flags: str) -> tuple[int, str]:
    """evaluate.py's command line in this process; (exit status, stderr)."""
    from shared.cli import run_cli

    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--output_dir", str(out), *flags])
    code = 0
    try:
        run_cli(main, Args)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


HF_SMALL = ["--generator", "hf", "--eval_num_prompts", "10", "--num_samples", "2", "--k", "1", "2", "--max_new_tokens",
            "12", "--num_bootstrap", "100"]


def test_hf_resume_recomputes_nothing_and_equals_a_straight_run(tmp_path, monkeypatch, capsys):
    """Chunks of 4 prompts here (64 by default), so that 10 prompts make three chunks: 4 + 4 + 2."""
    flags = ["--chunk_size", "4", *HF_SMALL]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_in_process(straight, monkeypatch, capsys, *flags)[0] == 0
    assert run_in_process(resumed, monkeypatch, capsys, *flags, "--stop_after_prompts", "1")[0] == 0
    assert not (resumed / "summary.json").exists()
    first = read_jsonl(resumed / "completions.rank0.jsonl")
    assert [r["index"] for r in first] == [0, 1, 2, 3]  # the first chunk, whole
    with open(resumed / "completions.rank0.jsonl", "a") as f:
        f.write('{"index": 4, "prompt": "torn')  # a kill in the middle of a write
    calls = []
    import shared.evaluation as evaluation

    real = evaluation.generate_chunks
    monkeypatch.setattr("algorithms.evaluate.generate_chunks",
                        lambda gen, ids, chunks, *a, **k: calls.append(list(chunks)) or real(gen, ids, chunks, *a, **k))
    assert run_in_process(resumed, monkeypatch, capsys, *flags)[0] == 0
    assert calls == [[range(4, 8)], [range(4, 8)], [range(8, 10)], [range(8, 10)]]  # greedy and sampled per chunk
    assert (resumed / "completions.jsonl").read_text() == (straight / "completions.jsonl").read_text()
    a, b = (json.loads((d / "summary.json").read_text()) for d in (straight, resumed))
    assert a["metrics"] == b["metrics"] and a["ci"] == b["ci"]
    # a finished evaluation: rerun with other summary flags recomputes the summary only
    calls.clear()
    assert run_in_process(resumed, monkeypatch, capsys, *flags[:-6], "--k", "2", "--num_bootstrap", "0",
                          "--max_new_tokens", "12")[0] == 0
    assert calls == [] and json.loads((resumed / "summary.json").read_text())["ci"] == {}
    assert json.loads((resumed / "summary.json").read_text())["metrics"]["eval/pass@2"] == a["metrics"]["eval/pass@2"]


@pytest.mark.parametrize("flags, message", [
    (["--k", "8"], "error: k: 8 is not in [1, num_samples=4]"),
    (["--k", "0"], "error: k: 0 is not in [1, num_samples=4]"),
    (["--num_samples", "0"], "error: num_samples: must be in [1, inf)"),
    (["--num_bootstrap", "-1"], "error: num_bootstrap: must be in [0, inf)"),
    (["--confidence", "1"], "error: confidence: must be in (0, 1)"),
    (["--temperature", "0"], "error: temperature: must be in (0, inf)"),
    (["--model_name_or_path", "/nonexistent/model"], "error: model_name_or_path: /nonexistent/model does not exist"),
    (["--reward_fn", "nope.py:score"], "error: reward_fn: file nope.py does not exist"),
    (["--eval_split", "validation"], "error: built-in task has splits 'train' and 'test', not 'validation'"),
    (["--eval_num_prompts", "0"], "error: eval_num_prompts: must be in [1, inf)"),  # was the whole split
    (["--num_prompts", "4"], "error: --num_prompts: --eval_num_prompts names evaluate.py's prompt count now"),
    (["--split", "train"], "error: --split: --eval_split names evaluate.py's split now"),
])
def test_bad_flags_are_one_line_errors_and_write_nothing(tmp_path, monkeypatch, capsys, flags, message):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(tmp_path / "out", monkeypatch, capsys, "--generator", "hf", *flags)
    assert code == 2 and err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_resuming_with_other_settings_is_an_error_that_changes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    flags = ["--generator", "hf", "--eval_num_prompts", "4", "--num_samples", "2", "--k", "1", "--num_bootstrap", "10"]
    assert run_in_process(out, monkeypatch, capsys, *flags)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, err = run_in_process(out, monkeypatch, capsys, *flags, "--temperature", "0.5", "--eval_num_prompts", "5")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: output_dir: {out} holds an evaluation with other settings: --eval_num_prompts 4 (now 5), "
                          "--temperature 1.0 (now 0.5)"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


VLLM_RESUME = ["--eval_num_prompts", "10", "--chunk_size", "3"]
RANKS = {g: ["--generator", g, "--eval_num_prompts", "70", "--num_samples", "2", "--k", "1", "2", "--chunk_size", "16"]
         for g in ("hf", "vllm")}


def grpo_then_evaluate(work: Path, generator: str) -> dict[str, list[str]]:
    """grpo.py's run (70 held-out prompts: two HF chunks), then evaluate.py on its final checkpoint, same settings."""
    run = work / f"grpo_{generator}"
    return {f"grpo_{generator}": ["algorithms/grpo.py", "--output_dir", str(run), "--generator", generator,
                                  "--total_episodes", "64", "--local_num_prompts", "4", "--num_generations", "4",
                                  "--local_micro_batch_size", "8", "--eval_num_prompts", "70", "--eval_num_samples",
                                  "4", "--eval_every", "0", "--dev_num_prompts", "8", "--sample_every", "0",
                                  "--save_every", "0", "--seed", "3"],
            f"grpo_eval_{generator}": ["algorithms/evaluate.py", "--output_dir", str(work / f"grpo_eval_{generator}"),
                                       "--model_name_or_path", str(run / "final"), "--generator", generator,
                                       "--eval_num_prompts", "70", "--num_samples", "4", "--temperature", "1.0", "--k",
                                       "4", "--seed", "3"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The end-to-end command lines of the slow tests below, one after another in one Python process
    (tests/test_e2e.py run_batch: each as `python algorithms/<script>.py ...` runs it, with its own log and exit
    status; the resumed runs after the ones they resume), then the 2-process ones in one `accelerate launch` pair;
    name -> (result, output_dir)."""
    from tests.test_e2e import run_batch

    work = tmp_path_factory.mktemp("evaluate_runs")
    # the stopped run's files, copied before the resumed run finishes them
    (work / "snapshot.py").write_text("import shutil, sys\nshutil.copytree(sys.argv[1], sys.argv[2])\n")
    ev = lambda name, *flags: ["algorithms/evaluate.py", "--output_dir", str(work / name), *flags]  # noqa: E731
    plan = {"vllm_straight": ev("vllm_straight", *VLLM_RESUME),
            "vllm_stopped": ev("vllm_resumed", *VLLM_RESUME, "--stop_after_prompts", "4"),
            "vllm_snapshot": [str(work / "snapshot.py"), str(work / "vllm_resumed"), str(work / "vllm_stopped")],
            "vllm_resumed": ev("vllm_resumed", *VLLM_RESUME),
            **{f"one_{g}": ev(f"one_{g}", *flags) for g, flags in RANKS.items()},
            **grpo_then_evaluate(work, "vllm"), **grpo_then_evaluate(work, "hf")}
    results = run_batch(plan, work / "batch")
    two = {f"two_{g}": ev(f"two_{g}", *flags) for g, flags in RANKS.items()}
    results.update(run_batch(two, work / "batch_two", ranks=2, launcher=(
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero0.yaml")))
    return {name: (results[name], work / name) for name in {**plan, **two}}


def finished(runs: dict, name: str) -> tuple[Path, str]:
    from tests.test_e2e import check_batch_run

    result, out = runs[name]
    return out, check_batch_run(result)  # exit status 0 (every rank), a clean exit; the run's output


@pytest.mark.slow
def test_evaluate_vllm_end_to_end_and_resume(runs):
    """vLLM: an evaluation stopped after some prompts, then resumed, writes the files of an uninterrupted one."""
    straight, _ = finished(runs, "vllm_straight")
    check_outputs(straight, 10, 4, [1, 4])
    finished(runs, "vllm_snapshot")  # the stopped run's files copied to vllm_stopped/ before the resumed run
    stopped, log = finished(runs, "vllm_stopped")
    assert "stopped: 6 of 10 prompts done" in log  # two calls of 3 prompts
    assert len(read_jsonl(stopped / "completions.rank0.jsonl")) == 6
    resumed, log = finished(runs, "vllm_resumed")
    assert "4 to generate (6 done before)" in log
    for name in ("completions.jsonl", "summary.json"):
        a, b = ((d / name).read_text() for d in (straight, resumed))
        assert a.replace("straight", "resumed") == b, name


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["hf", "vllm"])
def test_two_ranks_equal_one_rank(runs, generator):
    """accelerate launch, 2 CPU processes: each rank generates its share of the calls, rank 0 merges; the files are
    those of one process."""
    one, _ = finished(runs, f"one_{generator}")
    two, _ = finished(runs, f"two_{generator}")
    assert (one / "completions.jsonl").read_text() == (two / "completions.jsonl").read_text()
    one, two = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert one["metrics"] == two["metrics"] and one["ci"] == two["ci"]


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["vllm", "hf"])
def test_a_grpo_runs_last_held_out_numbers_equal_evaluate_on_its_final_checkpoint(runs, generator):
    """The key property: grpo.py's final eval/accuracy and eval/pass@4 (70 held-out prompts: two HF chunks) equal
    evaluate.py's on output_dir/final with the same settings, exactly."""
    run, _ = finished(runs, f"grpo_{generator}")
    last = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/accuracy" in r][-1]
    out, _ = finished(runs, f"grpo_eval_{generator}")
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert metrics["eval/accuracy"] == last["eval/accuracy"]
    assert metrics["eval/pass@4"] == last["eval/pass@4"]


def test_a_changed_model_is_named_in_the_resume_error(tmp_path, monkeypatch, capsys):
    import shutil

    from shared.models import resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny-sft"), model)
    out = tmp_path / "out"
    flags = ["--model_name_or_path", str(model), "--generator", "hf", "--eval_num_prompts", "2", "--num_samples", "1",
             "--k", "1", "--num_bootstrap", "0", "--no_greedy"]
    assert run_in_process(out, monkeypatch, capsys, *flags)[0] == 0
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())  # retrained in place
    code, err = run_in_process(out, monkeypatch, capsys, *flags)
    assert code == 2 and err == (f"error: output_dir: {out} holds an evaluation with other settings: the weight files "
                                 f"of {model} changed; rerun with its settings, or use another --output_dir\n"), err
