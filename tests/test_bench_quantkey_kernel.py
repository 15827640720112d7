"""benchmarks/bench_quantkey_kernel.py: which launch settings a run times (the timing itself needs CUDA)."""

from __future__ import annotations

from benchmarks import bench_quantkey_kernel


def test_settings_time_v1_the_v2_grid_and_v3_where_it_fits():
    args = bench_quantkey_kernel.parse_args(["--warps", "2", "4", "--rows-per-thread", "16", "8"])
    chosen = bench_quantkey_kernel.settings(args, 2)
    assert chosen[0]["variant"] == "v1"
    assert sum(s["variant"] == "v2" for s in chosen) == 4  # 2 warps x 2 rows (the default among them)
    v3 = [s for s in chosen if s["variant"] == "v3"]
    assert [(s["num_warps"], s.get("precision", "tf32")) for s in v3] == [(2, "tf32"), (4, "tf32"), (None, "ieee")]
    narrow = bench_quantkey_kernel.parse_args(["--head-dim", "32", "--warps", "4"])
    assert not any(s["variant"] == "v3" for s in bench_quantkey_kernel.settings(narrow, 2))  # 8 code bytes per row


def test_table_line_names_the_exact_v3():
    row = {"variant": "v3", "precision": "ieee", "block_n": None, "num_warps": None, "rows_per_thread": None,
           "seconds": 1e-4, "max_abs_err": 1e-6, "first_call_seconds": 1.0}  # fmt: skip
    line = bench_quantkey_kernel.table_line(row, 10**8, 2 * 10**8, 2e-4)
    assert line.startswith("v3-ieee") and "2.00" in line
