"""Weights & Biases, offline: ``wandb.init(mode="offline")`` run files under ``<run>/wandb``."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROJECT = "paratrain"
_BLOCK = 32768  # the log's block size


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf ``Record``s of an offline ``.wandb`` file (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of chunks with 7-byte headers: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (n == 0 and kind == 0) or pos + 7 + n > len(data):
            return
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf, no stubs
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def history_steps(path: Path) -> Iterator[int]:
    """The ``_step`` of every history row of an offline ``.wandb`` file."""
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                if (item.key or "/".join(item.nested_key)) == "_step":
                    yield int(json.loads(item.value_json))


class WandbTracker:
    """One offline W&B run (nothing goes over a network), named after the run; ``own`` (in
    ``trackers.json``) holds the id a resumed run continues."""

    def __init__(self, run_dir: Path, job: dict[str, Any], own: dict[str, Any]) -> None:
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        settings = wandb.Settings(silent=True, console="off", disable_git=True,
                                  x_disable_stats=True)
        self.run = wandb.init(project=PROJECT, dir=str(run_dir), mode="offline", id=own.get("id"),
                              resume="allow", name=Path(run_dir).name, config=job,
                              settings=settings, reinit="create_new")
        own["id"] = self.run.id  # W&B's own id for a fresh run
        self.root, self.session = Path(run_dir) / "wandb", Path(self.run.dir).parent

    def held_through(self) -> float | None:
        """The last step the run's earlier sessions' offline files hold."""
        files = self.root.glob(f"offline-run-*-{self.run.id}/run-{self.run.id}.wandb")
        return float(max((step for f in files if f.parent != self.session for step in history_steps(f)),
                         default=-1))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
