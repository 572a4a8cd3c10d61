"""Shared fixtures. Every model and tokenizer here is built locally (shared/tiny.py); nothing is downloaded.

The cache of built-in models (random-init tiny model, and the SFT warm start that the end-to-end tests
need) lives in CLEANRLHF_CACHE, default ~/.cache/cleanrlhf, so repeated test runs reuse it."""

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Signs of an unclean exit, also with exit status 0: C++ std::terminate (e.g. a process group left to interpreter
# exit), an exception in a destructor or exit-time finalizer (Python prints it and goes on), a process group used after
# it was destroyed
UNCLEAN_EXIT = ("terminate called", "Exception ignored in", "Invalid process group")


def assert_clean_exit(output: str, what: str) -> None:
    """Fail when a finished run's output (stdout and stderr) shows an unclean exit; `what` names the run (its
    command). The subprocess helpers of the tests call it after checking the exit status (`from conftest import
    assert_clean_exit`: tests/ is on sys.path under pytest)."""
    unclean = [s for s in UNCLEAN_EXIT if s in output]
    assert not unclean, f"{what} printed {unclean[0]!r} (an unclean exit):\n{output[-6000:]}"


@pytest.fixture(scope="session")
def tiny_model():
    """A random-init tiny Llama (in memory) and its character tokenizer."""
    from transformers import LlamaForCausalLM

    from shared.tiny import build_tokenizer, tiny_config

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
    return model, tok


@pytest.fixture(scope="session")
def tiny_path():
    """Path of the cached random-init built-in tiny model (HF format, vLLM-loadable)."""
    from shared.tiny import builtin_tiny

    return str(builtin_tiny())


@pytest.fixture(autouse=True)
def _undo_quiet_libraries():
    """A test that calls run_cli in-process quiets the libraries for the whole process (shared/console.py: environment
    variables, logger levels): undo it afterwards, so later tests and the subprocesses they start see the defaults."""
    import logging

    from shared import console

    env = dict(os.environ)
    loggers = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters))
               for name in console.LIBRARY_LOGGERS}
    yield
    if not console._verbose:
        os.environ.clear()
        os.environ.update(env)
        for name, (level, filters) in loggers.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).filters[:] = filters
        console._verbose = True


# The longest test files, started first so that neither worker is left with one of them at the end
LONGEST_FIRST = ("test_real_model_e2e", "test_e2e", "test_lora")


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the suite on 2 pytest-xdist workers (`-n 2 --dist loadfile`: a file's tests on one
    worker, so a module-scoped fixture, e.g. a trained reward model or a converted chat model, is built once; xdist's
    `loadgroup` does not group under pytest 9.2). The longest files go first."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))
