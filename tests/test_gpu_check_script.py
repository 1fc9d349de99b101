"""scripts/gpu_check.sh on a machine without a GPU: exit 0 and one JSON object saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script runs the real checks")
def test_gpu_check_says_no_gpu_and_exits_0() -> None:
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert out["gpu"] is False
    assert out["reason"] == "no CUDA device"
    assert out["checks"] == {}


def test_gpu_check_lists_every_device_check() -> None:
    """The checks the script runs on a GPU machine are the ones it promises."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert set(gpu_check.CHECKS) == {"dp_vs_ddp_and_compressed_exchange", "tensor_parallel", "pipeline", "bf16"}
    assert gpu_check.DEADLINE_S < 300
