"""opd.py's teachers: MOPD (--teachers, --teacher_column: each row's teacher, every teacher vocabulary-checked, an
unknown row an error at start-up) and on-policy self-distillation (--self_distillation, --teacher_context reference:
a frozen copy of the start model reading the gold answer in its prompt, scored on the student's own completion
tokens). Hand-computed numbers, the reference implementations' definitions transcribed (OPSD's teacher log-probs,
TRL's teacher_id routing), and short runs of the script on the built-in models."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from algorithms.opd import (Args, align_completions, distribution_losses, main, parse_teachers, select_teacher,
                            teacher_prompt_text, teacher_routes, validate)
from tests.test_opd import swapped_vocabulary_teacher

ROOT = Path(__file__).resolve().parents[1]


# ---- the references' definitions, transcribed -------------------------------------------------------------------
def opsd_teacher_logprobs(model, teacher_prompt: list[int], completion: list[int], temperature: float):
    """siyan-zhao/OPSD opsd_trainer.py compute_loss (use_thinking_machines_loss): the teacher's forward on
    [teacher prompt][generation], logits[:, teacher_prompt_len - 1 : -1] / T, log_softmax, gathered at the sampled
    token ids (the student's generation). One unpadded row here."""
    ids = torch.tensor([teacher_prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(teacher_prompt) - 1 : -1, :]
    return torch.gather(F.log_softmax(logits / temperature, -1), -1, ids[:, len(teacher_prompt):, None])[0, :, 0]


def trl_resolve_teacher(row: dict, teachers: dict) -> str:
    """trl AsyncDistillationTrainer's _resolve_teacher_server_url: one teacher scores every row; with several,
    row["teacher_id"] selects, and a missing or unmapped id raises (no silent misroute)."""
    if len(teachers) == 1:
        return next(iter(teachers))
    teacher_id = row.get("teacher_id")
    if teacher_id not in teachers:
        raise KeyError(teacher_id)
    return teacher_id


# ---- pure functions ---------------------------------------------------------------------------------------------
def test_parse_teachers():
    assert parse_teachers((), "builtin:tiny-grpo") == {"default": "builtin:tiny-grpo"}
    assert parse_teachers(("math=org/a", "code=x=y"), "ignored") == {"math": "org/a", "code": "x=y"}
    for bad, msg in ((("math",), "expected name=path"), (("=org/a",), "expected name=path"),
                     (("a=p", "a=q"), "given twice")):
        with pytest.raises(ValueError, match=f"^teachers: .*{msg}"):
            parse_teachers(bad, "")


def test_rows_route_to_their_teacher_as_trl_routes_them():
    rows = [{"teacher_id": "code"}, {"teacher_id": "math"}, {"teacher_id": "code"}]
    names = ["math", "code"]
    assert teacher_routes(rows, "teacher_id", names, "x") == [1, 0, 1]
    assert [names[k] for k in teacher_routes(rows, "teacher_id", names, "x")] == \
        [trl_resolve_teacher(r, dict.fromkeys(names)) for r in rows]
    assert teacher_routes([{}, {}], "teacher_id", ["only"], "x") == [0, 0]  # one teacher: no column needed
    assert trl_resolve_teacher({}, {"only": None}) == "only"
    with pytest.raises(ValueError, match=r"^teacher_column: the split row 1 names teacher 'chem', not one of "
                                         r"--teachers \(math, code\)$"):
        teacher_routes([{"teacher_id": "math"}, {"teacher_id": "chem"}], "teacher_id", names, "the split")
    with pytest.raises(ValueError, match="^teacher_column: the split row 0 has no column 'domain'"):
        teacher_routes([{"teacher_id": "math"}], "domain", names, "the split")


def test_select_teacher_by_hand():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    b = -a
    assert select_teacher([a, b], torch.tensor([1, 0, 1])).tolist() == [[-1.0, -2.0], [3.0, 4.0], [-5.0, -6.0]]
    assert torch.equal(select_teacher([a], torch.zeros(3, dtype=torch.long)), a)  # one teacher: its values exactly


def test_teacher_prompt_holds_the_answer_and_ends_with_the_students_prompt():
    text = teacher_prompt_text("7+5=", "12", Args().teacher_template)
    assert text == "Here is a reference solution:\n12\n\n7+5=" and text.endswith("7+5=")
    assert teacher_prompt_text("{x} 1+1=", "2", "{answer}|{prompt}") == "2|{x} 1+1="  # braces in the text kept


def test_align_completions_by_hand():
    # teacher rows: prompts of 3 and 2 tokens; student rows: 1 and 4; completions of 2 and 1 tokens
    src = torch.tensor([[0.0, 0.0, -1.0, -2.0, 0.0], [0.0, -3.0, 0.0, 0.0, 0.0]])
    like = torch.zeros(2, 4)
    out = align_completions(src, [3, 2], [1, 4], [2, 1], like)
    assert out.tolist() == [[-1.0, -2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -3.0]]


def test_teacher_logprobs_on_the_students_tokens_equal_opsds_definition(tiny_model):
    """The script's path (pad_batch, batch_logprobs, align_completions) against OPSD's per-row teacher log-probs:
    the privileged teacher's log-probs land on exactly the student's completion tokens, nowhere else."""
    from shared.data import pad_batch
    from shared.logprobs import batch_logprobs

    model, tok = tiny_model
    enc = lambda s: [tok.bos_token_id] + tok(s, add_special_tokens=False).input_ids  # noqa: E731
    prompts = [enc("7+5="), enc("1+2+3=")]
    completions = [tok("12", add_special_tokens=False).input_ids + [tok.eos_token_id],
                   tok("3\n6", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    t_prompts = [enc(teacher_prompt_text("7+5=", "12", Args().teacher_template)),
                 enc(teacher_prompt_text("1+2+3=", "6", Args().teacher_template))]
    T = 0.7
    ids, attn, resp = pad_batch(prompts, completions, tok.pad_token_id)
    t_ids, t_attn, t_resp = pad_batch(t_prompts, completions, tok.pad_token_id)
    assert not torch.equal(ids[0, : len(t_prompts[0])], t_ids[0, : len(t_prompts[0])])  # different prompts
    (teacher_logp,) = batch_logprobs([model], t_ids, t_attn, t_resp, t_attn.sum(1).tolist(), 1, "padded", T)
    like = torch.zeros_like(resp[:, 1:], dtype=torch.float32)
    got = align_completions(teacher_logp, [len(p) for p in t_prompts], [len(p) for p in prompts],
                            [len(c) for c in completions], like)
    mask = resp[:, 1:].bool()
    assert (got[~mask] == 0).all()
    for i in range(2):
        ref = opsd_teacher_logprobs(model, t_prompts[i], completions[i], T)
        torch.testing.assert_close(got[i][mask[i]], ref, atol=1e-5, rtol=1e-5)
        # the tokens scored are the student's: its row's completion columns hold exactly those ids
        assert ids[i, 1:][mask[i]].tolist() == completions[i]


@pytest.mark.parametrize("loss", ["jsd", "fkl_topk"])
def test_each_row_takes_its_own_teachers_distribution(tiny_model, loss):
    """MOPD with --loss jsd / fkl_topk: two teachers routed by row give each row the divergence, and the student the
    gradient, that the row's own teacher alone gives it (the rows computed one teacher at a time)."""
    from transformers import LlamaForCausalLM

    from shared.data import pad_batch

    student = tiny_model[0]
    teachers = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        teachers.append(LlamaForCausalLM(student.config).requires_grad_(False))
    ids, attn, resp = pad_batch([[1, 40, 41], [1, 42], [1, 43, 44]], [[43, 44, 2], [45, 46, 47, 2], [48, 2]], 2)
    routes = torch.tensor([1, 0, 1])
    student.zero_grad()
    div, logp, _, _ = distribution_losses(student, teachers, routes, ids, attn, resp, 0.8, None, loss, 0.3, 3, True,
                                          chunk_size=4)
    div.sum().backward()
    mixed = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
    expected, grad = torch.zeros_like(div), 0
    for k, teacher in enumerate(teachers):
        rows = (routes == k).nonzero().flatten()
        student.zero_grad()
        d = distribution_losses(student, [teacher], torch.zeros(len(rows), dtype=torch.long), ids[rows], attn[rows],
                                resp[rows], 0.8, None, loss, 0.3, 3, True)[0]
        d.sum().backward()
        expected[rows] = d.detach()
        grad = grad + torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None])
    torch.testing.assert_close(div.detach(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mixed, grad, atol=1e-6, rtol=1e-5)
    assert expected[routes == 0].abs().sum() > 0 and expected[routes == 1].abs().sum() > 0


def test_bad_flag_combinations_are_one_line_errors():
    for kwargs, msg in (({"teachers": ("a=x",), "self_distillation": True}, "^self_distillation: "),
                        ({"teacher_context": "reference", "loss": "fkl_topk"}, "^teacher_context: "),
                        ({"teacher_context": "reference", "teacher_template": "{prompt}"}, r"^teacher_template: has no \{answer\}"),
                        ({"teacher_context": "reference", "teacher_template": "{answer}"}, r"^teacher_template: has no \{prompt\}")):
        with pytest.raises(ValueError, match=msg):
            validate(Args(**kwargs))


# ---- the script on the built-in models --------------------------------------------------------------------------
SMALL = dict(local_num_prompts=4, num_generations=4, local_micro_batch_size=16, max_new_tokens=8, total_episodes=32,
             eval_every=0, eval_num_prompts=4, eval_num_samples=2, dev_num_prompts=0, best_metric="", generator="hf",
             save_model=False, reward_fn="builtin")


def routed_dataset(path: Path, names: list[str], n: int = 40) -> Path:
    """n built-in prompts, row i routed to names[i % len(names)] through a `teacher_id` column."""
    from shared.data import load_rows

    rows = load_rows("builtin", "train")[:n]
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"],
                                        "teacher_id": names[i % len(names)]}) + "\n" for i, r in enumerate(rows)))
    return path


def step_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "opd/teacher_kl" in r]


def test_mopd_two_teachers_each_row_its_own(tmp_path):
    """tiny-sft taught by tiny-grpo on half the rows and by tiny-sft (itself) on the other half: at step 1 the
    self-taught rows' advantage is 0 (their teacher is the start model), the others' is not; each has half the rows."""
    data = routed_dataset(tmp_path / "routed.jsonl", ["grpo", "sft"])
    main(Args(output_dir=str(tmp_path / "run"), dataset=str(data), teachers=("grpo=builtin:tiny-grpo",
                                                                             "sft=builtin:tiny-sft"), **SMALL))
    first = step_rows(tmp_path / "run")[0]
    assert abs(first["opd/teacher_kl/sft"]) < 1e-6 and first["opd/teacher_kl/grpo"] > 0.01
    assert 0 < first["opd/teacher_token_frac/grpo"] < 1
    assert first["opd/teacher_token_frac/grpo"] + first["opd/teacher_token_frac/sft"] == pytest.approx(1)


def test_mopd_with_the_full_distribution_loss(tmp_path):
    """--loss jsd with two routed teachers: two steps train (a finite divergence), each teacher's share of the rows is
    logged, and the self-taught rows' teacher is the start model (its reverse KL there 0 at step 1)."""
    data = routed_dataset(tmp_path / "routed.jsonl", ["grpo", "sft"])
    main(Args(output_dir=str(tmp_path / "run"), dataset=str(data), loss="jsd",
              teachers=("grpo=builtin:tiny-grpo", "sft=builtin:tiny-sft"), **SMALL))
    rows = step_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["opd/teacher_token_frac/grpo"] < 1 for r in rows)
    assert abs(rows[0]["opd/teacher_kl/sft"]) < 1e-6 and rows[0]["opd/teacher_kl/grpo"] > 0.01
    assert all(math.isfinite(r["loss/divergence_avg"]) and r["loss/divergence_avg"] > 0 for r in rows)


def test_a_row_naming_an_unknown_teacher_stops_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    """The script's command line (shared/cli.py's run_cli, in this process): one `error:` line naming the file's row,
    exit status 2, nothing written."""
    from algorithms.opd import run_cli

    data = routed_dataset(tmp_path / "routed.jsonl", ["grpo", "sft", "chem"], n=12)
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["opd.py", "--dataset", str(data), "--output_dir", str(out), "--teachers",
                                      "grpo=builtin:tiny-grpo", "sft=builtin:tiny-sft", "--generator", "hf",
                                      "--reward_fn", "builtin"])
    with pytest.raises(SystemExit) as stop:
        run_cli(main, Args)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: teacher_column: dataset {str(data)!r} split 'train' row 2 names teacher 'chem', not "
                     "one of --teachers (grpo, sft)"]
    assert not out.exists()


def test_every_teacher_passes_the_vocabulary_check(tmp_path):
    """The second of two teachers has two token ids exchanged: the single teacher's check, naming that teacher."""
    teacher = swapped_vocabulary_teacher(tmp_path / "teacher")
    data = routed_dataset(tmp_path / "routed.jsonl", ["grpo", "odd"], n=12)
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=r"^teachers odd: token 'a' has id \d+ in the teacher's vocabulary"):
        main(Args(output_dir=str(out), dataset=str(data), teachers=("grpo=builtin:tiny-grpo", f"odd={teacher}"),
                  **SMALL))
    assert not out.exists()


def test_self_distillation_teacher_reads_the_answer_the_student_never_does(tmp_path, monkeypatch):
    """--self_distillation --teacher_context reference: the sampler gets the student's prompts only; the frozen start
    model scores the same completion tokens after its privileged prompt, so it disagrees with the student (without
    the context it agrees: A = 0 on every token)."""
    import algorithms.opd as opd

    seen = []
    real = opd.make_generator

    def spy(*args, **kwargs):
        gen = real(*args, **kwargs)
        generate = gen.generate
        gen.generate = lambda prompts, *a, **k: seen.extend(prompts) or generate(prompts, *a, **k)
        return gen
    monkeypatch.setattr(opd, "make_generator", spy)
    main(Args(output_dir=str(tmp_path / "sd"), self_distillation=True, teacher_context="reference", **SMALL))
    from shared.distributed import load_tokenizer
    from shared.models import resolve_model_path

    tok = load_tokenizer(resolve_model_path("builtin:tiny-sft"))
    texts = {tok.decode(p) for p in seen}
    assert seen and not any("reference" in t for t in texts)
    first = step_rows(tmp_path / "sd")[0]
    assert first["opd/teacher_kl"] > 0.01 and first["opd/adv_min"] < 0
    main(Args(output_dir=str(tmp_path / "plain"), self_distillation=True, **SMALL))
    assert all(r["opd/teacher_kl"] == 0 and r["opd/adv_abs_mean"] == 0 for r in step_rows(tmp_path / "plain"))


@pytest.mark.slow
def test_two_processes_under_zero3_two_teachers_reading_the_reference(tmp_path):
    """accelerate launch, 2 processes, ZeRO-3 (the policy and both teachers partitioned), MOPD with the reference
    answer in the teachers' prompts: 2 steps, the per-teacher metrics reduced over ranks, identical weights at the end."""
    from tests.test_e2e import metrics
    from tests.test_reliability import launch

    data = routed_dataset(tmp_path / "routed.jsonl", ["grpo", "sft"])
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
            "algorithms/opd.py", "--output_dir", str(tmp_path / "run"), "--dataset", str(data), "--reward_fn",
            "builtin", "--teachers", "grpo=builtin:tiny-grpo", "sft=builtin:tiny-sft", "--teacher_context",
            "reference", "--local_num_prompts", "2", "--num_generations", "4", "--local_micro_batch_size", "8",
            "--max_new_tokens", "8", "--total_episodes", "32", "--eval_every", "0", "--eval_num_prompts", "4",
            "--eval_num_samples", "1", "--dev_num_prompts", "0", "--best_metric", "", "--generator", "hf",
            "--no_save_model"], 600)
    rows = metrics(tmp_path / "run")
    steps = [r for r in rows if "opd/teacher_kl" in r]
    assert len(steps) == 2
    assert all(r["opd/teacher_token_frac/grpo"] + r["opd/teacher_token_frac/sft"] == pytest.approx(1) for r in steps)
    assert steps[0]["opd/teacher_kl/sft"] > 0.01  # the start model reading the answer disagrees with itself
    assert rows[-1]["check/world_size"] == 2.0 and rows[-1]["check/ranks_identical_weights"] == 1.0
