"""Property test: random sequences of prefill chunks, decode steps, crops, batch edits, resets, forwards stopped
after the first layer (rolled back) and re-encodings of the summaries at a coarser level; after each one the layer's
KV re-assembled from every tier equals ``DynamicCache``'s after the same calls, bit for bit, every host block is
referenced exactly as counted, and the summaries are the layer's selector's, within their quantization steps of the
KV (``Pair.check``).

The default run draws a CI-sized sample; ``HF_OFFLOAD_PROPERTY_EXAMPLES=10000 python -m pytest
tests/cache/test_edit_sequences.py`` is the long run.
"""

from __future__ import annotations

import os
import warnings

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from .test_editing import Pair

EXAMPLES = int(os.environ.get("HF_OFFLOAD_PROPERTY_EXAMPLES", "25"))

OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),  # a prefill chunk (or a decode step: 1)
    st.tuples(st.just("decode"), st.integers(1, 6)),  # that many one-token steps
    st.tuples(st.just("crop"), st.integers(1, 30)),  # crop(-n)
    st.tuples(st.just("repeat"), st.integers(2, 3)),  # batch_repeat_interleave
    st.tuples(st.just("select"), st.integers(0, 2**16)),  # batch_select_indices, indices drawn from this seed
    st.tuples(st.just("reorder"), st.integers(0, 2**16)),  # reorder_cache (beam indices, repeats allowed)
    st.tuples(st.just("reset"), st.just(0)),
    st.tuples(st.just("fault"), st.integers(1, 20)),  # a forward of that many tokens stopped after the first layer
    st.tuples(st.just("coarsen"), st.just(0)),  # the summaries re-encoded at the next coarser level, if any
)


def _apply(pair: Pair, name: str, arg: int) -> None:
    length = pair.ref.get_seq_length()
    if name == "append":
        pair.append(arg)
    elif name == "decode":
        for _ in range(arg):
            pair.append(1)
    elif name == "crop" and length > arg:
        pair.edit("crop", -arg)
    elif name == "repeat" and length and pair.batch * arg <= 6:
        pair.edit("batch_repeat_interleave", arg)
    elif name in ("select", "reorder") and length:
        g = torch.Generator().manual_seed(arg)
        if name == "select":
            keep = torch.randperm(pair.batch, generator=g)[: 1 + arg % pair.batch].sort().values
            pair.edit("batch_select_indices", keep)
        else:
            pair.edit("reorder_cache", torch.randint(0, pair.batch, (pair.batch,), generator=g))
    elif name == "reset":
        pair.cache.reset()
        pair.ref = DynamicCache(config=pair.model.config)
    elif name == "coarsen":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pair.cache._shared.coarsen_summaries()
    elif name == "fault":
        pair.append(arg, layers=1)  # the forward stopped after layer 0: the reference never saw it
        assert pair.cache.get_seq_length() == length  # rolled back


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(batch=st.integers(1, 3), ops=st.lists(OPS, min_size=1, max_size=8))
def test_random_edit_sequences_reassemble_to_dynamic_cache(batch, ops):
    pair = Pair(batch)
    for name, arg in ops:
        _apply(pair, name, arg)
        if pair.ref.get_seq_length():
            pair.check()
