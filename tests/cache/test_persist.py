"""OffloadCache.save / OffloadCache.load: a cache written to one safetensors file and read back in a new process
continues exactly as the uninterrupted cache, at a full and at a sparse budget; every way a load can fail says so
and builds nothing."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_offload import OffloadCache
from hf_offload.cache.blocks import BlockStore
from hf_offload import CacheFileError
from hf_offload.cache.planner import DecodePlanner

from ..helpers import TINY_PREFILL, TINY_SPARSE, build_model, left_padded

ROOT = Path(__file__).resolve().parents[2]
FIRST, MORE = 6, 8  # tokens generated before the save, and after it
BUDGETS = {"full": dict(TINY_PREFILL, budget_tokens=4096), "sparse": dict(TINY_SPARSE, pool_tokens=16)}

# Run in a new process: load each saved cache and continue it, recording every decode step's selection.
CONTINUE = """
import json, sys, torch
from hf_offload import OffloadCache
from hf_offload.cache.planner import DecodePlanner
from tests.cache.test_persist import continue_recorded
from tests.helpers import build_model

job = json.load(open(sys.argv[1]))
model = build_model(job["arch"])
results = {}
for name, path in job["files"].items():
    cache = OffloadCache.load(path, model)
    results[name] = continue_recorded(model, cache, torch.tensor(job["ids"]), torch.tensor(job["mask"]))
print(json.dumps(results))
"""


def continue_recorded(model, cache, ids, mask) -> dict:
    """Generate ``MORE`` tokens after ``ids`` (the cache holds all but the last); the tokens, the blocks every
    decode step of every layer selected, and the counters that do not depend on the slot pool's contents."""
    selections = []
    plan = DecodePlanner.plan

    def recording(self, *args, **kwargs):
        selection = plan(self, *args, **kwargs)
        chosen = selection.blocks.masked_fill(~selection.keep, -1).sort(dim=-1).values
        selections.append(chosen.tolist())
        return selection

    cache.reset_stats()
    DecodePlanner.plan = recording
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=MORE,
                                 do_sample=False)  # fmt: skip
    finally:
        DecodePlanner.plan = plan
    stats = cache.stats()
    return {
        "tokens": out.tolist(),
        "selections": selections,
        "counters": {key: stats[key] for key in ("decode_steps", "tail_share", "reused_selections")},
    }


def _prefilled(model, settings, lengths=(37, 22), seed=0):
    """A cache after the prompts and ``FIRST`` generated tokens; with the ids and mask to continue from."""
    ids, mask = left_padded(list(lengths), seed=seed)
    cache = OffloadCache(model, **settings)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=FIRST,
                             do_sample=False)  # fmt: skip
    return cache, out, torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], dim=1)


def _in_new_process(job: dict, tmp_path: Path) -> dict:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CONTINUE, str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_cache_continues_in_a_new_process(arch, tmp_path):
    model = build_model(arch)
    files, expected, ids, mask = {}, {}, None, None
    for name, settings in BUDGETS.items():
        cache, ids, mask = _prefilled(model, settings)
        files[name] = str(tmp_path / f"{name}.safetensors")
        cache.save(files[name])
        expected[name] = continue_recorded(model, cache, ids, mask)  # the uninterrupted cache
    got = _in_new_process({"arch": arch, "files": files, "ids": ids.tolist(), "mask": mask.tolist()}, tmp_path)
    for name in BUDGETS:
        assert got[name]["tokens"] == expected[name]["tokens"], name
        assert got[name]["selections"] == expected[name]["selections"], name
        assert got[name]["counters"] == expected[name]["counters"], name
    assert len(expected["sparse"]["selections"][-1][0][0]) < len(expected["full"]["selections"][-1][0][0])


def test_the_file_is_plain_safetensors_holding_the_cache(tmp_path):
    model = build_model("gemma3")  # offloaded and dense sliding-window layers
    cache, ids, mask = _prefilled(model, BUDGETS["full"])
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    tensors = load_file(path)
    for layer in cache.offload_layers:
        prefix = f"layers.{layer.layer_idx}"
        blocks, table = tensors[f"{prefix}.blocks"], tensors[f"{prefix}.block_table"]
        store = layer.blocks
        assert blocks.shape == (len(torch.unique(store.block_table)), 2, store.kv_heads, 8, store.head_dim)
        assert torch.equal(tensors[f"{prefix}.open_keys"], store.keys)
        keys = blocks[table][:, :, 0].permute(0, 2, 1, 3, 4).flatten(2, 3)  # [batch, heads, sealed tokens, dim]
        assert torch.equal(torch.cat([keys, store.keys], dim=2), layer.dense_kv()[0])
    sliding = [i for i, layer in enumerate(cache.layers) if layer not in cache.offload_layers]
    assert torch.equal(tensors[f"layers.{sliding[0]}.keys"], cache.layers[sliding[0]].keys)
    loaded = OffloadCache.load(path, model)
    assert loaded.get_seq_length() == cache.get_seq_length()
    assert loaded.config == cache.config


def test_blocks_shared_by_sequences_are_stored_once_and_stay_shared(tmp_path):
    model = build_model("llama")
    cache, ids, mask = _prefilled(model, BUDGETS["full"], lengths=(37,))
    cache.batch_repeat_interleave(3)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    store = cache.offload_layers[0].blocks
    assert load_file(path)["layers.0.blocks"].shape[0] == store.n_blocks
    loaded = OffloadCache.load(path, model)
    assert loaded.stats()["host_kv_bytes"] == cache.stats()["host_kv_bytes"]
    three = (ids.repeat(3, 1), mask.repeat(3, 1))
    assert continue_recorded(model, loaded, *three)["tokens"] == continue_recorded(model, cache, *three)["tokens"]


def test_an_empty_cache_round_trips(tmp_path):
    model = build_model("llama")
    path = tmp_path / "empty.safetensors"
    OffloadCache(model, **BUDGETS["full"]).save(path)
    loaded = OffloadCache.load(path, model)
    assert loaded.get_seq_length() == 0
    ids, mask = left_padded([12])
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=loaded, max_new_tokens=3, do_sample=False)
    assert loaded.get_seq_length() == 14


def test_settings_that_leave_the_layout_alone_may_change_at_load(tmp_path):
    model = build_model("llama")
    cache, ids, mask = _prefilled(model, BUDGETS["sparse"])
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    wider = OffloadCache.load(path, model, budget_tokens=4096, pool_tokens=64)
    assert wider.config.budget_tokens == 4096
    with pytest.raises(ValueError, match="block_tokens.*fix the blocks"):
        OffloadCache.load(path, model, block_tokens=16)


def test_a_selector_instance_is_saved_by_its_registered_name(tmp_path):
    from hf_offload import QuantKeySelector

    model = build_model("llama")
    cache, ids, mask = _prefilled(model, dict(BUDGETS["sparse"], selector=QuantKeySelector(bits=4)))
    cache.save(tmp_path / "cache.safetensors")
    loaded = OffloadCache.load(tmp_path / "cache.safetensors", model)
    assert loaded.config.selector == "quantkey[bits=4]"
    assert continue_recorded(model, loaded, ids, mask) == continue_recorded(model, cache, ids, mask)

    class Unnamed(QuantKeySelector):  # not registered: no name in a file rebuilds it
        pass

    unnamed = OffloadCache(model, **dict(BUDGETS["sparse"], selector=Unnamed()))
    with pytest.raises(ValueError, match="cannot be written to a file.*register_selector"):
        unnamed.save(tmp_path / "unnamed.safetensors")
    assert not (tmp_path / "unnamed.safetensors").exists()


# ---------------------------------------------------------------------------------------------------- errors
@pytest.fixture
def saved(tmp_path):
    """A model and the file of a cache it filled."""
    model = build_model("llama")
    cache, _, _ = _prefilled(model, BUDGETS["full"])
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    return model, path


def _live_stores() -> int:
    gc.collect()
    return sum(type(obj) is BlockStore and obj.is_initialized for obj in gc.get_objects())


def _edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) >= 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize("other", ["weights", "arch", "dtype"])
def test_loading_into_another_model_says_what_differs(saved, other):
    model, path = saved
    if other == "weights":
        wrong, match = build_model("llama", seed=1), "same shapes and dtype but other weights"
    elif other == "arch":
        wrong, match = build_model("qwen2"), "architecture: file 'LlamaForCausalLM', model 'Qwen2ForCausalLM'"
    else:
        wrong, match = build_model("llama").to(torch.float64), "dtype: file 'float32', model 'float64'"
    before = _live_stores()
    with pytest.raises(CacheFileError, match=match) as error:
        OffloadCache.load(path, wrong)
    assert "load it with the model it was saved from" in str(error.value)
    assert _live_stores() == before


def test_each_checksum_is_the_crc32_of_its_tensors_bytes(saved):
    _, path = saved
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    index = json.loads(data[8:header])
    meta = index.pop("__metadata__")
    assert meta["hf_offload.checksum"] == "crc32" and meta["hf_offload.version"] == "2"
    checksums = json.loads(meta["hf_offload.checksums"])
    assert sorted(checksums) == sorted(index)
    for name, info in index.items():
        start, end = info["data_offsets"]
        assert checksums[name] == f"{zlib.crc32(data[header + start : header + end]):08x}", name


def test_a_version_1_file_is_checked_with_sha256_and_loads(tmp_path, monkeypatch):
    """Files of format version 1 (SHA-256 per tensor) still load, continue exactly, and a corrupted one is caught."""
    from hf_offload.cache import persist

    model = build_model("llama")
    cache, ids, mask = _prefilled(model, BUDGETS["sparse"])
    monkeypatch.setattr(persist, "FORMAT_VERSION", 1)
    monkeypatch.setattr(persist, "CHECKSUM", "sha256")
    monkeypatch.setattr(persist.write_file, "__defaults__", ("sha256",))
    path = tmp_path / "v1.safetensors"
    cache.save(path)
    monkeypatch.undo()
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    index = json.loads(data[8:header])
    meta = index.pop("__metadata__")
    assert meta["hf_offload.version"] == "1" and meta["hf_offload.checksum"] == "sha256"
    name, info = next(iter(index.items()))
    start, end = info["data_offsets"]
    digest = hashlib.sha256(data[header + start : header + end]).hexdigest()
    assert json.loads(meta["hf_offload.checksums"])[name] == digest
    expected = continue_recorded(model, cache, ids, mask)
    assert continue_recorded(model, OffloadCache.load(path, model), ids, mask) == expected
    corrupted = bytearray(data)
    corrupted[header + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(corrupted))
    before = _live_stores()
    with pytest.raises(CacheFileError, match=f"data of tensor '{name}' does not match its checksum"):
        OffloadCache.load(path, model)
    assert _live_stores() == before


def test_an_unknown_checksum_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    from hf_offload.cache import persist

    model = build_model("llama")
    cache, _, _ = _prefilled(model, BUDGETS["sparse"])
    monkeypatch.setitem(persist._CHECKSUMS, "crc99", persist._Crc32)  # a checksum of a later hf-offload
    monkeypatch.setattr(persist.write_file, "__defaults__", ("crc99",))
    cache.save(tmp_path / "later.safetensors")
    monkeypatch.undo()
    before = _live_stores()
    with pytest.raises(CacheFileError, match="checksum is 'crc99', which this hf-offload does not know"):
        OffloadCache.load(tmp_path / "later.safetensors", model)
    assert _live_stores() == before


def test_hashing_runs_several_digests_at_once_each_in_order():
    from hf_offload.cache.persist import _Hashing

    generator = torch.Generator().manual_seed(0)
    tensors = {name: [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator).numpy() for n in sizes]
               for name, sizes in {"a": [3000, 70000, 5], "b": [], "c": [65536] * 6}.items()}  # fmt: skip
    hashing = _Hashing("crc32", threads=2, held_bytes=100000)  # a few pieces: update waits for the hashing
    try:
        digests = {}
        for name, pieces in tensors.items():
            stream = hashing.begin()
            for piece in pieces:
                hashing.update(stream, piece, held=True)
            digests[name] = hashing.end(stream)
        for name, pieces in tensors.items():
            assert digests[name].result() == f"{zlib.crc32(b''.join(p.tobytes() for p in pieces)):08x}"
        assert hashing._held == 0
        hashing.begin()  # one never ended (a failed save or load): closing drops it and returns
    finally:
        hashing.close()


def test_a_truncated_file_is_refused(saved):
    model, path = saved
    data = path.read_bytes()
    for cut in (len(data) - 100, 20, 4):
        path.write_bytes(data[:cut])
        with pytest.raises(CacheFileError, match="truncated or corrupted"):
            OffloadCache.load(path, model)


def test_a_flipped_byte_fails_its_checksum_and_builds_nothing(saved):
    model, path = saved
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    index = json.loads(data[8:header])
    start, end = index["layers.1.blocks"]["data_offsets"]
    data[header + (start + end) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    before = _live_stores()
    with pytest.raises(CacheFileError, match=r"data of tensor 'layers\.1\.blocks' does not match its checksum"):
        OffloadCache.load(path, model)
    assert _live_stores() == before  # layer 0 was built before the checksum of layer 1 failed: freed again


def test_a_failed_read_on_a_hashing_thread_fails_the_load_and_builds_nothing(saved, monkeypatch):
    model, path = saved
    preadv, calls = os.preadv, []

    def failing(fd, buffers, offset):  # the blocks of the later layers are read on the hashing threads
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(5, "Input/output error")
        return preadv(fd, buffers, offset)

    before = _live_stores()
    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(OSError, match="Input/output error"):
        OffloadCache.load(path, model)
    monkeypatch.undo()
    assert len(calls) > 3 and _live_stores() == before
    assert OffloadCache.load(path, model).get_seq_length() > 0


def test_an_edited_header_fails_the_header_checksum(saved):
    model, path = saved
    _edit(path, b'\\"n_tokens\\": 42', b'\\"n_tokens\\": 44')
    with pytest.raises(CacheFileError, match="header does not match the header's checksum"):
        OffloadCache.load(path, model)


def test_an_unknown_format_version_says_which_reads_it(saved):
    model, path = saved
    _edit(path, b'"hf_offload.version":"2"', b'"hf_offload.version":"9"')
    with pytest.raises(CacheFileError, match=r"format version '9'.*reads versions 1, 2\."):
        OffloadCache.load(path, model)


def test_other_files_are_refused(saved, tmp_path):
    model, _ = saved
    other = tmp_path / "weights.safetensors"
    save_file({"x": torch.zeros(3)}, other)
    with pytest.raises(CacheFileError, match="not a saved OffloadCache"):
        OffloadCache.load(other, model)
    with pytest.raises(FileNotFoundError, match="No cache file"):
        OffloadCache.load(tmp_path / "missing.safetensors", model)


def test_save_never_replaces_a_file_unless_told(saved):
    model, path = saved
    cache, _, _ = _prefilled(model, BUDGETS["sparse"])
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        cache.save(path)
    assert path.read_bytes() == before
    cache.save(path, overwrite=True)
    assert OffloadCache.load(path, model).config.budget_tokens == BUDGETS["sparse"]["budget_tokens"]
    with pytest.raises(IsADirectoryError, match="give a file name"):
        cache.save(path.parent, overwrite=True)


def test_save_where_it_cannot_write_leaves_nothing(tmp_path, monkeypatch):
    model = build_model("llama")
    cache, _, _ = _prefilled(model, BUDGETS["full"])
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        cache.save(tmp_path / "no" / "such" / "dir" / "cache.safetensors")
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(PermissionError, match="cannot write in .*choose a writable directory"):
        cache.save(tmp_path / "cache.safetensors")
    monkeypatch.undo()
    # A write that fails part-way (a full disk) removes its temporary file and leaves no file under the name.
    from hf_offload.store.host import HostBlockPool

    def full_disk(self, ids, max_blocks):
        yield self.chunks[0][:1]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(HostBlockPool, "runs", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cache.save(tmp_path / "cache.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a user that file permissions bind")
def test_save_into_a_read_only_directory(tmp_path):
    cache, _, _ = _prefilled(build_model("llama"), BUDGETS["full"])
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="choose a writable directory"):
            cache.save(tmp_path / "cache.safetensors")
    finally:
        tmp_path.chmod(0o700)


def test_the_weights_fingerprint_samples_within_large_parameters():
    """Sample positions are spaced in float32, which rounds past 2**24 elements: the last one must stay inside."""
    from hf_offload.cache.persist import _weights_hash

    module = torch.nn.Linear(1, 1)
    module.weight = torch.nn.Parameter(torch.zeros(2**24 + 4, dtype=torch.bfloat16), requires_grad=False)
    assert len(_weights_hash(module)) == 64
