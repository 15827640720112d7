"""HostBlockPool with its own chunk allocator, and the huge-page pinned allocator of benchmarks/bench_recall.py."""

import gc

import torch

from hf_offload.store import HostBlockPool, HostMemoryBudget


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


def test_huge_page_pinned_is_aligned_registered_and_unregistered(monkeypatch):
    import benchmarks.bench_recall as bench

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
    t = bench.huge_page_pinned((3, 1000), torch.bfloat16)
    assert t.shape == (3, 1000) and t.dtype == torch.bfloat16 and not t.any()
    assert t.data_ptr() % (2 << 20) == 0
    t[1, 5] = 7.0
    assert float(t[1, 5]) == 7.0
    assert log == [("register", t.data_ptr(), 3 * 1000 * 2)]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert log[-1] == ("unregister", ptr)
