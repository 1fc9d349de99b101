"""Counters and handles of the tensor-parallel collectives. :class:`CommStats` counts every
call by type, at the call: ``payload_bytes_measured`` (the tensors this rank hands over) and
``bytes_sent_modelled`` (the ring cost model: all_reduce 2(p-1)/p n; all_gather,
reduce_scatter, broadcast, reduce (p-1)/p n; send n: the backend's algorithm is not visible
from here), the time spent waiting, the compute time the layers book, and ``replayed``
collectives a recomputation read back from its tape instead. :class:`Handle` is an in-flight
collective; ``wait()`` returns its result and books the wait.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CommStats:
    """The counters of the module docstring, kept at each call (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()  # ring-model wire bytes (modelled)
        self.payload: Counter[str] = Counter()  # sizes of the tensors handed over (measured)
        self.comm_time_s = 0.0
        self.compute_time_s = 0.0
        self.async_launched = 0  # collectives started without blocking (overlappable)
        # forward collectives a recomputation read back from a tape instead of running
        # (tensor_parallel.memory): not sent, so in none of the counts above
        self.replayed = 0

    def record(self, kind: str, wire_bytes: float, seconds: float = 0.0, *, payload_bytes: int = 0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.bytes[kind] += int(round(wire_bytes))
            self.payload[kind] += int(payload_bytes)
            self.comm_time_s += seconds

    def launched_async(self) -> None:
        with self._lock:
            self.async_launched += 1

    def replayed_collective(self) -> None:
        with self._lock:
            self.replayed += 1

    def add_comm_time(self, seconds: float) -> None:
        with self._lock:
            self.comm_time_s += seconds

    def add_compute_time(self, seconds: float) -> None:
        with self._lock:
            self.compute_time_s += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "collectives": dict(self.counts),
                "bytes_sent_by_type_modelled": dict(self.bytes),
                "payload_bytes_by_type_measured": dict(self.payload),
                "total_collectives": sum(self.counts.values()),
                "bytes_sent_modelled": sum(self.bytes.values()),
                "payload_bytes_measured": sum(self.payload.values()),
                "communication_time_s": self.comm_time_s,
                "computation_time_s": self.compute_time_s,
                "async_collectives": self.async_launched,
                "replayed_collectives": self.replayed,
            }


class Handle:
    """An in-flight collective; ``wait()`` returns its result and books the exposed time."""

    def __init__(self, stats: CommStats, *, work: Any = None, future: Future[Any] | None = None,
                 result: Any = None, finish: Callable[[], Any] | None = None) -> None:
        self._stats, self._work, self._future = stats, work, future
        self._result, self._finish = result, finish
        self._done = work is None and future is None

    def wait(self) -> Any:
        if not self._done:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
            if self._future is not None:
                self._result = self._future.result()
            self._stats.add_comm_time(time.perf_counter() - t0)
            self._done = True
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result
