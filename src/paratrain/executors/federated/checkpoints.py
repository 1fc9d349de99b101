"""Federated checkpoints: the server's state (rank 0) and every worker's clients' state,
saved together at a round boundary and resumed together, on the same number of worker
processes or on another.

Layout. ``checkpoints/ckpt-<round>.pt`` is the server's (global model, aggregator state,
round, ...) plus ``workers``: how many worker processes wrote that round's worker files.
``checkpoints/worker-<rank>/ckpt-<round>.pt`` holds the codec state (error-feedback
residuals), the personal parts (Local subgraphs) and SCAFFOLD's control variates ``c_i``
(``control``) of the clients that worker hosts
(client ``c`` on rank ``c % world``), keyed ``client-<c>``. :func:`save_round` writes every
worker's file, then (after a barrier) the server's: the newest server checkpoint always
has its workers' files.

When (:class:`~paratrain.training.interrupt.Cadence` over rounds): ``run.checkpoint_every``
is a round count (0, the default: every round) or a wall time (``"10m"``: due on any
worker's clock, agreed over the group after each round); and always at the end, and when
SIGINT/SIGTERM stops the run at a round boundary.

Resume on the same world: each rank takes its own folder's newest file at or below the
server's round that every rank can read (:func:`~paratrain.training.resume.agree_on_checkpoint`);
when they fall back, rank 0 loads the server checkpoint of that older round too.
Resume on another world (2 workers -> 3, 3 -> 2): the server's state is unchanged; rank 0
reads every old worker's file of the server's round, merges the clients' states and
broadcasts them; every rank keeps those of the clients it hosts now (:func:`restore_workers`).
After the first save on the new layout, the folders of workers that no longer exist are
removed.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from ...comm import collectives as C
from ...comm.federated_ops import barrier
from ...config import ConfigError
from ...files import safe_rmtree
from ...training import checkpoint
from ...training.resume import agree_on_checkpoint

__all__ = ["worker_dir", "restore_workers", "save_round"]


def worker_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / "checkpoints" / f"worker-{rank}"


def _server_fallback(server: Any, run_dir: Path, round_: int) -> None:
    """Rank 0: load the server checkpoint of the older ``round_`` the workers fell back to."""
    older = checkpoint.checkpoint_path(run_dir / "checkpoints", round_)
    try:
        state = checkpoint.load_checkpoint(older)
    except (checkpoint.CheckpointError, OSError) as e:
        raise ConfigError([("checkpoint", (
            f"the workers fell back to round {round_} but the server checkpoint {older} "
            f"cannot be read ({e}); start without --resume (or with --overwrite)"))]) from None
    server.check_state(state, source=older)
    server.load_state_dict(state)


def _merged(run_dir: Path, round_: int, old_world: int) -> dict[str, Any]:
    """Every old worker's clients' state of ``round_``, one dict by client name."""
    out: dict[str, Any] = {"codec": {}, "personal": {}, "control": {}}
    for k in range(old_world):
        path = checkpoint.checkpoint_path(worker_dir(run_dir, k), round_)
        try:
            state = checkpoint.load_checkpoint(path)
        except FileNotFoundError:
            raise ConfigError([("checkpoint", (
                f"{path} is missing: resuming on another number of workers reads every earlier "
                "worker's checkpoint from this run folder (on several machines, gather them "
                "first)"))]) from None
        except checkpoint.CheckpointError as e:
            raise ConfigError([("checkpoint", str(e))]) from None
        for part in ("codec", "personal", "control"):
            out[part].update(dict(state.get(part, {})))
    return out


def restore_workers(host: Any, server: Any, run_dir: Path, *, start: int, saved_world: int,
                    stateful: bool, rank: int, world: int, group: Any) -> int:
    """Load this rank's clients' state for a resume from the server's round ``start``
    (written by ``saved_world`` workers); returns the round the run continues from."""
    if start == 0 or not stateful:  # nothing of the clients' own to restore
        return start
    if saved_world != world:  # another layout: merge on rank 0, every rank keeps its own
        blob: bytes | None = None
        if rank == 0:
            try:
                buf = io.BytesIO()
                torch.save(_merged(run_dir, start, saved_world), buf)
                blob = b"S" + buf.getvalue()
            except ConfigError as e:
                blob = b"E" + json.dumps(e.problems).encode()
        got = C.broadcast_bytes(blob, src=0, group=group if world > 1 else None)
        if got[:1] == b"E":
            raise ConfigError([tuple(p) for p in json.loads(got[1:].decode())])
        merged = torch.load(io.BytesIO(got[1:]), map_location="cpu", weights_only=True)
        host.load_state_dict({
            part: {n: s for n, s in dict(merged[part]).items()
                   if host.hosts(int(str(n).removeprefix("client-")))}
            for part in ("codec", "personal", "control")})
        return start
    # one round on every rank: the newest <= the server's whose file every rank reads
    agreed = agree_on_checkpoint(worker_dir(run_dir, rank), start, group if world > 1 else None)
    assert agreed is not None
    if agreed[0] != start and server is not None:
        _server_fallback(server, run_dir, agreed[0])
    host.load_state_dict(agreed[1])
    return int(agreed[0])


def save_round(host: Any, server: Any, run_dir: Path, round_: int, *, stateful: bool, rank: int,
               world: int, group: Any) -> None:
    """Checkpoint round ``round_`` (collective): every worker's clients' state, then the
    server's, naming the number of workers; then the folders of workers that no longer exist
    are removed."""
    if stateful:
        wdir = worker_dir(run_dir, rank)
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(wdir, round_), host.state_dict())
        checkpoint.prune(wdir, keep=3)
    barrier(group if world > 1 else None)  # every worker file is on disk before the server's
    if server is None:
        return
    ckpts = run_dir / "checkpoints"
    checkpoint.save_checkpoint(checkpoint.checkpoint_path(ckpts, round_),
                               {**server.state_dict(), "workers": world})
    checkpoint.prune(ckpts)
    for old in ckpts.glob("worker-*"):
        k = old.name.removeprefix("worker-")
        if k.isdigit() and int(k) >= world:  # a worker of an earlier, larger layout
            safe_rmtree(old, ckpts)
