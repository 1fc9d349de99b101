"""What a process group needs when its workers live on several machines.

**Which address gloo listens on.** gloo binds the address this host's name resolves to; where
``/etc/hosts`` maps it to ``127.0.0.1`` or ``127.0.1.1``, peers on other hosts are told to
connect to their own loopback ("Gloo connectFullMesh failed ... Connection refused").
:func:`gloo_interface` picks the interface that routes to ``MASTER_ADDR`` in exactly that case
(``GLOO_SOCKET_IFNAME``, when set, always wins).

**Which keys belong to this group.** Node 0's elastic agent keeps one TCPStore across restart
attempts, so a dead group's keys are still there when the next one meets, and a per-attempt
prefix fails across machines (a node started again counts attempts from 0 while the survivor
is at 1). :func:`group_prefix` agrees on a fresh prefix instead: rank 0 publishes a random id;
every other rank answers under it with a random token and waits until rank 0 echoes it back,
so an id left by a dead rank 0 is never taken for the current one.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

_ROOT = "paratrain/group"
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
    """The interface gloo should bind for a group whose store is at ``master_addr``, or
    None to keep gloo's default. Only when this host's name resolves to loopback (what
    gloo would bind) while the master is reached at a non-loopback address: the
    interface this host uses to reach the master."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or _is_loopback(master_addr):
        return None
    if not _is_loopback(socket.gethostname()):
        return None
    local = address_towards(master_addr, master_port)
    try:
        return None if local is None else _interface_with(local)
    except (OSError, ImportError):
        return None


def group_prefix(store: Any, *, rank: int, world_size: int, timeout: timedelta) -> str:
    """A key prefix (``paratrain/group/<id>/``) that every rank of the group forming now
    agrees on and no earlier group used (see the module docstring). Collective: every
    rank calls it; raises TimeoutError naming the rank after ``timeout``."""
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
