"""Passing the cache to ``generate()`` under the name the installed transformers expects."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers.generation.utils import GenerationMixin

from hf_offload import OffloadCache, generate_cache_kwarg

from .helpers import build_model


def test_generate_kwargs_use_the_installed_transformers_name_without_a_warning():
    """``cache.generate_kwargs()`` passes the cache as ``cache=`` where generate() takes that name (transformers 5.24)
    and as ``past_key_values=`` where it does not (5.17): no deprecation warning either way, and the tokens of
    ``past_key_values=``."""
    name = generate_cache_kwarg()
    takes_cache = "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert name == ("cache" if takes_cache else "past_key_values")
    model = build_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(3))
    cache = OffloadCache(model, budget_tokens=64, block_tokens=16, sink_tokens=16, window_tokens=16)
    assert list(cache.generate_kwargs()) == [name] and cache.generate_kwargs()[name] is cache
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache.generate_kwargs(), max_new_tokens=6,
                             do_sample=False)  # fmt: skip
    assert cache.stats()["decode_steps"] == 5
    old_cache = OffloadCache(model, budget_tokens=64, block_tokens=16, sink_tokens=16, window_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=old_cache, max_new_tokens=6,
                             do_sample=False)  # fmt: skip
    assert torch.equal(out, old)


def test_forward_kwargs_use_the_models_name_without_a_warning():
    """``cache.forward_kwargs()`` passes the cache under the name the model's ``forward`` takes (``cache`` in
    transformers 5.24 and later, ``past_key_values`` in 5.17): no deprecation warning, the same logits and cache as
    ``past_key_values=``."""
    from hf_offload import forward_cache_kwarg

    model = build_model("llama")
    name = forward_cache_kwarg(model)
    assert name == ("cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values")
    ids = torch.randint(0, model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(4))
    cache = OffloadCache(model, budget_tokens=64, block_tokens=16, sink_tokens=16, window_tokens=16)
    assert list(cache.forward_kwargs()) == [name] and cache.forward_kwargs()[name] is cache
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        logits = model(input_ids=ids, **cache.forward_kwargs(), use_cache=True).logits
    assert cache.get_seq_length() == 100
    old_cache = OffloadCache(model, budget_tokens=64, block_tokens=16, sink_tokens=16, window_tokens=16)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)
        old = model(input_ids=ids, past_key_values=old_cache, use_cache=True).logits
    assert torch.equal(logits, old) and old_cache.get_seq_length() == 100
