"""The benchmark scripts' pure helpers and CLIs (no timing, nothing launched; the scripts themselves are benchmarks)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path[:0] = [str(SCRIPTS), *(str(p) for p in sorted(SCRIPTS.iterdir()) if p.is_dir())]  # scripts/ and its kinds


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, next(SCRIPTS.glob(f"**/{name}.py")))  # scripts/<kind>/<name>.py
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bc = load("bench_common")


def test_summarize():
    assert bc.summarize([3.0, 1.0, 2.0, None]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert bc.summarize([]) == {"min": None, "median": None, "max": None, "n": 0}


def test_paired_ratios():
    assert bc.paired_ratios([1.0, 3.0], [2.0, 1.5]) == [0.5, 2.0]
    assert bc.paired_ratios([1.0, None], [0.0, 2.0]) == []  # division by zero and missing values are skipped
    with pytest.raises(ValueError):
        bc.paired_ratios([1.0], [1.0, 2.0])


def test_alternating_order():
    assert bc.alternating_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bc.alternating_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert bc.alternating_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_run_repeats_alternates_and_drops_a_failed_contender(capsys):
    calls = []

    def run_one(name, rep):
        calls.append((name, rep))
        if name == "b" and rep == 1:
            raise RuntimeError("child exited with status 1\ntraceback ...")
        return {"step_s": [float(rep)]}

    runs = bc.run_repeats(["a", "b", "c"], 4, run_one, lambda res: f"step {res['step_s'][0]}")
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("c", 2),
                     ("c", 3), ("a", 3)]  # b is not run again after failing in repeat 1
    assert runs["a"] == [{"step_s": [0.0]}, {"step_s": [1.0]}, {"step_s": [2.0]}, {"step_s": [3.0]}]
    assert runs["b"][0] == {"step_s": [0.0]} and "status 1" in runs["b"][1]["error"] and len(runs["b"]) == 2
    out = capsys.readouterr().out
    assert "b rep 1: FAILED (dropped from later repeats): child exited with status 1\n" in out
    assert "a rep 3: step 3.0 (" in out


@pytest.mark.parametrize("name", ["bench_generation", "bench_grpo", "bench_preference", "bench_vineppo"])
def test_gpu_mode_without_a_gpu_is_a_one_line_error(name, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--gpu: no CUDA device visible"):
        load(name).main(["--gpu", "--out", "/nonexistent/never_written"])


def test_step_times_from_rows_drops_warmup_and_divides_windows():
    rows = [{"step": 0, "time": 5.0, "eval/accuracy": 0.5},  # not a step row
            {"step": 1, "time": 10.0, "time/train": 1.0},  # warm-up: only the reference point
            {"step": 2, "time": 12.0, "time/train": 1.0},
            {"step": 3, "time": 13.5, "time/train": 1.0},
            {"step": 3, "time": 20.0, "eval/accuracy": 0.6}]
    assert bc.step_times_from_rows(rows) == [2.0, 1.5]
    windows = [{"step": 10, "time": 4.0, "time/train": 3.0}, {"step": 20, "time": 6.0, "time/train": 2.0}]
    assert bc.step_times_from_rows(windows) == [pytest.approx(0.2)]


def test_iteration_times():
    ends = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]  # 2 optimizer steps per iteration: iterations end at 2, 4, 8
    assert bc.iteration_times(ends, 2) == [2.0, 4.0]
    assert bc.iteration_times(ends, 1) == [1.0, 1.0, 1.0, 2.0, 2.0]


def test_table_and_fmt():
    text = bc.table([{"a": 1.23456, "b": None}, {"a": 12345.6, "b": "x"}], ["a", "b"])
    lines = text.splitlines()
    assert lines[0].startswith("| a") and "1.23" in lines[2] and "12346" in lines[3] and "-" in lines[2]


def test_child_env_puts_this_checkout_first():
    env = bc.child_env({"X": "1"})
    assert env["PYTHONPATH"].split(":")[0] == str(bc.ROOT) and env["X"] == "1"
    assert "RANK" not in env


@pytest.mark.parametrize("name", ["bench_grpo", "bench_preference", "bench_vineppo", "bench_generation"])
def test_cli_defaults(name):
    mod = load(name)
    full, quick, gpu = mod.parse_args([]), mod.parse_args(["--quick"]), mod.parse_args(["--gpu"])
    assert full.repeats >= 3 and quick.repeats == 1
    assert full.model.startswith("builtin:") and "Qwen" in gpu.model


@pytest.mark.parametrize("name", ["bench_grpo", "bench_preference", "bench_vineppo", "bench_generation"])
def test_smollm2_preset(name):
    """`--smollm2`: the real chat model at CPU-sized batches, explicit flags still win, >= 3 repeats for the report."""
    mod = load(name)
    a = mod.parse_args(["--smollm2"])
    assert a.model == "builtin:smollm2-135m" and a.repeats >= 3 and a.smollm2
    assert mod.parse_args(["--smollm2", "--model", "builtin:tiny-sft"]).model == "builtin:tiny-sft"
    if name == "bench_grpo":
        assert (a.batch, a.grad_accum, a.optimizer_steps_per_iteration, a.learning_rate) == (32, 1, 4, 1e-6)
    if name == "bench_preference":
        assert a.lr == {"dpo": 5e-7, "rm": 1e-5}  # a pretrained model gets the hub-model learning rates
        assert mod.parse_args([]).lr == {"dpo": 1e-4, "rm": 3e-4}


def test_grpo_batch_mapping_to_trl():
    a = load("bench_grpo").parse_args([])
    # 64 prompts x 8 = 512 completions, 2 minibatches of 256 = 1 micro-batch each, 2 passes -> 4 optimizer steps
    assert (a.batch, a.grad_accum, a.optimizer_steps_per_iteration) == (512, 1, 4)
    with pytest.raises(SystemExit):
        load("bench_grpo").parse_args(["--micro_batch_size", "100"])


def test_invocation_names_the_script_relative_to_the_repository():
    script = str(SCRIPTS / "experiments" / "compare_drca_ppo.py")
    assert bc.invocation([script, "--seeds", "1", "2", "--extra", "--lr", "1e-4"]) == \
        "python scripts/experiments/compare_drca_ppo.py --seeds 1 2 --extra --lr 1e-4"
    assert bc.invocation(["/elsewhere/x.py", "a b"]) == "python /elsewhere/x.py 'a b'"


def test_gpu_bench_without_a_gpu_is_a_one_line_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--gpu: no CUDA device visible"):
        load("gpu_bench").main(["--out", "/nonexistent/never_written"])


def test_gpu_bench_model_flops_by_hand():
    """6 x (layer matmul parameters) x tokens + 6 x head x response tokens + 6 x layers x hidden x seq x tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16 each, down 16x8 = 64+32+32+64+128+128+128 = 576
    layers, head = 2 * 576, 100 * 8
    b, s, p = 3, 10, 4
    expected = 6 * layers * b * s + 6 * head * b * (s - p) + 6 * 2 * 8 * s * b * s
    assert load("gpu_bench").model_flops_per_step(model, b, s, p) == expected


def test_gpu_bench_datasheet_peaks_and_junit_summary(tmp_path):
    gb = load("gpu_bench")
    assert gb.datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4 and gb.datasheet_peak("Some GPU") is None
    (tmp_path / "r.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="a"/>'
        '<testcase classname="tests.test_gpu" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="c"><skipped/></testcase></testsuite></testsuites>')
    s = gb.junit_summary(tmp_path / "r.xml")
    assert (s["passed"], s["failed"], s["skipped"]) == (1, 1, 1) and s["failed_tests"] == ["tests.test_gpu::b"]
    assert "error" in gb.junit_summary(tmp_path / "missing.xml")


def test_memory_estimate_by_hand():
    """24 bytes per trained parameter of training state, the larger of the step buffers and activations + logits."""
    from types import SimpleNamespace

    em = load("estimate_memory")
    cfg = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "vocab_size": 100, "tie_word_embeddings": True}
    P = em.shapes(cfg)["params"]
    # per layer 576 matmul weights + q/k/v biases (8 + 4 + 4) + two norms (16) = 608; embedding 800; final norm 8
    assert P == 2 * 608 + 800 + 8
    a = SimpleNamespace(seq_len=10, completion_len=6, num_completions=4, logits_chunk=512, beta=0.0,
                        gradient_checkpointing=True)
    e = em.estimate(cfg, a, 3, 0, True, engine=False)
    act = 2 * 3 * 10 * 8 * 2 + 2 * 3 * 10 * (9 * 8 + 3 * 16)
    logits = 3 * 4 * min(512, 3 * 6) * 100
    assert e["total_gb"] * 1e9 == pytest.approx(2 * P + 12 * P + 6 * P + max(4 * P, act + logits))
    with_engine = em.estimate(cfg, a, 3, 0, True, engine=True)
    kv = 4 * 10 * 2 * 2 * 4 * 2  # completions x seq x layers x (K, V) x kv_dim x 2 bytes
    assert with_engine["total_gb"] * 1e9 == pytest.approx(e["total_gb"] * 1e9 + 2 * P + kv)


def test_wall_minutes_count_every_invocation_of_a_resumed_run():
    """A run stopped at step 2 (its tracker at 157 s) and resumed (the tracker restarts) counts the first invocation's
    157 s beside the last invocation's wall time; a straight run counts only its own."""
    bh = load("bench_headline")
    resumed = [{"step": 0, "time": 21.6}, {"step": 1, "time": 90.0}, {"step": 2, "time": 157.0},
               {"step": 3, "time": 60.5}, {"step": 4, "time": 64.0}]
    assert bh.earlier_invocations_s(resumed) == 157.0
    assert bh.earlier_invocations_s(resumed[:3]) == 0.0
    assert bh.earlier_invocations_s([{"step": 0}, *resumed[:3], {"step": 3, "time": 10.0}, {"step": 4, "time": 5.0},
                                     {"step": 5, "time": 9.0}]) == 167.0  # stopped twice
    r = {"wall_s_this_invocation": 120.0, "wall_s_earlier_invocations": 157.0}
    assert bh.wall_minutes(r) == pytest.approx(277.0 / 60)
    assert bh.wall_minutes({"wall_s_this_invocation": 120.0}) == 2.0  # stored before the field existed


def test_headline_reuse_copies_stored_seeds_and_the_footnote_names_them(tmp_path, capsys, monkeypatch):
    """bench_headline.py --reuse FILE: the seeds the file stores are copied (marked with where they were measured),
    only the others run, the summary covers both and the footnotes name the copied runs; a file of other --flags or
    other start models, or not a summary, is a one-line error (exit 2)."""
    bh = load("bench_headline")
    import docs_tables

    def run(seed, start, final):
        return {"seed": seed, "command": f"python algorithms/ppo_rlhf.py --seed {seed}",
                "start": {"eval/reward": start, "eval/accuracy": 0.5}, "final": {"eval/reward": final,
                                                                                   "eval/accuracy": 0.6},
                "at_best": None, "best_step": None, "peak_rss_mb": 2048.0, "wall_s_this_invocation": 600.0,
                "loadavg_at_end": [2.0, 2.0, 2.0]}

    models = {"builtin:tiny-sft": {"weights_sha256": "895ca454" + "0" * 56, "expected": True}}
    stored = tmp_path / "cpu_1.json"
    stored.write_text(json.dumps({"env": {"git_commit": "1fb3a00", "time": "2026-11-28 07:00:00",
                                          "builtin_models": models}, "flags": "",
                                  "results": {"ppo_rlhf": bh.summarize("ppo_rlhf", {"1": run(1, 0.1, 0.5)}, "")}}))
    ran = []
    monkeypatch.setattr(bh, "run_one", lambda a, name, seed: ran.append((name, seed)) or run(seed, 0.1, 0.7))
    monkeypatch.setattr(bh.bc, "builtin_models", lambda cache: models)
    written = {}
    monkeypatch.setattr(bh.bc, "write_result", lambda name, out, *a, **k: written.update(out) or tmp_path / "o.json")
    monkeypatch.setattr(sys, "argv", ["bench_headline.py", "--algorithms", "ppo_rlhf", "--seeds", "1", "2",
                                      "--reuse", str(stored), "--out", str(tmp_path / "w")])
    bh.main()
    assert ran == [("ppo_rlhf", 2)]
    r = written["results"]["ppo_rlhf"]
    assert r["final"]["eval/reward"] == pytest.approx({"mean": 0.6, "min": 0.5, "max": 0.7, "n": 2})
    assert r["seeds"]["1"]["measured_in"] == {"file": "cpu_1.json", "git_commit": "1fb3a00",
                                              "time": "2026-11-28 07:00:00"}
    assert "measured_in" not in r["seeds"]["2"]
    written["env"].update(git_commit="abc1234")
    note = docs_tables._reused_note([r["seeds"]])  # the end of headline_runs' caption: it names the copied runs
    assert note == (" Copied with `--reuse`: ppo_rlhf.py seed 1 (measured in cpu_1.json, on the same start "
                    "models).")  # the file keeps the commit and time; a caption names none (docs_tables)
    assert "1fb3a00" not in note and "abc1234" not in note
    assert docs_tables._reused_note([{"2": r["seeds"]["2"]}]) == ""  # a run made here is not "copied"
    later = {**r["seeds"]["2"], "measured_in": {"file": "cpu_2.json", "git_commit": "2fb3a00", "time": "T2"}}
    assert docs_tables._reused_note([{"1": r["seeds"]["1"], "2": later}]) == (  # two earlier files: one sentence
        " Copied with `--reuse`: ppo_rlhf.py seed 1 (measured in cpu_1.json, on the same start models); ppo_rlhf.py "
        "seed 2 (measured in cpu_2.json, on the same start models).")
    assert docs_tables._spread3(bh.spread([0.5])) == "0.500 (1 seed)"  # a partial result says it is one run
    assert docs_tables._spread3(bh.spread([0.5, 0.7])) == "0.600 (0.500-0.700)"

    other = {"builtin:tiny-sft": {"weights_sha256": "ffff" * 16}}
    with pytest.raises(SystemExit) as e:
        bh.check_same_start_models(models, other)
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --reuse: the reused runs started from")
    bh.check_same_start_models(models, {})  # nothing built now: nothing to compare
    with pytest.raises(SystemExit) as e:
        bh.reused_runs(stored, ["ppo_rlhf"], "--lora_r 16")
    assert e.value.code == 2 and "its runs had --flags ''" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        bh.reused_runs(tmp_path / "bad.json", ["ppo_rlhf"], "")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --reuse ") and err.count("\n") == 1


def test_headline_curve_records_the_training_samples_before_each_evaluation():
    """bench_headline.py: grpo's evaluation at step s follows s batches; restem's follow whole iterations (its step 0
    row is the base, no samples yet), which is what docs/restem.md compares at."""
    bh = load("bench_headline")
    rows = [{"step": 0, "eval/accuracy": 0.5, "eval/pass@4": 0.9}, {"step": 3, "loss": 1.0},
            {"step": 10, "eval/accuracy": 0.6, "eval/pass@4": 0.9, "restem/iteration": 0},
            {"step": 20, "eval/accuracy": 0.7, "eval/pass@4": 0.95, "restem/iteration": 1, "best/step": 20}]
    keys = bh.METRICS["restem"]
    out = bh.summarize_run(rows, keys, "restem", {"num_prompts": 800, "num_samples_per_prompt": 8})
    assert [pt["samples"] for pt in out["curve"]] == [0, 6400, 12800]
    assert out["start"]["eval/accuracy"] == 0.5 and out["final"]["eval/accuracy"] == 0.7
    out = bh.summarize_run(rows, keys, "grpo", {"batch_size": 512})
    assert [pt["samples"] for pt in out["curve"]] == [0, 5120, 10240]
    assert "samples" not in bh.summarize_run(rows, keys)["curve"][0]  # without args.json: as before


def test_bench_async_pairs_each_async_variant_with_its_sync_run_and_renders_them():
    """--variants: the gain differences go to the sync run at the same settings (async1_iter1 - sync_iter1, not -
    sync), by hand; the docs table shows one row per run with its flags and differences."""
    import bench_async
    import docs_tables

    def run(start, final, stale=0.0):
        return {"start": {"eval/accuracy": start}, "final": {"eval/accuracy": final}, "staleness_mean": stale}

    def variant(flags, seeds):
        finals = [r["final"]["eval/accuracy"] for r in seeds.values()]
        spread = lambda xs: {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}  # noqa: E731
        return {"flags": flags, "seeds": seeds, "start": {"eval/accuracy": spread([0.5] * len(seeds))},
                "final": {"eval/accuracy": spread(finals)}, "staleness_mean": spread([1.0]), "minutes": spread([4.0]),
                "tis_clipfrac_mean": spread([0.0029]), "sampler_logprob_diff_mean": spread([0.048])}

    results = {"sync": variant("", {"1": run(0.5, 0.8), "2": run(0.5, 0.9)}),
               "sync_iter1": variant("--num_iterations 1", {"1": run(0.5, 0.7), "2": run(0.5, 0.6)}),
               "async1_iter1": variant("--async_steps 1 --num_iterations 1", {"1": run(0.5, 0.75), "2": run(0.5, 0.5)}),
               "async1_tis_mask": variant("--async_steps 1 --tis token_mask", {"2": run(0.5, 0.85)})}
    diffs = bench_async.gain_differences(results)
    assert diffs.keys() == {"async1_iter1_minus_sync_iter1_gain", "async1_tis_mask_minus_sync_gain"}
    assert diffs["async1_iter1_minus_sync_iter1_gain"] == pytest.approx({"1": 0.05, "2": -0.1})
    assert diffs["async1_tis_mask_minus_sync_gain"] == pytest.approx({"2": -0.05})
    text = docs_tables.async_bench({"learning": {**results, **diffs}, "env": {}, "command": "x"})
    row = next(line for line in text.splitlines() if line.startswith("| async1_iter1 |"))
    assert "+0.050 / -0.100 (vs sync_iter1; mean -0.025)" in row and "`--async_steps 1 --num_iterations 1`" in row
    assert "| 0.29% | 0.048 |" in row
    assert next(line for line in text.splitlines() if line.startswith("| sync |")).count("| - |") == 1


def test_git_commit_is_the_callers_when_set(monkeypatch):
    """A copy of the tree on another machine may carry a stale .git: the commit the caller names wins."""
    bc = load("bench_common")
    monkeypatch.setenv("CLEANRLHF_GIT_COMMIT", "1234abc")
    assert bc.git_commit() == "1234abc" and bc.environment()["git_commit"] == "1234abc"
    monkeypatch.delenv("CLEANRLHF_GIT_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True).stdout.strip()
    assert bc.git_commit() == (head or None)


def test_bench_mismatch_compares_each_variant_with_its_baseline_and_renders_it():
    """Each variant's final accuracy minus its baseline's, seed by seed over the seeds both ran (by hand), and one
    docs row per variant with its command, the difference and the mismatch diagnostics."""
    import bench_mismatch
    import docs_tables

    spread = lambda xs: {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}  # noqa: E731

    def variant(name, finals):
        script, flags, baseline = bench_mismatch.VARIANTS[name]
        seeds = {s: {"final": {"eval/accuracy": f}} for s, f in finals.items()}
        return {"script": script, "flags": flags, "baseline": baseline, "command": f"python algorithms/{script}.py "
                f"{flags}".strip(), "start": spread([0.5]), "final": spread(list(finals.values())),
                "val/sampler_kl_mean": spread([0.0012]), "val/tis_clipfrac_mean": spread([0.004]),
                "minutes": spread([5.0]), "seeds": seeds}

    results = {"async1": variant("async1", {"1": 0.80, "2": 0.70}),
               "async1_geo_mask": variant("async1_geo_mask", {"1": 0.75, "2": 0.72, "3": 0.9}),
               "maxrl": variant("maxrl", {"1": 0.9})}  # its baseline (sync) did not run: no difference
    diffs = bench_mismatch.versus_baseline(results)
    assert diffs.keys() == {"async1_geo_mask"}
    assert diffs["async1_geo_mask"] == pytest.approx({"1": -0.05, "2": 0.02})
    text = docs_tables.mismatch_bench({"variants": results, "final_minus_baseline": diffs, "command": "x"})
    row = next(line for line in text.splitlines() if line.startswith("| async1_geo_mask |"))
    assert "`python algorithms/grpo_async.py --tis geometric_mask --tis_cap 1.001`" in row
    assert "-0.050 / +0.020 (vs async1; mean -0.015)" in row and "| 0.0012 |" in row and "| 0.40% |" in row
    assert next(line for line in text.splitlines() if line.startswith("| maxrl |")).count("| - |") == 3


def test_bench_mismatch_reuse_copies_stored_rows_from_the_same_start_model_only(tmp_path, capsys):
    """--reuse FILE: the stored variants not run now are copied with where they were measured (kept through a second
    copy), the caption names it; another start model, or a file that is not a summary, is a one-line error, exit 2."""
    import bench_mismatch
    import docs_tables

    spread = lambda xs: {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs)}  # noqa: E731
    row = lambda f: {"baseline": None, "command": "python algorithms/grpo.py", "start": spread([0.5]),  # noqa: E731
                     "final": spread([f]), "minutes": spread([12.0]), "seeds": {"1": {"final": {"eval/accuracy": f}}}}
    models = {"builtin:tiny-sft": {"weights_sha256": "895ca454" + "0" * 56, "expected": True}}
    stored = tmp_path / "cpu_1.json"
    env = {"git_commit": "1fb3a00", "time": "2026-11-28 04:40:47", "builtin_models": models}
    stored.write_text(json.dumps({"env": env, "variants": {"sync": row(0.8), "maxrl": row(0.1)}}))
    reused = bench_mismatch.reused_variants(stored, ["maxrl"])
    assert list(reused) == ["sync"] and reused["sync"]["measured_in"]["file"] == "cpu_1.json"
    assert bench_mismatch.reused_variants(None, ["maxrl"]) == {}
    bench_mismatch.check_same_start_model(reused, models)
    again = tmp_path / "cpu_2.json"  # a summary that itself copied sync: sync keeps its first origin
    again.write_text(json.dumps({"env": {"git_commit": "2222222", "time": "t"}, "variants": reused}))
    assert bench_mismatch.reused_variants(again, [])["sync"]["measured_in"]["git_commit"] == "1fb3a00"

    maxrl = {**row(0.9), "baseline": "sync"}
    results = {"sync": reused["sync"], "maxrl": maxrl}
    d = {"variants": results, "final_minus_baseline": bench_mismatch.versus_baseline(results), "command": "x",
         "env": {"device": "CPU", "time": "2026-11-29", "git_commit": "abc1234"}}
    text = docs_tables.mismatch_bench(d)
    assert "+0.100 (vs sync; mean +0.100)" in text
    assert ("sync: measured in cpu_1.json on the same start model, copied with `--reuse`; the other rows and the file: "
            "`x`, CPU.") in text

    with pytest.raises(SystemExit) as e:
        bench_mismatch.check_same_start_model(reused, {"builtin:tiny-sft": {"weights_sha256": "ffff" * 16}})
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --reuse: variant sync was measured on")
    (tmp_path / "bad.json").write_text("{}")
    for path in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            bench_mismatch.reused_variants(path, [])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: --reuse {path}:") and err.count("\n") == 1


def test_bench_mismatch_real_model_renders_both_runs_step_by_step():
    """--real_model: one row per step with the sync and the async diagnostics side by side (the async run's first
    step is not stale yet: its numbers equal the sync run's); absolute run paths in the recorded command are shown
    from the repository root, the same on every machine."""
    import docs_tables

    sync = [{"step": 1, "val/sampler_kl": 2.29e-9, "val/sampler_logprob_diff": 1.84e-5, "val/tis_ratio_p99": 1.0,
             "val/tis_ratio_min": 0.99993, "val/tis_ratio_max": 1.0001, "val/tis_clipfrac": 0.0}]
    stale = [{**sync[0]}, {"step": 2, "val/sampler_kl": 8.32e-4, "val/tis_clipfrac": 3.56e-4}]
    d = {"command": "python scripts/experiments/bench_mismatch.py --real_model 1 --out /check/work/main/runs/bench/m",
         "env": {"device": "CPU", "time": "2026-11-27", "git_commit": "abc1234"},
         "real_model": {"grpo": {"command": "python algorithms/grpo.py --dataset /home/u/repo/runs/d.jsonl",
                                 "steps": sync}, "grpo_async": {"command": "x", "steps": stale}}}
    text = docs_tables.MACHINE_PATH.sub("runs/", docs_tables.mismatch_bench(d))
    assert "| 1 | 2.29e-09 | 2.29e-09 | 1.84e-05 | 1.84e-05 | 1 | 1 | 0.99993-1.0001 | 0.99993-1.0001 | 0% | 0% |" in text
    assert "--dataset runs/d.jsonl" in text and "--out runs/bench/m" in text and "/work" not in text
    assert docs_tables.MACHINE_PATH.sub("runs/", "see docs/runs/x and ./runs/y") == "see docs/runs/x and ./runs/y"
