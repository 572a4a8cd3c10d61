"""The sampler/trainer mismatch: its correction (`tis_weights`, the same function in every script that samples with
one engine and trains with another) and its diagnostics (shared/mismatch.py), against hand-computed numbers, and the
start-up checks of the flags (--top_p with a correction, --tis_mask_low)."""

import math

import pytest
import torch

from shared.mismatch import mismatch_metrics

SCRIPTS = ["grpo", "dapo", "grpo_async", "ppo", "ppo_async", "ppo_rlhf", "vineppo", "prime", "calibration", "drca"]
MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_mask"]


def _batch():
    """rho = pi_old / pi_sampler: row 0 = 1, 3, 0.25; row 1 = 1.5, 1.2 and a padding token (ratio 7, not counted)."""
    logp_old = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.2, 7.0]]))
    return logp_old, torch.zeros(2, 3), torch.tensor([[1.0, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_every_script_has_grpos_tis_weights(script):
    """Algorithm-local copies of one function: equal on random log-probs, in every mode, cap and lower bound."""
    import importlib

    grpo, other = importlib.import_module("algorithms.grpo"), importlib.import_module(f"algorithms.{script}")
    g = torch.Generator().manual_seed(0)
    old, sampler = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    for mode in MODES:
        for cap, low in ((2.0, 0.0), (5.0, 0.5), (1.001, 0.0), (math.inf, 0.0)):
            assert torch.equal(grpo.tis_weights(old, sampler, mask, mode, cap, low),
                               other.tis_weights(old, sampler, mask, mode, cap, low)), (mode, cap, low)
    assert other.Args().tis_mask_low == 0.0 and other.Args().entropy_coef == 0.0


def test_mismatch_metrics_hand_computed():
    from algorithms.grpo import tis_weights

    logp_old, sampler, mask = _batch()
    w = tis_weights(logp_old, sampler, mask, "token_truncate", 2.0)
    w_raw = tis_weights(logp_old, sampler, mask, "token_truncate", math.inf)
    m = mismatch_metrics(logp_old, sampler, mask, w, w_raw)
    rho = [1.0, 3.0, 0.25, 1.5, 1.2]
    assert m["val/tis_ratio"] == pytest.approx(6.95 / 5)
    assert (m["val/tis_ratio_min"], m["val/tis_ratio_max"]) == pytest.approx((0.25, 3.0))
    # the 99th percentile, interpolated between the two largest of 5 sorted values: 1.5 + 0.96 * (3 - 1.5)
    assert m["val/tis_ratio_p99"] == pytest.approx(2.94)
    assert m["val/sampler_logprob_diff"] == pytest.approx(sum(abs(math.log(r)) for r in rho) / 5)
    # k3: mean of rho - 1 - log rho = (0 + 0.9014 + 0.6363 + 0.0945 + 0.0177) / 5
    assert m["val/sampler_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 5)
    assert m["val/sampler_kl"] == pytest.approx(0.32998, abs=1e-5)
    # the weights used: 1, 2, 0.25, 1.5, 1.2 (3 truncated to C = 2); one token of five, one completion of two
    assert m["val/tis_weight"] == pytest.approx(5.95 / 5)
    assert (m["val/tis_clipfrac"], m["val/tis_seq_clipfrac"]) == pytest.approx((0.2, 0.5))


def test_the_sequence_clip_fraction_counts_only_completions_with_trained_tokens():
    """Rows without a trained token (overlong-filtered, dynamic-sampling fillers) are not completions the correction
    could change: 1 of the 2 trained rows truncated is 0.5, whatever the number of empty rows beside them."""
    from algorithms.grpo import tis_weights

    logp_old, sampler, mask = _batch()
    logp_old, sampler = torch.cat([logp_old, logp_old]), torch.cat([sampler, sampler])
    mask = torch.cat([mask, torch.zeros(2, 3)])  # two rows with no trained token
    w = tis_weights(logp_old, sampler, mask, "token_truncate", 2.0)
    m = mismatch_metrics(logp_old, sampler, mask, w, tis_weights(logp_old, sampler, mask, "token_truncate", math.inf))
    assert m["val/tis_seq_clipfrac"] == pytest.approx(0.5)
    assert m["val/tis_clipfrac"] == pytest.approx(0.2)


def test_the_ratio_percentile_takes_more_than_2_to_the_24_tokens():
    """torch.quantile raises on more than 2^24 elements; a long-CoT step has that many tokens on one rank."""
    n = 2**24 + 10
    log_old = torch.zeros(1, n)
    log_old[0, -100:] = math.log(3.0)  # 100 ratios of 3, the rest 1: the 99th percentile is 1
    m = mismatch_metrics(log_old, torch.zeros(1, n), torch.ones(1, n), torch.ones(1, n), torch.ones(1, n))
    assert m["val/tis_ratio_p99"] == pytest.approx(1.0) and m["val/tis_ratio_max"] == pytest.approx(3.0)
    from shared.mismatch import quantile

    x = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.5, 0.99, 1.0):  # the same linear interpolation as torch.quantile where both apply
        assert quantile(x, q) == pytest.approx(torch.quantile(x, q).item(), abs=1e-6)


def test_mismatch_metrics_of_a_geometric_mask_and_of_agreement():
    from algorithms.grpo import tis_weights

    logp_old, sampler, mask = _batch()
    # C = 1.2: row 1 (geometric mean 1.342) rejected, its 2 tokens of 5
    w = tis_weights(logp_old, sampler, mask, "geometric_mask", 1.2)
    m = mismatch_metrics(logp_old, sampler, mask, w, tis_weights(logp_old, sampler, mask, "geometric_mask", math.inf))
    assert (m["val/tis_clipfrac"], m["val/tis_seq_clipfrac"], m["val/tis_weight"]) == pytest.approx((0.4, 0.5, 0.6))
    # sampler and trainer agree: ratios 1, KL 0, nothing corrected
    same = mismatch_metrics(logp_old, logp_old, mask, torch.ones(2, 3), torch.ones(2, 3))
    assert same["val/tis_ratio_min"] == same["val/tis_ratio_max"] == same["val/tis_ratio_p99"] == 1.0
    assert same["val/sampler_kl"] == same["val/tis_clipfrac"] == 0.0


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("change, message", [
    ({"top_p": 0.9, "tis": "token_truncate"}, "^top_p: the sampler's log-probs are then those of the renormalised"),
    ({"tis_mask_low": 2.0, "tis_cap": 2.0}, r"^tis_mask_low: must be below --tis_cap \(2.0 >= 2.0\)$"),
    ({"tis": "token_mask", "tis_cap": 0.5}, r"^tis_cap: a mask keeps ratios in \[1/C, C\], empty for C = 0.5 <= 1"),
    ({"tis": "geometric_mask", "tis_cap": 1.0}, r"^tis_cap: a mask keeps ratios in \[1/C, C\], empty for C = 1.0")])
def test_a_correction_refuses_a_truncated_sampler_and_an_empty_range(script, change, message):
    """top_p < 1: vLLM's log-probs are those of the renormalised nucleus (logprobs_mode processed_logprobs), the
    trainer's of the whole vocabulary; their ratio is not the mismatch, so a correction by it is refused (one line at
    start-up; --tis none keeps top_p < 1 available). A mask's kept range [lo, C] must not be empty."""
    import importlib

    from shared.cli import check_args

    args = importlib.import_module(f"algorithms.{script}").Args(**change)
    with pytest.raises(ValueError, match=message):
        check_args(args)
    check_args(importlib.import_module(f"algorithms.{script}").Args(top_p=0.9, tis="none"))


@pytest.mark.parametrize("fn", ["compute_advantages", "dppo_surrogate", "cispo_surrogate", "clipped_surrogate",
                                "tis_weights", "validate"])
def test_grpo_async_has_grpos_loss_and_advantage_functions(fn):
    """grpo_async.py repeats grpo.py's pure functions (its loop differs, its algorithm does not): the same source, so
    the flags that switch them (MaxRL, DPPO, CISPO, the mismatch modes) mean the same in both files."""
    import inspect

    from algorithms import grpo, grpo_async

    assert inspect.getsource(getattr(grpo_async, fn)) == inspect.getsource(getattr(grpo, fn))
