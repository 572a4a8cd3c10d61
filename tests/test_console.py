"""A quiet console (shared/console.py): library INFO/WARNING logs and warnings hidden unless --verbose, errors shown;
one progress bar and a summary line per run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared import console

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = """
import logging, os, sys, sysconfig, warnings
from shared.console import quiet_libraries

quiet_libraries(verbose=sys.argv[1] == "verbose")
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger

configure_logging_if_needed(LoggingConfig())  # as vLLM does when an engine is created (level: VLLM_LOGGING_LEVEL)
log = init_logger("vllm.console_test")
log.info("VLLM-INFO")
log.warning("VLLM-WARNING")
log.error("VLLM-ERROR")
import deepspeed  # on CPU it warns "Setting accelerator to CPU" while importing; its logger resets its level

deepspeed.utils.logger.warning("DS-WARNING")
deepspeed.utils.logger.error("DS-ERROR")
from transformers.utils import logging as hf_logging

hf_logging.get_logger("transformers.console_test").warning("HF-WARNING")
hf_logging.get_logger("transformers.console_test").error("HF-ERROR")
logging.getLogger("accelerate.console_test").warning("ACCELERATE-WARNING")
logging.getLogger("accelerate.console_test").error("ACCELERATE-ERROR")
library_file = os.path.join(sysconfig.get_paths()["purelib"], "some_library.py")  # a warning raised in a library
exec(compile("import warnings; warnings.warn('LIBRARY-WARNING', FutureWarning)", library_file, "exec"))
warnings.warn("USER-WARNING")  # raised by the user's own code
print("PRINTED")
"""
HIDDEN = ["VLLM-INFO", "VLLM-WARNING", "DS-WARNING", "HF-WARNING", "ACCELERATE-WARNING", "LIBRARY-WARNING"]
SHOWN = ["VLLM-ERROR", "DS-ERROR", "HF-ERROR", "ACCELERATE-ERROR", "USER-WARNING", "PRINTED"]


def clean_env(**extra) -> dict:
    """This environment without the variables quiet_libraries sets (another test may have left them)."""
    env = {k: v for k, v in os.environ.items() if k not in console.LIBRARY_ENV}
    return {**env, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_library_logs_and_warnings_are_hidden_unless_verbose_and_errors_always_show(mode):
    proc = subprocess.run([sys.executable, "-c", LIBRARIES, mode], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for marker in SHOWN:
        assert marker in out, marker
    for marker in HIDDEN:
        assert (marker in out) == (mode == "verbose"), marker
    if "Setting accelerator to CPU" in out or mode == "quiet":  # DeepSpeed only warns on a machine without GPU
        assert ("Setting accelerator to CPU" in out) == (mode == "verbose")


def test_muted_holds_back_library_output_and_shows_it_when_the_call_fails(monkeypatch, capfd):
    monkeypatch.setattr(console, "_verbose", False)
    with console.muted():
        os.write(1, b"C-LEVEL STDOUT\n")  # as a C++ extension writes, past Python's sys.stdout
        os.write(2, b"C-LEVEL STDERR\n")
    assert capfd.readouterr() == ("", "")
    with pytest.raises(RuntimeError, match="engine failed"):
        with console.muted():
            os.write(2, b"why it failed\n")
            raise RuntimeError("engine failed")
    assert "why it failed" in capfd.readouterr().err
    monkeypatch.setattr(console, "_verbose", True)
    with console.muted():
        os.write(1, b"VERBOSE\n")
    assert "VERBOSE" in capfd.readouterr().out
