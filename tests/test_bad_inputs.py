"""Bad inputs that used to run to a silent wrong result (exit 0) or end in a traceback: each is now a one-line error
naming the row, flag or file (a ValueError, which shared/cli.py's run_cli prints as `error: ...`, exit status 2), raised
before the run writes anything where the input is known at start-up, or is handled as documented beside it.
Unit-level where the check is a function; a few in-process start-ups of a script where the order matters."""

import json
import math
import shutil

import pytest
import torch
import tyro

from shared import data as data_utils
from shared.generation import HFGenerator, VLLMGenerator, check_context, completion_decoder, make_generator
from shared.models import resolve_model_path
from shared.rewards import FLOAT32_MAX, check_labels, compute_rewards, load_reward_fn


def _lines(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# ---------------------------------------------------------------- reward functions
def test_a_reward_beyond_float32_is_a_one_line_error():
    """1e39 is finite in Python but inf in the trainer's float32 tensors: every update was skipped by the NaN guard."""
    fn = lambda completions, **_: [1e39] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match=r"value 0 is 1e\+39, beyond float32's range"):
        compute_rewards(fn, ["p"], ["c"], ["a"], [True], [{}])
    edge = lambda completions, **_: [FLOAT32_MAX, -FLOAT32_MAX]  # noqa: E731
    assert compute_rewards(edge, ["p"] * 2, ["c"] * 2, ["a"] * 2, [True] * 2, [{}] * 2) == [FLOAT32_MAX, -FLOAT32_MAX]


def test_eval_num_prompts_0_is_refused_by_the_training_scripts():
    """0 used to evaluate the whole eval split at every evaluation (the sampler reads 0 as no limit)."""
    from algorithms.grpo import Args
    from shared.prompts import load_prompt_task
    from shared.tiny import builtin_tiny
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="^eval_num_prompts: 0 would evaluate the whole eval split"):
        load_prompt_task(Args(eval_num_prompts=0), AutoTokenizer.from_pretrained(builtin_tiny()))


def test_numpy_reward_values_are_numbers():
    """A list of np.float32 values (no Python float subclass) was refused as "expected a finite number"."""
    import numpy as np

    fn = lambda completions, **_: [np.float32(1.0), np.int64(0)]  # noqa: E731
    assert compute_rewards(fn, ["p"] * 2, ["c"] * 2, ["a"] * 2, [True] * 2, [{}] * 2) == [1.0, 0.0]


def test_an_empty_answer_key_with_a_grader_is_an_error_at_start_up(tmp_path):
    """`--answer_key ""` gave rows without a gold answer: the probe passed (it reads .get) and the grader failed at the
    first rollout, after the run had written its files."""
    from types import SimpleNamespace

    from shared.prompts import load_prompt_task

    path = tmp_path / "d.jsonl"
    path.write_text(_lines(*[{"prompt": "1+2=", "gold": "3"}] * 2))
    args = SimpleNamespace(dataset=str(path), train_split="train", eval_split="test", prompt_key="prompt",
                           answer_key="", prompt_template="{prompt}", chat_template=False, max_prompt_length=64,
                           eval_num_prompts=2, dev_num_prompts=0, reward_fn="builtin", best_metric="")
    with pytest.raises(ValueError, match=r"^answer_key: empty, but the reward function grades"):
        load_prompt_task(args, _tok())


@pytest.mark.parametrize("source, message", [
    ("def score(completions, **kw)\n    return [0.0]\n", r"importing .*bad\.py raised SyntaxError: expected ':' \(bad\.py, line 1\)"),
    ("import nonexistent_package_xyz\n", r"importing .*bad\.py raised ModuleNotFoundError: No module named "
                                         r"'nonexistent_package_xyz'"),
])
def test_a_reward_file_that_fails_to_import_is_a_one_line_error(tmp_path, source, message):
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    with pytest.raises(ValueError, match="^reward_fn: " + message) as error:
        load_reward_fn(f"{bad}:score")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="^reward_fn: importing nonexistent_module_xyz raised ModuleNotFoundError"):
        load_reward_fn("nonexistent_module_xyz:score")


def test_outcome_labels_must_be_0_or_1():
    check_labels([0.0, 1.0, 1, 0], lambda: None)
    with pytest.raises(ValueError, match=r"reward_fn half: returned 0\.5; the labels .* must be 0 or 1"):
        check_labels([1.0, 0.5], type("F", (), {"__name__": "half"})())


@pytest.mark.parametrize("script", ["prime", "genrm", "implicit_prm"])
def test_a_grader_that_is_not_0_1_is_refused_before_anything_is_written(tmp_path, script):
    """prime.py's PRM, implicit_prm.py and genrm.py train a cross-entropy on the grader's value: 0.5 or -1 trained
    on nothing meaningful (exit 0). Now the start-up probe refuses it (and prime/implicit_prm check every batch)."""
    import importlib

    mod = importlib.import_module(f"algorithms.{script}")
    bad = tmp_path / "partial.py"
    bad.write_text("def partial(completions, **kw):\n    return [0.5] * len(completions)\n")
    out = tmp_path / "out"
    args = tyro.cli(mod.Args, args=["--output_dir", str(out), "--reward_fn", f"{bad}:partial", "--generator", "hf"],
                    use_underscores=True)
    with pytest.raises(ValueError, match=r"reward_fn partial: returned 0\.5; the labels this script trains on must be"):
        mod.main(args)
    assert not out.exists()


# ---------------------------------------------------------------- data files
def test_a_nan_gold_answer_is_an_error_naming_the_row(tmp_path):
    """json reads NaN; it was turned into the gold answer "nan" (every completion graded against it)."""
    path = tmp_path / "d.jsonl"
    path.write_text(_lines({"prompt": "1+2=", "answer": "3"}, '{"prompt": "1+1=", "answer": NaN}'))
    with pytest.raises(ValueError, match=r"row 1: field 'answer' is nan, expected text or a finite number"):
        data_utils.load_prompts(str(path), "train", _tok())
    path.write_text(_lines({"prompt": "1+2=", "answer": 3}))  # a finite number is still its text
    assert data_utils.load_prompts(str(path), "train", _tok()).rows[0]["answer"] == "3"


def test_a_lone_surrogate_is_an_error_naming_the_row_and_field(tmp_path):
    """A JSON "\\ud800" escape: the tokenizer raised a TypeError traceback."""
    path = tmp_path / "d.jsonl"
    path.write_text(_lines({"prompt": "1+2=", "answer": "3"}, '{"prompt": "1+1=\\ud800", "answer": "2"}'))
    with pytest.raises(ValueError, match=r"d\.jsonl: row 1: field 'prompt' holds a lone surrogate \('\\ud800'\)"):
        data_utils.load_prompts(str(path), "train", _tok())
    from algorithms import genrm

    path.write_text(_lines({"prompt": "1+1=", "completion": "2", "label": 1},
                           '{"prompt": "1+1=", "completion": "\\udfff", "label": 0}'))
    with pytest.raises(ValueError, match=r"row 2: field 'completion' holds a lone surrogate"):
        genrm.read_labelled(str(path))


@pytest.mark.parametrize("name", ["missing.csv", "./missing_dir", "runs/x/data"])
def test_a_missing_local_dataset_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch, name):
    """A path that does not exist was sent to the hub: a ConnectionError traceback, or the hub's repo-id rules."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"dataset '{name}' does not exist"):
        data_utils.load_rows(name, "train")


def test_a_missing_data_path_is_a_one_line_error(tmp_path):
    """genrm.py opened it directly: a FileNotFoundError traceback; implicit_prm.py reads it with load_rows."""
    from algorithms import genrm, implicit_prm

    with pytest.raises(ValueError, match=r"^data_path: .*nope\.jsonl does not exist$"):
        genrm.read_labelled(str(tmp_path / "nope.jsonl"))
    args = tyro.cli(implicit_prm.Args, args=["--data_path", str(tmp_path / "nope.jsonl")], use_underscores=True)
    with pytest.raises(ValueError, match=r"nope\.jsonl does not exist"):
        implicit_prm.load_labelled(args.data_path, "train", _tok(), args)


def test_labelled_rows_get_eos_only_when_finished_and_long_rows_are_dropped(tmp_path):
    """A --data_path response that was cut off (`"finished": false`) has no EOS, as a sampled one that hit
    max_new_tokens; rows over --max_seq_length are dropped and counted (they had no limit: out of memory)."""
    from algorithms import genrm, implicit_prm

    tok = _tok()
    eos = tok.eos_token_id
    assert data_utils.encode_response(tok, "12")[-1] == eos
    assert eos not in data_utils.encode_response(tok, "12", finished=False)
    path = tmp_path / "l.jsonl"
    path.write_text(_lines({"prompt": "1+1=", "response": "2", "label": 1},
                           {"prompt": "1+2=", "response": "3\n4", "label": 0, "finished": False},
                           {"prompt": "1+3=", "response": "4" * 40, "label": 0}))
    args = tyro.cli(implicit_prm.Args, args=["--data_path", str(path), "--max_seq_length", "20",
                                             "--dev_num_prompts", "0"], use_underscores=True)
    rows = implicit_prm.load_labelled(str(path), "test", tok, args)
    assert rows["dropped"] == 1 and len(rows["response_ids"]) == 2
    assert rows["response_ids"][0][-1] == eos and eos not in rows["response_ids"][1]
    path.write_text(_lines({"prompt": "1+1=", "response": "2", "label": 1, "finished": "no"}))
    with pytest.raises(ValueError, match=r"row 0: field 'finished' is 'no', expected true or false"):
        implicit_prm.load_labelled(str(path), "test", tok, args)
    path.write_text(_lines({"prompt": "1+1=", "completion": "2", "label": 1, "finished": 0}))
    with pytest.raises(ValueError, match=r"row 1: field 'finished' must be true or false"):
        genrm.read_labelled(str(path))
    assert "max_seq_length" in {f for f in genrm.Args.__dataclass_fields__}


# ---------------------------------------------------------------- models
def test_a_model_directory_without_weights_is_a_one_line_error(tmp_path, tiny_path):
    """config.json alone passed the check; from_pretrained then raised an OSError traceback."""
    empty = tmp_path / "noweights"
    shutil.copytree(tiny_path, empty, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with pytest.raises(ValueError, match=r"^reward_model_path: .*noweights has no weights \(no \*\.safetensors or "):
        resolve_model_path(str(empty), "reward_model_path")
    assert resolve_model_path(tiny_path) == tiny_path


def test_an_implicit_prm_stores_its_local_reference_as_an_absolute_path(tmp_path, monkeypatch, tiny_path):
    """`--model_name_or_path m/sft` (relative, one slash) was stored as given: read from another directory it is a
    hub name. Now the absolute path is stored; built-in and hub names are kept as given."""
    from algorithms import implicit_prm

    model = tmp_path / "m" / "sft"
    shutil.copytree(tiny_path, model)
    data = tmp_path / "l.jsonl"
    data.write_text(_lines(*[{"prompt": f"{i}+1=", "response": str(i + 1), "label": i % 2} for i in range(8)]))
    monkeypatch.chdir(tmp_path)
    args = tyro.cli(implicit_prm.Args, args=["--model_name_or_path", "m/sft", "--data_path", str(data),
                                             "--output_dir", "out", "--total_episodes", "8",
                                             "--local_micro_batch_size", "8", "--dev_num_prompts", "0",
                                             "--best_metric", "", "--localisation_num_pairs", "0",
                                             "--save_every", "0"], use_underscores=True)
    implicit_prm.main(args)
    config = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    assert config["implicit_prm_reference"] == str(model)


# ---------------------------------------------------------------- generation
def test_an_empty_stop_string_is_a_one_line_error(tiny_model, tiny_path):
    """`--stop ""` (an unset shell variable) ended every completion at its first token and cut every text to ''."""
    model, tok = tiny_model
    with pytest.raises(ValueError, match=r"^stop: \('',\) holds an empty string"):
        completion_decoder(tok, ("",))
    with pytest.raises(ValueError, match=r"^stop: \('</a>', ''\) holds an empty string"):
        make_generator("hf", model_path=tiny_path, model=model, tokenizer=tok, dtype=torch.float32, seed=0,
                       max_model_len=64, world_size=1, zero_stage=0, stop=("</a>", ""))
    assert completion_decoder(tok, ("\n\n",))(tok("3\n6", add_special_tokens=False).input_ids) == "3\n6"


def test_prompts_beyond_the_model_s_context(tiny_model):
    """--generator hf: a prompt longer than max_position_embeddings (512) generated at positions the model never saw
    (exit 0); vLLM raised its VLLMValidationError traceback. Both now: a one-line error for a prompt that fills the
    context, and a completion that reaches its end stops there (finish_reason "length"), as vLLM did."""
    model, tok = tiny_model
    context = model.config.max_position_embeddings
    gen = HFGenerator(model, tok)
    kw = dict(n=1, temperature=1.0, top_p=1.0, seed=0)
    with pytest.raises(ValueError, match=rf"^max_prompt_length: prompt 1 of a generate call has {context} tokens, and "
                                         rf"the model's context is {context}: no room"):
        gen.generate([[tok.bos_token_id] * 4, [tok.bos_token_id] * context], max_new_tokens=4, **kw)
    near = [tok.bos_token_id] + tok("1+2=", add_special_tokens=False).input_ids * ((context - 6) // 4)
    out = gen.generate([near], max_new_tokens=32, **kw)[0][0]
    assert len(near) + len(out.token_ids) <= context and len(near) + 32 > context
    check_context([[1] * 511], 512)
    with pytest.raises(ValueError, match="prompt 0 of a generate call has 600 tokens"):
        check_context([[1] * 600], 512)
    engine = VLLMGenerator.__new__(VLLMGenerator)  # the check runs before the engine is touched
    engine.stop, engine.max_model_len = (), context
    with pytest.raises(ValueError, match=f"has {context + 88} tokens, and the model's context is {context}"):
        engine.generate([[1] * (context + 88)], max_new_tokens=4, **kw)


# ---------------------------------------------------------------- opd.py: a teacher whose embedding is padded
def test_opd_compares_the_real_vocabulary_of_padded_embeddings(tiny_model):
    """Qwen2.5's student and teacher embeddings are padded to different sizes (151,936 vs 152,064 rows): --loss jsd /
    fkl_topk raised a shape-mismatch traceback. They now compare the tokenizer's real tokens; a tokenizer larger than
    an embedding is refused."""
    import copy

    from algorithms.opd import compared_vocab_size, distribution_losses

    model, tok = tiny_model
    n = len(tok)
    assert compared_vocab_size(n, n, n) is None
    assert compared_vocab_size(151_936, 152_064, 151_665) == 151_665
    with pytest.raises(ValueError, match=r"^teacher_model_name_or_path: the tokenizer has 151665 tokens, but"):
        compared_vocab_size(151_000, 152_064, 151_665)
    teacher = copy.deepcopy(model)
    teacher.resize_token_embeddings(n + 28)
    ids = torch.tensor([tok("1+2+3=3\n", add_special_tokens=True).input_ids])
    attn = torch.ones_like(ids)
    response = torch.zeros_like(ids)
    response[:, 4:] = 1  # the completion tokens
    vocab = compared_vocab_size(model.config.vocab_size, teacher.config.vocab_size, n)
    for loss in ("jsd", "fkl_topk"):
        with torch.no_grad():
            divergence, logp, _, _ = distribution_losses(model, [teacher], torch.zeros(1), ids, attn, response, 1.0, vocab,
                                                         loss, 0.5, 4, False)
        assert torch.isfinite(divergence).all() and torch.isfinite(logp).all()
        with torch.no_grad():  # a teacher equal to the student: no divergence on the real tokens
            same, _, _, _ = distribution_losses(model, [model], torch.zeros(1), ids, attn, response, 1.0, vocab, loss, 0.5, 4,
                                             False)
        assert same.abs().max() < 1e-5


def _tok():
    from shared.tiny import build_tokenizer

    return build_tokenizer()


def test_an_empty_stop_string_is_refused_by_the_start_up_check_before_anything_is_written(tmp_path):
    """check_args (every script, before its Checkpointer or Tracker) refuses `--stop ""`: no output_dir is made."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "algorithms/grpo.py", "--output_dir", str(out), "--stop", ""],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: stop: ('',) holds an empty")
    assert not out.exists()
