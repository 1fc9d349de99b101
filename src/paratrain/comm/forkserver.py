"""Worker processes that start in milliseconds: a forkserver that has imported torch once.

``import torch`` costs about 3 s of CPU in every process ``spawn`` starts (a 4-rank launch on
2 cores spent ~6 s importing). :func:`context`'s one single-threaded server imports torch and
the caller's ``preload``; workers are ``fork()``s of it, before any torch thread pool exists,
and inherit the *server's* state, so :class:`ParentState` carries what ``spawn`` would give.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction as reduction
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The per-rank environment torch's elastic agent sets in each worker (on top of ours).
_LAUNCHER_KEYS = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
})


def context(preload: Sequence[str] = ()) -> Any:
    """The forkserver context, its server preloading torch, NumPy and ``preload`` (the
    workers' entry module, named by the caller; a server already running keeps its own),
    with the collector off while it imports and its heap frozen after (:mod:`.forkserver_gc`,
    :mod:`.forkserver_frozen`)."""
    global _STOP_AT_EXIT
    if not _STOP_AT_EXIT:
        atexit.register(_stop_at_exit)  # runs before multiprocessing's own exit function (LIFO)
        _STOP_AT_EXIT = True
    multiprocessing.set_forkserver_preload([f"{__package__}.forkserver_gc", "torch", "torch.distributed", "numpy",
                                            *preload, f"{__package__}.forkserver_frozen"])
    return multiprocessing.get_context("forkserver")


_STOP_AT_EXIT = False


def warm(preload: Sequence[str] = ()) -> None:
    """Start the forkserver now (while this process checks the job), without waiting; a no-op
    when it runs. ``preload`` is a hint: the server skips a name that fails to import."""
    context(preload)
    multiprocessing.forkserver.ensure_running()


def _reap(pid: int, timeout_s: float) -> None:
    """Wait for child ``pid`` to exit (SIGKILL after ``timeout_s``) and collect it."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.005)


def stop(timeout_s: float = 10.0) -> None:
    """End the forkserver (SIGKILL: it holds no state, so its 1-2 s interpreter shutdown is
    skipped) and the resource tracker (EOF, its normal end) this process started, which
    otherwise outlived ``paratrain run`` by 1-2 s, and reap both within ``timeout_s``; through
    CPython's ``multiprocessing`` singletons."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    lock = getattr(server, "_lock", None)
    if lock is not None:
        with lock:
            pid = getattr(server, "_forkserver_pid", None)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                try:
                    server._stop_unlocked()  # type: ignore[union-attr]  # closes its fd, reaps it
                except ChildProcessError:  # reaped elsewhere already: forget it
                    server._forkserver_pid = server._forkserver_address = None  # type: ignore[union-attr]
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    lock = getattr(tracker, "_lock", None)
    if lock is not None:
        with lock:
            fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
            if fd is not None and pid is not None:
                os.close(fd)  # EOF: the tracker cleans up and exits
                tracker._fd = tracker._pid = None  # type: ignore[union-attr]
                _reap(pid, timeout_s)


def _stop_at_exit() -> None:
    """:func:`stop` at interpreter exit, after freeing this process's named semaphores:
    multiprocessing's own exit function (which runs after this one) found them freed by the
    tracker :func:`stop` closes and printed a ``FileNotFoundError`` traceback."""
    with contextlib.suppress(Exception):
        multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]
    stop()


class _InheritFd:
    """Pickles as a duplicate of ``fd`` that the child receives over the forkserver's
    socket; unpickles to the child's descriptor number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        # DupFd must be built while the process is being pickled for start().
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def _inherit(fd: int) -> _InheritFd | None:
    """``fd`` to pass on, or None when this process has no such descriptor (a daemon with
    its stdio closed): the child then keeps the server's."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return _InheritFd(fd)


@dataclass
class ParentState:
    """What a spawned child would inherit from its parent *now*: environment, working directory,
    ``sys.path``, the current stdout/stderr (as ``DupFd``)."""

    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: str = field(default_factory=os.getcwd)
    path: list[str] = field(default_factory=lambda: list(sys.path))
    stdio: tuple[Any, Any] = field(default_factory=lambda: (_inherit(1), _inherit(2)))

    def apply(self) -> None:
        """In the child, before anything is unpickled: take them (keeping the launcher's
        per-rank environment keys)."""
        launcher = {k: v for k, v in os.environ.items()
                    if k in _LAUNCHER_KEYS or k.startswith("TORCHELASTIC_")}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(launcher)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for target, fd in zip((1, 2), self.stdio, strict=True):
            if isinstance(fd, int) and fd != target:
                (sys.stdout if target == 1 else sys.stderr).flush()
                os.dup2(fd, target)
                os.close(fd)

