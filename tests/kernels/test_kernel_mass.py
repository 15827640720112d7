"""The block-scores kernels give the torch code's scores (softmax over the valid blocks per head, summed over heads,
forced blocks ``+inf``, blocks that are not valid ``-inf``) up to float32 rounding, with the same infinite entries
and the same top-k selections. Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels.mass import BLOCK_N, block_scores, block_scores_reference, block_scores_supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _inputs(batch, heads, group, n, seed, spread=8.0):
    g = torch.Generator().manual_seed(seed)
    lse = torch.randn(batch, heads, group, n, generator=g) * spread
    valid = torch.rand(batch, n, generator=g) > 0.1
    valid[:, :1] = True
    forced = torch.zeros(batch, n, dtype=torch.bool)
    forced[:, :1] = True  # a sink block
    forced[:, -2:] = True  # window blocks
    forced[:, -1] = False if n > 2 else forced[:, -1]
    return lse.to(DEVICE), valid.to(DEVICE), forced.to(DEVICE)


@pytest.mark.parametrize("batch,heads,group,n", [(3, 2, 4, 37), (2, 8, 4, BLOCK_N), (1, 4, 1, 3 * BLOCK_N + 5),
                                                 (2, 2, 3, 40 * BLOCK_N), (4, 1, 7, 1)])  # fmt: skip
def test_block_scores_match_the_torch_code(batch, heads, group, n):
    lse, valid, forced = _inputs(batch, heads, group, n, seed=n)
    assert block_scores_supported(lse)
    got, want = block_scores(lse, valid, forced), block_scores_reference(lse, valid, forced)
    assert got.shape == want.shape == (batch, 1, n) and got.dtype == torch.float32
    assert torch.equal(got == float("inf"), want == float("inf"))
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-7)
    k = min(n, 5)
    if n > 2:  # top-k of well-separated random scores: the same blocks, in the same order
        assert torch.equal(got.topk(k).indices, want.topk(k).indices)


def test_rows_without_valid_blocks_and_infinite_logits():
    """A sequence with no valid block scores -inf everywhere (forced or not); a head whose valid blocks all have
    -inf logits adds nothing (the torch code's softmax of such a row is nan, which ends up only in that row)."""
    lse, valid, forced = _inputs(3, 2, 2, 50, seed=1)
    valid[1] = False
    lse[2, 1, 0] = float("-inf")
    got = block_scores(lse, valid, forced).cpu()
    assert (got[1] == float("-inf")).all()
    assert torch.isfinite(got[2][~forced[2].cpu()[None] & valid[2].cpu()[None]]).all()
    # Sequence 2 without its -inf head: the sum over the other three heads
    want = block_scores_reference(lse[2:, [0, 1], :][:, :, 1:], valid[2:], forced[2:]).cpu()
    want0 = block_scores_reference(lse[2:, :1, :1], valid[2:], forced[2:]).cpu()
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[2:][finite], (want + want0)[finite], rtol=1e-5, atol=1e-7)


def test_the_quantkey_selection_is_the_one_of_the_torch_scores():
    """QuantKeySelector.select through the kernels picks the blocks that the torch scores of the same block
    log-sum-exps pick (plain and with the bounded estimate's ranking)."""
    from hf_offload.kernels.quant import quantize_keys
    from hf_offload.selectors.quantkey import QuantKeySelector

    g = torch.Generator().manual_seed(3)
    batch, heads, group, n, tokens, dim, k = 2, 2, 2, 40, 16, 32, 7
    keys = torch.randn(batch, n, heads, tokens, dim, generator=g)
    query = torch.randn(batch, heads, group, dim, generator=g).to(DEVICE)
    summaries = {name: t.to(DEVICE) for name, t in quantize_keys(keys, 4).items()}
    valid = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    valid[0, 5:9] = False
    forced = torch.zeros(batch, n, dtype=torch.bool, device=DEVICE)
    forced[:, 0] = forced[:, -1] = True
    for spec in (QuantKeySelector(bits=4), QuantKeySelector(bits=4, tail_bits=2, tail_near=1.0)):
        sel = spec.select(query, summaries, 0.2, k, forced, valid)
        lse = spec.block_lse(query, summaries, 0.2)
        scores = block_scores_reference(lse, valid, forced)
        want = scores.topk(k).indices
        # The same blocks; forced blocks tie at +inf, which top-k may order either way (it does on CUDA).
        assert torch.equal(sel.blocks.sort(-1).values, want.sort(-1).values)
        assert bool(sel.keep.all())
        if spec.tail_near:
            assert sel.ranked is not None and sel.ranked.shape[-1] == k + k
            near = scores.topk(k + k).indices[..., k:]
            assert torch.equal(sel.ranked[..., k:].sort(-1).values, near.sort(-1).values)
            assert bool((sel.block_lse[0, :, :, 5:9] == float("-inf")).all())


@pytest.mark.parametrize("batch,heads,group,n", [(3, 2, 4, 37), (1, 4, 1, 3 * BLOCK_N + 5)])
def test_block_scores_also_write_the_masked_log_sum_exps(batch, heads, group, n):
    """With ``masked``, the second launch also writes ``lse`` with ``-inf`` for the blocks that are not valid; the
    scores are those without it."""
    lse, valid, forced = _inputs(batch, heads, group, n, seed=n + 1)
    scores, masked = block_scores(lse, valid, forced, masked=True)
    assert torch.equal(scores, block_scores(lse, valid, forced))
    assert torch.equal(masked, lse.masked_fill(~valid[:, None, None, :], float("-inf")))
    assert (~valid).any()
