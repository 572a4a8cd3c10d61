"""Weight sync into vLLM for a model with tied input and output embeddings (its own file: a second vLLM engine in
the process of tests/test_generation.py's module engine would break that one's parallel state)."""

import copy
from pathlib import Path

import torch

from shared import data
from shared.distributed import full_named_parameters
from shared.generation import VLLMGenerator
from test_generation import INFO, T, TOL, max_diff, model_dir  # noqa: F401  (model_dir: the fixture)


def test_vllm_sync_with_tied_embeddings(model_dir, tmp_path):
    """Tied input and output embeddings (SmolLM2, Qwen2.5-0.5B/1.5B, Llama-3.2-1B): the trainer has one parameter
    for both, so the sync sends embed_tokens only and vLLM (whose LM head is the same tensor) must still serve the
    new output layer. One step that changes only that tensor, then the log-probs are compared."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()  # lm_head.weight is now embed_tokens.weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    path = tmp_path / "tied"
    model.save_pretrained(path)
    for f in Path(model_dir).iterdir():
        if "token" in f.name or f.name == "generation_config.json":
            shutil.copy(f, path / f.name)
    engine = VLLMGenerator(str(path), tok, dtype=torch.float32, seed=0, max_model_len=64)
    prompts = [data.encode_prompt(tok, t, False) for t in ["3+4+5+1=", "9+9="]]
    kw = dict(n=4, temperature=T, top_p=1.0, max_new_tokens=12, seed=5)
    before = engine.generate(prompts, **kw)
    assert max_diff(model, prompts, before) < TOL
    old = copy.deepcopy(model)
    with torch.no_grad():  # change the shared embedding only: the output layer moves with it
        model.get_input_embeddings().weight.add_(0.5 * torch.randn_like(model.get_input_embeddings().weight))
    names = [n for n, _ in full_named_parameters(model, INFO)]
    assert not any("lm_head" in n for n in names)  # one tensor for both, sent once
    engine.sync_weights(full_named_parameters(model, INFO))
    after = engine.generate(prompts, **kw)
    assert max_diff(model, prompts, after) < TOL
    assert max_diff(old, prompts, after) > 1e-2
