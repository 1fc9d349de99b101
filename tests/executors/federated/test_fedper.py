"""Personal subgraphs under Federated (issue 15 part 3): FedPer and FedBN on 2 gloo workers.

- FedPer (Arivazhagan et al. 2019): digits split 2 label shards per client; with
  ``[subgraphs.head] type = "Local"`` the mean per-client test accuracy (each client's own
  model on its own test split) is higher than FedAvg's global model on the same splits, and
  the head never travels: the server's state and checkpoint lack it, every update and every
  broadcast carries exactly the other parameters' bytes.
- FedBN (Li et al. 2021): an IID split whose clients' inputs get their own scale and offset
  (``data.partition.feature_shift``); an MLP with BatchNorm, the norm layer Local, beats FedAvg
  of the same model.
- Resume: a worker killed mid-run and restarted by the elastic agent ends bit-identical to the
  uninterrupted run, the personal parts included; dropping the saved personal parts changes
  the result (so they are really restored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paratrain.comm.testing import run_distributed
from paratrain.config import load_job
from paratrain.data.partition import (
    client_test_splits,
    feature_shifts,
    owners,
    partition_shards,
    shift_features,
)
from paratrain.executors.federated.state import fed_store
from paratrain.training import read_metrics
from paratrain.training.stores import latest_folder, read_named_model, read_rank_state

pytestmark = pytest.mark.timeout(300)

HIDDEN = 32
CLASSES = 10
HEAD = HIDDEN * CLASSES + CLASSES
BODY = 64 * HIDDEN + HIDDEN
FEDPER_ROUNDS, FEDPER_K = 6, 10


def doc(out: Path | str, name: str, *, subgraphs: dict[str, Any] | None = None, fedbn: bool = False,
        rounds: int = FEDPER_ROUNDS, num_workers: int = 2, max_restarts: int = 0) -> dict[str, Any]:
    partition = ({"method": "iid", "feature_shift": 1.5} if fedbn
                 else {"method": "shards", "shards_per_client": 2})
    model: dict[str, Any] = {"name": "mlp", "hidden": [HIDDEN]}
    if fedbn:
        model["norm"] = "batch"
    return {
        "run": {"name": name, "seed": 0, "output_dir": str(out), "num_workers": num_workers,
                "max_restarts": max_restarts},
        "model": model,
        "data": {"name": "digits", "partition": partition},
        "train": {"optimizer": {"name": "sgd", "lr": 0.05 if fedbn else 0.1, "momentum": 0.9}},
        "federated": {"local_epochs": 1, "batch_size": 10, "evaluate_clients": True},
        "strategy": {"type": "Federated", "num_clients": 8 if fedbn else FEDPER_K, "rounds": rounds,
                     "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
        "subgraphs": subgraphs or {},
    }


def _sequence(ctx: Any, docs: list[dict[str, Any]]) -> list[Any]:
    from paratrain.executors.federated import worker_main

    return [worker_main(ctx, load_job(d), False) for d in docs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fedper")
    names = {
        "fedavg": doc(tmp, "fedavg"),
        "fedper": doc(tmp, "fedper", subgraphs={"head": {"type": "Local"}}),
        "fedavg_bn": doc(tmp, "fedavg_bn", fedbn=True),
        "fedbn": doc(tmp, "fedbn", fedbn=True, subgraphs={"norm0": {"type": "Local"}}),
    }
    out = run_distributed(_sequence, 2, list(names.values()), timeout_s=240)[0]
    return {"tmp": tmp, **dict(zip(names, out, strict=True))}


def test_fedper_beats_fedavg_per_client(runs: dict[str, Any]) -> None:
    avg, per = runs["fedavg"], runs["fedper"]
    assert avg["clients_evaluated"] == per["clients_evaluated"] == FEDPER_K
    assert per["personal_test_accuracy"] > avg["personal_test_accuracy"] + 0.1, (per, avg)
    assert per["personal_test_accuracy"] > 0.9
    # with the personal head, test_accuracy scores every test example by its client's model
    assert per["test_accuracy"] > avg["test_accuracy"]
    rec = [r for r in read_metrics(per["run_dir"]) if "round" in r]
    assert [r["round"] for r in rec] == list(range(1, FEDPER_ROUNDS + 1))
    assert all("personal_test_accuracy" in r for r in rec)


def test_the_head_never_travels_and_the_server_never_holds_it(runs: dict[str, Any]) -> None:
    per, avg = runs["fedper"], runs["fedavg"]
    assert per["personal_keys"] == ["head.weight", "head.bias"] and per["local_subgraphs"] == ["head"]
    assert per["server_state_keys"] == ["fc0.bias", "fc0.weight"]
    ck = latest_folder(Path(per["run_dir"]) / "checkpoints")
    assert ck is not None and ck.name == f"step-{FEDPER_ROUNDS:09d}"
    assert sorted(read_rank_state(ck, 0)["model"]) == ["fc0.bias", "fc0.weight"]
    assert sorted(read_named_model(ck)) == ["fc0.bias", "fc0.weight"]  # no process saved a head as model
    # every update carried the body only: K clients x rounds x 4 bytes x body parameters
    updates = FEDPER_K * FEDPER_ROUNDS
    assert per["bytes_up_measured"] == updates * 4 * BODY
    assert avg["bytes_up_measured"] == updates * 4 * (BODY + HEAD)
    # the round broadcasts to the second worker carried the body only
    assert per["wire_bytes_down_measured"] == FEDPER_ROUNDS * 4 * BODY
    assert avg["wire_bytes_down_measured"] == FEDPER_ROUNDS * 4 * (BODY + HEAD)
    # each worker checkpoint holds the heads of the clients it hosts (c % 2 == rank), only
    for rank in range(2):
        state = read_rank_state(ck, rank)["engine"]["clients"]
        assert sorted(state["personal"]) == sorted(f"client-{c}" for c in range(rank, FEDPER_K, 2))
        heads = [v["head.weight"] for v in state["personal"].values()]
        assert all(set(v) == {"head.weight", "head.bias"} for v in state["personal"].values())
        assert not torch.equal(heads[0], heads[1])  # really personal


def test_fedbn_beats_fedavg_on_feature_shifted_clients(runs: dict[str, Any]) -> None:
    avg, bn = runs["fedavg_bn"], runs["fedbn"]
    assert bn["personal_keys"] == [f"norm0.{k}" for k in
                                   ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
    assert bn["personal_test_accuracy"] > avg["personal_test_accuracy"] + 0.03, (bn, avg)
    assert bn["personal_test_accuracy_min"] > avg["personal_test_accuracy_min"]


def test_a_killed_worker_resumes_bit_identical_personal_parts_included(
        runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.executors.federated import run
    from paratrain.training.faults import FAULT_ENV

    ref = runs["fedper"]
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 is SIGKILLed after round 3
    job = load_job(doc(runs["tmp"] / "kill", "fedper", subgraphs={"head": {"type": "Local"}},
                       max_restarts=1))
    out = run(job)
    assert out["client_updates_this_run"] < FEDPER_K * FEDPER_ROUNDS  # it really restarted
    for key in ("parameters_sha256", "personal_sha256", "personal_test_accuracy", "test_accuracy"):
        assert out[key] == ref[key], key
    assert [w["personal_sha256"] for w in out["workers"]] == [w["personal_sha256"] for w in ref["workers"]]
    a = [r["personal_test_accuracy"] for r in read_metrics(ref["run_dir"]) if "round" in r]
    b = [r["personal_test_accuracy"] for r in read_metrics(out["run_dir"]) if "round" in r]
    assert a == b


def test_resume_restores_the_personal_parts(tmp_path: Path) -> None:
    """In one process: a run stopped after 2 rounds and resumed to 4 equals 4 rounds straight;
    without its saved personal parts the resumed run differs (non-vacuity)."""
    from paratrain.executors.federated import run_in_process

    sub = {"head": {"type": "Local"}}
    ref = run_in_process(load_job(doc(tmp_path / "a", "r", subgraphs=sub, rounds=4, num_workers=1)))
    for name, drop in (("b", False), ("c", True)):
        run_in_process(load_job(doc(tmp_path / name, "r", subgraphs=sub, rounds=2, num_workers=1)))
        if drop:
            folder = tmp_path / name / "r" / "checkpoints" / "step-000000002"
            state = read_rank_state(folder, 0)
            assert len(state["engine"]["clients"]["personal"]) == FEDPER_K
            state["engine"]["clients"]["personal"] = {}
            runtime = json.loads((folder / "layout.json").read_text())["runtime"]
            fed_store(tmp_path / name / "r", rank=0, world=1, group=None, runtime=runtime).save(2, state)
        resumed = run_in_process(load_job(doc(tmp_path / name, "r", subgraphs=sub, rounds=4, num_workers=1)),
                                 resume=True)
        same = resumed["personal_sha256"] == ref["personal_sha256"]
        assert same is not drop, name
        assert (resumed["personal_test_accuracy"] == ref["personal_test_accuracy"]) is not drop


def test_fedprox_and_compressed_updates_leave_the_personal_part_alone(tmp_path: Path) -> None:
    """FedProx's proximal term covers the global parameters only (the head has no global
    anchor) and a compressed (TopK + error feedback) update carries the body only."""
    from paratrain.executors.federated import run_in_process

    d = doc(tmp_path, "prox", subgraphs={"head": {"type": "Local"}}, rounds=2, num_workers=1)
    d["strategy"]["aggregation"] = {"method": "FedProx", "mu": 0.5}
    d["compression"] = {"method": "ErrorFeedback", "error_compensation": True,
                        "base_strategy": {"method": "TopK", "k": 50}}
    s = run_in_process(load_job(d))
    rec = [r for r in read_metrics(s["run_dir"]) if "round" in r]
    assert [(r["clients_ok"], r["clients_failed"]) for r in rec] == [(FEDPER_K, 0)] * 2
    last = latest_folder(Path(s["run_dir"]) / "checkpoints")
    assert last is not None
    state = read_rank_state(last, 0)["engine"]["clients"]
    residuals = next(iter(state["codec"].values()))
    assert "head.weight" not in str(sorted(_keys(residuals))) and "fc0.weight" in str(sorted(_keys(residuals)))


def _keys(obj: Any) -> list[str]:
    """Every dict key anywhere inside ``obj``."""
    if isinstance(obj, dict):
        return [str(k) for k in obj] + [k for v in obj.values() for k in _keys(v)]
    if isinstance(obj, list | tuple):
        return [k for v in obj for k in _keys(v)]
    return []


# ------------------------------------------------------------------ client splits


def test_client_test_splits_follow_the_label_partition() -> None:
    rng = np.random.default_rng(0)
    y_train = rng.integers(0, 10, 600)
    y_test = rng.integers(0, 10, 200)
    parts = partition_shards(y_train, 6, shards_per_client=2, seed=1)

    class DS:
        def __init__(self, y: np.ndarray) -> None:
            self.tensors = (torch.zeros(len(y), 3), torch.from_numpy(y))

        def __len__(self) -> int:
            return len(self.tensors[1])

    splits = client_test_splits(DS(y_train), DS(y_test), parts, "shards", seed=0)
    flat = np.concatenate(splits)
    assert sorted(flat.tolist()) == list(range(200))  # disjoint and covering
    for c in range(6):
        train_labels = set(y_train[parts[c]].tolist())
        assert set(y_test[splits[c]].tolist()) <= train_labels  # a client is tested on its labels
        for label in train_labels:  # in proportion to its share of that label (+-1 by rounding)
            share = np.mean(y_train[parts[c]] == label) * len(parts[c]) / np.sum(y_train == label)
            assert abs(np.sum(y_test[splits[c]] == label) - share * np.sum(y_test == label)) <= 1
    iid = client_test_splits(DS(y_train), DS(y_test), parts, "iid", seed=0)
    assert sorted(np.concatenate(iid).tolist()) == list(range(200))
    assert max(map(len, iid)) - min(map(len, iid)) <= 1


def test_feature_shift_scales_and_offsets_each_clients_inputs() -> None:
    x = torch.rand(12, 4)
    parts = [np.array([0, 3, 5]), np.array([1, 2, 4, 6, 7]), np.array([8, 9, 10, 11])]
    scales, offsets = feature_shifts(3, 1.5, seed=0)
    assert np.all((scales > np.exp(-1.5)) & (scales < np.exp(1.5))) and len(set(scales)) == 3
    from torch.utils.data import TensorDataset

    ds = shift_features(TensorDataset(x, torch.zeros(12)), owners(parts, 12), scales, offsets)
    for c, idx in enumerate(parts):
        want = x[idx] * float(scales[c]) + float(offsets[c])
        torch.testing.assert_close(ds.tensors[0][idx], want.to(torch.float32))
    with pytest.raises(ValueError, match="float features"):
        shift_features(TensorDataset(torch.zeros(3, 2, dtype=torch.long)), np.zeros(3, dtype=np.int64),
                       scales, offsets)


def test_the_example_job_validates() -> None:
    from paratrain.cli import main

    path = Path(__file__).resolve().parents[3] / "examples" / "federated_fedper.toml"
    assert main(["validate", str(path)]) == 0
    job = load_job(path)
    assert json.loads(json.dumps(job.to_json_dict()))["subgraphs"] == {"head": {"type": "Local"}}
