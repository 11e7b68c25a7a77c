"""The one atomic write every cache, report and dataset file goes through."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

from dspark_flow.files import write_atomic, write_text_atomic


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "cache.json"
    write_text_atomic("old", path)
    write_text_atomic("néw\n", path, durable=True)
    assert path.read_text(encoding="utf-8") == "néw\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]
    plain = tmp_path / "plain"
    plain.write_text("x")  # what open() gives under this process's umask
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    plain.unlink()


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "shard.npz"
    write_atomic(path, lambda f: np.savez(f, a=np.arange(3)))

    def half_then_fail(f: object) -> None:
        f.write(b"half a file")  # type: ignore[attr-defined]
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail)
    with np.load(path) as z:
        assert z["a"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.npz"]


def test_a_missing_folder_is_an_oserror_not_a_partial_file(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write_text_atomic("x", tmp_path / "absent" / "f.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors via /proc")
def test_a_folder_synced_whole_flushes_each_file_and_then_the_folder(tmp_path, monkeypatch):
    """What a checkpoint does before its rename: every file's data, then the folder's entries."""
    import os

    from dspark_flow import files

    for name in ("weights.safetensors", "trainer.json"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    files.sync_files(tmp_path)
    assert [Path(p).name for p in synced] == ["trainer.json", "weights.safetensors", tmp_path.name]


def test_replace_folder_puts_a_flushed_folder_in_place_of_the_old_one(tmp_path, monkeypatch):
    from dspark_flow import files

    staged, final = tmp_path / "staged", tmp_path / "final"
    for folder, text in ((staged, "new"), (final, "old")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    (final / "stale").write_text("x")
    order: list[str] = []
    monkeypatch.setattr(files, "sync_files", lambda d: order.append(f"files {d.name}"))
    monkeypatch.setattr(files, "sync_folder", lambda d: order.append(f"folder {d.name}"))
    files.replace_folder(staged, final)
    assert order == ["files staged", f"folder {tmp_path.name}"]  # flushed before the rename
    assert sorted(p.name for p in final.iterdir()) == ["weights"] and not staged.exists()
    assert (final / "weights").read_text() == "new"
