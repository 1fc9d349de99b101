"""Two "hosts" on one machine for the multi-node tests: two network namespaces joined by
a veth pair (``10.<a>.<b>.1/24`` and ``.2/24``), ``lo`` up in each.

Each host has its own network stack, so a process in host A reaches host B only through
the veth pair at B's address, exactly as across two machines on one subnet (its
127.0.0.1 is its own, and its ports are its own). What shares a host is what runs under
``ip netns exec NS``; :meth:`Host.kill_all` SIGKILLs every process in the namespace (the
whole "machine" going down). Needs root and ``ip`` (iproute2); :func:`cannot_create`
says why not where they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Host", "cannot_create", "make_hosts", "remove_hosts", "remove_stale", "skip_without"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def cannot_create() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pt-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "delete", probe, check=False)
    return None


def skip_without(test: str) -> None:
    """Skip the calling test module (``test``, its name), saying why on stderr, where
    namespaces cannot be made."""
    why = cannot_create()
    if why is not None:
        import pytest

        print(f"{test}: skipped: {why}", file=sys.stderr)
        pytest.skip(f"two hosts need network namespaces: {why}", allow_module_level=True)


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its veth interface and its address on the pair."""

    ns: str
    ifname: str
    addr: str

    def cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.cmd(argv), **kw)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process of this host until none is left; the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
            time.sleep(0.05)
        return killed


def make_hosts(tag: str, subnet: int) -> tuple[Host, Host]:
    """Namespaces ``pt-<tag>-a`` / ``-b`` with a veth pair on ``10.<hi>.<lo>.0/24``
    (``subnet`` in 0..65535 picks it); every partial state is removed on failure."""
    hi, lo = divmod(subnet % 65536, 256)
    a = Host(f"pt-{tag}-a", f"vpt{tag}a"[:15], f"10.{hi}.{lo}.1")
    b = Host(f"pt-{tag}-b", f"vpt{tag}b"[:15], f"10.{hi}.{lo}.2")
    try:
        for h in (a, b):
            _ip("netns", "add", h.ns)
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        for h in (a, b):
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
    except BaseException:
        remove_hosts(a, b)
        raise
    return a, b


def remove_hosts(*hosts: Host) -> None:
    """Kill every process of each host, then delete its namespace (the veth pair goes
    with it). Never raises."""
    for h in hosts:
        try:
            h.kill_all()
        finally:
            _ip("netns", "delete", h.ns, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces ``pt-<pid>...`` of test sessions whose process is gone (a
    session killed before its finalizer ran); the names removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"pt-(\d+)\w*-[ab]", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            remove_hosts(Host(name, "", ""))
            removed.append(name)
    return removed
