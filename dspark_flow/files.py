"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# The process's umask, read once at import (reading it means setting it: not thread-safe later).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: Path, write: Callable[[IO[bytes]], object], durable: bool = False) -> Path:
    """Write `path` through a temporary file beside it and a rename.

    A reader, or another process writing the same file, sees the old file or the new one, never
    half of either; a failed write leaves the old file whole and no temporary behind (the
    temporary is `.<name>.<random>.tmp`, so a folder's `*.tmp` sweep also finds one a killed
    process left). The file gets the permissions a plain `open` would give (mkstemp's are
    private). `durable` syncs the data, and then the rename, to disk, for caches and datasets
    that should outlive a power cut, at the price of disk flushes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        sync_folder(path.parent)
    return path


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to disk where the system allows it (POSIX)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_files(folder: Path) -> None:
    """Flush every file in `folder`, then its entries, to disk: a folder written whole and then
    renamed into place (a checkpoint) survives a power cut as well as a crash."""
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    sync_folder(Path(folder))


def replace_folder(staged: Path, final: Path) -> None:
    """Put a folder written whole (`staged`) in place of `final`, durably: its files flushed
    before the rename, so a power cut leaves the old folder or the whole new one, and the
    parent's entries after it."""
    sync_files(staged)
    if final.exists():  # (a stale or half-deleted entry of an older run)
        shutil.rmtree(final)
    os.replace(staged, final)
    sync_folder(final.parent)


def acquire_saying_why(lock: Any, on_wait: Callable[[], object]) -> None:
    """Take a filelock `lock`; when another process still holds it after a second, call
    `on_wait` (to say why this one waits) and wait on."""
    from filelock import Timeout  # a huggingface_hub dependency, so always present

    try:
        lock.acquire(timeout=1)
    except Timeout:
        on_wait()
        lock.acquire()


def write_text_atomic(text: str, path: Path, durable: bool = False) -> Path:
    """`write_atomic` for UTF-8 text."""
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")), durable)


def unwritable(folder: Path) -> str | None:
    """Why `folder` could not be created or written into (None: it could), found without
    creating it: the nearest part of the path that exists must be a folder this process may
    write a file in."""
    here = Path(folder).absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        return f"{here} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=here, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"cannot write in {here} ({exc.strerror or exc})"
    return None
