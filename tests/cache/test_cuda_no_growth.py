"""Fresh caches leave nothing behind on the device: ``generate()`` after ``generate()``, each with a new
:class:`~hf_offload.OffloadCache` whose decoder layers replay from CUDA graphs, ends every call with the device memory
allocated after the first, once the state each collected cache parks for the next one is released. Skipped without
CUDA and Triton."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_offload import OffloadCache, release_parked
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS, parked_bytes
from hf_offload.config import DEFAULT_SELECTOR

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import build_model, left_padded

pytestmark = [pytest.mark.cuda, pytest.mark.triton]


@pytest.mark.parametrize("graph_scope", ["layer", "attention"])
def test_fresh_caches_leave_no_device_memory(graph_scope):
    """Every stream a matrix product runs on keeps a cuBLAS workspace for the life of the process, so streams made
    per cache grew the device memory by a workspace per call (32 MiB on Hopper) until PyTorch's pool of streams
    wrapped; the caches share the device's side streams instead. The memory the allocator reserves stays flat too: a
    graph memory pool per cache kept one more pool reserved after every call (2 MiB each on the H200, 2,000 calls of
    the soak); the pools go from cache to cache."""
    model = build_model("llama").to("cuda", torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())
    after, reserved = [], []
    for call in range(12):
        ids, mask = left_padded([90, 61] if call % 2 else [75, 40, 33], seed=call)
        cache = OffloadCache(model, **SMALL, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS, cuda_graphs=True,
                             graph_scope=graph_scope, selector="quantkey" if call % 4 < 2 else DEFAULT_SELECTOR)  # fmt: skip
        with torch.no_grad():
            model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache, max_new_tokens=20,
                           min_new_tokens=20, do_sample=False)  # fmt: skip
        assert cache.stats()["graph_replays"] > 0  # the graphs ran
        del cache
        gc.collect()
        torch.cuda.synchronize(device)
        # The collected cache parked its layers for the next one (hf_offload.cache.parking): one state at most,
        # freed by the next cache where it does not fit; released here so that what stays is what leaked.
        assert parked_bytes(model) > 0
        assert release_parked() == 1
        after.append(torch.cuda.memory_allocated(device))
        reserved.append(torch.cuda.memory_reserved(device))
    growth = [(b - after[0]) / 2**20 for b in after[1:]]
    assert max(growth) < 1.0, f"device memory allocated grew by {growth} MiB after the first call"
    # Once each selector and shape has been seen (4 calls), the pools hold what the captures need.
    grown = [(b - reserved[3]) / 2**20 for b in reserved[4:]]
    assert max(grown) < 4.0, f"device memory reserved grew by {grown} MiB after the fourth call"
