"""LoRA through peft: adapters on a frozen base model, merged weights for the generation engine and the exports.

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

Why merged weights rather than vLLM's LoRA adapter path: the engine then runs the plain base architecture (no LoRA
kernels, no `enable_lora` / `max_lora_rank` engine settings, the same code path as full fine-tuning, the same log-
probs as the trainer to fp32 rounding); the cost is one W + BA per targeted layer per sync, which is small next to
a rollout (scripts/bench_lora_memory.py measures it). vLLM's adapter path would send only A and B, a gain for multi-GPU
models where weight traffic matters, not measured here.
"""

from __future__ import annotations

import contextlib

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
    not carry an adapter (`all-linear` leaves it out)."""
    if not getattr(args, "lora_r", 0):
        return
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError("lora_r: LoRA needs the peft package (pip install -r requirements.txt)") from None
    targets = target_modules(args.lora_target_modules)
    if not targets:
        raise ValueError("lora_target_modules: expected `all-linear` or comma-separated module names, got "
                         f"{args.lora_target_modules!r}")
    if targets == "all-linear":
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
