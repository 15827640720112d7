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


def test_bench_disk_with_stage_near_as_further_configurations(tmp_path):
    out = tmp_path / "disk.json"
    bench_disk.main(["--shape", "tiny", "--context", "2048", "--batch", "2", "--steps", "4", "--budget", "256",
                     "--host-chunk-mib", "0.0625", "--drive-mib", "4", "--random-reads", "64", "--dir", str(tmp_path),
                     "--dtype", "float32", "--stage-near", "0", "8", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"host_only", "disk_tier", "disk_tier_near8"}
    plain, near = result["runs"]["disk_tier"], result["runs"]["disk_tier_near8"]
    assert plain["staged_ahead_blocks_per_step"] == 0 and near["staged_ahead_blocks_per_step"] > 0
    assert 0 <= near["staged_used_blocks_per_step"] <= near["staged_ahead_blocks_per_step"]
    assert near["demand_read_blocks_per_step"] >= 0 and plain["demand_read_blocks_per_step"] > 0
    assert result["summary"]["decode_disk_vs_host_only_near8"] > 0


def test_bench_disk_replays_a_recorded_workload(tmp_path):
    """``--workload recorded:PATH``: the fill and every decode step come from a decode recorded from a (tiny, random)
    Qwen2 model; the file names its workload, and each run its hit rate. A bad path fails before anything runs."""
    import pytest

    from benchmarks import workload

    from ..helpers import tiny_recording

    recording = tiny_recording()
    path = recording.save(tmp_path / "rec" / "tiny.safetensors")
    out, tier = tmp_path / "disk.json", tmp_path / "tier"
    tier.mkdir()
    argv = ["--shape", "tiny", "--context", "2048", "--batch", "2", "--steps", "4", "--budget", "256",
            "--host-chunk-mib", "0.0625", "--drive-mib", "4", "--random-reads", "64", "--dir", str(tier),
            "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert bench_disk.main([*argv, "--workload", f"recorded:{path}"]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["kind"] == "recorded" and result["workload"]["model"] == "tiny-qwen2"
    assert result["workload"]["sha256"] == workload.file_sha256(path)
    assert "tiny.safetensors" in result["metadata"]["workload"]
    for name in ("host_only", "disk_tier"):
        assert 0 <= result["runs"][name]["hit_rate"] <= 1
    assert result["runs"]["disk_tier"]["stats"]["disk_kv_bytes"] > 0
    assert not list(tier.iterdir())  # the tier's files are gone
    with pytest.raises(SystemExit):
        bench_disk.main([*argv, "--workload", f"recorded:{tmp_path / 'missing.safetensors'}"])


def test_bench_disk_runs_a_real_model_folder_with_the_same_tokens(tmp_path):
    """``--model``: a model folder (here a tiny random Qwen2 and its tokenizer) prefills one needle document per
    sequence and decodes greedily; the disk tier, with and without lookahead, generates the host-only tokens."""
    import pytest

    from ..fixtures.tiny import tiny_model, tiny_tokenizer

    folder, tier, out = tmp_path / "model", tmp_path / "tier", tmp_path / "disk.json"
    tier.mkdir()
    tokenizer = tiny_tokenizer()
    tiny_model(len(tokenizer), max_positions=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = ["--model", str(folder), "--context", "2048", "--batch", "2", "--steps", "5", "--budget", "256",
            "--host-chunk-mib", "0.0625", "--drive-mib", "4", "--random-reads", "64", "--dir", str(tier),
            "--device", "cpu", "--prefill-chunk", "512", "--lookahead", "both", "--out", str(out)]  # fmt: skip
    assert bench_disk.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["kind"] == "model" and len(result["workload"]["prompts"]) == 2
    assert set(result["runs"]) == {"host_only", "disk_tier", "disk_tier_lookahead"}
    host = result["runs"]["host_only"]
    assert len(host["tokens"]) == 2 and all(len(t) == 5 for t in host["tokens"])
    for name in ("disk_tier", "disk_tier_lookahead"):
        run = result["runs"][name]
        assert run["stats"]["disk_kv_bytes"] > 0 and run["stats"]["decode_steps"] == 5
        assert run["demand_read_blocks_per_step"] + run["staging_hits_per_step"] > 0  # the decode read from disk
    assert result["summary"]["tokens_match_host_only"] is True
    assert result["summary"]["tokens_match_host_only_lookahead"] is True
    assert not list(tier.iterdir())  # the tier's files are gone
    with pytest.raises(SystemExit):  # a real model runs real prompts: no replayed workload
        bench_disk.main([*argv, "--workload", "recorded:x.safetensors"])
