"""The [train] options of the one loop (training/stepping.py), under Local:

* the schedule's shapes (pure) and that the optimizer really sees them;
* ``grad_accumulation = k`` with batch b takes the steps of batch k*b (mean losses);
* ``grad_clip_norm`` scales by torch's ``clip_grad_norm_`` coefficient;
* ``precision = "bf16"`` really runs the forward in bfloat16 (and changes the result);
* a Local run SIGKILLed midway (a real process) and resumed with every option on ends
  bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.config import ConfigError, load_job
from paratrain.executors import local
from paratrain.files import step_folders
from paratrain.training.stepping import (
    autocast,
    build_scheduler,
    clip_coefficient,
    clip_gradients_,
    local_grad_sq_norm,
    lr_factor,
)

OPTS: dict[str, Any] = {"lr_schedule": "cosine", "warmup_steps": 3, "grad_clip_norm": 0.5,
                        "grad_accumulation": 2, "precision": "bf16",
                        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05}}


def _doc(tmp: Path, name: str, **train: Any) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 4, "output_dir": str(tmp), "checkpoint_every": 4},
            "task": {"name": "regression"}, "data": {"name": "diabetes"},
            "model": {"name": "mlp", "hidden": [16]},
            "train": {"epochs": 2, "batch_size": 8, "eval_every": 5,
                      "optimizer": {"name": "sgd", "lr": 0.05}, **train}}


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(["constant", "cosine", "linear"]), warmup=st.integers(0, 20),
       total=st.integers(1, 200), step=st.integers(0, 250))
def test_lr_factor_is_in_range_warms_up_and_ends_at_zero(kind: str, warmup: int, total: int,
                                                         step: int) -> None:
    f = lr_factor(step, kind=kind, warmup_steps=warmup, total_steps=total)
    assert 0.0 <= f <= 1.0
    if step < warmup:
        assert f == pytest.approx((step + 1) / warmup)
    elif kind == "constant":
        assert f == 1.0
    elif step >= total > warmup:
        assert f == pytest.approx(0.0, abs=1e-12)


def test_scheduler_drives_the_optimizer_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    cfg = load_job({"train": {"lr_schedule": "linear", "warmup_steps": 2}}).train
    sched = build_scheduler(opt, cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1, 0.2, 0.2, 0.15, 0.1, 0.05])
    assert math.isclose(0.5 * (1 + math.cos(math.pi * 0.5)), lr_factor(3, kind="cosine", warmup_steps=1, total_steps=5))


def test_clipping_matches_torch_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    for x, y in zip(a, b, strict=True):
        x.grad = torch.randn(x.shape, generator=g)
        y.grad = x.grad.clone()
    torch.nn.utils.clip_grad_norm_(a, 0.7)
    clip_gradients_(b, clip_coefficient(float(local_grad_sq_norm(b)), 0.7))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x.grad, y.grad, rtol=1e-6)
    assert clip_coefficient(1.0, 5.0) == 1.0  # under the norm: untouched


def test_bf16_autocast_really_runs_in_bfloat16() -> None:
    lin = torch.nn.Linear(4, 4)
    with autocast("bf16", "cpu"):
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    with autocast("fp32", "cpu"):
        assert lin(torch.randn(2, 4)).dtype == torch.float32


def test_accumulation_equals_the_big_batch(tmp_path: Path) -> None:
    a = local.run(load_job(_doc(tmp_path, "acc", grad_accumulation=4, batch_size=4, max_steps=6)))
    b = local.run(load_job(_doc(tmp_path, "big", batch_size=16, max_steps=6)))
    assert a["steps"] == b["steps"] == 6
    assert a["test_mse"] == pytest.approx(b["test_mse"], rel=1e-5)
    c = local.run(load_job(_doc(tmp_path, "small", batch_size=4, max_steps=6)))
    assert c["test_mse"] != pytest.approx(b["test_mse"], rel=1e-5)  # non-vacuity


def test_each_option_changes_the_result(tmp_path: Path) -> None:
    base = local.run(load_job(_doc(tmp_path, "base", max_steps=6)))["parameters_sha256"]
    for i, opt in enumerate(({"lr_schedule": "cosine"}, {"warmup_steps": 2}, {"grad_clip_norm": 0.01},
                             {"precision": "bf16"}, {"optimizer": {"name": "sgd", "lr": 0.05, "weight_decay": 0.5}})):
        got = local.run(load_job(_doc(tmp_path, f"o{i}", max_steps=6, **opt)))["parameters_sha256"]
        assert got != base, opt


def test_bad_option_values_name_the_field() -> None:
    for train, field in (({"precision": "fp16"}, "train.precision"), ({"grad_accumulation": 0}, "train.grad_accumulation"),
                         ({"grad_clip_norm": 0}, "train.grad_clip_norm"), ({"lr_schedule": "step"}, "train.lr_schedule"),
                         ({"warmup_steps": -1}, "train.warmup_steps")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_job({"train": train})


_RUN = "import json, sys; from paratrain.config import load_job; from paratrain.executors import local; " \
       "local.run(load_job(json.loads(sys.argv[1])), resume=sys.argv[2] == '1')"


def test_local_resume_after_sigkill_is_bit_identical_with_every_option(tmp_path: Path) -> None:
    clean = local.run(load_job(_doc(tmp_path, "clean", **OPTS)))
    doc = _doc(tmp_path, "cut", **OPTS)
    env = dict(os.environ, PARATRAIN_FAULT_KILL="0:6")  # dies after step 6; checkpoint at 4
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(doc), "0"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = [p.name for p in step_folders(tmp_path / "cut" / "checkpoints")]
    assert ckpts and ckpts[-1] == "step-000000004"
    resumed = local.run(load_job(doc), resume=True)
    assert resumed["steps"] == clean["steps"]
    assert resumed["parameters_sha256"] == clean["parameters_sha256"]
    assert resumed["test_mse"] == clean["test_mse"]
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [
        json.loads(x)["step"] for x in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
