"""What the RL scripts log about the mismatch between the sampler's log-probs (vLLM or HF generate, the weights of
the last sync) and the trainer's (pi_old: the same weights in the training forward, or newer ones when generation
runs ahead), every step, whatever `--tis` does. Logging only: the correction itself is each script's `tis_weights`.

    metrics = mismatch_metrics(old_logp, sampler_logp, mask, w, w_raw)   # w: --tis weights; w_raw: before C and lo
"""

from __future__ import annotations

import torch


def mismatch_metrics(logp_old: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor, w: torch.Tensor,
                     w_raw: torch.Tensor) -> dict[str, float]:
    """Over the completion tokens of a batch ([B, T] tensors; mask 1 on them), with rho_t = pi_old(y_t) /
    pi_sampler(y_t) before any truncation or mask:
      val/tis_ratio, _min, _max, _p99       mean, min, max and 99th percentile of rho
      val/sampler_logprob_diff              mean |log rho|
      val/sampler_kl                        mean of rho - 1 - log rho: the k3 estimate of KL(pi_sampler || pi_old)
                                            from the sampler's own tokens (>= 0; 0 when they agree)
      val/tis_weight                        mean weight w the loss uses
      val/tis_clipfrac, val/tis_seq_clipfrac  fraction of tokens, and of completions on at least one token, whose
                                            weight the correction changed (w != w_raw: truncated or masked); the
                                            completions counted are those with a trained token (mask > 0)
    A batch without completion tokens gives rho = 1 everywhere. The percentile is taken by rank selection (kthvalue)
    (torch.quantile refuses inputs of more than 2^24 elements: a long-CoT batch has more tokens on one rank)."""
    keep = mask > 0
    log_rho = (logp_old - logp_sampler)[keep].detach().float()
    if not len(log_rho):
        log_rho = torch.zeros(1)
    rho = torch.exp(log_rho)
    changed = (w != w_raw) & keep
    rows = keep.any(1)
    return {"val/tis_ratio": rho.mean().item(), "val/tis_ratio_min": rho.min().item(),
            "val/tis_ratio_max": rho.max().item(), "val/tis_ratio_p99": quantile(rho, 0.99),
            "val/sampler_logprob_diff": log_rho.abs().mean().item(),
            "val/sampler_kl": (rho - 1 - log_rho).mean().item(),
            "val/tis_weight": (w[keep].mean() if keep.any() else torch.ones(())).item(),
            "val/tis_clipfrac": (changed.sum() / keep.sum().clamp(min=1)).item(),
            "val/tis_seq_clipfrac": (changed.any(1).sum() / rows.sum().clamp(min=1)).item()}


def quantile(x: torch.Tensor, q: float) -> float:
    """torch.quantile(x, q) of a 1-D tensor (linear interpolation between the two nearest ranks), of any length."""
    x = x.flatten()
    pos = q * (len(x) - 1)
    lo = int(pos)
    below, above = x.kthvalue(lo + 1).values, x.kthvalue(min(lo + 2, len(x))).values  # ranks lo and lo + 1
    return (below + (pos - lo) * (above - below)).item()
