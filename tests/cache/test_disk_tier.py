"""The disk tier: with a host cap small enough that most sealed blocks are on disk, generate() is token-identical to
DynamicCache at a full budget and makes the same selections as the all-in-RAM cache at a sparse one; the spill
files exist while the cache is used (private modes) and are gone after close, garbage collection, a forward that
failed part-way and the end of the process; a full disk and a removed file raise errors that say what to change and
leave the cache consistent; save / load and fork keep working with blocks on disk; staging stays bounded."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.cache.planner import DecodePlanner
from hf_offload.store.disk import DiskTierError

from ..helpers import TINY_PREFILL, TINY_SPARSE, build_model, left_padded

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32 (every tiny model)
CHUNK_BYTES = 2 * BLOCK_BYTES  # two blocks a chunk: many chunks, so that most of them spill
DISK = dict(host_chunk_mib=CHUNK_BYTES / 2**20, host_memory_gib=4 * CHUNK_BYTES / 2**30, disk_staging_chunks=2)
FULL = dict(TINY_PREFILL, budget_tokens=4096)
SPARSE = dict(TINY_SPARSE, pool_tokens=16)
NEW = 8


def _generate(model, ids, mask, cache, new_tokens=NEW):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              do_sample=False)  # fmt: skip


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*"))


def _recorded(run):
    """``run()``'s result and every plan's selected blocks (sorted, ``-1`` where not kept)."""
    selections, plan = [], DecodePlanner.plan

    def recording(self, *args, **kwargs):
        selection = plan(self, *args, **kwargs)
        selections.append(selection.blocks.masked_fill(~selection.keep, -1).sort(dim=-1).values.tolist())
        return selection

    DecodePlanner.plan = recording
    try:
        return run(), selections
    finally:
        DecodePlanner.plan = plan


def test_full_budget_with_most_blocks_on_disk_matches_dynamic_cache(arch, tmp_path):
    model = build_model(arch)
    ids, mask = left_padded([101, 77], seed=1)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    assert torch.equal(_generate(model, ids, mask, cache), expected)
    stats = cache.stats()
    assert stats["disk_kv_bytes"] > 2 * stats["host_kv_bytes"] > 0  # most blocks are on disk
    assert stats["disk_reads"] > 0 and stats["disk_read_bytes"] >= stats["disk_reads"] * BLOCK_BYTES
    assert stats["host_reserved_bytes"] <= 4 * CHUNK_BYTES
    assert stats["disk_kv_bytes"] == sum(layer["disk_kv_bytes"] for layer in stats["layers"].values())
    cache.close()


def test_sparse_budget_on_disk_selects_as_the_cache_in_memory(arch, tmp_path):
    model = build_model(arch)
    ids, mask = left_padded([101, 77], seed=2)
    memory = OffloadCache(model, **SPARSE)
    expected, chosen = _recorded(lambda: _generate(model, ids, mask, memory))
    disk = OffloadCache(model, **SPARSE, **DISK, disk_dir=tmp_path)
    got, chosen_disk = _recorded(lambda: _generate(model, ids, mask, disk))
    assert torch.equal(got, expected)
    assert chosen_disk == chosen
    a, b = memory.stats(), disk.stats()
    for name in ("recalled_blocks", "decode_recalled_blocks", "hit_rate", "decode_steps", "offloaded_bytes"):
        assert a[name] == b[name], name
    assert b["disk_kv_bytes"] > b["host_kv_bytes"] and b["disk_reads"] > 0
    assert a["host_kv_bytes"] == b["host_kv_bytes"] + b["disk_kv_bytes"]


def test_files_are_private_while_used_and_gone_after_close(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([101], seed=3)
    with OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path) as cache:
        assert _files(tmp_path) == []  # nothing is made before the first spill
        _generate(model, ids, mask, cache)
        root, path = Path(cache.disk.root), Path(cache.disk.path)
        assert root.parent == tmp_path and _files(tmp_path) == [root, path]
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_size >= cache.stats()["disk_kv_bytes"] > 0
    assert _files(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        _generate(model, ids, mask, cache)


def test_files_are_gone_after_garbage_collection(tmp_path):
    model = build_model("qwen2")
    ids, mask = left_padded([90], seed=4)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    _generate(model, ids, mask, cache)
    assert _files(tmp_path)
    del cache
    gc.collect()
    assert _files(tmp_path) == []


def _generate_stopped_at_the_third_decode_step(model, ids, mask, cache):
    """generate() through ``cache`` with a forward pre-hook of layer 1 that raises at its fourth call (the third
    decode step, after layer 0 took its token)."""
    calls = []

    def failing(module, args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("stop")

    handle = model.model.layers[1].register_forward_pre_hook(failing)
    try:
        with pytest.raises(RuntimeError, match="stop"):
            _generate(model, ids, mask, cache)
    finally:
        handle.remove()


def test_an_exception_inside_a_forward_rolls_back_and_keeps_the_files(tmp_path):
    """The forward stopped after layer 0 took its token: layer 0 is cropped back, the blocks on disk stay where they
    are, and the cache goes on; close() removes the files."""
    model = build_model("llama")
    ids, mask = left_padded([90], seed=5)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    _generate_stopped_at_the_third_decode_step(model, ids, mask, cache)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [90 + 2] * len(cache.layers)
    assert _files(tmp_path) != [] and cache.stats()["disk_kv_bytes"] > 0
    follow = torch.cat([ids, _generate(model, ids, mask, OffloadCache(model, **FULL))[:, 90:93]], 1)
    dense = DynamicCache(config=model.config)
    _generate(model, ids, mask, dense, 3)
    want = _generate(model, follow, torch.ones_like(follow), dense, 4)
    assert torch.equal(_generate(model, follow, torch.ones_like(follow), cache, 4), want)
    cache.close()
    assert _files(tmp_path) == []


def test_files_are_gone_after_an_exception_that_cannot_be_rolled_back(tmp_path):
    """Gemma 3's sliding layers (window 12) dropped old tokens for the failed forward's: the cache is broken, and
    its tiers and files are freed at once; reset() makes it usable again."""
    model = build_model("gemma3")
    ids, mask = left_padded([90], seed=5)
    expected = _generate(model, ids, mask, OffloadCache(model, **FULL))
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    _generate_stopped_at_the_third_decode_step(model, ids, mask, cache)
    assert _files(tmp_path) == []  # the forward stopped part-way: tiers and files freed
    with pytest.raises(RuntimeError, match="unusable.*disk files were freed"):
        _generate(model, ids, mask, cache)
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, cache), expected)


def test_files_are_gone_when_the_process_ends(tmp_path):
    script = f"""
import torch
from hf_offload import OffloadCache
from tests.helpers import build_model, left_padded
from tests.cache.test_disk_tier import FULL, DISK
model = build_model("llama")
ids, mask = left_padded([90], seed=6)
cache = OffloadCache(model, **FULL, **DISK, disk_dir={str(tmp_path)!r})
with torch.no_grad():
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False)
print(cache.disk.path, cache.stats()["disk_kv_bytes"])
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    path, spilled = out.stdout.split()[-2:]
    assert int(spilled) > 0 and Path(path).parent.parent == tmp_path
    assert _files(tmp_path) == []


def test_a_full_disk_refuses_the_forward_and_the_cache_goes_on_after_space_is_freed(tmp_path, monkeypatch):
    model = build_model("llama")
    ids, mask = left_padded([101], seed=7)
    more, _ = left_padded([40], seed=8)
    memory = OffloadCache(model, **FULL)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    with torch.no_grad():
        expected = [model(input_ids=ids, past_key_values=memory).logits,
                    model(input_ids=more, past_key_values=memory).logits]  # fmt: skip
        got = [model(input_ids=ids, past_key_values=cache).logits]

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        before, spilled = cache.get_seq_length(), cache.stats()["disk_kv_bytes"]
        with pytest.raises(DiskTierError, match="No space left.*refused before it changed the cache.*disk_memory_gib"):
            model(input_ids=more, past_key_values=cache)
        assert cache.get_seq_length() == before and cache.stats()["disk_kv_bytes"] == spilled
        monkeypatch.undo()  # space freed
        got.append(model(input_ids=more, past_key_values=cache).logits)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_a_failed_write_keeps_the_chunk_in_memory_and_the_cache_consistent(tmp_path, monkeypatch):
    model = build_model("llama")
    ids, mask = left_padded([101], seed=9)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    budget = cache.host_budget

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "posix_fallocate", lambda *args: None)  # e.g. a file system without it
    spills = []
    spill = cache.disk.spill

    def watched(pool, chunk):
        try:
            spill(pool, chunk)
        finally:
            spills.append((pool.chunks[chunk].numel() > 0, pool.chunk_disk[chunk], budget.reserved_bytes))

    monkeypatch.setattr(cache.disk, "spill", watched)
    with pytest.raises(DiskTierError, match="No space left.*stayed in host memory.*host_memory_gib"):
        _generate(model, ids, mask, cache)
    assert spills == [(True, None, 4 * CHUNK_BYTES)]  # the chunk stayed in memory, nothing half-written
    # The first layer's seal failed before any layer changed: nothing is cached, no block is held.
    assert cache.get_seq_length() == 0 and cache.stats()["disk_kv_bytes"] == 0
    assert all(not s.is_initialized or s.host.used_blocks == 0 for s in (layer.blocks for layer in cache.offload_layers))
    monkeypatch.undo()  # space freed: the same cache goes on
    expected = _generate(model, ids, mask, OffloadCache(model, **FULL))
    assert torch.equal(_generate(model, ids, mask, cache), expected)
    assert cache.stats()["disk_kv_bytes"] > 0
    cache.close()
    assert _files(tmp_path) == []


def test_a_removed_spill_file_is_a_clear_error(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([101], seed=10)
    cache = OffloadCache(model, **SPARSE, **DISK, disk_dir=tmp_path)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    os.unlink(cache.disk.path)
    with pytest.raises(DiskTierError, match="removed while the cache was using it.*reset"):
        _generate(model, torch.cat([ids, ids[:, :3]], 1), None, cache)
    cache.close()
    assert _files(tmp_path) == []


def test_staging_stays_within_its_bound(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([140, 140, 140], seed=11)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path)
    _generate(model, ids, mask, cache, new_tokens=4)
    stats = cache.stats()
    assert stats["disk_staging_bytes"] == DISK["disk_staging_chunks"] * CHUNK_BYTES
    # Each recall of a layer needs more blocks on disk than staging holds: it reads them in batches.
    assert stats["disk_read_blocks"] > 3 * 17 * stats["decode_steps"]
    for staging in cache.disk._staging.values():
        assert len(staging.entries) <= staging.n_slots == 2 * DISK["disk_staging_chunks"]


def test_lookahead_stages_the_forecast_ahead_of_the_recall(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([101, 77], seed=12)
    settings = dict(TINY_SPARSE, lookahead=True, lookahead_query="same")  # a pool that holds the budget
    expected = _generate(model, ids, mask, OffloadCache(model, **settings))
    cache = OffloadCache(model, **settings, **dict(DISK, disk_staging_chunks=8), disk_dir=tmp_path)
    assert torch.equal(_generate(model, ids, mask, cache), expected)
    stats = cache.stats()
    assert stats["disk_staged_ahead_blocks"] > 0 and stats["disk_staging_hits"] > 0


@pytest.mark.parametrize("selector", ["quantkey[bits=4,tail_bits=2,tail_near=3]", "solohead"])
def test_disk_stage_near_reads_the_blocks_ranked_below_the_selection_ahead(tmp_path, monkeypatch, selector):
    """``disk_stage_near``: after each recall, the blocks ranked just below the selection start moving from disk
    (those of the selector's ranking past the selection, else its next-best scores), and what is attended stays
    the same: the same tokens and selections as without it."""
    model = build_model("llama")
    ids, mask = left_padded([140, 101], seed=14)
    settings = dict(TINY_SPARSE, selector=selector, **dict(DISK, disk_staging_chunks=16), disk_dir=tmp_path)
    without = OffloadCache(model, **settings)
    expected, chosen = _recorded(lambda: _generate(model, ids, mask, without))
    staged = []
    stage = type(without.disk).stage
    monkeypatch.setattr(type(without.disk), "stage", lambda self, pool, ids: staged.append(list(ids)) or stage(
        self, pool, ids))  # fmt: skip
    cache = OffloadCache(model, **settings, disk_stage_near=4)
    got, selections = _recorded(lambda: _generate(model, ids, mask, cache))
    assert torch.equal(got, expected) and selections == chosen
    stats, before = cache.stats(), without.stats()
    assert before["disk_staged_ahead_blocks"] == 0 and before["disk_staged_used_blocks"] == 0
    assert 0 < stats["disk_staged_ahead_blocks"] <= sum(map(len, staged))  # those already staged are not read again
    assert all(len(call) <= 2 * 4 for call in staged)  # at most 4 blocks per sequence (2 sequences) a layer step
    assert 0 <= stats["disk_staged_used_blocks"] <= stats["disk_staging_hits"]
    assert stats["disk_read_blocks"] - stats["disk_staged_ahead_blocks"] <= before["disk_read_blocks"]


def test_disk_stage_near_is_a_step_option(tmp_path):
    """``set_options(disk_stage_near=...)`` switches it on a filled cache; a negative value is refused."""
    model = build_model("llama")
    ids, mask = left_padded([140, 101], seed=15)
    cache = OffloadCache(model, **TINY_SPARSE, **dict(DISK, disk_staging_chunks=16), disk_dir=tmp_path)
    _generate(model, ids, mask, cache, new_tokens=3)
    assert cache.stats()["disk_staged_ahead_blocks"] == 0
    cache.set_options(disk_stage_near=4)
    with torch.no_grad():  # continue the filled cache with a few more tokens
        more, more_mask = torch.cat([ids, ids[:, -3:]], 1), torch.cat([mask, mask[:, -3:]], 1)
        out = model.generate(input_ids=more, attention_mask=more_mask, past_key_values=cache, max_new_tokens=3,
                             do_sample=False)  # fmt: skip
    assert out.shape[1] == ids.shape[1] + 6 and cache.stats()["disk_staged_ahead_blocks"] > 0
    with pytest.raises(ValueError, match="disk_stage_near must be a non-negative integer"):
        cache.set_options(disk_stage_near=-1)
    assert cache.config.disk_stage_near == 4


def test_save_reads_blocks_on_disk_and_load_spills_again(tmp_path):
    model = build_model("qwen3")
    ids, mask = left_padded([101, 77], seed=13)
    (tmp_path / "a").mkdir()
    cache = OffloadCache(model, **SPARSE, **DISK, disk_dir=tmp_path / "a")
    first = _generate(model, ids, mask, cache)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    follow = torch.cat([first, left_padded([5, 5], seed=14)[0]], 1)
    follow_mask = torch.cat([mask, torch.ones_like(follow[:, mask.shape[1] :])], 1)
    expected = _generate(model, follow, follow_mask, cache)
    (tmp_path / "b").mkdir()
    assert OffloadCache.load(path, model, host_memory_gib=None).config.disk_dir is None  # a directory of the saving machine is not kept
    loaded = OffloadCache.load(path, model, disk_dir=str(tmp_path / "b"))
    assert loaded.stats()["disk_kv_bytes"] > 0
    assert torch.equal(_generate(model, follow, follow_mask, loaded), expected)
    in_memory = OffloadCache.load(path, model, host_memory_gib=None, disk_dir=None)
    assert torch.equal(_generate(model, follow, follow_mask, in_memory), expected)


def test_fork_shares_blocks_on_disk_by_reference(tmp_path):
    model = build_model("llama")
    document, _ = left_padded([97], seed=15)
    questions = left_padded([5, 5, 5], seed=16)[0]
    full = torch.cat([document.expand(3, -1), questions], 1)
    expected = _generate(model, full, torch.ones_like(full), DynamicCache(config=model.config))
    prefix = OffloadCache(model, **FULL, **dict(DISK, host_memory_gib=6 * CHUNK_BYTES / 2**30), disk_dir=tmp_path)
    with torch.no_grad():
        model(input_ids=document, past_key_values=prefix)
    on_disk = prefix.stats()["disk_kv_bytes"]
    assert on_disk > 0
    fork = prefix.fork(batch=3)
    assert fork.stats()["disk_kv_bytes"] == on_disk  # shared, not copied
    prefix.close()  # the fork still holds the shared blocks: the file stays
    assert _files(tmp_path)
    assert torch.equal(_generate(model, full, torch.ones_like(full), fork), expected)
    fork.close()
    del prefix, fork
    gc.collect()
    assert _files(tmp_path) == []


def test_a_file_system_without_direct_io_falls_back_to_buffered_io(tmp_path, monkeypatch):
    model = build_model("llama")
    ids, mask = left_padded([90], seed=17)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    opened = os.open

    def no_direct(path, flags, *args):  # what tmpfs before Linux 6.6 answers
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path) as cache:
        assert torch.equal(_generate(model, ids, mask, cache), expected)
        assert cache.stats()["disk_direct_io"] is False and cache.stats()["disk_kv_bytes"] > 0


def test_a_tmpfs_directory_works():
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("needs a writable /dev/shm (tmpfs)")
    model = build_model("llama")
    ids, mask = left_padded([90], seed=17)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    with OffloadCache(model, **FULL, **DISK, disk_dir=shm) as cache:
        assert torch.equal(_generate(model, ids, mask, cache), expected)
        assert cache.stats()["disk_kv_bytes"] > 0
        root = Path(cache.disk.root)
    assert not root.exists()


def test_settings_are_checked(tmp_path):
    model = build_model("llama")
    with pytest.raises(ValueError, match="set host_memory_gib"):
        OffloadCache(model, disk_dir=tmp_path)
    with pytest.raises(ValueError, match="not an existing directory"):
        OffloadCache(model, host_memory_gib=1, disk_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="set disk_dir too"):
        OffloadCache(model, host_memory_gib=1, disk_memory_gib=1)
    with pytest.raises(ValueError, match="disk_staging_chunks must be a positive integer"):
        OffloadCache(model, host_memory_gib=1, disk_dir=tmp_path, disk_staging_chunks=0)


def test_disk_memory_gib_bounds_the_spilled_bytes(tmp_path):
    model = build_model("llama")
    ids, mask = left_padded([101], seed=18)
    cache = OffloadCache(model, **FULL, **DISK, disk_dir=tmp_path, disk_memory_gib=3 * CHUNK_BYTES / 2**30)
    with pytest.raises(MemoryError, match="disk_memory_gib"):
        _generate(model, ids, mask, cache)


def _demand_reads(cache) -> int:
    stats = cache.stats()
    return stats["disk_read_blocks"] - stats["disk_staged_ahead_blocks"]


def _decode_reads(model, ids, mask, cache):
    """``generate()``'s blocks read from disk on demand (not staged ahead) by each decode step (not by its prefill),
    its tokens and every decode step's selection."""
    at_step, plan = [], DecodePlanner.plan

    def noting(self, *args, **kwargs):
        if self.blocks.layer_idx == 0:  # a decode step starts
            at_step.append(_demand_reads(cache))
        return plan(self, *args, **kwargs)

    DecodePlanner.plan = noting
    try:
        out, selections = _recorded(lambda: _generate(model, ids, mask, cache))
    finally:
        DecodePlanner.plan = plan
    at_step.append(_demand_reads(cache))
    return [b - a for a, b in itertools.pairwise(at_step)], out, selections


@pytest.mark.parametrize("selector", [None, "quantkey"])
def test_disk_cap_bounds_the_blocks_a_decode_step_reads_from_disk(tmp_path, selector):
    """``disk_cap_blocks=0``: no decode step reads a selected block from disk on demand (the selection takes blocks
    in host memory or staged instead, or fewer blocks), but the first reads the sink blocks, which every step attends
    and the slot pool keeps from then on; without the cap later steps read from disk. With ``disk_stage_left_out``
    the best blocks the cap leaves out are staged ahead, and later steps attend some of them from staging (still no
    read on demand); without it nothing is staged. The cap never touches a step that selects every block."""
    model = build_model("llama")
    ids, mask = left_padded([101, 77], seed=2)
    chosen = {} if selector is None else {"selector": selector}
    disk = dict(DISK, disk_staging_chunks=16)  # room for the blocks staged ahead beside those read on demand
    sparse = TINY_SPARSE  # a slot pool that holds the selection: the sink and window blocks stay in it
    read, _, plain = _decode_reads(model, ids, mask, OffloadCache(model, **sparse, **disk, **chosen,
                                                                  disk_dir=tmp_path))  # fmt: skip
    sinks = 2 * len(model.model.layers) * (SPARSE["sink_tokens"] // SPARSE["block_tokens"])  # per sequence, layer
    assert len(read) == NEW - 1 and sum(read[1:]) > 0
    for staged in (0, 4):
        capped = OffloadCache(model, **sparse, **disk, **chosen, disk_cap_blocks=0, disk_stage_left_out=staged,
                              disk_dir=tmp_path)  # fmt: skip
        read_capped, _, bounded = _decode_reads(model, ids, mask, capped)
        assert len(read_capped) == NEW - 1
        assert 0 < read_capped[0] <= sinks and read_capped[1:] == [0] * (NEW - 2)
        assert bounded != plain  # blocks on disk swapped for blocks in memory, or left out
        stats = capped.stats()
        assert stats["disk_kv_bytes"] > stats["host_kv_bytes"]  # most blocks stayed on disk
        if staged:  # left out, staged, then attended
            assert stats["disk_staged_ahead_blocks"] > 0 and stats["disk_staged_used_blocks"] > 0
        else:
            assert stats["disk_staged_ahead_blocks"] == 0
    # At a budget that covers the context every block is selected: the cap changes nothing.
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    full = OffloadCache(model, **FULL, **DISK, disk_cap_blocks=0, disk_dir=tmp_path)
    assert torch.equal(_generate(model, ids, mask, full), expected)


def test_disk_cap_settings_are_checked():
    model = build_model("llama")
    with pytest.raises(ValueError, match="set disk_dir too"):
        OffloadCache(model, **SPARSE, disk_cap_blocks=2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="disk_cap_blocks must be a non-negative integer"):
            OffloadCache(model, **SPARSE, **DISK, disk_cap_blocks=bad, disk_dir="/tmp")
        with pytest.raises(ValueError, match="disk_stage_left_out must be a non-negative integer"):
            OffloadCache(model, **SPARSE, **DISK, disk_cap_blocks=0, disk_stage_left_out=bad, disk_dir="/tmp")


def test_the_device_table_of_chunks_on_disk_follows_the_spills(tmp_path):
    """``HostBlockPool.chunk_on_disk`` (what ``disk_cap_blocks`` reads in the plan) names exactly the spilled chunks,
    those spilled after the table was made included (set in place), and ends with ``False`` for the id ``-1``."""
    model = build_model("llama")
    ids, mask = left_padded([101, 77], seed=2)
    cache = OffloadCache(model, **SPARSE, **DISK, disk_dir=tmp_path)
    cpu = torch.device("cpu")
    with torch.no_grad():
        model(input_ids=ids[:, :40], attention_mask=mask[:, :40], past_key_values=cache)  # a few chunks spill
        pools = [layer.blocks.host for layer in cache.offload_layers]
        before = [(pool.chunk_on_disk(cpu), pool.table_version, [d is not None for d in pool.chunk_disk])
                  for pool in pools]  # fmt: skip
        model(input_ids=ids[:, 40:], attention_mask=mask, past_key_values=cache)  # more spill
    spilled_later = 0
    for pool, (table, version, spilled_before) in zip(pools, before):
        flags = pool.chunk_on_disk(cpu)
        spilled = [extent is not None for extent in pool.chunk_disk]
        assert flags[: len(spilled)].tolist() == spilled and not flags[-1]
        later = [c for c, (was, now) in enumerate(zip(spilled_before, spilled)) if now and not was]
        spilled_later += len(later)
        if pool.table_version == version:  # the same table, its entries set as the chunks spilled
            assert flags is table
    assert spilled_later > 0  # chunks that were in memory when the table was made spilled since
    cache.close()


def test_blocks_staged_ahead_stay_staged_while_published(tmp_path):
    """What a plan under ``disk_cap_blocks`` takes as readable without the disk (``HostBlockPool.block_staged``) is
    published at the second sync after its read ahead and stays in staging until the pool unpublishes it: reads
    ahead for other pools and reads on demand evict other entries first; a recall's use unpublishes a block at the
    next sync, and so does ``PUBLISHED_SYNCS`` syncs' age; at most half of staging is published at a time."""
    from hf_offload.store.disk import PUBLISHED_SYNCS

    model = build_model("llama")
    ids, mask = left_padded([101, 77], seed=2)
    cache = OffloadCache(model, **SPARSE, **dict(DISK, disk_staging_chunks=4), disk_dir=tmp_path)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    first, second = (layer.blocks.host for layer in cache.offload_layers[:2])
    cpu = torch.device("cpu")
    table = first.block_staged(cpu)
    staging = first.disk._staging_for(first)
    spilled = [i for i in range(first._next_id) if first.on_disk(torch.tensor([i]))[0]]
    other = [i for i in range(second._next_id) if second.on_disk(torch.tensor([i]))[0]]
    assert staging.n_slots == 8 and len(spilled) >= 6 and len(other) >= staging.n_slots

    def marked():
        return table.nonzero().flatten().tolist()

    def in_staging(pool, blocks):
        return all((pool.disk_serial, b) in staging.entries for b in blocks)

    first.stage(torch.tensor(spilled[:6]))
    first.sync_staged()
    assert marked() == []  # published a sync later, after their reads: the same blocks whatever the drive's timing
    first.sync_staged()
    published = marked()
    assert len(published) == staging.n_slots // 2 and set(published) <= set(spilled[:6])  # half of staging at most
    second.stage(torch.tensor(other))  # reads ahead for another pool: they take the other slots only
    second.read(torch.tensor(other[-2:]))  # reads on demand too
    assert in_staging(first, published)
    first.read(torch.tensor(published[:1]))  # a recall uses one: unpublished at the next sync
    assert marked() == published
    first.sync_staged()
    assert marked() == published[1:]
    for _ in range(PUBLISHED_SYNCS - 1):  # the others age out
        first.sync_staged()
    assert marked() == []
    second.stage(torch.tensor(other[:staging.n_slots]))  # now evictable
    assert not in_staging(first, published)
    cache.close()
