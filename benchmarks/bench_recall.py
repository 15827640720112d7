"""Host-to-device recall bandwidth: the gather kernel against the alternatives, in one run.

For each block size it times, on the same pinned host pool and the same random block ids:

* ``bulk``: one contiguous pinned -> device copy of the same number of bytes (the PCIe ceiling of this run);
* ``kernel``: one launch of the gather kernel (hf_offload.kernels.gather), reading pinned memory directly;
* ``kernel_fresh``: the same, but every call gathers a new random set of blocks, as a decode step does (the
  repeated set of ``kernel`` reads host pages whose address translations the previous call left cached);
* ``memcpy_per_block``: one ``copy_`` (cudaMemcpyAsync) per block;
* ``cpu_gather_copy``: ``index_select`` into a pinned staging buffer on the host, then one copy.

and, for an 8B-model block (8 KV heads, head_dim 128, 16 tokens, bf16 = 64 KB), the SoloHead layout (one 64 KB span
per block) against the headwise layout (16 pieces of 4 KB per block), through the kernel and through one copy per
piece. Prints a table and writes raw JSON (machine, versions, git commit) to ``--out``.

    python benchmarks/bench_recall.py --out results/recall/bench_recall.json
"""

from __future__ import annotations

import argparse
import math
import mmap
import sys
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_timed as timed  # noqa: E402
from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.kernels.gather import copy_pieces  # noqa: E402
from hf_offload.store import HostBlockPool, HostMemoryBudget  # noqa: E402
from hf_offload.store.host import meminfo_bytes  # noqa: E402

KIB = 1024
_HUGE = 2 << 20


def huge_page_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor on memory advised for transparent huge pages (2 MiB aligned), registered with CUDA.

    Args:
        shape: tensor shape.
        dtype: element type.

    Returns:
        The tensor (CPU); it is unregistered when freed.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = (-raw.data_ptr()) % _HUGE
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    flat = raw[start : start + nbytes]
    flat.zero_()  # fault the pages in now, huge pages where the kernel grants them
    ptr = flat.data_ptr()
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)} for {nbytes} bytes")
    out = flat.view(dtype).view(shape)
    weakref.finalize(out, torch.cuda.cudart().cudaHostUnregister, ptr)
    return out




def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-gib", type=float, default=4.0, help="host pool size to draw random blocks from")
    parser.add_argument("--move-mib", type=int, default=512, help="bytes moved per timed gather")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[2, 4, 16, 64, 256])
    parser.add_argument("--memcpy-blocks", type=int, default=2048, help="blocks copied one by one (kept small)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--host-alloc", choices=["torch", "huge"], default="torch",
                        help="host pool chunks from torch's pinned allocator, or huge pages + cudaHostRegister")
    parser.add_argument("--chunk-mib", type=int, default=64, help="bytes of one host pool allocation, in MiB "
                        "(OffloadCache: host_chunk_mib, 16 by default)")
    parser.add_argument("--out", default="results/recall/bench_recall.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rows = []
    allocator = huge_page_pinned if args.host_alloc == "huge" else None
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    print(f"host pool: {args.host_alloc} ({args.pool_gib:g} GiB per block size); transparent huge pages: {thp}")

    def bench(block_bytes: int, label: str = "") -> dict:
        n_pool = int(args.pool_gib * (1 << 30)) // block_bytes
        host = HostBlockPool((block_bytes // 2,), torch.bfloat16, True, args.chunk_mib << 20, HostMemoryBudget(None),
                             allocator=allocator)  # fmt: skip
        ids_all = host.allocate(n_pool)
        n = (args.move_mib << 20) // block_bytes
        ids = ids_all[torch.randperm(n_pool, generator=g)[:n]]
        dst = torch.empty((n, block_bytes // 2), dtype=torch.bfloat16, device=device)
        words = block_bytes // 4
        ids_dev, zeros = ids.to(device), torch.zeros(n, dtype=torch.int64, device=device)
        offs = torch.arange(n, device=device, dtype=torch.int64) * words
        addrs = host.chunk_addrs(device)
        nbytes = n * block_bytes
        bulk_src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
        bulk_dst = torch.empty_like(bulk_src, device=device)
        res = {"block_bytes": block_bytes, "blocks": n, "bytes": nbytes, "huge_pages_in_use": meminfo_bytes("AnonHugePages")}
        res["bulk_gbps"] = nbytes / timed(lambda: bulk_dst.copy_(bulk_src, non_blocking=True), args.repeat) / 1e9
        res["kernel_gbps"] = nbytes / timed(
            lambda: copy_pieces(addrs, host.chunk_blocks, words, ids_dev, zeros, dst, offs, words, False), args.repeat
        ) / 1e9
        fresh = [ids_all[torch.randperm(n_pool, generator=g)[:n]].to(device) for _ in range(args.repeat + 2)]
        calls = iter(range(1 << 62))

        def fresh_gather():
            ids_now = fresh[next(calls) % len(fresh)]
            copy_pieces(addrs, host.chunk_blocks, words, ids_now, zeros, dst, offs, words, False)

        res["kernel_fresh_gbps"] = nbytes / timed(fresh_gather, args.repeat) / 1e9
        # Bit-exact check of the timed gather against a host-side gather of the same ids.
        copy_pieces(addrs, host.chunk_blocks, words, ids_dev, zeros, dst, offs, words, False)
        res["kernel_bit_exact"] = bool(torch.equal(dst.cpu().view(torch.int16), host.read(ids).view(n, -1).view(torch.int16)))
        m = min(n, args.memcpy_blocks)
        srcs = [host.chunks[int(i) // host.chunk_blocks][int(i) % host.chunk_blocks] for i in ids[:m]]

        def per_block():
            for i, src in enumerate(srcs):
                dst[i].copy_(src, non_blocking=True)

        res["memcpy_per_block_gbps"] = m * block_bytes / timed(per_block, max(1, args.repeat // 2)) / 1e9
        staging = torch.empty((n, block_bytes // 2), dtype=torch.bfloat16, pin_memory=True)

        def cpu_gather():
            for c in range(len(host.chunks)):
                sel = (ids // host.chunk_blocks == c).nonzero().flatten()
                torch.index_select(host.chunks[c], 0, ids[sel] % host.chunk_blocks, out=staging[: len(sel)])
            dst.copy_(staging, non_blocking=True)

        res["cpu_gather_copy_gbps"] = nbytes / timed(cpu_gather, max(1, args.repeat // 2)) / 1e9
        res["kernel_over_bulk"] = res["kernel_gbps"] / res["bulk_gbps"]
        del host, bulk_src, bulk_dst, dst, staging
        torch.cuda.empty_cache()
        return res

    for kib in args.block_kib:
        rows.append(bench(kib * KIB))
        r = rows[-1]
        print(f"{kib:>4} KiB  bulk {r['bulk_gbps']:6.1f}  kernel {r['kernel_gbps']:6.1f} ({r['kernel_over_bulk']:.3f} x bulk, "
              f"exact={r['kernel_bit_exact']})  kernel, new blocks per call {r['kernel_fresh_gbps']:6.1f}  memcpy/block {r['memcpy_per_block_gbps']:6.2f}  "
              f"cpu gather+copy {r['cpu_gather_copy_gbps']:6.1f} GB/s", flush=True)

    # SoloHead vs headwise layout for an 8B block: 2 (K, V) x 8 heads x 16 tokens x 128 dims x 2 bytes = 64 KiB.
    heads, block_bytes = 8, 64 * KIB
    piece_bytes = block_bytes // (2 * heads)
    n_pool = int(args.pool_gib * (1 << 30)) // block_bytes
    host = HostBlockPool((block_bytes // 2,), torch.bfloat16, True, args.chunk_mib << 20, HostMemoryBudget(None),
                         allocator=allocator)  # fmt: skip
    ids_all = host.allocate(n_pool)
    n = (args.move_mib << 20) // block_bytes
    ids = ids_all[torch.randperm(n_pool, generator=g)[:n]].to(device)
    dst = torch.empty((n, block_bytes // 2), dtype=torch.bfloat16, device=device)
    words, piece_words = block_bytes // 4, piece_bytes // 4
    addrs = host.chunk_addrs(device)
    solo = timed(lambda: copy_pieces(addrs, host.chunk_blocks, words, ids, torch.zeros_like(ids), dst,
                                     torch.arange(n, device=device) * words, words, False), args.repeat)  # fmt: skip
    pieces = torch.arange(2 * heads, device=device)
    p_ids = ids.repeat_interleave(2 * heads)
    p_host = pieces.repeat(n) * piece_words
    p_dev = torch.arange(n * 2 * heads, device=device) * piece_words
    headwise = timed(lambda: copy_pieces(addrs, host.chunk_blocks, words, p_ids, p_host, dst, p_dev, piece_words, False),
                     args.repeat)  # fmt: skip
    m = min(n, args.memcpy_blocks // (2 * heads))
    flat_dst = dst.view(-1, piece_bytes // 2)
    srcs = [host.chunks[int(i) // host.chunk_blocks][int(i) % host.chunk_blocks].view(-1, piece_bytes // 2) for i in ids[:m].cpu()]

    def headwise_memcpy():
        for i, src in enumerate(srcs):
            for p in range(2 * heads):
                flat_dst[i * 2 * heads + p].copy_(src[p], non_blocking=True)

    layout = {
        "block_bytes": block_bytes,
        "piece_bytes": piece_bytes,
        "solohead_kernel_gbps": n * block_bytes / solo / 1e9,
        "headwise_kernel_gbps": n * block_bytes / headwise / 1e9,
        "headwise_memcpy_per_piece_gbps": m * block_bytes / timed(headwise_memcpy, 1) / 1e9,
    }
    print(f"8B block 64 KiB: solohead kernel {layout['solohead_kernel_gbps']:.1f}  headwise kernel (4 KiB pieces) "
          f"{layout['headwise_kernel_gbps']:.1f}  headwise one copy per piece {layout['headwise_memcpy_per_piece_gbps']:.2f} GB/s")

    write_results(args.out, {"metadata": run_metadata(args, transparent_huge_pages=thp), "block_sizes": rows,
                             "layout_8b": layout})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
