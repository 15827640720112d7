"""benchmarks/bench_disk.py runs end to end at a tiny shape and writes its JSON."""

from __future__ import annotations

import json

from benchmarks import bench_disk


def test_bench_disk_writes_drive_tier_and_decode_numbers(tmp_path):
    out = tmp_path / "disk.json"
    bench_disk.main(["--shape", "tiny", "--context", "2048", "--batch", "2", "--steps", "4", "--budget", "256",
                     "--host-chunk-mib", "0.0625", "--drive-mib", "4", "--random-reads", "64", "--dir", str(tmp_path),
                     "--dtype", "float32", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["drive"]["seq_write_gbs"] > 0 and result["drive"]["random_read_gbs"] > 0
    disk = result["runs"]["disk_tier"]
    assert disk["stats"]["disk_kv_bytes"] > 0 and disk["spill_gbs"] > 0 and disk["tier_read_gbs"] > 0
    assert result["runs"]["host_only"]["stats"]["disk_kv_bytes"] == 0
    assert result["summary"]["decode_disk_vs_host_only"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk.json"]  # nothing left behind


def test_bench_disk_with_lookahead_as_a_second_configuration(tmp_path):
    out = tmp_path / "disk.json"
    bench_disk.main(["--shape", "tiny", "--context", "2048", "--batch", "2", "--steps", "4", "--budget", "256",
                     "--host-chunk-mib", "0.0625", "--drive-mib", "4", "--random-reads", "64", "--dir", str(tmp_path),
                     "--dtype", "float32", "--lookahead", "both", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"host_only", "disk_tier", "disk_tier_lookahead"}
    ahead = result["runs"]["disk_tier_lookahead"]["stats"]
    assert ahead["disk_kv_bytes"] > 0 and ahead["prefetched_blocks"] + ahead["disk_staged_ahead_blocks"] > 0
    assert result["summary"]["decode_disk_vs_host_only_lookahead"] > 0
    assert result["summary"]["decode_disk_vs_host_only"] > 0
