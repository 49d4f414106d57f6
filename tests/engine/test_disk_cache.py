"""The converted-weights cache is keyed by contents (a reinstall reuses it) and held under a size cap."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tristream.engine import disk_cache
from tristream.engine.disk_cache import content_key, file_digest, prune


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "cache-root"))


def _write(p: Path, data: bytes, mtime: float | None = None) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    if mtime is not None:
        os.utime(p, (mtime, mtime))
    return p


def test_key_follows_contents_not_path_or_mtime(tmp_path: Path) -> None:
    a = _write(tmp_path / "venv1" / "model.bin", b"weights" * 1000, mtime=1_000_000)
    b = _write(tmp_path / "venv2" / "model.bin", b"weights" * 1000, mtime=2_000_000)
    c = _write(tmp_path / "venv3" / "model.bin", b"weightz" * 1000)
    assert file_digest(a) == file_digest(b) != file_digest(c)
    assert content_key([a], "m") == content_key([b], "m") != content_key([a], "other")
    # an edited file (new mtime) is hashed again, not served from the memo
    _write(a, b"changed", mtime=3_000_000)
    assert file_digest(a) != file_digest(b)


def test_digest_memo_survives_a_corrupt_index(tmp_path: Path) -> None:
    a = _write(tmp_path / "m.bin", b"x" * 100)
    first = file_digest(a)
    index = disk_cache.cache_root() / "digests.json"
    assert index.exists()
    index.write_text("{not json")
    assert file_digest(a) == first


def test_prune_removes_least_recently_used_and_keeps_the_entry_in_use(tmp_path: Path) -> None:
    root = tmp_path / "entries"
    now = time.time()
    old = _write(root / "old.safetensors", b"a" * 400, mtime=now - 300)
    mid = _write(root / "mid" / "model.safetensors", b"b" * 400, mtime=now - 200)
    os.utime(root / "mid", (now - 200, now - 200))
    keep = _write(root / "keep.safetensors", b"c" * 400, mtime=now - 1000)  # oldest, but in use
    stale = root / "x.123.tmp"
    stale.mkdir()
    os.utime(stale, (now - 7200, now - 7200))
    fresh_tmp = _write(root / "y.456.tmp", b"", mtime=now)  # a conversion still running
    removed = prune(root, keep=keep, limit=900)
    assert set(removed) == {stale, old}
    assert keep.exists() and mid.exists() and fresh_tmp.exists()
    assert prune(root, keep=keep, limit=100) == [mid.parent]  # over the cap: everything but `keep` goes
    assert keep.exists()


def test_bad_size_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.MAX_GB_ENV, "lots")
    with pytest.raises(ValueError, match="TRISTREAM_CACHE_MAX_GB"):
        disk_cache.max_bytes()


def test_reinstalled_gguf_reuses_its_converted_folder(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from tests.engine._tiny import tiny_hf_model
    from tests.engine.test_gguf import write_gguf
    from tristream.engine.gguf_loader import cached_gguf_folder

    hf = tiny_hf_model("llama", tmp_path / "hf", seed=5)
    first = tmp_path / "site1" / "tiny.gguf"
    first.parent.mkdir()
    write_gguf(hf, first, quant_ffn=False)
    cache = tmp_path / "gguf-cache"
    folder = cached_gguf_folder(first, cache_dir=cache)
    made = (folder / "model.safetensors").stat().st_mtime_ns
    second = tmp_path / "site2" / "tiny.gguf"  # a fresh venv: same bytes, new path and mtime
    second.parent.mkdir()
    shutil.copy(first, second)
    os.utime(second, (time.time() + 5, time.time() + 5))
    assert cached_gguf_folder(second, cache_dir=cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == made  # not converted again
    assert [p.name for p in cache.iterdir()] == [folder.name]
