"""A cache nobody holds any more is freed at once, host pools included (no reference cycle through the cache)."""

import gc
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
