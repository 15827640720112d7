"""benchmarks/bench_quantkey_kernel.py: which launch settings a run times (the timing itself needs CUDA)."""

from __future__ import annotations

from benchmarks import bench_quantkey_kernel


def test_settings_time_the_v2_grid_then_the_tensor_core_kernel():
    args = bench_quantkey_kernel.parse_args(["--warps", "2", "4", "--rows-per-thread", "16", "8"])
    chosen = bench_quantkey_kernel.settings(args, 2)
    triton = [s for s in chosen if s["variant"] == "v2"]
    assert len(triton) == 4 and chosen[:4] == triton  # 2 warps x 2 rows (the default among them)
    cuda = chosen[4:]
    assert [s["variant"] for s in cuda] == ["mma"] * 17  # the base, then changes from it
    assert cuda[0] == {"variant": "mma", "block_n": None, "num_warps": 4, "rows_per_thread": None, "prefetch": False,
                       "unroll": 1, "stages": 0, "chains": 1, "min_blocks": 0, "transpose": False}  # fmt: skip
    changed = [{k: v for k, v in s.items() if v != cuda[0][k]} for s in cuda[1:17]]
    assert {"prefetch": True} in changed and {"num_warps": 8} in changed and {"stages": 3} in changed
    assert {"stages": 2, "min_blocks": 8} in changed and {"transpose": True} in changed
    assert {"stages": 3, "transpose": True, "min_blocks": 7} in changed
    assert len({tuple(sorted(c.items())) for c in changed}) == 16  # no setting twice
    narrow = bench_quantkey_kernel.parse_args(["--head-dim", "32", "--warps", "1"])
    chosen = bench_quantkey_kernel.settings(narrow, 2)
    triton = [s for s in chosen if s["variant"] == "v2"]
    assert triton
    assert triton[-1]["num_warps"] == 4  # the default setting is timed even where the grid leaves it out


def test_table_line_marks_the_default():
    row = {"variant": "v2", "default": True, "block_n": 64, "num_warps": 4, "rows_per_thread": 16,
           "seconds": 1e-4, "max_abs_err": 1e-6, "first_call_seconds": 1.0}  # fmt: skip
    line = bench_quantkey_kernel.table_line(row, 10**8, 2 * 10**8, 2e-4)
    assert line.startswith("v2*") and "2.00" in line
    mma = {**row, "variant": "mma", "default": False, "prefetch": True, "unroll": 2, "num_warps": 8}
    assert bench_quantkey_kernel.table_line(mma, 10**8, 2 * 10**8, 2e-4).startswith("mma-pf-u2")
    ring = {**mma, "prefetch": False, "unroll": 1, "stages": 3}
    assert bench_quantkey_kernel.table_line(ring, 10**8, 2 * 10**8, 2e-4).startswith("mma-s3 ")
    capped = {**ring, "chains": 2, "min_blocks": 8}
    assert bench_quantkey_kernel.table_line(capped, 10**8, 2 * 10**8, 2e-4).startswith("mma-s3-c2-b8 ")
