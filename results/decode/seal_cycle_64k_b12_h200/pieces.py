"""Host wall time per piece (perf_counter, no synchronisation) in free-running decode steps, bench_decode quantkey-auto."""
import collections, functools, sys, time
import torch
from benchmarks import bench_decode
from hf_offload import attention, cache as cache_mod, graphs, transfer
from hf_offload.store import device as dev_store, host as host_store
from hf_offload.selectors import quantkey

acc = collections.Counter()

def timed(owner, name, label):
    fn = getattr(owner, name)
    @functools.wraps(fn)
    def wrap(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0
    setattr(owner, name, wrap)

L = cache_mod.OffloadLayer
for owner, name in [(L, "update"), (L, "_seal"), (L, "finish_step"), (L, "_append_summary"), (L, "capture_decode"),
                    (L, "replay"), (attention, "_decode_step"), (attention, "_decode_body"),
                    (host_store.HostBlockPool, "allocate"), (host_store.HostBlockPool, "_grow"),
                    (transfer, "launch_on"), (quantkey.QuantKeySelector, "summarize"),
                    (dev_store.DeviceSlotPool, "assign"), (dev_store.DeviceSlotPool, "write"),
                    (torch.Tensor, "pin_memory") if False else (L, "decode_inputs")]:
    timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")
orig_cat = torch.cat

orig = bench_decode.decode
rows = []

def decode(model, cache, kw, ids, start, n, mask, clock=None):
    if clock is None:
        return orig(model, cache, kw, ids, start, n, mask, clock)
    for i in range(n):
        acc.clear()
        t0 = time.perf_counter()
        ids = orig(model, cache, kw, ids, start + i, 1, mask, None)
        acc["STEP"] = time.perf_counter() - t0
        rows.append((i, start + i, dict(acc)))
        clock.mark()
    return ids

bench_decode.decode = decode
sys.argv = ["bench_decode.py"] + sys.argv[1:]
bench_decode.main()
for i, pos, a in rows:
    if a["STEP"] > 0.045 or i in (2, 3):
        print(f"step {i} pos {pos} ({pos % 16}): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(a.items(), key=lambda kv: -kv[1])))
