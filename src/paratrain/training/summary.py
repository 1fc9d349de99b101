"""What every strategy's summary reports: position, test metrics, best, reference metrics,
wall time, parameter count and the parameters' digest."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (on the CPU, in row-major order), for digests."""
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def parameters_digest(state: nn.Module | Mapping[str, torch.Tensor]) -> str:
    """A summary's ``parameters_sha256``, the same under every strategy: SHA-256 over each
    name and the raw bytes of its whole tensor, in ``state_dict`` order (a tied tensor under
    each name). ``state``: the model, or the gathered state_dict of ``model.safetensors``."""
    h = hashlib.sha256()
    for name, t in (state.state_dict() if isinstance(state, nn.Module) else state).items():
        h.update(name.encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


def summary_fields(result: Any, task: Any, *, train: Any, test: Any, model: nn.Module | None,
                   started: float) -> dict[str, Any]:
    """The summary keys every strategy reports (on the logging process)."""
    out: dict[str, Any] = {"steps": result.position.step, "epochs": result.position.epoch,
                           "task": str(getattr(task, "name", type(task).__name__))}
    if model is not None:
        out["num_parameters"] = sum(p.numel() for p in model.parameters())
    if result.final is not None:
        out.update({f"test_{k}": v for k, v in result.final.items()})
        out[f"best_test_{task.fitness_metric}"] = result.best
    reference = getattr(task, "reference_metrics", None)
    if callable(reference):
        out.update(reference(train, test))
    resumed = getattr(result, "extra", {}).get("resumed_from")
    if resumed:  # which checkpoint, of which layout (read by the model's names when resharded)
        out["resumed_from"] = resumed
    out["wall_time_s"] = round(time.perf_counter() - started, 3)
    if model is not None:
        out["parameters_sha256"] = parameters_digest(model)
    return out
