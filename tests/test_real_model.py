"""Generation on a real pretrained chat model, `builtin:smollm2-135m` (SmolLM2-135M-Instruct; shared/models.py).

What the 17-token character model could not exercise: a 49k-token BPE vocabulary, a ChatML chat template whose
turns end in `<|im_end|>` (EOS == pad), generation_config stop ids, stop strings that end inside a token, and a
real architecture in vLLM. Each test here fails if that path is wrong:
  - vLLM's sampled-token log-probs equal the trainer's forward (right-padded, as the scripts train, and left-padded,
    as HF generates) on chat prompts of different lengths, to 1e-4 in fp32; so do the HF backend's;
  - both backends stop on every id of generation_config.eos_token_id, and on --stop strings, at the same token;
  - the chat template gives exactly one BOS, and the HF and vLLM backends produce the same greedy completions.
The checkpoint is converted from the packaged GGUF on first use (~45 s, cached in $CLEANRLHF_CACHE)."""

import copy
import json
import os

import pytest
import torch

from shared.logprobs import forward_logprobs
from shared import data
from shared.distributed import load_causal_lm, load_tokenizer
from shared.generation import (HFGenerator, VLLMGenerator, completion_decoder, cut_at_stop, stop_string_end,
                               stop_token_ids)

pytestmark = pytest.mark.real_model

QUESTIONS = ["What is 3+4?", "Name a colour.", "What is the capital of France? Answer in one word.",
             "Write one short sentence about the sea, then stop."]


@pytest.fixture(scope="module")
def smol():
    from shared.models import resolve_model_path

    path = resolve_model_path("builtin:smollm2-135m")
    tok = load_tokenizer(path)
    model = load_causal_lm(path, torch.float32).eval()
    prompts = [data.encode_prompt(tok, q, use_chat_template=True) for q in QUESTIONS]
    return path, tok, model, prompts


@pytest.fixture(scope="module")
def engine(smol):
    path, tok, _, _ = smol
    return VLLMGenerator(path, tok, torch.float32, seed=0, max_model_len=256)


def test_builtin_smollm2_is_a_real_chat_checkpoint(smol):
    path, tok, model, prompts = smol
    config = json.loads(open(os.path.join(path, "config.json")).read())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert stop_token_ids(path, tok) == [tok.eos_token_id]
    source = json.loads(open(os.path.join(path, "cleanrlhf_source.json")).read())
    assert source["gguf_sha256"].startswith("b179c952") and len(source["weights_sha256"]) == 64
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_chat_template_gives_exactly_one_bos(smol):
    """SmolLM2's BOS is `<|im_start|>`, which also opens every ChatML turn: the prompt must start with one of them
    (the template's), not two (the template's plus a tokenizer-added one), and hold one per turn."""
    _, tok, _, prompts = smol
    for q, ids in zip(QUESTIONS, prompts):
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
        assert ids.count(tok.bos_token_id) == 3  # system, user, assistant turns
        assert tok.decode(ids) == tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                          add_generation_prompt=True)
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def _trainer_logprobs(model, prompts, groups, temperature, left_pad: bool):
    """The trainer's log-probs of each sampled token: grpo.py's forward on a right-padded [prompt | completion | pad]
    batch (as every script trains), or on a left-padded one (as HF generates), positions from the attention mask."""
    flat_p = [p for p, g in zip(prompts, groups) for _ in g]
    flat_c = [c.token_ids for g in groups for c in g]
    ids, attn, resp = data.pad_batch(flat_p, flat_c, pad_id=2)
    if left_pad:  # roll each row so its padding comes first
        lengths = attn.sum(1)
        ids, attn, resp = (torch.stack([torch.roll(r, int(x.shape[1] - n)) for r, n in zip(x, lengths)])
                           for x in (ids, attn, resp))
    with torch.no_grad():
        logp, _ = forward_logprobs(model, ids, attn, resp, temperature)
    out = []
    for i, (p, c) in enumerate(zip(flat_p, flat_c)):
        start = (ids.shape[1] - int(attn[i].sum()) if left_pad else 0) + len(p) - 1
        out.append(logp[i, start : start + len(c)])
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_equal_trainer_forward_on_chat_prompts(smol, engine, temperature):
    _, tok, model, prompts = smol
    assert len({len(p) for p in prompts}) == len(prompts)  # different prompt lengths: real padding in the batch
    out = engine.generate(prompts, n=3, temperature=temperature, top_p=1.0, max_new_tokens=24, seed=7)
    flat = [c for g in out for c in g]
    assert any(c.finished for c in flat) and any(len(c.token_ids) > 10 for c in flat)
    for left_pad in (False, True):
        ref = _trainer_logprobs(model, prompts, out, temperature, left_pad)
        diff = max((torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(flat, ref))
        assert diff <= 1e-4, (left_pad, diff)


def test_hf_logprobs_equal_trainer_forward_on_chat_prompts(smol):
    _, tok, model, prompts = smol
    out = HFGenerator(model, tok).generate(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=3)
    flat = [c for g in out for c in g]
    ref = _trainer_logprobs(model, prompts, out, 1.0, left_pad=False)
    assert max((torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(flat, ref)) <= 1e-4


def test_hf_and_vllm_produce_the_same_greedy_completions(smol, engine):
    _, tok, model, prompts = smol
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0)
    hf = [g[0] for g in HFGenerator(model, tok).generate(prompts, **kw)]
    vl = [g[0] for g in engine.generate(prompts, **kw)]
    assert [c.token_ids for c in hf] == [c.token_ids for c in vl]
    assert [c.finish_reason for c in hf] == [c.finish_reason for c in vl]
    assert any(c.finished for c in vl)  # some turns end with <|im_end|>, which is kept as the last token
    for c in vl:
        assert (c.token_ids[-1] == tok.eos_token_id) == c.finished and tok.eos_token_id not in c.token_ids[:-1]
    assert completion_decoder(tok)(vl[2].token_ids).strip().startswith("The capital of France is Paris")


@pytest.fixture(scope="module")
def comma_stop_dir(smol, tmp_path_factory):
    """The checkpoint with generation_config.eos_token_id = [<|im_end|>, ","]: a second end-of-turn id that is not
    the tokenizer's EOS (as Llama-3-Instruct's <|eot_id|>). Weights are linked, not copied."""
    path, tok, _, _ = smol
    out = tmp_path_factory.mktemp("smol-comma")
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), out / name)
    comma = tok(",", add_special_tokens=False).input_ids
    assert len(comma) == 1
    (out / "generation_config.json").unlink()
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, comma[0]],
                                                            "pad_token_id": 2}))
    return str(out), comma[0]


def test_both_backends_stop_on_every_generation_config_eos_id(smol, engine, comma_stop_dir):
    """Greedy "Hello! ..." style answers contain a comma early; with ',' among the eos ids both backends must end
    the completion at the first comma (kept, finish_reason stop), where the tokenizer's EOS alone would not."""
    _, tok, model, prompts = smol
    path, comma = comma_stop_dir
    ids = stop_token_ids(path, tok)
    assert ids == [tok.eos_token_id, comma]
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0)
    free = [g[0] for g in engine.generate(prompts, **kw)]
    with_comma = [i for i, c in enumerate(free) if comma in c.token_ids[:-1]]
    assert with_comma, [tok.decode(c.token_ids) for c in free]  # the test needs a completion with an inner comma
    vllm_gen = copy.copy(engine)  # the same engine, with this checkpoint's stop ids
    vllm_gen.stop_token_ids = ids
    hf_gen = HFGenerator(model, tok, stop_token_ids=ids)
    for gen in (vllm_gen, hf_gen):
        out = [g[0] for g in gen.generate(prompts, **kw)]
        for i in with_comma:
            first = free[i].token_ids.index(comma)
            assert out[i].token_ids == free[i].token_ids[: first + 1] and out[i].finish_reason == "stop"
            assert len(out[i].logprobs) == first + 1
    # sampled: whatever ends a completion is one of the ids, and no id occurs before the end
    for gen in (vllm_gen, hf_gen):
        for c in (c for g in gen.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=1)
                  for c in g):
            assert not set(c.token_ids[:-1]) & set(ids)
            assert c.finished == (c.token_ids[-1] in ids)


def test_stop_string_helpers():
    assert cut_at_stop("a + b = 12\nAnswer: 12\nQuestion: next", ["Question:", "\n\n"]) == "a + b = 12\nAnswer: 12\n"
    assert cut_at_stop("abc", ["x"]) == "abc" and cut_at_stop("abcx", ["x", "bc"]) == "a"


@pytest.mark.parametrize("stop", [["Par"], ["France is"], ["\n\n", " capital"]])
def test_both_backends_stop_on_stop_strings(smol, engine, stop):
    """'Par' ends inside the token ' Paris' (the token is kept, the text cut before 'Par'); 'France is' spans two
    tokens; with several strings the first to appear wins. Both backends end at the same token."""
    _, tok, model, prompts = smol
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0)
    free = engine.generate(prompts[2:3], **kw)[0][0]
    text = completion_decoder(tok)(free.token_ids)
    assert "The capital of France is Paris" in text
    end = stop_string_end(tok, free.token_ids, stop)
    assert end is not None and end < len(free.token_ids)
    decode = completion_decoder(tok, stop)
    vllm_gen = copy.copy(engine)  # the same engine, with these stop strings
    vllm_gen.stop = tuple(stop)
    results = []
    for gen in (vllm_gen, HFGenerator(model, tok, stop=stop)):
        c = gen.generate(prompts[2:3], **kw)[0][0]
        assert c.token_ids == free.token_ids[:end] and c.finish_reason == "stop" and len(c.logprobs) == end
        assert decode(c.token_ids) == cut_at_stop(text, stop) and not any(s in decode(c.token_ids) for s in stop)
        results.append(c.token_ids)
    assert results[0] == results[1]
    # sampled, several prompts: a completion ends at the first token whose text completes a stop string, never later
    for c in (c for g in vllm_gen.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=2)
              for c in g):
        if c.finished and c.token_ids[-1] != tok.eos_token_id:
            assert stop_string_end(tok, c.token_ids, stop) == len(c.token_ids)
        else:
            assert stop_string_end(tok, c.token_ids, stop) is None


def test_a_stop_token_is_trained_on_like_eos(smol, engine, comma_stop_dir):
    """With pad == EOS == <|im_end|> and ',' as a second stop id: the training batch's response mask (every script:
    data.pad_batch, then position t predicts token t+1) covers the completion's last token whichever id ended it, so
    the policy loss, the KL term and the reference log-probs all include it; padding never counts, although the pad
    id is the EOS id; the reward text has no EOS and stops where the completion stopped."""
    from algorithms.grpo import completion_mask

    _, tok, model, prompts = smol
    path, comma = comma_stop_dir
    gen = copy.copy(engine)
    gen.stop_token_ids = stop_token_ids(path, tok)
    comps = [c for g in gen.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=4) for c in g]
    ends = {c.token_ids[-1] for c in comps if c.finished}
    assert comma in ends and ends <= {tok.eos_token_id, comma}  # some completions end on the non-EOS stop id
    flat_p = [p for p in prompts for _ in range(4)]
    ids, attn, resp = data.pad_batch(flat_p, [c.token_ids for c in comps], tok.pad_token_id)
    mask = completion_mask(resp, torch.tensor([c.finished for c in comps]), mask_truncated=False)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, ids, attn, resp, 1.0)
    for i, (p, c) in enumerate(zip(flat_p, comps)):
        positions = mask[i].nonzero().squeeze(-1).tolist()
        assert positions == list(range(len(p) - 1, len(p) - 1 + len(c.token_ids)))  # last token (stop) included
        assert torch.allclose(logp[i, positions], torch.tensor(c.logprobs), atol=1e-4)
    decode = completion_decoder(tok)
    for c in comps:
        assert "<|im_end|>" not in decode(c.token_ids)
