"""paratrain.files.write_atomic: the one atomic write of everything a run writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from paratrain import files


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record what each os.fsync syncs: "folder" or the file's name."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append("folder" if path.is_dir() else path.name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_writes_content_and_syncs_file_then_folder(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    synced = _fsyncs(monkeypatch)
    files.write_bytes(tmp_path / "a.bin", b"\x00\x01")
    files.write_text(tmp_path / "b.txt", "héllo")
    files.write_json(tmp_path / "c.json", {"k": [1, 2]}, indent=1)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert json.loads((tmp_path / "c.json").read_text()) == {"k": [1, 2]}
    # each file's temp file is synced before the rename, the folder after it
    assert len(synced) == 6 and synced[1::2] == ["folder"] * 3
    assert all(name.startswith(".") and name.endswith(".tmp") for name in synced[0::2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.json"]


def test_crash_before_replace_keeps_old_file(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "job.json"
    files.write_text(target, "old")

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space"):
        files.write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]  # no temp file left


def test_failed_fill_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    files.write_bytes(target, b"old")

    def torn(tmp: Path) -> None:
        tmp.write_bytes(b"ne")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(target, torn)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_not_durable_skips_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = _fsyncs(monkeypatch)
    files.write_bytes(tmp_path / "x.pt", b"v", durable=False)
    assert synced == [] and (tmp_path / "x.pt").read_bytes() == b"v"


def test_run_folder_files_are_synced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """summary.json (once renamed unsynced) goes through the one write."""
    from paratrain.training.rundir import write_summary

    synced = _fsyncs(monkeypatch)
    write_summary(tmp_path, {"test_loss": 0.5})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"test_loss": 0.5}
    assert synced[-1] == "folder" and synced[0].startswith(".summary.json.")
