"""``paratrain export RUN --format hf --out DIR`` (paratrain.training.export.export_hf): a tensor-parallel
GPT-2 run (2 ranks), a ZeRO-3 Llama run (2 replicas), a 1F1B pipeline GPT-2 (2 stages, the tied
head on the second) and a Federated Llama (FedAvg of 2 clients) exported through the CLI load with
``AutoModelForCausalLM.from_pretrained(DIR)`` and score the run's reported test loss on its
test data (rtol 1e-5); a corrupted weight in the folder scores otherwise; a model that is not
a transformers model is refused naming --format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from paratrain import cli
from paratrain.config.job import load_job
from paratrain.task import evaluate, resolve_task

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

GPT2 = {"name": "hf", "architecture": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2,
        "n_positions": 16}
CASES: dict[str, dict[str, Any]] = {
    "gpt2-tp2": {"model": GPT2, "tensor_parallel": {"tensor_parallel_size": 2}},
    "llama-zero3": {"model": {"factory": "hf_factories:llama", "hidden": 32},
                    "strategy": {"type": "DataParallel", "num_replicas": 2, "shard": "parameters",
                                 "aggregation": {"method": "AllReduce"}}},
    "gpt2-pipeline": {"model": GPT2, "strategy": {
        "type": "ModelParallel",
        "communication": {"protocol": "Pipeline", "micro_batch_size": 4, "schedule": "1F1B"},
        "partitions": [{"node_ids": ["transformer.h.1", "transformer.ln_f", "lm_head"],
                        "target": {"WorkerId": "worker-1"}}]}},
    # one round, each client's data as one batch: a FedAvg of two AdamW steps
    "llama-federated": {"model": {"factory": "hf_factories:llama", "hidden": 32},
                        "strategy": {"type": "Federated", "num_clients": 2, "rounds": 1,
                                     "aggregation": {"method": "FedAvg"},
                                     "client_selection": {"method": "All"}},
                        "federated": {"local_epochs": 1, "batch_size": None},
                        "run": {"num_workers": 2}, "train": {"optimizer": {"name": "adamw", "lr": 3e-3}}},
}


def _doc(tmp: Path, name: str, *, run: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    # a small slice of the corpus (hf_factories.tiny_text) and 3 steps: the run is start-up
    return {"run": {"name": name, "seed": 1, "output_dir": str(tmp), **(run or {})},
            "task": {"name": "language_model", "block_size": 16},
            "data": {"factory": "hf_factories:tiny_text"},
            "train": {"batch_size": 8, "max_steps": 3, "eval_every": 3,
                      "optimizer": {"name": "adamw", "lr": 3e-3}},
            **extra}


def _test_loss(model: Any, doc: dict[str, Any]) -> float:
    job = load_job(doc)
    task = resolve_task(job)
    _, test = task.datasets(job.run.seed)
    return float(evaluate(model, task, test)["loss"])


@pytest.mark.parametrize("case", list(CASES))
def test_from_pretrained_scores_the_runs_test_loss(tmp_path: Path, case: str) -> None:
    doc = _doc(tmp_path, case, **CASES[case])
    summary = paratrain.fit(doc)
    assert summary["strategy"] == {"gpt2-tp2": "TensorParallel", "llama-zero3": "DataParallel",
                                   "gpt2-pipeline": "ModelParallel", "llama-federated": "Federated"}[case]
    assert summary.get("tensor_parallel_size", 2) == 2 and summary.get("shard", "parameters") == "parameters"
    out = tmp_path / "hf"
    assert cli.main(["export", summary["run_dir"], "--format", "hf", "--out", str(out), "-q"]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {p.name for p in out.iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    assert _test_loss(model, doc) == pytest.approx(summary["test_loss"], rel=1e-5)

    # non-vacuity: the same folder with one weight changed scores otherwise
    from safetensors.torch import load_file, save_file

    weights = load_file(str(out / "model.safetensors"))
    if case.startswith("gpt2"):  # the tied head stored once, as save_pretrained stores it
        assert "lm_head.weight" not in weights and "transformer.wte.weight" in weights
    name = next(k for k in ("transformer.wte.weight", "model.embed_tokens.weight") if k in weights)
    weights[name] = weights[name] + torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    changed = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert _test_loss(changed, doc) != pytest.approx(summary["test_loss"], rel=1e-3)


def test_a_model_not_from_transformers_is_refused_naming_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {"run": {"name": "mlp", "seed": 0, "output_dir": str(tmp_path)},
           "task": {"name": "regression"}, "data": {"name": "diabetes"},
           "model": {"name": "mlp", "hidden": [8]},
           "train": {"epochs": 1, "max_steps": 2, "batch_size": 16,
                     "optimizer": {"name": "sgd", "lr": 0.01}}}
    summary = paratrain.fit(doc)
    out = tmp_path / "hf"
    assert cli.main(["export", summary["run_dir"], "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--format" in err and "transformers" in err and "Sequential" in err, err
    assert not out.exists()


def test_a_wrapper_around_one_transformers_model_exports_that_model() -> None:
    from torch import nn

    from paratrain.config import ConfigError
    from paratrain.training.export import _pretrained

    cfg = transformers.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2)

    class Wrapper(nn.Module):
        def __init__(self, extra: bool) -> None:
            super().__init__()
            self.hf = transformers.GPT2LMHeadModel(cfg)
            self.scale = nn.Parameter(torch.ones(1)) if extra else None

    inner = Wrapper(extra=False)
    assert _pretrained(inner) is inner.hf
    with pytest.raises(ConfigError, match="--format"):  # a parameter outside the HF model
        _pretrained(Wrapper(extra=True))
