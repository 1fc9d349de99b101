"""Replica groups on torchft (``[fault_tolerance]``): a :class:`Lighthouse` that forms each
step's quorum, one :class:`ReplicaGroup` (torchft's ``Manager`` over a reconfigurable gloo
group) per process, and :func:`supervise`, which restarts only the group whose process died.

A replica group is one process or several (:class:`Member`: process ``i`` of ``k``, torchft's
``group_rank`` / ``group_world_size``). A step of a replica group: :meth:`ReplicaGroup.begin`
joins the step's quorum (synchronous: a group behind the others' step receives a live
peer's state here, process ``i`` from process ``i`` of the peer, through the Manager's
checkpoint transport); :meth:`ReplicaGroup.mean_` averages a tensor over process ``i`` of
each group of that quorum, ``x_i <- (1/q) sum_{g in quorum} x_{g,i}``;
:meth:`ReplicaGroup.commit` says whether every group of the quorum completed the step, every
process of this group agreeing (then it counts, else the step is taken again).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .forkserver import context as forkserver_context


class QuorumTimeout(RuntimeError):
    """No quorum of ``min_replicas`` groups formed in ``quorum_timeout_s``: fatal, as a
    restart would wait for the same missing groups."""


class FellBehind(RuntimeError):
    """This group's step was not committed while its peers' was: it must heal from a peer,
    which a running loop cannot take mid-step, so the process ends and is restarted."""


def _quiet() -> None:
    """torchft's Rust side logs every quorum at INFO unless ``RUST_LOG`` says otherwise."""
    if not os.environ.get("PARATRAIN_DEBUG"):
        os.environ.setdefault("RUST_LOG", "warn")


@contextlib.contextmanager
def lighthouse(*, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float,
               listen: str | None = None) -> Iterator[str]:
    """A torchft Lighthouse for the block, on ``listen`` (``host:port``, reached from other
    hosts) or 127.0.0.1; yields its address."""
    _quiet()  # before torchft's import, which sets up its logger
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=listen or "127.0.0.1:0", min_replicas=min_replicas,
                              join_timeout_ms=int(join_timeout_s * 1000),
                              heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    try:
        # the server advertises the host name; the groups reach it on the address it listens on
        host = listen.rpartition(":")[0] if listen else "127.0.0.1"
        yield f"http://{host}:" + server.address().rsplit(":", 1)[1]
    finally:
        server.shutdown()


def own_address(lighthouse: str) -> str:
    """This host's address as the Lighthouse and the other groups reach it: 127.0.0.1 with a
    Lighthouse on loopback, else the address on the route to it (gloo is told its interface
    where the host name resolves to loopback, :func:`~.rendezvous.gloo_interface`)."""
    from .rendezvous import _is_loopback, address_towards, gloo_interface

    host, _, port = lighthouse.split("://")[-1].rpartition(":")
    if _is_loopback(host):
        return "127.0.0.1"
    ifname = gloo_interface(host, int(port))
    if ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    return address_towards(host, int(port)) or socket.gethostname()


def _transport(host: str, timeout: timedelta) -> Any:
    """torchft's checkpoint transport (a healing peer reads the state over HTTP), at ``host``
    instead of the host name (which may resolve to loopback)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


@contextlib.contextmanager
def start_line() -> Iterator[str]:
    """A store for the block where the first attempts of the groups meet (:meth:`ReplicaGroup.start`),
    so that a run's first quorum has every group; yields its ``host:port``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    try:
        yield f"127.0.0.1:{store.port}"
    finally:
        del store


@dataclass(frozen=True)
class Member:
    """One process of a replica group: ``rank`` of its ``size`` processes; ``port``: the
    group's rendezvous store on 127.0.0.1, which :func:`supervise` keeps (None: a group of
    one process, which needs none)."""

    rank: int = 0
    size: int = 1
    port: int | None = None


class ReplicaGroup:
    """This process as process ``member.rank`` of a replica group (module docstring): one
    torchft ``Manager`` per process, the same ``replica_id`` across the group; the group's
    process 0 runs its Manager server and store, whose port the others read from
    ``control`` (the group's own store; a group of one needs none). Each process's
    reconfigurable gloo group joins process ``rank`` of every group of the quorum, so
    :meth:`mean_` averages a tensor over the same process of each group (torchft's HSDP).
    ``state()`` is what the same process of a healing group receives, ``load(state)`` takes a
    peer's state (both called by the Manager during :meth:`begin`)."""

    def __init__(self, *, replica: int, lighthouse: str, min_replicas: int, quorum_timeout_s: float,
                 timeout_s: float, state: Callable[[], Any], load: Callable[[Any], None],
                 member: Member = Member(), control: Any = None) -> None:
        _quiet()  # before torchft's import, which sets up its logger
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.replica, self.min_replicas, self.quorum_timeout_s = replica, min_replicas, quorum_timeout_s
        self.timeout = timeout = timedelta(seconds=timeout_s)
        host = own_address(lighthouse)  # the other groups reach this one's store, server and state here
        self._store: Any = None
        if member.rank == 0:  # the Manager's store: a fresh one for each start of the group
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
            port = int(self._store.port)
            if control is not None:
                control.set("ft/store", str(port))
        else:
            port = int(control.get("ft/store"))  # waits for process 0 (the store's timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=state,
            min_replica_size=min_replicas, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timeout, rank=member.rank, world_size=member.size, store_addr=host,
            hostname=host, store_port=port, lighthouse_addr=lighthouse, replica_id=f"replica_{replica}",
            checkpoint_transport=_transport(host, timeout))
        self._open = False  # a quorum joined whose step is not committed yet

    def start(self, line: str, *, replica: int, groups: int, wait: bool) -> None:
        """Mark this group at the start line; ``wait`` (a first attempt): until all ``groups`` are."""
        host, _, port = line.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False,  # type: ignore[attr-defined]
                              timeout=self.timeout)
        store.set(f"ready/{replica}", "1")
        if wait:
            try:
                store.wait([f"ready/{g}" for g in range(groups)])
            except RuntimeError as e:  # torch's store timeout (DistStoreError)
                raise QuorumTimeout(f"not every one of the {groups} replica groups started within "
                                    f"comm.timeout_s = {self.timeout.total_seconds():g} s "
                                    f"({str(e).splitlines()[0]})") from None

    @property
    def step(self) -> int:
        """The steps committed (equal on every group of a quorum)."""
        return int(self.manager.current_step())

    def set_step(self, step: int) -> None:
        """Continue after ``step`` (a checkpoint's)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin(self) -> None:
        """Join the next step's quorum (no-op when joined); a peer's state is loaded here."""
        if self._open:
            return
        began = time.monotonic()
        try:
            self.manager.start_quorum()
        except TimeoutError:
            raise QuorumTimeout(f"no quorum of fault_tolerance.min_replicas = {self.min_replicas} "
                                f"replica group(s) within fault_tolerance.quorum_timeout_s = "
                                f"{self.quorum_timeout_s:g} s (waited {time.monotonic() - began:.1f} s)") from None
        self._open = True

    @property
    def participants(self) -> int:
        """The groups of this step's quorum."""
        return int(self.manager.num_participants())

    def mean_(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` averaged in place over this step's quorum (an error marks the step
        uncommittable instead of raising)."""
        self.manager.allreduce(flat).wait()
        return flat

    def sum_(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` summed in place over this step's quorum (errors as :meth:`mean_`)."""
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        return flat

    def commit(self) -> bool:
        """Whether the step counts: every group of the quorum completed it."""
        self._open = False
        return bool(self.manager.should_commit())

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _stop(procs: dict[Any, Any], grace_s: float = 5.0) -> None:
    """SIGTERM every process still running, SIGKILL what outlives ``grace_s``; reap all."""
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _exit_name(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"exit code {code}"


def _kill_group(procs: dict[tuple[int, int], Any], group: int) -> None:
    """SIGKILL the processes of ``group`` still running and reap them: a group lives and
    dies whole (its shards are one replica), and a process left waiting in a collective
    with a dead group-mate would only time out."""
    mine = [p for (g, _), p in procs.items() if g == group]
    for p in mine:
        if p.is_alive():
            p.kill()
    for p in mine:
        p.join()


def supervise(target: Callable[..., None], args: Callable[[int, int], Sequence[Any]], *, groups: Sequence[int],
              max_restarts: int, fatal: Callable[[int, int, int], BaseException | None],
              preload: Sequence[str] = (), on_restart: Callable[[int, str], None] | None = None,
              on_lost: Callable[[int], None] | None = None, processes: int = 1) -> dict[int, int]:
    """Run ``target(*args(group, restart_count), member)`` in ``processes`` processes per group
    (``member``: :class:`Member`) and restart a group one of whose processes fails, whole (its
    other processes killed first, :func:`_kill_group`) and alone, at most ``max_restarts``
    times each; the others run on (also past a group out of restarts: ``on_lost(group)``). A
    group whose processes all ended (exit 0) is done: once one is, none is restarted (the run
    ended). ``fatal(group, rank, exit_code)`` names a failure no restart mends (raised after
    every process is stopped), as is every group failing. Returns each group's restart count
    once every process ended."""
    ctx = forkserver_context(list(preload))
    restarts = dict.fromkeys(groups, 0)
    # a group of several processes meets at a store of its own, kept across its restarts
    # (each start of the group takes a fresh key prefix there: rendezvous.group_prefix)
    stores = {g: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
              for g in groups} if processes > 1 else {}
    procs: dict[tuple[int, int], Any] = {}

    def start(g: int) -> None:
        for i in range(processes):
            member = Member(i, processes, int(stores[g].port) if stores else None)
            procs[g, i] = ctx.Process(target=target, args=(*args(g, restarts[g]), member),
                                      name=f"paratrain-ft-{g}" + (f".{i}" if processes > 1 else ""))
            procs[g, i].start()

    for g in groups:
        start(g)
    ended: dict[int, set[int]] = {g: set() for g in groups}  # a group's processes that exited 0
    lost: dict[int, str] = {}  # groups out of restarts (or failed after the run ended)
    try:
        while len(lost) + sum(len(e) == processes for e in ended.values()) < len(groups):
            running = {p.sentinel: (g, i, p) for (g, i), p in procs.items() if g not in lost and i not in ended[g]}
            for sentinel in multiprocessing.connection.wait(list(running)):
                g, i, p = running[sentinel]
                if g in lost or procs[g, i] is not p:
                    continue  # its group was restarted or given up in this round already
                p.join()
                if p.exitcode == 0:
                    ended[g].add(i)
                    continue
                error = fatal(g, i, p.exitcode)
                if error is not None:
                    raise error
                _kill_group(procs, g)
                why = _exit_name(p.exitcode) if processes == 1 else f"process {i} {_exit_name(p.exitcode)}"
                if ended[g] or any(len(e) == processes for e in ended.values()) or restarts[g] >= max_restarts:
                    lost[g] = why  # the others go on without it
                    if on_lost is not None:
                        on_lost(g)
                else:
                    restarts[g] += 1
                    if on_restart is not None:
                        on_restart(g, why)
                    start(g)
    finally:
        _stop(procs)
        stores.clear()
    if not any(len(e) == processes for e in ended.values()):
        raise RuntimeError("every replica group failed (run.max_restarts = "
                           f"{max_restarts}): " + ", ".join(f"group {g} {why}" for g, why in sorted(lost.items())))
    return restarts
