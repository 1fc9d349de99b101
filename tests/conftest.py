"""Test setup: tests/ on sys.path (worker functions for spawned ranks live here),
one torch thread per process (the CI machine has 2 cores), fixed hypothesis profile."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

settings.register_profile(
    "paratrain",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("paratrain")
