"""Worker of tests/test_lean_logprobs.py::test_lean_logprobs_under_deepspeed, launched on 2 ranks with
`accelerate launch --config_file scripts/accelerate/zero{2,3}.yaml tests/lean_logprobs_ranks.py`.

For each script's log-prob function, one SGD step (lr 1, so the weights move by the gradient) of the tiny policy
wrapped in a DeepSpeed engine, once with the lean function and once with the full-logits reference, from the same
weights and data; the two updated models must agree. The ranks hold different numbers of response tokens (1 and 4
chunks of 4), and `stage3_param_persistence_threshold: 0` makes ZeRO-3 partition even the tiny LM head, so that
every call of it gathers its weight across ranks: with unequal chunk counts the ranks would deadlock. Untied and
tied embeddings, and a frozen output layer as under LoRA (shared.distributed.output_head gathers it per call under
ZeRO-3). Writes one JSON file per rank: the largest weight difference per function.
"""

import copy
import json
import os
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from algorithms import dpo, repulse, sft
from shared import data, logprobs
from shared.distributed import full_named_parameters, init_distributed, prepare
from shared.tiny import build_tokenizer, tiny_config


def reference_logprobs(model, input_ids, attention_mask, temperature=1.0):
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    return logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def token_loss(logp, resp, w):
    return (w * logp * resp[:, 1:]).sum()


def sequence_loss(s, resp, w):  # dpo: a loss on the per-sequence sums
    return (w[:, 0] * s).sum()


LEAN = {  # name: (log-probs, loss)
    "grpo": (lambda m, ids, attn, resp: logprobs.forward_logprobs(m, ids, attn, resp, 0.7, True, 4)[0], token_loss),
    "dpo": (lambda m, ids, attn, resp: dpo.sequence_logps(m, ids, attn, resp, 0.7, 4)[0], sequence_loss),
    "repulse": (lambda m, ids, attn, resp: repulse.forward_logprobs(m, ids, attn, resp[:, 1:], 4), token_loss),
    "sft": (lambda m, ids, attn, resp: -sft.sequence_nll(m, ids, attn, resp, 4)[0], token_loss),
}
FROZEN_HEAD = ["grpo", "dpo", "sft"]  # the same output_head path in every script; three of them with a frozen head
REFERENCE = {
    "grpo": (lambda m, ids, attn, resp: reference_logprobs(m, ids, attn, 0.7), token_loss),
    "dpo": (lambda m, ids, attn, resp: (reference_logprobs(m, ids, attn, 0.7) * resp[:, 1:]).sum(1), sequence_loss),
    "repulse": (lambda m, ids, attn, resp: reference_logprobs(m, ids, attn), token_loss),
    "sft": (lambda m, ids, attn, resp: reference_logprobs(m, ids, attn), token_loss),
}


def main():
    info = init_distributed()
    info.ds_base_config.update(zero_allow_untested_optimizer=True,  # plain SGD
                               zero_optimization={"stage3_param_persistence_threshold": 0})
    tok = build_tokenizer()
    prompts = [tok(x).input_ids for x in (["1+2=", "3="] if info.rank == 0 else ["12+30=", "7+8+9="])]
    responses = [tok(x, add_special_tokens=False).input_ids + [tok.eos_token_id]
                 for x in (["3", ""] if info.rank == 0 else ["42", "24\n5\n6\n7"])]  # 3 and 13 response tokens
    ids, attn, resp = data.pad_batch(prompts, responses, tok.pad_token_id)
    weights = torch.randn(resp[:, 1:].shape, generator=torch.Generator().manual_seed(info.rank))
    out = {"rank": info.rank, "zero_stage": info.zero_stage}
    for tied, frozen_head in ((False, False), (True, False), (False, True), (True, True)):
        torch.manual_seed(0)
        cfg = tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        cfg.tie_word_embeddings = tied
        base = LlamaForCausalLM(cfg)
        if frozen_head:  # as under LoRA: the output layer (and, tied, the embedding) frozen, the rest trained
            base.get_output_embeddings().requires_grad_(False)
        for name in FROZEN_HEAD if frozen_head else LEAN:
            updated = []
            for fn, loss in (REFERENCE[name], LEAN[name]):
                model = copy.deepcopy(base)
                optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
                engine, _, _ = prepare(model, optimizer, None, info, micro_batch_size=2, grad_accum=1,
                                       max_grad_norm=0.0, dtype=torch.float32)
                logp = fn(engine, ids, attn, resp)
                engine.backward(loss(logp, resp, weights), scale_wrt_gas=False)
                engine.step()
                updated.append(dict(full_named_parameters(engine, info)))
            moved = max((updated[0][n] - p).abs().max().item() for n, p in base.named_parameters())
            diff = max((updated[0][n] - updated[1][n]).abs().max().item() for n in updated[0])
            key = f"{name}{'_tied' if tied else ''}{'_frozen_head' if frozen_head else ''}"
            out[key] = {"max_weight_diff": diff, "max_update": moved}
    # One file per rank: two ranks printing to one pipe can interleave their lines.
    Path(os.environ["LEAN_RESULT_DIR"], f"rank{info.rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
