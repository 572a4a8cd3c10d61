"""A frozen causal LM as the reader of linguistic calibration (algorithms/calibration.py, `--reader lm`): it answers
two prompts about a text, ExtractAnswers and ForecastProbs (Band et al. 2024, https://arxiv.org/abs/2404.00474, §3),
zero-shot. Plumbing only: the reward and the metrics computed from its forecasts stay in the script.

    read = LMReader(model, tokenizer, max_new_tokens)
    probe_reader(read)                                 # ValueError unless its forecasts follow stated chances
    forecasts, p_golds = read(rows, texts, finished)   # [{answer: p}], [p of row["answer"]]
"""

from __future__ import annotations

import torch


def split_answers(reply: str, max_answers: int = 4) -> list[str]:
    """The extraction's first line as answers: `No Answer` (or nothing) -> []; else split on ';', stripped,
    deduplicated in order (the reference deduplicates with a set), at most max_answers."""
    reply = reply.strip().split("\n")[0]
    if not reply or "No Answer" in reply:
        return []
    return list(dict.fromkeys(a.strip() for a in reply.split(";") if a.strip()))[:max_answers]


class LMReader:
    """`--reader lm`: a frozen causal LM as ExtractAnswers and ForecastProbs, zero-shot (no trained head). Extraction:
    greedy decoding of the reference's extraction instruction, split on ';', stripped, deduplicated in order (at most
    4), `No Answer` -> none. Forecast of answer a: p = P(Yes) / (P(Yes) + P(No)) for the next token after a question
    whether the text gives a as the answer (the gold answer is scored the same way, extracted or not)."""

    EXTRACT = ("You will receive a context paragraph and a question related to the paragraph. Provide a list of "
               "answers to the question which are provided in the paragraph, even if those answers are incorrect. "
               "Separate each answer with a semicolon. If there are no answers to the question in the paragraph, "
               "write \"No Answer\".\n\nContext paragraph:\n{text}\n\nQuestion:\n{question}")
    FORECAST = ("Question:\n{question}\n\nContext:\n{text}\n\nBased only on the Context, is \"{answer}\" a correct "
                "answer to the Question? Answer Yes or No.")

    def __init__(self, model, tokenizer, max_new_tokens: int):
        self.model, self.tok, self.max_new_tokens = model.eval().requires_grad_(False), tokenizer, max_new_tokens
        self.yes_no = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No")]

    def _ids(self, content: str) -> torch.Tensor:
        if self.tok.chat_template:
            ids = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tok(content + "\n")["input_ids"]
        return torch.tensor([ids], device=self.model.device)

    @torch.no_grad()
    def extract(self, question: str, text: str) -> list[str]:
        ids = self._ids(self.EXTRACT.format(text=text, question=question))
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=self.max_new_tokens, pad_token_id=self.tok.pad_token_id)
        return split_answers(self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

    @torch.no_grad()
    def forecast(self, question: str, text: str, answer: str) -> float:
        logits = self.model(self._ids(self.FORECAST.format(question=question, text=text, answer=answer))).logits
        return torch.softmax(logits[0, -1, self.yes_no].float(), 0)[0].item()

    def __call__(self, rows: list[dict], texts: list[str], finished: list[bool]) -> tuple[list[dict], list[float]]:
        forecasts, p_golds = [], []
        for row, text, done in zip(rows, texts, finished):
            answers = self.extract(row["prompt"], text) if done else []
            forecasts.append({a: self.forecast(row["prompt"], text, a) for a in answers})
            gold = str(row["answer"]).strip()
            p_golds.append(forecasts[-1][gold] if gold in forecasts[-1] else
                           self.forecast(row["prompt"], text, gold) if done else 0.0)
        return forecasts, p_golds


PROBE_ROW = {"prompt": "What is 12 + 7?", "answer": "19"}
PROBE_CHANCES = (90, 50, 10)  # percent, stated in the probe texts


def probe_reader(read, min_gap: float = 0.3) -> None:
    """Raises ValueError (one line, with what the reader did) unless the reader reads stated claims: on the texts
    `The sum is 19. I am c% sure of it.` (c = 90, 50, 10) it must extract exactly `19`, its p(19) must fall by at
    least min_gap from c = 90 to c = 10 and never rise, and at c = 90 a wrong answer (18) must get less than 19.
    RL against a reader that fails this trains on noise (its reward does not depend on the stated confidence)."""
    texts = [f"The sum is 19. I am {c}% sure of it." for c in PROBE_CHANCES]
    forecasts, p_golds = read([PROBE_ROW] * len(texts), texts, [True] * len(texts))
    p_wrong = read([{**PROBE_ROW, "answer": "18"}], texts[:1], [True])[1][0]
    extracted = all(list(f) == ["19"] for f in forecasts)
    follows = p_golds[0] - p_golds[-1] >= min_gap and all(a >= b for a, b in zip(p_golds, p_golds[1:]))
    if not (extracted and follows and p_wrong < p_golds[0]):
        shown = "/".join(f"{p:.3f}" for p in p_golds)
        raise ValueError(f"reader: its forecasts do not follow stated chances (probe `The sum is 19. I am c% sure of "
                         f"it.`, c = {'/'.join(map(str, PROBE_CHANCES))}: p(19) {shown}, p(18) at 90% {p_wrong:.3f}, "
                         f"extracted {[list(f) for f in forecasts][0]}); RL against it would train on noise: use "
                         f"--reader parser, or a --reader_model_path that reads claims")
