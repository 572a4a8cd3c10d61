"""A quiet console: library INFO/WARNING output hidden unless `--verbose`; errors always show.

`quiet_libraries(verbose)` runs once at start-up (`run_cli`, before any library but torch is imported):
  - vLLM, transformers, datasets, huggingface_hub: their verbosity environment variables (read when they are
    imported) and their loggers' levels (for one already imported) set to ERROR; HF progress bars off;
  - DeepSpeed, accelerate, torch, math_verify: their loggers at ERROR (DeepSpeed resets its level on import: a
    filter); the grader worker process (shared/graders.py) sets math_verify's level there too;
  - wandb: WANDB_SILENT (its banner and end-of-run summary; the tracker prints one line naming the run);
  - Python warnings raised inside installed packages (site-packages) are not shown; those from this project's
    code or a user's reward function still are.
`muted()` wraps the few library calls that print around logging (C++ warnings from vLLM's engine start,
DeepSpeed's op-build `print`, trackio's banner): their stdout/stderr is held back, and shown if the call raises.
With `--verbose` both do nothing, and every library prints as it would without this module. A variable the user
has set is kept. Not covered: what a launcher prints in its own process (`accelerate launch`, `torchrun`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import tempfile
import warnings

_verbose = True  # until quiet_libraries(False): code that never calls it (tests, notebooks) keeps library output
LIBRARY_LOGGERS = ("vllm", "transformers", "datasets", "huggingface_hub", "accelerate", "torch", "DeepSpeed",
                   "trackio", "wandb", "math_verify")  # math_verify in-process; the grader worker: shared/graders.py
LIBRARY_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "DATASETS_VERBOSITY": "error",
               "HF_HUB_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
               "WANDB_SILENT": "true"}


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_libraries(verbose: bool) -> None:
    """Hide library INFO/WARNING logs, HF progress bars and library Python warnings (not `verbose`). Call once,
    early: the environment variables only reach libraries imported after it. A variable the user set is kept."""
    global _verbose
    _verbose = verbose
    if verbose:
        return
    for k, v in LIBRARY_ENV.items():
        os.environ.setdefault(k, v)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        if _errors_only not in logger.filters:  # survives a library resetting the level on import (DeepSpeed)
            logger.addFilter(_errors_only)
    library_dirs = tuple({os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not os.path.realpath(filename).startswith(library_dirs):
            show(message, category, filename, lineno, file, line)

    if not getattr(warnings.showwarning, "_cleanrlhf", False):
        showwarning._cleanrlhf = True
        warnings.showwarning = showwarning


def verbose() -> bool:
    return _verbose


@contextlib.contextmanager
def muted():
    """Hold back what the enclosed library call writes to stdout/stderr, from Python or C++ (file descriptors 1 and
    2); write it to stderr if the call raises. A no-op with --verbose."""
    if _verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if failed:
                held.seek(0)
                sys.stderr.write(held.read().decode(errors="replace"))
                sys.stderr.flush()
