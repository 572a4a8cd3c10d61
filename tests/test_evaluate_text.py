"""algorithms/evaluate_text.py: the metrics against hand-computed values, the judge's parsing, position swap and
retries, bad inputs (one line, exit status 2, nothing written), and a real vLLM OpenAI server on loopback as the
judge (one per module, started when the module starts so that the other tests run while it loads)."""

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from algorithms import evaluate_text as et

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT = 240  # seconds: the vLLM CPU server imports torch and vLLM twice (API server, engine core)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _judge_server(request, tmp_path_factory):
    """A vLLM OpenAI-compatible server of builtin:tiny-sft on loopback, started (not awaited) when the module starts,
    only if a selected test of this module uses `judge_url`; stopped at the end of the module."""
    wanted = any("judge_url" in item.fixturenames for item in request.session.items
                 if item.module is request.module)
    if not wanted:
        yield None
        return
    from shared.models import resolve_model_path

    port = free_port()
    log = tmp_path_factory.mktemp("judge") / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 resolve_model_path("builtin:tiny-sft"), "--served-model-name", "tiny-judge",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
                                 "--enforce-eager", "--dtype", "float32"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}/v1", "log": log, "start": time.time()}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def judge_url(_judge_server):
    server = _judge_server
    while time.time() - server["start"] < SERVER_START_TIMEOUT:
        assert server["proc"].poll() is None, f"the vLLM server exited:\n{server['log'].read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(server["url"] + "/models", timeout=2) as r:
                if r.status == 200:
                    return server["url"]
        except OSError:
            time.sleep(1)
    pytest.fail(f"the vLLM server did not answer within {SERVER_START_TIMEOUT} s:\n{server['log'].read_text()[-3000:]}")


def run(argv, monkeypatch, capsys):
    """evaluate_text.py's command line in this process: (exit status or 0, stderr, summary or None)."""
    from shared.cli import run_cli

    monkeypatch.setattr(sys, "argv", ["evaluate_text.py", *argv])
    result = {}
    try:
        run_cli(lambda a: result.setdefault("summary", et.main(a)), et.Args)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err, result.get("summary")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PREDS = [{"prompt": "1+2+3+4=", "completion": "3\n6\n10", "reference": "3\n6\n10"},
         {"prompt": "5+5+1+1=", "completion": "10\n11\n13", "reference": "10\n11\n12"},
         {"prompt": "2+2+2+2=", "completion": "4\n6\n8", "reference": "4\n6\n8"}]
OFF = ["--verifiers", "--num_bootstrap", "0"]  # no reward model, no intervals: only what a test names


# --- the judge's parsing and position swap (pure) ---------------------------------------------------------------
def test_parse_score():
    assert et.parse_score("Clear and right.\nScore: 8") == 8.0
    assert et.parse_score("score = 3 ... final Score: **7**") == 7.0  # the last one
    assert et.parse_score(" 9 ") == 9.0  # a bare number
    for reply in ["Score: 11", "Score: 0", "great answer", "", None, "Score: nan", "8/10"]:
        assert et.parse_score(reply) is None, reply


def test_parse_verdict():
    assert et.parse_verdict("A is longer, B is right.\nVerdict: B") == "B"
    assert et.parse_verdict("Verdict: [A]") == "A"
    assert et.parse_verdict("verdict: TIE.") == "tie"
    assert et.parse_verdict("A") == "A"
    for reply in ["Verdict: C", "both are fine", "", None, "Verdict: Alpha"]:
        assert et.parse_verdict(reply) is None, reply


def test_combine_orders_cancels_position_bias():
    # first: the model is A; second: the model is B
    assert et.combine_orders("A", "B") == 1.0  # both orders prefer the model
    assert et.combine_orders("B", "A") == 0.0  # both prefer the baseline
    assert et.combine_orders("A", "A") == 0.5  # a judge that always picks the first position: a tie
    assert et.combine_orders("B", "B") == 0.5
    assert et.combine_orders("tie", "B") == 0.5 and et.combine_orders("A", "tie") == 0.5
    assert et.combine_orders(None, "B") is None and et.combine_orders("A", None) is None


# --- the metrics against hand-computed values --------------------------------------------------------------------
def test_bleu_of_identical_text_is_100_and_of_disjoint_text_0():
    a = ["the cat sat on the mat today", "a quick brown fox jumps over it"]
    corpus, sentence = et.bleu(a, a)
    assert corpus == pytest.approx(100) and sentence == pytest.approx([100, 100])
    corpus, sentence = et.bleu(a, ["one two three four five six seven", "eight nine ten eleven twelve x y"])
    assert corpus == 0 and sentence == [0, 0]


def test_bertscore_of_identical_text_is_1():
    from shared.models import resolve_model_path

    path = resolve_model_path("builtin:tiny")
    f1 = et.bertscore_f1(["3\n6\n10", "12+4"], ["3\n6\n10", "12+4"], path, 1, 8, torch.device("cpu"))
    assert f1 == pytest.approx([1.0, 1.0], abs=1e-5)
    other = et.bertscore_f1(["3\n6\n10"], ["99+1+77"], path, 1, 8, torch.device("cpu"))
    assert other[0] < 0.999


def test_perplexity_equals_a_hand_computation(tiny_model):
    model, tok = tiny_model
    model.eval()
    contexts = [tok("1+2=", add_special_tokens=True).input_ids, tok("9+9+9=", add_special_tokens=True).input_ids]
    texts = [tok("3", add_special_tokens=False).input_ids, tok("18\n27", add_special_tokens=False).input_ids]
    got = et.perplexities(model, contexts, texts + [], tok.pad_token_id, micro_batch_size=2)
    for ctx, txt, value in zip(contexts, texts, got):  # token by token, one unpadded sequence
        ids = torch.tensor([ctx + txt])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        nll = [-torch.log_softmax(logits[len(ctx) - 1 + t], -1)[txt[t]].item() for t in range(len(txt))]
        assert value == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)
    assert et.perplexities(model, contexts[:1], [[]], tok.pad_token_id, 4) == [None]


def test_summary_leaves_missing_scores_out_of_the_mean():
    preds = [{"index": 0, "scores": {"judge/efficiency": 4.0}}, {"index": 1, "scores": {}},
             {"index": 2, "scores": {"judge/efficiency": 8.0}}]
    s = et.summarize(preds, {"eval/bleu": 12.0}, 50, 0.9, 1)
    assert s["metrics"] == {"eval/bleu": 12.0, "eval/judge/efficiency": 6.0, "eval/judge/efficiency/count": 2}
    assert 4.0 <= s["ci"]["eval/judge/efficiency"][0] <= s["ci"]["eval/judge/efficiency"][1] <= 8.0


# --- retries and bad inputs ----------------------------------------------------------------------------------------
def test_a_refusing_endpoint_is_retried_counted_and_never_scored():
    args = et.Args(judge_base_url=f"http://127.0.0.1:{free_port()}/v1", judge_model="m", judge_max_retries=2,
                   judge_backoff=0.01, judge_timeout=5)
    judge = et.Judge(args)
    preds = [{"index": 0, "sample": 0, "prompt": "p", "completion": "c", "scores": {}}]
    counts = et.run_judge(judge, preds, {(0, 0): {"completion": "b"}}, ("efficiency",), 2)
    assert counts == {"judge/calls": 9, "judge/retries": 6, "judge/failed": 3, "judge/unparsed": 0,
                      "judge/questions": 3}
    assert preds[0]["scores"] == {}  # no score, no win
    assert all(v == {"reply": None, "parsed": None} for v in preds[0]["judge"].values())
    assert "onnect" in judge.errors[0]


def test_a_judge_that_refuses_at_start_up_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    preds = write_jsonl(tmp_path / "p.jsonl", PREDS)
    out = tmp_path / "run"
    code, err, _ = run(["--predictions_path", str(preds), "--output_dir", str(out), *OFF, "--judge_base_url",
                        f"http://127.0.0.1:{free_port()}/v1", "--judge_max_retries", "1", "--judge_backoff", "0.01"],
                       monkeypatch, capsys)
    assert code == 2 and err.startswith("error: judge_base_url: http://127.0.0.1:") and err.count("\n") == 1, err
    assert "does not answer" in err and not out.exists()


@pytest.mark.parametrize("case", ["empty", "no_reference_in_file", "no_reference_column", "baseline_misses"])
def test_bad_input_is_a_one_line_error_and_nothing_is_written(case, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    preds = write_jsonl(tmp_path / "p.jsonl", PREDS)
    write_jsonl(tmp_path / "d.test.jsonl", [{"prompt": "1+1="}])
    argv, expected = {
        "empty": (["--predictions_path", str(write_jsonl(tmp_path / "e.jsonl", []))],
                  f"error: predictions_path: {tmp_path / 'e.jsonl'} holds no predictions\n"),
        "no_reference_in_file": (["--predictions_path", str(write_jsonl(tmp_path / "n.jsonl", [
            {"prompt": "1+1=", "completion": "2"}]))],
            f"error: predictions_path: {tmp_path / 'n.jsonl'} line 1 has no text 'reference' (--response_key '': "
            "score without references)\n"),
        "no_reference_column": (["--dataset", str(tmp_path / "d.jsonl")],  # its test split: d.test.jsonl
                                f"error: dataset '{tmp_path / 'd.jsonl'}' split 'test' row 0: missing key 'response' "
                                "(has ['prompt'])\n"),
        "baseline_misses": (["--predictions_path", str(preds), "--judge_base_url", "http://127.0.0.1:9/v1",
                             "--judge_baseline_path", str(write_jsonl(tmp_path / "b.jsonl", PREDS[:2]))],
                            f"error: judge_baseline_path: {tmp_path / 'b.jsonl'} has no prediction for (index, "
                            "sample) (2, 0) (1 missing); generate it on the same prompts and samples\n"),
    }[case]
    code, err, _ = run([*argv, "--output_dir", str(out), *OFF], monkeypatch, capsys)
    assert (code, err) == (2, expected)
    assert not out.exists()


# --- end to end ---------------------------------------------------------------------------------------------------
def test_generate_then_score_again_from_the_predictions_file(tmp_path, monkeypatch, capsys):
    """A generated evaluation (HF) and the same predictions scored again give the same scores, record by record."""
    out = tmp_path / "gen"
    code, err, first = run(["--generator", "hf", "--eval_num_prompts", "6", "--output_dir", str(out),
                            "--perplexity_model", "builtin:tiny-sft", "--num_bootstrap", "20"], monkeypatch, capsys)
    assert code == 0, err
    records = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 6 and {"prompt", "completion", "reference", "finished", "scores"} <= set(records[0])
    assert set(records[0]["scores"]) == {"sentence_bleu", "perplexity", "reward/rm"}
    assert {"eval/bleu", "eval/sentence_bleu", "eval/perplexity", "eval/reward/rm"} <= set(first["metrics"])
    assert first["metrics"]["eval/reward/rm"] == pytest.approx(sum(r["scores"]["reward/rm"] for r in records) / 6)
    code, err, again = run(["--predictions_path", str(out / "predictions.jsonl"), "--output_dir", str(tmp_path / "re"),
                            "--perplexity_model", "builtin:tiny-sft", "--num_bootstrap", "20"], monkeypatch, capsys)
    assert code == 0, err
    rescored = [json.loads(x) for x in (tmp_path / "re" / "predictions.jsonl").read_text().splitlines()]
    for a, b in zip(records, rescored):
        assert a["scores"].keys() == b["scores"].keys()
        for k in a["scores"]:
            assert a["scores"][k] == pytest.approx(b["scores"][k], rel=1e-5), k
    assert again["metrics"] == pytest.approx(first["metrics"], rel=1e-5)


def test_a_real_vllm_judge_scores_compares_and_counts_what_does_not_parse(judge_url, tmp_path, monkeypatch, capsys):
    """The tiny judge rarely writes `Score: N` or `Verdict: X`: whatever it writes is stored, each question is
    answered (none failed), and every reply is either parsed into a score or counted as unparsed."""
    preds = write_jsonl(tmp_path / "p.jsonl", PREDS)
    base = write_jsonl(tmp_path / "b.jsonl", [{**r, "completion": "1\n2\n3"} for r in PREDS])
    out = tmp_path / "run"
    code, err, s = run(["--predictions_path", str(preds), "--output_dir", str(out), *OFF, "--judge_base_url",
                        judge_url, "--judge_baseline_path", str(base), "--judge_max_tokens", "8",
                        "--judge_workers", "4"], monkeypatch, capsys)
    assert code == 0, err
    m = s["metrics"]
    assert s["judge_model"] == "tiny-judge"
    assert m["judge/questions"] == 3 * (3 + 2) and m["judge/failed"] == 0 and m["judge/calls"] == 15
    records = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    replies = [v for r in records for v in r["judge"].values()]
    assert len(replies) == 15 and all(isinstance(v["reply"], str) for v in replies)
    parsed = sum(v["parsed"] is not None for v in replies)
    assert parsed + m["judge/unparsed"] == 15
    for c in et.RUBRICS:  # a parsed score is in its prediction's scores and in the mean; an unparsed one nowhere
        n = sum(r["judge"][c]["parsed"] is not None for r in records)
        assert m.get(f"eval/judge/{c}/count", 0) == n
    wins = [et.combine_orders(r["judge"]["pair/model_first"]["parsed"], r["judge"]["pair/baseline_first"]["parsed"])
            for r in records]
    assert m.get("eval/judge/win_rate/count", 0) == sum(w is not None for w in wins)


def test_a_structured_judge_reply_always_parses(judge_url, tmp_path, monkeypatch, capsys):
    """--judge_structured: vLLM constrains each reply to a score 1-10 or A / B / tie, so even the tiny judge's parse."""
    preds = write_jsonl(tmp_path / "p.jsonl", PREDS[:2])
    out = tmp_path / "run"
    code, err, s = run(["--predictions_path", str(preds), "--output_dir", str(out), *OFF, "--judge_base_url",
                        judge_url, "--judge_baseline_path", str(preds), "--judge_max_tokens", "4",
                        "--judge_structured", "--judge_criteria", "efficiency"], monkeypatch, capsys)
    assert code == 0, err
    m = s["metrics"]
    assert (m["judge/questions"], m["judge/failed"], m["judge/unparsed"]) == (6, 0, 0)
    assert m["eval/judge/efficiency/count"] == 2 and m["eval/judge/win_rate/count"] == 2
    records = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert all(r["judge"]["pair/model_first"]["reply"] in et.VERDICTS for r in records)
