"""Cache editing for generate() features: crop, batch_repeat_interleave, batch_select_indices, reorder_cache.

Two levels: the layer's KV re-assembled from every tier (``OffloadCache.dense_kv``) equals ``DynamicCache``'s after
each edit, bit for bit (both fed the same keys and values); and beam search, prompt-lookup and assisted decoding
generate exactly what they generate with ``DynamicCache`` at a budget covering the context, on every architecture;
so does contrastive search, written here against the cache API (in transformers 5 it is Hub code).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.attention.handoff import take_handoff
from hf_offload.kernels.quant import dequantize_keys

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

HEADS, HEAD_DIM = 2, 16  # the tiny llama's KV heads and head size


class Pair:
    """An OffloadCache and a DynamicCache of the tiny llama fed the same keys and values directly."""

    def __init__(self, batch: int, seed: int = 0):
        self.model = build_model("llama")
        self.cache = OffloadCache(self.model, budget_tokens=4096, **SMALL)
        self.ref = DynamicCache(config=self.model.config)
        self.gen = torch.Generator().manual_seed(seed)
        self.batch = batch

    def append(self, tokens: int, layers: int | None = None) -> None:
        """``tokens`` new keys and values through every layer, or through the first ``layers`` of the cache only
        (a forward that stopped there; the reference does not see it)."""
        partial = layers is not None
        for idx in range(len(self.cache.layers) if layers is None else layers):
            k, v = (torch.randn(self.batch, HEADS, tokens, HEAD_DIM, generator=self.gen) for _ in range(2))
            self.cache.update(k, v, idx)
            take_handoff()  # no attention call follows
            self.cache.layers[idx].finish_step()
            if not partial:
                self.ref.update(k, v, idx)

    def edit(self, name: str, *args) -> None:
        getattr(self.cache, name)(*args)
        getattr(self.ref, name)(*args)
        self.batch = self.ref.layers[0].keys.shape[0]

    def check(self) -> None:
        for idx, layer in enumerate(self.cache.layers):
            keys, values = self.cache.dense_kv(idx)
            assert torch.equal(keys, self.ref.layers[idx].keys) and torch.equal(values, self.ref.layers[idx].values)
            store = layer.blocks
            assert store.n_tokens == keys.shape[-2] == layer.get_seq_length()
            assert store.block_table.shape == (self.batch, store.n_blocks)
            assert all(s.shape[:2] == (self.batch, store.n_blocks) for s in store.summaries.values())
            assert all(not s[:, store.n_blocks :].any() for s in store.summary_store.values())  # zeros past them
            _check_summaries(layer, keys, values)
            # Every referenced host block is counted once per reference, and no other block is held.
            ids = store.block_table.flatten()
            unique, counts = torch.unique(ids, return_counts=True)
            assert torch.equal(store.host.refs(unique), counts.int())
            assert store.host.used_blocks == len(unique)


def _check_summaries(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """The layer's summaries are its selector's (names), and each quantized key and value is within half a step of
    its level, plus half a 4-bit step where it was re-encoded from 4-bit codes (``coarsen_summaries``), of the KV."""
    store, selector = layer.blocks, layer.selector
    n, T = store.n_blocks, store.block_tokens
    names = {"codes", "kmin", "kstep"} | ({"vcodes", "vmin", "vstep"} if selector.tail_bits else set())
    if not n:
        return
    assert set(store.summary_store) == names
    pairs = [(keys, "codes", "kmin", "kstep", selector.bits)]
    if selector.tail_bits:
        pairs.append((values, "vcodes", "vmin", "vstep", selector.tail_bits))
    for kv, codes, low, step, bits in pairs:
        b, h, _, d = kv.shape
        blocks = kv[:, :, : n * T].reshape(b, h, n, T, d).transpose(1, 2)  # [batch, n, heads, T, d]
        got = dequantize_keys(store.summaries[codes], store.summaries[low], store.summaries[step], bits)[..., :d]
        span = (blocks.amax(dim=3) - blocks.amin(dim=3))[:, :, :, None]
        assert ((got - blocks).abs() <= span * (0.5 / ((1 << bits) - 1) + 0.5 / 15) + 1e-5).all()


def test_crop_within_the_open_block_and_into_sealed_blocks():
    pair = Pair(batch=2)
    pair.append(37)  # 4 sealed blocks of 8 and 5 open tokens
    pair.check()
    for remove in (3, 2, 11, 8, 0):  # open block only; to a block boundary; into sealed blocks; a whole block
        pair.edit("crop", -remove)
        pair.check()
    pair.append(13)  # blocks sealed again after a crop hold the new tokens
    pair.check()
    pair.edit("crop", -pair.cache.get_seq_length())  # everything
    pair.check()
    pair.append(20)
    pair.check()


def test_crop_to_a_length_as_transformers_5_17():
    pair = Pair(batch=1)
    pair.append(30)
    pair.cache.crop(100)  # longer than held: nothing changes
    assert pair.cache.get_seq_length() == 30
    pair.cache.crop(19)
    pair.ref.crop(-11)
    pair.check()


def test_batch_edits_share_host_blocks_and_match_dynamic_cache():
    pair = Pair(batch=2)
    pair.append(29)
    pair.edit("batch_repeat_interleave", 3)  # [a, a, a, b, b, b]
    pair.check()
    pair.append(6)  # each copy grows on its own
    pair.check()
    pair.edit("reorder_cache", torch.tensor([5, 5, 0, 2, 1, 0]))
    pair.check()
    pair.edit("crop", -10)  # into sealed blocks shared by several sequences
    pair.check()
    pair.append(17)
    pair.check()
    pair.edit("batch_select_indices", torch.tensor([4, 1]))
    pair.check()
    pair.append(9)
    pair.check()


def test_batch_select_with_a_boolean_mask():
    pair = Pair(batch=3)
    pair.append(21)
    mask = torch.tensor([True, False, True])
    pair.cache.batch_select_indices(mask)
    pair.ref.batch_select_indices(mask.nonzero().flatten())
    pair.batch = 2
    pair.check()


def test_edits_of_an_empty_cache_change_nothing():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    cache.batch_repeat_interleave(3)
    cache.reorder_cache(torch.tensor([0]))
    cache.crop(-4)
    assert cache.get_seq_length() == 0 and not cache.offload_layers[0].is_initialized


# ---------------------------------------------------------------------------------------------- generate() modes
def _prompt():
    """A prompt with repeats, so that prompt lookup finds candidates (and some are rejected)."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13] * 4 + [5, 6]])
    return ids, torch.ones_like(ids)


MODES = {
    "beam_search": lambda arch: dict(num_beams=3),
    "prompt_lookup": lambda arch: dict(prompt_lookup_num_tokens=3),
    "assisted": lambda arch: dict(assistant_model=build_model(arch, seed=1)),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_generate_mode_token_identical(arch, mode, monkeypatch):
    model = build_model(arch)
    if mode == "beam_search":  # two left-padded prompts: beams of different sequences
        ids, mask = left_padded([38, 27], seed=4)
    elif mode == "assisted":  # a random prompt: the assistant's guesses are often rejected
        ids, mask = left_padded([38], seed=5)
    else:
        ids, mask = _prompt()

    def run(cache):
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=14, do_sample=False,
                **MODES[mode](arch),
            )  # fmt: skip

    expected = run(DynamicCache(config=model.config))
    crops = []
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    store = type(cache.offload_layers[0].blocks)
    original = store.crop
    monkeypatch.setattr(store, "crop", lambda self, n: (crops.append((self.n_blocks, n // 8)), original(self, n)))
    got = run(cache)
    assert torch.equal(got, expected)
    assert cache.stats()["host_kv_bytes"] > 0
    if mode != "beam_search":
        assert crops  # rejected candidates were cropped
    if mode == "prompt_lookup" and arch == "llama":
        assert any(kept < held for held, kept in crops)  # a crop reached into sealed blocks


def _contrastive(model, ids: torch.Tensor, cache, new_tokens: int, top_k: int = 4, alpha: float = 0.6):
    """Contrastive search (Su et al., 2022, "A Contrastive Framework for Neural Text Generation") driven through the
    cache API that transformers' implementation uses (in the library up to 4.x, a Hub download in 5.x): each step
    repeats every sequence ``top_k`` times (``batch_repeat_interleave``), runs the ``top_k`` most likely next tokens
    in one forward, scores each as ``(1 - alpha) * p - alpha * max cosine(candidate state, earlier states)`` and
    keeps the best candidate's row (``batch_select_indices``). Returns the chosen tokens, ``[batch, new_tokens]``."""
    batch = ids.shape[0]
    rows = torch.arange(batch)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    states, logits, chosen = out.hidden_states[-1], out.logits[:, -1], []
    for _ in range(new_tokens):
        probs, candidates = logits.float().softmax(-1).topk(top_k, dim=-1)  # [batch, top_k]
        cache.batch_repeat_interleave(top_k)
        out = model(input_ids=candidates.reshape(-1, 1), past_key_values=cache, use_cache=True,
                    output_hidden_states=True)  # fmt: skip
        new_states = out.hidden_states[-1][:, -1].reshape(batch, top_k, -1)
        similarity = torch.nn.functional.cosine_similarity(new_states[:, :, None].float(), states[:, None].float(), -1)
        best = ((1 - alpha) * probs - alpha * similarity.amax(-1)).argmax(-1)  # [batch]
        keep = rows * top_k + best
        cache.batch_select_indices(keep)
        states = torch.cat([states, new_states[rows, best][:, None]], 1)
        logits = out.logits[keep, -1]
        chosen.append(candidates[rows, best])
    return torch.stack(chosen, 1)


def test_contrastive_search_through_the_cache_api_token_identical(arch):
    model = build_model(arch)
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = _contrastive(model, ids, DynamicCache(config=model.config), 12)
        cache = OffloadCache(model, budget_tokens=4096, **SMALL)
        got = _contrastive(model, ids, cache, 12)
    assert torch.equal(got, expected)
    assert cache.stats()["host_kv_bytes"] > 0 and cache.get_seq_length() == ids.shape[1] + 12
    assert len(set(got[0].tolist())) > 1  # not one token repeated: the penalty chose among candidates


def test_contrastive_search_is_a_hub_download():
    model = build_model("llama")
    ids, mask = _prompt()
    try:
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=OffloadCache(model, budget_tokens=4096, **SMALL),
                max_new_tokens=4, penalty_alpha=0.6, top_k=4,
            )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - any failure to fetch the Hub code
        reason = "contrastive search is Hub code (custom_generate='transformers-community/contrastive-search')"
        pytest.skip(f"{reason}, not run offline: {type(error).__name__}")
    pytest.fail("contrastive search ran without its Hub code; add it to the token-identity test")
