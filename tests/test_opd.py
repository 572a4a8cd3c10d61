"""opd.py: the per-token teacher advantage and the fixed-negative-advantage control on hand-made log-probs; every
divergence on a 3-token vocabulary by hand and against a transcription of TRL's generalized_jsd_loss; no gradient
to the teacher; student == teacher gives zero; one temperature for both models; the vocabulary guard; EOS scored when
pad == eos; exact resume (tests/resume_runs.py, case `opd`); 2 steps on the real chat model."""

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from algorithms.opd import (Args, check_same_vocabulary, distribution_losses, generalized_jsd, main, opd_advantages,
                            topk_forward_kl)

ROOT = Path(__file__).resolve().parents[1]
P = [0.5, 0.3, 0.2]  # teacher nu over a 3-token vocabulary
Q = [0.2, 0.5, 0.3]  # student pi


def lp(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


# ---- the reference's definition, transcribed (TRL trl/experimental/gkd/gkd_trainer.py generalized_jsd_loss) ------
def trl_generalized_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    """Per position, before masking and reduction; F.kl_div(input, target, log_target=True) = KL(target || input)."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(m, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(m, s, reduction="none",
                                                                                           log_target=True)
    return jsd.sum(-1)


def test_advantage_is_teacher_minus_student_on_generated_tokens_only():
    student = torch.tensor([[0.0, -1.0, -0.5, -2.0, 0.0], [-0.3, -0.7, 0.0, 0.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[-9.0, -0.2, -1.5, -0.1, -4.0], [-0.3, -2.7, -5.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # prompt position, 3 generated tokens, padding
    adv = opd_advantages(teacher, student, mask)
    expected = torch.tensor([[0.0, -0.2 + 1.0, -1.5 + 0.5, -0.1 + 2.0, 0.0], [0.0, -2.7 + 0.7, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert not adv.requires_grad  # sg(): the advantage carries no gradient
    # the control arm: exactly -c on every generated token, 0 elsewhere, whatever the teacher says
    torch.testing.assert_close(opd_advantages(teacher, student, mask, control_adv=0.37), -0.37 * mask)


def test_divergences_on_a_three_token_vocabulary_by_hand():
    p, q = P, Q
    forward = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))  # KL(nu || pi)
    reverse = sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))  # KL(pi || nu)
    m = [0.5 * pi + 0.5 * qi for pi, qi in zip(p, q)]
    jsd = 0.5 * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m)) + 0.5 * sum(qi * math.log(qi / mi)
                                                                               for qi, mi in zip(q, m))
    assert generalized_jsd(lp(q), lp(p), 0.0).item() == pytest.approx(forward, rel=1e-12)
    assert generalized_jsd(lp(q), lp(p), 1.0).item() == pytest.approx(reverse, rel=1e-12)
    assert generalized_jsd(lp(q), lp(p), 0.5).item() == pytest.approx(jsd, rel=1e-12)
    # beta 0.9: M = 0.9 nu + 0.1 pi, weights as TRL's (0.9 on KL(nu || M))
    m9 = [0.9 * pi + 0.1 * qi for pi, qi in zip(p, q)]
    jsd9 = 0.9 * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m9)) + 0.1 * sum(qi * math.log(qi / mi)
                                                                                 for qi, mi in zip(q, m9))
    assert generalized_jsd(lp(q), lp(p), 0.9).item() == pytest.approx(jsd9, rel=1e-12)
    # the reference's definition on random logits, every beta, and at a temperature
    torch.manual_seed(0)
    s_logits, t_logits = torch.randn(4, 7, 11, dtype=torch.float64), torch.randn(4, 7, 11, dtype=torch.float64)
    for beta in (0.0, 0.25, 0.5, 1.0):
        for temp in (1.0, 0.7):
            ours = generalized_jsd(F.log_softmax(s_logits / temp, -1), F.log_softmax(t_logits / temp, -1), beta)
            torch.testing.assert_close(ours, trl_generalized_jsd(s_logits, t_logits, beta, temp))


def test_topk_forward_kl_with_its_clamp_and_tail_by_hand():
    p, q = P, Q  # TopK(nu), k = 2: tokens 0 and 1; P_k = 0.8, Q_k = 0.7
    head = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.5)
    loss, m = topk_forward_kl(lp(q), lp(p), 2)
    assert loss.item() == pytest.approx(head, rel=1e-12) and head > 0
    assert m["teacher_mass"].item() == pytest.approx(0.8) and m["student_mass"].item() == pytest.approx(0.7)
    assert m["overlap_ratio"].item() == pytest.approx(0.5)  # the student's top 2 are tokens 1 and 2
    tail, _ = topk_forward_kl(lp(q), lp(p), 2, tail=True)
    assert tail.item() == pytest.approx(head + 0.2 * math.log(0.2 / 0.3), rel=1e-12)
    # a student with more mass than the teacher on the top-k: the head is negative, clamped at 0; the tail variant
    # (unclamped head + tail) is the KL of the coarse-grained distributions, between 0 and the full KL
    q2 = [0.6, 0.35, 0.05]
    head2 = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.35)
    assert head2 < 0 and topk_forward_kl(lp(q2), lp(p), 2)[0].item() == 0.0
    coarse = head2 + 0.2 * math.log(0.2 / 0.05)
    assert topk_forward_kl(lp(q2), lp(p), 2, tail=True)[0].item() == pytest.approx(coarse, rel=1e-12)
    full = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q2))
    assert 0 <= coarse <= full
    # k = the vocabulary: the forward KL itself, no tail left
    assert topk_forward_kl(lp(q), lp(p), 3, tail=True)[0].item() == pytest.approx(generalized_jsd(lp(q), lp(p), 0.0)
                                                                                  .item(), rel=1e-9)


def test_student_equal_to_teacher_gives_zero_advantage_and_loss():
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 13)
    s = F.log_softmax(logits, -1)
    mask = torch.ones(3, 5)
    assert opd_advantages(s.max(-1).values, s.max(-1).values, mask).abs().max() == 0
    for beta in (0.0, 0.5, 1.0):
        assert generalized_jsd(s, s.clone(), beta).abs().max() < 1e-6
    for tail in (False, True):
        assert topk_forward_kl(s, s.clone(), 4, tail)[0].abs().max() < 1e-6


def test_teacher_gets_no_gradient_and_both_models_use_one_temperature(tiny_model):
    """The script's code path: the teacher frozen as the script freezes it (shared.distributed.prepare_frozen), its
    log-probs (sampled tokens and whole distributions) taken at the rollout temperature, as the student's."""
    from transformers import LlamaForCausalLM

    from shared.distributed import DistInfo, prepare_frozen
    from shared.logprobs import batch_logprobs, micro_batch_logprobs

    student, tok = tiny_model
    student = LlamaForCausalLM(student.config)
    student.load_state_dict(tiny_model[0].state_dict())
    torch.manual_seed(3)
    teacher = prepare_frozen(LlamaForCausalLM(student.config), DistInfo(0, 1, 0, torch.device("cpu"), 0, {}),
                             torch.float32)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    from shared.data import pad_batch

    eos = tok.eos_token_id  # padded with EOS (pad == eos): the masks come from lengths, the real EOS is kept
    ids, attn, resp = pad_batch([[1, 40, 41], [1, 42]], [[43, 44, eos], [45, eos]], eos)
    mask = resp[:, 1:].float()
    T = 0.7
    old_logp, teacher_logp = batch_logprobs([student, teacher], ids, attn, resp, attn.sum(1).tolist(), 1, "padded", T)
    # both at T: log_softmax(logits / T) of each model, gathered at the sampled tokens
    for model, got in ((student, old_logp), (teacher, teacher_logp)):
        with torch.no_grad():
            ref = F.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1] / T, -1)
        torch.testing.assert_close(got, ref.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask, atol=1e-5, rtol=1e-5)
    # each completion's EOS is its last generated token, in the mask and scored; the EOS-valued padding is not
    assert mask[0].tolist() == [0, 0, 1, 1, 1] and mask[1].tolist() == [0, 1, 1, 0, 0]
    adv = opd_advantages(teacher_logp, old_logp, mask)
    assert adv[0, 4] != 0 and adv[1, 2] != 0  # the EOS positions
    # the pg loss and the jsd loss backpropagate into the student only
    logp, _ = micro_batch_logprobs(student, ids, attn, resp, "padded", T)
    divergence = distribution_losses(student, [teacher], torch.zeros(2), ids, attn, resp, T, None, "jsd", 0.5, 4, False)[0]
    loss = -(torch.exp(logp - old_logp) * adv * mask).sum() + (divergence * mask).sum()
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


def whole_distribution_reference(student, teacher, ids, attn, resp, T, loss, vocab_size=None):
    """The unchunked form: both models' log_softmax(logits / T) at every position [B, L-1, V], the divergence,
    log pi of the next token and the entropy there, kept at the completion positions."""
    lps = [F.log_softmax(m(input_ids=ids, attention_mask=attn).logits[:, :-1, :vocab_size].float() / T, -1)
           for m in (student, teacher)]
    keep = resp[:, 1:].float()
    div = generalized_jsd(*lps, 0.3) if loss == "jsd" else topk_forward_kl(*lps, 3, True)[0]
    logp = lps[0].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return div * keep, logp * keep, -(lps[0].exp() * lps[0]).sum(-1) * keep


@pytest.mark.parametrize("loss", ["jsd", "fkl_topk"])
def test_the_chunked_full_distribution_losses_equal_the_whole_distribution_ones(tiny_model, loss):
    """--loss jsd / fkl_topk on completion positions, 2 at a time (checkpointed chunks): the divergence, log pi, the
    entropy and the student's gradient equal those of both models' whole [B, L-1, V] distributions to float
    precision; the teacher gets no gradient."""
    from transformers import LlamaForCausalLM

    from shared.data import pad_batch

    student = tiny_model[0]
    torch.manual_seed(5)
    teacher = LlamaForCausalLM(student.config).requires_grad_(False)
    ids, attn, resp = pad_batch([[1, 40, 41, 42, 43], [1, 42]], [[43, 44, 45], [45, 46, 47, 48, 2]], 2)
    T, V = 0.8, student.config.vocab_size - 3  # the compared vocabulary: the first V logits
    grads = []
    for chunked in (True, False):
        student.zero_grad()
        if chunked:
            div, logp, ent, masses = distribution_losses(student, [teacher], torch.zeros(2), ids, attn, resp, T, V, loss, 0.3,
                                                         3, True, chunk_size=2)
            assert set(masses) == ({"teacher_mass", "student_mass", "overlap_ratio"} if loss == "fkl_topk" else set())
        else:
            div, logp, ent = whole_distribution_reference(student, teacher, ids, attn, resp, T, loss, V)
        (div.sum() + 0.1 * logp.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]))
        outs = (div.detach(), logp.detach(), ent.detach())
        if chunked:
            first = outs
    for a, b in zip(first, outs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
    assert first[0].abs().sum() > 0 and all(p.grad is None for p in teacher.parameters())


def test_the_full_distribution_losses_take_logits_at_completion_positions_only(tiny_model):
    """Both LM heads run on the positions that predict a completion token, at most chunk_size rows at a time (and on
    the last position inside the models' forwards): never on the prompt's positions, never [B, L-1, V] at once."""
    from transformers import LlamaForCausalLM

    from shared.data import pad_batch

    student = tiny_model[0]
    teacher = LlamaForCausalLM(student.config).requires_grad_(False)
    ids, attn, resp = pad_batch([[1] + [40] * 20, [1, 42]], [[43, 44, 45], [45, 46, 47, 48, 2]], 2)
    rows = []
    hooks = [m.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(tuple(inp[0].shape[:-1])))
             for m in (student, teacher)]
    div = distribution_losses(student, [teacher], torch.zeros(2), ids, attn, resp, 1.0, None, "jsd", 0.5, 3, False,
                              chunk_size=3)[0]
    div.sum().backward()  # the recomputed chunks too
    for h in hooks:
        h.remove()
    n = int(resp[:, 1:].sum())  # 8 completion tokens
    assert all(r[-1] == 1 for r in rows if len(r) == 2)  # inside the forwards: the last position only
    chunks = [r[0] for r in rows if len(r) == 1]
    assert max(chunks) <= 3 and sum(chunks) == 4 * n  # both heads forward, and both again in the recompute


def test_every_log_prob_in_the_script_is_taken_at_the_rollout_temperature():
    """One temperature for student and teacher: each log-prob call in opd.py passes args.temperature."""
    src = (ROOT / "algorithms" / "opd.py").read_text()
    calls = re.findall(r"(?:batch_logprobs|micro_batch_logprobs|distribution_losses)\((?:[^()]|\([^()]*\))*\)", src)
    calls = [c for c in calls if "policy, teachers: list, row_teacher" not in c]  # the definition's signature
    # the pre-update forwards (the student's rows; the teachers' own rows with --teacher_context), training, jsd
    assert len(calls) == 4 and all("args.temperature" in c for c in calls), calls


def swapped_vocabulary_teacher(teacher: Path) -> Path:
    """A copy of builtin:tiny whose tokenizer has the ids of 'a' and 'b' exchanged (fails the vocabulary check)."""
    from shared.tiny import builtin_tiny

    teacher.mkdir()
    for f in builtin_tiny().iterdir():
        if f.is_file():
            (teacher / f.name).write_bytes(f.read_bytes())
    spec = json.loads((teacher / "tokenizer.json").read_text())
    v = spec["model"]["vocab"]
    v["a"], v["b"] = v["b"], v["a"]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    return teacher


def test_vocabulary_guard_names_the_first_difference(tmp_path):
    from shared.tiny import build_tokenizer

    student = build_tokenizer()
    check_same_vocabulary(student, build_tokenizer())  # the same tokenizer passes
    vocab = student.get_vocab()
    swapped = {**vocab, "a": vocab["b"], "b": vocab["a"]}  # same size, two ids exchanged
    fake = SimpleNamespace(get_vocab=lambda: swapped, bos_token_id=student.bos_token_id,
                           eos_token_id=student.eos_token_id, pad_token_id=student.pad_token_id)
    with pytest.raises(ValueError, match=r"^teacher_model_name_or_path: token 'a' has id \d+ in the teacher's"):
        check_same_vocabulary(student, fake)
    other_eos = SimpleNamespace(**{**vars(fake), "get_vocab": lambda: vocab, "eos_token_id": student.eos_token_id + 1})
    with pytest.raises(ValueError, match="^teacher_model_name_or_path: the teacher's eos_token_id is"):
        check_same_vocabulary(student, other_eos)
    # the script stops before writing anything: a teacher directory whose tokenizer has two ids exchanged
    teacher = swapped_vocabulary_teacher(tmp_path / "teacher")
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="token 'a' has id"):
        main(Args(output_dir=str(out), teacher_model_name_or_path=str(teacher), generator="hf"))
    assert not out.exists()


def launch(cmd, timeout=900):
    from tests.test_reliability import launch as run

    return run(cmd, timeout)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("opd_resume")
    launch([sys.executable, "tests/resume_runs.py", str(out), "opd"])
    return json.loads((out / "results.json").read_text())["opd"]


def test_stop_and_resume_equals_the_straight_run(resumed):
    """Every metric row and the final weights bit for bit (builtin:tiny-grpo teaching builtin:tiny-sft)."""
    r = resumed
    assert r["stopped_at"] >= 1 and r["rows_at_stop"] < r["n_rows"][1]
    assert r["rows_equal"], f"first differing row: {r['first_diff']}"
    assert r["weights_equal"] and r["finished"] and r["best"]


def test_opd_logs_its_metrics_and_the_teacher_disagrees(resumed):
    row = resumed["step_row"]
    for key in ("opd/teacher_kl", "opd/adv_mean", "opd/adv_min", "opd/adv_max", "loss/policy_avg"):
        assert key in row, key
    assert row["opd/teacher_kl"] > 0 and row["opd/adv_min"] < 0  # a stronger teacher: the student is far from it
    assert resumed["last_row"]["check/ranks_identical_weights"] == 1.0


@pytest.mark.slow
def test_two_processes_under_zero3_with_the_teacher_partitioned(tmp_path):
    """accelerate launch, 2 processes, ZeRO-3 (the policy and the frozen teacher partitioned), HF generation:
    the ranks see different prompts, score them with the gathered teacher and end with identical weights."""
    from tests.test_e2e import metrics

    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
            "algorithms/opd.py", "--output_dir", str(tmp_path), "--local_num_prompts", "4", "--num_generations", "4",
            "--local_micro_batch_size", "16", "--max_new_tokens", "8", "--total_episodes", "64", "--eval_every", "0",
            "--eval_num_prompts", "4", "--eval_num_samples", "2", "--dev_num_prompts", "0", "--best_metric", "",
            "--generator", "hf", "--no_save_model"])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "opd/teacher_kl" in r]
    assert len(steps) == 2 and all(r["opd/teacher_kl"] > 0 and r["opd/adv_min"] < 0 for r in steps)
    last = rows[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


@pytest.mark.real_model
@pytest.mark.slow
def test_two_steps_on_the_chat_model(tmp_path):
    """The chat model teaching itself: same tokenizer (pad == eos), so the advantage is 0 on every token."""
    from tests.test_e2e import metrics, run

    out = tmp_path / "opd"
    run([sys.executable, "algorithms/opd.py", "--output_dir", str(out), "--model_name_or_path", "builtin:smollm2-135m",
         "--teacher_model_name_or_path", "builtin:smollm2-135m", "--chat_template", "--dev_num_prompts", "0",
         "--learning_rate", "1e-5", "--max_new_tokens", "8", "--local_num_prompts", "2", "--num_generations", "2",
         "--local_micro_batch_size", "4", "--num_minibatches", "1", "--num_iterations", "1", "--total_episodes", "8",
         "--eval_num_prompts", "2", "--eval_num_samples", "1", "--eval_every", "0", "--generator", "hf",
         "--no_save_model", "--best_metric", ""], timeout=900)
    rows = [r for r in metrics(out) if "opd/teacher_kl" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["opd/teacher_kl"]) < 1e-4 and abs(r["opd/adv_max"]) < 1e-3 for r in rows)
