#!/usr/bin/env bash
# The test command: set up the environment (idempotent), then run the whole suite. Extra args go to pytest.
# Fails on any test failure, and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PATH="$PWD/.venv/bin:$PATH" VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
# A process killed while DeepSpeed JIT-compiles an op (its CPU shared-memory collective) leaves torch's lock file in
# ~/.cache/torch_extensions, and every later process waits on it forever (seen: two tests hung 10 minutes on one).
# A build takes about a minute, so a lock older than 10 minutes is stale.
find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -mmin +10 -delete 2>/dev/null || true
# two workers, one per core, one thread each (the models here are small: two single-threaded tests at once get more
# done than one test on two threads); a file's tests stay on one worker, the longest files first (tests/conftest.py)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
[ "$rc" -eq 5 ] && echo "pytest collected no tests: failing" >&2
exit "$rc"
