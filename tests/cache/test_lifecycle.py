"""A cache nobody holds any more is freed at once, host pools included (no reference cycle through the cache)."""

import gc
import warnings
import weakref

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_offload import OffloadCache


def test_cache_is_freed_without_cyclic_garbage_collection():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 200))
    gc.collect()
    gc.disable()  # an eval loop builds caches faster than the collector's object-count thresholds fire
    try:
        cache = OffloadCache(model, budget_tokens=64, block_tokens=16, timing=True, admission="auto")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3,
                           do_sample=False)  # fmt: skip
        assert cache.stats()["host_kv_bytes"] > 0
        refs = [weakref.ref(cache)] + [weakref.ref(layer) for layer in cache.offload_layers]
        refs += [weakref.ref(chunk) for layer in cache.offload_layers for chunk in layer.blocks.host.chunks]
        del cache
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def _live_tensors() -> tuple[int, int]:
    """Tensors the garbage collector tracks, and the bytes of their distinct storages."""
    with warnings.catch_warnings():  # isinstance on a deprecated module attribute warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"
    }
    return len(tensors), sum(storages.values())


def test_many_generate_calls_with_fresh_caches_leave_nothing_behind(tmp_path):
    """A long-running process: generate() after generate(), each with a fresh cache, alternating two models, batch
    sizes, prompt lengths, selectors, a fork and the disk tier. After the first round of every combination, the
    tensors alive stay the same in number, and their bytes only take values seen in the first of those rounds (what
    is left between calls belongs to the last call's shapes, and is replaced, not added to)."""
    from ..helpers import TINY_SPARSE, build_model, left_padded

    models = {arch: build_model(arch) for arch in ("llama", "qwen2")}
    settings = [{}, {"selector": "quantkey"}, {"admission": "auto"},
                {"host_memory_gib": 2 / 1024, "host_chunk_mib": 0.25, "disk_dir": tmp_path}]  # fmt: skip
    counts = []
    period = 2 * len(settings)  # every model with every setting, then again
    for call in range(3 * period):
        arch, setting = ("llama", "qwen2")[call % 2], (call // 2) % len(settings)
        model = models[arch]
        ids, mask = left_padded([70, 41] if arch == "llama" else [95, 60, 33], seed=call)
        cache = OffloadCache(model, **TINY_SPARSE, **settings[setting])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                           min_new_tokens=6, do_sample=False)  # fmt: skip
            if setting == 1:  # a second question over the same prompt
                fork = cache.fork(batch=ids.shape[0])
                more = torch.cat([ids, torch.full_like(ids[:, :3], 5)], 1)
                model.generate(input_ids=more, attention_mask=torch.ones_like(more), past_key_values=fork,
                               max_new_tokens=4, do_sample=False)  # fmt: skip
                del fork
        assert cache.stats()["host_kv_bytes"] > 0
        cache.close()
        del cache
        gc.collect()
        counts.append(_live_tensors())
    later = counts[period:]
    assert len({n for n, _ in later}) == 1, f"live tensors (count, bytes) per call: {later}"
    assert {b for _, b in later} <= {b for _, b in counts[period : 2 * period]}, later
    assert not list(tmp_path.iterdir())  # the disk tier's directories are gone
