"""Slip localisation: an evaluation of credit assignment on the built-in task (algorithms/drca.py's eval/localisation).

The rejected response of a built-in preference pair (shared/task.py::builtin_preferences) is the chosen one with one
line off (the slip), the later lines continued from it. A credit-assignment method gives each unit of that response a
credit; a method that assigns credit well gives the lowest credit to the unit holding the slip. Per evaluation:
  eval/localisation          share of held-out pairs whose lowest-credit unit overlaps the slip (a tie counts as a
                             unit picked at random among the tied)
  eval/localisation_chance   what a unit picked at random would score (the share of units overlapping the slip)
  eval/localisation_line{k}  eval/localisation over the pairs whose slip is on line k
"""

from __future__ import annotations

import math

import torch

from shared import data
from shared.units import char_offsets, char_span_to_tokens


def load_slips(args, tokenizer) -> data.PreferenceData:
    """The first `args.localisation_num_pairs` held-out pairs of the built-in task, tokenized as the script's prompts."""
    return data.load_preferences(args.dataset, args.eval_split, tokenizer, prompt_template=args.prompt_template,
                                 use_chat_template=args.chat_template, max_prompt_length=args.max_prompt_length,
                                 max_seq_length=args.max_prompt_length + args.max_new_tokens,
                                 limit=args.localisation_num_pairs)


def slip_localisation(credits: list[float], spans: list[tuple[int, int]], slip: tuple[int, int]) -> tuple[float, float]:
    """Does the lowest credit land on the slip? (The share of the units tied at the lowest credit that overlap the
    slipped tokens [slip): 1.0 or 0.0 without a tie; and the share of all units overlapping the slip: the score of a
    unit picked at random.) No unit: (0.0, 0.0)."""
    if not spans:
        return 0.0, 0.0
    on_slip = [float(a < slip[1] and slip[0] < b) for a, b in spans]
    lowest = [k for k in range(len(credits)) if credits[k] == min(credits)]
    return sum(on_slip[k] for k in lowest) / len(lowest), sum(on_slip) / len(on_slip)


def localisation_metrics(slips: data.PreferenceData, info, decode, unit_credits) -> dict:
    """The module docstring's metrics over all ranks. `unit_credits(prompts, responses)` returns each response's
    unit spans (response-token coordinates) and their credits; every rank calls it once with the same number of
    pairs (its contiguous share, padded by repeating it), so that model forwards stay in step under ZeRO-3."""
    per_rank = math.ceil(len(slips) / info.world_size)
    idx = list(range(info.rank * per_rank, min(len(slips), (info.rank + 1) * per_rank)))
    padded = [idx[j % len(idx)] if idx else 0 for j in range(per_rank)]
    spans, credits = unit_credits([slips.prompt_ids[i] for i in padded], [slips.rejected_ids[i] for i in padded])
    lines_max = max(r["rejected_step"] for r in slips.rows) + 1  # the same on every rank
    stats = torch.zeros(3 + 2 * lines_max, dtype=torch.float64)  # hits, chance, pairs; per slipped line: hits, pairs
    for j, i in enumerate(idx):
        text_ids = slips.rejected_ids[i][:-1]  # without EOS
        lines, k = slips.rows[i]["rejected"].split("\n"), slips.rows[i]["rejected_step"]
        start = sum(len(line) + 1 for line in lines[:k])
        slip = char_span_to_tokens(char_offsets(decode, text_ids), start, start + len(lines[k]))
        hit, rate = slip_localisation(credits[j], spans[j], slip)
        stats[:3] += torch.tensor([hit, rate, 1.0], dtype=torch.float64)
        stats[3 + 2 * k : 5 + 2 * k] += torch.tensor([hit, 1.0], dtype=torch.float64)
    stats = info.all_reduce(stats)
    return {"eval/localisation": (stats[0] / stats[2]).item(),
            "eval/localisation_chance": (stats[1] / stats[2]).item(),
            **{f"eval/localisation_line{k}": (stats[3 + 2 * k] / stats[4 + 2 * k]).item()
               for k in range(lines_max) if stats[4 + 2 * k] > 0}}
