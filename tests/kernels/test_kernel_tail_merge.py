"""The estimate merged with the selection in one more launch (``tail_attention_merged``) against the torch
composition it replaces: the estimate (``tail_attention``), the far blocks' mass and ``merge_attention``.

The kernel runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``);
elsewhere the same function takes the torch path, which the last test checks.
"""

from __future__ import annotations

import pytest
import torch

import hf_offload.kernels.tail as tail_module
from hf_offload.kernels.tail import (
    far_midpoints,
    finish_tail_reference,
    merge_attention,
    tail_attention,
    tail_attention_merged,
    tail_partials,
    with_far_values,
)
from hf_offload.kernels.quant import quantize_keys

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernels = pytest.mark.triton


def _inputs(batch, capacity, n, heads, group, tokens, dim, seed=0):
    """Quantized keys (4 bits) and values (2 bits) of ``capacity`` blocks, a scaled query, the tokens of ``n`` near
    blocks and their index, the selection's attention and block log-sum-exps of a capacity-wide buffer."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(batch, capacity, heads, tokens, dim, generator=g) * 2).to(torch.bfloat16)
    values = torch.randn(batch, capacity, heads, tokens, dim, generator=g).to(torch.bfloat16)
    kq = {k: v.to(DEVICE) for k, v in quantize_keys(keys, 4).items()}
    vq = {k: v.to(DEVICE) for k, v in quantize_keys(values, 2).items()}
    query = (torch.randn(batch, heads, group, dim, generator=g) * dim**-0.5).to(DEVICE)
    index = torch.stack([torch.randperm(capacity, generator=g)[:n] for _ in range(batch)]).to(DEVICE)
    near_ok = (torch.rand(batch, n, tokens, generator=g) > 0.3).to(DEVICE)
    near_ok[0] = False  # a sequence with nothing estimated token by token: its far blocks must not count
    sel_out = torch.randn(batch, heads, group, dim, generator=g).to(DEVICE)
    sel_lse = (torch.randn(batch, heads, group, generator=g) * 3).to(DEVICE)
    wide = torch.randn(batch, heads, group, capacity + 5, generator=g) * 4  # a buffer past the blocks in use
    wide[..., 1] = float("-inf")  # blocks with no valid token
    block_lse = wide.to(DEVICE)[..., :capacity]
    far = (torch.rand(batch, capacity, generator=g) > 0.4).to(DEVICE)
    far.scatter_(1, index, False)
    return query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far


def _composed(query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse=None, far=None):
    """What the decode step computed before: the estimate, the far mass added, merged with the selection."""
    out_t, lse_t = tail_attention(query, kq, 4, vq, 2, near_ok, index=index, precision="ieee")
    if block_lse is not None:
        far_lse = block_lse.masked_fill(~far[:, None, None, :], float("-inf")).logsumexp(-1)
        far_lse = far_lse.masked_fill(torch.isinf(lse_t), float("-inf"))
        lse_t = torch.logaddexp(lse_t, far_lse)
    out, _ = merge_attention(sel_out, sel_lse, out_t, lse_t)
    return out, lse_t


@needs_kernels
@pytest.mark.parametrize("with_far", [True, False])
@pytest.mark.parametrize("shape", [(2, 40, 7, 2, 4, 16, 64), (3, 130, 33, 1, 7, 16, 128)])
def test_merged_kernel_matches_the_composition(with_far, shape):
    batch, capacity, n, heads, group, tokens, dim = shape
    query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far = _inputs(*shape)
    assert len(tail_partials(query, kq, 4, vq, 2, near_ok, index=index)) == 3  # the kernel path, not the reference
    extra = dict(block_lse=block_lse, far=far) if with_far else {}
    want_out, want_lse = _composed(query, kq, vq, near_ok, index, sel_out, sel_lse, **extra)
    old = tail_module.FINISH_BLOCK_N
    try:
        for step in (old, 32):  # one step over the far blocks, and several
            tail_module.FINISH_BLOCK_N = step
            out, lse = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, **extra)
            # (the estimate's own products in TF32 on CUDA, as the decode step runs them)
            torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(out, want_out, atol=2e-3, rtol=2e-3)
            # Nothing estimated for sequence 0: its far blocks are not counted and the selection stands alone.
            assert torch.isneginf(lse[0]).all()
            torch.testing.assert_close(out[0], sel_out[0])
    finally:
        tail_module.FINISH_BLOCK_N = old
    bf16, _ = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index,
                                    out_dtype=torch.bfloat16, **extra)  # fmt: skip
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, want_out.to(torch.bfloat16), atol=2e-2, rtol=2e-2)


@needs_kernels
def test_merged_kernel_reads_a_capacity_wide_block_lse_in_place_and_a_copy_alike():
    query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far = _inputs(2, 40, 7, 2, 4, 16, 64)
    assert block_lse.stride(-2) != block_lse.shape[-1]  # a view into a wider buffer
    a = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=block_lse, far=far)
    b = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index,
                              block_lse=block_lse.contiguous(), far=far)  # fmt: skip
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Perturbing a far block's log-sum-exp moves the result; perturbing a block that is not far does not.
    j_far, j_not = int(far[1].nonzero()[0]), int((~far[1]).nonzero()[0])
    moved = block_lse.clone()
    moved[1, :, :, j_far] += 5.0
    c = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=moved, far=far)
    assert not torch.allclose(c[1][1], a[1][1])
    same = block_lse.clone()
    same[1, :, :, j_not] += 5.0
    d = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=same, far=far)
    torch.testing.assert_close(d, a, atol=0, rtol=0)


def test_torch_path_is_the_reference_composition():
    """Where the kernel cannot run (here: float64 summaries), the same function is the torch composition."""
    query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far = _inputs(2, 40, 7, 2, 4, 16, 64)
    kq = {k: v.double() if v.is_floating_point() else v for k, v in kq.items()}
    assert len(tail_partials(query, kq, 4, vq, 2, near_ok, index=index)) == 2
    out, lse = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=block_lse,
                                     far=far)  # fmt: skip
    out_t, lse_t = tail_attention(query, kq, 4, vq, 2, near_ok, index=index)
    want_out, want_lse = finish_tail_reference(out_t, lse_t, sel_out, sel_lse, block_lse, far)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="together"):
        tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=block_lse)


def _mid_composed(query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far):
    """``tail_far="mid"`` written out: the far blocks as one more softmax part, every token of a far block at the
    midpoint of its block's value range and the block's mass its log-sum-exp, whether anything was estimated."""
    out_t, lse_t = tail_attention(query, kq, 4, vq, 2, near_ok, index=index, precision="ieee")
    mid = vq["kmin"].float() + vq["kstep"].float() * 1.5  # [B, n, H, D]
    blse = block_lse.masked_fill(~far[:, None, None, :], float("-inf"))
    far_lse = blse.logsumexp(-1)
    p = torch.softmax(blse, dim=-1).nan_to_num(0.0)
    out_f = torch.einsum("bhgn,bnhd->bhgd", p, mid)
    lse = torch.logaddexp(lse_t, far_lse)
    out_t = torch.where(torch.isinf(lse_t)[..., None], out_f, out_t * torch.exp(lse_t - lse)[..., None]
                        + out_f * torch.exp(far_lse - lse)[..., None])  # fmt: skip
    out, _ = merge_attention(sel_out, sel_lse, out_t, lse)
    return out, lse


def test_far_midpoints_value_each_far_block_at_its_own_range():
    query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far = _inputs(2, 40, 7, 2, 4, 16, 64)
    kq = {k: v.double() if v.is_floating_point() else v for k, v in kq.items()}  # the torch path
    out, lse = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index,
                                     block_lse=block_lse, far=far, far_mid=True)  # fmt: skip
    want_out, want_lse = _mid_composed(query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    # Sequence 0 estimated nothing token by token: its far blocks count all the same, at their midpoints.
    assert torch.isfinite(lse[0]).all()
    assert not torch.allclose(out[0], sel_out[0])
    # A far block's midpoint moves the result; a block that is not far does not.
    j_far, j_not = int(far[1].nonzero()[0]), int((~far[1]).nonzero()[0])
    for j, moves in ((j_far, True), (j_not, False)):
        shifted = dict(vq, kmin=vq["kmin"].clone())
        shifted["kmin"][1, j] += 3.0
        other, _ = tail_attention_merged(query, kq, 4, shifted, 2, near_ok, sel_out, sel_lse, index=index,
                                         block_lse=block_lse, far=far, far_mid=True)  # fmt: skip
        assert torch.allclose(other[1], out[1]) != moves
    # No far block: the estimate alone, as without far_mid.
    none = torch.zeros_like(far)
    a = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=block_lse,
                              far=none, far_mid=True)  # fmt: skip
    b = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index, block_lse=block_lse,
                              far=none)  # fmt: skip
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # The building blocks: the midpoints, and the far part merged with an estimate.
    torch.testing.assert_close(far_midpoints(vq, 2), vq["kmin"].float() + 1.5 * vq["kstep"].float())
    out_t, lse_t = tail_attention(query, kq, 4, vq, 2, near_ok, index=index)
    merged_out, merged_lse = with_far_values(out_t, lse_t, block_lse, far, far_midpoints(vq, 2))
    torch.testing.assert_close(finish_tail_reference(out_t, lse_t, sel_out, sel_lse, block_lse, far,
                                                     far_midpoints(vq, 2))[1], merged_lse)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("shape", [(2, 40, 7, 2, 4, 16, 64), (3, 130, 33, 1, 7, 16, 128)])
def test_merged_kernel_values_far_blocks_at_their_midpoints(shape):
    query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far = _inputs(*shape)
    assert len(tail_partials(query, kq, 4, vq, 2, near_ok, index=index)) == 3  # the kernel path
    want_out, want_lse = _mid_composed(query, kq, vq, near_ok, index, sel_out, sel_lse, block_lse, far)
    old = tail_module.FAR_MID_SPLIT_N, tail_module.FAR_MID_BLOCK_N
    try:
        # One program per KV head over all far blocks, several programs (the last one part empty), several steps
        # per program.
        for split, step in ((old[0], old[1]), (16, 16), (32, 8)):
            tail_module.FAR_MID_SPLIT_N, tail_module.FAR_MID_BLOCK_N = split, step
            out, lse = tail_attention_merged(query, kq, 4, vq, 2, near_ok, sel_out, sel_lse, index=index,
                                             block_lse=block_lse, far=far, far_mid=True)  # fmt: skip
            torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(out, want_out, atol=2e-3, rtol=2e-3)
    finally:
        tail_module.FAR_MID_SPLIT_N, tail_module.FAR_MID_BLOCK_N = old


def _plan_inputs(batch=3, capacity=70, n=64, k=9, near=20, tokens=16, seed=0):
    """A token mask of a capacity-wide buffer (some blocks partly padding), a ranking whose first ``k`` entries are
    the selection (some not kept) and the next ``near`` the near blocks, and scores with some ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(batch, capacity, tokens, generator=g) > 0.05
    rows[:, :, :] |= torch.rand(batch, capacity, 1, generator=g) > 0.5  # many blocks fully attendable
    scores = torch.randn(batch, n, generator=g)
    scores[:, 3] = float("-inf")
    ranked = torch.stack([torch.randperm(n, generator=g)[: k + near] for _ in range(batch)])
    ranked[0, k] = 3  # a near block that may not be attended
    keep = torch.rand(batch, k, generator=g) > 0.2
    wide = torch.cat([ranked, torch.zeros(batch, 5, dtype=torch.int64)], dim=1)  # a view, as the selection's
    to = lambda x: x.to(DEVICE)  # noqa: E731
    return to(rows)[:, :n], to(wide)[:, :k], to(keep), to(wide)[:, k : k + near], to(scores)


_PLAN_SPLITS = [
    dict(),
    dict(PLAN_BLOCK_N=64),  # ranges walked 64 blocks a step
    dict(PLAN_BLOCK_N=2048, PLAN_MIN_BLOCKS=1 << 30),  # one program per sequence
    # Several ranges per sequence (the last one partly past the end) of several steps each, the near blocks' steps
    # shared among them unevenly.
    dict(PLAN_BLOCK_N=16, PLAN_MIN_BLOCKS=16, PLAN_PROGRAMS=8, PLAN_NEAR_BLOCK=8),
]


@needs_kernels
@pytest.mark.parametrize("shape", [dict(), dict(batch=2, capacity=5000, n=4100, k=128, near=384),
                                   dict(batch=1, capacity=8300, n=8200, k=128, near=400)])  # fmt: skip
def test_plan_kernel_matches_the_torch_code(shape, monkeypatch):
    rows, blocks, keep, index, scores = _plan_inputs(**shape)
    assert rows.stride(1) == rows.shape[-1] and (rows.shape[0] == 1 or not rows.is_contiguous())
    want_ok, want_far = tail_module.tail_plan_reference(rows, blocks, keep, index, scores)
    for split in _PLAN_SPLITS:
        with monkeypatch.context() as patch:
            for name, value in split.items():
                patch.setattr(tail_module, name, value)
            near_ok, far = tail_module.tail_plan(rows, blocks, keep, index, scores)
        assert torch.equal(near_ok, want_ok) and torch.equal(far, want_far), split
    assert not near_ok[0, 0].any()  # score -inf: nothing to estimate
    assert not far.gather(1, index).any() and not far.gather(1, blocks)[keep].any()
    assert far.any() and near_ok.any()


def test_plan_reference_is_the_estimate_s_torch_code():
    """The reference is what the selector computed before: the kept blocks left out, near_index's near tokens, the
    far blocks of tail_attention."""
    from hf_offload.selectors.base import Selection, unselected_tokens
    from hf_offload.selectors.quantkey import QuantKeySelector

    rows, blocks, keep, index, scores = [x.cpu() for x in _plan_inputs()]
    k, near = blocks.shape[-1], index.shape[-1]
    ranked = torch.cat([blocks, index], dim=1)[:, None]
    selection = Selection(blocks=blocks[:, None], keep=keep[:, None], scores=scores[:, None], ranked=ranked)
    tail = unselected_tokens(rows, selection)
    selector = QuantKeySelector(bits=4, tail_bits=2, tail_near=near / k)
    assert selector.near_count(selection, rows.shape[1]) == near
    want_ok, want_index = selector.near_index(tail, selection)
    near_ok, far = tail_module.tail_plan_reference(rows, blocks, keep, index, scores)
    assert torch.equal(want_index, index) and torch.equal(near_ok, want_ok)
    assert torch.equal(far, tail.all(dim=-1).scatter(1, index, False))
