"""Results files stored plain or gzip-compressed (``name.jsonl`` or ``name.jsonl.gz``, ``.json`` or ``.json.gz``).

Runs write plain files; the large ones are committed compressed (``gzip -9 -n``, see ``results/README.md``). Every
reader of ``results/`` goes through these functions, so a file reads the same under either name.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

GZ = ".gz"


def plain_name(path) -> str:
    """The file's name without a ``.gz`` suffix (``a.jsonl.gz`` -> ``a.jsonl``)."""
    name = Path(path).name
    return name[: -len(GZ)] if name.endswith(GZ) else name


def stored(path) -> Path:
    """``path`` itself if it exists, else its ``.gz`` twin if that exists, else ``path`` (for the caller's error)."""
    path = Path(path)
    if path.exists() or path.name.endswith(GZ):
        return path
    twin = path.with_name(path.name + GZ)
    return twin if twin.exists() else path


def open_text(path):
    """Open a results file for reading text (UTF-8), decompressing a ``.gz`` file; a plain name missing on disk
    opens its ``.gz`` twin."""
    path = stored(path)
    if path.name.endswith(GZ):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def read_text(path) -> str:
    """The whole text of a results file (see :func:`open_text`)."""
    with open_text(path) as f:
        return f.read()


def read_json(path):
    """A JSON results file, parsed (see :func:`open_text`)."""
    return json.loads(read_text(path))


def find(folder, pattern: str) -> list[Path]:
    """The files of ``folder`` matching ``pattern`` (e.g. ``"*.jsonl"``) under their plain or ``.gz`` name.

    One path per plain name (the plain file where both exist), in order of the plain names, so compressing a file
    changes neither what is read nor in which order.
    """
    folder = Path(folder)
    found: dict[str, Path] = {}
    for path in [*folder.glob(pattern + GZ), *folder.glob(pattern)]:  # a plain file replaces its .gz twin
        if path.is_file():
            found[plain_name(path)] = path
    return [found[name] for name in sorted(found)]
