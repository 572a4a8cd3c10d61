"""The built-in tiny model: a character-level tokenizer and a small Llama, built locally (no download).

`builtin:tiny` is the randomly initialised model; `builtin:tiny-sft` is that model warm-started by
`algorithms/sft.py` on the built-in task; `builtin:tiny-rm` is a reward model trained by `algorithms/rm.py` (its
defaults) from `builtin:tiny-sft` on the built-in preference pairs. All are created on first use and cached under
`$CLEANRLHF_CACHE` (default `~/.cache/cleanrlhf`), guarded by a file lock so concurrent ranks or test
processes build each one exactly once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

# Printable ASCII plus newline: enough for the built-in task, chat templates and GSM8K-like text in tests.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Bump when the architecture, tokenizer or warm-start recipe changes, so stale caches are not reused.
BUILTIN_VERSION = "v1"
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("CLEANRLHF_CACHE", Path.home() / ".cache" / "cleanrlhf"))


def build_tokenizer():
    """Character-level `PreTrainedTokenizerFast`: one token per character, BOS added by the post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    bos = vocab["<bos>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    """3 layers, hidden 128, 2 heads of dim 64 (vLLM's CPU attention needs head_dim 64), 0.67 M parameters (665,472)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
        torch_dtype="float32",
    )


def save_random_tiny(path: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Llama + tokenizer to `path` (HF format, loadable by vLLM)."""
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@contextmanager
def cache_lock(name: str):
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_atomically(final: Path, build) -> Path:
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    tmp.rename(final)
    return final


def builtin_tiny() -> Path:
    """Path of the random-init tiny model, created on first use."""
    with cache_lock("tiny") as root:
        final = root / f"tiny-{BUILTIN_VERSION}"
        if not (final / "config.json").exists():
            build_atomically(final, save_random_tiny)
        return final


def _clean_env() -> dict:
    """The environment for a clean single-process run: the launcher's rendezvous and DeepSpeed settings dropped."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSS_RANK")
    return {k: v for k, v in os.environ.items()
            if k not in launcher and not k.startswith(("TORCHELASTIC_", "ACCELERATE_", "DEEPSPEED_"))}


def _built_by(name: str, script: str, base: Path) -> Path:
    """Path of `name`, trained on first use by `algorithms/<script>` (default flags, seed 1) from `base`."""
    with cache_lock(name) as root:
        final = root / f"{name}-{BUILTIN_VERSION}"
        if not (final / "config.json").exists():

            def build(tmp: Path):
                print(f"[cleanrlhf] building {final} with algorithms/{script} (once)", flush=True)
                cmd = [sys.executable, str(PROJECT_ROOT / "algorithms" / script),
                       "--model_name_or_path", str(base), "--output_dir", str(tmp), "--seed", "1",
                       "--save_every", "0", "--best_metric", "", "--dev_num_prompts", "0"]  # only the final model,
                # trained on the whole train split (no dev slice: nothing selects a best checkpoint here)
                # its console stays out of the caller's (one progress bar per run); shown only if it fails
                proc = subprocess.run(cmd, env=_clean_env(), cwd=PROJECT_ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
                    raise RuntimeError(f"building {final} with algorithms/{script} failed (exit {proc.returncode})")
                # the scripts write their final checkpoint under output_dir/final
                for item in (tmp / "final").iterdir():
                    shutil.move(str(item), tmp / item.name)

            build_atomically(final, build)
        return final


def builtin_tiny_sft() -> Path:
    """Path of the tiny model warm-started by `algorithms/sft.py` on the built-in task, trained on first use."""
    return _built_by("tiny-sft", "sft.py", builtin_tiny())


def builtin_tiny_rm() -> Path:
    """Path of the Bradley-Terry reward model trained by `algorithms/rm.py` (defaults) from `builtin:tiny-sft`."""
    return _built_by("tiny-rm", "rm.py", builtin_tiny_sft())
