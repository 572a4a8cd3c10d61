"""The built-in tiny model: a character-level tokenizer and a small Llama, built locally (no download).

`builtin:tiny` is the randomly initialised model; `builtin:tiny-sft` is that model warm-started by
`algorithms/sft.py` on the built-in task; `builtin:tiny-rm` is a reward model trained by `algorithms/rm.py` (its
defaults) from `builtin:tiny-sft` on the built-in preference pairs; `builtin:tiny-cf-rm` is `builtin:tiny-rm` trained
further by rm.py on the counterfactual-format pairs of `builtin:counterfactual` (shared/task.py), a reward model that
can score DRCA's counterfactuals (a response with a line blanked or cut). All are created on first use and cached under
`$CLEANRLHF_CACHE` (default `~/.cache/cleanrlhf`), guarded by a file lock so concurrent ranks or test
processes build each one exactly once.

The builds are deterministic, so that every machine starts from the same weights: each runs in a child process on
CPU with one thread, ATen's kernels pinned to AVX2 and MKL's to its AVX2 reproducible path (`BUILD_ENV`), and seed 1.
Each model directory gets `build.json` with the SHA-256 of its weights; `EXPECTED_SHA256` holds the values this
code gives on x86-64 (tests/test_builtin_models.py checks them), and every stored benchmark names the hashes of the
built-in models it ran on (`scripts/bench_common.py`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
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
BUILTIN_VERSION = "v3"  # v2: deterministic builds (BUILD_ENV); v3: sft.py / rm.py train with the fused AdamW
# (0ea16ae), which rounds differently: tiny-sft v2 was bd9048d7..., the start of the results that name it
# The environment of every build: CPU only, one thread (a reduction's order depends on the thread count), ATen's
# vectorised kernels and MKL's BLAS pinned to AVX2 (which every x86-64 server has), so an AVX-512 machine computes
# the same sums in the same order as an AVX2 one.
BUILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "PYTHONHASHSEED": "0"}
# SHA-256 of model.safetensors of each build on x86-64 (torch 2.13.0, transformers 5.19.0); a change of the build
# recipe or of the stack that moves them is a new start model: bump BUILTIN_VERSION and re-measure stored results.
EXPECTED_SHA256 = {
    "tiny": "395d0a932928cfdaffe558995ca2c1e733de0fcf55879b6fe3e901855d75cffa",
    "tiny-sft": "895ca454631ffc586b9b86fcbbbf96a5a2dd4d4d3874d63e4600aee60518ea27",
    "tiny-rm": "984800f927191a78db0a819baf1b8402525c66f22be0bc6d7aae0f77ecdc67dc",
    "tiny-cf-rm": "b71ffa025fda562642ac7c12ee590d4afa394d070a387e27d4863a92091e7c0e",
}
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


def weights_sha256(model_dir: str | Path) -> str:
    """SHA-256 of a model directory's `model.safetensors` (the weights; config and tokenizer are fixed by code)."""
    digest = hashlib.sha256()
    with open(Path(model_dir) / "model.safetensors", "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_build_record(model_dir: Path, name: str) -> None:
    """`build.json`: the weights' hash, whether it is the expected one, and the build environment."""
    sha = weights_sha256(model_dir)
    record = {"name": f"builtin:{name}", "version": BUILTIN_VERSION, "weights_sha256": sha,
              "expected_sha256": EXPECTED_SHA256.get(name) or None, "build_env": BUILD_ENV}
    (model_dir / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    if EXPECTED_SHA256.get(name) and sha != EXPECTED_SHA256[name]:
        print(f"[cleanrlhf] warning: builtin:{name} built with weights {sha[:12]}, not the expected "
              f"{EXPECTED_SHA256[name][:12]} (another CPU architecture or library version): results will differ "
              "from the stored ones", file=sys.stderr, flush=True)


def build_record(name: str, cache: Path | None = None) -> dict | None:
    """The `build.json` of built-in model `name` (`tiny`, `tiny-sft`, `tiny-rm`) in `cache` (default: the cache),
    if it was built there."""
    path = Path(cache or cache_dir()) / f"{name}-{BUILTIN_VERSION}" / "build.json"
    return json.loads(path.read_text()) if path.exists() else None


def _run_build(cmd: list[str], what: str) -> None:
    """Run a build command in the deterministic environment; its console is shown only if it fails."""
    proc = subprocess.run(cmd, env={**_clean_env(), **BUILD_ENV}, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"building {what} failed (exit {proc.returncode})")


def builtin_tiny() -> Path:
    """Path of the random-init tiny model, created on first use (in a child process: BUILD_ENV)."""
    with cache_lock("tiny") as root:
        final = root / f"tiny-{BUILTIN_VERSION}"
        if not (final / "config.json").exists():

            def build(tmp: Path):
                code = f"from shared.tiny import save_random_tiny; save_random_tiny({str(tmp)!r})"
                _run_build([sys.executable, "-c", code], str(final))
                write_build_record(tmp, "tiny")

            build_atomically(final, build)
        return final


def _clean_env() -> dict:
    """The environment for a clean single-process run: the launcher's rendezvous and DeepSpeed settings dropped."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSS_RANK")
    return {k: v for k, v in os.environ.items()
            if k not in launcher and not k.startswith(("TORCHELASTIC_", "ACCELERATE_", "DEEPSPEED_"))}


def _built_by(name: str, script: str, base: Path, flags: tuple[str, ...] = ()) -> Path:
    """Path of `name`, trained on first use by `algorithms/<script>` (default flags and `flags`, seed 1) from `base`."""
    with cache_lock(name) as root:
        final = root / f"{name}-{BUILTIN_VERSION}"
        if not (final / "config.json").exists():

            def build(tmp: Path):
                print(f"[cleanrlhf] building {final} with algorithms/{script} (once)", flush=True)
                cmd = [sys.executable, str(PROJECT_ROOT / "algorithms" / script),
                       "--model_name_or_path", str(base), "--output_dir", str(tmp), "--seed", "1",
                       "--save_every", "0", "--best_metric", "", "--dev_num_prompts", "0", *flags]  # the final model,
                # trained on the whole train split (no dev slice: nothing selects a best checkpoint here)
                # its console stays out of the caller's (one progress bar per run); shown only if it fails
                _run_build(cmd, f"{final} with algorithms/{script}")
                # the scripts write their final checkpoint under output_dir/final
                for item in (tmp / "final").iterdir():
                    shutil.move(str(item), tmp / item.name)
                write_build_record(tmp, name)

            build_atomically(final, build)
        return final


def builtin_tiny_sft() -> Path:
    """Path of the tiny model warm-started by `algorithms/sft.py` on the built-in task, trained on first use."""
    return _built_by("tiny-sft", "sft.py", builtin_tiny())


def builtin_tiny_rm() -> Path:
    """Path of the Bradley-Terry reward model trained by `algorithms/rm.py` (defaults) from `builtin:tiny-sft`."""
    return _built_by("tiny-rm", "rm.py", builtin_tiny_sft())


def builtin_tiny_cf_rm() -> Path:
    """Path of the reward model trained by `algorithms/rm.py` from `builtin:tiny-rm` on the counterfactual-format
    pairs of `builtin:counterfactual` (DRCA's counterfactuals ranked by the per-line grader), 256,000 pairs (9 epochs;
    rm.py's other defaults): starting from an RM that already ranks whole responses, it learns the counterfactuals."""
    return _built_by("tiny-cf-rm", "rm.py", builtin_tiny_rm(),
                     ("--dataset", "builtin:counterfactual", "--total_episodes", "256000"))
