"""A custom coordinator: train an ensemble of Local runs (different seeds) and average
their predicted probabilities on the test set.

Run it with ``paratrain run examples/custom_ensemble.toml``; the job lists this file in
``run.imports`` so the ``@register_coordinator`` below runs before dispatch.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.config import Local
from paratrain.config.job import JobConfig
from paratrain.data import load_data
from paratrain.executors import local, register_coordinator
from paratrain.models import build_model
from paratrain.training import write_summary
from paratrain.training.export import load_model


@register_coordinator("ensemble")
def ensemble(job: JobConfig, config: Any, *, resume: bool = False) -> dict[str, Any]:
    # ``resume`` (``paratrain run --resume``) continues each member from its checkpoint;
    # the job arrives whole, so [train], [compression], ... are the coordinator's to use.
    members = int((config or {}).get("members", 3))
    if members < 1:
        raise ValueError(f"strategy.config.members must be >= 1 (got {members})")
    data = load_data(job.data, seed=job.run.seed)
    x_test, y_test = data.test.tensors
    probs = torch.zeros(len(y_test), data.num_classes)
    member_acc = []
    for i in range(members):
        member_job = job.model_copy(update={
            "strategy": Local(),
            # Each member is a run of its own in <output_dir>/<name>/member<i>/.
            "run": job.run.model_copy(update={"output_dir": f"{job.run.output_dir}/{job.run.name}",
                                              "name": f"member{i}", "seed": job.run.seed + i}),
        })
        summary = local.run(member_job, data=data, resume=resume)
        member_acc.append(summary["test_accuracy"])
        model = build_model(job.model, input_shape=data.input_shape, num_classes=data.num_classes)
        model.load_state_dict(load_model(summary["run_dir"]))  # the member's trained model
        model.eval()
        with torch.no_grad():
            probs += torch.softmax(model(x_test), dim=1)
    accuracy = float((probs.argmax(dim=1) == y_test).float().mean())
    out = {
        "strategy": "Custom",
        "coordinator": "ensemble",
        "run_dir": f"{job.run.output_dir}/{job.run.name}",
        "members": members,
        "member_accuracies": member_acc,
        "test_accuracy": accuracy,
        "best_member_accuracy": max(member_acc),
    }
    write_summary(out["run_dir"], out)
    return out
