"""HostBlockPool with its own chunk allocator, the huge-page pinned allocator, and ``host_pages``."""

import gc

import pytest
import torch

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.store import HostBlockPool, HostMemoryBudget
from hf_offload.store.host import pinned_huge_pages

from .conftest import build_model, left_padded


def test_pool_uses_the_given_allocator():
    calls = []

    def allocator(shape, dtype):
        calls.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype)

    pool = HostBlockPool((2, 2, 4, 8), torch.bfloat16, False, 4 * 256, HostMemoryBudget(None), allocator=allocator)
    ids = pool.allocate(6)  # 4 blocks per chunk: two chunks
    assert calls == [((4, 2, 2, 4, 8), torch.bfloat16)] * 2
    blocks = torch.randn(6, 2, 2, 4, 8).to(torch.bfloat16)
    pool.write(ids, blocks)
    assert torch.equal(pool.read(ids), blocks)


def test_pinned_huge_pages_is_aligned_registered_and_unregistered(monkeypatch):
    log = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            log.append(("register", ptr, nbytes))
            return 0

        def cudaHostUnregister(self, ptr):
            log.append(("unregister", ptr))
            return 0

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = pinned_huge_pages((3, 1000), torch.bfloat16)
    assert t.shape == (3, 1000) and t.dtype == torch.bfloat16 and not t.any()
    assert t.data_ptr() % (2 << 20) == 0
    t[1, 5] = 7.0
    assert float(t[1, 5]) == 7.0
    assert log == [("register", t.data_ptr(), 3 * 1000 * 2)]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert log[-1] == ("unregister", ptr)


def test_host_pages_must_be_default_or_huge():
    with pytest.raises(ValueError, match="host_pages must be 'default' or 'huge'"):
        OffloadConfig(host_pages="2M")


def test_huge_host_pages_on_cpu_say_what_to_change():
    model = build_model("llama")
    ids, mask = left_padded([20], seed=0)
    cache = OffloadCache(model, budget_tokens=32, block_tokens=8, sink_tokens=8, window_tokens=8, host_pages="huge")
    with pytest.raises(ValueError, match="use host_pages='default'"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
