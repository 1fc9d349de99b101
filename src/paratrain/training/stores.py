"""Where the one loop keeps its checkpoints: one process, or one directory per rank.

- :class:`LocalStore`: ``checkpoints/ckpt-<step>.pt``; resume from the newest readable
  file (a damaged newest one falls back, :func:`.checkpoint.load_latest`).
- :class:`RankStore`: ``checkpoints/<prefix>-rank<r>/ckpt-<step>.pt`` per rank; after
  every rank has saved a step (barrier) rank 0 writes ``checkpoints/<prefix>-complete.json``
  naming it and the layout (replica / shard counts). A resume starts at that step and
  falls back, on every rank together, to the newest step all ranks can read
  (:func:`.resume.agree_on_checkpoint`); a marker written by another layout is a
  ConfigError naming the setting, before anything is loaded -- unless the store may
  ``reshard``: then process 0 reads every old process's file of the marker's step, merges
  them by the model's names (:func:`.reshard.merge`) and broadcasts the result, which
  the loop lays out for this world (:func:`.reshard.localize`). After the first save on
  the new layout, the folders of processes that no longer exist are removed.

Either store resumes from the newest complete checkpoint of *any* layout in the run folder
(:func:`paratrain.files.newest_checkpoint`): a Local run continues a DataParallel or
tensor-parallel one and the other way round, by the model's names (:func:`read_states`
reads every old process's file, :func:`.reshard.merge` joins them). A resume never starts
fresh while such a checkpoint exists: one that cannot be resumed here (a PopulationBased
population) is a ConfigError naming it.

``save`` and ``load`` of a RankStore are collective: every rank of ``group`` calls them.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..comm import collectives as C
from ..config import ConfigError
from ..files import FoundCheckpoint, newest_checkpoint, safe_rmtree
from . import checkpoint
from .reshard import merge
from .resume import agree_on_checkpoint

__all__ = ["LocalStore", "RankStore", "read_states"]


class LocalStore:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def load(self) -> tuple[Path, dict[str, Any]] | None:
        found = newest_checkpoint(self.directory.parent)
        if found is None or found.kind == "local":
            return checkpoint.load_latest(self.directory)
        source, states = read_states(found, self.directory)
        return source, merge(states, source=str(source))

    def save(self, step: int, state: dict[str, Any]) -> None:
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(self.directory, step), state)
        checkpoint.prune(self.directory)


class RankStore:
    def __init__(self, run_dir: str | Path, prefix: str, *, rank: int, world: int, group: Any,
                 layout: dict[str, Any], layout_field: str,
                 device: torch.device | None = None, reshard: bool = False) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.prefix, self.rank, self.world, self.group = prefix, rank, world, group
        self.layout, self.layout_field = dict(layout), layout_field
        self.device, self.reshard = device, reshard
        self.loaded_step: int | None = None

    @property
    def directory(self) -> Path:
        return self.root / f"{self.prefix}-rank{self.rank}"

    @property
    def marker(self) -> Path:
        return self.root / f"{self.prefix}-complete.json"

    def _barrier(self) -> None:
        if self.world > 1:
            C.barrier(self.group)

    def _found(self) -> FoundCheckpoint | None:
        return newest_checkpoint(self.root.parent)

    def _complete_step(self) -> int:
        """The step of this layout's marker when it is the run folder's newest checkpoint
        (-1: no checkpoint, -2: the newest is another layout's), broadcast from rank 0."""
        value = -1
        if self.rank == 0:
            found = self._found()
            if found is not None:
                same = found.kind == self.prefix and all(
                    found.doc.get(k, v) == v for k, v in self.layout.items())
                value = found.step if same else -2
        if self.world > 1:
            t = torch.tensor([value], dtype=torch.int64, device=self.device)
            value = int(C.broadcast_(t, src=0, group=self.group).item())
        return value

    def load(self) -> tuple[Path, dict[str, Any]] | None:
        step = self._complete_step()
        if step == -2:
            return self._load_resharded()
        agreed = agree_on_checkpoint(self.directory, None if step < 0 else step,
                                     self.group if self.world > 1 else None)
        if agreed is None:
            return None
        self.loaded_step = int(agreed[0])
        return checkpoint.checkpoint_path(self.directory, agreed[0]), agreed[1]

    def _load_resharded(self) -> tuple[Path, dict[str, Any]]:
        """Process 0 merges every old process's checkpoint of the newest complete step (of
        any layout) by model names; every process receives the merged state (an error,
        e.g. a store that may not reshard, reaches them all)."""
        blob: bytes | None = None
        source = self.root
        if self.rank == 0:
            try:
                found = self._found()
                assert found is not None
                if not self.reshard:
                    shape = ", ".join(f"{k}={v}" for k, v in self.layout.items())
                    raise ConfigError([(self.layout_field, (
                        f"the newest checkpoint in {self.root}, {found.describe()}, was written "
                        f"with another layout than this job's ({shape}); resume with the original "
                        "settings or start without --resume"))])
                source, states = read_states(found, self.root, field=self.layout_field)
                merged = merge(states, source=str(source))
                buf = io.BytesIO()
                torch.save(merged, buf)
                blob = b"S" + buf.getvalue()
            except ConfigError as e:
                blob = b"E" + json.dumps(e.problems).encode()
        got = C.broadcast_bytes(blob, src=0, group=self.group if self.world > 1 else None)
        if got[:1] == b"E":
            raise ConfigError([tuple(p) for p in json.loads(got[1:].decode())])
        state = torch.load(io.BytesIO(got[1:]), map_location="cpu", weights_only=True)
        self.loaded_step = int(state["step"])
        return Path(source), state

    def save(self, step: int, state: dict[str, Any]) -> None:
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(self.directory, step), state)
        self._barrier()  # every rank has saved `step` before it is declared complete
        if self.rank == 0:
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, **self.layout, "world": self.world}))
            os.replace(tmp, self.marker)
            for old in self.root.glob(f"{self.prefix}-rank*"):
                k = old.name.removeprefix(f"{self.prefix}-rank")
                if k.isdigit() and int(k) >= self.world:  # a process of an earlier, larger layout
                    safe_rmtree(old, self.root)
        self._barrier()
        checkpoint.prune(self.directory)


def read_states(found: FoundCheckpoint, root: Path, *,
                field: str = "checkpoint") -> tuple[Path, list[dict[str, Any]]]:
    """Every old process's checkpoint of ``found`` (process order) and the file to name.
    A layout whose state is not the one loop's (a PopulationBased population, an earlier
    marker without its process count) is a ConfigError naming it and ``field``."""
    if found.kind == "local":
        latest = checkpoint.load_latest(root)
        assert latest is not None
        return latest[0], [latest[1]]
    if found.kind == "population":
        raise ConfigError([(field, (
            f"the newest checkpoint in {root} is {found.describe()}, a PopulationBased "
            "population, which only PopulationBased resumes; resume with the original strategy "
            "or start a fresh run with --overwrite"))])
    old_world = int(found.doc.get("world", 0))
    if old_world < 1:
        raise ConfigError([(field, (
            f"{found.path} does not say how many processes wrote it (an earlier paratrain); "
            "resume with the original settings"))])
    paths = [checkpoint.checkpoint_path(root / f"{found.kind}-rank{k}", found.step)
             for k in range(old_world)]
    return paths[0], [_readable(p) for p in paths]


def _readable(path: Path) -> dict[str, Any]:
    try:
        return checkpoint.load_checkpoint(path)
    except FileNotFoundError:
        raise ConfigError([("checkpoint", (
            f"{path} is missing: resuming on another layout reads every earlier process's "
            "checkpoint from this run folder (on several machines, gather them first)"))]) from None
    except checkpoint.CheckpointError as e:
        raise ConfigError([("checkpoint", str(e))]) from None
