"""ModelParallel jobs end to end over models written by others (issue 21):

- a raw ``GPT2LMHeadModel`` (tests/hf_factories.py, tied head) under the built-in
  ``language_model`` task, its decoder layers on two workers, Pipeline 1F1B: the same
  parameters and test loss as the Local run on the same batches (rtol 1e-5), and the
  exported model holds the tie under both names with one value;
- a BatchNorm CNN (conv + BN blocks like a ResNet's, ``num_batches_tracked`` a 0-dim
  buffer; torchvision cannot be installed here) finishes a ModelParallel run with its
  summary (the end-of-run digest reads 0-dim tensors), every micro-batch counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paratrain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SGD = {"batch_size": 8, "max_steps": 3, "eval_every": 3, "optimizer": {"name": "sgd", "lr": 0.5}}
WORKERS = [{"id": "worker-0"}, {"id": "worker-1"}]


def _mp(stage2: list[str], micro: int) -> dict[str, Any]:
    return {"type": "ModelParallel",
            "communication": {"protocol": "Pipeline", "micro_batch_size": micro, "schedule": "1F1B"},
            "partitions": [{"node_ids": stage2, "target": {"WorkerId": "worker-1"}}]}


def test_raw_gpt2_pipeline_job_equals_the_local_run(tmp_path: Path) -> None:
    pytest.importorskip("transformers")

    def job(name: str, **extra: Any) -> dict[str, Any]:
        return {"run": {"name": name, "seed": 1, "output_dir": str(tmp_path)},
                "task": {"name": "language_model", "block_size": 16},
                "data": {"factory": "hf_factories:tiny_text"},
                "model": {"factory": "hf_factories:gpt2", "hidden": 16}, "train": SGD, **extra}

    local = paratrain.fit(job("local"))
    mp = paratrain.fit(job("mp", strategy=_mp(["transformer.h.1", "transformer.ln_f", "lm_head"], 3),
                           workers=WORKERS))
    assert [s["worker"] for s in mp["stages"]] == ["worker-0", "worker-1"]
    assert any(n.startswith("transformer.h.0.") for n in mp["stages"][0]["nodes"])
    assert any(n.startswith("transformer.h.1.") for n in mp["stages"][1]["nodes"])
    assert mp["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    ref, got = paratrain.load_model(local["run_dir"]), paratrain.load_model(mp["run_dir"])
    assert list(got) == list(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_user_module_wrapping_an_hf_model_equals_the_local_run_direct_and_1f1b(
        tmp_path: Path, kind: str) -> None:
    """Issue 36: a wrapper's lifted constants (``lifted_tensor_0`` of the HF attention) made
    ``validate`` and ``run`` fail with AttributeError under ModelParallel."""
    pytest.importorskip("transformers")
    stage2 = (["hf.transformer.h.1", "hf.transformer.ln_f", "hf.lm_head"] if kind == "gpt2"
              else ["hf.model.layers.1", "hf.model.norm", "hf.lm_head"])

    def job(name: str, **extra: Any) -> dict[str, Any]:
        return {"run": {"name": name, "seed": 1, "output_dir": str(tmp_path)},
                "task": {"name": "language_model", "block_size": 16},
                "data": {"factory": "hf_factories:tiny_text"},
                "model": {"factory": "hf_factories:wrapped", "kind": kind}, "train": SGD, **extra}

    local = paratrain.fit(job("local"))
    ref = paratrain.load_model(local["run_dir"])
    direct = {"type": "ModelParallel", "communication": {"protocol": "Direct"},
              "partitions": [{"node_ids": stage2, "target": {"WorkerId": "worker-1"}}]}
    for name, strategy in (("direct", direct), ("1f1b", _mp(stage2, 4))):
        got = paratrain.fit(job(name, strategy=strategy, workers=WORKERS))
        assert got["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5), name
        params = paratrain.load_model(got["run_dir"])
        assert list(params) == list(ref)
        for key in ref:
            torch.testing.assert_close(params[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert got["steps"] == 3 and [s["worker"] for s in got["stages"]] == ["worker-0", "worker-1"]


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class BatchNormCNN(nn.Module):
    """A stem (conv, BN), two residual conv+BN blocks, global pooling and a head."""

    def __init__(self, num_classes: int, c: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.layer1, self.layer2 = Block(c), Block(c)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x.reshape(x.shape[0], 1, 8, 8))))
        return self.fc(self.layer2(self.layer1(h)).mean(dim=(2, 3)))


def bn_cnn(num_classes: int) -> nn.Module:
    return BatchNormCNN(num_classes)


def test_batchnorm_cnn_finishes_a_model_parallel_run_with_its_summary(tmp_path: Path) -> None:
    job = {"run": {"name": "bn", "seed": 0, "output_dir": str(tmp_path)},
           "data": {"name": "digits"}, "model": {"factory": "test_mp_hf_job:bn_cnn"},
           "train": {**SGD, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.1}},
           "strategy": _mp(["layer2", "fc"], 8), "workers": WORKERS}
    summary = paratrain.fit(job)
    assert summary["steps"] == 3 and len(summary["parameters_sha256"]) == 64
    assert (Path(summary["run_dir"]) / "summary.json").is_file()
    state = paratrain.load_model(summary["run_dir"])
    # 3 steps of 2 micro-batches each: every BN (on both workers) counted 6 forwards
    for name in ("bn1", "layer1.bn", "layer2.bn"):
        assert state[f"{name}.num_batches_tracked"].dim() == 0
        assert int(state[f"{name}.num_batches_tracked"]) == 6, name
