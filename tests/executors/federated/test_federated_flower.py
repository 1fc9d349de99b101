"""Federated on Flower's Deployment Runtime, for real: one ``flower-superlink --insecure`` and two
``flower-supernode`` processes on 127.0.0.1 (free ports, FLWR_HOME in the test's tmp folder),
paratrain's app started with ``flwr run`` (examples/federated_flower).

- the global model after R rounds equals the same job run the local way (``runtime = "local"``,
  paratrain's in-process round loop) bit for bit, for FedAvg with client-level DP in local mode
  (each update clipped and noised on its node, with each round's seeded noise; the same epsilon
  either way; the runs without DP are the noise-free path), FedMedian (robust) with a Local
  head kept per client in context.state (FedPer's personal parts; the clients' personal scores
  come from ``@app.evaluate``), FedAdam (adaptive) with central client-level DP (the server
  clips each update and noises the sum; one round), FedNova (one round: it keeps nothing from
  round to round), FedBuff (asynchronous: one message per client pushed and its reply pulled as it
  comes; one client in flight, so the order is fixed), and SCAFFOLD (the server's c
  travels with the model, each client's c_i stays in its node's context.state; checked on the
  resumed run below): both paths train each client with the same
  seeded generator of (seed, round, client) at one intra-op thread and aggregate with the same
  FederatedServer, and Flower's ArrayRecord carries the float32 tensors exactly;
- the ServerApp process killed mid-run (after round 1 of 2) and a second ``flwr run`` with
  ``resume = true`` continue at the checkpointed round with the same server state (SCAFFOLD's ``c``) and the
  same client state (each ``c_i``, from its node's ``state-dir``): the final model equals an
  uninterrupted run's bit for bit, every round is logged once;
- bytes per round measured at the Message level are in metrics.jsonl.

(A SuperNode killed mid-round: test_federated_flower_faults.py, on a federation of its own so
that the two files run side by side.) One federation serves every test (module fixture); the six runs of the group share it
at the same time. (A SuperNode runs one ClientApp process per message, one message at a time,
each importing torch: the group's cost is its message count, so features share runs and a run
whose features keep no state from round to round on the nodes or in the Flower loop runs one
round.) Every process started is ended (with what Flower spawned) in a finally.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from _flower_federation import LocalFederation  # noqa: E402
from paratrain.config.job import load_job  # noqa: E402
from paratrain.dispatch import execute  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
APP = Path(__file__).resolve().parents[3] / "examples" / "federated_flower"
AGGREGATIONS = {
    # + [federated.dp] mode local: clip and seeded noise on the nodes (FedAvg's run: the DP run
    # is FedAvg plus the noise, so a plain FedAvg run would cover nothing more)
    "FedAvg+DP-local": {"method": "FedAvg"},
    # robust, + a Local head (FedPer): personal parts in context.state, scored by @app.evaluate
    "FedMedian+FedPer": {"method": "FedMedian"},
    # adaptive, with central client-level DP (the server clips, noises the sum, accounts)
    "FedAdam+DP-central": {"method": "FedAdam", "eta": 0.05},
    "FedNova": {"method": "FedNova"},  # normalised local steps: each client's tau_i travels up
    # asynchronous: one message per client, pushed and pulled as replies come (one in flight: the
    # order is the local path's, so the model is too)
    "FedBuff": {"method": "FedBuff", "buffer_size": 1, "concurrency": 1},
}
# SCAFFOLD (c down with the model, each c_i in its node's context.state) is the resumed run's
SCAFFOLD = {"method": "SCAFFOLD"}
# Rounds per run: 2 where a round depends on the last one in a way the Flower path carries
# (FedPer's heads in the nodes' context.state, local DP's noise drawn on the nodes for the
# round the message names and its accounting, FedBuff's versions and dispatches). FedNova keeps
# nothing between rounds; FedAdam's moments and central DP's accountant live in the ServerApp's
# FederatedServer, the local path's own object, carried from round to round by the same loop
# as FedAvg+DP-local's accounting, FedPer's rounds and SCAFFOLD's c (across a restart, below):
# a second round of either would repeat its first (two ClientApp processes, ~9 CPU-s)
ROUNDS = {m: 2 for m in AGGREGATIONS} | {"FedNova": 1, "FedAdam+DP-central": 1}
# Timeouts far above a round's time: a round whose client misses round_timeout aggregates
# fewer clients and no longer equals the local run. Under a loaded CI box a round of the
# six-run group measured 162 s (each message starts a ClientApp process that imports torch),
# and 240 s failed the SCAFFOLD resume's equality once; a dead node's message ends its round
# early anyway (SuperLink answers it with an error once the node is gone).
DEADLINE_S = 1200.0


def _job(out: Path, name: str, aggregation: dict[str, Any], *, rounds: int = 2, runtime: str = "flower",
         round_timeout: float = 900.0) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 3, "output_dir": str(out), "num_workers": 1},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits", "partition": {"method": "iid"}},
        "train": {"optimizer": {"name": "sgd", "lr": 0.05}},
        "strategy": {"type": "Federated", "num_clients": 4, "rounds": rounds, "aggregation": aggregation,
                     "client_selection": {"method": "All"}},
        "federated": {"local_epochs": 1, "batch_size": 32, "runtime": runtime},
    }
    if runtime == "flower":
        doc["run"].pop("num_workers")
        doc["federated"]["flower"] = {"round_timeout": round_timeout, "min_nodes": 2, "node_timeout": 120.0}
    return doc


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def _local(doc: dict[str, Any]) -> dict[str, Any]:
    local = json.loads(json.dumps(doc))
    local["federated"]["runtime"] = "local"
    local["federated"].pop("flower", None)
    local["run"]["name"] += "_local"
    local["run"]["num_workers"] = 1
    return execute(load_job(local), overwrite=True)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(cond: Any, what: str, fed: LocalFederation, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{fed.logs()}")
        time.sleep(0.2)


def _holder(fed: LocalFederation, run_dir: Path) -> int | None:
    """The ServerApp process holding ``run_dir``'s lock (the run folder it writes)."""
    lock = str((run_dir / ".lock").resolve())
    for pid in fed.serverapp_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == lock for fd in fds):
                return pid
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    home = tmp_path_factory.mktemp("flwr_home")
    federation = LocalFederation(home, 2)
    try:
        federation.start()
        yield federation
    finally:
        federation.close()


@pytest.fixture(scope="module")
def group(fed: LocalFederation, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Six runs at once on the federation: the five equality jobs (FedBuff one of them), and a
    SCAFFOLD run over two rounds whose ServerApp is killed after round 1 and resumed by a second
    ``flwr run`` for round 2 (the server's ``c`` comes back from its checkpoint, each client's
    ``c_i`` from its node's ``state-dir``: round 2's model depends on both)."""
    tmp = tmp_path_factory.mktemp("flower_runs")
    out = tmp / "runs"
    docs = {m: _job(out, f"fl_{m.lower().replace('+', '_')}", agg, rounds=ROUNDS[m])
            for m, agg in AGGREGATIONS.items()}
    docs["FedMedian+FedPer"]["subgraphs"] = {"head": {"type": "Local"}}
    docs["FedAvg+DP-local"]["federated"]["dp"] = {"mode": "local", "clip": 0.5, "noise_multiplier": 0.3,
                                                  "delta": 1e-5}
    docs["FedAdam+DP-central"]["federated"]["dp"] = {"mode": "central", "clip": 0.5,
                                                     "noise_multiplier": 0.3, "delta": 1e-5}
    docs["resume"] = _job(out, "fl_resume", SCAFFOLD, rounds=2)
    files = {k: _write(tmp / f"{k}.json", d) for k, d in docs.items()}
    for f in files.values():
        fed.run(APP, {"job": str(f)})
    run_dir = {k: out / d["run"]["name"] for k, d in docs.items()}
    # The resumed run: kill its ServerApp (SIGKILL) once round 1's checkpoint is on disk (the
    # metrics line comes first: a kill between the two resumed from the start), run it again.
    ckpts = run_dir["resume"] / "checkpoints"
    _wait(lambda: ckpts.is_dir() and any(ckpts.glob("step-*/layout.json")), "round 1's checkpoint of fl_resume", fed)
    pid = _holder(fed, run_dir["resume"])
    assert pid is not None, f"no ServerApp holds {run_dir['resume']}\n{fed.logs()}"
    os.kill(pid, 9)
    killed_after = len(_metrics(run_dir["resume"]))
    _wait(lambda: _holder(fed, run_dir["resume"]) is None, "the killed ServerApp to go", fed, 30)
    fed.run(APP, {"job": str(files["resume"]), "resume": True})
    local = {k: _local(d) for k, d in docs.items()}  # meanwhile, the local path's runs
    for d in run_dir.values():
        _wait(lambda d=d: (d / "summary.json").exists(), f"{d.name}/summary.json", fed)
    return {"run_dir": run_dir, "local": local, "killed_after": killed_after,
            "summary": {k: json.loads((d / "summary.json").read_text()) for k, d in run_dir.items()}}


def _same_rounds(flower: Path, local: Path) -> None:
    """Every round's metrics the same on both paths (accuracy, loss, update bytes)."""
    fl, lo = _metrics(flower), _metrics(local)
    for key in ("round", "test_accuracy", "train_loss", "bytes_up_measured"):
        assert [r[key] for r in fl] == [r[key] for r in lo], key


def _same_model(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert list(ta) == list(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("method", list(AGGREGATIONS))
def test_flower_equals_local(group: dict[str, Any], method: str) -> None:
    key = method
    flower, local = group["summary"][key], group["local"][key]
    assert flower["runtime"] == "flower" and flower["rounds"] == ROUNDS[method] and flower["clients_failed_total"] == 0
    assert flower["parameters_sha256"] == local["parameters_sha256"]
    _same_model(group["run_dir"][key], Path(local["run_dir"]))
    _same_rounds(group["run_dir"][key], Path(local["run_dir"]))
    fl, lo = _metrics(group["run_dir"][key]), _metrics(Path(local["run_dir"]))
    if method in ("FedAvg+DP-local", "FedAdam+DP-central"):  # the same noise, the same privacy spent
        assert flower["epsilon"] == local["epsilon"] > 0
        assert flower["dp_mode"] == ("local" if method == "FedAvg+DP-local" else "central")
    if method == "FedMedian+FedPer":  # every client scored with its own head, on its node
        assert flower["personal_test_accuracy"] == local["personal_test_accuracy"]
        assert [r["personal_test_accuracy"] for r in fl] == [r["personal_test_accuracy"] for r in lo]


def test_bytes_per_round_at_message_level(group: dict[str, Any]) -> None:
    rows = _metrics(group["run_dir"]["FedAvg+DP-local"])
    params = group["summary"]["FedAvg+DP-local"]["num_parameters"]
    for r in rows:
        # two train messages down, each with the model's float32 tensors; two replies up,
        # each with its clients' encoded updates
        assert r["wire_bytes_down_measured"] >= 2 * 4 * params
        assert r["wire_bytes_up_measured"] >= r["bytes_up_measured"] == 4 * 4 * params
    summary = group["summary"]["FedAvg+DP-local"]
    assert summary["wire_bytes_down_measured"] == sum(r["wire_bytes_down_measured"] for r in rows)
    assert summary["wire_bytes_up_measured"] == sum(r["wire_bytes_up_measured"] for r in rows)


def test_server_killed_and_restarted_resumes(group: dict[str, Any]) -> None:
    summary, local = group["summary"]["resume"], group["local"]["resume"]
    # killed after round 1 (before round 2 ended), resumed at round 1's checkpoint
    assert summary["resumed_from_round"] == 1 and group["killed_after"] == 1
    rows = _metrics(group["run_dir"]["resume"])
    assert [r["round"] for r in rows] == [1, 2]
    assert summary["clients_failed_total"] == 0, [r.get("failures") for r in rows]  # else not comparable
    assert summary["parameters_sha256"] == local["parameters_sha256"]
    _same_model(group["run_dir"]["resume"], Path(local["run_dir"]))
    # SCAFFOLD's equality with the local path, round by round, across the server's restart
    _same_rounds(group["run_dir"]["resume"], Path(local["run_dir"]))
    # the clients' c_i came back from both nodes' state-dir (fresh c_i would change the model)
    assert summary["client_state_restored_partitions"] == [0, 1] and "resume_note" not in summary
