"""The later-chunk prefill benchmark: both paths run, time and agree, and the masked path is what it says."""

from __future__ import annotations

import json

from benchmarks import bench_chunk_prefill
from hf_offload.attention import prefill


def test_both_paths_are_timed_and_give_the_same_logits(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert bench_chunk_prefill.main(["--shape", "tiny", "--layers", "2", "--context", "256", "--chunks", "5", "40",
                                     "--batch", "2", "--repeats", "2", "--dtype", "float32", "--device", "cpu",
                                     "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["complete"] and result["metadata"]["workload"] == bench_chunk_prefill.WORKLOAD
    assert [r["chunk"] for r in result["rows"]] == [5, 40]
    for row in result["rows"]:
        assert len(row["masked_s"]) == len(row["parts_s"]) == 2 and min(row["masked_s"] + row["parts_s"]) > 0
        assert row["masked_over_parts"] == row["median_masked_s"] / row["median_parts_s"]
        assert row["max_abs_logit_diff"] <= 1e-4 * max(1.0, row["max_abs_logit"])
    assert "masked/parts" in capsys.readouterr().out
    from hf_offload.cache import layer

    # Restored after the runs, in the attention and in the admission's estimate.
    assert prefill.lse_attention_available.__name__ == "lse_attention_available"
    assert layer.lse_attention_available is prefill.lse_attention_available


def test_the_masked_path_skips_the_parts(monkeypatch):
    """``masked`` really takes the one-call path (no log-sum-exp parts), ``parts`` the merged one."""
    import torch

    from benchmarks.bench_disk import build
    from hf_offload import OffloadCache

    model = build("tiny", 2, 512, torch.device("cpu"), torch.float32)
    prefix = OffloadCache(model, budget_tokens=2048)
    x = torch.randint(3, model.config.vocab_size, (1, 256))
    with torch.inference_mode():
        model(input_ids=x, attention_mask=torch.ones_like(x), **prefix.forward_kwargs(), use_cache=True)
    calls = []
    original = prefill.segmented_prefill
    monkeypatch.setattr(prefill, "segmented_prefill", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(3, model.config.vocab_size, (1, 9))
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # query heads share KV heads
    bench_chunk_prefill.timed_chunk(model, prefix, ids, 256, 1, "masked")
    assert calls == []
    bench_chunk_prefill.timed_chunk(model, prefix, ids, 256, 1, "parts")
    assert len(calls) == 2  # both layers
