"""Where the one loop keeps its checkpoints: torch.distributed.checkpoint folders.

``checkpoints/step-<step>/`` is one DCP checkpoint of every process plus ``layout.json``,
written into ``.step-<step>.tmp/`` and renamed: the rename is the commit (a killed save
leaves only a ``.tmp``, removed by the next). Two steps are kept. On the same layout each
process reads back exactly its keys (bit-identical); on another, the slices it holds now by
name, and rank 0 warns naming what is reset. An unreadable folder on any process makes
every process fall back to the next older one. Hosts without a shared file system keep
their own copies (``rank<r>/...``). The keys, by the model's own names: ``model/<name>``
(whole, or the pieces processes hold as DCP chunks), ``optim/<name>/<key>`` (cut like the
parameter where it has its shape), ``rank<r>/...`` (process ``r``'s own copy: values that
differ, or no shared file system), ``meta/rank<r>`` (position, scheduler, RNG, ..., and what
was saved) and ``engine/rank<r>`` (the strategy's own state): :func:`flatten` writes,
:func:`rebuild` reads back on the same layout, :func:`reshard_targets` what a process of
another layout holds now.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import secrets
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.collectives import side_group
from ..comm.dcp_pieces import METADATA, Box, Piece, Target
from ..config import ConfigError
from ..files import (
    DCP_FOLDER,
    fsync_folder,
    newest_checkpoint,
    safe_rmtree,
    step_folders,
    write_bytes,
    write_json,
)
from .checkpoint import MIN_KEEP
from .faults import maybe_kill_in_save
from .reshard import ReshardWarning, param_keys
from .summary import tensor_bytes

log = logging.getLogger(__name__)
LAYOUT_FILE = "layout.json"
# the loop state a process's meta/rank<r> holds besides its tensors' descriptions (and "curve")
_LOOP_KEYS = ("step", "epoch", "batch", "scheduler", "rng", "losses", "loader", "optimizer_type", "layout")


def _dcp() -> ModuleType:
    """torch.distributed.checkpoint imports DTensor (~0.7 s): only at the first save or resume."""
    from ..comm import dcp

    return dcp


def _failed_dcp() -> type[BaseException]:
    """What a failed DCP read or write raises (evaluated only once something was raised)."""
    return _dcp().CheckpointException  # type: ignore[no-any-return]


def warm() -> None:
    """Import torch.distributed.checkpoint in a background thread, overlapping the first steps.

    ``torch._dynamo`` first: the loop's first ``optimizer.step()`` imports it and its chain
    touches ``torch.distributed``; imported here before DCP, the two threads never hold one
    another's module locks (Python's import machinery would end that with ``_DeadlockError``)."""

    def load() -> None:
        try:
            import torch._dynamo  # noqa: F401

            _dcp()
        except BaseException as e:  # noqa: BLE001 - met again, and raised, by the first save
            log.debug("background import of torch.distributed.checkpoint failed: %r", e)

    threading.Thread(target=load, name="paratrain-dcp-import", daemon=True).start()


def read_layout(folder: Path) -> dict[str, Any] | None:
    """``layout.json`` of a step folder (None: unreadable)."""
    try:
        doc = json.loads((folder / LAYOUT_FILE).read_text())
    except (OSError, ValueError) as e:  # a step folder that is not one (yet): skipped
        log.debug("%s: no readable %s: %r", folder, LAYOUT_FILE, e)
        return None
    return doc if isinstance(doc, dict) else None


class Unreadable(RuntimeError):
    """A checkpoint folder that lacks part of what DCP wrote (every process raises it)."""


def _failures(e: BaseException) -> dict[Any, Any]:
    """A CheckpointException's failures by rank (``{}`` for anything else)."""
    failures = getattr(e, "failures", None)
    return failures if isinstance(failures, dict) else {}


def save_reason(e: BaseException) -> str:
    """Why a save failed, one line: the OS error (DCP gathers each process's)."""
    if isinstance(e, OSError):
        return str(e.strerror or e)
    for failure in _failures(e).values():
        err: Any = failure[0] if isinstance(failure, tuple) else failure
        return str(err.strerror or err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    return str(e)[:300]


def load_reason(e: BaseException) -> str:
    """Why a folder could not be read: what is missing or corrupt, one line."""
    if isinstance(e, Unreadable):
        return f"is not readable: it {e}"
    for failure in _failures(e).values():
        err: Any = failure[0] if isinstance(failure, tuple) else failure  # DCP's (exception, traceback)
        first = (str(err).strip().splitlines() or [""])[-1]
        return f"is not readable, truncated or corrupt: {type(err).__name__}: {first[:300]}"
    return str(e)[:300]


@dataclass(frozen=True)
class Held:
    """What this process holds, for a resume on another layout."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    names: dict[str, str] | None
    shards: dict[str, dict[str, Any]] | None
    layout: dict[str, Any] | None = None  # the run's layout, for the warning


class RankStore:
    """The checkpoints of ``world`` processes (``prefix``: ``dp``, ``tp``, ``mp``, ...); collective."""

    def __init__(self, run_dir: str | Path, prefix: str, *, rank: int, world: int, group: Any,
                 layout: dict[str, Any], layout_field: str,
                 device: torch.device | None = None, reshard: bool | str = False) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.prefix, self.rank, self.world, self.group = prefix, rank, world, group
        self.layout, self.layout_field = dict(layout), layout_field
        self.device, self.reshard = device, reshard
        self.loaded_step: int | None = None
        self._leader: bool | None = None  # writes this host's folder names (one per file system)
        self._shared = True  # every process sees one checkpoints folder
        self._side: Any = None  # the save thread's gloo group (several processes)
        self._pending: _Pending | None = None  # the save in flight
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}  # the last save's staged copies

    def _g(self) -> Any:
        return self.group  # world 1: None or a group of this process alone

    def _probe(self) -> None:
        """Which processes share a file system: each writes a file, each lists them."""
        if self._leader is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if self.world == 1:
            self._leader, self._shared = True, True
            return
        token = C.broadcast_bytes(secrets.token_hex(8).encode() if self.rank == 0 else None,
                                  group=self.group).decode()
        mine = self.root / f".probe-{token}-{self.rank}"
        mine.write_text("")
        C.barrier(self.group)
        seen = [r for r in range(self.world) if (self.root / f".probe-{token}-{r}").exists()]
        C.barrier(self.group)
        mine.unlink()
        self._leader = min(seen) == self.rank
        self._shared = C.all_min_ints([int(len(seen) == self.world)], group=self.group)[0] == 1

    def _remove_stale(self) -> None:
        for p in self.root.glob(".step-*.tmp"):
            safe_rmtree(p, self.root)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective); written when this returns."""
        self.start_save(step, state)
        self.wait()

    def start_save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` as step ``step`` (collective), asynchronously: the state is
        copied here (the only cost to the step) and written by a thread over a gloo group of
        its own (:func:`~paratrain.comm.collectives.side_group`). One save is in flight at a time:
        the next save, a load and :meth:`wait` wait for it (and raise what it raised)."""
        self.wait()
        self._probe()
        if self.world > 1 and self._side is None:
            self._side = side_group(self.group)
        pieces, meta, engine = flatten(state)
        staged = (self._stage_pieces(pieces), _stage(meta), _stage(engine))
        self._pending = _Pending(lambda: self._write(step, *staged))

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _stage_pieces(self, pieces: list[Piece]) -> list[Piece]:
        """A CPU copy of every piece, into the last save's buffers where they fit (no page faults)."""
        out: list[Piece] = []
        kept: dict[tuple[str, Any], torch.Tensor] = {}
        for fqn, t, box in pieces:
            key = (fqn, box.offsets if box is not None else None)  # a key's pieces: one buffer each
            buf = self._buffers.get(key)
            if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                buf.copy_(t.detach())
            else:
                buf = t.detach().to("cpu", copy=True)
            kept[key] = buf
            out.append((fqn, buf, box))
        self._buffers = kept
        return out

    def _write(self, step: int, pieces: list[Piece], meta: dict[str, Any],
               engine: dict[str, Any]) -> None:
        """Write one staged checkpoint (the save thread; collective over the side group)."""
        group = self._side
        g = group if self.world > 1 else self.group
        private: set[str] | None = None  # None: every key is this process's own
        if self.world > 1 and self._shared:
            mine = digests(pieces)
            seen: dict[str, set[str]] = {}
            for text in C.all_gather_text(json.dumps(mine), group=group):
                for k, d in json.loads(text).items():
                    seen.setdefault(k, set()).add(d)
            private = {k for k, ds in seen.items() if len(ds) > 1}
        meta["differed"] = sorted(k.removeprefix("model/") for k in (private or ())
                                  if k.startswith("model/"))
        if self.world > 1 and (private is None or private):
            pieces = privatize(pieces, meta, private, self.rank)
        final, tmp = self.root / DCP_FOLDER.format(step), self.root / f".{DCP_FOLDER.format(step)}.tmp"
        try:
            if self._leader:
                self._remove_stale()
                tmp.mkdir(parents=True)
            C.barrier(g)
            _dcp().save(tmp, pieces, blobs={meta_key(self.rank): meta, engine_key(self.rank): engine},
                     group=group, world=self.world)
            md = C.broadcast_bytes((tmp / METADATA).read_bytes() if self.rank == 0 else None,
                                   group=g) if not self._shared else b""
            if self._leader:
                if md and not (tmp / METADATA).exists():
                    write_bytes(tmp / METADATA, md)
                write_json(tmp / LAYOUT_FILE, {"kind": self.prefix, "step": step, **self.layout,
                                               "world": self.world})
            C.barrier(g)
            maybe_kill_in_save(final)
            if self._leader:
                if final.exists():
                    safe_rmtree(final, self.root)
                os.replace(tmp, final)
                fsync_folder(self.root)  # the rename itself survives a power cut
                for old in step_folders(self.root)[:-MIN_KEEP]:
                    safe_rmtree(old, self.root)
        except (OSError, _failed_dcp()) as e:  # DCP wraps a failed write (a full disk)
            raise ConfigError([("run.output_dir", f"cannot write checkpoint {final}: "
                                f"{save_reason(e)}")]) from None
        C.barrier(g)

    def load(self, held: Held | None = None) -> tuple[Path, dict[str, Any]] | None:
        """``(folder, state)`` of the newest readable checkpoint (None: there is none);
        ``state`` is this process's loop state, with ``"resharded": True`` when it was
        written on another layout (``held`` says what this process holds then)."""
        self.wait()
        doc: dict[str, Any] = {}
        if self.rank == 0:
            try:
                doc = {"steps": self._candidates()}
            except ConfigError as e:
                doc = {"error": e.problems}
        doc = json.loads(C.broadcast_bytes(json.dumps(doc).encode() if self.rank == 0 else None,
                                           group=self._g()).decode())
        if "error" in doc:
            raise ConfigError([tuple(p) for p in doc["error"]])
        skipped: list[str] = []
        steps = doc["steps"]
        for i, name in enumerate(steps):
            folder = self.root / name
            try:
                found = self._load_one(folder, held)
            except (_failed_dcp(), Unreadable) as e:
                skipped.append(f"checkpoint {folder} {load_reason(e)}")
                if i + 1 < len(steps) and self.rank == 0:
                    warnings.warn(f"skipping {skipped[-1]}; falling back to step "
                                  f"{int(steps[i + 1][5:])} ({self.root / steps[i + 1]})",
                                  RuntimeWarning, stacklevel=2)
                continue
            self.loaded_step = int(found[1]["step"])
            return found
        if skipped:
            raise ConfigError([("checkpoint", f"no readable checkpoint in {self.root}: "
                                f"{'; '.join(skipped)}; start without --resume (or with --overwrite)")])
        return None

    def _candidates(self) -> list[str]:
        """Rank 0: the step folders to try, newest first (ConfigError: one no store resumes).
        A killed save's ``.tmp`` folder is left to the next save (:meth:`_write`): a reader,
        such as a fault-tolerant replica group restarting or joining while group 0 writes,
        must not remove the folder a live writer is filling."""
        found = newest_checkpoint(self.root.parent)
        if found is None:
            return []
        if not found.path.is_dir():
            raise ConfigError([(self.layout_field, (
                f"the newest checkpoint in {self.root} is {found.describe()}, in the "
                f"{'' if found.kind in ('local', 'population') else 'per-process '}torch.save "
                "format of paratrain before torch.distributed.checkpoint: this version does not "
                "resume it; finish the run with the version that wrote it, or start a fresh run "
                "with --overwrite"))])
        own = {"fed": "Federated", "pbt": "PopulationBased"}
        if found.kind != self.prefix and (found.kind in own or self.prefix in own):
            raise ConfigError([(self.layout_field, (
                f"the newest checkpoint in {self.root} is {found.describe()}, written by "
                f"{own.get(found.kind, 'another strategy')}, which this strategy does not "
                "resume; resume with the original strategy or start a fresh run with --overwrite"))])
        return [p.name for p in reversed(step_folders(self.root)) if read_layout(p) is not None]

    def _all_have(self, mine: bool, what: str) -> None:
        """Every process found what it needs, or every process raises :class:`Unreadable`."""
        if C.all_min_ints([int(mine)], group=self._g())[0] == 0:
            raise Unreadable(f"lacks {what}")

    def _same_layout(self, doc: dict[str, Any]) -> bool:
        return (doc.get("kind") == self.prefix and int(doc.get("world", 0)) == self.world
                and all(doc.get(k, v) == v for k, v in self.layout.items()))

    def _load_one(self, folder: Path, held: Held | None) -> tuple[Path, dict[str, Any]]:
        doc = read_layout(folder) or {}
        if self._same_layout(doc):
            blobs = _dcp().load(folder, {}, blobs=[meta_key(self.rank), engine_key(self.rank)],
                             group=self.group, world=self.world)
            self._all_have(meta_key(self.rank) in blobs, "a process's description (meta/rank<r>)")
            meta = blobs[meta_key(self.rank)]
            targets, build = rebuild(meta)
            _dcp().load(folder, targets, group=self.group, world=self.world)
            return folder, {**build(), "engine": blobs.get(engine_key(self.rank), {})}
        if not self.reshard:
            shape = ", ".join(f"{k}={v}" for k, v in self.layout.items())
            raise ConfigError([(self.layout_field, (
                f"the newest checkpoint in {self.root}, {folder.name} "
                f"({', '.join(f'{k}={v}' for k, v in doc.items() if k not in ('step', 'kind'))}), was written "
                f"with another layout than this job's ({shape}); resume with the original "
                "settings or start without --resume"))])
        if self.reshard == "engines":
            return self._load_engines(folder, doc)
        assert held is not None, "a store that reshards needs to know what this process holds"
        old_world = int(doc.get("world", 1))
        metas_ = _dcp().load(folder, {}, blobs=[meta_key(r) for r in range(old_world)],
                          group=self.group, world=self.world)
        self._all_have(all(meta_key(r) in metas_ for r in range(old_world)),
                       f"the descriptions of its {old_world} processes")
        metas = [metas_[meta_key(r)] for r in range(old_world)]
        md = _dcp().read_metadata(folder)
        targets, missing, wrong, build = reshard_targets(
            md, metas, module=held.module, optimizer=held.optimizer, names=held.names, shards=held.shards)
        problems = _agree(missing, wrong, len(metas[0]["param_groups"]), held.optimizer, folder, self._g())
        if problems:
            raise ConfigError(problems)
        _dcp().load(folder, targets, group=self.group, world=self.world)
        first = metas[0]
        state = build(first["param_groups"])
        reset = [*_reset(metas, self.rank, self.world), "the training losses since the last evaluation"]
        if self.rank == 0:
            warnings.warn(
                f"resuming {folder} (layout {dict(first.get('layout') or {})}) on layout "
                f"{dict(held.layout or self.layout)}: the model and optimizer state continue by name at step "
                f"{first['step']}; reset: {'; '.join(reset)}", ReshardWarning, stacklevel=3)
        rng = metas[self.rank]["rng"] if self.rank < old_world else first["rng"]
        return folder, {**state, "scheduler": first["scheduler"], "rng": rng, "engine": {},
                        "step": first["step"], "epoch": first["epoch"], "batch": first["batch"],
                        "losses": [], "optimizer_type": first.get("optimizer_type"),
                        "layout": first.get("layout"), "resharded": True, "reset": reset}

    def _load_engines(self, folder: Path, doc: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        """Another layout of an engine-state strategy: process 0's position and model, every engine."""
        old_world = int(doc.get("world", 1))
        keys = [meta_key(r) for r in range(old_world)] + [engine_key(r) for r in range(old_world)]
        blobs = _dcp().load(folder, {}, blobs=keys, group=self.group, world=self.world)
        self._all_have(all(meta_key(r) in blobs for r in range(old_world)),
                       f"the descriptions of its {old_world} processes")
        targets, build = rebuild(blobs[meta_key(0)])
        _dcp().load(folder, targets, group=self.group, world=self.world)
        engines = [blobs.get(engine_key(r), {}) for r in range(old_world)]
        return folder, {**build(), "engine": {}, "engines": engines, "resharded": True}


class LocalStore(RankStore):
    """One process's checkpoints (``prefix`` ``local``); resumes any layout's by names."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__(Path(directory).parent, "local", rank=0, world=1, group=None,
                         layout={"strategy": "Local"}, layout_field="checkpoint", reshard=True)


class _Pending:
    """One checkpoint write on a daemon thread (a process failing elsewhere does not hang on a
    write whose peers are gone); :meth:`result` joins it and raises what it raised."""

    def __init__(self, write: Any) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(write,), name="paratrain-checkpoint",
                                       daemon=True)
        self.thread.start()

    def _run(self, write: Any) -> None:
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self) -> None:
        self.thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error


def _stage(obj: Any) -> Any:
    """A copy of a checkpoint's nested state that training cannot change (tensors on the CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # a subclass (a state_dict's OrderedDict) keeps its type and attributes
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _stage(v)
        return out
    if isinstance(obj, list):
        return [_stage(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_stage(v) for v in obj)
    if isinstance(obj, (int, float, str, bytes, bool, type(None))):
        return obj
    return copy.deepcopy(obj)


def _agree(missing: list[str], wrong: list[str], saved_groups: int, optimizer: torch.optim.Optimizer,
           folder: Path, group: Any) -> list[tuple[str, str]]:
    """Every process's problems with a checkpoint of another layout, on every process."""
    mine: list[tuple[str, str]] = []
    if missing:
        mine.append(("model", f"checkpoint {folder} holds no {', '.join(missing[:5])}: it was written "
                              "for another model; resume with the original model"))
    if wrong:
        mine.append(("model", f"checkpoint {folder} does not fit this job's model: {'; '.join(wrong[:5])}; "
                              "resume with the original model"))
    if saved_groups != len(optimizer.param_groups):
        mine.append(("train.optimizer", f"checkpoint {folder} has {saved_groups} parameter groups; "
                                        f"this job's optimizer has {len(optimizer.param_groups)}"))
    out: list[tuple[str, str]] = []
    for text in C.all_gather_text(json.dumps(mine), group=group):
        for p in json.loads(text):
            if tuple(p) not in out:
                out.append((p[0], p[1]))
    return out


def _reset(metas: list[dict[str, Any]], rank: int, world: int) -> list[str]:
    reset = []
    differed = metas[0].get("differed") or []
    if differed:
        shown = ", ".join(differed[:4]) + (" ..." if len(differed) > 4 else "")
        reset.append(f"tensors the old processes held with different values ({shown}: e.g. "
                     "Local subgraph layers, Decentralized replicas) now take process 0's")
    engine = sorted({k for m in metas for k in m.get("engine_keys", [])})
    if engine:
        reset.append(f"the strategy's own state ({', '.join(engine)}: e.g. compressor residuals, "
                     "per process)")
    if max(world, rank + 1) > len(metas):
        reset.append(f"the random state of processes {len(metas)}..{max(world, rank + 1) - 1} "
                     "(they did not exist: they take process 0's)")
    return reset


def read_named_model(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model of checkpoint ``folder`` by the model's names (every tensor: for export)."""
    dcp = _dcp()
    folder = Path(folder)
    md = dcp.read_metadata(folder)
    doc = json.loads((folder / LAYOUT_FILE).read_text())
    old_world = int(doc.get("world", 1))
    names: dict[str, Any] = {}
    for f, m in md.state_dict_metadata.items():
        g = unranked(f)
        if g.startswith("model/") and isinstance(m, dcp.TensorStorageMetadata):
            names.setdefault(g.removeprefix("model/"), m)
    metas = dcp.load(folder, {}, blobs=[meta_key(0)], group=None, world=1)
    order = [d[1] for d in metas[meta_key(0)]["model"]]
    targets: dict[str, Target] = {}
    for n, m in names.items():
        srcs = tuple(x for x in sources("model", n, old_world) if x in md.state_dict_metadata)
        targets[n] = Target(torch.empty(tuple(m.size), dtype=m.properties.dtype), None, srcs)
    dcp.load(folder, targets, group=None, world=1)
    ranked = [n for n in order if n in targets] + sorted(n for n in targets if n not in order)
    return {n: targets[n].tensor for n in ranked}


def read_rank_state(folder: str | Path, rank: int = 0) -> dict[str, Any]:
    """Process ``rank``'s loop state as saved into checkpoint ``folder`` (inspection, tests)."""
    dcp = _dcp()
    blobs = dcp.load(folder, {}, blobs=[meta_key(rank), engine_key(rank)], group=None, world=1)
    if meta_key(rank) not in blobs:
        raise ConfigError([("checkpoint", f"{folder} holds no process {rank}")])
    meta = blobs[meta_key(rank)]
    targets, build = rebuild(meta)
    dcp.load(folder, targets, group=None, world=1)
    return {**build(), "engine": blobs.get(engine_key(rank), {}),
            "shards": [None if d[5] is None else {"shape": d[5][0], "offsets": d[5][1]}
                       for d in meta["model"]]}


def latest_folder(checkpoints: str | Path) -> Path | None:
    """The newest complete step folder in ``checkpoints`` (None: there is none)."""
    found = step_folders(checkpoints)
    return found[-1] if found else None



def meta_key(rank: int) -> str:
    return f"meta/rank{rank}"


def engine_key(rank: int) -> str:
    return f"engine/rank{rank}"


def box_of(spec: Mapping[str, Any] | None) -> Box | None:
    """The DCP chunk of a shard spec (slices on one dim compose, as ``narrow``s do)."""
    if spec is None:
        return None
    offsets = [0] * len(spec["shape"])
    for dim, start, _ in spec["slices"]:
        offsets[int(dim)] += int(start)
    return Box(tuple(int(x) for x in spec["shape"]), tuple(offsets))


def _box_list(box: Box | None) -> list[list[int]] | None:
    return None if box is None else [list(box.shape), list(box.offsets)]


def _box(doc: Any) -> Box | None:
    return None if doc is None else Box(tuple(doc[0]), tuple(doc[1]))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint description")
    return dt


def _piece_shape(spec: Mapping[str, Any]) -> tuple[int, ...]:
    shape = list(spec["shape"])
    for dim, _, length in spec["slices"]:
        shape[int(dim)] = int(length)
    return tuple(shape)


def flatten(state: Mapping[str, Any]) -> tuple[list[Piece], dict[str, Any], dict[str, Any]]:
    """``(pieces, meta, engine)`` of one process's loop state (the dict ``run_loop`` saves)."""
    keys = list(state["model"])
    names = state.get("names") or keys
    shards = state.get("shards") or [None] * len(keys)
    pieces: list[Piece] = []
    model_desc = []
    for k, n, spec in zip(keys, names, shards, strict=True):
        t = state["model"][k]
        box = box_of(spec)
        fqn = f"model/{n}" if (t.numel() > 0 or box is not None) else None
        if fqn is not None:
            pieces.append((fqn, t, box))
        model_desc.append([k, n, list(t.shape), str(t.dtype), fqn, _box_list(box)])
    opt = state.get("optimizer") or {"state": {}, "param_groups": []}  # none: Federated, PBT
    pnames = list(state.get("param_names") or [])
    pshards = state.get("param_shards") or [None] * len(pnames)
    optim_desc: dict[int, dict[str, Any]] = {}
    for i, st in opt["state"].items():
        n, spec = pnames[int(i)], pshards[int(i)]
        part = _piece_shape(spec) if spec is not None else None
        d: dict[str, Any] = {}
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                box = box_of(spec) if part is not None and tuple(v.shape) == part else None
                fqn = f"optim/{n}/{key}"
                pieces.append((fqn, v, box))
                d[key] = ["t", list(v.shape), str(v.dtype), fqn, _box_list(box)]
            else:
                d[key] = ["v", v]
        optim_desc[int(i)] = d
    # one key and chunk once: q, k and v of a fused tensor each carry Adam's ``step``
    unique: dict[tuple[str, tuple[int, ...] | None], Piece] = {}
    for fqn, t, box in pieces:
        unique.setdefault((fqn, box.offsets if box is not None else None), (fqn, t, box))
    pieces = list(unique.values())
    engine = dict(state.get("engine") or {})
    meta = {k: state.get(k) for k in (*_LOOP_KEYS, "curve")}
    meta.update(param_groups=opt["param_groups"], model=model_desc, optim=optim_desc,
                param_names=pnames, engine_keys=sorted(k for k, v in engine.items() if v))
    return pieces, meta, engine


def digests(pieces: Sequence[Piece]) -> dict[str, str]:
    """A digest of every whole tensor's bytes (pieces are each one process's own)."""
    return {fqn: hashlib.blake2b(tensor_bytes(t), digest_size=12).hexdigest()
            for fqn, t, box in pieces if box is None}


def privatize(pieces: list[Piece], meta: dict[str, Any], private: set[str] | None,
              rank: int) -> list[Piece]:
    """Move the keys in ``private`` (every key when None) under ``rank<r>/``."""
    def rename(fqn: str | None) -> str | None:
        return fqn if fqn is None or (private is not None and fqn not in private) else f"rank{rank}/{fqn}"

    for d in meta["model"]:
        d[4] = rename(d[4])
    for st in meta["optim"].values():
        for v in st.values():
            if v[0] == "t":
                v[3] = rename(v[3])
    return [(str(rename(f)), t, b) for f, t, b in pieces]


def rebuild(meta: Mapping[str, Any]) -> tuple[dict[str, Target], Any]:
    """Targets for exactly what a process wrote, and the function giving its loop state."""
    targets: dict[str, Target] = {}
    empties: dict[str, torch.Tensor] = {}
    for k, _, shape, dtype, fqn, box in meta["model"]:
        t = torch.empty(shape, dtype=_dtype(dtype))
        if fqn is None:
            empties[k] = t
        else:
            targets[f"m:{k}"] = Target(t, _box(box), (fqn,))
    for i, st in meta["optim"].items():
        for key, v in st.items():
            if v[0] == "t":
                targets[f"o:{i}:{key}"] = Target(torch.empty(v[1], dtype=_dtype(v[2])), _box(v[4]), (v[3],))

    def state() -> dict[str, Any]:
        model = {k: empties[k] if k in empties else targets[f"m:{k}"].tensor for k, *_ in meta["model"]}
        opt_state = {int(i): {key: targets[f"o:{i}:{key}"].tensor if v[0] == "t" else v[1]
                              for key, v in st.items()} for i, st in meta["optim"].items()}
        return {**{k: meta[k] for k in _LOOP_KEYS},
                "curve": meta.get("curve"),  # absent from checkpoints written before it
                "model": model, "optimizer": {"state": opt_state, "param_groups": meta["param_groups"]},
                "names": [d[1] for d in meta["model"]], "param_names": meta["param_names"]}

    return targets, state


def unranked(fqn: str) -> str:
    """``rank<r>/model/x`` -> ``model/x``."""
    head, _, rest = fqn.partition("/")
    return rest if head.startswith("rank") and head[4:].isdigit() else fqn


def sources(kind: str, name: str, old_world: int) -> tuple[str, ...]:
    base = f"{kind}/{name}"
    return (base, *(f"rank{r}/{base}" for r in range(old_world)))


def reshard_targets(md: Any, metas: Sequence[Mapping[str, Any]], *, module: nn.Module,
                    optimizer: torch.optim.Optimizer, names: Mapping[str, str] | None,
                    shards: Mapping[str, Mapping[str, Any]] | None,
                    ) -> tuple[dict[str, Target], list[str], list[str], Any]:
    """What this process holds now, by model names, from a checkpoint of another layout
    (``md``: its DCP metadata; ``metas``: every old process's ``meta``): ``(targets,
    missing, wrong, build)``, ``build(groups)`` giving the state in this process's keys."""
    shards = shards or {}
    present = md.state_dict_metadata
    old_world = len(metas)
    current = module.state_dict()
    to_model = {k: (names.get(k, k) if names is not None else k) for k in current}
    targets: dict[str, Target] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for k, v in current.items():
        if v.numel() == 0 and k not in shards:
            continue  # an empty placeholder (a pipeline rank that owns no parameters)
        n, box = to_model[k], box_of(shards.get(k))
        srcs = [s for s in sources("model", n, old_world) if s in present]
        if not srcs:
            missing.append(n)
            continue
        whole = box.shape if box is not None else tuple(v.shape)
        if tuple(present[srcs[0]].size) != whole:
            wrong.append(f"{n}: checkpoint {tuple(present[srcs[0]].size)}, this job {whole}")
            continue
        targets[f"m:{k}"] = Target(torch.empty(v.shape, dtype=present[srcs[0]].properties.dtype), box,
                                   tuple(srcs))
    pkeys = param_keys(module, optimizer)
    values: dict[str, dict[str, Any]] = {}  # non-tensor optimizer state, by name
    for m in metas:
        for i, st in m["optim"].items():
            n = m["param_names"][int(i)]
            for key, v in st.items():
                if v[0] == "v":
                    values.setdefault(n, {}).setdefault(key, v[1])
    opt_keys: dict[int, list[str]] = {}
    for i, k in enumerate(pkeys):
        n, spec = to_model[k], shards.get(k)
        box = box_of(spec)
        prefix = f"optim/{n}/"
        stkeys = sorted({g[len(prefix):] for g in map(unranked, present)
                         if g.startswith(prefix) and "/" not in g[len(prefix):]})
        opt_keys[i] = stkeys
        for key in stkeys:
            osrcs = tuple(s for s in sources("optim", f"{n}/{key}", old_world) if s in present)
            size = tuple(present[osrcs[0]].size)
            sharded = box is not None and size == box.shape
            shape = tuple(module.get_parameter(k).shape) if sharded else size
            targets[f"o:{i}:{key}"] = Target(torch.empty(shape, dtype=present[osrcs[0]].properties.dtype),
                                             box if sharded else None, osrcs)

    def build(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        model = {k: targets[f"m:{k}"].tensor if f"m:{k}" in targets else current[k] for k in current}
        state: dict[int, Any] = {}
        for i, k in enumerate(pkeys):
            st = {key: targets[f"o:{i}:{key}"].tensor for key in opt_keys[i]}
            st.update(values.get(to_model[k], {}))
            if st:
                state[i] = st
        out_groups, j = [], 0
        for saved, g in zip(groups, optimizer.param_groups, strict=True):
            out_groups.append({**{a: b for a, b in saved.items() if a != "params"},
                               "params": list(range(j, j + len(g["params"])))})
            j += len(g["params"])
        return {"model": model, "optimizer": {"state": state, "param_groups": out_groups}}

    return targets, missing, wrong, build
