"""paratrain.training.optim: the pre-run optimizer check builds the optimizer without
importing torch's compiler (``torch._dynamo``, about 1.3 s of CPU), and still refuses bad
options; an optimizer built for training afterwards takes torch's usual path."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import sys, torch
from paratrain.config import ConfigError
from paratrain.config.job import OptimizerSpec
from paratrain.training.optim import build_optimizer, check_optimizer
params = [torch.nn.Parameter(torch.zeros(3))]
for spec in ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adam", "lr": 1e-3},
             {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}):
    check_optimizer(params, OptimizerSpec.model_validate(spec))
print("after check", "torch._dynamo" in sys.modules)
try:
    check_optimizer(params, OptimizerSpec.model_validate({"name": "sgd", "lr": 0.1, "momentum": -1.0}))
except ConfigError as e:
    print("refused", e.problems[0][0])
wrapped = torch.optim.Optimizer.add_param_group.__wrapped__
print("cache left", getattr(wrapped, "__dynamo_disable", None) is not None)
build_optimizer(params, OptimizerSpec.model_validate({"name": "sgd", "lr": 0.1}))
print("after build", "torch._dynamo" in sys.modules)
"""


def test_check_optimizer_imports_no_compiler_and_still_refuses() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "after check False" in lines
    assert "refused train.optimizer" in lines
    assert "cache left False" in lines
    assert "after build True" in lines  # non-vacuity: building for training imports it
