"""Lookahead inside the whole-layer graphs through the kernel transfer path (the slot assignment and copy kernels,
the prefetch marks), on Triton's CPU interpreter (``TRITON_INTERPRET=1``) with the stand-in graphs of
``tests/cache/test_layer_graphs_cpu.py``: the tokens and the prefetch counters of lookahead run op by op."""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels.gather import kernels_available

from ..cache.test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401 (fixtures)

# The stand-in graphs run on the CPU: Triton's interpreter, not Triton on CUDA.
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not kernels_available(torch.device("cpu")),
                                                    reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")]


def test_graphed_lookahead_on_the_kernel_path_counts_as_op_by_op(stand_in_graphs):  # noqa: F811
    """The predicted query (``lookahead_query="next"``, the default); the layer's own query runs on the torch path
    in ``tests/cache/test_lookahead_graphs_cpu.py``. (No estimate of the unselected blocks: under Triton's
    interpreter it would be most of this test's time, and the prefetch does not depend on it.)"""
    from hf_offload import OffloadCache
    from hf_offload.cache import GRAPH_CAPACITY_BLOCKS

    from ..helpers import build_model, left_padded

    model = build_model("llama")
    ids, mask = left_padded([66, 50, 41], seed=4)
    runs = {}
    for graphs in (False, None):
        cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=48,
                             admission="always", transfer="kernel", lookahead=True, selector="quantkey[bits=4]",
                             cuda_graphs=graphs, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)  # fmt: skip
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                 min_new_tokens=12, do_sample=False)  # fmt: skip
        runs[graphs] = (out, cache)
    (expected, eager), (got, graphed) = runs[False], runs[None]
    assert torch.equal(got, expected)
    assert all(layer.execution.use_kernels for layer in graphed.offload_layers)
    assert all(int(layer.stats.layer_graph_replays) > 0 for layer in graphed.offload_layers)
    a, b = graphed.stats(), eager.stats()
    assert a["prefetched_blocks"] > 0 and a["prefetch_used_blocks"] > 0
    for name in ("prefetched_blocks", "prefetch_used_blocks", "decode_recalled_blocks", "hit_rate"):
        assert a[name] == b[name], (name, a[name], b[name])
