"""Scalar-head models: reward models and critics, as HF `AutoModelForSequenceClassification(num_labels=1)`.

One format for both, so a reward model trained here (or any HF sequence-classification checkpoint) loads
with `from_pretrained`, can initialise a critic, and scores completions the same way everywhere:

    rm = load_scalar_model(path, dtype)               # reward model or critic
    scores = score_last_token(rm, input_ids, attn)    # [B], read at the last non-pad token
    values = token_values(critic, input_ids, attn)    # [B, L], one value per position

The score is read at index `attention_mask.sum(1) - 1` of right-padded batches, never located through
`pad_token_id` (HF's own pooling finds the first pad token, which is wrong when pad == eos). If the
checkpoint's config stores `reward_mean` / `reward_std` (written by a reward-model trainer), scores are
returned normalised as (r - mean) / std.
"""

from __future__ import annotations

import math

import torch

from shared.lora import base_module


def load_scalar_model(path: str, dtype: torch.dtype):
    """A backbone with a 1-output linear head; a causal-LM checkpoint gets a freshly initialised head."""
    from transformers import AutoModelForSequenceClassification

    from shared.distributed import disable_dropout

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
    disable_dropout(model)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def head(model) -> torch.nn.Module:
    """The model's scalar head (`score` for Llama/Qwen/Mistral, `classifier` for others); with LoRA, the wrapper
    holding its trained copy."""
    module = base_module(model)
    for name in ("score", "classifier", "v_head"):
        if hasattr(module, name):
            return getattr(module, name)
    raise ValueError(f"{type(module).__name__} has no scalar head (expected .score or .classifier)")


def load_reward_model(path: str, tokenizer, info, dtype: torch.dtype):
    """A frozen reward model scoring the policy's completions (checked to share its tokenizer), prepared like a
    frozen reference (partitioned under ZeRO-3); it scores at the last non-pad token, normalised as above. A causal LM
    whose config.json names a verifier (a GenRM or an implicit PRM, shared/verifier.py) loads as that verifier, and
    `score_sequences` scores with it."""
    from shared.distributed import prepare_frozen
    from shared.verifier import load_verifier, verifier_kind

    check_same_tokenizer(path, tokenizer)
    if verifier_kind(path):
        return load_verifier(path, tokenizer, info, dtype)
    return prepare_frozen(load_scalar_model(path, dtype), info, dtype)


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Head output at every position, [B, L] (fp32)."""
    module = base_module(model)  # a DeepSpeed engine's module; a LoRA model's transformers model
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    base = getattr(module, module.base_model_prefix)
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    return head(module)(hidden).squeeze(-1).float()


def score_last_token(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     normalize: bool = True) -> torch.Tensor:
    """Score of each right-padded sequence at its last non-pad token, [B]; normalised if the config has stats."""
    values = token_values(model, input_ids, attention_mask)
    last = attention_mask.sum(1).long() - 1
    scores = values.gather(1, last.unsqueeze(1)).squeeze(1)
    return normalized(scores, model) if normalize else scores


def normalized(values: torch.Tensor, model) -> torch.Tensor:
    """(v - mean) / std with the score stats stored in the model's config by a reward-model trainer (rm.py), so that
    a reward model's scores, and the values of a critic initialised from it, share units; unchanged without stats."""
    config = getattr(model, "module", model).config
    if getattr(config, "reward_mean", None) is None:
        return values
    return (values - config.reward_mean) / max(float(getattr(config, "reward_std", 1.0)), 1e-8)


def score_sequences(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int, info,
                    micro_batch_size: int) -> torch.Tensor:
    """Normalised scores of prompt + response pairs, [N], in right-padded micro-batches (no grad). Every rank runs
    the same number of forwards (a dummy one when it has run out), as a ZeRO-3-partitioned model requires. A
    verifier loaded by `load_reward_model` gives its own score (shared/verifier.py: p(yes), or a line reward)."""
    from shared.data import pad_batch
    from shared.verifier import GenerativeVerifier, ImplicitPRM, verifier_scores

    if isinstance(model, (GenerativeVerifier, ImplicitPRM)):
        return verifier_scores(model, prompts, responses, pad_id, info, micro_batch_size)

    n_local = torch.tensor([math.ceil(len(responses) / micro_batch_size)])
    n_batches = int(info.all_reduce(n_local, "max").item())
    out = []
    with torch.no_grad():
        for b in range(n_batches):
            p = prompts[b * micro_batch_size : (b + 1) * micro_batch_size]
            r = responses[b * micro_batch_size : (b + 1) * micro_batch_size]
            ids, attn, _ = pad_batch(p or [[pad_id]], r or [[pad_id]], pad_id, info.device)
            scores = score_last_token(model, ids, attn)
            if r:
                out.append(scores)
    return torch.cat(out) if out else torch.zeros(0, device=info.device)


def use_distinct_pad_token(tokenizer) -> str | None:
    """Make the tokenizer's pad token differ from its EOS when they are the same (SmolLM2, Llama-3 padded with EOS),
    choosing its unknown token or another special token that is not EOS; return the new pad token, or None when it
    already differed (or no candidate exists). Why: HF's own `...ForSequenceClassification` forward, which TRL, vLLM
    and OpenRLHF use, reads the score at the rightmost token that is not the pad id; with pad == EOS that is the
    token before EOS, while this project reads at EOS (the last token by length): the same checkpoint would score
    differently elsewhere. The vocabulary is unchanged, so the model still shares the policy's tokenizer."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if pad is not None and pad != eos:
        return None
    candidates = [tokenizer.unk_token] + list(getattr(tokenizer, "all_special_tokens", []))
    for token in candidates:
        if token is not None and tokenizer.convert_tokens_to_ids(token) not in (eos, None):
            tokenizer.pad_token = token
            return token
    return None


def check_same_tokenizer(model_path: str, tokenizer, what: str = "reward_model_path") -> None:
    """Scores are computed on the policy's token ids, so the scalar model must share the policy's vocabulary."""
    from shared.distributed import load_tokenizer

    try:
        other = load_tokenizer(model_path)
    except (OSError, ValueError):
        return  # no tokenizer saved with the model: nothing to compare
    if other.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{what}: {model_path} has a different tokenizer from the policy; its scores would read "
                         "the policy's token ids as its own (train the reward model on the policy's tokenizer)")
