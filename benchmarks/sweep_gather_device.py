"""Sweep the gather kernel's launch shape (32-bit words per program x warps) for blocks read from device memory.

With ``admission="auto"`` most blocks of a layer stay on the device and a recall copies them device-to-device into
the slot pool through the same kernel that reads pinned host memory. This times one recall launch of the shape of
one layer at 64K tokens, batch 12 (Llama-3.1-8B: 64 KiB blocks moved as 16 pieces of 4 KiB, 128 selected blocks per
sequence, 81% of them missing: the random-weight benchmarks' hit rate of 0.19) from a 1 GiB pool of device chunks,
per launch setting, against a bulk device copy of the same bytes. Writes JSON to the path given.

    python benchmarks/sweep_gather_device.py results/recall/d2d_copy_sweep_h200.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch, json, sys
import triton
from hf_offload.kernels.gather import copy_pieces
dev = torch.device("cuda")
B, H, T, D, k = 12, 8, 16, 128, 128           # 64K b12 layer: 128 selected blocks per sequence
block_words = 2 * H * T * D * 2 // 4          # K and V of all heads, bf16 -> words
piece = block_words // (2 * H)
chunk_blocks, n_chunks = 256, 64              # 16384 device blocks (1 GiB)
chunks = [torch.empty(chunk_blocks * block_words, dtype=torch.int32, device=dev).random_() for _ in range(n_chunks)]
addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=dev)
slots = 160
pool = torch.zeros(2 * B * H * (slots + 1) * piece, dtype=torch.int32, device=dev)
g = torch.Generator(device=dev).manual_seed(0)
entries = B * k
ids = torch.randint(0, chunk_blocks * n_chunks, (entries,), device=dev, generator=g)
ids = torch.where(torch.rand(entries, device=dev, generator=g) < 0.81, ids, -1)   # hit rate 0.19
b_idx = torch.arange(B, device=dev).repeat_interleave(k); s_idx = torch.arange(k, device=dev).repeat(B)
kv_h = torch.arange(2 * H, device=dev); h = kv_h % H; kv = kv_h // H
host_off = (kv_h * piece).expand(entries, -1)
dev_off = (((kv[None] * B + b_idx[:, None]) * H + h[None]) * (slots + 1) + s_idx[:, None]) * piece
pid = ids[:, None].expand(-1, 2 * H)
moved = int((ids >= 0).sum()) * block_words * 4
res = {}
for wpp in (1024, 512, 256, 128):
    for warps in (1, 2, 4, 8):
        f = lambda: copy_pieces(addrs, chunk_blocks, block_words, pid.flatten(), host_off.flatten(), pool, dev_off.flatten(), piece, False, words_per_program=wpp, num_warps=warps)
        f(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50): f()
        e.record(); torch.cuda.synchronize()
        us = s.elapsed_time(e) / 50 * 1e3
        res[f"wpp{wpp}_w{warps}"] = {"us": us, "GBps": moved / us / 1e3}
        print(f"words/program {wpp:5d} warps {warps}: {us:7.1f} us  {moved / us / 1e3:7.1f} GB/s")
x = torch.empty(moved // 4, dtype=torch.int32, device=dev); y = torch.empty_like(x)
s.record(); [y.copy_(x) for _ in range(50)]; e.record(); torch.cuda.synchronize()
bulk_us = s.elapsed_time(e) / 50 * 1e3
print(f"bulk device copy of the same bytes: {bulk_us:.1f} us {moved / bulk_us / 1e3:.1f} GB/s")
json.dump({"moved_bytes": moved, "variants": res, "bulk": {"us": bulk_us, "GBps": moved / bulk_us / 1e3}},
          open(sys.argv[1], "w"), indent=1)
