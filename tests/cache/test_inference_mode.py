"""A cache filled under ``torch.inference_mode()`` goes on under ``generate()`` (``no_grad``), and the other way round,
as ``DynamicCache`` does: the cache's own tensors are never inference tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

STEPS = 12


def _prompt():
    ids, _ = left_padded([45], seed=1)
    question = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    return ids, torch.cat([ids, question], 1)


def _generate(model, ids, cache):
    return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=STEPS,
                          do_sample=False)  # fmt: skip


def test_a_prefix_filled_under_inference_mode_forks_under_generate(arch):
    _fill_and_continue(arch, "inference_mode", "fork")


@pytest.mark.parametrize("fill, use", [("inference_mode", "cache"), ("no_grad", "cache"), ("no_grad", "fork")])
def test_a_cache_filled_in_one_mode_continues_in_the_other(fill, use):
    _fill_and_continue("llama", fill, use)


def _fill_and_continue(arch, fill, use):
    """Prefill under ``fill``; continue ``use`` (the cache, or a fork of it) in the other mode."""
    model = build_model(arch)
    prefix, full = _prompt()
    with torch.no_grad():
        want = _generate(model, full, DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    with torch.inference_mode() if fill == "inference_mode" else torch.no_grad():
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
    target = cache.fork() if use == "fork" else cache
    with torch.no_grad() if fill == "inference_mode" else torch.inference_mode():
        got = _generate(model, full, target)
    assert torch.equal(got, want)
    assert cache.stats()["host_kv_bytes"] > 0  # blocks went through the host pool
    for layer in target.offload_layers:
        assert not layer.blocks.host.chunks[0].is_inference()
