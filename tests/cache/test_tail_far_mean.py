"""``tail_far="mean"`` through a cache: the blocks' mean values are one more summary (``vmean``) that is written at
every seal, saved and loaded with the others, and re-encoded or dropped with the values when the summaries coarsen;
a decode with it runs and differs from the midpoints' only through the far blocks' values."""

from __future__ import annotations

import torch

from hf_offload import OffloadCache
from hf_offload.kernels.tail import far_means

from ..helpers import TINY_SPARSE, build_model, left_padded

MEAN = "quantkey[bits=4,tail_bits=2,tail_near=1,tail_far=mean]"


def _generate(model, cache, ids, mask, steps=24):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False)  # fmt: skip


def test_the_means_are_summaries_of_every_sealed_block_and_persist(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([150, 123, 101], seed=4)
    cache = OffloadCache(model, **dict(TINY_SPARSE, selector=MEAN))
    out = _generate(model, cache, ids, mask, 8)
    for layer in cache.offload_layers:
        store = layer.blocks
        n = store.n_blocks
        assert n > 8 and store.summaries["vmean"].dtype == torch.uint8
        # Each sealed block's stored mean is its values' mean, within a 255th of the range and the rounding.
        blocks = store.host.read(store.block_table[:, :n].flatten()).view(store.batch, n, *store.host.block_shape)
        values = blocks[:, :, 1].float()  # [batch, n, kv_heads, tokens, head_dim]
        s = {name: t[:, :n] for name, t in store.summaries.items()}
        got = far_means({"kmin": s["vmin"], "kstep": s["vstep"]}, 2, s["vmean"])[..., : values.shape[-1]]
        bound = s["vstep"].float()[..., : values.shape[-1]] * 3 / 255 + 1e-2
        assert bool(((got - values.mean(dim=3)).abs() <= bound).all())
    cache.save(tmp_path / "c.safetensors")
    loaded = OffloadCache.load(tmp_path / "c.safetensors", model)
    for a, b in zip(cache.offload_layers, loaded.offload_layers):
        n = a.blocks.n_blocks
        assert torch.equal(a.blocks.summaries["vmean"][:, :n], b.blocks.summaries["vmean"][:, :n])
    mask = torch.cat([mask, torch.ones(mask.shape[0], out.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    assert torch.equal(_generate(model, loaded, out, mask), _generate(model, cache, out, mask))


def test_far_values_change_the_decode_only_through_the_far_blocks(monkeypatch):
    """With ``tail_near`` covering every unselected block there is no far block: mean, mid and near give the same
    tokens. With a bounded estimate the decode values the far blocks at their means, read from the summaries."""
    import hf_offload.kernels.tail as tail

    model = build_model("llama")
    ids, mask = left_padded([150, 123, 101], seed=4)
    runs = {}
    for far in ("near", "mid", "mean"):
        selector = f"quantkey[bits=4,tail_bits=2,tail_near=64,tail_far={far}]"
        runs[far] = _generate(model, OffloadCache(model, **dict(TINY_SPARSE, selector=selector)), ids, mask)
    assert torch.equal(runs["mean"], runs["near"]) and torch.equal(runs["mid"], runs["near"])
    calls = []

    def counted(values, bits, vmean):
        calls.append(vmean.shape)
        return far_means(values, bits, vmean)

    monkeypatch.setattr(tail, "far_means", counted)
    cache = OffloadCache(model, **dict(TINY_SPARSE, selector=MEAN))
    _generate(model, cache, ids, mask)
    assert len(calls) >= 23 * len(cache.offload_layers)  # every decode step of every layer
