"""grpo_tools.py and shared/tools.py: multi-turn calculator episodes.

Unit tests drive shared/tools.py's ToolGenerator with a scripted engine (a "model" that writes a fixed text whatever
its context, stopping where a real engine would: at EOS, at a stop string, or at its budget), token by token on the
character tokenizer. The end-to-end tests share one run of tests/resume_runs.py's `grpo_tools` case (straight, and
stopped after 2 steps then resumed) and one 2-step run on builtin:smollm2-135m."""

import json
import sys
from pathlib import Path

import pytest
import torch

from shared import task
from shared.data import pad_batch
from shared.generation import Completion
from shared.tools import (ToolGenerator, calculate, chat_tool_turn, encode_segments, episode_metrics, model_token_mask,
                          observation, segments, tool_response)

ROOT = Path(__file__).resolve().parents[1]
EOS = "<eos>"


@pytest.fixture(scope="module")
def tok():
    from shared.tiny import build_tokenizer

    return build_tokenizer()


class ScriptedEngine:
    """Episode k (in call order, n = 1 per prompt) writes `texts[k]` (EOS where the text says `<eos>`), resuming
    where its last turn stopped; records every context it was given."""

    def __init__(self, tok, texts: list[str], prompt_len: int):
        self.tok, self.stop_token_ids, self.prompt_len, self.keys = tok, [tok.eos_token_id], prompt_len, {}
        self.streams = [tok(t.replace(EOS, ""), add_special_tokens=False).input_ids + ([tok.eos_token_id] if EOS in t
                                                                                     else []) for t in texts]
        self.pos, self.contexts, self.calls, self.stops = [0] * len(texts), [], 0, []

    def generate(self, prompts, n, temperature, top_p, max_new_tokens, seed, index_offset=0, stop=None):
        self.calls += 1
        self.stops.append(tuple(stop or ()))
        out = []
        for j, context in enumerate(prompts):
            k = self.keys.setdefault(tuple(context[: self.prompt_len]), len(self.keys))  # episodes by prompt
            budget = max_new_tokens[j] if isinstance(max_new_tokens, list) else max_new_tokens
            ids, reason = [], "length"
            while len(ids) < budget and self.pos[k] < len(self.streams[k]):
                ids.append(self.streams[k][self.pos[k]])
                self.pos[k] += 1
                text = self.tok.decode(ids, skip_special_tokens=True)
                if ids[-1] == self.tok.eos_token_id or any(text.endswith(s) for s in stop or ()):
                    reason = "stop"
                    break
            self.contexts.append(list(context))
            out.append([Completion(ids, [-0.5] * len(ids), reason)])
        return out


def run_episodes(tok, prompts: list[str], texts: list[str], max_tool_calls=8, max_new_tokens=128, turns="inline"):
    prompt_ids = [tok(p).input_ids for p in prompts]
    engine = ScriptedEngine(tok, texts, len(prompt_ids[0]))
    out = ToolGenerator(engine, tok, max_tool_calls, turns=turns).generate(prompt_ids, n=1, temperature=1.0, top_p=1.0,
                                                            max_new_tokens=max_new_tokens, seed=1)
    return engine, prompt_ids, [g[0] for g in out]


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_calculator_parses_integers_without_eval():
    assert [calculate(e) for e in ["3+4", "12*3-4", "2-10", "7", "10*10*10"]] == [7, 32, -8, 7, 1000]
    assert [calculate(e) for e in ["3+", "a+b", "", "3/4", "(3)", "3 + 4", "__import__('os')", "1" * 33]] == [None] * 8
    assert observation("<<3+4=") == ("7>>", True) and observation("\n<<12+5=") == ("17>>", True)


def test_a_scripted_three_call_episode_token_by_token(tok):
    """Mask 1 on every model token (`<<`, the expression, `=`, the newline, the answer, EOS), 0 on every `RESULT>>`
    token; the engine's ids appended verbatim, so every context it got is a prefix of prompt + response."""
    engine, (prompt,), (ep,) = run_episodes(tok, ["3+4+5+1="], ["<<3+4=\n<<7+5=\n<<12+1=\n13" + EOS])
    parts = [("<<3+4=", 1), ("7>>", 0), ("\n<<7+5=", 1), ("12>>", 0), ("\n<<12+1=", 1), ("13>>", 0), ("\n13", 1)]
    want_ids = [i for text, _ in parts for i in ids(tok, text)] + [tok.eos_token_id]
    want_mask = [m for text, m in parts for _ in ids(tok, text)] + [1]
    assert ep.token_ids == want_ids and ep.model_mask == want_mask
    assert [lp for lp, m in zip(ep.logprobs, ep.model_mask) if not m] == [0.0] * 11
    assert all(lp == -0.5 for lp, m in zip(ep.logprobs, ep.model_mask) if m)
    assert (ep.calls, ep.malformed, ep.turn_limited, ep.finished) == (3, 0, False, True)
    full = prompt + ep.token_ids
    assert engine.calls == 4 and all(full[: len(c)] == c for c in engine.contexts)
    assert tok.decode(ep.token_ids, skip_special_tokens=True) == "<<3+4=7>>\n<<7+5=12>>\n<<12+1=13>>\n13"
    # the task's grader, unchanged: the last line is the answer
    text = tok.decode(ep.token_ids, skip_special_tokens=True)
    assert task.grade(text, "13", ep.finished) == 1.0 and task.grade(text[:-2] + "14", "13", True) == 0.0
    # the loss mask of the padded batch: the episode's mask on its response positions, shifted like completion_mask
    _, _, resp = pad_batch([prompt, prompt[:3]], [ep.token_ids, [5, 6]], tok.pad_token_id)
    m = model_token_mask(resp, [ep.model_mask, [1, 1]])
    assert m[0, len(prompt):len(prompt) + len(want_mask)].tolist() == want_mask and m[0, :len(prompt)].sum() == 0
    assert m[1].tolist()[:5] == [0, 0, 0, 1, 1] and m[1, 5:].sum() == 0


def test_malformed_calls_get_err_and_are_counted(tok):
    long = "<<" + "1+" * 19 + "1="  # a 39-character expression
    _, _, (ep,) = run_episodes(tok, ["3+4="], ["<<3+=\n<<a+b=\n7=\n" + long + "\n7" + EOS])
    text = tok.decode(ep.token_ids, skip_special_tokens=True)
    assert text == "<<3+=ERR>>\n<<a+b=ERR>>\n7=ERR>>\n" + long + "ERR>>\n7"
    assert (ep.calls, ep.malformed, ep.finished) == (4, 4, True)
    m = episode_metrics([ep])
    assert (m["tools/malformed_frac"], m["tools/wellformed_frac"], m["tools/calls_per_episode"]) == (1.0, 0.0, 4.0)


def test_the_turn_limit(tok):
    """Past max_tool_calls an `=` is a model token: no observation, the episode goes on and is graded as written;
    0 runs no tool (one engine call, no `=` stop)."""
    script = "<<3+4=\n<<7+5=\n<<12+1=\n13" + EOS
    engine, _, (ep,) = run_episodes(tok, ["3+4+5+1="], [script], max_tool_calls=2)
    assert tok.decode(ep.token_ids, skip_special_tokens=True) == "<<3+4=7>>\n<<7+5=12>>\n<<12+1=\n13"
    assert ep.model_mask[-len(ids(tok, "\n<<12+1=\n13")) - 1:] == [1] * (len(ids(tok, "\n<<12+1=\n13")) + 1)
    assert (ep.calls, ep.turn_limited, ep.finished) == (2, True, True)
    assert engine.stops[-1] == ()  # the last round: no episode may call, no `=` stop
    engine, _, (ep,) = run_episodes(tok, ["3+4+5+1="], [script], max_tool_calls=0)
    assert engine.calls == 1 and engine.stops == [()] and ep.calls == 0 and sum(ep.model_mask) == len(ep.token_ids)
    assert tok.decode(ep.token_ids, skip_special_tokens=True) == script.replace(EOS, "")


def test_batched_rounds_and_length_metrics_count_model_tokens(tok):
    """Unfinished episodes generate together (one engine call per round); an observation that overflows the budget
    truncates; lengths count model tokens only."""
    engine, _, eps = run_episodes(tok, ["1+2=", "3+4=", "5+6="], ["<<1+2=\n3" + EOS, "7" + EOS,
                                                                 "<<99999*99999*99999=" + EOS], max_new_tokens=30)
    assert engine.calls == 2 and [len(c) for c in engine.contexts[:3]] == [5, 5, 5]
    assert [e.finish_reason for e in eps] == ["stop", "stop", "length"]  # the third's 17-token result did not fit
    m = episode_metrics(eps)
    model = sum(sum(e.model_mask) for e in eps)
    assert m["val/sequence_lengths"] == model / 3 == (9 + 2 + 20) / 3
    assert m["tools/tool_tokens_frac"] == pytest.approx(1 - model / sum(len(e.token_ids) for e in eps))
    assert m["tools/calls_per_episode"] == 2 / 3 and m["tools/wellformed_frac"] == 1.0


def test_sft_data_masks_the_tool_results(tok):
    assert tool_response([3, 4, 5]) == "<<3+4+5=12>>\n12"
    text = tool_response([3, 4, 5], per_line=True)
    assert text == "<<3+4=7>>\n<<7+5=12>>\n12"
    assert segments(text) == [("<<3+4=", 1), ("7>>", 0), ("\n<<7+5=", 1), ("12>>", 0), ("\n12", 1)]
    r, keep = encode_segments(tok, text)
    assert r == ids(tok, text) + [tok.eos_token_id]
    assert [t for t, k in zip(tok.convert_ids_to_tokens(r), keep) if not k] == list("7>>12>>")
    row = json.loads((ROOT / "shared/builtin_models/tools_sft/sums10.train.jsonl").open().readline())
    assert task.grade(row["response"], row["answer"]) == 1.0


def test_chat_tool_turns_and_the_prefix_check(tok):
    """--tool_turns chat: the result comes as a tool turn rendered by the chat template (mask 0 on all of it); a
    template that is not prefix-preserving is a one-line start-up error."""
    import copy

    obs = "\n<|tool|>\n7>>\n<|assistant|>\n"  # the tiny template: the assistant turn's end, the tool turn, the header
    assert chat_tool_turn(tok)("7>>") == obs
    _, _, (ep,) = run_episodes(tok, ["3+4+5="], ["<<3+4=\n12" + EOS], turns="chat")
    assert tok.decode(ep.token_ids, skip_special_tokens=True) == "<<3+4=" + obs + "\n12"
    assert ep.model_mask == [1] * 6 + [0] * len(ids(tok, obs)) + [1] * 4
    bad = copy.deepcopy(tok)
    bad.chat_template = "{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="not prefix-preserving"):
        chat_tool_turn(bad)


@pytest.mark.real_model
def test_smollm2_chat_tool_turn():
    from transformers import AutoTokenizer

    from shared.models import resolve_model_path

    smol = AutoTokenizer.from_pretrained(resolve_model_path("builtin:smollm2-135m"))
    text = chat_tool_turn(smol)("7>>")
    assert text == "<|im_end|>\n<|im_start|>tool\n7>><|im_end|>\n<|im_start|>assistant\n"
    assert smol(text, add_special_tokens=False).input_ids[0] == smol.convert_tokens_to_ids("<|im_end|>")


# ---------------------------------------------------------------- end to end: one shared run
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """tests/resume_runs.py's grpo_tools case: straight (a) and stopped after 2 steps then resumed (b)."""
    from tests.test_reliability import launch

    out = tmp_path_factory.mktemp("tools_resume")
    launch([sys.executable, "tests/resume_runs.py", str(out), "grpo_tools"], timeout=600)
    return out, json.loads((out / "results.json").read_text())["grpo_tools"]


@pytest.mark.slow
def test_resume_is_exact_and_the_run_logs_tool_metrics(resumed):
    out, r = resumed
    assert r["stopped_at"] >= 2 and r["rows_at_stop"] < r["n_rows"][1]
    assert r["rows_equal"], f"first differing row: {r['first_diff']}"
    assert r["weights_equal"] and "final" in r["weights"] and r["finished"]
    step = r["step_row"]
    assert step["tools/calls_per_episode"] > 0.5 and step["tools/wellformed_frac"] > 0.5
    assert 0 < step["tools/tool_tokens_frac"] < 1
    samples = [json.loads(line) for line in (out / "grpo_tools" / "a" / "samples.jsonl").read_text().splitlines()]
    assert any("<<" in s["completion"] and ">>" in s["completion"] for s in samples)


THREE_RANKS = """
import json, sys
sys.path[:0] = [{root!r}]
from shared.distributed import init_distributed
from shared.tiny import build_tokenizer
from shared.tools import ToolGenerator
from tests.test_grpo_tools import ScriptedEngine
info = init_distributed()
tok = build_tokenizer()
texts = [["<<3+4=\\n<<7+5=\\n12<eos>"], ["12<eos>"], []][info.rank]  # rank 0: 3 rounds, rank 1: 1, rank 2: none
prompts = [tok("3+4+5=").input_ids] * len(texts)
engine = ScriptedEngine(tok, texts, len(prompts[0]) if prompts else 0)
engine.synced_gpus = True
out = ToolGenerator(engine, tok, 4).generate(prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=32, seed=1)
text = [tok.decode(g[0].token_ids, skip_special_tokens=True) for g in out]
print("result:" + json.dumps(info.gather_objects({{"calls": engine.calls, "text": text}})), flush=True)
from shared.distributed import end_process_group
end_process_group()  # a rank that leaves with gloo's threads running aborts ("terminate called ...")
"""


def test_ranks_under_zero3_make_the_same_generate_calls_whatever_their_rounds():
    """HF generation under ZeRO-3 (`synced_gpus`): every forward gathers the shards from all ranks, so the ranks
    must make the same number of generate calls (3 against 1 before: a hang or a desynchronised step). Three gloo
    ranks whose episodes need 3, 1 and 0 rounds all make 3 calls (the finished ranks empty ones), and the episodes
    are those of one rank alone. Without synced_gpus each rank makes only its own (the scripted tests above)."""
    import os
    import subprocess

    from shared.distributed import _free_port

    port, world = _free_port(), 3
    procs = [subprocess.Popen([sys.executable, "-c", THREE_RANKS.format(root=str(ROOT))], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:]
    result = json.loads([x for x in outs[0][0].splitlines() if x.startswith("result:")][-1].split(":", 1)[1])
    assert [r["calls"] for r in result] == [3, 3, 3]
    assert [r["text"] for r in result] == [["<<3+4=7>>\n<<7+5=12>>\n12"], ["12"], []]


@pytest.mark.slow
def test_two_processes_under_zero3_agree_on_the_rounds(tmp_path):
    """accelerate launch, 2 processes under ZeRO-3 (HF generation, synced_gpus): the ranks' episodes need different
    numbers of rounds, the ranks agree on them (an unmatched generate call would hang), see different prompts and end
    with identical weights."""
    from tests.test_e2e import metrics
    from tests.test_reliability import launch

    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3.yaml",
            "algorithms/grpo_tools.py", "--output_dir", str(tmp_path), "--local_num_prompts", "4", "--num_generations",
            "4", "--local_micro_batch_size", "16", "--total_episodes", "64", "--eval_every", "0", "--eval_num_prompts",
            "4", "--eval_num_samples", "2", "--dev_num_prompts", "0", "--best_metric", "", "--generator", "hf",
            "--no_save_model"])
    rows = metrics(tmp_path)
    steps = [r for r in rows if "tools/calls_per_episode" in r]
    assert len(steps) == 2 and all(r["tools/calls_per_episode"] > 0 for r in steps)
    last = rows[-1]
    assert last["check/world_size"] == 2.0 and last["check/ranks_identical_weights"] == 1.0
    assert last["check/ranks_shared_prompts"] == 0.0


@pytest.mark.slow
@pytest.mark.real_model
def test_two_steps_on_smollm2(tmp_path):
    """The same syntax inside SmolLM2's assistant text (its BPE: `=` may end inside a token)."""
    from tests.test_e2e import metrics, run

    out = tmp_path / "smol"
    run([sys.executable, "algorithms/grpo_tools.py", "--output_dir", str(out), "--model_name_or_path",
         "builtin:smollm2-135m", "--chat_template", "--dataset", "builtin:sums-4", "--prompt_template",
         "{prompt}\nUse the calculator: write <<a+b= and it appends the result.", "--learning_rate", "1e-5",
         "--max_new_tokens", "16", "--local_num_prompts", "2", "--num_generations", "2", "--local_micro_batch_size",
         "4", "--num_minibatches", "1", "--num_iterations", "1", "--total_episodes", "8", "--eval_num_prompts", "1",
         "--eval_num_samples", "1", "--eval_every", "0", "--dev_num_prompts", "0", "--best_metric", "",
         "--save_every", "0", "--no_save_model", "--generator", "hf", "--sample_every", "1"])
    rows = [r for r in metrics(out) if "tools/calls_per_episode" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss/policy_avg"])) for r in rows)
    assert all(0 <= r["tools/tool_tokens_frac"] < 1 and r["val/sequence_lengths"] <= 16 for r in rows)
