"""Test harness: a local Flower federation on 127.0.0.1 (tests, benchmarks, trying the app on one machine):
``flower-superlink`` and N ``flower-supernode`` processes with explicit 127.0.0.1 addresses on
free ports (Flower's defaults bind 0.0.0.0), either ``--insecure`` (the default) or, with
``secure=True``, over TLS with CLI-managed node authentication: a local CA and server certificate
and one key pair per node (:mod:`_flower_pki`), the SuperLink started with the certificates and
``--enable-supernode-auth``, each node's public key registered with ``flwr supernode register``
before the nodes start, each node started with ``--root-certificates`` and its private key, and
``flwr`` trusting the CA through ``root-certificates`` in ``config.toml``. Node ``i`` is started with
``--node-config 'partition-id=i num-partitions=N state-dir="<home>/node<i>-state"'`` (the
node keeps its clients' state there across server restarts); ``flwr run`` against it. ``FLWR_HOME``
(Flower's config, installed apps and state) is a folder of the caller's choosing, so nothing
outside it is touched. Every process is started in its own session and ended with its whole
process group (the ServerApp/ClientApp processes Flower spawns too) by :meth:`close`.

The commands are the ones examples/federated_flower/README.md gives. No Flower import."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _flower_pki import write_local_pki

__all__ = ["LocalFederation", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(root: int) -> list[int]:
    """Every live descendant of process ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s; log {log}")


class LocalFederation:
    """A SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1 (see the module docstring)."""

    def __init__(self, home: str | Path, num_nodes: int, *, num_partitions: int | None = None,
                 bin_dir: str | Path | None = None, secure: bool = False,
                 task_poll_interval: float = 1.0) -> None:
        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.bin = Path(bin_dir) if bin_dir is not None else Path(sys.executable).parent
        self.num_nodes = int(num_nodes)
        self.num_partitions = int(num_partitions or num_nodes)
        self.port = free_port()
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        # Each SuperExec (one per SuperNode, one on the SuperLink) asks for a task, and starts at
        # most one, every task_poll_interval s. Flower's default 1 s: an idle federation of two
        # SuperNodes took 0.034 CPU-s per second at 1 s, 0.052 at 0.3 s (the SuperLink and the
        # SuperNodes serve the polls), and the tests are CPU-bound; 1 s adds half a second per
        # message on average to a ClientApp process that takes seconds of CPU to start
        self.env = {**os.environ, "FLWR_HOME": str(self.home),
                    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": repr(float(task_poll_interval)),
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.pki = write_local_pki(self.home / "certs", self.num_nodes) if secure else None
        trust = f'root-certificates = "{self.pki.ca_cert}"' if self.pki else "insecure = true"
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\n{trust}\n', encoding="utf-8")

    # ------------------------------------------------------------------ processes

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        log = self.home / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, cwd=self.home, env={**self.env, **(env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 60.0, num_started: int | None = None) -> LocalFederation:
        """Start the SuperLink (and, when secure, register every node's public key) and SuperNodes
        ``0 .. num_started - 1`` (default: all)."""
        if self.pki is None:
            link = ["--insecure"]
        else:
            link = ["--ssl-ca-certfile", str(self.pki.ca_cert), "--ssl-certfile", str(self.pki.server_cert),
                    "--ssl-keyfile", str(self.pki.server_key), "--enable-supernode-auth"]
        sl = self._start("superlink", [str(self.bin / "flower-superlink"), *link, "--host", "127.0.0.1",
                                       "--port", str(self.port), "--disable-runtime-dependency-installation"])
        _wait_port(self.port, sl, timeout, self.home / "superlink.log")
        if self.pki is not None:
            for i in range(self.num_nodes):
                self.register(self.pki.node_public_key(i), timeout)
        for i in range(self.num_nodes if num_started is None else num_started):
            self.start_node(i)
        return self

    def register(self, public_key: Path, timeout: float = 60.0) -> None:
        """``flwr supernode register PUBLIC_KEY local``: allow the node holding the matching private
        key to connect (a SuperLink started with ``--enable-supernode-auth`` refuses any other)."""
        res = subprocess.run([str(self.bin / "flwr"), "supernode", "register", str(public_key), "local"],
                             cwd=self.home, env=self.env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0 or "registered successfully" not in res.stdout:
            raise RuntimeError(f"flwr supernode register {public_key} failed ({res.returncode}):\n"
                               f"{res.stdout}\n{res.stderr}")

    def start_node(self, i: int, env: dict[str, str] | None = None, *,
                   private_key: Path | None = None, name: str | None = None) -> subprocess.Popen[Any]:
        """(Re)start SuperNode ``i`` (partition ``i``), a new node id for the SuperLink. When secure,
        the node signs with ``private_key`` (default: node ``i``'s registered key)."""
        port = free_port()
        if self.pki is None:
            trust = ["--insecure"]
        else:
            key = private_key if private_key is not None else self.pki.node_keys[i]
            trust = ["--root-certificates", str(self.pki.ca_cert), "--auth-supernode-private-key", str(key)]
        return self._start(name or f"node{i}", [
            str(self.bin / "flower-supernode"), *trust, "--superlink", f"127.0.0.1:{self.port}",
            "--host", "127.0.0.1", "--port", str(port),
            "--node-config", (f"partition-id={i} num-partitions={self.num_partitions} "
                              f'state-dir="{self.home / f"node{i}-state"}"')], env)

    def kill(self, name: str) -> None:
        """SIGKILL the process ``name``, every process of its group and every descendant
        (Flower's SuperExec starts the ServerApp/ClientApp processes in sessions of their own)."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        tree = _descendants(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _app_pids(self, name: str, exe: bytes) -> list[int]:
        """The running ``exe`` processes that process ``name`` spawned (through its SuperExec)."""
        proc = self.procs.get(name)
        if proc is None:
            return []
        out = []
        for pid in _descendants(proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(exe) for part in cmd[:2]):
                out.append(pid)
        return out

    def serverapp_pids(self) -> list[int]:
        """The running ``flwr-serverapp`` processes the SuperLink spawned."""
        return self._app_pids("superlink", b"flwr-serverapp")

    def clientapp_pids(self, name: str) -> list[int]:
        """The running ``flwr-clientapp`` processes SuperNode ``name`` (``"node<i>"``) spawned: one
        per message it took (its SuperExec, a child too, is not one)."""
        return self._app_pids(name, b"flwr-clientapp")

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ runs

    def run(self, app: str | Path, config: dict[str, Any], timeout: float = 120.0) -> str:
        """``flwr run APP local --run-config ...``; returns what it printed (the run id line)."""
        items = " ".join(f"{k}={_toml(v)}" for k, v in config.items())
        res = subprocess.run([str(self.bin / "flwr"), "run", str(Path(app).resolve()), "local", "--run-config", items],
                             cwd=self.home, env=self.env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"flwr run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res.stdout

    def logs(self) -> str:
        """The tail of every process's log (for a failing test's message)."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.home.glob("*.log")))


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
