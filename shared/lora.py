"""LoRA through peft: adapters on a frozen base model; the merged weights or the adapter for the generation engine,
both for the exports.

    check_lora(args, model_path)              # start-up: --lora_* flags and target names, before anything is written
    model = add_lora(model, args)             # a peft model whose only trainable weights are the adapters
                                              # (--lora_r 0: the model itself, unchanged)
    ref = adapters_disabled(engine)           # the reference policy: the same model, adapters off (no copy)

Everything else goes through the usual plumbing, which recognises a peft model:
  - `full_named_parameters` (shared/distributed.py) yields the *merged* weights W + (alpha / r) B A under the base
    model's own parameter names, so `generator.sync_weights`, the rank check and the exports need no change
    (`merged_named_parameters` below; ZeRO-3 shards of W, A and B are gathered first);
  - `save_hf` (shared/checkpoint.py) writes the merged model (transformers and vLLM load it) and, in its
    `adapter/` subdirectory, the adapter in peft format (`PeftModel.from_pretrained(base, "<dir>/adapter")`);
  - resumable checkpoints store the trainable weights (the adapters, and a reward model's / critic's head) and
    their optimizer state only: the frozen base is read again from `--model_name_or_path` on resume.

The vLLM engine gets the policy in one of two ways (`--lora_sync`, the scripts' `make_generator(..., lora_sync=)`):
  - `merged` (default): the merged weights, loaded in place with `reload_weights` like full fine-tuning's. The engine
    runs the plain base architecture (no LoRA kernels, no `enable_lora` engine settings), its log-probs equal the
    trainer's to fp32 rounding; each sync computes W + BA for every targeted layer and rewrites every weight.
  - `adapter`: the engine is built with vLLM's LoRA (`enable_lora`, `max_lora_rank` = `vllm_lora_rank(--lora_r)`)
    and each sync writes only A and B (`write_adapter`: peft format, in a directory the generator owns) and has the
    engine load them (shared/generation.py); the base weights stay as loaded. Measured on builtin:smollm2-135m on
    CPU (scripts/benchmarks/bench_lora_sync.py, docs/lora.md): the adapter sync is several times faster, but generation through
    vLLM's CPU LoRA kernels is about 3x slower, which outweighs it unless a step generates only a few dozen tokens,
    so `merged` is the default. Both serve the trained policy (tests/test_lora.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os

import torch

ADAPTER_DIR = "adapter"  # subdirectory of an export (final/, best/) holding the peft adapter


def is_peft(model) -> bool:
    """True for a peft model (or a DeepSpeed engine wrapping one)."""
    module = getattr(model, "module", model)
    return hasattr(module, "peft_config") and hasattr(module, "get_base_model")


def base_module(model):
    """The transformers model under a peft model (its LoRA layers injected, adapters active); any other model as is.
    Used where code needs the model's own attributes (`generate`, `base_model_prefix`, the scalar head)."""
    module = getattr(model, "module", model)
    return module.get_base_model() if is_peft(module) else module


def target_modules(spec: str):
    """`all-linear` (peft's shorthand) or a comma-separated list of module names (`q_proj,v_proj`)."""
    spec = spec.strip()
    if spec.lower() == "all-linear":
        return "all-linear"
    return [name.strip() for name in spec.split(",") if name.strip()]


def check_lora(args, model_path: str, seq_cls: bool = False) -> None:
    """Start-up checks of the LoRA flags (one-line errors naming the flag, before anything is written): with
    --lora_r > 0, peft must be installed and every name of --lora_target_modules must match a linear layer of the
    model, built from its config on the meta device (no weights read); under ZeRO-3 a causal LM's output layer may
    not carry an adapter (`all-linear` leaves it out). With --lora_sync adapter: --lora_r > 0, --generator vllm, a
    rank vLLM's LoRA serves, and adapters it can serve on this model (`check_vllm_lora`)."""
    adapter_sync = getattr(args, "lora_sync", "merged") == "adapter"
    if adapter_sync and not getattr(args, "lora_r", 0):
        raise ValueError("lora_sync: `adapter` sends LoRA adapters to vLLM and needs --lora_r > 0 (there are none)")
    if adapter_sync and getattr(args, "generator", "vllm") != "vllm":
        raise ValueError("lora_sync: `adapter` is for --generator vllm (the hf backend generates with the trained "
                         "model itself, nothing is synced)")
    if not getattr(args, "lora_r", 0):
        return
    if adapter_sync and args.lora_r > max(vllm_lora_ranks()):
        raise ValueError(f"lora_r: vLLM's LoRA serves ranks up to {max(vllm_lora_ranks())}, got {args.lora_r} "
                         "(or --lora_sync merged)")
    try:
        importlib.import_module("peft")
    except ImportError:
        raise ValueError("lora_r: LoRA needs the peft package (pip install -r requirements.txt)") from None
    targets = target_modules(args.lora_target_modules)
    if not targets:
        raise ValueError("lora_target_modules: expected `all-linear` or comma-separated module names, got "
                         f"{args.lora_target_modules!r}")
    if targets == "all-linear":  # every linear layer but the output layer
        if adapter_sync:
            check_vllm_lora(model_path, None)
        return
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        auto = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
        model = auto.from_config(config)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in targets if t not in linear]
    if missing:
        raise ValueError(f"lora_target_modules: {', '.join(missing)} is not a linear layer of {model_path} "
                         f"(its linear layers: {', '.join(sorted(linear))}; or `all-linear`)")
    from shared.launch import launch_zero_stage

    head = model.get_output_embeddings()
    head_name = next((n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head), None)
    if not seq_cls and head_name in targets and launch_zero_stage()[0] == 3:
        # the lean log-probs gather a frozen output layer per chunk (shared.distributed.output_head); one with an
        # adapter runs as a module, whose weight ZeRO-3 releases before the recomputed chunk's backward reads it
        raise ValueError(f"lora_target_modules: an adapter on the output layer ({head_name}) is not supported under "
                         "ZeRO-3; leave it out, or launch with scripts/accelerate/zero2.yaml")
    if not seq_cls and head_name in targets and getattr(config, "tie_word_embeddings", False):
        # tied: the merged model (the engine's weights and the exports) holds one matrix for the input embeddings and
        # the output layer, so W + BA of the head cannot be represented there (the engine would serve the embeddings)
        raise ValueError(f"lora_target_modules: an adapter on the output layer ({head_name}) of a model with tied "
                         f"embeddings ({model_path}) cannot be merged into it; leave it out")
    if adapter_sync:
        check_vllm_lora(model_path, head_name if head_name in targets else None)


def vllm_lora_ranks() -> tuple[int, ...]:
    """The values of `max_lora_rank` the installed vLLM accepts (1, 8, 16, 32, ..., 512 in vLLM 0.32)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(get_args(MaxLoRARanks)))


def vllm_lora_rank(r: int) -> int:
    """The engine's `max_lora_rank` for adapters of rank r: the smallest value vLLM accepts that holds r."""
    return next(v for v in vllm_lora_ranks() if v >= r)


def check_vllm_lora(model_path: str, head: str | None) -> None:
    """--lora_sync adapter: vLLM's class for the model's architecture must serve LoRA adapters, and `head` (the
    output layer's name when it carries an adapter) must be one of its LoRA embedding modules (Llama's lm_head is,
    Qwen2's is not). An architecture vLLM does not register itself is left to the engine, which says why at start."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    archs = [a for a in AutoConfig.from_pretrained(model_path).architectures or [] if a in ModelRegistry.models]
    if not archs:
        return
    cls = ModelRegistry.models[archs[0]].load_model_cls()
    if not supports_lora(cls):
        raise ValueError(f"lora_sync: vLLM's {archs[0]} does not serve LoRA adapters; use --lora_sync merged")
    if head is not None and head not in getattr(cls, "embedding_modules", {}):
        raise ValueError(f"lora_target_modules: vLLM's LoRA cannot serve an adapter on the output layer ({head}) of "
                         f"{archs[0]} (--lora_sync adapter); leave it out, or use --lora_sync merged")


def add_lora(model, args, seq_cls: bool = False):
    """Wrap `model` with LoRA adapters (`--lora_r`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`); only
    they train. `seq_cls`: a reward model or critic, whose scalar head (`score`) is trained in full beside the
    adapters (peft `modules_to_save`) and never gets an adapter. `--lora_r 0` returns `model` unchanged.

    A adapters start random (peft's Kaiming init, from the torch RNG: the same on every rank, as the scripts seed
    before building models) and B adapters at zero, so the wrapped model computes exactly what the base does."""
    if not getattr(args, "lora_r", 0):
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=target_modules(args.lora_target_modules), bias="none",
                        task_type="SEQ_CLS" if seq_cls else "CAUSAL_LM")
    # adapters in the model's dtype (peft would make bf16 models' adapters fp32): one dtype for DeepSpeed, whose bf16
    # mode keeps fp32 master weights in the optimizer anyway
    return get_peft_model(model, config, autocast_adapter_dtype=False)


@contextlib.contextmanager
def _gathered(params, zero3: bool):
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=None):
        yield


def merged_named_parameters(model, zero3: bool = False):
    """(name, full tensor) of the merged model, under the base model's parameter names (those vLLM and a
    transformers checkpoint use): each LoRA-targeted weight is W + delta, delta = peft's `get_delta_weight`
    (scaling * B @ A), computed out of place (the training weights are untouched, as `merge_adapter` /
    `unmerge_adapter` would not leave them: W + BA - BA != W in floating point); the trained copy of a
    `modules_to_save` module (a reward model's head) replaces the original. Equal, bit for bit, to the weights of
    peft's `merge_and_unload()`. A generator: one tensor at a time. ZeRO-3: W, A and B of one layer are gathered
    together, one layer at a time, and released before the tensor is yielded."""
    from peft.tuners.lora import LoraLayer

    base = base_module(model)
    lora_of = {}  # id(base layer) -> its LoRA wrapper
    for _, m in base.named_modules():
        if isinstance(m, LoraLayer):
            lora_of[id(m.get_base_layer())] = m
    for name, p in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapter factors (merged below) and the frozen original of a trained head
        module_name, _, leaf = name.rpartition(".")
        clean = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        owner = base.get_submodule(module_name) if module_name else base
        lora = lora_of.get(id(owner))
        if lora is None or leaf != "weight" or lora.merged or lora.disable_adapters:
            with _gathered([p], zero3):
                full = p.detach().clone() if zero3 else p.detach()
            yield clean, full
            continue
        adapters = [a for a in lora.active_adapters if a in lora.lora_A]
        factors = [q for a in adapters for q in (lora.lora_A[a].weight, lora.lora_B[a].weight)]
        with _gathered([p, *factors], zero3), torch.no_grad():
            merged = p.detach().clone()
            for a in adapters:
                merged += lora.get_delta_weight(a)  # the same in-place add as peft's merge
        yield clean, merged


def adapter_state_dict(model, zero3: bool = False) -> dict[str, torch.Tensor]:
    """The trainable tensors of a peft model (adapters, modules_to_save) under the peft model's own names, gathered
    under ZeRO-3, on CPU: what `PeftModel.save_pretrained(state_dict=...)` takes."""
    module = getattr(model, "module", model)
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            with _gathered([p], zero3):
                out[name] = p.detach().cpu().clone()
    return out


def write_adapter(model, directory: str, zero3: bool = False) -> None:
    """The adapter of peft model `model` in peft format in `directory`: adapter_config.json and
    adapter_model.safetensors, under the names `save_pretrained` writes (what vLLM's LoRA and
    `PeftModel.from_pretrained` load), without the copy of the base's output layer that peft adds when the output
    layer carries an adapter. Collective under ZeRO-3 (every rank gathers the adapters)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    module = getattr(model, "module", model)
    tensors = get_peft_model_state_dict(module, state_dict=adapter_state_dict(module, zero3),
                                        save_embedding_layers=False)
    module.peft_config["default"].save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "adapter_model.safetensors"))


class adapters_disabled:  # noqa: N801 - used like a model
    """The reference policy of a LoRA run: calls the policy (a DeepSpeed engine or the peft model) inside peft's
    `disable_adapter()` context, i.e. the frozen base model, without holding a second copy of it."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with getattr(self.policy, "module", self.policy).disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self):
        """The output head for the scripts' lean log-probs, which call it on hidden states outside the forward: it
        runs with the adapters disabled as well (it carries one only when --lora_target_modules names it)."""
        module = getattr(self.policy, "module", self.policy)
        head = module.get_output_embeddings()

        def call(hidden: torch.Tensor) -> torch.Tensor:
            with module.disable_adapter():
                return head(hidden)

        return call
