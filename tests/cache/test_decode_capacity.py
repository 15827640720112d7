"""Decode steps that score a block capacity (the sealed blocks rounded up to ``decode_capacity_blocks``, the blocks
past them masked) give the tokens of steps over the sealed blocks alone, on the CPU; the shared inputs, the buffers
that grow by whole chunks and the settings' errors."""

from __future__ import annotations

import random

import pytest
import torch

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.config import DEFAULT_SELECTOR
from hf_offload.attention import DecodeInputs
from hf_offload.selectors import QuantKeySelector, SoloHeadSelector, get_selector
from hf_offload.selectors.base import Selector, key_bound_logits

from ..helpers import TINY_BLOCKS, build_model, left_padded

SMALL = dict(TINY_BLOCKS, budget_tokens=64, window_tokens=16, prefill_chunk_tokens=64)


def _generate(model, ids, mask, steps, **options):
    cache = OffloadCache(model, **SMALL, **options)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out, cache


@pytest.mark.parametrize("selector", ["quantkey", DEFAULT_SELECTOR, "quantkey[tail_bits=2]", "solohead", "headwise",
                                      "meanbound", "meanvar", "union", "oracle"])  # fmt: skip
def test_capacity_steps_give_the_tokens_of_sealed_block_steps(selector, monkeypatch):
    from hf_offload.cache import execution

    model = build_model("llama")
    ids, mask = left_padded([150, 97], seed=4)  # sequence 1: 53 tokens of padding, six whole blocks of it
    steps = 40  # 150 + 40 tokens: 18 to 23 sealed blocks, 7 of them selected
    expected, plain = _generate(model, ids, mask, steps, selector=selector, decode_capacity_blocks=1)
    # 8: the capacity grows from 24 to 32 blocks during the run; 64: one capacity; None: the default's rule scaled
    # down (multiples of 2, or of a quarter of the sealed blocks rounded down to a power of two): from 20 to 24.
    monkeypatch.setattr(execution, "GRAPH_CAPACITY_BLOCKS", 2)
    monkeypatch.setattr(execution, "GRAPH_CAPACITY_SHARE", 4)
    for capacity in (8, 64, None):
        got, cache = _generate(model, ids, mask, steps, selector=selector, decode_capacity_blocks=capacity)
        layer = cache.offload_layers[0]
        assert layer.execution.capacity_blocks == (capacity or 2)
        last_n = layer.n_blocks - (1 if layer.keys.shape[-2] == 0 else 0)  # sealed blocks before the last step
        want = execution.decode_capacity(last_n, 0, capacity or 2, 0 if capacity else 4)
        assert layer.resources.decode_inputs(layer.device).capacity == want
        assert capacity or want == -(-last_n // 4) * 4  # 17 to 31 sealed blocks: steps of 4
        assert torch.equal(got.sequences, expected.sequences), capacity
        for a, b in zip(got.scores, expected.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        if selector == "union":
            # Its per-head picks join the forced blocks at +inf; top-k orders such ties by the scored length, so the
            # same blocks can come in another order and fill the slot pool's LRU order differently (other counts).
            continue
        a, b = plain.stats(), cache.stats()
        for name in ("recalled_blocks", "decode_recalled_blocks", "hit_rate", "decode_steps"):
            assert a[name] == b[name], (capacity, name)


def test_selection_never_takes_blocks_past_the_sealed_ones():
    torch.manual_seed(0)
    selector = get_selector(DEFAULT_SELECTOR)
    batch, heads, group, dim, T, n, capacity, k = 2, 2, 3, 16, 8, 11, 32, 4
    keys = torch.randn(batch, n, heads, T, dim)
    summaries = selector.summarize(keys)
    summaries.update(selector.summarize_values(torch.randn(batch, n, heads, T, dim)))
    padded = {name: torch.cat([s, s.new_zeros((batch, capacity - n, *s.shape[2:]))], 1) for name, s in summaries.items()}
    query = torch.randn(batch, heads, group, dim)
    valid = torch.ones(batch, n, dtype=torch.bool)
    valid[1, :3] = False  # padding-only blocks
    forced = torch.zeros(batch, n, dtype=torch.bool)
    forced[:, -2:] = True
    wide_valid = torch.cat([valid, torch.zeros(batch, capacity - n, dtype=torch.bool)], 1)
    wide_forced = torch.cat([forced, torch.zeros(batch, capacity - n, dtype=torch.bool)], 1)
    plain = selector.select(query, summaries, 0.25, k, forced, valid)
    wide = selector.select(query, padded, 0.25, k, wide_forced, wide_valid)
    # The same blocks (forced ones tie at +inf, so their order may differ).
    assert torch.equal(wide.blocks.sort(-1).values, plain.blocks.sort(-1).values) 
    assert wide.keep.all() and plain.keep.all()
    torch.testing.assert_close(wide.scores[..., :n], plain.scores)
    assert (wide.scores[..., n:] == float("-inf")).all()
    assert (wide.blocks[wide.keep] < n).all()
    # Invalid blocks take no share of a head's softmax: the masses of valid blocks sum to the number of heads.
    mass = wide.scores.masked_fill(wide.scores.isinf(), 0).sum(-1)
    plain_mass = plain.scores.masked_fill(plain.scores.isinf(), 0).sum(-1)
    torch.testing.assert_close(mass, plain_mass)


def test_decode_inputs_with_a_capacity():
    T, n, batch, capacity, sink, window = 4, 6, 2, 16, 1, 2
    padding = torch.ones((batch, 40), dtype=torch.bool)
    padding[1, :9] = False
    inputs = DecodeInputs()
    for pad in (None, padding, None):
        inputs.update(batch, n, T, n * T, 3, pad, sink, window, torch.device("cpu"), object(), capacity=capacity)
        assert inputs.rows.shape == (batch, capacity + 2, T) and inputs.open_row == capacity
        assert not inputs.rows[:, n:capacity].any() and not inputs.rows[:, capacity + 1].any()
        assert inputs.rows[:, capacity, :3].all() and not inputs.rows[:, capacity, 3:].any()
        assert not inputs.valid[:, n:].any() and not inputs.forced[:, n:].any()
        assert inputs.forced[:, n - window : n].all()  # the window ends at the last sealed block
    ptr = inputs.rows.data_ptr()
    inputs.update(batch, n + 1, T, (n + 1) * T, 1, None, sink, window, torch.device("cpu"), object(), capacity=capacity)
    assert inputs.rows.data_ptr() == ptr  # one more sealed block, same capacity: filled in place
    assert inputs.rows[:, n].all() and inputs.valid[:, n].all() and inputs.forced[:, n].all()
    assert not inputs.forced[:, n - 2].any()  # left the window
    with pytest.raises(ValueError, match="capacity 3 is below the 7 sealed blocks"):
        inputs.update(batch, 7, T, 28, 1, None, sink, window, torch.device("cpu"), object(), capacity=3)


def test_buffers_grow_by_capacity_and_hold_zeros_past_the_sealed_blocks():
    model = build_model("llama")
    ids = torch.randint(3, 90, (2, 150))
    cache = OffloadCache(model, **SMALL, decode_capacity_blocks=300)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    layer = cache.offload_layers[0]
    n = layer.n_blocks
    views = layer.blocks.summary_views(300)
    assert all(v.shape[1] == 300 for v in views.values())
    assert all(store.shape[1] == 512 for store in layer.blocks.summary_store.values())  # whole chunks of 256 blocks
    assert all(not v[:, n:].any() for v in views.values())
    assert all(torch.equal(layer.blocks.summaries[name], views[name][:, :n]) for name in views)


def test_capacity_settings_are_checked():
    with pytest.raises(ValueError, match="decode_capacity_blocks must be a positive integer"):
        OffloadConfig(decode_capacity_blocks=0)
    with pytest.raises(ValueError, match="decode_capacity_blocks must be a positive integer"):
        OffloadConfig(decode_capacity_blocks=True)
    model = build_model("llama")

    class OwnScore(SoloHeadSelector):
        name = "own_score"

        def score(self, query, summaries, scaling):
            return super().score(query, summaries, scaling) * 2

    class OwnLse(QuantKeySelector):
        name = "own_lse"

    class Plain(Selector):  # scores normalised over every block, no masked_score()
        name = "plain"

        def score(self, query, summaries, scaling):
            return torch.softmax(key_bound_logits(query, summaries["kmin"], summaries["kmax"]), -1).sum((1, 2))[:, None]

    with pytest.raises(ValueError, match="selector 'plain' does not support"):
        OffloadCache(model, selector=Plain(), decode_capacity_blocks=16)
    OffloadCache(model, selector=Plain(), decode_capacity_blocks=1)  # the sealed blocks: any selector
    assert SoloHeadSelector().masks_invalid and not OwnScore().masks_invalid and not Plain().masks_invalid
    assert OwnLse().masks_invalid and get_selector("headwise").masks_invalid
    assert all(get_selector(name).masks_invalid for name in ("meanbound", "meanvar", "union", "oracle", "streaming"))
    # None: 64 for a selector that masks the blocks past the sealed ones, with graphs or without (here: the CPU, no
    # graphs), so that a step's sums do not depend on whether it was replayed; 1 for one that does not.
    for selector, capacity in ((None, 64), (Plain(), 1)):
        options = {} if selector is None else {"selector": selector}
        cache = OffloadCache(model, **SMALL, **options)
        with torch.no_grad():
            model(input_ids=torch.randint(3, 90, (1, 40)), past_key_values=cache)
        assert [layer.execution.capacity_blocks for layer in cache.offload_layers] == [capacity] * len(cache.offload_layers)


def test_chunk_tables_fill_in_place_while_the_pool_grows():
    from hf_offload.store import DeviceAdmission, HostBlockPool, HostMemoryBudget

    block = (2, 2, 4, 8)
    nbytes = torch.Size(block).numel() * 4
    admission = DeviceAdmission(torch.device("cpu"), limit_bytes=2 * 2 * nbytes)  # the first two chunks admitted
    pool = HostBlockPool(block, torch.float32, False, 2 * nbytes, HostMemoryBudget(None), admission=admission)
    pool.allocate(3)  # two chunks
    addrs, on_host = pool.chunk_tables(torch.device("cpu"))
    version, ptr = pool.table_version, on_host.data_ptr()
    assert len(addrs) == 2 and len(on_host) == 65  # room for 64 chunks, and the entry of the id -1
    ids = pool.allocate(6)  # three more chunks, in host memory
    addrs, on_host = pool.chunk_tables(torch.device("cpu"))
    assert pool.table_version == version and on_host.data_ptr() == ptr  # filled in place
    assert addrs.tolist() == [c.data_ptr() for c in pool.chunks]
    assert on_host[:5].tolist() == [False, False, True, True, True] and not on_host[5:].any()
    assert pool.count_on_host(torch.cat([ids, torch.tensor([-1, 0])])) == 5  # ids 3..8: 5 on the host; -1, 0 not
    pool.allocate(2 * 64)  # past the tables' room: new tables, a new version
    addrs, _ = pool.chunk_tables(torch.device("cpu"))
    assert pool.table_version == version + 1 and len(addrs) == len(pool.chunks)


def test_demotion_order_is_the_same_in_every_run():
    """Stores with as many admitted chunks give theirs back last registered first, whatever their addresses: the
    same chunks move to host memory in every run, so the host reads that follow are the same too."""
    from hf_offload.store import DeviceAdmission

    class Store:
        def __init__(self, chunks):
            self.chunks = chunks

        def admitted_chunks(self):
            return self.chunks

        def demote_chunk(self):
            self.chunks -= 1
            return True

        def device_buffer_bytes(self):
            return 0

    for trial in range(4):
        admission = DeviceAdmission(torch.device("cpu"), limit_bytes=1 << 20)
        stores = [Store(2) for _ in range(5)]
        order = list(range(5))
        random.Random(trial).shuffle(order)  # objects created in one order, registered in another
        for i in order:
            admission.register(stores[i])
        admission.register(stores[order[0]])  # registering again keeps the first number
        demoted = []
        for _ in range(7):
            first = admission._newest_first()[0]
            first.demote_chunk()
            demoted.append(stores.index(first))
        assert demoted == [order[4], order[3], order[2], order[1], order[0], order[4], order[3]], (trial, demoted)


def test_the_default_capacity_grows_with_the_context():
    """``decode_capacity_blocks=None`` rounds to 64 blocks, or to a sixteenth of the sealed blocks (a power of two)
    where that is more: never below the sealed blocks, at most 1/16 (or 63 blocks) above them, never smaller for more
    sealed blocks, and one capacity over as many seals as its step; a set value keeps its fixed step."""
    from hf_offload.cache.execution import GRAPH_CAPACITY_BLOCKS, GRAPH_CAPACITY_SHARE, decode_capacity

    previous = 0
    for n in range(1, 40000):
        c = decode_capacity(n, 0, GRAPH_CAPACITY_BLOCKS, GRAPH_CAPACITY_SHARE)
        assert n <= c <= max(n + GRAPH_CAPACITY_BLOCKS - 1, n + n // GRAPH_CAPACITY_SHARE) and c >= previous, n
        previous = c
    assert decode_capacity(4097, 0, 64, 16) == 4352  # 64K tokens in 16-token blocks, one seal on: 256-block steps
    assert decode_capacity(8193, 0, 64, 16) == 8704
    assert decode_capacity(1000, 0, 64, 16) == 1024
    assert decode_capacity(4097, 0, 64) == 4160  # no share: the fixed step
    assert decode_capacity(4097, 5000, 64, 16) == 4097  # every block selected: the sealed ones
    model = build_model("llama")
    ids, mask = left_padded([40, 30], seed=1)
    for options, share in (({}, GRAPH_CAPACITY_SHARE), ({"decode_capacity_blocks": 64}, 0)):
        execution = _generate(model, ids, mask, 2, **options)[1].offload_layers[0].execution
        assert (execution.capacity_blocks, execution.capacity_share) == (GRAPH_CAPACITY_BLOCKS, share)
