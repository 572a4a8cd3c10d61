"""kto.py: the KTO loss, its reference point z0 and the mismatched pairs against hand-computed numbers and TRL's
definitions (trl 1.16.0 trl/trainer/kto_trainer.py: `_compute_loss` with loss_type="kto", the KL completions' rotation
in `_prepare_dataset`, transcribed below), TRL's unpaired prompt/completion/label rows and their bad rows, and two steps each on
self-generated, grader-labelled examples and on an unpaired file."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from algorithms.kto import Args, kl_partners, kto_loss, reference_point, unpair, validate, with_partners
from shared import data as data_utils

ROOT = Path(__file__).resolve().parents[1]


def trl_kto(chosen_logratios, rejected_logratios, kl, beta, desirable_weight, undesirable_weight):
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    return torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)


def test_kto_loss_hand_computed():
    """beta 0.5, z0 1: a desirable example with r = 3 loses 1 - sigmoid(1) = 0.2689, an undesirable one with r = 3
    loses 1 - sigmoid(-1) = 0.7311 (weighted by w_u = 2: 1.4621); z0 carries no gradient."""
    r = torch.tensor([3.0, 3.0], requires_grad=True)
    z0 = torch.tensor(1.0, requires_grad=True)
    loss = kto_loss(r, torch.tensor([True, False]), z0, 0.5, 1.0, 2.0)
    s = 1 / (1 + math.exp(-1))
    assert loss.tolist() == pytest.approx([1 - s, 2 * s])
    loss.sum().backward()
    assert z0.grad is None and r.grad.tolist() == pytest.approx([-0.5 * s * (1 - s), 2 * 0.5 * s * (1 - s)])


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.75)])
def test_kto_loss_equals_trl(weights):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(10, generator=g) * 2
    desirable = torch.tensor([True, False] * 5)
    for kl in (0.0, 0.4):
        ours = kto_loss(r, desirable, torch.tensor(kl), 0.1, *weights)
        trl = trl_kto(r[desirable], r[~desirable], kl, 0.1, *weights)
        assert torch.allclose(torch.cat((ours[desirable], ours[~desirable])), trl, atol=1e-7)


def test_reference_point_is_the_clamped_mean():
    """TRL: kl = (KL_logps - ref_KL_logps).mean(), gathered over ranks, .mean().clamp(min=0)."""
    assert reference_point(torch.tensor([0.5, 1.5, -0.5])).item() == pytest.approx(0.5)
    assert reference_point(torch.tensor([-0.5, -1.0])).item() == 0.0


def test_kl_partners_rotate_within_chunks_as_trl():
    """In the seeded order, each chunk of `chunk` examples is TRL's [y_n] + y[:-1]; no example is its own partner in a
    chunk of two or more; the same seed gives the same partners."""
    import random

    n, chunk, seed = 10, 4, 3
    partner = kl_partners(n, chunk, seed)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    for s in range(0, n, chunk):
        part = order[s : s + chunk]
        trl = [part[-1]] + part[:-1]  # examples["KL_completion_ids"] = [ids[-1]] + ids[:-1]
        assert [partner[i] for i in part] == trl
    assert all(partner[i] != i for i in range(n)) and partner == kl_partners(n, chunk, seed)


def test_unpair_gives_each_pair_a_desirable_and_an_undesirable_example():
    pairs = data_utils.PreferenceData([{"prompt": "a"}, {"prompt": "b"}], [[1], [2]], [[10], [20]], [[11], [21]])
    rows, prompts, completions, desirable = unpair(pairs)
    assert prompts == [[1], [2], [1], [2]] and completions == [[10], [20], [11], [21]]
    assert desirable == [True, True, False, False] and [r["prompt"] for r in rows] == ["a", "b", "a", "b"]


def test_a_micro_batch_of_one_is_refused():
    with pytest.raises(ValueError, match="^local_micro_batch_size: z0 needs at least 2"):
        validate(Args(local_micro_batch_size=1))


def test_two_steps_on_self_generated_examples(tmp_path):
    """The grader labels every sample (no pairs needed); two steps of 32 examples with their mismatched pairs: finite
    losses, z0 >= 0, both labels in the data, and the held-out pairs scored."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run([sys.executable, "algorithms/kto.py", "--output_dir", str(tmp_path), "--example_source",
                    "self_generated", "--num_generation_prompts", "16", "--num_generations", "4",
                    "--total_episodes", "64", "--local_micro_batch_size", "32", "--eval_every", "0",
                    "--eval_num_prompts", "8", "--eval_num_samples", "1", "--dev_num_prompts", "0",
                    "--eval_num_pairs", "16", "--generator", "hf", "--no_save_model", "--best_metric", ""],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/kto" in r]
    assert steps[-1]["step"] == 2 and all(math.isfinite(r["loss/kto"]) and r["kl"] >= 0 for r in steps)
    assert 0 < rows[0]["data/desirable_fraction"] < 1 and rows[0]["examples/num"] == 64
    assert any("eval/rewards/accuracies" in r for r in rows)
    assert (tmp_path / "checkpoints" / "self_generated_examples.pt").exists()


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_unpaired_rows_load_as_trl_unpaired_format(tmp_path, tiny_model):
    """Text and conversational rows (TRL's unpaired preference format), each label kept, an over-long row skipped
    and counted; with_partners gives each example another example's completion and keeps the labels."""
    _, tok = tiny_model
    conv = [{"role": "user", "content": "1+1="}]
    rows = [{"prompt": "2+2=", "completion": "4", "label": True}, {"prompt": "2+2=", "completion": "5", "label": False},
            {"prompt": conv, "completion": [{"role": "assistant", "content": "2"}], "label": True},
            {"prompt": "3+3=", "completion": "6" * 80, "label": False}]
    out = data_utils.load_unpaired(_jsonl(tmp_path / "u.jsonl", rows), "train", tok, max_seq_length=40)
    assert len(out) == 3 and out.num_too_long == 1 and out.desirable == [True, False, True]
    assert out.prompt_ids[0] == data_utils.encode_prompt(tok, "2+2=", False)
    assert out.prompt_ids[2] == data_utils.encode_prompt(tok, "1+1=", use_chat_template=True)
    assert out.completion_ids == [data_utils.encode_response(tok, t) for t in ("4", "5", "2")]
    d = with_partners(out, chunk=3, seed=0)
    assert d.chosen_ids == out.completion_ids and d.labels.tolist() == [True, False, True]
    assert sorted(map(tuple, d.rejected_ids)) == sorted(map(tuple, out.completion_ids))  # a rotation of them
    assert all(r != c for r, c in zip(d.rejected_ids, d.chosen_ids))


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": "1", "label": "yes"}], r"row 0: field 'label' is 'yes', expected true or false"),
    ([{"prompt": "a", "completion": "1", "label": 1}], r"row 0: field 'label' is 1, expected true or false"),
    ([{"prompt": "a", "completion": "1"}], r"row 0: missing key 'label'"),
    ([{"prompt": "a", "completion": " ", "label": True}], r"row 0: field 'completion' is empty"),
    ([{"prompt": "a", "completion": [{"role": "assistant", "content": "1"}], "label": True}],
     r"row 0: 'completion' is a conversation, so 'prompt' must be one too"),
    ([{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "1"}],
       "label": True}], r"row 0: the last message of 'completion' must be the assistant's"),
])
def test_bad_unpaired_rows_are_errors_naming_the_row(tmp_path, tiny_model, rows, message):
    _, tok = tiny_model
    with pytest.raises(data_utils.DataError, match=message):
        data_utils.load_unpaired(_jsonl(tmp_path / "u.jsonl", rows), "train", tok)


def _unpaired_split(split: str) -> list[dict]:
    """The built-in task's pairs as TRL's unpaired rows (chosen desirable, rejected not), without their answers."""
    from shared import task

    return [{"prompt": r["prompt"], "completion": c, "label": label} for r in task.builtin_preferences(split)
            for c, label in ((r["chosen"], True), (r["rejected"], False))]


def test_two_steps_on_an_unpaired_file(tmp_path):
    """An unpaired train/test file pair with no answers: two steps, the held-out and dev examples scored by KTO's
    loss and rewards, output_dir/best picked by the dev margin; a file of one label is a one-line error (exit 2)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    _jsonl(data_dir / "u.train.jsonl", _unpaired_split("train")[:400])
    _jsonl(data_dir / "u.test.jsonl", _unpaired_split("test")[:64])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "algorithms/kto.py", "--dataset", str(data_dir / "u.jsonl"), "--total_episodes", "64",
           "--local_micro_batch_size", "32", "--eval_every", "0", "--eval_num_pairs", "32", "--dev_num_prompts", "8",
           "--no_save_model"]
    run = subprocess.run(cmd + ["--output_dir", str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["data/train_examples"] == 400 - 2 * 8  # the dev prompts' examples (both labels) are held out
    steps = [r for r in rows if "loss/kto" in r]
    assert steps[-1]["step"] == 2 and all(math.isfinite(r["loss/kto"]) for r in steps)
    evals = [r for r in rows if "eval/loss/kto" in r]
    assert len(evals) == 2 and all(math.isfinite(r["eval/rewards/margins"]) and "dev/rewards/margins" in r
                                   for r in evals)
    assert 0 < evals[0]["eval/data/desirable_fraction"] < 1 and "eval/rewards/accuracies" not in evals[0]
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["metric"] == "dev/rewards/margins"
    _jsonl(data_dir / "v.train.jsonl", [r for r in _unpaired_split("train")[:100] if r["label"]])
    _jsonl(data_dir / "v.test.jsonl", _unpaired_split("test")[:8])
    bad = subprocess.run(cmd[:3] + [str(data_dir / "v.jsonl")] + cmd[4:] + ["--output_dir", str(tmp_path / "bad")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: dataset ")
    assert "KTO needs both" in bad.stderr and not (tmp_path / "bad" / "metrics.jsonl").exists()
    rows = _unpaired_split("train")[:100]  # one row without its label: that row is named, not a missing 'chosen'
    del rows[7]["label"]
    _jsonl(data_dir / "w.train.jsonl", rows)
    _jsonl(data_dir / "w.test.jsonl", _unpaired_split("test")[:8])
    bad = subprocess.run(cmd[:3] + [str(data_dir / "w.jsonl")] + cmd[4:] + ["--output_dir", str(tmp_path / "bad2")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "row 7: missing key 'label'" in bad.stderr.strip().splitlines()[-1]
