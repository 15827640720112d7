"""The planner predicts exactly what a cache holds: against stats() on tiny models and against measured GPU runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.planner import GIB, ModelShape, largest_batch, plan, shape_from_config

from .helpers import TINY_BLOCKS, build_model, left_padded

SMALL = dict(TINY_BLOCKS, pool_tokens=24, host_chunk_mib=0.01)


def _generated_and_planned(model, config: OffloadConfig):
    """``(cache, its stats, the plan)`` after generate() of three sequences (61, 40 and 52 tokens) and 7 new tokens
    through an OffloadCache of ``config``."""
    cache = OffloadCache(model, config=config)
    ids, mask = left_padded([61, 40, 52], seed=11)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=7, do_sample=False)
    predicted = plan(shape_from_config(model.config, dtype_bytes=4), cache.get_seq_length(), 3, "offload", config)
    return cache, cache.stats(), predicted


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("selector", ["solohead", "meanbound", "quantkey", "quantkey[tail_bits=2]", "oracle", "streaming"])
def test_offload_prediction_equals_stats(arch, selector):
    model = build_model(arch)
    config = OffloadConfig(budget_tokens=48, selector=selector, **SMALL)
    cache, stats, predicted = _generated_and_planned(model, config)
    assert predicted.device_kv_bytes == stats["device_kv_bytes"]
    assert predicted.device_summary_bytes == stats["device_summary_bytes"]
    assert predicted.host_kv_bytes == stats["host_kv_bytes"]
    assert predicted.host_reserved_bytes == stats["host_reserved_bytes"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dense_prediction_equals_dynamic_cache(arch):
    model = build_model(arch)
    cache = DynamicCache(config=model.config)
    ids, mask = left_padded([45, 30], seed=12)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    held = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)
    predicted = plan(shape_from_config(model.config, dtype_bytes=4), cache.get_seq_length(), 2, "dense")
    assert predicted.device_kv_bytes == held


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_prediction_equals_static_cache(arch):
    from transformers import StaticCache

    model = build_model(arch)
    ids, mask = left_padded([45, 30], seed=12)
    max_len = ids.shape[1] + 9
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    held = sum(layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in cache.layers)
    predicted = plan(shape_from_config(model.config, dtype_bytes=4), max_len, 2, "static")
    assert predicted.device_kv_bytes == held


def test_step_transients_of_the_dense_caches():
    """DynamicCache's step concatenates one layer; StaticCache's SDPA repeats one layer's KV to every query head."""
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128, query_heads=32)
    layer = 12 * 65536 * shape.kv_bytes_per_token
    dense, static = plan(shape, 65536, 12, "dense"), plan(shape, 65536, 12, "static")
    assert dense.device_bytes == static.device_bytes == 32 * layer
    assert (dense.step_transient_bytes, static.step_transient_bytes) == (layer, 4 * layer)
    assert static.peak_device_bytes == static.device_bytes + 4 * layer
    assert plan(shape, 65536, 12, "offload").step_transient_bytes == 0
    # The transient decides the largest batch: 100 GiB hold 12 sequences of 8 GiB dense (96 + 3), 11 static (88 +
    # 11; 12 would need 96 + 12).
    assert largest_batch(shape, 65536, "dense", 100 << 30, 0) == 12
    assert largest_batch(shape, 65536, "static", 100 << 30, 0) == 11
    with pytest.raises(ValueError, match="'dense', 'static' or 'offload'"):
        plan(shape, 65536, 12, "paged")


def test_dense_peaks_of_the_h200_runs_are_predicted_within_1_percent():
    """The H200 runs of DynamicCache and StaticCache at 64K and 128K (results/decode/same_run_h200): weights and
    the device bytes before the cache, plus the planner's cache and step transient, against the measured peak
    (0.999-1.001 when written)."""
    folder = Path(__file__).resolve().parents[1] / "results/decode/same_run_h200"
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128, query_heads=32)
    checked = 0
    for path in sorted(folder.glob("bench_decode_*_same_run.json")):
        for run in json.loads(path.read_text())["runs"]:
            if run["method"] not in ("dynamic", "static"):
                continue
            p = plan(shape, run["prediction"]["kv_tokens"], run["batch"], "dense" if run["method"] == "dynamic"
                     else "static")  # fmt: skip
            ratio = run["peak_device_bytes"] / (run["device_bytes_before"] + p.peak_device_bytes)
            assert 0.99 < ratio < 1.01, (path.name, run["method"], run["batch"], ratio)
            checked += 1
    assert checked == 15


def test_prediction_matches_the_measured_real_model_runs():
    """Qwen2.5-Coder-0.5B, batch 10, budget 2048 on the H200 (results/core_needle): device KV, summaries, host KV."""
    data = json.loads((Path(__file__).resolve().parents[1] / "results/core_needle/needle.json").read_text())
    shape = ModelShape(full_layers=24, sliding_layers=0, sliding_window=None, kv_heads=2, head_dim=64)
    checked = 0
    for run in data["runs"]:
        if run["method"] not in ("solohead", "headwise"):
            continue
        for stats in run["stats_per_batch"]:
            context = run["length"] + stats["decode_steps"]  # prompt + tokens fed back during decode
            p = plan(shape, context, run["batch"], "offload", OffloadConfig(budget_tokens=2048, selector=run["method"]))
            # These runs predate the open block's one-block buffer: they held only its filled tokens.
            per_token = 2 * shape.kv_heads * shape.head_dim * 2
            unfilled = shape.full_layers * run["batch"] * (-context % 16) * per_token
            assert (p.device_kv_bytes, p.device_summary_bytes, p.host_kv_bytes) == (
                stats["device_kv_bytes"] + unfilled, stats["device_summary_bytes"], stats["host_kv_bytes"]
            )
            checked += 1
    assert checked >= 6


def test_largest_batch_is_monotone_and_offload_fits_more():
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128)
    device, host = 100 << 30, 120 << 30
    always = OffloadConfig(admission="always")
    dense = largest_batch(shape, 65536, "dense", device, host)
    offload = largest_batch(shape, 65536, "offload", device, host, always)
    assert dense == 12  # 8 GiB of KV per sequence at 64K: 100 GiB holds 12
    assert offload > dense
    assert plan(shape, 65536, offload, "offload", always).host_reserved_bytes <= host
    assert plan(shape, 65536, offload + 1, "offload", always).host_reserved_bytes > host or plan(
        shape, 65536, offload + 1, "offload", always).device_bytes > device


@pytest.mark.parametrize("selector", ["quantkey", "quantkey[bits=4,tail_bits=2,tail_near=3]"])
def test_largest_batch_with_admission_auto_admits_what_the_summaries_leave(selector):
    """admission="auto" (the default) without a bound: blocks are admitted into what the cache's other device bytes
    and the margin leave, so larger summaries move blocks to the host instead of ruling the batch out; the batch
    found fits that way and the next one does not (the host is full)."""
    from hf_offload.planner import admission_margin_bytes

    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128)
    device, host = 124 << 30, 120 << 30  # an H200 less 15 GiB of 8B-shape weights; a 128 GiB host
    config = OffloadConfig(selector=selector)
    assert config.admission == "auto"
    dense = largest_batch(shape, 131072, "dense", device, host)
    offload = largest_batch(shape, 131072, "offload", device, host, config)
    assert dense == 7 and offload > dense  # 16 GiB of KV per sequence at 128K
    for batch, fits in ((offload, True), (offload + 1, False)):
        p = plan(shape, 131072, batch, "offload", config, device_free_bytes=device)
        assert p.admitted_reserved_bytes > 0
        assert p.device_bytes <= device - admission_margin_bytes(device) + (16 << 20)  # within one chunk
        assert (p.device_bytes <= device and p.host_reserved_bytes <= host) == fits


@pytest.mark.parametrize("chunks", [1, 3, 1000])  # one chunk, some chunks, every chunk
def test_admission_auto_prediction_equals_stats(chunks):
    """admission="auto" within device_memory_gib: the bound less the cache's buffers, in whole chunks, is device
    memory (a chunk less where one went back to the host as the summaries grew); the planner predicts it."""
    model = build_model("llama")
    ids, mask = left_padded([61, 40, 52], seed=11)

    def run(config):
        cache = OffloadCache(model, config=config)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False)
        return cache

    probe = OffloadConfig(budget_tokens=48, admission="always", **SMALL)
    always = run(probe)
    host = always.offload_layers[0].blocks.host
    chunk_bytes, total_chunks = host.chunk_blocks * host.block_bytes, sum(
        len(layer.blocks.host.chunks) for layer in always.offload_layers)  # fmt: skip
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in always.offload_layers)
    config = probe.replace(admission="auto", device_memory_gib=(buffers + chunks * chunk_bytes) / 2**30)
    cache = run(config)
    admitted = sum(layer.blocks.host.admitted_chunks for layer in cache.offload_layers)
    assert min(chunks, total_chunks) - 1 <= admitted <= min(chunks, total_chunks)
    admission = cache._shared.admissions[torch.device("cpu")]
    assert admission.cache_bytes() <= admission.limit_bytes
    stats, before = cache.stats(), always.stats()
    # Nothing lost or counted twice: admitted blocks moved from the host column to the device column.
    assert stats["host_kv_bytes"] + stats["device_kv_bytes"] == before["host_kv_bytes"] + before["device_kv_bytes"]
    assert (stats["host_kv_bytes"] == 0) == (admitted == total_chunks)
    shape = shape_from_config(model.config, dtype_bytes=4)
    predicted = plan(shape, cache.get_seq_length(), 3, "offload", config)
    assert abs(predicted.admitted_reserved_bytes // chunk_bytes - admitted) <= 1


def test_admission_auto_without_a_device_admits_nothing():
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128)
    p = plan(shape, 65536, 4, "offload", OffloadConfig(admission="auto"))
    assert p.admitted_reserved_bytes == 0
    p = plan(shape, 65536, 16, "offload", OffloadConfig(admission="auto"), device_free_bytes=100 << 30)
    left = (100 << 30) - (p.device_bytes - p.admitted_reserved_bytes) - (4 << 30)  # the 4% margin
    assert p.admitted_reserved_bytes <= left < p.admitted_reserved_bytes + (16 << 20)  # whole 16 MiB chunks
    assert p.host_kv_bytes + p.admitted_kv_bytes == plan(shape, 65536, 16, "offload").host_kv_bytes


def test_admission_auto_with_no_free_memory_admits_nothing():
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128)
    p = plan(shape, 65536, 12, "offload", OffloadConfig(admission="auto"), device_free_bytes=-(4 << 30))
    always = plan(shape, 65536, 12, "offload")
    assert p.admitted_reserved_bytes == p.admitted_kv_bytes == 0
    assert (p.host_kv_bytes, p.host_reserved_bytes) == (always.host_kv_bytes, always.host_reserved_bytes)


@pytest.mark.parametrize("selector", ["quantkey", "quantkey[bits=4,tail_bits=2,tail_near=3]"])
def test_largest_resident_batch_keeps_every_block_on_the_device_and_the_next_does_not(selector):
    from hf_offload.planner import largest_resident_batch, suggested_device_memory_gib

    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128,
                       weights_bytes=int(2 * 8.03e9))  # fmt: skip
    device = (139 << 30) - shape.weights_bytes
    config = OffloadConfig(selector=selector, admission="auto")
    batch = largest_resident_batch(shape, 65536, device, config, margin_gib=8.0)
    assert 0 < batch < largest_batch(shape, 65536, "offload", device, 1 << 50, config)
    gib = suggested_device_memory_gib(shape, 65536, batch, config, device, 8.0)
    for b, resident in ((batch, True), (batch + 1, False)):
        p = plan(shape, 65536, b, "offload", config.replace(device_memory_gib=gib))
        assert (p.host_kv_bytes == 0) == resident
    # A larger margin or smaller summaries never allow more sequences on the device.
    assert largest_resident_batch(shape, 65536, device, config, margin_gib=30.0) < batch
    assert largest_resident_batch(shape, 65536, 0, config) == 0


@pytest.mark.parametrize("folder, names", [
    ("batch_sweep_h200", ("bench_decode_65536_quantkey_batches.json", "bench_decode_131072_quantkey_batches.json")),
    ("tail_mma_h200", ("bench_decode_65536_default_batches.json", "bench_decode_131072_default_batches.json")),
])  # fmt: skip
def test_largest_resident_batch_matches_the_h200_batch_sweeps(folder, names):
    """results/decode/batch_sweep_h200 (plain quantkey) and tail_mma_h200 (the default selector): admission "auto"
    with the benchmark's 8 GiB margin, 8B shape on one H200. Every block stayed on the device up to one batch (64K:
    12 and 10; 128K: 6 and 5) and the next batch run put blocks in host memory (batch 11 was not run at 64K with
    the default selector); the planner's resident batch lies between them, for each selector's summary bytes."""
    from hf_offload.planner import largest_resident_batch, shape_from_preset

    shape = shape_from_preset("llama-3.1-8b")
    for name in names:
        data = json.loads((Path(__file__).resolve().parents[1] / "results" / "decode" / folder / name).read_text())
        args = data["metadata"]["args"]
        assert args["admission_margin_gib"] == 8.0 and args["admission_gib"] is None
        runs = data["runs"]
        resident = max(r["batch"] for r in runs if r["stats"]["host_kv_bytes"] == 0)
        spilled = min(r["batch"] for r in runs if r["stats"]["host_kv_bytes"] > 0)
        assert resident < spilled
        device = 139 << 30  # the H200's memory as torch reports it, rounded down
        config = OffloadConfig(selector=args["quantkey_selector"], budget_tokens=args["budget"])
        predicted = largest_resident_batch(shape, runs[0]["context"], device - shape.weights_bytes, config,
                                           margin_gib=8.0)  # fmt: skip
        assert resident <= predicted < spilled, (name, predicted, resident, spilled)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_disk_tier_prediction_equals_stats(arch, tmp_path):
    model = build_model(arch)
    chunk_bytes = 2 * (2 * 2 * 8 * 16 * 4)  # two blocks of the tiny models
    config = OffloadConfig(budget_tokens=48, **dict(SMALL, host_chunk_mib=chunk_bytes / 2**20),
                           host_memory_gib=5 * chunk_bytes / 2**30, disk_dir=str(tmp_path))  # fmt: skip
    cache, stats, predicted = _generated_and_planned(model, config)
    assert stats["disk_kv_bytes"] > 0
    assert predicted.host_kv_bytes == stats["host_kv_bytes"]
    assert predicted.host_reserved_bytes == stats["host_reserved_bytes"]
    assert predicted.disk_kv_bytes == stats["disk_kv_bytes"]
    assert predicted.disk_reserved_bytes == cache.disk.used_bytes
    cache.close()


def test_largest_batch_counts_the_disk_tier():
    shape = ModelShape(32, 0, None, 8, 128, 2, int(16e9), 32)
    host_only = OffloadConfig(host_memory_gib=64)
    disk = host_only.replace(disk_dir=".")
    device, host = 120 * 2**30, 64 * 2**30
    base = largest_batch(shape, 131072, "offload", device, host, host_only)
    more = largest_batch(shape, 131072, "offload", device, host, disk, disk_free_bytes=1 << 40)
    assert more > base
    p = plan(shape, 131072, more, "offload", disk)
    assert p.host_reserved_bytes <= host and 0 < p.disk_reserved_bytes <= 1 << 40


@pytest.mark.parametrize("share", [1.5, 0.95, 0.6])  # the default's summaries fit / the first level / plain quantkey
def test_the_summary_level_a_bound_forces_is_predicted(share):
    """Under a device_memory_gib that the default's summaries do not fit, the cache re-encodes them at a coarser
    level (coarsen_summaries); the planner names the level the cache ends at and predicts its summary bytes."""
    model = build_model("llama")
    ids, mask = left_padded([61, 40, 52], seed=11)

    def run(config):
        cache = OffloadCache(model, config=config)
        with torch.no_grad(), __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore", RuntimeWarning)
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=7, do_sample=False)
        return cache

    probe = run(OffloadConfig(budget_tokens=48, admission="always", **SMALL))
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in probe.offload_layers)
    summaries = probe.stats()["device_summary_bytes"]
    config = OffloadConfig(budget_tokens=48, admission="auto", **SMALL,
                           device_memory_gib=(buffers - summaries + share * summaries) / 2**30)  # fmt: skip
    cache = run(config)
    stats = cache.stats()
    predicted = plan(shape_from_config(model.config, dtype_bytes=4), cache.get_seq_length(), 3, "offload", config)
    assert predicted.summary_selector == stats["selector"]
    assert predicted.device_summary_bytes == stats["device_summary_bytes"]
    assert (stats["selector"] == "quantkey[bits=4,tail_bits=2,tail_near=16.0]") == (share >= 1)
    fixed = plan(shape_from_config(model.config, dtype_bytes=4), cache.get_seq_length(), 3, "offload",
                 config.replace(coarsen_summaries=False))  # fmt: skip
    assert fixed.summary_selector == "quantkey[bits=4,tail_bits=2,tail_near=16.0]"
    assert fixed.device_summary_bytes == summaries


def test_coarser_summaries_let_a_small_device_run_larger_batches():
    shape = ModelShape(full_layers=32, sliding_layers=0, sliding_window=None, kv_heads=8, head_dim=128)
    free = int(9 * GIB)  # a 24 GiB device less 8B weights
    config = OffloadConfig(budget_tokens=2048)
    coarse = largest_batch(shape, 131072, "offload", free, int(1e12), config)
    fine = largest_batch(shape, 131072, "offload", free, int(1e12), config.replace(coarsen_summaries=False))
    assert coarse > fine >= 1
    level = plan(shape, 131072, coarse, "offload", config, device_free_bytes=free)
    assert level.summary_selector == "quantkey" and level.peak_device_bytes <= free
    assert plan(shape, 131072, fine, "offload", config, device_free_bytes=free).summary_selector == (
        "quantkey[bits=4,tail_bits=2,tail_near=16.0]"
    )


def test_the_planned_prefill_temporaries_are_the_admissions_own_estimate(monkeypatch):
    # A chunked prefill of 61 tokens in chunks of 16 through a bounded cache (the admission exists on the CPU only
    # under a bound): the largest estimate the admission took, at the last chunk, equals the plan's. The plan is a
    # device's; a later chunk on the CPU attends in parts where a device would not, so the CPU takes the device's
    # route here.
    from hf_offload.attention import prefill

    in_parts = prefill.in_parts
    monkeypatch.setattr(prefill, "in_parts", lambda cpu, *args: in_parts(False, *args))
    model = build_model("llama")
    config = OffloadConfig(budget_tokens=48, device_memory_gib=1.0, **SMALL)
    cache = OffloadCache(model, config=config)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for start in range(0, 64, 16):
            model(input_ids=ids[:, start : start + 16], past_key_values=cache)
    admission = cache.offload_layers[0].blocks.host.admission
    shape = shape_from_config(model.config, dtype_bytes=4)
    predicted = plan(shape, 64, 2, "offload", config, prefill_chunk_tokens=16)
    assert predicted.prefill_transient_bytes == admission.transient_bytes > 0
    assert predicted.prefill_peak_bytes == predicted.device_bytes - predicted.admitted_reserved_bytes + admission.transient_bytes


def test_a_planned_prefill_chunk_bounds_the_largest_batch_and_needs_the_layer_sizes():
    from hf_offload.planner import shape_from_preset

    shape = shape_from_preset("llama-3.1-8b")
    free, host = 9 * GIB, 10**6 * GIB  # a 24 GiB device less the 8B weights
    config = OffloadConfig(budget_tokens=2048)
    without = largest_batch(shape, 131072, "offload", free, host, config)
    chunked = largest_batch(shape, 131072, "offload", free, host, config, prefill_chunk_tokens=8192)
    assert 1 <= chunked < without
    p = plan(shape, 131072, chunked, "offload", config, free, prefill_chunk_tokens=8192)
    assert p.prefill_peak_bytes <= free < plan(shape, 131072, chunked + 1, "offload", config, free,
                                               prefill_chunk_tokens=8192).prefill_peak_bytes  # fmt: skip
    # The recalled KV of a later chunk grows with the context, not the chunk.
    small = plan(shape, 131072, 1, "offload", config, free, prefill_chunk_tokens=1024).prefill_transient_bytes
    assert small > 131072 * 2 * shape.kv_heads * shape.head_dim * 2  # the layer's K and V at 128K, at least
    bare = ModelShape(32, 0, None, 8, 128, 2, shape.weights_bytes, 32)
    with pytest.raises(ValueError, match="hidden_size and intermediate_size"):
        plan(bare, 131072, 1, "offload", config, free, prefill_chunk_tokens=8192)
