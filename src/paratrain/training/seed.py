"""Seeding and RNG state capture, so a resumed run draws the same numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..data.loader import seed_everything as seed_everything


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as tensors/ints only (weights_only-safe)."""
    py = random.getstate()
    np_state: Any = np.random.get_state()
    return {
        "python_version": int(py[0]),
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"]), None))
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), 0, 0.0))
    torch.set_rng_state(state["torch"])
