"""benchmarks/selector_cost.py on a CPU: runs, and reports each selector's summary bytes per block."""

from benchmarks.selector_cost import main


def test_selector_cost_smoke(tmp_path):
    out = main(["--shape", "tiny", "--context", "512", "--batch", "2", "--budget", "128", "--repeats", "1",
                "--selectors", "solohead", "meanbound", "--device", "cpu", "--out", str(tmp_path / "c.json")])  # fmt: skip
    rows = {r["selector"]: r for r in out["runs"]}
    heads, dim = 2, 16  # the tiny shape; bf16 summaries: kmin and kmax, plus kmean for meanbound
    assert rows["solohead"]["summary_bytes_per_block"] == 2 * heads * dim * 2
    assert rows["meanbound"]["summary_bytes_per_block"] == 3 * heads * dim * 2
    assert all(r["ms_per_step"] > 0 for r in rows.values())
    assert (tmp_path / "c.json").exists()
