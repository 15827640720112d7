"""The decode step's shared inputs, the cuda_graphs option and runtime settings, on the CPU."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.attention import DecodeInputs

from ..helpers import build_model


def _reference(padding, n, T, first, n_recent, sink, window, batch):
    rows = torch.zeros((batch, n + 2, T), dtype=torch.bool)
    if padding is None:
        rows[:, :n] = True
        rows[:, n, :n_recent] = True
    else:
        rows[:, :n] = padding[:, : n * T].view(batch, n, T)
        rows[:, n, :n_recent] = padding[:, first : first + n_recent]
    valid = rows[:, :n].any(-1)
    idx = torch.arange(n)
    start = valid.int().argmax(-1, keepdim=True)
    forced = (((idx >= start) & (idx < start + sink)) | (idx >= n - window)) & valid
    return rows, valid, forced


def test_decode_inputs_match_reference_and_keep_addresses():
    T, n, batch, sink, window = 4, 6, 3, 1, 2
    padding = torch.ones((batch, 40), dtype=torch.bool)
    padding[1, :9] = False  # sequence 1: two whole blocks and one token of padding
    padding[2, :4] = False
    inputs = DecodeInputs()
    steps = [(padding, n_recent) for n_recent in (1, 2, 3)] + [(None, 1), (None, 4), (padding, 2)]
    ptr = None
    for i, (pad, n_recent) in enumerate(steps):
        step = object()
        inputs.update(batch, n, T, n * T, n_recent, pad, sink, window, torch.device("cpu"), step)
        rows, valid, forced = _reference(pad, n, T, n * T, n_recent, sink, window, batch)
        assert torch.equal(inputs.rows, rows), i
        assert torch.equal(inputs.valid, valid) and torch.equal(inputs.forced, forced), i
        ptr = ptr or inputs.rows.data_ptr()
        assert inputs.rows.data_ptr() == ptr  # same geometry: filled in place
    assert not inputs.forced[1, 0] and inputs.forced[1, 2]  # the sink starts at the first real block
    inputs.update(batch, n + 1, T, (n + 1) * T, 1, None, sink, window, torch.device("cpu"), object())
    assert inputs.rows.shape == (batch, n + 3, T)


def test_cuda_graphs_option_is_validated():
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        OffloadConfig(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cannot be combined with timing"):
        OffloadConfig(cuda_graphs=True, timing=True)
    with pytest.raises(ValueError, match="cannot be combined with lookahead=True under graph_scope='attention'"):
        OffloadConfig(cuda_graphs=True, lookahead=True, graph_scope="attention")
    assert OffloadConfig(cuda_graphs=True, lookahead=True).graph_scope == "layer"  # lookahead inside layer graphs
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=32, block_tokens=8, cuda_graphs=True)
    ids = torch.randint(3, 100, (1, 20))
    with pytest.raises(RuntimeError, match="needs a CUDA device and the kernel transfer path"):
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
    # None: on where it can run, so off here without an error.
    cache = OffloadCache(model, budget_tokens=32, block_tokens=8, cuda_graphs=None)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    assert not any(layer.execution.graphs for layer in cache.offload_layers)


def test_set_options_changes_only_step_settings():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=32, block_tokens=8)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 20)), past_key_values=cache)
    cache.set_options(timing=True, lookahead=True)
    assert all(layer.execution.lookahead and layer.timer is not None for layer in cache.offload_layers)
    cache.set_options(timing=False)
    assert all(layer.timer is None for layer in cache.offload_layers)
    with pytest.raises(ValueError, match="build a new OffloadCache"):
        cache.set_options(block_tokens=16)
    assert cache.config.block_tokens == 8
