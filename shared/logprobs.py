"""Per-token log-probs of a policy on right-padded [prompt | completion | pad] rows, the forward pass every RL script
trains through: the LM head runs on the completion positions only, in chunks recomputed in the backward pass
(docs/performance.md#memory-of-the-log-probs), and `--micro_batching` lays a micro-batch out as padded, sorted or
packed rows with the same log-probs (docs/micro_batching.md). `--fp32_lm_head` (fp32_lm_head) makes the output
layer's product float32 for every caller of the layer. No loss here: the scripts compute theirs.
"""

from __future__ import annotations

import math
import types

import torch
from torch.utils.checkpoint import checkpoint

from shared import data as data_utils
from shared.distributed import max_over_ranks, output_head

def _fp32_linear(self, hidden: torch.Tensor) -> torch.Tensor:
    """The forward of an output layer under --fp32_lm_head: hidden @ W^T (+ b) with both operands upcast to float32
    and autocast off, float32 logits; the weight itself stays in the model's dtype (its gradient comes back in it)."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def fp32_lm_head(models: list, enabled: bool) -> None:
    """--fp32_lm_head: the output layer of each model (None skipped) computes its logits in float32 from now on
    (_fp32_linear): the lean log-probs here, the model's own forward and so HF generate (the `hf` sampler) and the
    end-of-run engine check; make_generator(fp32_lm_head=True) gives the vLLM sampler the same product (vLLM's
    head_dtype). The weights keep their dtype: optimizer, checkpoints and the engine's weights are unchanged, and a
    float32 model computes exactly what it did. Call after the models are prepared. A LoRA reference (the policy with
    its adapters off) shares the policy's layer. One-line errors: an output layer with a LoRA adapter (its product is
    peft's), or a frozen one that ZeRO-3 partitions (shared.distributed.output_head gathers it for each product in
    the model's dtype)."""
    if not enabled:
        return
    for model in models:
        head = None if model is None else getattr(model, "module", model).get_output_embeddings()
        if not isinstance(head, torch.nn.Module):  # None, or a LoRA reference's function over the policy's layer
            continue
        if not isinstance(head, torch.nn.Linear):
            raise ValueError(f"fp32_lm_head: the output layer is a {type(head).__name__}, not a plain Linear (an "
                             "adapter on it: leave it out of --lora_target_modules)")
        if all(hasattr(p, "ds_id") and not p.requires_grad for p in head.parameters()):
            raise ValueError("fp32_lm_head: a frozen output layer that ZeRO-3 partitions (a reference or a LoRA "
                             "policy under ZeRO-3) is not supported; launch with scripts/accelerate/zero2.yaml")
        head.forward = types.MethodType(_fp32_linear, head)


def token_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool = False):
    """log pi(target | prefix) at N positions from their final hidden states [N, H], [N]; optionally the entropy
    (differentiable: an entropy bonus backpropagates through it). Only these N rows of logits exist, upcast to
    float32 here (the model's dtype is bf16 on GPU)."""
    logits = lm_head(hidden).float() / temperature  # [N, V]
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1) if with_entropy else None
    return logp, entropy

def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                     temperature: float, with_entropy: bool = False, chunk_size: int = 512):
    """log pi(token_{t+1} | prefix) from logits / temperature at the positions t that predict a response token
    (response_mask[:, t+1] = 1), [B, L-1], 0 at the other positions; optionally the entropy there.
    The LM head runs on the response positions only, chunk_size at a time, and each chunk's logits are recomputed
    in the backward pass (docs/performance.md#memory-of-the-log-probs)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    # the model's own forward (a DeepSpeed engine's hooks run), computing the logits of the last position only
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                output_hidden_states=True, logits_to_keep=1)
    keep = response_mask[:, 1:].bool()  # [B, L-1]: position t predicts token t+1
    hidden = out.hidden_states[-1][:, :-1][keep]  # [N, H]: final (normed) hidden states of the kept positions
    targets = input_ids[:, 1:][keep]  # [N]
    lm_head = output_head(model)  # the output layer (ZeRO-3, frozen head: gathered per call)
    # as many chunks on every rank (at least one, so that N = 0 still backpropagates): each call of a ZeRO-3
    # partitioned lm_head gathers its weight, a collective
    num_chunks = max_over_ranks(max(1, math.ceil(len(targets) / chunk_size)))
    chunks = []
    for k in range(num_chunks):
        s = slice(k * chunk_size, (k + 1) * chunk_size)  # past N: an empty chunk
        chunks.append(checkpoint(token_logprobs, lm_head, hidden[s], targets[s], temperature, with_entropy,
                                 use_reentrant=False, preserve_rng_state=False))  # recomputed in backward
    logp = hidden.new_zeros(keep.shape, dtype=torch.float32)
    logp[keep] = torch.cat([lp for lp, _ in chunks])
    entropy = None
    if with_entropy:
        entropy = hidden.new_zeros(keep.shape, dtype=torch.float32)
        entropy[keep] = torch.cat([ent for _, ent in chunks])
    return logp, entropy

def packed_forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                            temperature: float, with_entropy: bool = False, chunk_size: int = 512,
                            width: int | None = None):
    """forward_logprobs of the same right-padded rows [B, L], as [B, L-1], computed with (almost) no padding: the
    sequences are packed, longest first, into rows of `width` tokens (default: the longest sequence), several per
    row, each with position ids restarting at 0, and no attention mask. transformers then starts a new sequence
    wherever a position id does not follow its predecessor (masking_utils.find_packed_sequence_indices: sdpa, eager,
    flex attention; flash attention's varlen path reads the same position ids) and confines attention to each
    sequence. That needs use_cache=False: with a cache (the config's default) the mask code skips the detection and
    attention crosses sequences (check_packing at start-up; tests/test_packing.py). Rows no wider than the longest
    sequence, rather than one row of all B sequences: sdpa and eager attend densely over a row under the mask, so
    their attention costs width^2 per row, B^2 times more in one row (docs/grpo.md). The free tail of a packed row
    (shorter than any sequence that did not fit) is padding that no real token attends to (it comes last)."""
    B, L = input_ids.shape
    real = attention_mask.bool()  # right padding: a row's tokens are its first n_i columns
    lengths = attention_mask.sum(1).tolist()
    width = width or max(lengths)
    place = data_utils.pack_rows(lengths, width)  # (packed row, offset) of each sequence
    num_rows = max(r for r, _ in place) + 1
    # flat index in the packed [num_rows, width] batch of each (row, column) of the padded one
    start = torch.tensor([r * width + o for r, o in place], device=input_ids.device)
    flat = (start[:, None] + torch.arange(L, device=input_ids.device)[None])[real]  # [N]
    ids = input_ids.new_zeros(num_rows * width)
    ids[flat] = input_ids[real]
    position_ids = torch.arange(width, device=input_ids.device).repeat(num_rows)  # the free tails: a sequence of
    position_ids[flat] = (attention_mask.cumsum(1) - 1)[real]  # their own; every packed sequence: 0..n_i-1
    out = model(input_ids=ids.view(num_rows, width), position_ids=position_ids.view(num_rows, width),
                use_cache=False, output_hidden_states=True, logits_to_keep=1)
    keep = response_mask[:, 1:].bool()  # [B, L-1]: position t of a row predicts its token t+1
    # the kept positions, in the row-major order of keep (as forward_logprobs): [num_rows * width, H] -> [n_kept, H]
    hidden = out.hidden_states[-1].reshape(num_rows * width, -1)[flat[torch.nn.functional.pad(keep, (0, 1))[real]]]
    targets = input_ids[:, 1:][keep]
    lm_head = output_head(model)  # the output layer (ZeRO-3, frozen head: gathered per call)
    num_chunks = max_over_ranks(max(1, math.ceil(len(targets) / chunk_size)))  # as in forward_logprobs
    chunks = []
    for k in range(num_chunks):
        s = slice(k * chunk_size, (k + 1) * chunk_size)
        chunks.append(checkpoint(token_logprobs, lm_head, hidden[s], targets[s], temperature, with_entropy,
                                 use_reentrant=False, preserve_rng_state=False))
    logp = hidden.new_zeros(keep.shape, dtype=torch.float32)
    logp[keep] = torch.cat([lp for lp, _ in chunks])
    entropy = None
    if with_entropy:
        entropy = hidden.new_zeros(keep.shape, dtype=torch.float32)
        entropy[keep] = torch.cat([ent for _, ent in chunks])
    return logp, entropy

def micro_batch_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                         layout: str, temperature: float, with_entropy: bool = False):
    """Log-probs (and entropies) of one micro-batch's right-padded rows [B, L], as [B, L-1] in every layout of
    --micro_batching, so that the rest of the step does not depend on it:
      padded: forward_logprobs on the rows as they are (padded to the whole batch's longest row)
      sorted: forward_logprobs on the columns up to the micro-batch's own longest row, zeros after it
      packed: packed_forward_logprobs (several sequences per row, position ids restarting, no padding)"""
    if layout == "packed":
        return packed_forward_logprobs(model, input_ids, attention_mask, response_mask, temperature, with_entropy)
    if layout == "padded":
        return forward_logprobs(model, input_ids, attention_mask, response_mask, temperature, with_entropy)
    if layout != "sorted":
        raise ValueError(f"micro_batching: expected padded, sorted or packed, got {layout!r}")
    n = int(attention_mask.sum(1).max())  # columns past the longest row hold padding only
    logp, entropy = forward_logprobs(model, input_ids[:, :n], attention_mask[:, :n], response_mask[:, :n],
                                     temperature, with_entropy)
    pad = (0, input_ids.shape[1] - n)
    return torch.nn.functional.pad(logp, pad), None if entropy is None else torch.nn.functional.pad(entropy, pad)


def batch_logprobs(models: list, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   lengths: list[int], num_micro_batches: int, layout: str, temperature: float) -> list[torch.Tensor]:
    """Log-probs [B, L-1] of the whole batch under each of `models` (zeros for a None), without gradient, in
    num_micro_batches micro-batches laid out by `layout` (data.micro_batches on the rows' token counts `lengths`),
    every model on a micro-batch before the next micro-batch."""
    out = [torch.zeros_like(response_mask[:, 1:], dtype=torch.float32) for _ in models]
    with torch.no_grad():
        for idx in data_utils.micro_batches(list(range(input_ids.shape[0])), lengths, num_micro_batches, layout):
            for model, logp in zip(models, out):
                if model is not None:
                    logp[idx] = micro_batch_logprobs(model, input_ids[idx], attention_mask[idx], response_mask[idx],
                                                     layout, temperature)[0]
    return out


def response_entropies(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, micro_batch_size: int,
                       temperature: float, device) -> list[torch.Tensor]:
    """The policy's entropy (no gradient) at the position predicting each response token, one CPU tensor per response
    in response-token coordinates (trailing padding included), micro_batch_size rows per forward."""
    out = []
    with torch.no_grad():
        for s in range(0, len(responses), micro_batch_size):
            p, r = prompts[s : s + micro_batch_size], responses[s : s + micro_batch_size]
            ids, attn, resp = data_utils.pad_batch(p, r, pad_id, device)
            _, ent = forward_logprobs(model, ids, attn, resp, temperature, True)
            out += [ent[j, len(p[j]) - 1 :].cpu() for j in range(len(r))]
    return out


def check_packing(model, prompts: list[list[int]], tol: float | None = None) -> None:
    """--micro_batching packed, at start-up: a one-line error unless the model keeps packed sequences apart.
    Of two sequences a, b (the first two distinct prompts), b is packed in one row after a + b, then after b + a
    (same length, other tokens); its log-probs must not move (attention does not cross sequences) and must equal
    b's alone (the model reads the restarted position ids), to within tol (default: 1e-4 in fp32, else 5e-2)."""
    a = prompts[0]
    b = next((p for p in prompts if p != a), a)
    param = next(model.parameters())
    device, tol = param.device, tol or (1e-4 if param.dtype == torch.float32 else 5e-2)
    rows = lambda seqs: data_utils.pad_batch([x[:1] for x in seqs], [x[1:] for x in seqs], 0, device)  # noqa: E731
    with torch.no_grad():
        width = len(a) + 2 * len(b)  # both in one packed row
        first = packed_forward_logprobs(model, *rows([a + b, b]), 1.0, width=width)[0][1, : len(b) - 1]
        swapped = packed_forward_logprobs(model, *rows([b + a, b]), 1.0, width=width)[0][1, : len(b) - 1]
        alone = forward_logprobs(model, *rows([b]), 1.0)[0][0]
    moved, off = (first - swapped).abs().max().item(), (first - alone).abs().max().item()
    if not max(moved, off) <= tol:
        impl = getattr(model.config, "_attn_implementation", "?")
        raise ValueError(f"micro_batching: packed: {type(model).__name__} (attention {impl}) does not keep packed "
                         f"sequences apart (a sequence's log-probs moved by {moved:.3g} when the one before it "
                         f"changed, {off:.3g} from its own); use --micro_batching sorted")
