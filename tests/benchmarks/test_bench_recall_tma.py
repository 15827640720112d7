"""benchmarks/bench_recall_tma.py: the variant names and limits on the CPU, and the TMA gather kernels bit-exact on a
small CPU pool under Triton's interpreter (``TRITON_INTERPRET=1``; skipped without Triton or without tensor
descriptors in it)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import bench_recall_tma as brt

KIB = 1024


def _interpreter_with_descriptors() -> bool:
    if brt.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return hasattr(brt.tl, "make_tensor_descriptor") and brt.TensorDescriptor is not None


needs_interpreter = pytest.mark.skipif(not _interpreter_with_descriptors(),
                                       reason="needs Triton's interpreter (TRITON_INTERPRET=1) with tensor descriptors")


def test_variants_cut_to_the_block_and_named_apart():
    names = [c.name for c in brt.default_sweep()]
    assert len(set(names)) == len(names)
    cut = brt.TmaConfig(box_bytes=16 * KIB, row_bytes=512).for_block(2 * KIB)
    assert (cut.box_bytes, cut.row_bytes, cut.name) == (2 * KIB, 512, "tma_host_r512_b2k_st_box_w4s1")
    assert brt.TmaConfig(box_bytes=256, row_bytes=512).for_block(4 * KIB).row_bytes == 256
    one_d = brt.TmaConfig(rank=1, elem_bytes=8, box_bytes=8 * KIB, programs_per_sm=4, num_stages=3, desc_store=True)
    assert one_d.name == "tma1d_host_e8_b8k_tma_p4_w4s3" and one_d.kind == "rank1_host_tma"
    assert {c.kind for c in brt.probe_sweep()} == {c.kind for c in brt.default_sweep()}


def test_config_error_limits():
    ok = brt.TmaConfig(box_bytes=4 * KIB)
    assert brt.config_error(ok, 16 * KIB, 1 << 32, 1 << 29) is None
    assert "power of two" in brt.config_error(brt.TmaConfig(box_bytes=3 * KIB), 12 * KIB, 1 << 20, 1 << 20)
    assert "row" in brt.config_error(brt.TmaConfig(row_bytes=8), 16 * KIB, 1 << 20, 1 << 20)
    assert "int32" in brt.config_error(brt.TmaConfig(rank=1, elem_bytes=4), 16 * KIB, 1 << 33, 1 << 20)
    assert "4 or 8" in brt.config_error(brt.TmaConfig(rank=1, elem_bytes=2), 16 * KIB, 1 << 20, 1 << 20)


def test_parse_args_defaults_and_no_cuda_exit(capsys, monkeypatch):
    args = brt.parse_args([])
    assert args.block_kib == [2, 4, 16, 64, 256] and (args.pool_mib, args.total_mib, args.reps) == (4096, 512, 10)
    with pytest.raises(SystemExit):
        brt.parse_args(["--block-kib", "3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert brt.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@needs_interpreter
@pytest.mark.parametrize("cfg", [
    brt.TmaConfig(box_bytes=4 * KIB),
    brt.TmaConfig(box_bytes=2 * KIB, row_bytes=256, desc_store=True),
    brt.TmaConfig(box_bytes=4 * KIB, programs_per_sm=3, num_stages=3),  # several boxes per program, repeated tail
    brt.TmaConfig(box_bytes=2 * KIB, device_desc=True, programs_per_sm=2, num_stages=2),
    brt.TmaConfig(rank=1, box_bytes=2 * KIB, elem_bytes=8),
    brt.TmaConfig(rank=1, box_bytes=1 * KIB, elem_bytes=4, desc_store=True, programs_per_sm=1),
], ids=lambda c: c.name)  # fmt: skip
def test_tma_gather_bit_exact_under_the_interpreter(cfg):
    block_bytes = 8 * KIB
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (24 * block_bytes,), dtype=torch.uint8, generator=g)
    ids = torch.randperm(24, generator=g)[:5]
    dst = torch.full((5, block_bytes), 0xA5, dtype=torch.uint8)
    brt.make_tma_gather(cfg.for_block(block_bytes), pool, ids, dst, block_bytes, sm_count=2)()
    assert torch.equal(dst, pool.view(-1, block_bytes)[ids])
