"""Federated resumes on another number of worker processes (issue 20, item 2): 2 -> 3 and
3 -> 2. Client ``c`` lives on rank ``c % world``, so its personal parts (FedPer head) and its
codec state (error-feedback residual) move to the worker that hosts it now; the server's
state is unchanged. Checked on a resume with no round left (the models it writes are the
saved ones: the global model and every client's, read back through ``paratrain.load_model``)
and on one that goes on (it ends where the uninterrupted run ends: every random draw is a
function of (seed, round, client) and the server aggregates in client order, so a residual
or personal part that did not move would change the result)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import paratrain
from _workers_federated import TOPK_EF, fed_job
from paratrain.dispatch import execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

K = 5  # clients 0..4: on 2 workers {0,2,4},{1,3}; on 3 workers {0,3},{1,4},{2}


def _job(out: Path, *, workers: int, rounds: int) -> Any:
    job = fed_job(out, "fed", K=K, rounds=rounds, num_workers=workers, local_epochs=1,
                  compression=TOPK_EF, batch_size=16, hidden=32)
    doc = job.to_json_dict()
    doc["subgraphs"] = {"head": {"type": "Local"}}  # FedPer: each client's own head
    return type(job).model_validate(doc)


def _models(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {"global": paratrain.load_model(run)}
    out.update({f"client-{c}": paratrain.load_model(run, client=c) for c in range(K)})
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """4 rounds straight, on 2 workers (the results do not depend on the number of workers)."""
    return execute(_job(tmp_path_factory.mktemp("ref"), workers=2, rounds=4))


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_resume_on_another_world_keeps_the_server_and_every_clients_state(
        tmp_path: Path, before: int, after: int, uninterrupted: dict[str, Any]) -> None:
    first = execute(_job(tmp_path / "cut", workers=before, rounds=2))
    run = Path(first["run_dir"])
    saved = _models(run)
    assert len({str(saved[f"client-{c}"]["head.weight"].sum().item()) for c in range(K)}) == K
    for p in run.glob("model*.safetensors"):  # the resume must write them again, from its state
        p.unlink()

    same = execute(_job(tmp_path / "cut", workers=after, rounds=2), resume=True)
    assert same["num_workers"] == after and same["rounds"] == 2
    assert same["client_updates_this_run"] == 0  # nothing trained: what it holds is what was saved
    resumed = _models(run)
    for name, state in saved.items():
        assert list(state) == list(resumed[name]), name
        for k, v in state.items():
            if name == "global" and k.startswith("head."):
                continue  # personal: the server's model has no head of its own
            assert torch.equal(v, resumed[name][k]), (name, k)
    assert same["personal_sha256"] == first["personal_sha256"]
    assert same["parameters_sha256"] == first["parameters_sha256"]

    # going on: the same end as the uninterrupted run (residuals and heads moved with their client)
    ref = uninterrupted
    more = execute(_job(tmp_path / "cut", workers=after, rounds=4), resume=True)
    assert more["client_updates_this_run"] == 2 * K
    for key in ("parameters_sha256", "personal_sha256", "test_accuracy", "personal_test_accuracy"):
        assert more[key] == ref[key], key
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert json.loads((newest / "layout.json").read_text())["world"] == after  # written on the new layout

