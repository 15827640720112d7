"""An exception in the middle of a forward (a hook, a KeyboardInterrupt) never leaves a cache that runs on silently:
the layers it reached are rolled back, or, where that cannot be exact, its next use says to reset it; reset() makes
it usable again; the model stays usable with any other cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.patches.layers import decoder_layers

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

BROKEN = r"reset\(\) or build a new OffloadCache"


class Boom(Exception):
    pass


NEW = 10


def _generate(model, cache, ids, mask, new_tokens=NEW):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              do_sample=False)  # fmt: skip


def _fail_at_call(model, layer_idx: int, call: int, error: BaseException):
    """A forward pre-hook on decoder layer ``layer_idx`` that raises ``error`` at its ``call``-th call."""
    module = next(m for m, idx in decoder_layers(model) if idx == layer_idx)
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == call:
            raise error

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("call", [1, 7], ids=["prefill", "decode_step_6"])
@pytest.mark.parametrize("error", [Boom("hook"), KeyboardInterrupt()], ids=["exception", "keyboard_interrupt"])
def test_a_forward_stopped_after_layer_0_rolls_the_cache_back(arch, call, error):
    """Layer 0 took the failed forward's tokens, layer 1 did not: the cache crops layer 0 back, so it holds what it
    held before the forward and continues as if the forward had never run. Gemma 3's sliding layers (window 12,
    prompts of 37 tokens) have dropped old tokens for the new ones and cannot be rolled back: that cache is marked
    broken, refuses every use, and reset() makes it usable again."""
    model = build_model(arch)
    ids, mask = left_padded([37, 21], seed=1)
    expected = _generate(model, DynamicCache(config=model.config), ids, mask)
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    hook = _fail_at_call(model, 1, call, error)
    with pytest.raises(type(error)):
        _generate(model, cache, ids, mask)
    hook.remove()
    done = call - 1  # forwards that completed: the prefill, then call - 2 decode steps
    held = 0 if done == 0 else ids.shape[1] + done - 1
    if arch != "gemma3":
        assert cache.get_seq_length() == held
        assert [int(layer.get_seq_length()) for layer in cache.layers] == [held] * len(cache.layers)
        # Continue from what the cache holds, as a DynamicCache that ran the same completed forwards continues.
        n = max(0, done - 1)  # generated tokens the cache holds
        known = expected[:, : ids.shape[1] + n + 1]
        known_mask = torch.cat([mask, torch.ones_like(known[:, ids.shape[1] :])], 1)
        dense = DynamicCache(config=model.config)
        if done:
            _generate(model, dense, ids, mask, n + 1)
        assert dense.get_seq_length() == held
        want = _generate(model, dense, known, known_mask, NEW - n - 1)
        assert torch.equal(_generate(model, cache, known, known_mask, NEW - n - 1), want)
        return
    for use in (
        lambda: _generate(model, cache, ids, mask, 2),
        lambda: cache.crop(-1),
        lambda: cache.reorder_cache(torch.tensor([1, 0])),
    ):
        with pytest.raises(RuntimeError, match=BROKEN):
            use()
    # The model is unharmed with another cache, and the reset cache generates exactly again.
    cache.reset()
    assert torch.equal(_generate(model, cache, ids, mask), expected)


def test_an_exception_inside_the_first_layer_before_its_update_leaves_the_cache_usable():
    model = build_model("llama")
    ids, mask = left_padded([30])
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    expected = _generate(model, DynamicCache(config=model.config), ids, mask)
    hook = _fail_at_call(model, 0, 1, Boom("before anything was cached"))
    with pytest.raises(Boom):
        _generate(model, cache, ids, mask)
    hook.remove()
    assert cache.get_seq_length() == 0
    assert torch.equal(_generate(model, cache, ids, mask), expected)


def test_a_broken_cache_is_not_copied():
    """Gemma 3's sliding layers past their window cannot be rolled back: the cache is broken and refuses a copy."""
    import copy

    model = build_model("gemma3")
    ids, mask = left_padded([30])
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    hook = _fail_at_call(model, 1, 3, Boom("decode"))
    with pytest.raises(Boom):
        _generate(model, cache, ids, mask)
    hook.remove()
    with pytest.raises(RuntimeError, match=BROKEN):
        copy.deepcopy(cache)


def test_output_attentions_is_refused_before_anything_is_cached(arch):
    model = build_model(arch)
    ids, mask = left_padded([20])
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    with pytest.raises(ValueError, match="does not return attention weights.*DynamicCache"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, output_attentions=True)
    assert cache.get_seq_length() == 0
    expected = _generate(model, DynamicCache(config=model.config), ids, mask, 3)
    assert torch.equal(_generate(model, cache, ids, mask, 3), expected)  # still usable
    with pytest.raises(ValueError, match="does not return attention weights"):
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=OffloadCache(model), max_new_tokens=2,
                           output_attentions=True, return_dict_in_generate=True)  # fmt: skip
