"""Layer-ahead lookahead: it only moves data early (identical tokens), its prefetches are used, it is bounded, and
the slot pools never serve stale data.

On the CPU the speculative plan and its recall run synchronously (no side stream); under ``TRITON_INTERPRET=1``
the copy-kernel path runs as well.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.attention import offload_attention_forward, take_handoff
from hf_offload.kernels.gather import kernels_available

from ..helpers import TINY_BLOCKS as SMALL
from ..helpers import _common, left_padded

TRANSFERS = ["torch"] + (["kernel"] if kernels_available(torch.device("cpu")) else [])
B, HQ, H, D, T = 2, 4, 2, 16, 8


def _llama(layers: int = 4, correlated: bool = False, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny random Llama with ``layers`` layers, float32, CPU.

    ``correlated``: every layer gets layer 0's weights and the embeddings dominate the residual stream, so a layer's
    query and keys resemble the next layer's (the premise of lookahead, which random layers lack).
    """
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common(num_hidden_layers=layers))).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        if correlated:
            model.model.embed_tokens.weight.mul_(20)
            for layer in model.model.layers[1:]:
                layer.load_state_dict(model.model.layers[0].state_dict())
    return model


def _generate(model, cache, new_tokens=16, lengths=(150, 120), seed=8):
    ids, mask = left_padded(list(lengths), seed=seed)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              do_sample=False)  # fmt: skip


def _exact_misses(stats: dict) -> int:
    """Blocks the exact plans recalled themselves (decode recalls minus prefetches)."""
    return stats["decode_recalled_blocks"] - stats["prefetched_blocks"]


# --------------------------------------------------------------------------------------------------------- config
def test_config_validates_lookahead():
    assert OffloadConfig().lookahead is False and OffloadConfig().lookahead_blocks is None
    for bad in (1, "yes", 0.5):
        with pytest.raises(ValueError, match="lookahead must be True, False or None"):
            OffloadConfig(lookahead=bad)
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="lookahead_blocks must be a non-negative integer"):
            OffloadConfig(lookahead_blocks=bad)
    assert OffloadConfig(lookahead=True, lookahead_blocks=0).lookahead_blocks == 0


def test_default_is_off_without_cuda_kernels():
    model = _llama(2)
    cache = OffloadCache(model, budget_tokens=48, **SMALL)
    _generate(model, cache, new_tokens=3)
    assert not any(layer.execution.lookahead for layer in cache.offload_layers)
    assert cache.stats()["prefetched_blocks"] == 0
    assert [layer.recaller.next for layer in cache.offload_layers] == [cache.layers[1].recaller, None]


# ---------------------------------------------------------------------------------------------- generate() level
@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("selector", ["solohead", "headwise", "oracle"])
def test_tokens_identical_with_and_without_lookahead(transfer, selector):
    model = _llama(4)
    runs = {}
    for lookahead in (False, True):
        cache = OffloadCache(model, budget_tokens=48, selector=selector, transfer=transfer, lookahead=lookahead,
                             **SMALL)  # fmt: skip
        runs[lookahead] = (_generate(model, cache), cache.stats())
    assert torch.equal(runs[False][0], runs[True][0])
    off, on = runs[False][1], runs[True][1]
    assert off["prefetched_blocks"] == off["prefetch_used_blocks"] == 0
    assert on["prefetched_blocks"] > 0 and 0 < on["prefetch_used_blocks"] <= on["prefetched_blocks"]
    # The first offloaded layer has no layer before it in the step: nothing is prefetched for it.
    assert on["layers"][0]["prefetched_blocks"] == 0
    assert on["decode_steps"] == off["decode_steps"]


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_prefetch_raises_hit_rate_when_layers_agree(transfer):
    model = _llama(4, correlated=True)
    runs = {}
    for lookahead in (False, True):
        cache = OffloadCache(model, budget_tokens=48, transfer=transfer, lookahead=lookahead, **SMALL)
        runs[lookahead] = (_generate(model, cache, new_tokens=20), cache.stats())
    assert torch.equal(runs[False][0], runs[True][0])
    off, on = runs[False][1], runs[True][1]
    assert on["hit_rate"] > off["hit_rate"] + 0.05
    assert _exact_misses(on) < 0.7 * _exact_misses(off)
    assert on["prefetch_used_blocks"] > 0.5 * on["prefetched_blocks"]
    for idx in (1, 2, 3):  # every layer that is prefetched for gains
        assert on["layers"][idx]["hit_rate"] > off["layers"][idx]["hit_rate"]


def test_lookahead_blocks_bounds_the_speculative_recall():
    model = _llama(3)
    runs = {}
    for limit in (None, 2, 0):
        cache = OffloadCache(model, budget_tokens=64, lookahead=True, lookahead_blocks=limit, **SMALL)
        runs[limit] = (_generate(model, cache, new_tokens=10), cache.stats())
    assert torch.equal(runs[None][0], runs[2][0]) and torch.equal(runs[None][0], runs[0][0])
    steps = runs[None][1]["decode_steps"]
    forced = 1 + 1  # sink and window blocks, always part of the speculative plan
    for limit in (2, 0):
        for idx in (1, 2):
            # At most (limit + forced) blocks per sequence and step are prefetched for each layer.
            assert runs[limit][1]["layers"][idx]["prefetched_blocks"] <= steps * B * (limit + forced)
    assert runs[0][1]["prefetched_blocks"] < runs[2][1]["prefetched_blocks"] < runs[None][1]["prefetched_blocks"]


def test_timing_counts_prefetch_as_its_own_phase():
    model = _llama(3)
    cache = OffloadCache(model, budget_tokens=48, lookahead=True, timing=True, **SMALL)
    _generate(model, cache, new_tokens=6)
    timing = cache.stats()["timing"]
    assert timing["timed_steps"] == 4
    for phase in ("select_ms", "prefetch_ms", "recall_ms", "attention_ms", "step_ms"):
        assert timing[phase] > 0
    phases = sum(timing[f"{p}_ms"] for p in ("select", "prefetch", "recall", "attention"))
    assert timing["rest_ms"] == pytest.approx(timing["step_ms"] - phases)
    # reset_stats forgets the timing too; set_lookahead switches the next steps.
    cache.reset_stats()
    assert cache.stats()["timing"] == {}
    cache.set_lookahead(False)
    assert not any(layer.execution.lookahead for layer in cache.offload_layers) and cache.config.lookahead is False
    cache.set_lookahead(True)
    assert all(layer.execution.lookahead for layer in cache.offload_layers)


# ------------------------------------------------------------------------------------------------- layer level
def _two_layers(**config):
    cache = OffloadCache(_llama(2), lookahead=True, block_tokens=T, **config)
    return cache, cache.layers[0], cache.layers[1]


def _step(layers, keys, values, queries):
    """One forward through ``layers``: update then attention, as the model runs them (lookahead included)."""
    for layer, k, v, q in zip(layers, keys, values, queries):
        layer.update(k, v)
        offload_attention_forward(take_handoff(), q, None)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_prefetch_covers_every_miss_when_the_guess_is_right(transfer):
    """Both layers hold the same KV and get the same query: the speculative plan is the exact plan, so layer 1's
    exact plans find every block resident and use every prefetched block."""
    cache, first, second = _two_layers(budget_tokens=6 * T, sink_tokens=T, window_tokens=T, pool_tokens=8 * T,
                                       transfer=transfer)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    for step, q_len in enumerate([60] + [1] * 20):
        k, v = torch.randn(B, H, q_len, D, generator=g), torch.randn(B, H, q_len, D, generator=g)
        q = torch.randn(B, HQ, q_len, D, generator=g)
        if step == 1:
            cache.reset_stats()  # decode steps only
        _step([first, second], [k, k], [v, v], [q, q])
    s0, s1 = first.stats, second.stats
    assert int(s0.lookups) == int(s1.lookups) > 0
    assert int(s1.hits) == int(s1.lookups)  # no exact miss left on the prefetched layer
    assert int(s0.hits) < int(s0.lookups)  # while the first layer (never prefetched for) misses
    assert int(s1.prefetched_blocks) == int(s1.prefetch_used_blocks) > 0
    assert int(s1.decode_recalled_blocks) == int(s1.prefetched_blocks)


def test_speculative_plan_never_evicts_sink_or_window():
    """A wrong guess with a pool barely larger than the budget: the next layer's sink and window stay resident."""
    cache, first, second = _two_layers(budget_tokens=5 * T, sink_tokens=T, window_tokens=2 * T, pool_tokens=6 * T)
    g = torch.Generator().manual_seed(5)
    for q_len in [70] + [1] * 12:
        k, v = torch.randn(B, H, q_len, D, generator=g), torch.randn(B, H, q_len, D, generator=g)
        first.update(k, v)
        offload_attention_forward(take_handoff(), torch.randn(B, HQ, q_len, D, generator=g), None)
        if q_len == 1:  # the speculative plan for the second layer has run; its forced blocks must be resident
            n = second.n_blocks
            held = second.blocks.pool.block[:, 0]
            for block in [0, *range(n - 2, n)]:
                assert bool((held == block).any(-1).all()), (block, held)
        second.update(torch.randn(B, H, q_len, D, generator=g), torch.randn(B, H, q_len, D, generator=g))
        offload_attention_forward(take_handoff(), torch.randn(B, HQ, q_len, D, generator=g), None)
    assert int(second.stats.prefetched_blocks) > 0


def _assert_slots_fresh(layer, dense_k, dense_v):
    """Each (sequence, head, slot) holds exactly the bytes of the block it claims to hold."""
    pool = layer.blocks.pool
    for b, h, s in (pool.block >= 0).nonzero().tolist():
        j = pool.block[b, h, s].item()
        assert torch.equal(pool.data[0, b, h, s], dense_k[b, h, j * T : (j + 1) * T]), (layer.layer_idx, b, h, j)
        assert torch.equal(pool.data[1, b, h, s], dense_v[b, h, j * T : (j + 1) * T]), (layer.layer_idx, b, h, j)


@pytest.mark.parametrize("transfer", TRANSFERS)
@pytest.mark.parametrize("selector", ["solohead", "headwise"])
@pytest.mark.parametrize("budget_tokens,pool_tokens", [(4 * T, 5 * T), (4 * T, T), (10_000, 2 * T)])
def test_slots_never_stale_with_lookahead(transfer, selector, budget_tokens, pool_tokens):
    """Fresh random contents at every step (and again after a reset that reuses every block id): with prefetches
    landing in the slot pools between the layers' own plans, every slot equals its block and the host pools equal
    every key and value ever given."""
    sink = T if budget_tokens >= 3 * T else 0
    cache, first, second = _two_layers(budget_tokens=budget_tokens, sink_tokens=sink, window_tokens=T,
                                       pool_tokens=pool_tokens, selector=selector, transfer=transfer)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for turn in range(2):
        given = {0: ([], []), 1: ([], [])}
        for q_len in [13, 1, 1, 30, 1, 7] + [1] * 12:
            keys = [torch.randn(B, H, q_len, D, generator=g) for _ in range(2)]
            values = [torch.randn(B, H, q_len, D, generator=g) for _ in range(2)]
            queries = [torch.randn(B, HQ, q_len, D, generator=g) for _ in range(2)]
            for idx in (0, 1):
                given[idx][0].append(keys[idx])
                given[idx][1].append(values[idx])
            first.update(keys[0], values[0])
            offload_attention_forward(take_handoff(), queries[0], None)
            # The second layer's slots (prefetched into just now) are checked before its own plan runs, too.
            for layer in (first, second):
                if layer.is_initialized:
                    dense_k, dense_v = layer.dense_kv()
                    _assert_slots_fresh(layer, dense_k, dense_v)
            second.update(keys[1], values[1])
            offload_attention_forward(take_handoff(), queries[1], None)
            for idx, layer in enumerate((first, second)):
                dense_k, dense_v = layer.dense_kv()
                assert torch.equal(dense_k, torch.cat(given[idx][0], dim=-2))
                assert torch.equal(dense_v, torch.cat(given[idx][1], dim=-2))
                _assert_slots_fresh(layer, dense_k, dense_v)
        if budget_tokens < 10_000 and pool_tokens > T:
            assert int(second.stats.prefetched_blocks) > 0
        cache.reset()  # the next turn reuses every host block id and slot with new contents
