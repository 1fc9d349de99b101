"""Where the worker processes meet, on one machine or several: :func:`launch_config` (alone, a
c10d rendezvous on ``127.0.0.1`` port 0; across nodes, ``--nnodes/--node-rank/--rdzv-endpoint``
as ``torchrun``), :func:`gloo_interface` and :func:`rendezvous_host` where this host's name
resolves to loopback (peers would be told to connect to their own: "Gloo connectFullMesh
failed"), :func:`group_prefix`, a fresh store key prefix per process group, and
:func:`cheap_event_names` (torch's rendezvous without its ``inspect.stack()`` per event).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig

_ROOT = "paratrain/group"
_NO_NAME = "no_method_name"
_POLL_S = 0.02


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to loopback; True when it does
    not resolve at all (gloo then falls back to loopback as well)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except OSError:
        return True
    return any(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _interface_with(addr: str) -> str | None:
    """The name of the network interface holding IPv4 address ``addr`` (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def address_towards(host: str, port: int) -> str | None:
    """This machine's IPv4 address on the route to ``host`` (``host`` itself when it is
    one of this machine's addresses), or None when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return None


def rendezvous_host(host: str, port: int) -> tuple[str | None, bool | None]:
    """For a multi-node c10d rendezvous at ``host``: (this machine's address as the others
    reach it, True when it hosts the rendezvous), None where torch's own answer stands. torch
    asks this machine's name, which fails where it resolves to loopback (no node hosts the
    store, all time out); only then, and for a non-loopback endpoint, the route decides."""
    if _is_loopback(host) or not _is_loopback(socket.gethostname()):
        return None, None
    local = address_towards(host, port)
    if local is None:
        return None, None
    try:
        targets = {info[4][0] for info in socket.getaddrinfo(host, port, socket.AF_INET)}
    except OSError:
        return local, None
    return local, (True if local in targets else None)


def gloo_interface(master_addr: str, master_port: int) -> str | None:
    """The interface gloo should bind (the one that reaches ``master_addr``) where this host's
    name resolves to loopback and the master's does not; None keeps gloo's default."""
    if (os.environ.get("GLOO_SOCKET_IFNAME") or _is_loopback(master_addr)
            or not _is_loopback(socket.gethostname())):
        return None
    local = address_towards(master_addr, master_port)
    try:
        return None if local is None else _interface_with(local)
    except (OSError, ImportError):
        return None


def group_prefix(store: Any, *, rank: int, world_size: int, timeout: timedelta) -> str:
    """A key prefix (``paratrain/group/<id>/``) the ranks of the group forming now agree on and no
    earlier group used (collective; TimeoutError naming the rank after ``timeout``). Node 0's agent
    keeps one TCPStore across restarts and attempt numbers differ across machines, so rank 0's
    random id is echoed back to each rank's random token: never an id a dead rank 0 left."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        gid = uuid.uuid4().hex
        store.set(f"{_ROOT}/leader", gid)
        for r in range(1, world_size):
            hello = f"{_ROOT}/{gid}/hello/{r}"
            store.wait([hello], timeout)
            store.set(f"{_ROOT}/{gid}/welcome/{r}", store.get(hello))
        return f"{_ROOT}/{gid}/"
    token = uuid.uuid4().hex.encode()
    seen: str | None = None
    while True:
        gid = store.get(f"{_ROOT}/leader").decode()  # waits for the first rank 0 to write it
        if gid != seen:  # a new rank 0: answer it (an old one never will)
            seen = gid
            store.set(f"{_ROOT}/{gid}/hello/{rank}", token)
        welcome = f"{_ROOT}/{gid}/welcome/{rank}"
        if store.check([welcome]) and store.get(welcome) == token:
            return f"{_ROOT}/{gid}/"
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 of this group did not answer within "
                               f"{timeout.total_seconds():.0f} s (comm.timeout_s)")
        time.sleep(_POLL_S)


ENV_NNODES = "PARATRAIN_NNODES"
ENV_NODE_RANK = "PARATRAIN_NODE_RANK"
ENV_RDZV_ENDPOINT = "PARATRAIN_RDZV_ENDPOINT"
# The command-line flag behind each variable: errors name what the user typed.
_FLAG = {ENV_NNODES: "--nnodes", ENV_NODE_RANK: "--node-rank", ENV_RDZV_ENDPOINT: "--rdzv-endpoint"}

def in_torchrun() -> bool:
    """True when torchrun (or any launcher) already set RANK, WORLD_SIZE and MASTER_ADDR."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError([(_FLAG[name], f"must be an integer (got {raw!r})")]) from None


def check_nodes(nnodes: int | None, node_rank: int | None, endpoint: str | None) -> None:
    """Check ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``; a ConfigError names the flag."""
    n = 1 if nnodes is None else nnodes
    if n < 1:
        raise ConfigError([("--nnodes", f"must be >= 1 (got {n})")])
    if n > 1 and not endpoint:
        raise ConfigError([("--rdzv-endpoint", "required with more than one node (HOST:PORT)")])
    if node_rank is not None and not 0 <= node_rank < n:
        raise ConfigError([("--node-rank", f"must be in [0, {n}) with --nnodes {n} (got {node_rank})")])
    if endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError([("--rdzv-endpoint", f"expected HOST:PORT with a port in 1..65535 (got {endpoint!r})")])


def launch_config(job: JobConfig, *, nprocs: int) -> Any:
    """The :class:`LaunchConfig` for ``job`` on this node (from the PARATRAIN_* variables):
    each of the ``PARATRAIN_NNODES`` nodes runs ``nprocs / nnodes`` of the job's processes."""
    from torch.distributed.launcher.api import LaunchConfig

    if nprocs < 1:
        raise ConfigError([("nprocs", f"need at least one worker process (got {nprocs})")])
    nnodes = _int_env(ENV_NNODES, 1) or 1
    node_rank = _int_env(ENV_NODE_RANK, None)
    endpoint = os.environ.get(ENV_RDZV_ENDPOINT, "")
    check_nodes(nnodes, node_rank, endpoint)
    if nprocs % nnodes:
        raise ConfigError([(
            "--nnodes",
            f"the job needs {nprocs} worker processes, which {nnodes} nodes cannot share evenly",
        )])

    rdzv_configs: dict[str, Any] = {"timeout": int(job.comm.timeout_s)}
    local_addr: str | None = None
    if nnodes == 1 and not endpoint:
        # Port 0: the rendezvous store binds a port the kernel picks, atomically (what
        # torchrun --standalone does). A port picked beforehand (bind, close, bind
        # again) can be taken by any other socket in between.
        endpoint = "127.0.0.1:0"
        backend = "c10d"
        local_addr = "127.0.0.1"
        rdzv_configs["is_host"] = True
    elif node_rank is not None:
        # torchrun's --node-rank semantics: the static rendezvous fixes node ranks and
        # the endpoint is the master's address.
        backend = "static"
        rdzv_configs["rank"] = node_rank
    else:
        backend = "c10d"
        if nnodes > 1:
            host, _, port = endpoint.rpartition(":")
            local_addr, is_host = rendezvous_host(host, int(port))
            if is_host:
                rdzv_configs["is_host"] = True
    # Every node must agree on the run id: across nodes it comes from the job, not at random.
    default_id = f"paratrain-{job.run.name}" if nnodes > 1 else f"{job.run.name}-{uuid.uuid4().hex[:8]}"
    run_id = os.environ.get("PARATRAIN_RUN_ID") or default_id
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nprocs // nnodes,
                        run_id=run_id, rdzv_backend=backend, rdzv_endpoint=endpoint,
                        rdzv_configs=rdzv_configs, max_restarts=job.run.max_restarts,
                        monitor_interval=0.1, start_method="forkserver", local_addr=local_addr)


def get_method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames above this one, ``"no_method_name"`` above the
    outermost: what torch's ``dynamic_rendezvous.get_method_name`` returns, from
    ``sys._getframe`` instead of ``inspect.stack()`` (tests/comm/test_comm_launch.py compares them)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return _NO_NAME


def cheap_event_names() -> None:
    """Name torch's rendezvous events with :func:`get_method_name`. torch 2.13's dynamic rendezvous
    names each event it records (several per rendezvous, each keep-alive and retry) with
    ``inspect.stack()[2].function``, called twice: ``inspect.stack()`` reads the source of every
    frame on the stack and maps each file to its module through ``sys.modules``. Under a test
    runner or a notebook (a deep stack, thousands of modules) that was 18% of the CPU of a
    sample of multi-process test files (py-spy), nearly all of the launcher's own. The names
    are the same; idempotent."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if getattr(dynamic_rendezvous, "get_method_name", None) is not None:
        dynamic_rendezvous.get_method_name = get_method_name
