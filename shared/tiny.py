"""The built-in tiny models: a character-level tokenizer and a small Llama, shipped with the code (no download).

    builtin:tiny        the randomly initialised model (seed 0)
    builtin:tiny-sft    builtin:tiny warm-started by `algorithms/sft.py` (its defaults, seed 1) on the built-in task
    builtin:tiny-rm     a Bradley-Terry reward model trained by `algorithms/rm.py` (its defaults) from builtin:tiny-sft
                        on the built-in preference pairs
    builtin:tiny-tools-sft  builtin:tiny warm-started by sft.py on `builtin:sums-10` written with calculator calls
                        (grpo_tools.py's start; scripts/builders/tools_sft_data.py)
    builtin:tiny-cf-rm  builtin:tiny-rm trained further by rm.py on the counterfactual-format pairs of
                        `builtin:counterfactual` (shared/task.py): a reward model that can score DRCA's counterfactuals
    builtin:tiny-grpo   builtin:tiny-sft trained by `algorithms/grpo.py` (its defaults but 51,200 samples, seed 1): the
                        default teacher of `algorithms/opd.py`, much stronger than tiny-sft on the built-in task
    builtin:tiny-unit-rm  a unit-level (segment) reward model trained by `algorithms/unit_rm.py` (its defaults but
                        32,000 pairs) from builtin:tiny-sft, with its unit_normalizer.json: `algorithms/unit_ppo.py`'s
                        default reward model

Their weights are committed in shared/builtin_models/<name>/ (2.7 MB each), so that every machine starts from the
same bits: training is not bit-reproducible across CPUs (the order in which the kernels sum depends on the CPU model
and vendor, whatever threads or instruction sets are pinned), so a warm start rebuilt on another machine is a
slightly different model, and everything measured from it moves. On first use a model is copied into
`$CLEANRLHF_CACHE` (default `~/.cache/cleanrlhf`) under a lock, and its SHA-256 is checked against `EXPECTED_SHA256`.

`python scripts/builders/build_builtin_models.py` rebuilds all four from scratch with `RECIPES` (each in a child process on
CPU with one thread and seed 1: `BUILD_ENV`) and compares them with the committed ones; `--write` replaces them
(then re-measure the stored results that start from them).
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
# The environment of every build: CPU only, one thread (a reduction's order depends on the thread count), ATen's
# vectorised kernels and MKL's BLAS pinned to AVX2. This makes a rebuild on the same machine bit-identical; on another
# CPU only the random-init build is (tests/test_builtin_models.py).
BUILD_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "PYTHONHASHSEED": "0"}
# How each model is built: (script in algorithms/, the model it starts from, flags beyond the script's defaults)
RECIPES = {
    "tiny-sft": ("sft.py", "tiny", ()),
    "tiny-rm": ("rm.py", "tiny-sft", ()),
    # 256,000 pairs (9 epochs): starting from an RM that already ranks whole responses, it learns the counterfactuals
    "tiny-cf-rm": ("rm.py", "tiny-rm", ("--dataset", "builtin:counterfactual", "--total_episodes", "256000")),
    # the committed data file (its targets come from tiny-sft's own samples; the gold answers are not used)
    "tiny-lc-sft": ("sft.py", "tiny-sft", ("--dataset", "shared/builtin_models/lc_sft/sums.jsonl", "--reward_fn",
                                           "algorithms.calibration:reader_accuracy", "--max_new_tokens", "32")),
    # builtin:sums-10 written with a calculator call (scripts/builders/tools_sft_data.py), the tool's result not trained
    "tiny-tools-sft": ("sft.py", "tiny", ("--dataset", "shared/builtin_models/tools_sft/sums10.jsonl",
                                          "--tool_results", "--reward_fn", "builtin", "--max_new_tokens", "64")),
    # the teacher of algorithms/opd.py: grpo.py's defaults from tiny-sft, half its samples (51,200: 100 steps, to keep
    # the build short), a model much stronger than tiny-sft on the built-in task
    "tiny-grpo": ("grpo.py", "tiny-sft", ("--total_episodes", "51200")),
    # unit_ppo.py's default reward model: unit_rm.py's defaults but 32,000 pairs (a quarter: 500 steps, to keep the
    # build short), its normaliser (final/unit_normalizer.json) beside the weights
    "tiny-unit-rm": ("unit_rm.py", "tiny-sft", ("--total_episodes", "32000")),
}
# SHA-256 of model.safetensors of the committed weights (shared/builtin_models/<name>/)
EXPECTED_SHA256 = {
    "tiny-unit-rm": "7055a8b9e2aba8d0c20611f56c55e5fa7eeb4f865e835a08ab9ec451d0d23ac2",
    "tiny-tools-sft": "63d9635ee189e5ad39898b8031098bd42a910baf24531a7e59d7937ee9115375",
    "tiny-grpo": "62eb61f7ea20126c86b40b596f868c91259262d16df2c2178165fee6bf61318c",
    "tiny": "395d0a932928cfdaffe558995ca2c1e733de0fcf55879b6fe3e901855d75cffa",
    "tiny-sft": "895ca454631ffc586b9b86fcbbbf96a5a2dd4d4d3874d63e4600aee60518ea27",
    "tiny-rm": "984800f927191a78db0a819baf1b8402525c66f22be0bc6d7aae0f77ecdc67dc",
    "tiny-cf-rm": "b71ffa025fda562642ac7c12ee590d4afa394d070a387e27d4863a92091e7c0e",
    "tiny-lc-sft": "9e7c9924ab3c3e62b11b7d922013c7bad751295ea95a6c360b94fc930d60ed67",
}
COMMITTED = Path(__file__).resolve().parent / "builtin_models"
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


def build_record(name: str, cache: Path | None = None) -> dict | None:
    """The `build.json` of built-in model `name` (`tiny`, `tiny-sft`, ...) as installed in `cache` (default: the
    cache), if it was used there: its weights' hash and the recipe, machine and stack that built it."""
    path = Path(cache or cache_dir()) / f"{name}-{EXPECTED_SHA256[name][:12]}" / "build.json"
    return json.loads(path.read_text()) if path.exists() else None


def builtin_model(name: str) -> Path:
    """Path of built-in model `name` in the cache, copied there from shared/builtin_models/ on first use (or when the
    cached copy's weights are not the committed ones)."""
    expected = EXPECTED_SHA256[name]
    with cache_lock(name) as root:
        final = root / f"{name}-{expected[:12]}"
        if (final / "config.json").exists() and weights_sha256(final) == expected:
            return final
        source = COMMITTED / name
        if not (source / "model.safetensors").exists() or weights_sha256(source) != expected:
            raise RuntimeError(f"builtin:{name}: {source}/model.safetensors is missing or not the committed file "
                               f"(SHA-256 {expected[:12]}...); restore it with git (git checkout -- {source})")
        shutil.rmtree(final, ignore_errors=True)
        return build_atomically(final, lambda tmp: shutil.copytree(source, tmp))


def builtin_tiny() -> Path:
    """Path of the random-init tiny model."""
    return builtin_model("tiny")


def builtin_tiny_sft() -> Path:
    """Path of the tiny model warm-started by `algorithms/sft.py` on the built-in task."""
    return builtin_model("tiny-sft")


def builtin_tiny_rm() -> Path:
    """Path of the Bradley-Terry reward model trained by `algorithms/rm.py` (defaults) from `builtin:tiny-sft`."""
    return builtin_model("tiny-rm")


def builtin_tiny_lc_sft() -> Path:
    return builtin_model("tiny-lc-sft")


def builtin_tiny_cf_rm() -> Path:
    """Path of the reward model trained by `algorithms/rm.py` from `builtin:tiny-rm` on the counterfactual-format
    pairs of `builtin:counterfactual` (DRCA's counterfactuals ranked by the per-line grader)."""
    return builtin_model("tiny-cf-rm")


# Rebuilding from scratch (scripts/builders/build_builtin_models.py, tests/test_builtin_models.py)
def _clean_env() -> dict:
    """The environment for a clean single-process run: the launcher's rendezvous and DeepSpeed settings dropped."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "CROSS_RANK")
    return {k: v for k, v in os.environ.items()
            if k not in launcher and not k.startswith(("TORCHELASTIC_", "ACCELERATE_", "DEEPSPEED_"))}


def _run_build(cmd: list[str], what: str) -> None:
    """Run a build command in BUILD_ENV; its console is shown only if it fails."""
    proc = subprocess.run(cmd, env={**_clean_env(), **BUILD_ENV}, cwd=PROJECT_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"building {what} failed (exit {proc.returncode})")


def build_model(name: str, out: str | Path, base: str | Path | None = None) -> Path:
    """Build `name` from scratch into the new directory `out` with its recipe, in a child process under BUILD_ENV:
    `tiny` by save_random_tiny, the others by their script from `base` (the model RECIPES names, built or
    committed). Writes out/build.json (hash, recipe, build environment, machine, library versions, and the script's
    last held-out evaluation: what a rebuild on another CPU is compared with)."""
    import platform

    import torch
    import transformers

    out = Path(out)
    if name == "tiny":
        _run_build([sys.executable, "-c", f"from shared.tiny import save_random_tiny; save_random_tiny({str(out)!r})"],
                   f"builtin:{name}")
        recipe, final_eval = "shared.tiny.save_random_tiny(seed 0)", {}
    else:
        script, _, flags = RECIPES[name]
        tmp = out.with_name(out.name + ".run")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, str(PROJECT_ROOT / "algorithms" / script), "--model_name_or_path", str(base),
               "--output_dir", str(tmp), "--seed", "1", "--save_every", "0", "--best_metric", "",
               "--dev_num_prompts", "0", *flags]  # the final model, trained on the whole train split
        _run_build(cmd, f"builtin:{name} with algorithms/{script}")
        shutil.move(str(tmp / "final"), out)  # the scripts write their final checkpoint under output_dir/final
        normalizer = out / "unit_normalizer.json"  # unit_rm.py's: it names the entropy model as the recipe does
        if normalizer.exists():
            normalizer.write_text(json.dumps({**json.loads(normalizer.read_text()),
                                              "model": f"builtin:{RECIPES[name][1]}"}, indent=1))
        rows = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines() if line.strip()]
        final_eval = {k: v for row in rows for k, v in row.items() if k.startswith("eval/")}  # the last of each
        shutil.rmtree(tmp, ignore_errors=True)
        recipe = " ".join(["python", f"algorithms/{script}", "--model_name_or_path", f"builtin:{RECIPES[name][1]}",
                           "--seed", "1", "--save_every", "0", "--best_metric", "''", "--dev_num_prompts", "0", *flags])
    record = {"name": f"builtin:{name}", "weights_sha256": weights_sha256(out), "recipe": recipe,
              "build_env": BUILD_ENV, "machine": _cpu_name(), "platform": platform.platform(),
              "torch": torch.__version__, "transformers": transformers.__version__, "final_eval": final_eval}
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
