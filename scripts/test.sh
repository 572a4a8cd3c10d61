#!/usr/bin/env bash
# The test command: set up the environment (idempotent), then run the whole suite. Extra args go to pytest.
# Fails on any test failure, and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PATH="$PWD/.venv/bin:$PATH" VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest "$@"
rc=$?
[ "$rc" -eq 5 ] && echo "pytest collected no tests: failing" >&2
exit "$rc"
