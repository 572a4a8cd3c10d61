"""Data loading, validation, tokenization (one BOS, EOS appended) and batching (masks), and bad dataset rows."""

import json

import pytest

from shared import data, task
from shared.data import DataError
from shared.rewards import load_reward_fn

DEFAULT_TEST_DIGEST = "1f807b51459b"  # sha256 of the default task's test rows (json), first 12 hex digits


# ---------------------------------------------------------------- built-in task
def test_builtin_splits_are_disjoint_and_deterministic():
    train, test = task.builtin_split("train"), task.builtin_split("test")
    assert len(test) == task.TEST_SIZE and len(train) == 10**task.NUM_TERMS - task.TEST_SIZE
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert task.builtin_split("test") == test


def test_builtin_sums_n_family_is_disjoint_deterministic_and_keeps_the_default():
    """`builtin:sums-N` has N-1 steps per response; `builtin` is `builtin:sums-4` row for row."""
    import hashlib
    import json

    from shared.data import load_rows

    def digest(rows):
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()

    for split in ("train", "test"):
        assert load_rows("builtin:sums-4", split) == load_rows("builtin", split) == task.builtin_split(split)
    # the default task's rows, pinned: its results and cached warm starts depend on them
    assert digest(task.builtin_split("test"))[:12] == DEFAULT_TEST_DIGEST
    for n, train_size in ((3, 500), (5, 10**5 - 500), (8, task.SAMPLED_TRAIN_SIZE)):
        train, test = load_rows(f"builtin:sums-{n}", "train"), load_rows(f"builtin:sums-{n}", "test")
        assert len(test) == task.TEST_SIZE and len(train) == train_size
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
        assert len({r["prompt"] for r in train}) == len(train)  # distinct problems
        assert load_rows(f"builtin:sums-{n}", "test") == test  # deterministic
        ex = test[0]
        digits = [int(d) for d in ex["prompt"].rstrip("=").split("+")]
        lines = ex["response"].split("\n")
        assert len(digits) == n and len(lines) == n - 1 and int(ex["answer"]) == sum(digits) == int(lines[-1])
        assert task.grade(ex["response"], ex["answer"]) == 1.0
        pairs = task.builtin_preferences("test", n)
        assert len(pairs) == (n - 1) * task.TEST_SIZE and {r["rejected_step"] for r in pairs} == set(range(n - 1))
    for bad in ("builtin:sums-2", "builtin:sums-13", "builtin:sum-8", "builtin:"):
        with pytest.raises(ValueError, match="not a built-in task"):
            load_rows(bad, "test")
    assert load_reward_fn("auto", "builtin:sums-8") is load_reward_fn("auto", "builtin")


def test_builtin_example_and_grader():
    ex = task.make_example((3, 4, 5, 1))
    assert ex == {"prompt": "3+4+5+1=", "response": "7\n12\n13", "answer": "13"}
    assert task.grade("7\n12\n13", "13") == 1.0
    assert task.grade("7\n12\n14", "13") == 0.0
    assert task.grade("7\n12\n13", "13", finished=False) == 0.0  # truncated: no reward
    assert task.grade("", "13") == 0.0
    assert task.step_boundaries("7\n12\n13") == [0, 1, 4, 7]


# ---------------------------------------------------------------- BOS / EOS: exactly one BOS, EOS appended
def test_exactly_one_bos_with_and_without_chat_template(tiny_model):
    _, tok = tiny_model
    bos = tok.bos_token_id
    plain = data.encode_prompt(tok, "1+2=", use_chat_template=False)
    chat = data.encode_prompt(tok, "1+2=", use_chat_template=True)  # the template itself emits BOS
    for ids in (plain, chat):
        assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(chat[1:]).startswith("<|user|>\n1+2=")
    # a prompt that already starts with the BOS text still ends up with one BOS
    assert data.encode_prompt(tok, "<bos>1+2=", use_chat_template=False).count(bos) == 1


def test_response_ends_with_one_eos_and_no_bos(tiny_model):
    _, tok = tiny_model
    ids = data.encode_response(tok, "7\n12")
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1 and tok.bos_token_id not in ids


def test_pad_batch_masks_come_from_lengths_even_when_pad_is_eos():
    eos = 2
    ids, attn, resp = data.pad_batch([[1, 5], [1, 5, 6]], [[7, eos], [8, 9, eos]], pad_id=eos)
    assert ids.tolist() == [[1, 5, 7, eos, eos, eos], [1, 5, 6, 8, 9, eos]]
    assert attn.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert resp.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    # exactly one EOS inside each response mask
    assert [(ids[i][resp[i].bool()] == eos).sum().item() for i in range(2)] == [1, 1]


# ---------------------------------------------------------------- bad input: one-line errors naming the row
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return str(p)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], r"row 1: missing key 'answer'"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "  ", "answer": "2"}], r"row 1: field 'prompt' is empty"),
    ([{"prompt": ["a"], "answer": "1"}], r"row 0: field 'prompt' is a list"),
])
def test_bad_rows_name_the_row_and_field(tmp_path, tiny_model, rows, message):
    _, tok = tiny_model
    path = _write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=message):  # a lone file is split (10% held out): the row is in one split
        for split in ("train", "test"):
            data.load_prompts(path, split, tok)


def test_malformed_jsonl_line_is_reported_with_its_number(tmp_path, tiny_model):
    path = _write(tmp_path, "d.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        data.load_prompts(path, "train", tiny_model[1])


def test_non_utf8_file_is_reported(tmp_path, tiny_model):
    path = _write(tmp_path, "d.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff\xfe", "answer": "2"}\n')
    with pytest.raises(DataError, match="line 2 is not valid UTF-8"):
        data.load_prompts(path, "train", tiny_model[1])


def test_empty_dataset_and_all_overlong_are_errors(tmp_path, tiny_model):
    _, tok = tiny_model
    with pytest.raises(DataError, match="no rows"):
        data.load_prompts(_write(tmp_path, "e.jsonl", "\n"), "train", tok)
    path = _write(tmp_path, "l.jsonl", json.dumps({"prompt": "x" * 50, "answer": "1"}))
    with pytest.raises(DataError, match="longer than max_prompt_length=10"):
        data.load_prompts(path, "train", tok, max_prompt_length=10)


def test_overlong_prompts_are_dropped_and_counted(tmp_path, tiny_model):
    _, tok = tiny_model
    rows = [{"q": "1+1=", "a": "2"}, {"q": "9" * 40, "a": "3"}, {"q": "2+2=", "a": 4}]
    path = _write(tmp_path, "d.json", json.dumps(rows))  # a JSON list, custom keys, a numeric answer
    out = data.load_prompts(path, "train", tok, prompt_key="q", answer_key="a", max_prompt_length=20)
    assert out.num_filtered == 1 and [r["answer"] for r in out.rows] == ["2", "4"]


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load_rows(str(tmp_path / "nope.jsonl"), "train")
    with pytest.raises(DataError, match="unsupported file type"):
        data.load_rows(_write(tmp_path, "d.csv", "a,b\n"), "train")


def test_parquet_and_split_sibling_files(tmp_path, tiny_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2=", "answer": "4"}]), tmp_path / "d.test.parquet")
    assert data.load_rows(str(tmp_path / "d.parquet"), "train")[0]["answer"] == "2"
    assert data.load_rows(str(tmp_path / "d.parquet"), "test")[0]["answer"] == "4"


def test_prompt_template():
    assert data.format_prompt("2+2", "[MATH_TASK] Problem:\n{prompt}\n\nSolution:") == \
        "[MATH_TASK] Problem:\n2+2\n\nSolution:"


# ---------------------------------------------------------------- sampler: order, ranks, resume
def test_prompt_sampler_epochs_and_resume():
    s = data.PromptSampler(10, seed=3)
    first = s.next_indices(10)
    assert sorted(first) == list(range(10))  # one epoch = a permutation, no repeats
    a = s.next_indices(4)
    state = s.state_dict()
    b = s.next_indices(9)  # crosses the epoch boundary
    s2 = data.PromptSampler(10, seed=3)
    s2.load_state_dict(state)
    assert s2.next_indices(9) == b and a != b[:4]
    assert data.PromptSampler(10, seed=3).next_indices(10) == first  # same on every rank


def test_reward_fn_loading_and_validation(tmp_path):
    from shared.rewards import compute_rewards, load_reward_fn

    fn = load_reward_fn("auto", "builtin")
    assert compute_rewards(fn, ["1+2+3+4="], ["3\n6\n10"], ["10"], [True], [{}]) == [1.0]
    p = tmp_path / "myreward.py"
    p.write_text("def short(prompts, completions, **kw):\n    return [1.0]\n"
                 "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
                 "def gold(prompts, completions, answers, rows, **kw):\n"
                 "    return [float(r['extra'] == a) for r, a in zip(rows, answers)]\n")
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        compute_rewards(load_reward_fn(f"{p}:short"), ["a", "b"], ["x", "y"], ["1", "2"], [True] * 2, [{}, {}])
    with pytest.raises(ValueError, match="value 0 is nan"):
        compute_rewards(load_reward_fn(f"{p}:nan"), ["a"], ["x"], ["1"], [True], [{}])
    # metadata pass-through: the reward function sees every dataset column
    assert compute_rewards(load_reward_fn(f"{p}:gold"), ["a"], ["x"], ["1"], [True], [{"extra": "1"}]) == [1.0]
    with pytest.raises(ValueError, match="reward_fn"):
        load_reward_fn("no_colon_here")
    with pytest.raises(ValueError, match="cannot infer"):
        load_reward_fn("auto", "some/dataset")


def test_reward_fn_any_parameter_names_positionally_or_some_names_by_keyword(tmp_path):
    """README: the five arguments are positional, so `def r(p, c, a, f, rows)` works (it raised a TypeError); a
    function taking some of the documented names gets just those; an impossible signature is a one-line error."""
    from shared.rewards import call_style, compute_rewards, load_reward_fn

    p = tmp_path / "mine.py"
    p.write_text("def short_names(p, c, a, f, rows):\n    return [float(x == y) for x, y in zip(c, a)]\n"
                 "def some(completions, answers):\n    return [float(x == y) for x, y in zip(completions, answers)]\n"
                 "def star(*args):\n    return [float(x == y) for x, y in zip(args[1], args[2])]\n"
                 "def bad(x):\n    return [0.0]\n"
                 "def extra(completions, answers, scale):\n    return [1.0]\n")
    args = (["q1", "q2"], ["7", "8"], ["7", "9"], [True, True], [{}, {}])
    for name in ("short_names", "some", "star"):
        assert compute_rewards(load_reward_fn(f"{p}:{name}"), *args) == [1.0, 0.0], name
    assert call_style(load_reward_fn(f"{p}:some")) == ("keywords", ("completions", "answers"))
    assert call_style(load_reward_fn(f"{p}:short_names"))[0] == "positional"
    for name in ("bad", "extra"):
        with pytest.raises(ValueError, match=f"reward_fn {name}: its parameters .* can take neither"):
            compute_rewards(load_reward_fn(f"{p}:{name}"), *args)


# ---------------------------------------------------------------- preference pairs (dpo.py, rm.py)
def test_builtin_preference_pairs_are_correct_vs_one_slip():
    rows = task.builtin_preferences("test")
    assert len(rows) == 3 * task.TEST_SIZE and len(task.builtin_preferences("train")) == 3 * (10**4 - task.TEST_SIZE)
    assert {r["prompt"] for r in rows} == {r["prompt"] for r in task.builtin_split("test")}  # same held-out problems
    for row in rows[:300]:
        assert task.grade(row["chosen"], row["answer"]) == 1.0 and task.grade(row["rejected"], row["answer"]) == 0.0
        good, bad = row["chosen"].split("\n"), row["rejected"].split("\n")
        k = row["rejected_step"]
        assert good[:k] == bad[:k] and good[k] != bad[k]  # the slip is at line k
        digits = [int(c) for c in row["prompt"].rstrip("=").split("+")]
        for j in range(k + 1, len(bad)):  # later lines continue correctly from the wrong value
            assert int(bad[j]) == int(bad[j - 1]) + digits[j + 1]
    assert task.builtin_preferences("test") == rows
    assert sorted({r["rejected_step"] for r in rows[:30]}) == [0, 1, 2]  # shuffled: the first pairs mix steps


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "chosen": "1", "rejected": "2"}, {"prompt": "b", "chosen": "1"}], r"row 1: missing key 'rejected'"),
    ([{"prompt": "a", "rejected": "2"}], r"row 0: missing key 'chosen'"),
    ([{"prompt": "a", "chosen": " ", "rejected": "2"}], r"row 0: field 'chosen' is empty"),
    ([{"prompt": "", "chosen": "1", "rejected": "2"}], r"row 0: field 'prompt' is empty"),
    ([{"prompt": "a", "chosen": 3, "rejected": "2"}], r"row 0: field 'chosen' is a int"),
    ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"}],
       "rejected": "2"}], r"row 0: 'chosen' and 'rejected' must both be text or both be conversations"),
    ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "1"}],
       "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "2"}]}],
     r"row 0: chosen and rejected conversations differ before the last reply"),
    ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant"}],
       "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "2"}]}],
     r"row 0: field 'chosen' message 1 is not"),
    ([{"prompt": "a", "chosen": "1", "rejected": "1"}], r"no usable pair \(1 with identical chosen and rejected"),
])
def test_bad_preference_rows_are_errors_naming_the_row(tmp_path, tiny_model, rows, message):
    _, tok = tiny_model
    path = _write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=message):
        data.load_preferences(path, "train", tok)


def test_identical_and_overlong_pairs_are_skipped_and_counted(tmp_path, tiny_model):
    _, tok = tiny_model
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "4"},
            {"prompt": "3+3=", "chosen": "6" * 80, "rejected": "5"}]
    out = data.load_preferences(_write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows)), "train", tok,
                                max_seq_length=40)
    assert len(out) == 1 and out.num_identical == 1 and out.num_too_long == 1
    assert out.chosen_ids[0] == data.encode_response(tok, "2") and out.prompt_ids[0] == data.encode_prompt(tok, "1+1=", False)


def test_conversational_pairs_use_the_chat_template(tmp_path, tiny_model):
    _, tok = tiny_model
    conv = [{"role": "user", "content": "1+1="}]
    rows = [{"chosen": conv + [{"role": "assistant", "content": "2"}],
             "rejected": conv + [{"role": "assistant", "content": "3"}]},
            {"prompt": conv, "chosen": [{"role": "assistant", "content": "2"}],
             "rejected": [{"role": "assistant", "content": "5"}]}]
    out = data.load_preferences(_write(tmp_path, "p.jsonl", "\n".join(json.dumps(r) for r in rows)), "train", tok)
    expected = data.encode_prompt(tok, "1+1=", use_chat_template=True)
    assert out.prompt_ids == [expected, expected]
    assert expected.count(tok.bos_token_id) == 1
    assert out.chosen_ids[0] == data.encode_response(tok, "2") and out.rejected_ids[1] == data.encode_response(tok, "5")


def test_a_single_file_without_split_files_holds_out_a_fixed_disjoint_slice(tmp_path, tiny_model, capsys):
    """Train and test of a lone file are disjoint (10% held out, at least 1), cover the file, do not depend on
    the call (seed, rank), and the split is said once on stderr; sibling split files switch it off."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    path = _write(tmp_path, "lone.jsonl", "\n".join(json.dumps(r) for r in rows))
    train, test = data.load_rows(path, "train"), data.load_rows(path, "test")
    assert (len(train), len(test)) == (27, 3)
    assert sorted(r["prompt"] for r in train + test) == sorted(r["prompt"] for r in rows)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert data.load_rows(path, "test") == test and data.load_rows(path, "validation") == test
    assert test != rows[-3:] and test != rows[:3]  # a shuffled slice, not the file's head or tail
    err = capsys.readouterr().err
    assert err.count("held out") == 1 and "3 of its 30 rows" in err
    prompts = data.load_prompts(path, "test", tiny_model[1])
    assert [r["prompt"] for r in prompts.rows] == [r["prompt"] for r in test]
    # a bad row is named by its number in the file, whichever split holds it
    bad = rows[:29] + [{"prompt": "  ", "answer": "1"}]
    path = _write(tmp_path, "bad.jsonl", "\n".join(json.dumps(r) for r in bad))
    split = "test" if 29 in data.load_rows(path, "test").numbers else "train"
    with pytest.raises(DataError, match="row 29: field 'prompt' is empty"):
        data.load_prompts(path, split, tiny_model[1])
    # with split files beside it, the file is read as given (and no split happens)
    _write(tmp_path, "lone.test.jsonl", json.dumps(rows[0]))
    assert data.load_rows(str(tmp_path / "lone.jsonl"), "train") == rows
    assert data.load_rows(str(tmp_path / "lone.jsonl"), "test") == rows[:1]


def test_a_tiny_file_is_used_for_both_with_a_warning(tmp_path, capsys):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(9)]
    path = _write(tmp_path, "small.jsonl", "\n".join(json.dumps(r) for r in rows))
    assert data.load_rows(path, "train") == data.load_rows(path, "test") == rows
    assert "9 rows (< 10)" in capsys.readouterr().err


def test_dev_slice_is_a_fixed_disjoint_part_of_the_train_split(tmp_path, tiny_model):
    """The dev slice (selects output_dir/best) comes out of the train split, min(num_dev, 10%) of it, never
    trained on, the same for every call; the held-out split is untouched."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(200)]
    path = _write(tmp_path, "d.train.jsonl", "\n".join(json.dumps(r) for r in rows))
    _write(tmp_path, "d.test.jsonl", "\n".join(json.dumps(r) for r in rows[:20]))
    path = str(tmp_path / "d.jsonl")
    tok = tiny_model[1]
    train = data.load_prompts(path, "train", tok, num_dev=100)
    dev = data.load_prompts(path, "train", tok, num_dev=100, part="dev")
    assert (len(train.rows), len(dev.rows)) == (180, 20)  # capped at 10% of the split
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in dev.rows}
    assert sorted(r["prompt"] for r in train.rows + dev.rows) == sorted(r["prompt"] for r in rows)
    assert [r["prompt"] for r in data.load_prompts(path, "train", tok, num_dev=100, part="dev").rows] == \
        [r["prompt"] for r in dev.rows]
    assert [r["prompt"] for r in dev.rows] != [r["prompt"] for r in rows[:20]]  # shuffled, not the head
    assert len(data.load_prompts(path, "train", tok, num_dev=5, part="dev").rows) == 5
    assert len(data.load_prompts(path, "train", tok).rows) == 200  # num_dev 0: no slice
    assert data.load_prompts(path, "train", tok, num_dev=0, part="dev").rows == []  # and an empty dev part
    assert len(data.load_preferences("builtin", "train", tok, num_dev=0, part="dev")) == 0
    assert len(data.load_prompts(path, "test", tok, num_dev=100).rows) == 18  # any split can be carved
    # under 10 rows: no dev slice at all
    small = _write(tmp_path, "s.train.jsonl", "\n".join(json.dumps(r) for r in rows[:9]))
    _write(tmp_path, "s.test.jsonl", json.dumps(rows[0]))
    assert data.load_prompts(str(tmp_path / "s.jsonl"), "train", tok, num_dev=100, part="dev").rows == []
    assert len(data.load_prompts(small.replace(".train", ""), "train", tok, num_dev=100).rows) == 9


def test_dev_slice_of_preference_pairs_keeps_a_prompts_pairs_together(tiny_model):
    """Builtin pairs: several pairs per problem. No dev prompt may have a pair in training."""
    tok = tiny_model[1]
    train = data.load_preferences("builtin", "train", tok, num_dev=50)
    dev = data.load_preferences("builtin", "train", tok, num_dev=50, part="dev")
    dev_prompts = {r["prompt"] for r in dev.rows}
    assert len(dev_prompts) == 50 and len(dev) > 50  # all pairs of 50 problems
    assert not dev_prompts & {r["prompt"] for r in train.rows}
    assert len(train) + len(dev) == len(data.load_preferences("builtin", "train", tok))


def test_eval_subset_is_a_fixed_sample_not_the_first_rows(tmp_path, tiny_model):
    """`limit` draws a fixed-seed sample (the same for every run and seed), kept in file order."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(100)]
    path = _write(tmp_path, "e.test.jsonl", "\n".join(json.dumps(r) for r in rows))
    _write(tmp_path, "e.train.jsonl", json.dumps(rows[0]))
    path = str(tmp_path / "e.jsonl")
    a = [int(r["answer"]) for r in data.load_prompts(path, "test", tiny_model[1], limit=10).rows]
    b = [int(r["answer"]) for r in data.load_prompts(path, "test", tiny_model[1], limit=10).rows]
    assert a == b == sorted(a) and len(set(a)) == 10 and a != list(range(1, 11))
    assert len(data.load_prompts(path, "test", tiny_model[1], limit=500).rows) == 100
    pairs = data.load_preferences("builtin", "test", tiny_model[1], limit=7)
    assert len(pairs) == 7 and pairs.rows != data.load_preferences("builtin", "test", tiny_model[1]).rows[:7]
