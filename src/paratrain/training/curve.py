"""The training curve: a ``"kind": "train"`` record every ``run.log_every`` steps (mean loss,
lr, rates, step time, peak memory), from floats the step already returns (no host
synchronisation per step); the window is checkpointed, so a resume logs the same records.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch

TRAIN_KIND = "train"  # the "kind" of a training-curve record in metrics.jsonl


def log_every_of(setting: int, total_steps: int) -> int:
    """``run.log_every``, 0 resolved to about 100 records over the run."""
    return int(setting) if setting else max(1, int(total_steps) // 100)


def peak_rss_mb() -> float:
    """This process's peak resident set (MiB; Linux's ``ru_maxrss`` counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_mb(device: torch.device | None) -> float:
    """The peak memory of this process's training: CUDA's peak allocation, else the peak RSS."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


class TrainCurve:
    """The window of steps since the last training record, and that record."""

    def __init__(self, every: int, *, device: torch.device | None = None) -> None:
        self.every, self.device = every, device
        self.losses: list[float] = []
        self.samples = 0
        self._since = time.perf_counter()

    def add(self, loss: float, samples: int) -> None:
        """One optimizer step's loss (a float the step already returned) and its rows."""
        self.losses.append(loss)
        self.samples += samples

    def due(self, step: int) -> bool:
        """A record is due after ``step`` (a multiple of ``every``)."""
        return bool(self.losses) and step % self.every == 0

    def record(self, step: int, epoch: int, lr: float,
               mean_over_ranks: Callable[[float], float]) -> dict[str, Any]:
        """The record after ``step`` (collective: ``mean_over_ranks``); the window restarts."""
        now = time.perf_counter()
        n, took = len(self.losses), max(now - self._since, 1e-9)
        loss = mean_over_ranks(sum(self.losses) / n)
        rec = {"kind": TRAIN_KIND, "step": step, "epoch": epoch, "train_loss": loss, "lr": lr,
               "steps_per_s": n / took, "samples_per_s": self.samples / took,
               "step_time_s": took / n, "memory_mb": memory_mb(self.device)}
        self.losses, self.samples, self._since = [], 0, now
        return rec

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.losses = [float(v) for v in state.get("losses", [])]
        self.samples = int(state.get("samples", 0))
        self._since = time.perf_counter()
