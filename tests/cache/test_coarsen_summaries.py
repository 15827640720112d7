"""Summaries that outgrow the device room are re-encoded at the selector's next coarser level
(``OffloadConfig.coarsen_summaries``) instead of failing: the levels, the re-encoding, and a cache that goes on."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.kernels.quant import dequantize_keys
from hf_offload.selectors import QuantKeySelector, get_selector
from hf_offload.selectors.base import Selector

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

NEW_TOKENS = 8


def _generate(model, ids, mask, cache, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False
        )


def _summary_free_bound(model, ids, mask, share: float, **settings) -> float:
    """A ``device_memory_gib`` that holds a cache's device buffers other than its summaries plus ``share`` of the
    default selector's summaries (measured on a cache filled without a bound)."""
    probe = OffloadCache(model, **settings)
    _generate(model, ids, mask, probe, new_tokens=2)
    layers = probe.offload_layers
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in layers)
    summaries = sum(layer.blocks.device_summary_bytes() for layer in layers)
    return (buffers - summaries + share * summaries) / 2**30


def _coarsened_generate(model, ids, mask, **settings):
    cache = OffloadCache(model, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _generate(model, ids, mask, cache)
    messages = [str(w.message) for w in caught if "block summaries no longer fit" in str(w.message)]
    return cache, out, messages


# --------------------------------------------------------------------------------------------------------- levels
def test_the_default_selector_coarsens_in_two_levels_then_stops():
    default = get_selector("quantkey[bits=4,tail_bits=2,tail_near=3]")
    first = default.coarser()
    assert (first.bits, first.tail_bits, first.tail_near) == (2, 2, 3)
    second = first.coarser()
    assert (second.bits, second.tail_bits, second.tail_near, second.tail_far) == (2, 0, 0.0, "near")
    assert second.coarser() is None
    assert get_selector("quantkey[bits=8]").coarser().bits == 4
    assert get_selector("meanbound").coarser() is None  # no coarser level: the cache raises as before
    assert Selector().coarser() is None

    class OwnSummaries(QuantKeySelector):
        def summarize(self, keys):
            return super().summarize(keys)

    assert OwnSummaries(bits=4).coarser() is None  # summaries of its own: no conversion known


@pytest.mark.parametrize("head_dim", [16, 10])
def test_recoded_keys_stay_within_both_quantization_steps(head_dim):
    torch.manual_seed(0)
    fine = get_selector("quantkey[bits=4,tail_bits=2,tail_near=3]")
    batch, n, heads, tokens, capacity = 2, 5, 3, 8, 7
    keys = torch.randn(batch, n, heads, tokens, head_dim)
    values = torch.randn(batch, n, heads, tokens, head_dim)
    made = {**fine.summarize(keys), **fine.summarize_values(values)}
    buffers = {name: torch.zeros((batch, capacity, *t.shape[2:]), dtype=t.dtype) for name, t in made.items()}
    for name, t in made.items():
        buffers[name][:, :n] = t
    coarse = fine.coarser()
    recoded = fine.coarsen_summaries(buffers, coarse, head_dim, n)
    assert set(recoded) == set(buffers)
    fresh = {**coarse.summarize(keys), **coarse.summarize_values(values)}
    for name, t in recoded.items():
        assert t.shape == (batch, capacity, *fresh[name].shape[2:]) and t.dtype == fresh[name].dtype
        assert not t[:, n:].any()  # zeros past the sealed blocks, as a grown buffer has
    assert recoded["vcodes"] is buffers["vcodes"]  # the values keep their 2 bits: not copied
    for prefix, x, bits_f, bits_c in (("", keys, 4, 2), ("v", values, 2, 2)):
        low, step = ("kmin", "kstep") if not prefix else ("vmin", "vstep")
        deq_f = dequantize_keys(buffers[f"{prefix}codes"][:, :n], buffers[low][:, :n], buffers[step][:, :n], bits_f)
        deq_c = dequantize_keys(recoded[f"{prefix}codes"][:, :n], recoded[low][:, :n], recoded[step][:, :n], bits_c)
        step_f = buffers[step][:, :n, :, None, :head_dim]
        step_c = recoded[step][:, :n, :, None, :head_dim]
        err = (deq_c[..., :head_dim] - x).abs()
        assert (err <= step_c / 2 + step_f / 2 + 1e-5).all()
        assert (deq_f[..., :head_dim] - x).abs().max() > 0  # the fine level is lossy too: the bound is not vacuous
    dropped = coarse.coarsen_summaries(recoded, coarse.coarser(), head_dim, n)
    assert set(dropped) == {"codes", "kmin", "kstep"} and dropped["codes"] is recoded["codes"]
    with pytest.raises(ValueError, match="tail_bits"):
        coarse.coarser().coarsen_summaries(dropped, coarse, head_dim, n)


# ----------------------------------------------------------------------------------------------- a cache goes on
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_a_bound_too_small_for_the_default_summaries_coarsens_and_stays_exact(arch):
    model = build_model(arch)
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(budget_tokens=4096, admission="auto", **SMALL)
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache, got, messages = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **settings)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert [(e["from"], e["to"]) for e in stats["summary_levels"]] == [
        ("quantkey[bits=4,tail_bits=2,tail_near=16.0]", "quantkey[tail_bits=2,tail_near=16.0]"),
        ("quantkey[tail_bits=2,tail_near=16.0]", "quantkey"),
    ]
    assert stats["selector"] == "quantkey" and cache.config.selector == "quantkey"
    assert len(messages) == 2 and "re-encoded from" in messages[0] and "coarsen_summaries=False" in messages[0]
    for layer in cache.offload_layers:
        assert set(layer.blocks.summary_store) == {"codes", "kmin", "kstep"}
        assert layer.selector is cache.selector and layer.blocks.selector is cache.selector
        assert layer.planner.selector is cache.selector and layer.graphs.selector is cache.selector
    admission = cache.offload_layers[0].blocks.host.admission
    assert admission.cache_bytes() <= admission.limit_bytes


def test_without_coarsening_the_same_bound_raises_what_to_change():
    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(budget_tokens=4096, admission="auto", **SMALL)
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    cache = OffloadCache(model, device_memory_gib=gib, coarsen_summaries=False, **settings)
    with pytest.raises(MemoryError, match=r"device_memory_gib=.*cannot hold.*coarsen_summaries=True"):
        _generate(model, ids, mask, cache)
    with pytest.raises(ValueError, match="coarsen_summaries must be True or False"):
        OffloadCache(model, coarsen_summaries="yes")


def test_summaries_held_are_recoded_when_a_later_growth_does_not_fit():
    # 8-token blocks: the summaries grow by 256 blocks (2,048 tokens) at a time, so a 2,100-token prompt grows them
    # once while the first 256 blocks are held at the fine level; a bound between the two levels' bytes makes that
    # growth coarsen what is held.
    model = build_model("llama")
    ids, mask = left_padded([2100, 2060], seed=5)
    settings = dict(budget_tokens=64, block_tokens=8, sink_tokens=8, window_tokens=8, admission="auto")
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    cache, got, messages = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **settings)
    levels = cache.stats()["summary_levels"]
    assert [e["to"] for e in levels] == ["quantkey[tail_bits=2,tail_near=16.0]", "quantkey"]
    assert levels[0]["summary_bytes_before"] > 0 and levels[-1]["summary_bytes_after"] < levels[0]["summary_bytes_before"]
    assert got.shape == (2, ids.shape[1] + NEW_TOKENS)
    # Every held summary is the coarse level's encoding of the keys it summarises, within both levels' steps.
    for layer in cache.offload_layers:
        store = layer.blocks
        keys, _ = store.sealed_kv(store.n_blocks)  # [batch, kv_heads, n * T, head_dim]
        b, h, _, d = keys.shape
        keys = keys.view(b, h, store.n_blocks, 8, d).transpose(1, 2)
        s = store.summaries
        deq = dequantize_keys(s["codes"], s["kmin"], s["kstep"], 2)[..., :d]
        # fine step: (max - min) / 15; coarse step: (max - min) / 3 (of the dequantized keys, at most the keys' own)
        span = (keys.amax(dim=3) - keys.amin(dim=3))[:, :, :, None]
        assert ((deq - keys).abs() <= span / 6 + span / 30 + 1e-5).all()
    # It decodes on at the coarse level: the same tokens as a cache made at that level, refilled with these keys?
    # Not identical (blocks sealed before the switch were re-encoded from 4-bit codes); what must hold is that its
    # output continues the dense one's first token (prefill is exact whatever the summaries).
    dense = _generate(model, ids, mask, DynamicCache(config=model.config), new_tokens=1)
    assert torch.equal(got[:, : dense.shape[1]], dense)


def test_reset_goes_back_to_the_configured_level_and_copies_keep_the_coarse_one(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(budget_tokens=4096, admission="auto", **SMALL)
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    cache, _, _ = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **settings)
    follow, _ = left_padded([6, 6], seed=7)
    path = tmp_path / "coarse.safetensors"
    cache.save(path)
    copies = [__import__("copy").deepcopy(cache), OffloadCache.load(path, model)]
    for other in copies:
        assert other.selector == cache.selector and other.config.selector == "quantkey"
    # Each continues the same way as the cache itself.
    full_ids = torch.cat([_generate(model, ids, mask, DynamicCache(config=model.config)), follow], dim=1)
    full_mask = torch.cat([mask, torch.ones((2, full_ids.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
    outs = [_generate(model, full_ids, full_mask, c, new_tokens=3) for c in (cache, *copies)]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    cache.reset()
    assert cache.stats()["summary_levels"] == []
    assert cache.stats()["selector"] == "quantkey[bits=4,tail_bits=2,tail_near=16.0]"
    assert all(layer.selector is cache.selector for layer in cache.offload_layers)
    assert cache.config.selector == "quantkey[bits=4,tail_bits=2,tail_near=16]"
    with pytest.warns(RuntimeWarning, match="re-encoded from"):
        _generate(model, ids, mask, cache)  # and fills again, coarsening again under the same bound
    assert cache.stats()["selector"] == "quantkey"


def test_a_fork_of_a_coarsened_cache_reads_the_coarse_summaries():
    # A fork's device buffers count under its prefix's bound, so the coarsening is called directly here.
    model = build_model("qwen2")
    ids, mask = left_padded([45, 30], seed=4)
    cache = OffloadCache(model, budget_tokens=24, **dict(SMALL, pool_tokens=24))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    with pytest.warns(RuntimeWarning, match="re-encoded from"):
        assert cache._shared.coarsen_summaries()
    fork = cache.fork(batch=4)
    assert fork.selector == cache.selector and fork.selector is not cache.selector
    assert set(fork.offload_layers[0].blocks.summary_store) == set(cache.offload_layers[0].blocks.summary_store)
    step = torch.tensor([[5], [6]])
    step_mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        want = model(input_ids=step, attention_mask=step_mask, past_key_values=cache).logits
        got = model(input_ids=step.repeat_interleave(2, 0), attention_mask=step_mask.repeat_interleave(2, 0),
                    past_key_values=fork).logits  # fmt: skip
    torch.testing.assert_close(got, want.repeat_interleave(2, 0))


def test_a_fault_part_way_through_a_coarsening_leaves_each_layer_whole(monkeypatch):
    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    calls = []
    recode = QuantKeySelector.coarsen_summaries

    def failing(self, summaries, coarser, head_dim, n_blocks):
        calls.append(n_blocks)
        if len(calls) == 2:  # the second layer's re-encoding runs out of memory
            raise torch.OutOfMemoryError("injected")
        return recode(self, summaries, coarser, head_dim, n_blocks)

    monkeypatch.setattr(QuantKeySelector, "coarsen_summaries", failing)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        cache._shared.coarsen_summaries()
    first, second = cache.offload_layers
    assert first.selector.bits == 2 and second.selector.bits == 4  # each layer whole, at its own level
    for layer in (first, second):
        store = layer.blocks.summary_store
        assert store["codes"].shape[-1] * 8 // layer.selector.bits == store["kmin"].shape[-1]
        assert layer.planner.selector is layer.selector and layer.blocks.selector is layer.selector
    assert cache.stats()["summary_levels"] == []  # not reported as done
    monkeypatch.setattr(QuantKeySelector, "coarsen_summaries", recode)
    # It decodes on exactly (a budget covering the context), and the next coarsening completes the level.
    step = _continue(model, ids, mask, cache, expected)
    with pytest.warns(RuntimeWarning, match="re-encoded from"):
        assert cache._shared.coarsen_summaries()
    assert {layer.selector.bits for layer in cache.offload_layers} == {2} and cache.selector.bits == 2
    _continue(model, ids, mask, cache, expected, start=step)
    cache.reset()
    assert all(layer.selector is cache.selector for layer in cache.offload_layers)
    assert cache.stats()["selector"] == "quantkey[bits=4,tail_bits=2,tail_near=16.0]"
    assert torch.equal(_generate(model, ids, mask, cache), expected)


def _continue(model, ids, mask, cache, expected, start=0, steps=3):
    """Feed the dense output's next ``steps`` tokens one by one from position ``start`` after the prompt and check
    each step's greedy choice against it; returns the next start."""
    width = ids.shape[1]
    with torch.no_grad():
        for i in range(start, start + steps):
            token = expected[:, width + i : width + i + 1]
            step_mask = torch.cat([mask, torch.ones((2, i + 1), dtype=mask.dtype)], dim=1)
            position = step_mask.sum(-1, keepdim=True) - 1
            logits = model(input_ids=token, attention_mask=step_mask, position_ids=position,
                           past_key_values=cache).logits  # fmt: skip
            assert torch.equal(logits[:, -1].argmax(-1), expected[:, width + i + 1])
    return start + steps


def test_a_fork_that_outgrows_the_shared_bound_coarsens_itself_not_its_prefix():
    # A fork's device buffers count under its prefix's bound (they share the host pools); when the fork's summaries
    # must grow past it, the fork's own layers move to the coarser level and the prefix keeps its own.
    model = build_model("llama")
    ids, _ = left_padded([2030], seed=9)
    settings = dict(budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, admission="auto")
    probe = OffloadCache(model, **settings)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=probe)
    layers = probe.offload_layers
    summaries = sum(layer.blocks.device_summary_bytes() for layer in layers)  # 256 blocks per layer, fine level
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in layers)
    # The prefix and a fork of it at 256 blocks each, and a little more: not the fork's next 256 at the fine level.
    gib = (2 * buffers + 0.5 * summaries) / 2**30
    prefix = OffloadCache(model, device_memory_gib=gib, **settings)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=prefix)  # generate() then feeds the prompt's last token
    fork = prefix.fork()
    expected = _generate(model, ids, None, DynamicCache(config=model.config), new_tokens=40)
    with pytest.warns(RuntimeWarning, match="re-encoded from"):
        got = _generate(model, ids, None, fork, new_tokens=40)  # crosses 2,048 tokens: 256 sealed blocks
    assert torch.equal(got, expected)  # a budget covering the context: exact at any summary level
    assert fork.stats()["summary_levels"] and fork.selector.bits == 2
    assert prefix.stats()["summary_levels"] == [] and prefix.selector.bits == 4
    assert all(layer.selector is prefix.selector for layer in prefix.offload_layers)


@pytest.mark.triton
def test_coarsened_summaries_through_the_kernel_path():
    """The kernels read the re-encoded summaries (scoring, the estimate, the one-launch seal of plain quantkey): on
    CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``). A budget covering the context: exact."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model("llama").to(device)
    ids, mask = left_padded([45, 30], seed=4)
    ids, mask = ids.to(device), mask.to(device)
    settings = dict(budget_tokens=4096, admission="auto", transfer="kernel", cuda_graphs=False, **SMALL)
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache, got, messages = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **settings)
    assert torch.equal(got, expected) and len(messages) == 2 and cache.stats()["selector"] == "quantkey"
    for layer in cache.offload_layers:
        assert layer.execution.use_kernels and layer.blocks.seal_is_one_launch()  # plain quantkey: one launch
    # A sparse budget through the same path: the coarse level's scoring kernel selects, and decoding goes on.
    sparse, out, _ = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **dict(settings, budget_tokens=24,
                                                                                         pool_tokens=24))  # fmt: skip
    assert out.shape == expected.shape and sparse.stats()["selector"] == "quantkey"


def _bound_for_level(model, ids, mask, level: str, **settings) -> float:
    """A ``device_memory_gib`` that holds a cache's device buffers with ``level``'s summaries (a cache made at that
    level and filled without a bound), and no more."""
    probe = OffloadCache(model, selector=level, **settings)
    _generate(model, ids, mask, probe, new_tokens=2)
    return sum(layer.blocks.device_buffer_bytes() for layer in probe.offload_layers) / 2**30


@pytest.mark.parametrize("level", ["quantkey[bits=2,tail_bits=2,tail_near=16]", "quantkey"])
def test_a_load_into_a_bound_too_small_for_the_files_level_coarsens_as_it_loads(tmp_path, level):
    # A cache filled with no bound is saved at the default level and loaded under a bound that holds the device
    # buffers with `level`'s summaries: one level down or two. The load re-encodes the file's summaries as the
    # filling cache would have, and the loaded cache decodes exactly as the saved one does once coarsened in memory
    # to the same level.
    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(SMALL, budget_tokens=24, pool_tokens=24, admission="auto")  # sparse: the summaries choose
    gib = _bound_for_level(model, ids, mask, level, **settings)
    cache = OffloadCache(model, **settings)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              past_key_values=cache)  # fmt: skip
    path = tmp_path / "fine.safetensors"
    cache.save(path)
    with pytest.warns(RuntimeWarning, match="re-encoded from") as caught:
        loaded = OffloadCache.load(path, model, device_memory_gib=gib)
    levels = 2 if level == "quantkey" else 1
    assert len([w for w in caught if "re-encoded from" in str(w.message)]) == levels
    with pytest.warns(RuntimeWarning, match="re-encoded from"):
        for _ in range(levels):
            assert cache._shared.coarsen_summaries()
    assert loaded.selector == cache.selector == get_selector(level)
    assert loaded.config.selector == cache.config.selector
    for mine, theirs in zip(loaded.offload_layers, cache.offload_layers):
        assert mine.selector is loaded.selector
        assert set(mine.blocks.summaries) == set(theirs.blocks.summaries)
        for name, summary in theirs.blocks.summaries.items():
            assert torch.equal(mine.blocks.summaries[name], summary), name  # the same re-encoding, bit for bit
    admission = loaded.offload_layers[0].blocks.host.admission
    assert admission.cache_bytes() <= admission.limit_bytes
    step = torch.tensor([[5], [6]])
    step_mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
    position = mask.sum(-1, keepdim=True)
    with torch.no_grad():
        want = model(input_ids=step, attention_mask=step_mask, position_ids=position, past_key_values=cache).logits
        got = model(input_ids=step, attention_mask=step_mask, position_ids=position, past_key_values=loaded).logits
    torch.testing.assert_close(got, want)  # the same blocks attended (rounding apart: device or host blocks)
    loaded.reset()
    assert loaded.stats()["selector"] == "quantkey[bits=4,tail_bits=2,tail_near=16.0]"  # the file's level again


def test_a_load_that_cannot_fit_even_the_coarsest_summaries_raises_and_leaves_nothing(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(SMALL, budget_tokens=24, pool_tokens=24, admission="auto")
    gib = 0.9 * _bound_for_level(model, ids, mask, "quantkey", **settings)
    cache = OffloadCache(model, **settings)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    path = tmp_path / "fine.safetensors"
    cache.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(MemoryError, match="device_memory_gib=.*cannot hold"):
            OffloadCache.load(path, model, device_memory_gib=gib)


def test_cached_allocator_memory_is_given_back_before_a_coarsening(monkeypatch):
    """Before a growth re-encodes the summaries at a coarser level, the allocator's cached blocks are given back
    (``release_cached_memory``: ``torch.cuda.empty_cache`` on CUDA) and the room checked again; where that makes
    room, nothing is coarsened. Stood in on a CPU by a release that raises the bound."""
    from hf_offload.cache import blocks as blocks_module

    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(budget_tokens=4096, admission="auto", **SMALL)
    gib = _summary_free_bound(model, ids, mask, 0.6, **settings)
    calls = []

    def release(device):  # what the allocator's cached blocks would free: room for every summary
        calls.append(device)
        cache.offload_layers[0].blocks.host.admission.limit_bytes += 1 << 30
        return True

    monkeypatch.setattr(blocks_module, "release_cached_memory", release)
    cache = OffloadCache(model, device_memory_gib=gib, **settings)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    got = _generate(model, ids, mask, cache)
    assert torch.equal(got, expected)
    assert len(calls) == 1 and cache.stats()["summary_levels"] == []
    assert cache.stats()["selector"] == "quantkey[bits=4,tail_bits=2,tail_near=16.0]"
    # Without the release (a CPU: nothing to give back), the same bound coarsens.
    monkeypatch.setattr(blocks_module, "release_cached_memory", lambda device: False)
    coarsened, _, messages = _coarsened_generate(model, ids, mask, device_memory_gib=gib, **settings)
    assert coarsened.stats()["summary_levels"] and messages


def test_the_finer_summaries_are_given_back_before_a_second_level(monkeypatch):
    """A coarsening frees the finer level's buffers into the allocator's cache, which the room under a memory
    fraction excludes: they are given back before the room is judged again, so that a room one level fits stops at
    that level. Stood in on a CPU: what a coarsening frees takes room until the next release."""
    from hf_offload.cache import blocks as blocks_module
    from hf_offload.cache.shared import DeviceResources

    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=4)
    settings = dict(budget_tokens=4096, admission="auto", **SMALL)
    # Room for 0.95 of the default's summaries: level 1 (0.91 of them at this head size) fits, the configured level
    # does not, nor level 1 while what the coarsening freed still takes room.
    gib = _summary_free_bound(model, ids, mask, 0.95, **settings)
    cached, releases = [0], []
    coarsen = DeviceResources.coarsen_summaries

    def coarsen_and_cache(self):  # the finer buffers stay in the allocator's cache, taking room
        changed = coarsen(self)
        if changed:
            level = self.coarsenings[-1]
            cached[0] += level["summary_bytes_before"] - level["summary_bytes_after"]
            admission.limit_bytes -= level["summary_bytes_before"] - level["summary_bytes_after"]
        return changed

    def release(device):  # empty_cache: the cached bytes are room again
        releases.append(cached[0])
        admission.limit_bytes += cached[0]
        cached[0] = 0
        return True

    monkeypatch.setattr(DeviceResources, "coarsen_summaries", coarsen_and_cache)
    monkeypatch.setattr(blocks_module, "release_cached_memory", release)
    cache = OffloadCache(model, device_memory_gib=gib, **settings)
    admission = cache._shared.admission(torch.device("cpu"))
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _generate(model, ids, mask, cache)
    assert torch.equal(got, expected)
    levels = cache.stats()["summary_levels"]
    assert [level["to"] for level in levels] == ["quantkey[tail_bits=2,tail_near=16.0]"], levels
    assert releases[0] == 0 and any(releases[1:]), releases  # once before the coarsening, again after it
    # Without a release (what the cached bytes cost before), the same room goes down both levels.
    monkeypatch.setattr(blocks_module, "release_cached_memory", lambda device: False)
    coarsened = OffloadCache(model, device_memory_gib=gib, **settings)
    admission = coarsened._shared.admission(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _generate(model, ids, mask, coarsened)
    assert len(coarsened.stats()["summary_levels"]) == 2
