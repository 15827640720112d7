"""OffloadCache.fork: a prefix prefilled once and continued by many requests, in one batch or in later calls, shares
its sealed host blocks instead of copying them; no fork's edit reaches the prefix."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache

from ..helpers import TINY_PREFILL, TINY_SPARSE, build_model, left_padded

FULL = dict(TINY_PREFILL, budget_tokens=4096)
SPARSE = dict(TINY_SPARSE, pool_tokens=16)
DOCUMENT, QUESTION, NEW = 61, 5, 10  # tokens: the shared prefix (not a multiple of the block), each question, answers


def _prefix(model, settings, rows=1, seed=0):
    """A cache prefilled with a document (``rows`` of them); with its ids."""
    ids, mask = left_padded([DOCUMENT] * rows, seed=seed)
    cache = OffloadCache(model, **settings)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    return cache, ids


def _answer(model, cache, document, questions):
    """Greedy answers to ``questions`` (``[n, QUESTION]``) after ``document`` (``[1 or n, DOCUMENT]``), with a cache
    that holds the document (or nothing)."""
    ids = torch.cat([document.expand(len(questions), -1), questions], dim=1)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                              max_new_tokens=NEW, do_sample=False)  # fmt: skip


def _questions(n, seed):
    return left_padded([QUESTION] * n, seed=seed)[0]


def _kv(cache):
    return [cache.dense_kv(layer.layer_idx) for layer in cache.offload_layers]


def test_forked_answers_match_each_questions_own_prefill(arch):
    model = build_model(arch)
    prefix, document = _prefix(model, FULL)
    kv_before = _kv(prefix)
    for seed in (1, 2):  # two later calls on the same prefix, three questions each in one batch
        questions = _questions(3, seed)
        expected = _answer(model, DynamicCache(config=model.config), document, questions)
        assert torch.equal(_answer(model, prefix.fork(batch=3), document, questions), expected)
    for (keys, values), (now_k, now_v) in zip(kv_before, _kv(prefix)):  # the prefix did not move
        assert torch.equal(keys, now_k) and torch.equal(values, now_v)
    assert prefix.get_seq_length() == DOCUMENT


def test_forks_at_a_sparse_budget_continue_like_copies():
    model = build_model("llama")
    prefix, document = _prefix(model, SPARSE)
    questions = _questions(3, seed=1)
    copies = copy.deepcopy(prefix)
    copies.batch_repeat_interleave(3)
    fork = prefix.fork(batch=3)
    assert torch.equal(_answer(model, fork, document, questions), _answer(model, copies, document, questions))
    assert fork.stats()["tail_share"] == copies.stats()["tail_share"]


def test_forks_share_the_prefix_host_bytes():
    model = build_model("llama")
    prefix, document = _prefix(model, FULL)
    prefix_bytes = prefix.stats()["host_kv_bytes"]
    n = 4
    fork = prefix.fork(batch=n)
    stats = fork.stats()
    assert stats["host_kv_bytes"] == prefix_bytes  # n sequences refer to one copy of the prefix's blocks
    assert stats["host_shared_bytes"] == prefix_bytes == prefix.stats()["host_shared_bytes"]
    _answer(model, fork, document, _questions(n, seed=1))
    # What the forks sealed after the prefix is theirs; the prefix's blocks stay shared.
    own = sum(n * (f.n_blocks - p.n_blocks) * f.blocks.host.block_bytes
              for f, p in zip(fork.offload_layers, prefix.offload_layers))  # fmt: skip
    assert own > 0
    assert fork.stats()["host_kv_bytes"] == prefix_bytes + own < n * prefix_bytes  # copies: n x (prefix + own / n)
    assert fork.stats()["host_shared_bytes"] == prefix_bytes
    # Dropping the forks gives their blocks back to the shared pools.
    del fork
    gc.collect()
    assert prefix.stats()["host_kv_bytes"] == prefix_bytes
    assert prefix.stats()["host_shared_bytes"] == 0


def test_a_prefix_with_several_documents_forks_each(arch):
    model = build_model(arch)
    prefix, documents = _prefix(model, FULL, rows=2, seed=3)
    questions = _questions(4, seed=4)
    rows = documents.repeat_interleave(2, dim=0)  # [a, a, b, b]
    expected = _answer(model, DynamicCache(config=model.config), rows, questions)
    assert torch.equal(_answer(model, prefix.fork(batch=4), rows, questions), expected)


@pytest.mark.parametrize("batch", [2, 4], ids=["own_rows", "repeated_rows"])
def test_a_prefix_with_several_documents_refills_its_fork(batch):
    """fork(batch, into=...) of a two-document prefix: each document's rows (its own rows in order, or each
    repeated) get the answers of a new fork, question after question, and the pool holds the prefix again after."""
    model = build_model("llama")
    prefix, documents = _prefix(model, SPARSE, rows=2, seed=3)
    host = prefix.offload_layers[0].blocks.host
    prefix_blocks = host.used_blocks
    rows = documents.repeat_interleave(batch // 2, dim=0)
    cache = prefix.fork(batch=batch)
    for seed in (4, 5):
        questions = _questions(batch, seed=seed)
        expected = _answer(model, prefix.fork(batch=batch), rows, questions)
        assert prefix.fork(batch=batch, into=cache) is cache
        assert torch.equal(_answer(model, cache, rows, questions), expected)
        gc.collect()
    prefix.fork(batch=batch, into=cache)
    del expected
    gc.collect()
    assert host.used_blocks == prefix_blocks


def test_fork_edits_never_reach_the_prefix():
    model = build_model("llama")
    prefix, document = _prefix(model, FULL)
    kv_before = _kv(prefix)
    fork = prefix.fork(batch=2)
    _answer(model, fork, document, _questions(2, seed=1))
    fork.crop(-(QUESTION + NEW + 11))  # back into the prefix's sealed blocks: the open block is read back
    fork.batch_select_indices(torch.tensor([1]))
    fork.reset()
    for (keys, values), (now_k, now_v) in zip(kv_before, _kv(prefix)):
        assert torch.equal(keys, now_k) and torch.equal(values, now_v)
    questions = _questions(2, seed=5)
    expected = _answer(model, DynamicCache(config=model.config), document, questions)
    assert torch.equal(_answer(model, prefix, document.expand(2, -1)[:1], questions[:1]), expected[:1])


def test_a_loaded_document_serves_many_questions(tmp_path):
    model = build_model("llama")
    prefix, document = _prefix(model, FULL)
    path = tmp_path / "document.safetensors"
    prefix.save(path)
    del prefix
    loaded = OffloadCache.load(path, model)
    questions = _questions(3, seed=1)
    expected = _answer(model, DynamicCache(config=model.config), document, questions)
    assert torch.equal(_answer(model, loaded.fork(batch=3), document, questions), expected)
    fork = loaded.fork(batch=2)
    fork.save(tmp_path / "fork.safetensors")  # a fork saves like any cache (the shared blocks it refers to)
    again = OffloadCache.load(tmp_path / "fork.safetensors", model)
    assert again.stats()["host_kv_bytes"] == loaded.stats()["host_kv_bytes"]
    assert torch.equal(_answer(model, again, document, questions[:2]), expected[:2])


def test_fork_refuses_what_it_cannot_do():
    model = build_model("llama")
    with pytest.raises(ValueError, match="holds none yet: prefill the prefix first"):
        OffloadCache(model, **FULL).fork(batch=2)
    prefix, _ = _prefix(model, FULL, rows=2)
    for batch in (3, 0, 1.5):
        with pytest.raises(ValueError, match=r"positive multiple of the cache's batch \(2\)"):
            prefix.fork(batch=batch)
    assert prefix.fork().offload_layers[0].blocks.batch == 2


@pytest.mark.parametrize("settings", [FULL, SPARSE], ids=["full", "sparse"])
def test_a_fork_refilled_for_the_next_questions_answers_as_a_new_fork(arch, settings):
    """fork(into=cache) drops the fork's tokens and holds the prefix again in the fork's own buffers: the next
    questions get the answers of a new fork (and, at a budget that covers the context, DynamicCache's); blocks only
    the fork held go back to the pool, the prefix does not move, the counters start at zero."""
    model = build_model(arch)
    prefix, document = _prefix(model, settings)
    kv_before = _kv(prefix)
    host = prefix.offload_layers[0].blocks.host
    prefix_blocks = host.used_blocks
    cache = prefix.fork(batch=3)
    buffers = [layer.blocks.summary_store for layer in cache.offload_layers]
    for seed in (1, 2, 3):
        questions = _questions(3, seed)
        expected = _answer(model, prefix.fork(batch=3), document, questions)
        if settings is FULL:
            assert torch.equal(expected, _answer(model, DynamicCache(config=model.config), document, questions))
        reused = prefix.fork(batch=3, into=cache)
        assert reused is cache and cache.get_seq_length() == DOCUMENT
        assert cache.stats()["decode_steps"] == 0  # counters start at zero
        assert torch.equal(_answer(model, cache, document, questions), expected)
        gc.collect()
    for layer, stores in zip(cache.offload_layers, buffers):  # the same buffers (the prefix grew nothing)
        assert all(layer.blocks.summary_store[name] is store for name, store in stores.items())
    for (keys, values), (now_k, now_v) in zip(kv_before, _kv(prefix)):
        assert torch.equal(keys, now_k) and torch.equal(values, now_v)
    # Blocks the last answers sealed stay with the fork; refilled once more, only the prefix's are held.
    prefix.fork(batch=3, into=cache)
    del expected
    gc.collect()
    assert host.used_blocks == prefix_blocks


def test_fork_into_refuses_what_is_not_its_fork():
    model = build_model("llama")
    prefix, _ = _prefix(model, FULL)
    other, _ = _prefix(model, FULL, seed=5)
    with pytest.raises(ValueError, match="that cache is not one"):
        prefix.fork(into=other.fork())
    fork = prefix.fork()
    for not_its_fork in (fork.fork(), copy.deepcopy(fork)):  # a fork of a fork, a copy: not forks of the prefix
        with pytest.raises(ValueError, match="that cache is not one"):
            prefix.fork(into=not_its_fork)
    with pytest.raises(ValueError, match="that cache is not one"):
        fork.fork(into=prefix)  # the prefix is not a fork of its fork: it keeps its tokens
    assert prefix.get_seq_length() == DOCUMENT
    with pytest.raises(ValueError, match="takes an earlier fork of this cache"):
        prefix.fork(into=prefix)
    with pytest.raises(ValueError, match="takes an earlier fork of this cache"):
        prefix.fork(into=DynamicCache())
    with pytest.raises(ValueError, match=r"refills a fork of 2 sequences; that one has 1"):
        prefix.fork(batch=2, into=prefix.fork())
    closed = prefix.fork()
    closed.close()
    with pytest.raises(RuntimeError, match="was closed"):
        prefix.fork(into=closed)


def test_fork_into_forks_anew_where_the_fork_cannot_take_the_prefix():
    """A prefix that reserved more blocks than an earlier fork's buffers take: fork(into=...) returns a new fork
    and leaves that one as it was."""
    model = build_model("llama")
    prefix, document = _prefix(model, FULL)
    cache = prefix.fork()
    questions = _questions(1, 4)
    answered = _answer(model, cache, document, questions)
    length = cache.get_seq_length()
    prefix.reserve(64 * 1024)
    new = prefix.fork(into=cache)
    assert new is not cache and cache.get_seq_length() == length and new.get_seq_length() == DOCUMENT
    assert torch.equal(_answer(model, new, document, questions), answered)


def test_a_refill_stopped_part_way_leaves_the_fork_broken_and_the_pool_counted(monkeypatch):
    from hf_offload.cache import OffloadLayer

    model = build_model("llama")
    prefix, document = _prefix(model, FULL)
    host = prefix.offload_layers[0].blocks.host
    held = host.used_blocks
    cache = prefix.fork()
    _answer(model, cache, document, _questions(1, 4))
    refill, calls = OffloadLayer.refill_rows, []

    def stops_at_the_second_layer(self, other, rows, *args):
        calls.append(self.layer_idx)
        if len(calls) == 2:
            raise KeyboardInterrupt
        refill(self, other, rows, *args)

    monkeypatch.setattr(OffloadLayer, "refill_rows", stops_at_the_second_layer)
    with pytest.raises(KeyboardInterrupt):
        prefix.fork(into=cache)
    with pytest.raises(RuntimeError, match="stopped in the middle of refilling it"):
        prefix.fork(into=cache)
    del cache
    gc.collect()
    assert host.used_blocks == held  # every reference of the fork went back, none twice
    assert prefix.get_seq_length() == DOCUMENT


@pytest.mark.triton
def test_forks_on_the_kernel_path_take_the_prefix_device_tables():
    """On the kernel path a new fork and a refilled one take the block table from the prefix's device table (no copy
    from the host): their answers are DynamicCache's at a budget that covers the context, question after question."""
    model = build_model("llama")
    prefix, document = _prefix(model, dict(FULL, transfer="kernel", cuda_graphs=False))
    assert prefix.offload_layers[0].blocks.block_table_dev is not None
    cache = None
    for seed in (1, 2):
        questions = _questions(2, seed)
        expected = _answer(model, DynamicCache(config=model.config), document, questions)
        assert torch.equal(_answer(model, prefix.fork(batch=2), document, questions), expected)
        cache = prefix.fork(batch=2, into=cache)
        for layer, mine in zip(cache.offload_layers, prefix.offload_layers):
            n = mine.blocks.n_blocks
            assert torch.equal(layer.blocks.block_table_dev[:, :n].cpu(), mine.blocks.block_table.expand(2, -1))
        assert torch.equal(_answer(model, cache, document, questions), expected)
