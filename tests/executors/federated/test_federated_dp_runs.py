"""[federated.dp] in federated runs (digits MLP): without noise or clipping both modes are
plain FedAvg bit for bit, with noise they are not; epsilon per round is Opacus's; a
target_epsilon run stops at the last round within budget, saying so; a killed worker
resumes bit-identically with central noise, adaptive clipping and compression; local
mode resumes too; the Flower runtime's server loop runs the same DP (same model)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from _workers_federated import TOPK_EF, fed_job
from paratrain.config import ConfigError
from paratrain.executors.federated import run, run_in_process
from paratrain.executors.federated.privacy import rdp_epsilon
from paratrain.training import read_metrics
from paratrain.training.faults import FAULT_ENV

pytestmark = pytest.mark.timeout(300)

BASE: dict[str, Any] = dict(K=6, rounds=2, local_epochs=1, partition={"method": "dirichlet", "alpha": 0.5})
OFF_CENTRAL = {"clip": math.inf, "noise_multiplier": 0.0, "weight_cap": 100_000}
OFF_LOCAL = {"clip": math.inf, "noise_multiplier": 0.0, "mode": "local"}


def _records(s: Mapping[str, Any]) -> list[dict[str, Any]]:
    return read_metrics(s["run_dir"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("dp")
    jobs: dict[str, dict[str, Any]] = {
        "fedavg": {},
        "central_off": {"dp": OFF_CENTRAL},
        "local_off": {"dp": OFF_LOCAL},
        "central": {"dp": {"clip": 0.5, "noise_multiplier": 0.3}},
        "local": {"dp": {"clip": 0.5, "noise_multiplier": 0.3, "mode": "local"}},
    }
    return {name: run_in_process(fed_job(out, name, **{**BASE, **kw})) for name, kw in jobs.items()}


def test_no_noise_and_no_clip_is_fedavg_bit_for_bit_and_noise_is_not(runs: dict[str, dict[str, Any]]) -> None:
    ref = runs["fedavg"]["parameters_sha256"]
    # unequal client sizes (Dirichlet): central mode weighs min(n_k, weight_cap) = n_k
    sizes = {r["clients_ok"] for r in _records(runs["fedavg"])}
    assert sizes == {6}
    assert runs["central_off"]["parameters_sha256"] == ref
    assert runs["local_off"]["parameters_sha256"] == ref
    assert runs["central"]["parameters_sha256"] != ref
    assert runs["local"]["parameters_sha256"] != ref
    assert runs["central"]["parameters_sha256"] != runs["local"]["parameters_sha256"]
    # no noise: no guarantee (epsilon inf -> null in the summary and the records)
    assert runs["central_off"]["epsilon"] is None
    assert all(r["epsilon"] is None for r in _records(runs["central_off"]))


@pytest.mark.parametrize("mode", ["central", "local"])
def test_epsilon_per_round_is_opacus(runs: dict[str, dict[str, Any]], mode: str) -> None:
    from opacus.accountants import RDPAccountant

    s = runs[mode]
    acc = RDPAccountant()
    eps = []
    for _ in range(BASE["rounds"]):  # All clients: q = 1 in both modes
        acc.step(noise_multiplier=0.3, sample_rate=1.0)
        eps.append(acc.get_epsilon(delta=1e-5))
    recs = _records(s)
    assert [r["epsilon"] for r in recs] == eps and all(r["delta"] == 1e-5 for r in recs)
    assert s["epsilon"] == eps[-1] and s["delta"] == 1e-5 and s["dp_mode"] == mode
    if mode == "central":  # the server saw and clipped every update; noise std on the mean
        assert all(r["dp_noise_std"] == pytest.approx(0.3 * 0.5 / 6) for r in recs)


def test_target_epsilon_stops_at_the_last_round_within_budget(tmp_path: Path) -> None:
    q = 3 / 6  # Random 0.5 of 6 clients
    e3, e4 = rdp_epsilon([(1.0, q, 3)], 1e-5), rdp_epsilon([(1.0, q, 4)], 1e-5)
    dp = {"clip": 1.0, "noise_multiplier": 1.0, "target_epsilon": (e3 + e4) / 2}
    s = run_in_process(fed_job(tmp_path, "t", **{**BASE, "rounds": 8, "sel": {"method": "Random", "fraction": 0.5},
                                                 "dp": dp}))
    assert s["rounds"] == 3 and len(_records(s)) == 3
    assert s["epsilon"] == e3 <= dp["target_epsilon"] < e4
    assert "stopping after round 3" in s["dp_stopped"] and "round 4 would spend" in s["dp_stopped"]
    assert "dp_stop" in _records(s)[-1] and s["dp_sample_rate"] == q
    saved = json.loads((Path(s["run_dir"]) / "summary.json").read_text())
    assert saved["dp_stopped"] == s["dp_stopped"]
    # a budget below one round's cost: no round runs
    none = run_in_process(fed_job(tmp_path, "n", **{**BASE, "dp": {**dp, "target_epsilon": 0.01}}))
    assert none["rounds"] == 0 and "stopping after round 0" in none["dp_stopped"]


ADAPTIVE = {"clip": 0.2, "noise_multiplier": 0.5, "target_quantile": 0.5, "clip_learning_rate": 0.5,
            "clipped_count_stddev": 1.0}


def test_killed_worker_resumes_bit_identically_with_central_noise(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Central noise, adaptive clipping, Random selection and top-k with error feedback:
    two worker processes, rank 1 killed at round 3 and restarted == one process
    uninterrupted, bit for bit, epsilon and clip per round included."""
    kw = {**BASE, "rounds": 4, "sel": {"method": "Random", "fraction": 0.5}, "compression": TOPK_EF,
          "agg": {"method": "FedAvgM", "server_momentum": 0.5}, "dp": ADAPTIVE}
    ref = run_in_process(fed_job(tmp_path / "ref", "k", **kw))
    monkeypatch.setenv(FAULT_ENV, "1:2")  # rank 1 is SIGKILLed after round 2
    out = run(fed_job(tmp_path / "kill", "k", num_workers=2, max_restarts=1, **kw))
    assert out["parameters_sha256"] == ref["parameters_sha256"]
    a, b = _records(ref), _records(out)
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    for key in ("epsilon", "dp_clip", "dp_next_clip", "dp_unclipped_fraction_noised", "test_accuracy"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert len({r["dp_clip"] for r in a}) == 4  # the clip moved every round
    assert out["client_updates_this_run"] < ref["client_updates_this_run"]  # it did resume


def test_local_mode_resumes_exactly_and_the_checkpoint_must_hold_the_privacy_state(tmp_path: Path) -> None:
    kw = {**BASE, "rounds": 4, "dp": {"clip": 0.5, "noise_multiplier": 0.3, "mode": "local"}}
    ref = run_in_process(fed_job(tmp_path / "a", "r", **kw))
    run_in_process(fed_job(tmp_path / "b", "r", **{**kw, "rounds": 2}))
    resumed = run_in_process(fed_job(tmp_path / "b", "r", **kw), resume=True)
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]
    assert [r["epsilon"] for r in _records(resumed)] == [r["epsilon"] for r in _records(ref)]
    # a checkpoint without the accountant's state cannot continue a DP run (nor the reverse)
    # (a run without [federated.dp] wrote c's checkpoint: its server state has no accountant)
    run_in_process(fed_job(tmp_path / "c", "r", **{**BASE, "rounds": 2}))
    with pytest.raises(ConfigError) as err:
        run_in_process(fed_job(tmp_path / "c", "r", **kw), resume=True)
    assert "federated.dp" in dict(err.value.problems)
    with pytest.raises(ConfigError, match="federated.dp"):
        run_in_process(fed_job(tmp_path / "a", "r", **{**BASE, "rounds": 5}), resume=True)


class _InProcessNodes:
    """The Flower runtime's node side (node.train_clients, what the ClientApp runs) called
    directly: one partition hosting every client, no Flower messaging."""

    def __init__(self, job: Any) -> None:
        self.job_json = json.dumps(job.to_json_dict())
        self.lineage: str | None = None
        self.keep_from = 0
        self.restored: set[int] = set()

    def train(self, round_idx: int, clients: Sequence[int], global_state: Mapping[str, Tensor],
              lr_scale: float, control: Mapping[str, Tensor] | None,
              ) -> tuple[list[dict[str, Any]], list[bytes | memoryview], int, int]:
        from paratrain.executors.federated.flower.node import train_clients

        statuses, payload, _ = train_clients(self.job_json, round_idx=round_idx, clients=list(clients),
                                             lr_scale=lr_scale, global_state=global_state, control=control,
                                             partition=0, num_partitions=1, state=None)
        out: list[bytes | memoryview] = []
        pos = 0
        for st in statuses:
            out.append(payload[pos : pos + int(st["nbytes"])])
            pos += int(st["nbytes"])
        return statuses, out, 0, 0

    def evaluate(self, tag: str, clients: Sequence[int], global_state: Mapping[str, Tensor],
                 entering: int = 0) -> tuple[dict[int, dict[str, float]], int, int]:
        return {}, 0, 0


@pytest.mark.parametrize("mode", ["central", "local"])
def test_flower_server_loop_runs_the_same_dp(runs: dict[str, dict[str, Any]], tmp_path: Path, mode: str) -> None:
    pytest.importorskip("flwr")
    from paratrain.executors.federated.flower.serverloop import run_server

    dp = {"clip": 0.5, "noise_multiplier": 0.3, "mode": mode}
    job = fed_job(tmp_path, mode, **{**BASE, "dp": dp})
    s = run_server(_InProcessNodes(job), job)
    assert s["parameters_sha256"] == runs[mode]["parameters_sha256"]
    assert s["epsilon"] == runs[mode]["epsilon"] and s["dp_mode"] == mode


def test_bycapability_central_divides_by_the_tagged_clients_only(tmp_path: Path) -> None:
    """ByCapability takes the same tagged clients every round: q = 1 over them and W sums
    their weights only, so without noise or clipping it is FedAvg over them, bit for bit."""
    kw: dict[str, Any] = {**BASE, "rounds": 2, "sel": {"method": "ByCapability", "required_tags": ["eu"]},
                          "client_tags": {"client-1": ["eu"], "client-2": ["eu"], "client-4": ["eu"]}}
    ref = run_in_process(fed_job(tmp_path, "ref", **kw))
    off = run_in_process(fed_job(tmp_path, "off", **kw, dp=OFF_CENTRAL))
    assert off["parameters_sha256"] == ref["parameters_sha256"]
    assert off["dp_sample_rate"] == 1.0 and all(r["clients_selected"] == 3 for r in _records(off))
