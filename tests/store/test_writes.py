"""Device writes gathered over a block and launched together (``hf_offload.store.writes``: a fork's refill)."""

from __future__ import annotations

import pytest
import torch

from hf_offload.store import writes


def test_writes_outside_a_block_run_at_once():
    a = torch.ones(4)
    writes.zero_(a)
    assert not a.any()
    writes.fill_(a, -1)
    assert (a == -1).all()
    writes.copy_(a[:2], torch.tensor([5.0]))
    assert a.tolist() == [5, 5, -1, -1]


def test_gathered_writes_land_at_the_end_zeros_before_copies():
    buffer, table, counts = torch.ones(2, 6), torch.zeros(2, 5, dtype=torch.int64), torch.ones(3, dtype=torch.int64)
    source = torch.arange(3.0)[None]
    with writes.gathered():
        writes.zero_(buffer)  # a buffer cleared, then part of it filled: the copy wins, as op by op
        writes.copy_(buffer[:, :3], source)  # broadcast over the rows
        writes.fill_(table[:, 2:], -1)
        writes.fill_(counts, 0)
        with writes.gathered():  # nested: the outer block launches
            writes.copy_(table[:, :2], torch.tensor([[7, 8]]))
        assert buffer.eq(1).all() and not table.any() and counts.eq(1).all()  # nothing written yet
    assert buffer.tolist() == [[0, 1, 2, 0, 0, 0]] * 2
    assert table.tolist() == [[7, 8, -1, -1, -1]] * 2
    assert not counts.any()


def test_gathered_writes_are_dropped_on_an_exception_and_the_next_block_starts_empty():
    a = torch.ones(3)
    with pytest.raises(RuntimeError, match="stop"), writes.gathered():
        writes.zero_(a)
        raise RuntimeError("stop")
    assert a.eq(1).all()
    with writes.gathered():
        writes.fill_(a, 2)
    assert a.eq(2).all()


def test_gathered_writes_reach_inference_tensors_and_other_dtypes_at_once():
    with torch.inference_mode():
        made_in_inference = torch.ones(3)
    half, wide = torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float64)
    with writes.gathered():
        writes.zero_(made_in_inference)
        writes.copy_(half, wide * 3)  # another dtype: copied at once
        assert half.eq(3).all()
    assert not made_in_inference.any()
