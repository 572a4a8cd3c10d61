"""Memory-lean log-probs: every script's log-prob function equals the full-logits computation it
replaced, and never materialises the [B, L-1, V] float32 logits.

The reference below is the code every script had before: logits of every position, prompt included, upcast to
float32, then a full-vocabulary log-softmax (and the entropy). The lean functions run the LM head on the response
positions only, in chunks recomputed during the backward pass. Values, entropies and parameter gradients must agree
to 1e-5 for chunk sizes that do and do not divide the number of response tokens, on rows of different prompt and
response lengths; the memory probe must see less than one [B, L-1, V] float32 tensor where the reference needs
several (checked on the reference too, so the probe can fail)."""

import inspect

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from algorithms import dpo, drca, grpo, ppo, repulse, restem, sft, vineppo
from shared import data, logprobs

TOL = dict(atol=1e-5, rtol=1e-5)
CHUNKS = [1, 3, 7, 1024]  # 3 and 7 divide none of the batches' response-token counts (25 and 9 below)


def reference_logprobs(model, input_ids, attention_mask, temperature=1.0):
    """The old computation: float32 logits of every position, [B, L-1, V]; log-probs and entropy, [B, L-1]."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    logp = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
    p = torch.softmax(logits, -1)
    entropy = torch.logsumexp(logits, -1) - (p * logits).sum(-1)
    return logp, entropy


# Each script's function as (log-probs [B, L-1], entropy or None); dpo's returns per-sequence sums, checked apart.
SCRIPTS = {  # shared/logprobs.py: the RL scripts but repulse (its own wrapper of it) train through it
    "logprobs": lambda m, ids, attn, resp, t, chunk: logprobs.forward_logprobs(m, ids, attn, resp, t, True, chunk),
    "repulse": lambda m, ids, attn, resp, t, chunk: (repulse.forward_logprobs(m, ids, attn, resp[:, 1:], chunk), None),
    "sft": lambda m, ids, attn, resp, t, chunk: (-sft.sequence_nll(m, ids, attn, resp, chunk)[0], None),
}
TEMPERATURE = {"logprobs": 0.7, "repulse": 1.0, "sft": 1.0}


@pytest.fixture(scope="module")
def batch(tiny_model):
    """Right-padded [prompt | response | pad] rows with prompts of 2-10 tokens and responses of 1-9 tokens."""
    _, tok = tiny_model
    prompts = [tok(x).input_ids for x in ["1+2=", "12+30+4+50=", "7=", "3+4+5="]]
    responses = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id] for x in ["3", "96\n1\n2\n3", "", "12\n"]]
    ids, attn, resp = data.pad_batch(prompts, responses, tok.pad_token_id)
    assert len({len(p) for p in prompts}) == 4 and len({len(r) for r in responses}) == 4
    return ids, attn, resp


def _grads(model, loss):
    return [g for g in torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) if g is not None]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_lean_logprobs_equal_the_full_logits_computation(tiny_model, batch, name, chunk):
    model, _ = tiny_model
    ids, attn, resp = batch
    T = TEMPERATURE[name]
    mask = resp[:, 1:].float()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask  # a loss on response tokens

    ref_logp, ref_ent = reference_logprobs(model, ids, attn, T)
    logp, ent = SCRIPTS[name](model, ids, attn, resp, T, chunk)
    assert logp.shape == mask.shape and logp.dtype == torch.float32
    torch.testing.assert_close(logp * mask, ref_logp * mask, **TOL)
    assert (logp[mask == 0] == 0).all()  # positions that predict no response token are never computed
    if ent is not None:
        torch.testing.assert_close(ent * mask, ref_ent * mask, **TOL)

    ref_g = _grads(model, (weights * ref_logp).sum())
    g = _grads(model, (weights * logp).sum())
    assert len(g) == len(ref_g) == len(list(model.parameters()))
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, **TOL)
    if ent is not None:  # the entropy is differentiable too: --entropy_coef's bonus backpropagates through it
        ent, ref_ent = SCRIPTS[name](model, ids, attn, resp, T, chunk)[1], reference_logprobs(model, ids, attn, T)[1]
        for a, b in zip(_grads(model, (weights * ent).sum()), _grads(model, (weights * ref_ent).sum())):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_dpo_sequence_logps_equal_the_full_logits_computation(tiny_model, batch, chunk):
    model, _ = tiny_model
    ids, attn, resp = batch
    mask = resp[:, 1:].float()
    ref_logp, _ = reference_logprobs(model, ids, attn, 0.6)
    s, lengths = dpo.sequence_logps(model, ids, attn, resp, 0.6, chunk)
    torch.testing.assert_close(s, (ref_logp * mask).sum(1), **TOL)
    torch.testing.assert_close(lengths, mask.sum(1))
    w = torch.tensor([0.3, -1.1, 0.7, 2.0])
    for a, b in zip(_grads(model, (w * s).sum()), _grads(model, (w * (ref_logp * mask).sum(1)).sum())):
        torch.testing.assert_close(a, b, **TOL)


def test_no_response_token_gives_zeros_and_a_zero_gradient(tiny_model, batch):
    """A micro-batch whose rows have no response token still returns a tensor that backpropagates (to zero)."""
    model, _ = tiny_model
    ids, attn, resp = batch
    logp, ent = logprobs.forward_logprobs(model, ids, attn, torch.zeros_like(resp), 1.0, True)
    assert (logp == 0).all() and (ent == 0).all() and logp.requires_grad
    assert all((g == 0).all() for g in _grads(model, logp.sum()))


def test_the_rl_scripts_share_one_log_prob_function():
    """The RL scripts train through shared/logprobs.py's forward pass, not a copy of it that could drift."""
    for m in (grpo, ppo, vineppo, drca, restem):
        assert (getattr(m, "forward_logprobs", None) is logprobs.forward_logprobs
                or getattr(m, "micro_batch_logprobs", None) is logprobs.micro_batch_logprobs), m.__name__
        assert "def forward_logprobs" not in inspect.getsource(m), m.__name__


# ---------------------------------------------------------------- memory
class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensors that torch ops create while active (forward and backward), from their storages'
    lifetimes (weak references, checked after every op): works on CPU, where torch keeps no allocator statistics.
    Inputs and parameters made before it are not counted."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


@pytest.fixture(scope="module")
def wide_model():
    """A one-layer Llama with a 16k vocabulary, so that the logits dominate memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16_000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return LlamaForCausalLM(cfg)


def _step_peak(model, fn):
    """Peak bytes of one training micro-step: forward, then backward of a loss on the response tokens."""
    B, P, R = 4, 96, 32
    ids = torch.randint(3, model.config.vocab_size, (B, P + R), generator=torch.Generator().manual_seed(0))
    attn, resp = torch.ones_like(ids), torch.zeros_like(ids)
    resp[:, P:] = 1
    model.zero_grad(set_to_none=True)
    with PeakBytes() as probe:
        logp = fn(model, ids, attn, resp)
        (logp * resp[:, 1:]).sum().backward()
    model.zero_grad(set_to_none=True)
    return probe.peak, B * (P + R - 1) * model.config.vocab_size * 4  # peak, bytes of [B, L-1, V] float32


def test_memory_probe_sees_the_full_logits_of_the_reference(wide_model):
    """The probe can fail: the old computation holds several [B, L-1, V] float32 copies at once."""
    peak, full = _step_peak(wide_model, lambda m, ids, attn, resp: reference_logprobs(m, ids, attn)[0])
    assert peak > 2 * full, (peak, full)


@pytest.mark.parametrize("name", list(SCRIPTS) + ["dpo"])
def test_lean_logprobs_never_hold_the_full_logits(wide_model, name):
    if name == "dpo":
        fn = lambda m, ids, attn, resp: dpo.sequence_logps(m, ids, attn, resp, 1.0, 16)[0][:, None]  # noqa: E731
    else:
        fn = lambda m, ids, attn, resp: SCRIPTS[name](m, ids, attn, resp, 1.0, 16)[0]  # noqa: E731
    calls = []
    hook = wide_model.get_output_embeddings().register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    try:
        peak, full = _step_peak(wide_model, fn)
    finally:
        hook.remove()
    # the model's own forward computes the last position's logits only; then 128 response positions in chunks of
    # 16, each once forward and once recomputed backward
    assert sorted(calls) == [(4, 1, 16_000)] + [(16, 16_000)] * 16, calls
    assert peak < full / 2, (peak, full)


# ---------------------------------------------------------------- DeepSpeed, 2 ranks
@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """tests/lean_logprobs_ranks.py under ZeRO-2 and under ZeRO-3, one after another in one `accelerate launch` pair
    (tests/test_e2e.py run_batch: each run its ZeRO stage, ACCELERATE_DEEPSPEED_ZERO_STAGE, and its result folder)."""
    import sys

    from tests.test_e2e import run_batch

    base = tmp_path_factory.mktemp("lean_ranks")
    plan = {f"zero{stage}": ["tests/lean_logprobs_ranks.py"] for stage in (2, 3)}
    run_env = {f"zero{stage}": {"ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
                                "LEAN_RESULT_DIR": str(base / f"zero{stage}")} for stage in (2, 3)}
    for name in plan:
        (base / name).mkdir()
    results = run_batch(plan, base / "batch", ranks=2, run_env=run_env, timeout=900, launcher=(
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero2.yaml"))
    return {name: (results[name], base / name) for name in plan}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lean_logprobs_under_deepspeed(stage, deepspeed_runs):
    """Through a DeepSpeed engine on 2 ranks with unequal chunk counts (ZeRO-3 gathering the LM head at every call):
    one SGD step with the lean functions equals one with the reference (tests/lean_logprobs_ranks.py), no deadlock."""
    import json

    from tests.test_e2e import check_batch_run

    result, out = deepspeed_runs[f"zero{stage}"]
    check_batch_run(result)  # exit status 0 on both ranks
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["zero_stage"] == stage for r in results)
    for r in results:
        for name, x in r.items():
            if isinstance(x, dict):
                assert x["max_update"] > 0.1 and x["max_weight_diff"] <= 1e-5 * x["max_update"], (r["rank"], name, x)
