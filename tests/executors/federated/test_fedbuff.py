"""FedBuff (Nguyen et al. 2022), asynchronous buffered aggregation on the local runtime
(executors/federated/{buffered,asynchronous}.py, aggregation/fedbuff.py): the step's algebra;
with ``buffer_size = concurrency =`` the clients per draw and every client of a version
arriving together (one process) it is synchronous FedAvg bit for bit; on three worker
processes a slow client holds one training rank, not the server nor the other clients, and
its late update is applied down-weighted; a run cut or SIGKILLed mid-run resumes (buffer and
clients in flight) bit-identically; options that cannot work are ConfigErrors naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_federated import fed_job
from paratrain.config import ConfigError, load_job
from paratrain.dispatch import execute
from paratrain.executors.federated import run, run_in_process
from paratrain.executors.federated.aggregation import fedavg_step
from paratrain.executors.federated.aggregation.fedbuff import FedBuffAggregator, staleness_weight
from paratrain.executors.federated.client import SLOW_ENV
from paratrain.files import step_folders
from paratrain.training import read_metrics
from paratrain.training.faults import FAULT_ENV
from paratrain.training.stores import read_rank_state

pytestmark = pytest.mark.timeout(300)

SMALL: dict[str, Any] = dict(local_epochs=1, batch_size=16, hidden=32)


def buff(k: int, c: int, **kw: Any) -> dict[str, Any]:
    return {"method": "FedBuff", "buffer_size": k, "concurrency": c, **kw}


def test_step_weights_each_update_by_its_staleness_over_the_buffer_examples() -> None:
    g = torch.Generator().manual_seed(0)
    ups = [{"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)} for _ in range(3)]
    n, s = [10.0, 30.0, 20.0], [0, 3, 8]
    agg = FedBuffAggregator(staleness="sqrt", eta=0.5)
    step = agg.buffered_step(ups, n, s)
    for k in ("w", "b"):
        want = 0.5 * sum(ni / math.sqrt(1 + si) * u[k].double() for u, ni, si in zip(ups, n, s, strict=True)) / 60
        assert torch.allclose(step[k], want, rtol=1e-12, atol=1e-14)
    assert [staleness_weight(x) for x in (0, 3)] == [1.0, 0.5]
    assert staleness_weight(8, "constant") == 1.0
    # nothing stale, eta 1: FedAvg's step, bit for bit
    fresh = FedBuffAggregator().buffered_step(ups, n, [0, 0, 0])
    assert all(torch.equal(fresh[k], fedavg_step(ups, n)[k]) for k in ("w", "b"))


@pytest.mark.parametrize(("clients", "sel", "per_draw"), [(4, {"method": "All"}, 4),
                                                          (6, {"method": "Random", "fraction": 0.5}, 3)])
def test_buffer_equal_to_concurrency_is_synchronous_fedavg_bit_for_bit(
        tmp_path: Path, clients: int, sel: dict[str, Any], per_draw: int) -> None:
    kw: dict[str, Any] = dict(K=clients, rounds=3, sel=sel, partition={"method": "shards", "shards_per_client": 2},
                              **SMALL)
    avg = run_in_process(fed_job(tmp_path, "avg", **kw))
    fb = run_in_process(fed_job(tmp_path, "fb", agg=buff(per_draw, per_draw), **kw))
    assert fb["parameters_sha256"] == avg["parameters_sha256"]
    assert fb["aggregation"] == "FedBuff" and fb["rounds"] == 3
    recs = read_metrics(fb["run_dir"])
    assert [r["test_accuracy"] for r in recs] == [r["test_accuracy"] for r in read_metrics(avg["run_dir"])]
    assert all(b["staleness"] == 0 for r in recs for b in r["buffer"])
    if per_draw != 4:
        return
    # a smaller buffer is another algorithm: stale updates join the next version
    other = run_in_process(fed_job(tmp_path, "fb2", agg=buff(per_draw - 1, per_draw), **kw))
    assert other["parameters_sha256"] != avg["parameters_sha256"]
    assert max(r["staleness_max"] for r in read_metrics(other["run_dir"])) >= 1


def test_a_slow_client_does_not_hold_the_server_back_and_counts_less_when_late(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes: ranks 1 and 2 train one client at a time, whichever client is next
    (rank 0 one still queued when no update is at hand); client 1, made 5x slower, holds one
    rank while the others train clients 0 and 2. Versions go on from clients 0 and 2 while
    client 1 trains; its update, started at version 0, is applied later at weight
    1/sqrt(1+s) < 1."""
    monkeypatch.setenv(SLOW_ENV, "1:5")
    out = run(fed_job(tmp_path, "slow", K=3, rounds=30, num_workers=3, agg=buff(2, 3), **SMALL))
    recs = read_metrics(out["run_dir"])
    assert [r["round"] for r in recs] == list(range(1, 31))
    first = next(i for i, r in enumerate(recs) if any(b["client"] == 1 for b in r["buffer"]))
    assert first >= 1  # version 1 did not wait for client 1
    late = next(b for b in recs[first]["buffer"] if b["client"] == 1)
    assert late["base_version"] == 0 and late["staleness"] == first >= 1
    assert late["staleness_weight"] == 1 / math.sqrt(1 + first) < 1
    assert all({b["client"] for b in r["buffer"]} <= {0, 2} for r in recs[:first])
    ups = [w["client_updates"] for w in out["workers"]]
    assert min(ups[1:]) >= 1 and out["num_workers"] == 3


def _doc(out: Path, rounds: int) -> dict[str, Any]:
    doc = fed_job(out, "fb", K=5, rounds=rounds, agg=buff(2, 4), sel={"method": "Random", "fraction": 0.8},
                  **SMALL).to_json_dict()
    doc["run"]["checkpoint_every"] = 1
    return doc


def test_a_cut_run_resumes_its_buffer_and_clients_in_flight_bit_identically(tmp_path: Path) -> None:
    straight = execute(load_job(_doc(tmp_path / "a", 7)))
    cut = execute(load_job(_doc(tmp_path / "b", 3)))
    state = read_rank_state(step_folders(Path(cut["run_dir"]) / "checkpoints")[-1])["engine"]["server"]["buffered"]
    flights = json.loads(state["flights"])
    assert flights  # the clients in flight are saved, with the models they started from
    assert {str(f["base"]) for f in flights} == set(state["bases"])
    more = execute(load_job(_doc(tmp_path / "b", 7)), resume=True)
    assert more["parameters_sha256"] == straight["parameters_sha256"]



def test_killed_server_process_restarts_and_ends_equal_to_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two worker processes, one client in flight (so the order is fixed): rank 0 is SIGKILLed
    after version 2's checkpoint, the launcher restarts both, the client in flight is
    dispatched again from its base; the model equals one process's uninterrupted run."""
    kw: dict[str, Any] = dict(K=4, rounds=5, agg=buff(1, 1), **SMALL)
    ref = run_in_process(fed_job(tmp_path / "ref", "k", **kw))
    monkeypatch.setenv(FAULT_ENV, "0:2")
    out = run(fed_job(tmp_path / "kill", "k", num_workers=2, max_restarts=1, **kw))
    assert out["parameters_sha256"] == ref["parameters_sha256"]
    assert [r["round"] for r in read_metrics(out["run_dir"])] == [1, 2, 3, 4, 5]
    assert out["client_updates_this_run"] < ref["client_updates_this_run"]  # only versions 3-5 again
    # one client in flight: handed to rank 1 at once, never queued for rank 0
    assert [w["client_updates"] for w in out["workers"]] == [0, out["client_updates_this_run"]]


@pytest.mark.parametrize(("agg", "extra", "field", "words"), [
    (buff(4, 3), {}, "strategy.aggregation.buffer_size", "concurrency = 3"),
    (buff(2, 5), {}, "strategy.aggregation.concurrency", "draws 4 of the 4"),
    (buff(1, 3), {"sel": {"method": "Random", "fraction": 0.5}}, "strategy.aggregation.concurrency", "draws 2"),
    (buff(1, 2), {"compression": {"method": "TopK", "k": 10}}, "compression", "codec state"),
    (buff(1, 2), {"dp": {"clip": 1.0, "noise_multiplier": 0.1}}, "federated.dp", "synchronous"),
])
def test_options_that_cannot_work_name_the_field(
        tmp_path: Path, agg: dict[str, Any], extra: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        run_in_process(fed_job(tmp_path, "bad", K=4, rounds=1, agg=agg, **extra))
    assert words in dict(err.value.problems)[field]


def test_a_bad_slow_client_injection_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, words in (("x:2", "CLIENT:FACTOR"), ("9:2", "outside [0, 4)")):
        monkeypatch.setenv(SLOW_ENV, bad)
        with pytest.raises(ConfigError) as err:
            run_in_process(fed_job(tmp_path, "bad", K=4, rounds=1, agg=buff(1, 2)))
        assert words in dict(err.value.problems)[SLOW_ENV]
