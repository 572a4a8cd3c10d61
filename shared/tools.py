"""Multi-turn tool episodes: a calculator the model calls in the middle of its response, batched turn by turn.

    prompt    "3+4+5="
    response  "<<3+4="  "7>>"  "\\n<<7+5="  "12>>"  "\\n12"  EOS
    mask        1 ...    0 ..     1 ...      0 ...    1 ...  1          1: the model's tokens, 0: the tool's

Call syntax (the grade-school-math calculator's, writable by the character tokenizer): the model writes `<<`, an
expression and `=`; generation stops at `=` (the stop string is kept: it is a model token with its sampled
log-prob); the tool appends the value and `>>` (`observation`); the model goes on. An expression is digits and
`+ - *` only, at most 32 characters, evaluated by an integer parser (`calculate`; no `eval`). Anything else, or an
`=` with no `<<` earlier in its turn, gets `ERR>>` and is counted as malformed, never raised.

`ToolGenerator` wraps a generator of shared/generation.py with the same `generate` call and returns `Episode`s
(`token_ids`, `logprobs`, `finish_reason`, `finished` as a `Completion`, plus the 0/1 `model_mask` and the call
counts), so graders, reward models and evaluation take them unchanged. Each round, every unfinished episode of the
call generates on from its prompt plus its response so far, in one engine call (one budget per episode: what is
left of `max_new_tokens`, which counts the tool's tokens too). The engine's ids are appended verbatim; only the
observation text is tokenised (alone). Past `max_tool_calls` calls no tool runs: an `=` there is an ordinary model
token and the episode generates on (a round in which no episode may call is generated without the `=` stop);
`max_tool_calls = 0` is plain generation. An observation that does not fit the budget ends the episode as
truncated ("length"). Seeding: round r of a call uses the call's seed shifted by r (shared/generation.py's rule).
Under ZeRO-3 (an engine with `synced_gpus`: HF generation, where every forward gathers the shards from all ranks)
the ranks agree on the number of rounds: each round starts while any rank has an unfinished episode (an all-reduce),
and a rank with none makes an empty call, the engine's dummy forward, so every rank makes the same engine calls.

Chat turns (`turns="chat"`, `chat_tool_turn`): the result is not written into the assistant's text but comes as a
`tool` message (`user` where the template has no tool role): the observation is what the chat template renders after
the call (the end of the assistant's turn, the tool turn, the next assistant header), found by rendering a short
conversation with and without the tool message, as TRL's GRPO tool loop does; a template that renders the earlier
messages differently once a tool message follows (not prefix-preserving) is a start-up error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from shared.distributed import max_over_ranks

CALL_OPEN, CALL_STOP, RESULT_CLOSE, ERROR = "<<", "=", ">>", "ERR"
MAX_EXPRESSION = 32  # characters
_EXPRESSION = re.compile(r"[0-9]+(?:[-+*][0-9]+)*")
ROUND_SEED = 10_007  # round r of a call samples with seed + r * ROUND_SEED


def calculate(expression: str) -> int | None:
    """The integer value of `expression` (digits and + - *, `*` before `+`/`-`, left to right), or None when it is
    not one (any other character, an operator without two operands, more than MAX_EXPRESSION characters)."""
    if len(expression) > MAX_EXPRESSION or not _EXPRESSION.fullmatch(expression):
        return None
    parts = re.split(r"([-+])", expression)  # "3*4-2" -> ["3*4", "-", "2"]
    total = math.prod(int(x) for x in parts[0].split("*"))
    for op, term in zip(parts[1::2], parts[2::2]):
        value = math.prod(int(x) for x in term.split("*"))
        total = total + value if op == "+" else total - value
    return total


def observation(turn: str) -> tuple[str, bool]:
    """The tool's reply to a model turn that ended with `=`: the value of the text between the turn's last `<<` and
    its last `=`, then `>>`; `ERR>>` and False when there is no `<<` or that text is not an expression."""
    head = turn[: turn.rfind(CALL_STOP)]
    start = head.rfind(CALL_OPEN)
    value = calculate(head[start + len(CALL_OPEN):]) if start >= 0 else None
    return (ERROR if value is None else str(value)) + RESULT_CLOSE, value is not None


def tool_response(terms: list[int], per_line: bool = False) -> str:
    """The sum of `terms` written with the calculator, the answer on its own last line (shared/task.py grades the
    last line): one call on the whole expression, [3, 4, 5] -> "<<3+4+5=12>>\n12"; `per_line`: one call per running
    sum, "<<3+4=7>>\n<<7+5=12>>\n12"."""
    if not per_line:
        return f"{CALL_OPEN}{'+'.join(map(str, terms))}{CALL_STOP}{sum(terms)}{RESULT_CLOSE}\n{sum(terms)}"
    lines, total = [], terms[0]
    for t in terms[1:]:
        lines.append(f"{CALL_OPEN}{total}+{t}{CALL_STOP}{total + t}{RESULT_CLOSE}")
        total += t
    return "\n".join(lines + [str(total)])


def segments(text: str) -> list[tuple[str, int]]:
    """A response in the call syntax split into (text, 1) model spans and (text, 0) tool results: each result is
    what follows a call's `=` up to and including the next `>>`. "<<3+4=7>>\\n9" -> [("<<3+4=", 1), ("7>>", 0),
    ("\\n9", 1)]."""
    out, pos = [], 0
    for m in re.finditer(re.escape(CALL_OPEN) + r"[^=\n]*" + re.escape(CALL_STOP) + r"([^\n]*?" +
                         re.escape(RESULT_CLOSE) + ")", text):
        out += [(text[pos : m.start(1)], 1), (m.group(1), 0)]
        pos = m.end(1)
    out.append((text[pos:], 1))
    return [(t, keep) for t, keep in out if t]


def encode_segments(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids and 0/1 loss mask of a response in the call syntax, each segment tokenised alone (as the episode
    loop appends observations), then EOS (mask 1); sft.py's `--tool_results`."""
    ids, mask = [], []
    for part, keep in segments(text):
        part_ids = tokenizer(part, add_special_tokens=False).input_ids
        ids += part_ids
        mask += [keep] * len(part_ids)
    return ids + [tokenizer.eos_token_id], mask + [1]


def chat_tool_turn(tokenizer) -> Callable[[str], str]:
    """text -> the observation text that closes the assistant's turn and gives `text` as a tool turn, then opens the
    next assistant turn (module docstring); checked once here."""
    base = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "<<1+1="}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    role = "tool"

    def render(text: str) -> str:
        after = tokenizer.apply_chat_template(base + [{"role": role, "content": text}], tokenize=False,
                                              add_generation_prompt=True)
        if not after.startswith(before) or text not in after[len(before):]:
            raise ValueError("tool_turns: the chat template is not prefix-preserving (a tool message after the "
                             "assistant's changes how the earlier messages render); use --tool_turns inline")
        return before[before.rindex("<<1+1=") + len("<<1+1="):] + after[len(before):]

    try:
        render("2>>")
    except Exception:  # no tool role in the template (it raises, or drops the message): the result as a user turn
        role = "user"
        render("2>>")
    return render


@dataclass
class Episode:
    token_ids: list[int] = field(default_factory=list)  # the response: model and tool tokens in order
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob per token, 0.0 on tool tokens
    model_mask: list[int] = field(default_factory=list)  # 1 on the model's tokens, 0 on the tool's
    finish_reason: str = "length"  # "stop" (EOS or a --stop string) or "length" (the budget ran out)
    calls: int = 0  # tool calls answered (well-formed or not)
    malformed: int = 0  # calls answered with ERR>>
    turn_limited: bool = False  # it wrote an `=` after its max_tool_calls-th call (no tool ran)
    done: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"


class ToolGenerator:
    """`generate` with the calculator in the loop (module docstring); `engine` is make_generator's generator."""

    def __init__(self, engine, tokenizer, max_tool_calls: int, stop=(), turns: str = "inline"):
        self.engine, self.tokenizer, self.max_tool_calls, self.stop = engine, tokenizer, max_tool_calls, tuple(stop)
        self.wrap = chat_tool_turn(tokenizer) if turns == "chat" else (lambda text: text)  # the observation's text

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int, index_offset: int = 0) -> list[list[Episode]]:
        episodes = [Episode() for _ in range(len(prompts) * n)]  # prompt-major, n per prompt
        contexts = [p for p in prompts for _ in range(n)]
        active = list(range(len(episodes)))
        synced = getattr(self.engine, "synced_gpus", False)  # HF under ZeRO-3: every rank must make the same calls
        for rnd in range(max_new_tokens):  # every round generates at least one token of each active episode
            if not (max_over_ranks(int(bool(active))) if synced else active):  # synced: until no rank has one
                break
            if not active:  # this rank is done, another is not: an empty call (the engine's dummy forward)
                self.engine.generate([], n=1, temperature=temperature, top_p=top_p, max_new_tokens=1,
                                     seed=seed + rnd * ROUND_SEED, stop=self.stop)
                continue
            may_call = any(episodes[i].calls < self.max_tool_calls for i in active)
            outs = self.engine.generate([contexts[i] + episodes[i].token_ids for i in active], n=1,
                                        temperature=temperature, top_p=top_p,
                                        max_new_tokens=[max_new_tokens - len(episodes[i].token_ids) for i in active],
                                        seed=seed + rnd * ROUND_SEED, index_offset=index_offset * n,
                                        stop=self.stop + ((CALL_STOP,) if may_call else ()))
            for i, (c,) in zip(active, outs):
                self._step(episodes[i], c, max_new_tokens)
            active = [i for i in active if not episodes[i].done]
        return [episodes[k * n : (k + 1) * n] for k in range(len(prompts))]

    def _step(self, ep: Episode, c, max_new_tokens: int) -> None:
        """Append one round's completion `c` to `ep`, then end it, answer its call, or let it go on."""
        ep.token_ids += c.token_ids
        ep.logprobs += c.logprobs
        ep.model_mask += [1] * len(c.token_ids)
        turn = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if ep.calls >= self.max_tool_calls and CALL_STOP in turn:  # a call past the limit: no tool runs
            ep.turn_limited = True
        ended_by_user_stop = any(s in turn for s in self.stop)
        if not c.finished or c.token_ids[-1] in self.engine.stop_token_ids or ended_by_user_stop:
            ep.finish_reason, ep.done = c.finish_reason, True
            return
        if ep.calls >= self.max_tool_calls:  # stopped at an `=` past the limit: an ordinary token, generate on
            return
        text, wellformed = observation(turn)
        obs = self.tokenizer(self.wrap(text), add_special_tokens=False).input_ids
        ep.calls, ep.malformed = ep.calls + 1, ep.malformed + (not wellformed)
        if len(ep.token_ids) + len(obs) >= max_new_tokens:  # no room for the result and a token after it
            ep.finish_reason, ep.done = "length", True
            return
        ep.token_ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.model_mask += [0] * len(obs)


def model_token_mask(response_mask: torch.Tensor, masks: list[list[int]]) -> torch.Tensor:
    """[B, L] 0/1 tensor laid out like pad_batch's response mask: row i's `masks[i]` (an episode's `model_mask`) on
    its response positions, 0 elsewhere (the response positions of a row are contiguous and in order)."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    flat = [m for row in masks for m in row]
    out[response_mask.bool()] = torch.tensor(flat, dtype=torch.float32, device=response_mask.device)
    return out


def episode_metrics(episodes: list[Episode]) -> dict:
    """A batch's tool metrics, and its completion length counted over the model's tokens only."""
    calls = sum(ep.calls for ep in episodes)
    malformed = sum(ep.malformed for ep in episodes)
    model_tokens = sum(sum(ep.model_mask) for ep in episodes)
    all_tokens = sum(len(ep.token_ids) for ep in episodes)
    return {"tools/calls_per_episode": calls / len(episodes),
            "tools/wellformed_frac": (calls - malformed) / calls if calls else 0.0,
            "tools/malformed_frac": malformed / calls if calls else 0.0,
            "tools/turn_limit_frac": sum(ep.turn_limited for ep in episodes) / len(episodes),
            "tools/tool_tokens_frac": 1 - model_tokens / all_tokens if all_tokens else 0.0,
            "val/sequence_lengths": model_tokens / len(episodes)}
