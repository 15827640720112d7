"""torch.compile next to the patches: a model compiled after an OffloadCache was built for it runs other caches
exactly, and a compiled module handed to OffloadCache is refused with what to pass instead."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache

from ..helpers import build_model, left_padded


def _generate(model, ids, mask, cache):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=3, do_sample=False)


def test_compiled_model_with_another_cache_is_unaffected_by_the_patches():
    model = build_model("llama")
    ids, mask = left_padded([20, 15], seed=1)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    OffloadCache(model, budget_tokens=4096)  # installs the patches (fused rotary copies the attention forward)
    model.forward = torch.compile(model.forward, backend="eager")
    try:
        got = _generate(model, ids, mask, DynamicCache(config=model.config))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected)


def test_compiled_module_is_refused_with_what_to_pass():
    model = build_model("llama")
    with pytest.raises(TypeError, match=r"_orig_mod"):
        OffloadCache(torch.compile(model, backend="eager"), budget_tokens=64)


def test_inductor_compiled_model_generates_exactly_with_an_offload_cache():
    """torch.compile's default backend (inductor, on the CPU here) around a model that decodes with an OffloadCache:
    dynamo breaks the graph where the cache's Python runs, and the tokens are DynamicCache's at a budget covering the
    context."""
    import shutil

    from ..helpers import TINY_PREFILL

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on the CPU needs a C++ compiler (g++)")
    model = build_model("llama")
    ids, mask = left_padded([40, 29], seed=1)

    def run(cache):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                                  min_new_tokens=6, do_sample=False)  # fmt: skip

    expected = run(DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **TINY_PREFILL)
    model.forward = torch.compile(model.forward)
    try:
        got = run(cache)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert cache.stats()["host_kv_bytes"] > 0
