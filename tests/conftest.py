"""Shared fixtures. Every model and tokenizer here is built locally (shared/tiny.py); nothing is downloaded.

The cache of built-in models (random-init tiny model, and the SFT warm start that the end-to-end tests
need) lives in CLEANRLHF_CACHE, default ~/.cache/cleanrlhf, so repeated test runs reuse it."""

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the suite on 2 pytest-xdist workers (`-n 2 --dist loadgroup`): the tests that share a
    module-scoped fixture (a trained reward model, a vLLM engine, a converted chat model) go to one worker together,
    so that each such fixture is built once."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
