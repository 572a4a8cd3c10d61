"""Verifiers that are language models: scores of a completion read off a causal LM, for rewards and best-of-N.

A checkpoint is one of these when its config.json carries the key below; `shared/scalar.py`'s `load_reward_model`
then loads it (so every script's `--reward_model_path` takes it) and `score_sequences` scores with it:

  genrm_mode "direct" | "cot"     a generative verifier (algorithms/genrm.py). The verifier reads the policy's prompt
                                  and completion tokens as sampled, then the verification question (`genrm_question`),
                                  and its score is p(verdict = `genrm_yes`): the product of the verdict's token
                                  probabilities (one token normally). "cot": first K = `genrm_num_rationales`
                                  rationales are sampled after `genrm_cot_prompt` at `genrm_temperature`, each ending
                                  in the question (a stop string); the score is the mean of their p(yes), and a
                                  rationale that ends without the question scores 0.
  implicit_prm_reference, _beta   an implicit PRM (algorithms/implicit_prm.py): per token d_t = log pi(y_t) - log
                                  pi_ref(y_t); a line's reward is beta * the sum of d_t over its tokens (its ending
                                  newline included, EOS in the last line); the score is the minimum over lines.

Scores are probabilities (GenRM) or log-ratios (implicit PRM), never normalised: a verifier ranks, a reward model's
scale is the RL script's business.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from shared.units import line_spans


def verifier_kind(path: str) -> str | None:
    """"genrm", "implicit_prm" or None (a scalar reward model), from the checkpoint's config.json."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    keys = json.loads(config.read_text())
    if keys.get("genrm_mode"):
        return "genrm"
    if keys.get("implicit_prm_reference"):
        return "implicit_prm"
    return None


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a piece of text inside a sequence (no BOS, no EOS)."""
    return tokenizer(text, add_special_tokens=False).input_ids if text else []


def sequence_prob(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """p(ids) from the logits at the positions predicting them, [B, m, V] -> [B]: the product over j of
    softmax(logits[:, j])[ids[j]] (a one-token verdict: one softmax entry over the full vocabulary)."""
    logp = torch.log_softmax(logits.float(), -1)[:, torch.arange(len(ids)), torch.tensor(ids)]  # [B, m]
    return logp.sum(-1).exp()


def continuation_logprob(model, contexts: list[list[int]], ids: list[int], pad_id: int, device) -> torch.Tensor:
    """log p(ids | context) for every context, [B] (one forward; no grad)."""
    from shared.data import pad_batch
    from shared.logprobs import forward_logprobs

    input_ids, attn, resp = pad_batch(contexts, [ids] * len(contexts), pad_id, device)
    with torch.no_grad():
        logp, _ = forward_logprobs(model, input_ids, attn, resp, 1.0)
    return logp.sum(1).float()


def _batched(n: int, micro_batch_size: int, info) -> int:
    """Forwards every rank runs (the largest count over ranks: a ZeRO-3-partitioned model needs as many everywhere)."""
    n_local = torch.tensor([math.ceil(n / micro_batch_size)])
    return int(info.all_reduce(n_local, "max").item())


class GenerativeVerifier:
    """A GenRM checkpoint (module docstring) with its question and verdict strings as token ids."""

    def __init__(self, model, tokenizer, config, zero_stage: int = 0):
        self.model, self.tokenizer, self.zero_stage = model, tokenizer, zero_stage
        self.mode = config.genrm_mode
        self.question = text_ids(tokenizer, config.genrm_question)
        self.yes, self.no = text_ids(tokenizer, config.genrm_yes), text_ids(tokenizer, config.genrm_no)
        self.question_text = config.genrm_question
        self.question_tail = text_ids(tokenizer, config.genrm_question[len(config.genrm_question.rstrip()):])
        self.cot_prompt = text_ids(tokenizer, getattr(config, "genrm_cot_prompt", ""))
        self.num_rationales = int(getattr(config, "genrm_num_rationales", 1))
        self.temperature = float(getattr(config, "genrm_temperature", 0.7))
        self.max_rationale_tokens = int(getattr(config, "genrm_max_rationale_tokens", 64))
        self.seed = int(getattr(config, "genrm_seed", 0))
        self.loss_type = getattr(config, "genrm_loss_type", "nll")  # bce: the classifier's score is p(yes)/(p(yes)+p(no))

    def verdict_probs(self, contexts: list[list[int]], pad_id: int, info, micro_batch_size: int,
                      with_no: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """p(yes | context) and, `with_no`, p(no | context), [N] each; contexts end with the question."""
        n_batches = _batched(len(contexts), micro_batch_size, info)
        yes, no = [], []
        for b in range(n_batches):
            chunk = contexts[b * micro_batch_size : (b + 1) * micro_batch_size] or [[pad_id]]
            yes.append(continuation_logprob(self.model, chunk, self.yes, pad_id, info.device).exp())
            if with_no:
                no.append(continuation_logprob(self.model, chunk, self.no, pad_id, info.device).exp())
        cut = lambda parts: torch.cat(parts)[: len(contexts)].cpu() if parts else torch.zeros(0)  # noqa: E731
        return cut(yes), (cut(no) if with_no else None)

    def rationales(self, prompts: list[list[int]], responses: list[list[int]], info, seed: int | None = None,
                   index_offset: int = 0) -> list:
        """K sampled rationales per (prompt, response) after the CoT prompt, [N][K] Completions (stop: the question);
        the random stream is seeded by `seed` and the first response's index (shared/generation.py)."""
        from shared.generation import HFGenerator

        stop = (self.question_text.strip(),)
        generator = HFGenerator(self.model, self.tokenizer, synced_gpus=self.zero_stage == 3, stop=stop)
        contexts = [p + r + self.cot_prompt for p, r in zip(prompts, responses)]
        return generator.generate(contexts, n=self.num_rationales, temperature=self.temperature, top_p=1.0,
                                  max_new_tokens=self.max_rationale_tokens,
                                  seed=self.seed if seed is None else seed, index_offset=index_offset)

    def score(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int, info, micro_batch_size: int,
              with_no: bool = False, seed: int | None = None) -> dict:
        """{"p_yes": [N], "p_no": [N] (with_no), "no_verdict": [N] fraction of rationales without the question}."""
        if self.mode == "direct":
            contexts = [p + r + self.question for p, r in zip(prompts, responses)]
            p_yes, p_no = self.verdict_probs(contexts, pad_id, info, micro_batch_size, with_no)
            return {"p_yes": p_yes, "p_no": p_no, "no_verdict": torch.zeros(len(prompts))}
        groups = []  # K rationales per response, micro_batch_size responses per generate call (as many on every rank)
        for b in range(_batched(len(prompts), micro_batch_size, info)):
            chunk = slice(b * micro_batch_size, (b + 1) * micro_batch_size)
            groups += self.rationales(prompts[chunk], responses[chunk], info, seed, b * micro_batch_size)
        contexts, owner, ended = [], [], []
        for i, (p, r, group) in enumerate(zip(prompts, responses, groups)):
            for c in group:
                ok = has_question(self.tokenizer, c.token_ids, self.question_text)
                ended.append(ok)
                if ok:  # generation stopped at the question's last visible character: its trailing blanks follow
                    contexts.append(p + r + self.cot_prompt + c.token_ids + self.question_tail)
                    owner.append(i)
        p_yes, p_no = self.verdict_probs(contexts, pad_id, info, micro_batch_size, with_no)
        return {"p_yes": cot_mean(p_yes, owner, len(prompts), self.num_rationales),
                "p_no": cot_mean(p_no, owner, len(prompts), self.num_rationales) if with_no else None,
                "no_verdict": 1 - torch.tensor(ended, dtype=torch.float32).view(len(prompts), -1).mean(1)}


def has_question(tokenizer, rationale_ids: list[int], question: str) -> bool:
    """True when a sampled rationale ends in the verification question (the stop string), so a verdict follows."""
    return tokenizer.decode(rationale_ids, skip_special_tokens=True).rstrip().endswith(question.strip())


def cot_mean(p_yes: torch.Tensor, owner: list[int], n: int, k: int) -> torch.Tensor:
    """GenRM-CoT's score: (1/K) sum_k p_k(yes) per response, rationales without a verdict counting 0. p_yes holds
    the verdict probabilities of the rationales that reached the question, owner[j] the response of p_yes[j]."""
    out = torch.zeros(n, dtype=torch.float32)
    if len(owner):
        out.index_add_(0, torch.tensor(owner), p_yes.float())
    return out / k


class ImplicitPRM:
    """An implicit-PRM checkpoint (module docstring): the trained model, its frozen reference and beta."""

    def __init__(self, model, reference, tokenizer, beta: float):
        self.model, self.reference, self.tokenizer, self.beta = model, reference, tokenizer, beta
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # as shared/generation.py decodes

    def token_rewards(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      info) -> list[torch.Tensor]:
        """beta * (log pi - log pi_ref) of every response token, one [T_i] tensor per response."""
        from shared.data import pad_batch
        from shared.logprobs import forward_logprobs

        input_ids, attn, resp = pad_batch(prompts or [[pad_id]], responses or [[pad_id]], pad_id, info.device)
        with torch.no_grad():
            d = (forward_logprobs(self.model, input_ids, attn, resp, 1.0)[0]
                 - forward_logprobs(self.reference, input_ids, attn, resp, 1.0)[0])
        keep = resp[:, 1:].bool()
        return [self.beta * d[i][keep[i]].cpu() for i in range(len(responses))]

    def score(self, prompts: list[list[int]], responses: list[list[int]], pad_id: int, info,
              micro_batch_size: int) -> dict:
        """{"min": min over lines of the line rewards, "sum": beta * log pi/pi_ref of the whole response}, [N] each."""
        mins, sums = [], []
        for b in range(_batched(len(responses), micro_batch_size, info)):
            p = prompts[b * micro_batch_size : (b + 1) * micro_batch_size]
            r = responses[b * micro_batch_size : (b + 1) * micro_batch_size]
            for ids, rewards in zip(r, self.token_rewards(p, r, pad_id, info)):
                lines = line_rewards(rewards, line_spans(self.decode, ids))
                mins.append(min(lines) if lines else 0.0)
                sums.append(float(rewards.sum()))
        return {"min": torch.tensor(mins), "sum": torch.tensor(sums)}


def line_rewards(token_rewards: torch.Tensor, spans: list[tuple[int, int]]) -> list[float]:
    """Sum of the token rewards of each line (the spans of shared/units.py's line_spans partition the tokens)."""
    return [float(token_rewards[a:b].sum()) for a, b in spans]


def load_verifier(path: str, tokenizer, info, dtype: torch.dtype):
    """The frozen verifier of a checkpoint whose config.json names its kind (module docstring)."""
    from shared.distributed import load_causal_lm, load_tokenizer, prepare_frozen

    model = prepare_frozen(load_causal_lm(path, dtype), info, dtype)
    config = getattr(model, "module", model).config
    if verifier_kind(path) == "genrm":
        return GenerativeVerifier(model, load_tokenizer(path), config, info.zero_stage)
    from shared.models import resolve_model_path

    reference_path = resolve_model_path(config.implicit_prm_reference, f"implicit_prm_reference of {path}/config.json")
    reference = prepare_frozen(load_causal_lm(reference_path, dtype), info, dtype)
    return ImplicitPRM(model, reference, load_tokenizer(path), float(config.implicit_prm_beta))


def verifier_scores(verifier, prompts: list[list[int]], responses: list[list[int]], pad_id: int, info,
                    micro_batch_size: int) -> torch.Tensor:
    """The reward of each completion: p(yes) for a GenRM (p(yes) / (p(yes) + p(no)) for one trained with
    `--loss_type bce`, the score it was trained on), the minimum line reward for an implicit PRM, [N]."""
    if isinstance(verifier, GenerativeVerifier):
        out = verifier.score(prompts, responses, pad_id, info, micro_batch_size, with_no=verifier.loss_type == "bce")
        score = out["p_yes"] / (out["p_yes"] + out["p_no"]) if verifier.loss_type == "bce" else out["p_yes"]
        return score.to(info.device)
    return verifier.score(prompts, responses, pad_id, info, micro_batch_size)["min"].to(info.device)
