"""The on-disk cache for converted weights (dequantised GGUF folders, quantised tensors).

Entries are keyed by the *contents* of their source files, never by path or modification time,
so a reinstall, a fresh virtual environment or a copied checkpoint reuses the entry instead of
writing another one. Hashing a large file once per copy is remembered in a small index keyed by
(path, size, mtime), so later loads stat the file and nothing more. Each cache folder is held
under a size cap (``$TRISTREAM_CACHE_MAX_GB``, default 20) by removing the least recently used
entries; the entry just used is never removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

CACHE_ENV = "TRISTREAM_CACHE"
MAX_GB_ENV = "TRISTREAM_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
_INDEX = "digests.json"
_INDEX_MAX = 512


def cache_root() -> Path:
    """$TRISTREAM_CACHE, else $XDG_CACHE_HOME/tristream, else ~/.cache/tristream."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tristream"


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:  # a read-only or full cache only costs a re-hash next time
        tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's contents, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def file_digest(path: Path, index_dir: Path | None = None) -> str:
    """sha256 of `path`'s contents, remembered per (path, size, mtime) in `index_dir`."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = (index_dir or cache_root()) / _INDEX
    index = _read_index(index_path)
    if stamp in index:
        return index[stamp]
    digest = sha256_file(path)
    index = _read_index(index_path)  # another process may have written meanwhile
    index[stamp] = digest
    if len(index) > _INDEX_MAX:
        index = dict(list(index.items())[-_INDEX_MAX:])
    _write_atomic(index_path, json.dumps(index))
    return digest


def content_key(files: Iterable[Path], *parts: str, length: int = 20) -> str:
    """A short key from the contents of `files` (in the given order) and extra `parts`."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_digest(f).encode() + b"\0")
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:length]


def _size(p: Path) -> int:
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        return p.stat().st_size
    except OSError:
        return 0


def touch(p: Path) -> None:
    """Mark an entry as just used (its mtime orders the LRU pruning)."""
    try:
        os.utime(p)
    except OSError:
        pass


def max_bytes() -> int:
    raw = os.environ.get(MAX_GB_ENV)
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        raise ValueError(f"${MAX_GB_ENV} must be a number of GB, got {raw!r}") from None
    return int(gb * (1 << 30))


def prune(folder: Path, keep: Path, limit: int | None = None, stale_tmp_s: float = 3600.0) -> list[Path]:
    """Remove the least recently used entries of `folder` until it fits `limit` bytes.

    `keep` (the entry in use) is never removed. Partial writes (``*.tmp``) older than
    `stale_tmp_s` go first: they are left by a conversion that was killed. Returns what was removed.
    """
    limit = max_bytes() if limit is None else limit
    try:
        entries = [p for p in folder.iterdir() if p.name != _INDEX]
    except OSError:
        return []
    now = time.time()
    removed: list[Path] = []

    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    def remove(p: Path) -> None:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)

    live = []
    for p in entries:
        if p.name.endswith(".tmp"):  # a write in progress, or a stale one left by a killed process
            if now - mtime(p) > stale_tmp_s:
                remove(p)
        elif p.resolve() != keep.resolve():
            live.append(p)
    sizes = {p: _size(p) for p in live}
    total = sum(sizes.values()) + _size(keep)
    for p in sorted(live, key=mtime):
        if total <= limit:
            break
        remove(p)
        total -= sizes[p]
    return removed
