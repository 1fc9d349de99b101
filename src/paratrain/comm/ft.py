"""Replica groups on torchft (``[fault_tolerance]``): a :class:`Lighthouse` that forms each
step's quorum, one :class:`ReplicaGroup` (torchft's ``Manager`` over a reconfigurable gloo
group) per process, and :func:`supervise`, which restarts only the process that died.

A step of a replica group: :meth:`ReplicaGroup.begin` joins the step's quorum (synchronous:
a group behind the others' step receives a live peer's state here, through the Manager's
checkpoint transport); :meth:`ReplicaGroup.mean_` averages a tensor over the groups of that
quorum, ``x <- (1/q) sum_{g in quorum} x_g``; :meth:`ReplicaGroup.commit` says whether every
group of the quorum completed the step (then it counts, else the step is taken again).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
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


class ReplicaGroup:
    """This process as one replica group of one process (module docstring). ``state()`` is
    what a healing peer receives, ``load(state)`` takes a peer's state (both called by the
    Manager during :meth:`begin`)."""

    def __init__(self, *, replica: int, lighthouse: str, min_replicas: int, quorum_timeout_s: float,
                 timeout_s: float, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        _quiet()  # before torchft's import, which sets up its logger
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.replica, self.min_replicas, self.quorum_timeout_s = replica, min_replicas, quorum_timeout_s
        self.timeout = timeout = timedelta(seconds=timeout_s)
        host = own_address(lighthouse)  # the other groups reach this one's store, server and state here
        # the Manager's own store (one process: this group's only rank)
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=state,
            min_replica_size=min_replicas, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timeout, rank=0, world_size=1, store_addr=host, hostname=host,
            store_port=self._store.port, lighthouse_addr=lighthouse, replica_id=f"replica_{replica}",
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


def _stop(procs: dict[int, Any], grace_s: float = 5.0) -> None:
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


def supervise(target: Callable[..., None], args: Callable[[int, int], Sequence[Any]], *, groups: Sequence[int],
              max_restarts: int, fatal: Callable[[int, int], BaseException | None],
              preload: Sequence[str] = (), on_restart: Callable[[int, str], None] | None = None,
              on_lost: Callable[[int], None] | None = None) -> dict[int, int]:
    """Run ``target(*args(group, restart_count))`` in one process per group and restart a
    group whose process fails, alone, at most ``max_restarts`` times each; the others run on
    (also past a group out of restarts: ``on_lost(group)``). A group that ended (exit 0) is done: once one is,
    none is restarted (the run ended). ``fatal(group, exit_code)`` names a failure no restart
    mends (raised after every process is stopped), as is every group failing. Returns each
    group's restart count once every process ended."""
    ctx = forkserver_context(list(preload))
    restarts = dict.fromkeys(groups, 0)
    procs: dict[int, Any] = {}

    def start(g: int) -> None:
        procs[g] = ctx.Process(target=target, args=tuple(args(g, restarts[g])), name=f"paratrain-ft-{g}")
        procs[g].start()

    for g in groups:
        start(g)
    done: set[int] = set()
    lost: dict[int, str] = {}  # groups out of restarts (or failed after the run ended)
    try:
        while len(done) + len(lost) < len(groups):
            running = {p.sentinel: g for g, p in procs.items() if g not in done and g not in lost}
            for sentinel in multiprocessing.connection.wait(list(running)):
                g = running[sentinel]
                procs[g].join()
                code = procs[g].exitcode
                error = fatal(g, code) if code else None
                if error is not None:
                    raise error
                if code == 0:
                    done.add(g)
                elif done or restarts[g] >= max_restarts:  # the others go on without it
                    lost[g] = _exit_name(code)
                    if on_lost is not None:
                        on_lost(g)
                else:
                    restarts[g] += 1
                    if on_restart is not None:
                        on_restart(g, _exit_name(code))
                    start(g)
    finally:
        _stop(procs)
    if not done:
        raise RuntimeError("every replica group failed (run.max_restarts = "
                           f"{max_restarts}): " + ", ".join(f"group {g} {why}" for g, why in sorted(lost.items())))
    return restarts

