"""``OffloadCache.save`` and ``OffloadCache.load`` against the drive they run on, measured in the same run.

* **drive**: a file of the size of the saved cache, written in 16 MiB writes, each handed to the drive as it is
  written (``start_writeback``), and fsynced (what ``save`` does), its pages then dropped from the page cache
  (``posix_fadvise(DONTNEED)``), and read back sequentially in 16 MiB reads of an unbuffered file (what ``load``
  does, into the host pool's chunks); GB/s each. The file system's page cache is used as ``save`` and ``load`` use
  it (no direct I/O), so both sides pay the same copies.
* **save**: a cache of a Llama-architecture model of ``--shape`` (random weights; ``--layers`` overrides the layer
  count) filled with ``--context`` tokens of random KV per sequence (``hf_offload.tools.bench.fill_random``, no
  prefill computed), saved to a new file, as the drive's is (checksums, fsync and rename included; an existing file
  is removed untimed: replacing it would also time freeing it); the file's pages are then dropped.
* **load**: ``OffloadCache.load`` of that file (checksums verified, every block copied into the host pool), from a
  cold page cache; then three decode steps, to show the loaded cache runs (the third one timed).

Each round measures the drive, then save, then load; the summary is the median over the rounds of each ratio to the
drive, and the lowest. Where free memory goes back to the host after a few seconds (a
virtual machine with free page reporting, as here), the first step to take up much memory pays for it: the first
0.66 GiB save of a process took 2.3 s here, the next 0.75 s, and a drive write after a few idle seconds ran at
0.4 GB/s, the next at 2.6. So the drive's write and the save are each timed on a second run right after a first
one, and one save and load before the rounds is not reported (the load reuses the memory of the one before it, as
the second of two loads in one process does). Throughput counts the file's bytes. The checksum the file is written
with (CRC-32) alone is timed too, on one thread, and SHA-256 beside it (what files of format version 1 used).

    python benchmarks/bench_persist.py --shape llama-3.2-1b --layers 4 --context 32768 --batch 2 --dir /tmp \\
        --out results/persist/cpu_llama1b_4layers_32k.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_disk import build  # noqa: E402
from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402
from hf_offload.cache.persist import _CHECKSUMS, CHECKSUM, start_writeback  # noqa: E402
from hf_offload.tools.bench import SHAPES, _decode, fill_random  # noqa: E402

MIB = 1 << 20
PIECE = 16 * MIB
WORKLOAD = "random weights, random KV written into the cache (no prefill computed)"


def _drop(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (they are clean after an fsync), so that the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drive(directory: Path, nbytes: int) -> dict:
    """Sequential write (handed to the drive piece by piece, fsynced) and cold sequential read of ``nbytes`` in
    16 MiB pieces; GB/s each. The write is timed on a second file, right after a first one written and removed
    untimed: after a few idle seconds, the first write of that much here ran at 0.4 GB/s and the next at 2.6 (free
    memory went back to the host; the module docstring says more)."""
    data = memoryview(torch.randint(0, 256, (PIECE,), dtype=torch.uint8).numpy())
    path = directory / f"hf-offload-drive-{os.getpid()}.bin"
    pieces = max(1, -(-nbytes // PIECE))
    try:
        for _ in range(2):
            path.unlink(missing_ok=True)
            start = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                for i in range(pieces):
                    f.write(data)
                    start_writeback(f.fileno(), i * PIECE, PIECE)  # as save hands its data to the drive
                os.fsync(f.fileno())
            write_s = time.perf_counter() - start
        _drop(path)
        buffer = bytearray(PIECE)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        read_s = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    total = pieces * PIECE
    return {"bytes": total, "seq_write_gbs": total / write_s / 1e9, "seq_read_gbs": total / read_s / 1e9}


def checksum_gbs(name: str, nbytes: int = 256 * MIB) -> float:
    """Throughput of the checksum ``name`` (``sha256``, ``crc32``: what a file's tensors are checked with) on one
    thread of this CPU, GB/s."""
    data = memoryview(torch.randint(0, 256, (PIECE,), dtype=torch.uint8).numpy())
    digest = _CHECKSUMS[name]()
    start = time.perf_counter()
    for _ in range(nbytes // PIECE):
        digest.update(data)
    return nbytes / (time.perf_counter() - start) / 1e9


def _save_load(cache, model, path: Path, args, device: torch.device, decode: bool = True) -> tuple:
    """Save ``cache`` to ``path`` twice (the second timed, each to a new file, as the drive's first write is not
    timed), drop its pages, load it (then decode three steps); remove the file. Returns the file's bytes, the save's
    and the load's seconds and the third decode step's (``None`` without ``decode``)."""
    for _ in range(2):
        path.unlink(missing_ok=True)  # untimed: replacing the file would also time freeing it
        start = time.perf_counter()
        cache.save(path)
        save_s = time.perf_counter() - start
    file_bytes = path.stat().st_size
    _drop(path)
    start = time.perf_counter()
    loaded = OffloadCache.load(path, model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    step_s = _decode(model, loaded, args.batch, args.context, 3, device) if decode else None  # the loaded cache runs
    del loaded
    path.unlink()
    return file_bytes, save_s, load_s, step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file is written")
    parser.add_argument("--repeats", type=int, default=2, help="save / load rounds (each reported)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="results/persist/bench_persist.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    directory = Path(args.dir)
    model = build(args.shape, args.layers, args.context + 64, device, dtype)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = OffloadCache(model, budget_tokens=args.budget)
    torch.manual_seed(0)
    with torch.inference_mode():
        fill_random(cache, args.batch, args.context, config.num_key_value_heads, head_dim, device, dtype=dtype)
    kv_bytes = cache.stats()["host_kv_bytes"] + cache.stats()["device_kv_bytes"]
    result = {"metadata": run_metadata(args, note=WORKLOAD), "workload": WORKLOAD, "device": str(device),
              "kv_bytes": kv_bytes, "checksum": CHECKSUM, "checksum_gbs": checksum_gbs(CHECKSUM),
              "sha256_gbs": checksum_gbs("sha256"), "rounds": []}  # fmt: skip
    path = directory / f"hf-offload-bench-{os.getpid()}.safetensors"
    try:
        file_bytes, _, _, _ = _save_load(cache, model, path, args, device, decode=False)  # not reported: see above
        for _ in range(args.repeats):
            disk = drive(directory, file_bytes)
            file_bytes, save_s, load_s, step_s = _save_load(cache, model, path, args, device)
            row = {"file_bytes": file_bytes, "save_s": save_s, "load_s": load_s, "save_gbs": file_bytes / save_s / 1e9,
                   "load_gbs": file_bytes / load_s / 1e9, "decode_step_after_load_s": step_s, "drive": disk}  # fmt: skip
            row["save_vs_drive_write"] = row["save_gbs"] / disk["seq_write_gbs"]
            row["load_vs_drive_read"] = row["load_gbs"] / disk["seq_read_gbs"]
            result["rounds"].append(row)
            write_results(args.out, result)
            print(f"file {file_bytes / 2**30:.2f} GiB: save {row['save_gbs']:.2f} GB/s (drive write "
                  f"{disk['seq_write_gbs']:.2f}, {row['save_vs_drive_write']:.2f}x), load {row['load_gbs']:.2f} GB/s "
                  f"(drive read {disk['seq_read_gbs']:.2f}, {row['load_vs_drive_read']:.2f}x); "
                  f"one thread's {CHECKSUM} {result['checksum_gbs']:.2f} GB/s, SHA-256 {result['sha256_gbs']:.2f}")  # fmt: skip
    finally:
        path.unlink(missing_ok=True)
    keys = ("save_vs_drive_write", "load_vs_drive_read")
    ratios = {key: sorted(row[key] for row in result["rounds"]) for key in keys}
    result["summary"] = {f"median_{key}": values[len(values) // 2] for key, values in ratios.items()}
    result["summary"].update({f"min_{key}": values[0] for key, values in ratios.items()})
    result["complete"] = True
    write_results(args.out, result)
    print("median over the rounds:", ", ".join(f"{k} {v:.2f}x" for k, v in result["summary"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
