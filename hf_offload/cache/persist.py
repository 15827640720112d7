"""One safetensors file per cache: :meth:`OffloadCache.save <hf_offload.cache.OffloadCache.save>` and
:meth:`OffloadCache.load <hf_offload.cache.OffloadCache.load>`.

The file is a plain safetensors file (``safetensors.safe_open`` and ``load_file`` read it; nothing is pickled). Its
tensors, per layer ``i`` of the model:

* offloaded layers: ``layers.{i}.blocks`` ``[n, 2, kv_heads, block_tokens, head_dim]``, the sealed blocks that the
  layer's sequences refer to, each once (a block shared by several sequences, e.g. after beam search or a fork, is
  stored once); ``layers.{i}.block_table`` ``[batch, n_blocks]``, ``int64``: for each sequence and block, its row of
  ``blocks``; ``layers.{i}.open_keys`` / ``open_values`` ``[batch, kv_heads, n_tokens - n_blocks * block_tokens,
  head_dim]``: the open block; ``layers.{i}.summaries.{name}`` ``[batch, n_blocks, ...]``: the selector's summaries.
* dense sliding-window layers (hybrid models): ``layers.{i}.keys`` / ``values``.

The metadata (``__metadata__``, strings) holds the format name and version, the cache's state (settings, lengths
and positions of every layer), a fingerprint of the model (architecture, layer types, head shapes, dtype and a
SHA-256 of a sample of its weights), one SHA-256 per tensor, and a SHA-256 of the header itself.

Saving streams: the header (every shape is known up front) is written first with placeholders for the checksums,
then each tensor in file order, the blocks run by run straight from the host pool's chunks (views, not copies), each
hashed as it goes; the header is then rewritten in place with the checksums (the same length). At no point does a
second copy of the KV exist in memory: the largest piece held is one run of blocks of one host chunk
(``host_chunk_mib``), or one layer's summaries. One file rather than one per layer keeps a saved cache one thing to
move, and lets the official parser validate it whole (offsets, sizes, truncation). The file is written under a
temporary name in the target's directory and renamed when complete, so a failed save leaves nothing behind and
never a partial file under the name.

Loading checks everything that can be checked before anything is built (the format and version, the header's
checksum, the fingerprint against the model, every tensor's shape), then builds the cache layer by layer, the
blocks run by run from the memory-mapped file, each tensor checked against its checksum; an error at any point
frees what was built, so a failed load leaves no cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "hf-offload-cache"
FORMAT_VERSION = 1
"""The version of the file format this hf-offload writes and reads."""

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_HASH_HEX = 64  # characters of a SHA-256 hex digest
_PLACEHOLDER = "0" * _HASH_HEX
_WEIGHT_SAMPLE_PARAMS = 8  # parameters of the model the fingerprint hashes a sample of
_WEIGHT_SAMPLE_ELEMENTS = 4096  # elements of each, spread over the whole tensor


class CacheFileError(ValueError):
    """A cache file that cannot be loaded (not a cache file, truncated, corrupted, an unknown format version) or
    that belongs to another model; the message says what to change. Nothing was built."""


# --------------------------------------------------------------------------------------------------- fingerprint
def model_fingerprint(model: torch.nn.Module, text_config, types: list[str]) -> dict:
    """What identifies the model a cache was filled by: its class, layer types and head shapes, dtype and a SHA-256
    of a sample of its weights (``_WEIGHT_SAMPLE_ELEMENTS`` elements spread over each of ``_WEIGHT_SAMPLE_PARAMS``
    parameters spread over the model; the same on any device).

    Args:
        model: the transformers model.
        text_config: its decoder text config.
        types: its layer types (:func:`~hf_offload.cache.container.layer_types`).
    """
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return {
        "architecture": type(model).__name__,
        "model_type": text_config.model_type,
        "layer_types": list(types),
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "hidden_size": text_config.hidden_size,
        "vocab_size": text_config.vocab_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights_sha256": _weights_hash(model),
    }


def _weights_hash(model: torch.nn.Module) -> str:
    params = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta"]
    if not params:
        return ""
    picks = sorted(
        {round(i * (len(params) - 1) / max(_WEIGHT_SAMPLE_PARAMS - 1, 1)) for i in range(_WEIGHT_SAMPLE_PARAMS)}
    )
    digest = hashlib.sha256()
    with torch.no_grad():
        for i in picks:
            name, p = params[i]
            flat = p.detach().reshape(-1)
            index = torch.linspace(0, flat.numel() - 1, min(_WEIGHT_SAMPLE_ELEMENTS, flat.numel()), device=flat.device)
            # float32 rounds indices past 2**24: the last one can land one past the end.
            sample = flat[index.long().clamp_(max=flat.numel() - 1)].cpu().contiguous()
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_fingerprint(saved: dict, model: torch.nn.Module, text_config, types: list[str], path: Path) -> None:
    """Raise :class:`CacheFileError` naming what differs if ``model`` is not the model the file was saved from."""
    now = model_fingerprint(model, text_config, types)
    differ = [key for key in sorted(set(saved) | set(now)) if saved.get(key) != now.get(key)]
    if not differ:
        return
    shapes = [key for key in differ if key != "weights_sha256"]
    if shapes:
        what = "; ".join(f"{key}: file {saved.get(key)!r}, model {now.get(key)!r}" for key in shapes)
        detail = f"a {saved.get('architecture')} ({saved.get('model_type')}) model of other shapes or dtype ({what})"
    else:
        detail = (f"a {saved.get('architecture')} of the same shapes and dtype but other weights (another checkpoint "
                  "or fine-tune)")  # fmt: skip
    raise CacheFileError(
        f"{path} holds the KV cache of {detail}. Its keys and values mean nothing to this model: load it with the "
        "model it was saved from (same checkpoint and dtype), or prefill the prompt again with this one."
    )


# ------------------------------------------------------------------------------------------------------- settings
def config_dict(config) -> dict:
    """The settings of ``config`` (an :class:`~hf_offload.config.OffloadConfig`) as JSON values, the selector by the
    name (with settings) that :func:`~hf_offload.selectors.get_selector` builds it from again.

    Raises:
        ValueError: for a selector instance that no registered name rebuilds.
    """
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values["selector"] = selector_spec(values["selector"])
    # A directory of this machine: a load names its own (OffloadCache.load(path, model, disk_dir=...)).
    values["disk_dir"] = values["disk_memory_gib"] = None
    return values


def selector_spec(selector) -> str:
    """A registered name with settings (``"quantkey[bits=4]"``) that builds ``selector`` again."""
    from ..selectors import SELECTORS, get_selector

    if isinstance(selector, str):
        return selector
    cls = type(selector)
    settings = []
    if dataclasses.is_dataclass(selector):
        for f in dataclasses.fields(selector):
            value = getattr(selector, f.name)
            if f.init and value != getattr(cls, f.name, dataclasses.MISSING):
                settings.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    spec = cls.name + (f"[{','.join(settings)}]" if settings else "")
    try:
        rebuilt = get_selector(spec) if SELECTORS.get(cls.name) is cls else None
    except (TypeError, ValueError):
        rebuilt = None
    if rebuilt is None or type(rebuilt) is not cls or (dataclasses.is_dataclass(selector) and rebuilt != selector):
        raise ValueError(
            f"The cache's selector {selector!r} cannot be written to a file: a file names its selector, and no "
            f"registered name with settings builds this one again (tried {spec!r}). Register its class "
            "(hf_offload.register_selector) and give it dataclass fields for its settings."
        )
    return spec


# ------------------------------------------------------------------------------------------------------ writing
@dataclass
class Entry:
    """One tensor of a file to write.

    Attributes:
        name: its name in the file.
        dtype: its dtype.
        shape: its shape.
        pieces: returns the tensor's data in order, as CPU tensors of ``dtype`` (any shapes) whose bytes
            concatenated are the tensor's, row-major.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def write_file(path: Path, entries: list[Entry], metadata: dict[str, str], overwrite: bool) -> None:
    """Write a safetensors file of ``entries`` (in that order) and ``metadata`` with checksums, streaming.

    The header is written first (checksums as placeholders), then each entry's pieces, hashed as they go, and the
    header again with the checksums; all under a temporary name in ``path``'s directory, renamed to ``path`` at the
    end (``os.replace``). Any failure removes the temporary file and leaves ``path`` as it was.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
        OSError: the directory does not exist or is not writable, or a write failed (disk full).
    """
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it, or choose another path.")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; save(path) writes one file: give a file name.")
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"Cannot save to {path}: the directory {directory} does not exist; create it first.")
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=directory)
    except OSError as err:
        raise type(err)(err.errno, f"Cannot save to {path}: cannot write in {directory} ({err.strerror}); choose "
                                   "a writable directory") from err  # fmt: skip
    try:
        with os.fdopen(handle, "wb") as f:
            checksums = {entry.name: _PLACEHOLDER for entry in entries}
            header = _header(entries, metadata, checksums)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            with ThreadPoolExecutor(1, thread_name_prefix="hf-offload-sha256") as hasher:
                for entry in entries:
                    checksums[entry.name] = _write_entry(f, entry, hasher)
            final = _header(entries, metadata, checksums)
            assert len(final) == len(header), "checksums are fixed-length hex digests"
            f.seek(8)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _write_entry(f, entry: Entry, hasher: ThreadPoolExecutor) -> str:
    """Write ``entry``'s pieces to ``f``; each piece is hashed on ``hasher``'s thread while it is written (hashlib
    and file writes release the GIL), so a save takes the longer of the two, not their sum."""
    digest = hashlib.sha256()
    written = 0
    hashing: Future | None = None
    for piece in entry.pieces():
        if piece.dtype != entry.dtype or piece.device.type != "cpu":
            raise TypeError(f"{entry.name}: a piece of {piece.dtype} on {piece.device}, not {entry.dtype} on the CPU")
        data = piece.contiguous().view(torch.uint8).numpy() if piece.numel() else b""
        if hashing is not None:
            hashing.result()  # in order: the previous piece is in the digest before this one
        hashing = hasher.submit(digest.update, data)
        f.write(data)
        written += piece.numel() * piece.element_size()
    if hashing is not None:
        hashing.result()
    if written != entry.nbytes:
        raise RuntimeError(f"{entry.name}: wrote {written} bytes for a tensor of {entry.nbytes}; the cache changed "
                           "while it was saved (save between forwards only)")  # fmt: skip
    return digest.hexdigest()


def _header(entries: list[Entry], metadata: dict[str, str], checksums: dict[str, str]) -> bytes:
    """The safetensors header: the tensor index, then the metadata with the checksums and the header's own SHA-256
    (over the canonical JSON of everything else), padded with spaces to a multiple of 8 bytes."""
    index, offset = {}, 0
    for entry in entries:
        index[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [offset, offset + entry.nbytes]}  # fmt: skip
        offset += entry.nbytes
    meta = dict(metadata, **{"hf_offload.checksums": json.dumps(checksums, sort_keys=True)})
    index["__metadata__"] = meta
    meta["hf_offload.header_sha256"] = _header_hash(index)
    data = json.dumps(index, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % 8)


def _header_hash(header: dict) -> str:
    """SHA-256 of the canonical JSON of a parsed header without its own hash."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "hf_offload.header_sha256"}
    canonical = json.dumps(dict(header, __metadata__=meta), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------------ reading
class CacheFile:
    """A cache file opened for loading, its header checked: format, version, header checksum, tensor index.

    Attributes:
        path: the file.
        state: the cache's state as :meth:`OffloadCache.save` wrote it (settings, fingerprint, layers).

    Raises:
        CacheFileError: not a cache file, an unknown format version, a truncated or corrupted file.
        FileNotFoundError: no file at ``path``.
    """

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"No cache file at {path}.")
        header = self._raw_header()
        meta = header.get("__metadata__") or {}
        if meta.get("hf_offload.format") != FORMAT:
            raise CacheFileError(f"{path} is a safetensors file but not a saved OffloadCache (no "
                                 f"'hf_offload.format': {FORMAT!r} in its metadata); write one with cache.save(path).")  # fmt: skip
        version = meta.get("hf_offload.version")
        if version != str(FORMAT_VERSION):
            from .. import __version__

            raise CacheFileError(
                f"{path} is an OffloadCache file of format version {version!r}; this hf-offload ({__version__}) reads "
                f"version {FORMAT_VERSION} only. Load it with the hf-offload that wrote it (its state says "
                f"{self._writer(meta)!r}) and save it again from there, or prefill the prompt again."
            )
        if meta.get("hf_offload.header_sha256") != _header_hash(header):
            raise self._corrupted("its header does not match the header's checksum")
        try:
            self._file = safe_open(str(path), framework="pt")
        except Exception as err:  # safetensors raises its own error type for every malformed file
            raise self._corrupted(f"safetensors cannot read it: {err}") from err
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hf-offload-sha256")
        self.state = json.loads(meta["hf_offload.state"])
        self.checksums = json.loads(meta["hf_offload.checksums"])
        self.shapes = {name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"}

    @staticmethod
    def _writer(meta: dict) -> str:
        """The hf-offload version the state of a file's metadata names, or ``"?"``."""
        try:
            return json.loads(meta.get("hf_offload.state", "{}")).get("hf_offload_version", "?")
        except ValueError:
            return "?"

    def _raw_header(self) -> dict:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > size - 8:
                raise self._corrupted(f"its header is cut short ({size} bytes in all)")
            try:
                header = json.loads(f.read(length))
            except ValueError as err:
                raise self._corrupted(f"its header is not valid JSON ({err})") from err
        if not isinstance(header, dict):
            raise self._corrupted("its header is not a JSON object")
        return header

    def _corrupted(self, why: str) -> CacheFileError:
        return CacheFileError(
            f"{self.path} is truncated or corrupted: {why}. Nothing was loaded; save the cache again (or copy the "
            "file again if it was moved)."
        )

    def expect(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        """Raise :class:`CacheFileError` unless the file holds tensor ``name`` of ``shape`` (and ``dtype``)."""
        if self.shapes.get(name) != tuple(shape):
            raise self._corrupted(f"tensor {name!r} has shape {self.shapes.get(name)}, its state says {tuple(shape)}")
        if dtype is not None and self._file.get_slice(name).get_dtype() != _DTYPES.get(dtype):
            raise self._corrupted(f"tensor {name!r} is not of {dtype}")

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (CPU; at least one dimension), checked against its checksum."""
        (tensor,) = self.pieces(name, rows=max(self.shapes[name][0], 1))
        return tensor

    def pieces(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """Tensor ``name`` (CPU; at least one dimension) in pieces of at most ``rows`` rows along its first
        dimension, read from the memory-mapped file; after the last piece the whole is checked against its checksum
        (a mismatch raises :class:`CacheFileError` then: the caller discards what it built from the pieces)."""
        view = self._file.get_slice(name)
        digest = hashlib.sha256()
        start, total = 0, self.shapes[name][0]
        hashing: Future | None = None
        while True:
            piece = view[start : start + rows]
            if hashing is not None:
                hashing.result()
            if piece.numel():  # hashed on a thread while the caller copies the piece out
                hashing = self._hasher.submit(digest.update, piece.contiguous().view(torch.uint8).numpy())
            yield piece
            start += rows
            if start >= total:
                break
        if hashing is not None:
            hashing.result()
        if digest.hexdigest() != self.checksums.get(name):
            raise self._corrupted(f"the data of tensor {name!r} does not match its checksum")

    def close(self) -> None:
        """Unmap the file."""
        self._hasher.shutdown()
        self._file.__exit__(None, None, None)

    def __enter__(self) -> "CacheFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------- the cache
LAYOUT_SETTINGS = ("block_tokens", "selector")
"""Settings a loaded cache cannot change: they fix the blocks and summaries in the file."""


def save_cache(cache, path: Path, overwrite: bool) -> None:
    """Write ``cache`` (an :class:`~hf_offload.cache.OffloadCache`) to ``path``; see ``OffloadCache.save``."""
    from .. import __version__
    from .container import layer_types
    from .layer import OffloadLayer

    cache._check_usable()
    model = cache._model_ref()
    if model is None:
        raise RuntimeError("The model this OffloadCache was built for has been freed; save() fingerprints the model.")
    config = config_dict(cache.config)
    entries: list[Entry] = []
    layers = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, OffloadLayer):
            layers.append(_offload_entries(layer.blocks, f"layers.{i}", entries))
        else:
            layers.append(_sliding_entries(layer, f"layers.{i}", entries))
    state = {
        "hf_offload_version": __version__,
        "config": config,
        "fingerprint": model_fingerprint(model, cache.model_config, layer_types(cache.model_config)),
        "layers": layers,
    }
    metadata = {"hf_offload.format": FORMAT, "hf_offload.version": str(FORMAT_VERSION),
                "hf_offload.state": json.dumps(state, sort_keys=True)}  # fmt: skip
    write_file(path, entries, metadata, overwrite)


def _tensor(tensor: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
    """The pieces of a small tensor (an open block, a summary, a table): the whole of it, copied to the CPU when
    written."""
    return lambda: iter([tensor.detach().cpu()])


def _offload_entries(store, prefix: str, entries: list[Entry]) -> dict:
    """Append the tensors of an offloaded layer's block store to ``entries``; return its state."""
    if not store.is_initialized:
        return {"kind": "offload", "batch": None}
    store.wait_host_writes()  # the kernel path writes sealed blocks on a side stream
    used, index = torch.unique(store.block_table, return_inverse=True)
    host = store.host
    entries.append(Entry(f"{prefix}.blocks", store.dtype, (len(used), *host.block_shape),
                         lambda: host.runs(used, host.chunk_blocks)))  # fmt: skip
    entries.append(Entry(f"{prefix}.block_table", torch.int64, tuple(index.shape), _tensor(index)))
    for name, tensor in (("open_keys", store.keys), ("open_values", store.values)):
        entries.append(Entry(f"{prefix}.{name}", store.dtype, tuple(tensor.shape), _tensor(tensor)))
    for name in sorted(store.summaries):
        summary = store.summaries[name]
        entries.append(Entry(f"{prefix}.summaries.{name}", summary.dtype, tuple(summary.shape), _tensor(summary)))
    return {
        "kind": "offload",
        "batch": store.batch,
        "kv_heads": store.kv_heads,
        "head_dim": store.head_dim,
        "dtype": str(store.dtype).removeprefix("torch."),
        "n_tokens": store.n_tokens,
        "n_blocks": store.n_blocks,
        "summaries": sorted(store.summaries),
    }


def _sliding_entries(layer, prefix: str, entries: list[Entry]) -> dict:
    """Append the tensors of a dense sliding-window layer to ``entries``; return its state."""
    state = {"kind": "sliding", "sliding_window": layer.sliding_window, "initialized": bool(layer.is_initialized),
             "cumulative_length": int(layer.cumulative_length)}  # fmt: skip
    if layer.is_initialized:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            entries.append(Entry(f"{prefix}.{name}", tensor.dtype, tuple(tensor.shape), _tensor(tensor)))
    return state


def load_cache(cls, path: Path, model: torch.nn.Module, overrides: dict):
    """A new ``cls`` (:class:`~hf_offload.cache.OffloadCache`) for ``model`` holding the cache saved at ``path``;
    see ``OffloadCache.load``."""
    from ..config import OffloadConfig
    from .container import _check_model, layer_types

    fixed = sorted(set(overrides) & set(LAYOUT_SETTINGS))
    if fixed:
        raise ValueError(f"A loaded cache keeps the {', '.join(fixed)} it was saved with (they fix the blocks and "
                         "summaries in the file); leave them out, or prefill a new OffloadCache with them.")  # fmt: skip
    text_config = _check_model(model)
    with CacheFile(path) as file:
        state = file.state
        types = layer_types(text_config)
        check_fingerprint(state["fingerprint"], model, text_config, types, path)
        config = OffloadConfig(**state["config"])
        config = config.replace(**overrides) if overrides else config
        layers = state["layers"]
        _check_layers(file, layers, types, config.block_tokens)
        devices = _layer_devices(model)
        cache = cls(model, config=config)
        try:
            for i, layer_state in enumerate(layers):
                device = devices.get(i, model.device)
                if layer_state["kind"] == "offload":
                    _load_offload(cache.layers[i], layer_state, file, f"layers.{i}", device)
                else:
                    cache.layers[i] = _load_sliding(layer_state, file, f"layers.{i}", device)
        except BaseException:
            cache.reset()  # frees the pools of the layers built so far: a failed load leaves no cache
            raise
    return cache


def _layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """The device of each decoder layer's parameters, by layer index (a model spread over devices)."""
    from ..patches.layers import decoder_layers

    devices = {}
    for module, idx in decoder_layers(model):
        param = next(module.parameters(), None)
        if param is not None:
            devices[idx] = param.device
    return devices


def _check_layers(file: CacheFile, layers: list[dict], types: list[str], block_tokens: int) -> None:
    """Raise :class:`CacheFileError` unless the file's layers are the model's and hold tensors of their shapes."""
    kinds = ["offload" if kind == "full_attention" else "sliding" for kind in types]
    if [layer["kind"] for layer in layers] != kinds:
        raise file._corrupted(f"its layers ({[layer['kind'] for layer in layers]}) are not the model's ({kinds})")
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}"
        if layer["kind"] == "sliding":
            if layer["initialized"]:
                shape = file.shapes.get(f"{prefix}.keys")
                file.expect(f"{prefix}.keys", shape or ())
                file.expect(f"{prefix}.values", shape or ())
            continue
        if layer["batch"] is None:
            continue
        batch, heads, dim, n_blocks = layer["batch"], layer["kv_heads"], layer["head_dim"], layer["n_blocks"]
        dtype = getattr(torch, layer["dtype"])
        blocks = file.shapes.get(f"{prefix}.blocks") or (0,)
        file.expect(f"{prefix}.blocks", (blocks[0], 2, heads, block_tokens, dim), dtype)
        file.expect(f"{prefix}.block_table", (batch, n_blocks), torch.int64)
        left = layer["n_tokens"] - n_blocks * block_tokens
        if not 0 <= left < block_tokens:
            raise file._corrupted(f"layer {i} holds {layer['n_tokens']} tokens in {n_blocks} blocks of {block_tokens}")
        for name in ("open_keys", "open_values"):
            file.expect(f"{prefix}.{name}", (batch, heads, left, dim), dtype)
        for name in layer["summaries"]:
            shape = file.shapes.get(f"{prefix}.summaries.{name}") or ()
            if tuple(shape[:2]) != (batch, n_blocks):
                raise file._corrupted(f"summary {name!r} of layer {i} has shape {shape}")


def _load_offload(layer, state: dict, file: CacheFile, prefix: str, device: torch.device) -> None:
    """Fill an empty offloaded layer from the file: host blocks run by run, then the tables, summaries and the open
    block (:meth:`~hf_offload.cache.blocks.BlockStore.adopt`)."""
    if state["batch"] is None:
        return
    dtype = getattr(torch, state["dtype"])
    empty = torch.empty(state["batch"], state["kv_heads"], 0, state["head_dim"], dtype=dtype, device=device)
    layer.initialize_like(empty, empty)
    store = layer.blocks
    _check_summaries(store, state, file, prefix)
    n_used = file.shapes[f"{prefix}.blocks"][0]
    # Piece by piece: with a disk tier, chunks of earlier pieces spill while later ones are read.
    ids = store.host.store(piece for piece in file.pieces(f"{prefix}.blocks", store.host.chunk_blocks) if len(piece))
    index = file.read(f"{prefix}.block_table")
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < n_used):
        raise file._corrupted(f"{prefix}.block_table refers to blocks past the {n_used} stored")
    summaries = {name: file.read(f"{prefix}.summaries.{name}") for name in state["summaries"]}
    open_k, open_v = file.read(f"{prefix}.open_keys"), file.read(f"{prefix}.open_values")
    store.adopt(store.refer(ids, index), summaries, open_k, open_v, state["n_tokens"])


def _check_summaries(store, state: dict, file: CacheFile, prefix: str) -> None:
    """Raise :class:`CacheFileError` unless the file's summaries are the ones the cache's selector makes (names,
    dtypes, shapes per block)."""
    if not state["n_blocks"]:
        return
    block = torch.zeros(store.batch, 1, store.kv_heads, store.block_tokens, store.head_dim, dtype=store.dtype,
                        device=store.device)  # fmt: skip
    made = {name: (s.dtype, tuple(s.shape[2:])) for name, s in store.summaries_of(block, block).items()}
    saved = {}
    for name in state["summaries"]:
        tensor = file._file.get_slice(f"{prefix}.summaries.{name}")
        dtype = next((d for d, s in _DTYPES.items() if s == tensor.get_dtype()), None)
        saved[name] = (dtype, tuple(tensor.get_shape()[2:]))
    if saved != made:
        raise CacheFileError(
            f"{file.path}: the block summaries of {prefix} ({sorted(saved)}) are not what selector "
            f"{store.selector.name!r} makes now ({sorted(made)}): the selector changed since the file was written. "
            "Load it with the hf-offload that wrote it, or prefill the prompt again."
        )


def _load_sliding(state: dict, file: CacheFile, prefix: str, device: torch.device):
    """A dense sliding-window layer (transformers' own) holding the file's keys and values."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=state["sliding_window"])
    if state["initialized"]:
        keys = file.read(f"{prefix}.keys").to(device)
        values = file.read(f"{prefix}.values").to(device)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layer.cumulative_length = state["cumulative_length"]
    return layer
