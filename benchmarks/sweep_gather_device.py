"""Sweep the gather kernel's launch shape (32-bit words per program x warps) for blocks read from device memory.

With ``admission="auto"`` most blocks of a layer stay on the device and a recall copies them device-to-device into
the slot pool through the same kernel that reads pinned host memory. This times one recall launch of the shape of
one layer at 64K tokens, batch 12 (Llama-3.1-8B: 64 KiB blocks moved as 16 pieces of 4 KiB, 128 selected blocks per
sequence, 81% of them missing: the random-weight benchmarks' hit rate of 0.19) from a 1 GiB pool of device chunks,
per launch setting, against a bulk device copy of the same bytes. Writes JSON to the path given.

Each setting: one warm-up launch, then the mean of 50 back-to-back launches between two CUDA events.

    python benchmarks/sweep_gather_device.py results/recall/d2d_copy_sweep_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cuda_event_ms, run_metadata, write_results  # noqa: E402
from hf_offload.kernels.gather import copy_pieces  # noqa: E402

LAUNCHES = 50  # back-to-back launches per timing


def _mean_us(fn) -> float:
    """Mean microseconds of ``fn`` over :data:`LAUNCHES` back-to-back calls, after one warm-up call."""
    return cuda_event_ms(lambda: [fn() for _ in range(LAUNCHES)], 1, 1)[0] * 1e3 / LAUNCHES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    B, H, T, D, k = 12, 8, 16, 128, 128  # a 64K, batch-12 layer of the 8B shape: 128 selected blocks per sequence
    block_words = 2 * H * T * D * 2 // 4  # K and V of all heads, bf16, in 32-bit words
    piece = block_words // (2 * H)
    chunk_blocks, n_chunks, slots = 256, 64, 160  # 16,384 device blocks (1 GiB); the slot pool of budget 2048
    chunks = [torch.empty(chunk_blocks * block_words, dtype=torch.int32, device=dev).random_() for _ in range(n_chunks)]
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=dev)
    pool = torch.zeros(2 * B * H * (slots + 1) * piece, dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    entries = B * k
    ids = torch.randint(0, chunk_blocks * n_chunks, (entries,), device=dev, generator=g)
    ids = torch.where(torch.rand(entries, device=dev, generator=g) < 0.81, ids, -1)  # hit rate 0.19
    b_idx, s_idx = torch.arange(B, device=dev).repeat_interleave(k), torch.arange(k, device=dev).repeat(B)
    kv_h = torch.arange(2 * H, device=dev)
    h, kv = kv_h % H, kv_h // H
    host_off = (kv_h * piece).expand(entries, -1).flatten()
    dev_off = ((((kv[None] * B + b_idx[:, None]) * H + h[None]) * (slots + 1) + s_idx[:, None]) * piece).flatten()
    pid = ids[:, None].expand(-1, 2 * H).flatten()
    moved = int((ids >= 0).sum()) * block_words * 4
    variants = {}
    for wpp in (1024, 512, 256, 128):
        for warps in (1, 2, 4, 8):
            us = _mean_us(lambda: copy_pieces(addrs, chunk_blocks, block_words, pid, host_off, pool, dev_off, piece,
                                              False, words_per_program=wpp, num_warps=warps))  # fmt: skip
            variants[f"wpp{wpp}_w{warps}"] = {"us": us, "GBps": moved / us / 1e3}
            print(f"words/program {wpp:5d} warps {warps}: {us:7.1f} us  {moved / us / 1e3:7.1f} GB/s")
    x = torch.empty(moved // 4, dtype=torch.int32, device=dev)
    y = torch.empty_like(x)
    bulk_us = _mean_us(lambda: y.copy_(x))
    print(f"bulk device copy of the same bytes: {bulk_us:.1f} us {moved / bulk_us / 1e3:.1f} GB/s")
    write_results(args.out, {**run_metadata(args), "moved_bytes": moved, "variants": variants,
                             "bulk": {"us": bulk_us, "GBps": moved / bulk_us / 1e3}})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
