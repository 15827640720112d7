"""Sweep the gather kernel's launch shape (32-bit words per program x warps) at several block sizes.

Prints, per block size, the kernel's bandwidth as a fraction of the bulk pinned host-to-device copy of the same run.

    python benchmarks/sweep_gather_kernel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cuda_timed  # noqa: E402
from hf_offload.kernels.gather import copy_pieces  # noqa: E402
from hf_offload.store import HostBlockPool, HostMemoryBudget  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    for kib in (2, 4, 16, 64):
        block_bytes = kib * 1024
        n_pool = (4 << 30) // block_bytes
        host = HostBlockPool((block_bytes // 2,), torch.bfloat16, True, 64 << 20, HostMemoryBudget(None))
        ids_all = host.allocate(n_pool)
        n = (512 << 20) // block_bytes
        ids = ids_all[torch.randperm(n_pool, generator=g)[:n]].to(device)
        dst = torch.empty((n, block_bytes // 2), dtype=torch.bfloat16, device=device)
        words = block_bytes // 4
        offs, zeros, addrs = torch.arange(n, device=device) * words, torch.zeros_like(ids), host.chunk_addrs(device)
        src = torch.empty(n * block_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
        bulk_dst = torch.empty_like(src, device=device)
        bulk = n * block_bytes / cuda_timed(lambda: bulk_dst.copy_(src, non_blocking=True), 7) / 1e9
        line = f"{kib:>3}KiB bulk {bulk:.1f} |"
        for wpp in (256, 512, 1024, 2048, 4096, 8192):
            if wpp > words and wpp != 256:
                continue
            for warps in (1, 2, 4, 8):
                t = cuda_timed(lambda: copy_pieces(addrs, host.chunk_blocks, words, ids, zeros, dst, offs, words, False,
                                                   words_per_program=wpp, num_warps=warps), 7)  # fmt: skip
                line += f" {wpp}/{warps}:{n * block_bytes / t / 1e9 / bulk:.3f}"
        print(line, flush=True)
        del host, src, bulk_dst, dst
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
