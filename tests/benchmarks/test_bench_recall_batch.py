"""benchmarks/bench_recall_batch.py: its pure logic on the CPU (arguments, host pointer arrays, the driver structs
and call, the no-CUDA exit), and the batched copy itself on a CUDA device (skipped without one)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import bench_recall_batch as brb

REPO = Path(__file__).resolve().parents[2]


def test_parse_args_defaults_and_split_sweep():
    args = brb.parse_args([])
    assert args.block_kib == [2, 4, 16, 64, 256]
    assert (args.pool_mib, args.total_mib, args.reps, args.split) == (4096, 512, 20, 0.5)
    assert args.out == "results/recall/bench_recall_batch.json" and args.max_count == 0
    assert brb.split_fractions(0.5) == [0.25, 0.5, 0.75]
    assert brb.split_fractions(0.3) == [0.25, 0.3, 0.75]
    assert brb.split_fractions(1.0) == [0.25, 0.75, 1.0]
    assert brb.parse_args(["--block-kib", "8", "--split", "0.4"]).block_kib == [8]


@pytest.mark.parametrize("argv", [["--split", "1.5"], ["--block-kib", "3"], ["--pool-mib", "100"],
                                  ["--total-mib", "8192"], ["--block-kib", "0"]])  # fmt: skip
def test_parse_args_rejects_inconsistent_settings(argv, capsys):
    with pytest.raises(SystemExit) as e:
        brb.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_attribute_struct_layout():
    assert ctypes.sizeof(brb.CUmemLocation) == 8
    assert ctypes.sizeof(brb.CUmemcpyAttributes) == 24
    fields = ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")
    offsets = [getattr(brb.CUmemcpyAttributes, f).offset for f in fields]
    assert offsets == [0, 4, 12, 20]
    labels = [label for label, _ in brb.attr_candidates(3)]
    assert labels[0] == "stream, no hints" and len(set(labels)) == 3
    hinted = brb.attr_candidates(3)[1][1]
    assert (hinted.srcAccessOrder, hinted.srcLocHint.type, hinted.dstLocHint.type, hinted.dstLocHint.id) == (1, 2, 1, 3)


def test_pointer_arrays_against_reference():
    rng = np.random.default_rng(0)
    chunk_blocks, block_bytes, n_chunks = 7, 4096, 5
    addrs = (np.uint64(0x7F00_0000_0000) + np.arange(n_chunks, dtype=np.uint64) * np.uint64(1 << 26))[::-1].copy()
    ids = rng.permutation(n_chunks * chunk_blocks)[:20].astype(np.int64)
    dst_base = 0x7E00_1234_0000
    for rows in (None, np.arange(5, 25)):
        dsts, srcs, sizes = brb.pointer_arrays(ids, addrs, chunk_blocks, block_bytes, dst_base, rows)
        want_rows = range(20) if rows is None else rows
        assert [int(x) for x in srcs] == [int(addrs[b // chunk_blocks]) + (b % chunk_blocks) * block_bytes for b in ids]
        assert [int(x) for x in dsts] == [dst_base + int(r) * block_bytes for r in want_rows]
        assert sizes.tolist() == [block_bytes] * 20
        for a in (dsts, srcs, sizes):
            assert a.dtype == np.uint64 and a.flags["C_CONTIGUOUS"] and a.shape == (20,)
    empty = brb.pointer_arrays(ids[:0], addrs, chunk_blocks, block_bytes, dst_base)
    assert [a.shape for a in empty] == [(0,), (0,), (0,)]


def _pool(n_chunks=4, chunk_blocks=6, block_bytes=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (chunk_blocks, block_bytes), dtype=torch.uint8, generator=g) for _ in range(n_chunks)]


def test_host_gather_and_emulated_batch_copy_match_a_loop():
    """The pointer arrays of real host buffers, copied one triple at a time with memmove, give the host gather."""
    chunks, chunk_blocks, block_bytes = _pool(), 6, 64
    ids = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:15]
    loop = torch.stack([chunks[int(b) // chunk_blocks][int(b) % chunk_blocks] for b in ids])
    assert torch.equal(brb.host_gather(chunks, chunk_blocks, ids), loop)
    dst = torch.zeros((20, block_bytes), dtype=torch.uint8)
    rows = np.arange(15) + 5
    addrs = np.array([c.data_ptr() for c in chunks], dtype=np.uint64)
    for d, s, z in zip(*brb.pointer_arrays(ids.numpy(), addrs, chunk_blocks, block_bytes, dst.data_ptr(), rows)):
        ctypes.memmove(int(d), int(s), int(z))
    assert torch.equal(dst[5:], loop) and not dst[:5].any()


def _fake_lib(*names):
    return types.SimpleNamespace(**{n: (lambda *a: 0) for n in names})


def test_resolve_batch_symbol_prefers_v2_and_falls_back():
    name, fn, fail_idx = brb.resolve_batch_symbol(_fake_lib("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"))
    assert (name, fail_idx, len(fn.argtypes)) == ("cuMemcpyBatchAsync_v2", False, 8)
    name, fn, fail_idx = brb.resolve_batch_symbol(_fake_lib("cuMemcpyBatchAsync"))
    assert (name, fail_idx, len(fn.argtypes)) == ("cuMemcpyBatchAsync", True, 9)
    assert fn.argtypes[7] is ctypes.c_void_p and fn.argtypes[3] is ctypes.c_size_t and fn.restype is ctypes.c_int
    both = _fake_lib("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2")
    assert brb.resolve_batch_symbol(both, "cuMemcpyBatchAsync")[0] == "cuMemcpyBatchAsync"
    with pytest.raises(RuntimeError, match="exports no"):
        brb.resolve_batch_symbol(_fake_lib("cuMemcpyAsync"))
    with pytest.raises(RuntimeError, match="exports no"):
        brb.resolve_batch_symbol(_fake_lib("cuMemcpyBatchAsync"), "cuMemcpyBatchAsync_v2")


@pytest.mark.parametrize("has_fail_idx", [False, True])
def test_batch_call_argument_order_and_chunking(monkeypatch, has_fail_idx):
    calls = []

    def fake(*a):
        calls.append(a)
        return 0

    copier = object.__new__(brb.BatchCopier)
    copier.name, copier.fn, copier.has_fail_idx, copier.max_count, copier.fail_at = "fake", fake, has_fail_idx, 2, ""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0x1234))
    dsts, srcs, sizes = (np.arange(5, dtype=np.uint64) * np.uint64(k) for k in (1, 2, 3))
    copier.attrs = brb.attr_candidates(0)[0][1]
    assert copier.call(dsts, srcs, sizes, copier.attrs) == 0
    assert [c[3] for c in calls] == [2, 2, 1]  # count per call: max_count 2
    assert [c[0] for c in calls] == [dsts[a:].ctypes.data for a in (0, 2, 4)]
    assert [c[1] for c in calls] == [srcs[a:].ctypes.data for a in (0, 2, 4)]
    for c in calls:
        assert len(c) == (9 if has_fail_idx else 8) and c[6] == 1 and c[-1].value == 0x1234
    copier.max_count, calls[:] = 0, []
    copier.copy(dsts, srcs, sizes)
    assert [c[3] for c in calls] == [5]
    copier.copy(dsts[:0], srcs[:0], sizes[:0])  # nothing to copy: no call
    assert len(calls) == 1
    copier.fn = lambda *a: 1
    copier.error_name = lambda code: "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        copier.copy(dsts, srcs, sizes)


def test_table_marks_errors_and_inexact_results():
    row = {"variants": {"bulk": {"gbps": 54.7, "over_bulk": 1.0, "bit_exact": True},
                        "kernel": {"gbps": 50.0, "over_bulk": 0.914, "bit_exact": False},
                        "batch_build": {"error": "x"}}}  # fmt: skip
    header, line = brb.table_lines(16, row, header=True)
    assert header.split() == ["KiB", "bulk", "kernel", "batch_build"]
    assert line.split() == ["16", "54.7", "1.000", "50.0", "0.914!", "error"]
    assert brb.table_lines(16, row, header=False) == [line]


def test_no_cuda_exits_with_code_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert brb.main(["--out", str(out)]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()


def test_help_runs_without_cuda():
    done = subprocess.run([sys.executable, "benchmarks/bench_recall_batch.py", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "--block-kib" in done.stdout and "--split" in done.stdout


@pytest.mark.cuda
def test_cuda_batch_copy_bit_exact_on_a_tiny_pool(tmp_path):
    chunk_blocks, block_bytes = 16, 4096
    pool = [c.pin_memory() for c in _pool(n_chunks=3, chunk_blocks=chunk_blocks, block_bytes=block_bytes)]
    ids = torch.randperm(3 * chunk_blocks, generator=torch.Generator().manual_seed(2))[:20]
    dst = torch.zeros((20, block_bytes), dtype=torch.uint8, device="cuda")
    copier = brb.BatchCopier()
    with torch.cuda.stream(torch.cuda.Stream()):  # not the legacy default stream
        copier.choose_attrs(pool[1][3], dst[0])
        addrs = np.array([c.data_ptr() for c in pool], dtype=np.uint64)
        copier.copy(*brb.pointer_arrays(ids.numpy(), addrs, chunk_blocks, block_bytes, dst.data_ptr()))
        torch.cuda.synchronize()
    assert copier.attempts[-1]["probe_bit_exact"], copier.attempts
    assert torch.equal(dst.cpu(), brb.host_gather(pool, chunk_blocks, ids))
    # The whole script at a tiny size: every variant ran, none failed, all bit-exact.
    out = tmp_path / "r.json"
    argv = ["--pool-mib", "8", "--chunk-mib", "2", "--total-mib", "1", "--block-kib", "4", "256", "--reps", "2",
            "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert brb.main(argv) == 0
    rows = json.loads(out.read_text())["block_sizes"]
    names = ["bulk", "kernel", "batch_build", "batch_launch", "split_0.25", "split_0.5", "split_0.75"]
    for row in rows:
        assert list(row["variants"]) == names
        for name, rec in row["variants"].items():
            if "Triton" in rec.get("error", ""):  # the kernel variants, on a machine without Triton
                continue
            assert rec.get("bit_exact") is True and rec["gbps"] > 0, (row["block_bytes"], name, rec)
