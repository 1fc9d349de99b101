"""A raw HF model trained by ``paratrain.fit`` under the built-in ``language_model`` task,
Local and tensor parallel, on the same batches (tests/hf_factories.py builds the models)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

import paratrain

VOCAB = 77  # the shakespeare character vocabulary (hf_factories.tiny_text)
SGD = {"batch_size": 8, "max_steps": 4, "eval_every": 0, "optimizer": {"name": "sgd", "lr": 0.5}}


def job(tmp_path: Path, name: str, model: dict[str, Any], tp: int = 1,
        plan: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "run": {"name": name, "seed": 1, "output_dir": str(tmp_path)},
        "task": {"name": "language_model", "block_size": 16},
        "data": {"factory": "hf_factories:tiny_text"}, "model": model, "train": SGD}
    if tp > 1:
        out["tensor_parallel"] = {"tensor_parallel_size": tp, **({"plan": plan} if plan else {})}
    return out


def tp_equals_local(tmp_path: Path, model: dict[str, Any], tp: int,
                    plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train Local and tensor parallel ``tp``; the TP run's parameters (merged by the model's
    names) and test loss equal the Local run's (rtol 1e-5), and the loss fell below chance."""
    local = paratrain.fit(job(tmp_path, "local", model))
    par = paratrain.fit(job(tmp_path, f"tp{tp}", model, tp=tp, plan=plan))
    ref, got = paratrain.load_model(local["run_dir"]), paratrain.load_model(par["run_dir"])
    assert set(ref) == set(got), set(ref) ^ set(got)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert par["test_loss"] == __import__("pytest").approx(local["test_loss"], rel=1e-5)
    assert par["test_loss"] < math.log(VOCAB)
    return par
