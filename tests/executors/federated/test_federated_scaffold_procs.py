"""SCAFFOLD across real worker processes (gloo on 127.0.0.1): the server's control variate
``c`` goes down with the model, each client's ``c_i`` lives on the rank hosting it (client
``c`` on rank ``c % world``). A 2-worker run equals the same job in one process (clients hosted
differently); a worker killed mid-run restarts from the round checkpoint and ends bit-identical
(its clients' ``c_i`` restored); a resume on 3 workers of a 2-worker run moves every ``c_i``
to its new host and ends where the uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_federated import fed_job
from paratrain.executors.federated import run, run_in_process
from paratrain.training.faults import FAULT_ENV
from paratrain.training.stores import read_rank_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

K, ROUNDS = 5, 4  # clients 0..4: on 2 workers {0,2,4},{1,3}; on 3 workers {0,3},{1,4},{2}


def _job(out: Path, *, workers: int = 1, rounds: int = ROUNDS, **kw: Any) -> Any:
    return fed_job(out, "scaffold", K=K, rounds=rounds, num_workers=workers, local_epochs=1,
                   agg={"method": "SCAFFOLD", "server_lr": 1.0}, sel={"method": "Random", "fraction": 0.6},
                   partition={"method": "shards", "shards_per_client": 2}, batch_size=32, hidden=32, **kw)


def _ckpt(run_dir: Path, round_: int, worker: int | None = None) -> dict[str, Any]:
    """The server's state after ``round_`` rounds (``worker`` None), or the state of the
    clients process ``worker`` hosts, from the ``step-<round_>`` folder."""
    st = read_rank_state(run_dir / "checkpoints" / f"step-{round_:09d}", 0 if worker is None else worker)
    if worker is None:
        return {**st["engine"]["server"], "model": st["model"]}
    return dict(st["engine"]["clients"])


def _controls(run_dir: Path, round_: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every client's c_i at ``round_``, checking each process saved only the clients it hosts."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(world):
        mine = _ckpt(run_dir, round_, r)["control"]
        assert all(int(n.removeprefix("client-")) % world == r for n in mine), (r, sorted(mine))
        out.update(mine)
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return sorted(a) == sorted(b) and all(
        _equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job uninterrupted, in one process (every client on rank 0)."""
    return run_in_process(_job(tmp_path_factory.mktemp("ref")))


def test_killed_worker_resumes_bit_identical_to_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: dict[str, Any]) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:2")  # rank 1 is SIGKILLed after round 2
    out = run(_job(tmp_path, workers=2, max_restarts=1))
    assert out["num_workers"] == 2 and all(w["client_updates"] > 0 for w in out["workers"])
    assert out["client_updates_this_run"] < reference["client_updates_this_run"]  # restarted at round 3
    assert out["parameters_sha256"] == reference["parameters_sha256"]
    ref_dir, run_dir = Path(reference["run_dir"]), Path(out["run_dir"])
    assert _equal(_ckpt(run_dir, ROUNDS)["aggregator"], _ckpt(ref_dir, ROUNDS)["aggregator"])  # c
    assert _equal(_controls(run_dir, ROUNDS, 2), _controls(ref_dir, ROUNDS, 1))  # every c_i
    # SCAFFOLD's down link: the model and c, each once per round to rank 1
    model_bytes = sum(4 * v.numel() for v in _ckpt(ref_dir, ROUNDS)["model"].values())
    assert out["wire_bytes_down_measured"] == ROUNDS * 2 * model_bytes


def test_resume_on_three_workers_moves_every_client_control(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    cut = ROUNDS - 1  # the reference keeps the server checkpoints of its last two rounds
    first = run(_job(tmp_path, workers=2, rounds=cut))
    run_dir, ref_dir = Path(first["run_dir"]), Path(reference["run_dir"])
    # 2 workers == 1 process after 3 rounds: the model, c and every client's c_i
    assert _equal(_ckpt(run_dir, cut)["model"], _ckpt(ref_dir, cut)["model"])
    assert _equal(_ckpt(run_dir, cut)["aggregator"], _ckpt(ref_dir, cut)["aggregator"])
    before = _controls(run_dir, cut, 2)
    assert before and _equal(before, _controls(ref_dir, cut, 1))
    assert any(int(n.removeprefix("client-")) % 2 != int(n.removeprefix("client-")) % 3 for n in before)
    more = run(_job(tmp_path, workers=3), resume=True)
    assert more["num_workers"] == 3
    assert more["parameters_sha256"] == reference["parameters_sha256"]
    assert _equal(_controls(run_dir, ROUNDS, 3), _controls(ref_dir, ROUNDS, 1))
    last = run_dir / "checkpoints" / f"step-{ROUNDS:09d}"
    assert json.loads((last / "layout.json").read_text())["world"] == 3  # written by 3 processes
