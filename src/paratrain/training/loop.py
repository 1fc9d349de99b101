"""Shared loop pieces: the device, the per-epoch permutation and one optimizer step."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resolve_device", "epoch_permutation", "train_step", "parameters_digest"]


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from ..config import ConfigError

        raise ConfigError([("run.device", "'cuda' requested but CUDA is not available")])
    return torch.device(name)


def epoch_permutation(n: int, *, seed: int, epoch: int) -> torch.Tensor:
    """A fresh permutation of ``range(n)`` per epoch, a pure function of (seed, epoch):
    every rank computes the same one, and a resumed run replays it exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    """Forward, cross-entropy, backward, step. Returns the batch loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def parameters_digest(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every parameter and buffer, in state_dict order."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
