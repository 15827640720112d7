"""Reading LongBench records (``input, context, answers, length, dataset, language, all_classes, _id``).

A source is one of:

* a folder holding ``{dataset}.jsonl`` / ``{dataset}_e.jsonl`` (directly or under ``data/``, as in the release zip);
* a ``.zip`` file or URL (the release's ``data.zip``, :data:`~eval_harness.longbench.config.DATA_URL`; a zip URL is
  downloaded once into ``$HF_OFFLOAD_CACHE`` or ``~/.cache/hf_offload``);
* an ``http(s)://`` URL of a folder holding the jsonl files.

With the optional ``datasets`` package the files are read through ``datasets.load_dataset("json", data_files=...)``
(which caches downloads); without it, through the standard library (``json``, ``zipfile``, ``urllib``).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import urllib.request
import warnings
import zipfile
from pathlib import Path

from .config import DATA_URL, FIELDS


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def _file_name(task: str, e: bool) -> str:
    return f"{task}_e.jsonl" if e else f"{task}.jsonl"


def locate(source: str | None, task: str, e: bool) -> tuple[str, str | None]:
    """Where a dataset's records are: ``(path or URL, member inside a zip or None)``.

    Raises:
        FileNotFoundError: a local source does not hold the file (the message lists where it looked).
    """
    source = DATA_URL if source is None else str(source)
    name = _file_name(task, e)
    if source.endswith(".zip"):
        if _is_url(source):
            source = str(cached_download(source))
        elif not Path(source).is_file():
            raise FileNotFoundError(f"LongBench zip {source} does not exist; point `data` at the release's data.zip")
        return source, f"data/{name}"
    if _is_url(source):
        return f"{source.rstrip('/')}/{name}", None
    folder = Path(source)
    for candidate in (folder / name, folder / "data" / name):
        if candidate.is_file():
            return str(candidate), None
    raise FileNotFoundError(
        f"no {name} in {folder} or {folder / 'data'}; point `data` at a folder of LongBench jsonl files, the "
        f"release's data.zip, or a URL (default: {DATA_URL})"
    )


def _check(records: list[dict], where: str) -> list[dict]:
    for i, record in enumerate(records):
        missing = [f for f in FIELDS if f not in record]
        if missing:
            raise ValueError(
                f"{where}: record {i} lacks the LongBench field(s) {', '.join(missing)} (every record needs "
                f"{', '.join(FIELDS)})"
            )
        if not isinstance(record["answers"], list) or not record["answers"]:
            raise ValueError(f"{where}: record {i} ({record['_id']}) needs a non-empty list of answers")
    return records


def _parse_jsonl(text: str, where: str) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}, line {n}: not valid JSON ({err})") from None
    return records


@functools.lru_cache(maxsize=2)
def _download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=600) as response:
        return response.read()


def cache_dir() -> Path:
    """Where downloaded zips are kept: ``$HF_OFFLOAD_CACHE`` or ``~/.cache/hf_offload``."""
    return Path(os.environ.get("HF_OFFLOAD_CACHE") or Path.home() / ".cache" / "hf_offload")


def cached_download(url: str) -> Path:
    """Download ``url`` once into :func:`cache_dir` (a later call reuses the file) and return the local path."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    path = cache_dir() / "longbench" / f"{digest}-{Path(url.split('?')[0]).name}"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(path.suffix + ".part")
        with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f, length=1 << 20)
        partial.replace(path)
    return path


def _read_stdlib(location: str, member: str | None) -> list[dict]:
    where = f"{location}::{member}" if member else location
    if member is not None:
        raw = _download(location) if _is_url(location) else Path(location).read_bytes()
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            if member not in archive.namelist():
                raise FileNotFoundError(f"{location} has no {member}")
            return _parse_jsonl(archive.read(member).decode("utf-8"), where)
    raw = _download(location) if _is_url(location) else Path(location).read_bytes()
    return _parse_jsonl(raw.decode("utf-8"), where)


def _read_datasets(location: str, member: str | None) -> list[dict]:
    from datasets import load_dataset

    data_files = f"zip://{member}::{location}" if member is not None else location
    return [dict(row) for row in load_dataset("json", data_files=data_files, split="train")]


def load_records(source: str | None, task: str, e: bool = False, use_datasets: bool | None = None) -> list[dict]:
    """All records of one LongBench (or LongBench-E, ``e=True``) dataset, checked for the LongBench fields.

    Args:
        source: folder, zip or URL (see the module docstring); ``None`` = the release's ``data.zip``.
        task: dataset name, e.g. ``"qasper"``.
        e: read the LongBench-E file ``{task}_e.jsonl``.
        use_datasets: read through ``datasets`` (``None``: when it is installed).
    """
    location, member = locate(source, task, e)
    if use_datasets is None:
        try:
            import datasets  # noqa: F401

            use_datasets = True
        except ImportError:
            use_datasets = False
    records = None
    if use_datasets:
        try:
            records = _read_datasets(location, member)
        except ImportError as err:  # e.g. fsspec's HTTP file system needs aiohttp, which datasets may not pull in
            if not _is_url(location):
                raise
            warnings.warn(
                f"datasets could not read {location} ({err}); reading it with the standard library", stacklevel=2
            )
    if records is None:
        records = _read_stdlib(location, member)
    return _check(records, f"{location}::{member}" if member else location)
