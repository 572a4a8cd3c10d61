"""sft.py's loss: its mask (response and EOS, also when pad == eos) and its reductions."""

import pytest
import torch

from algorithms.sft import reduce_loss, sequence_nll
from shared import data


def _batch(tok, pad_id=None):
    prompts = [data.encode_prompt(tok, p, False) for p in ["1+2=", "3+4+5+6="]]
    responses = [data.encode_response(tok, r) for r in ["3", "7\n12\n18"]]
    return data.pad_batch(prompts, responses, tok.pad_token_id if pad_id is None else pad_id)


def test_loss_mask_covers_response_and_eos_only(tiny_model):
    model, tok = tiny_model
    ids, attn, resp = _batch(tok)
    nll, mask = sequence_nll(model, ids, attn, resp)
    # mask[t] marks the prediction of token t+1: exactly the response tokens (EOS included)
    for i in range(2):
        predicted = ids[i, 1:][mask[i].bool()].tolist()
        assert predicted[-1] == tok.eos_token_id
        assert tok.decode(predicted[:-1]) in ("3", "7\n12\n18")
    assert nll.shape == mask.shape == (2, ids.shape[1] - 1)


def test_eos_stays_in_the_loss_when_pad_is_eos(tiny_model):
    model, tok = tiny_model
    ids, attn, resp = _batch(tok, pad_id=tok.eos_token_id)
    _, mask = sequence_nll(model, ids, attn, resp)
    for i in range(2):
        assert (ids[i, 1:][mask[i].bool()] == tok.eos_token_id).sum() == 1


def test_seq_mean_is_mean_of_per_sequence_means_and_differs_from_token_mean():
    nll = torch.tensor([[1.0, 3.0, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert reduce_loss(nll, mask, "seq_mean", 2, 5).item() == pytest.approx((2.0 + 2.0) / 2)
    assert reduce_loss(nll, mask, "token_mean", 2, 5).item() == pytest.approx(10.0 / 5)
    nll2 = torch.tensor([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask2 = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert reduce_loss(nll2, mask2, "seq_mean", 2, 4).item() == pytest.approx(2.5)
    assert reduce_loss(nll2, mask2, "token_mean", 2, 4).item() == pytest.approx(7.0 / 4)


@pytest.mark.parametrize("reduction", ["seq_mean", "token_mean"])
def test_reduction_is_invariant_to_gradient_accumulation(reduction):
    nll = torch.rand(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    tokens = int(mask.sum())
    whole = reduce_loss(nll, mask, reduction, 4, tokens)
    parts = sum(reduce_loss(nll[i : i + 1], mask[i : i + 1], reduction, 4, tokens) for i in range(4))
    assert torch.isclose(whole, parts)


@pytest.mark.parametrize("reduction", ["seq_mean", "token_mean"])
def test_two_ranks_equal_one_rank_accumulating_both_halves(reduction):
    """Each rank's loss is averaged over ranks (as DeepSpeed averages gradients); with uneven token counts per rank
    the old per-rank token mean weighted tokens differently from one rank accumulating the same two halves."""
    torch.manual_seed(0)
    nll = torch.rand(4, 6)
    mask = torch.tensor([[1.0] * 6, [1.0] * 5 + [0.0], [1.0, 0, 0, 0, 0, 0], [1.0, 1.0, 0, 0, 0, 0]])
    tokens = int(mask.sum())
    one_rank = sum(reduce_loss(nll[i : i + 2], mask[i : i + 2], reduction, 4, tokens) for i in (0, 2))
    # 2 ranks, 2 sequences each (num_seqs counts this rank's step: 2), tokens counted over both ranks
    two_ranks = sum(reduce_loss(nll[i : i + 2], mask[i : i + 2], reduction, 2, tokens, world_size=2)
                    for i in (0, 2)) / 2
    assert torch.isclose(one_rank, two_ranks)
    if reduction == "token_mean":
        assert torch.isclose(one_rank, (nll * mask).sum() / tokens)


def test_unknown_reduction_is_rejected():
    with pytest.raises(ValueError, match="loss_reduction"):
        reduce_loss(torch.ones(1, 1), torch.ones(1, 1), "sum", 1, 1)
