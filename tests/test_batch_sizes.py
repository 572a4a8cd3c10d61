"""The micro-batch size is a memory cap: a minibatch smaller than it runs as one micro-batch in every script that
splits a minibatch into micro-batches; a minibatch larger than it must still divide into whole micro-batches."""

import importlib

import pytest
import tyro


class SizesDerived(Exception):
    """Raised where a script resolves its model, right after it derived its batch sizes."""


def derived_sizes(script: str, argv: list[str], monkeypatch):
    mod = importlib.import_module(f"algorithms.{script}")
    args = tyro.cli(mod.Args, args=argv)

    def stop(*_a, **_k):
        raise SizesDerived

    monkeypatch.setattr(mod, "resolve_model_path", stop)
    with pytest.raises(SizesDerived):
        mod.main(args)
    return args


# (script, flags giving a local minibatch of 32 completions, that minibatch)
SMALL_MINIBATCH = [
    ("grpo", ["--local_num_prompts", "8", "--num_generations", "8", "--num_minibatches", "2"], 32),
    ("ppo", ["--local_num_prompts", "4", "--num_generations", "8", "--num_minibatches", "1"], 32),
    ("vineppo", ["--local_num_prompts", "4", "--num_generations", "8", "--num_minibatches", "1"], 32),
    ("drca", ["--local_num_prompts", "4", "--num_generations", "8", "--num_minibatches", "1"], 32),
]


@pytest.mark.parametrize("script, flags, minibatch", SMALL_MINIBATCH)
def test_a_minibatch_smaller_than_the_micro_batch_is_one_micro_batch(script, flags, minibatch, tmp_path,
                                                                     monkeypatch):
    args = derived_sizes(script, [*flags, "--local_micro_batch_size", "64", "--output_dir", str(tmp_path)],
                         monkeypatch)
    assert args.local_minibatch_size == minibatch
    assert args.local_micro_batch_size == minibatch and args.gradient_accumulation_steps == 1


def test_repulse_batch_smaller_than_the_micro_batch_is_one_micro_batch(tmp_path, monkeypatch):
    args = derived_sizes("repulse", ["--local_num_prompts", "4", "--num_generations", "4",
                                     "--local_micro_batch_size", "250", "--output_dir", str(tmp_path)], monkeypatch)
    assert args.local_micro_batch_size == 16


@pytest.mark.parametrize("script, flags, minibatch", SMALL_MINIBATCH)
def test_a_larger_minibatch_still_divides_into_micro_batches(script, flags, minibatch, tmp_path, monkeypatch):
    args = derived_sizes(script, [*flags, "--local_micro_batch_size", "8", "--output_dir", str(tmp_path)], monkeypatch)
    assert args.local_micro_batch_size == 8 and args.gradient_accumulation_steps == minibatch // 8
    mod = importlib.import_module(f"algorithms.{script}")
    with pytest.raises(ValueError, match="local_micro_batch_size"):
        mod.main(tyro.cli(mod.Args, args=[*flags, "--local_micro_batch_size", "24", "--output_dir", str(tmp_path)]))
