"""Federated rounds end to end: real worker processes, faults, compression, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _workers_federated import TOPK_EF, fed_job, rank_main_sequence
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.executors.federated import run, run_in_process
from paratrain.executors.federated.aggregation import MalformedUpdateError
from paratrain.executors.federated.state import fed_store
from paratrain.executors.federated.wire import decode_update, encode_update
from paratrain.models import build_model
from paratrain.training import parameters_digest, read_metrics, seed_everything
from paratrain.training.faults import FAULT_ENV, inject_faults
from paratrain.training.stores import read_rank_state

DENSE_MODEL_BYTES = 4 * (64 * 64 + 64 + 64 * 10 + 10)


def _rounds(run_dir: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "round" in r]


def _step(run_dir: str | Path, r: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{r:09d}"


# ------------------------------------------------------------------ wire


def test_wire_decoding_rejects_malformed_updates_naming_client_and_tensor() -> None:
    ref = {"a": torch.zeros(2, 3), "b": torch.zeros(())}
    delta = {"a": torch.ones(2, 3), "b": torch.tensor(0.5)}
    headers, payload = encode_update(delta)
    out = decode_update("client-4", headers, payload, ref)
    assert torch.equal(out["a"], delta["a"]) and out["b"].item() == 0.5
    with pytest.raises(MalformedUpdateError, match=r"client client-4: tensor '<payload>'"):
        decode_update("client-4", headers, payload[:-2], ref)
    bad = [dict(h) for h in headers]
    bad[0]["shape"] = [3, 2]
    with pytest.raises(MalformedUpdateError, match=r"tensor 'a': shape \(3, 2\)"):
        decode_update("client-4", bad, payload, ref)
    bad = [dict(h) for h in headers]
    bad[1]["name"] = "c"
    with pytest.raises(MalformedUpdateError, match=r"tensor 'c': unexpected"):
        decode_update("client-4", bad, payload, ref)
    with pytest.raises(MalformedUpdateError, match=r"tensor 'b': missing"):
        decode_update("client-4", headers[:1], payload[:24], ref)
    bad = [dict(h) for h in headers]
    bad[0]["enc"] = "pickle"
    with pytest.raises(MalformedUpdateError, match="unknown encoding"):
        decode_update("client-4", bad, payload, ref)
    from paratrain.compression import Compressor

    ct = Compressor({"method": "TopK", "k": 2}).compress("a", torch.arange(6.0).reshape(2, 3)).to_bytes()
    h = [{"name": "a", "shape": [2, 3], "enc": "ct", "nbytes": len(ct) - 3},
         {"name": "b", "shape": [], "enc": "f32", "nbytes": 4}]
    with pytest.raises(MalformedUpdateError, match=r"tensor 'a': bad compressed payload"):
        decode_update("client-9", h, ct[:-3] + payload[-4:], ref)
    h[0]["nbytes"] = len(ct)
    ok = decode_update("client-9", h, ct + payload[-4:], ref)
    assert torch.equal(ok["a"], torch.tensor([[0.0, 0, 0], [0, 4, 5]]))


# ------------------------------------------------------------------ in-process rounds


def test_round_records_failures_rejections_bytes_and_residuals(tmp_path: Path) -> None:
    job = fed_job(tmp_path, "faults", K=6, rounds=2, compression=TOPK_EF, local_epochs=1)
    with inject_faults(fail_clients=[1], corrupt_clients=[2]):
        s = run_in_process(job)
    recs = _rounds(s["run_dir"])
    assert [r["round"] for r in recs] == [1, 2]
    for r in recs:
        assert (r["clients_selected"], r["clients_ok"], r["clients_failed"]) == (6, 4, 2)
        errs = {f["client"]: f["error"] for f in r["failures"]}
        assert "injected failure" in errs["client-1"]
        assert "rejected update: client client-2: tensor 'fc0.weight': shape (4095,)" in errs["client-2"]
        assert r["bytes_down_modelled"] == 6 * DENSE_MODEL_BYTES
        assert 0 < r["bytes_up_measured"] < 5 * DENSE_MODEL_BYTES / 3  # top-k: far below dense
        # one process: nothing went through a process group
        assert r["wire_bytes_down_measured"] == r["wire_bytes_up_measured"] == 0
    assert s["clients_failed_total"] == 4
    ckpt = read_rank_state(_step(s["run_dir"], 2), 0)["engine"]["clients"]
    # client-1 failed before encoding: no residual; client-2 encoded (the server rejected it)
    assert sorted(ckpt["codec"]) == ["client-0", "client-2", "client-3", "client-4", "client-5"]
    res = ckpt["codec"]["client-0"]["residuals"]["fc0.weight"]
    assert res.shape == (4096,) and float(res.abs().sum()) > 0


def test_round_with_no_successful_client_keeps_the_model(tmp_path: Path) -> None:
    job = fed_job(tmp_path, "nobody", K=2, rounds=2,
                  agg={"method": "FedYogi", "beta1": 0.9, "beta2": 0.99, "tau": 1e-3})
    with inject_faults(fail_clients=[0, 1]):
        s = run_in_process(job)
    seed_everything(0)
    init = build_model(job.model, input_shape=(64,), num_classes=10)
    assert s["parameters_sha256"] == parameters_digest(init)
    for r in _rounds(s["run_dir"]):
        assert r["clients_ok"] == 0 and "no successful client out of 2" in r["note"]
        assert "global model unchanged" in r["note"]


def test_resume_continues_a_finished_run_exactly(tmp_path: Path) -> None:
    yogi = {"method": "FedYogi", "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "eta": 0.03}
    kw = dict(K=6, sel={"method": "Random", "fraction": 0.5}, agg=yogi, local_epochs=1)
    ref = run_in_process(fed_job(tmp_path / "a", "r", rounds=4, **kw))
    run_in_process(fed_job(tmp_path / "b", "r", rounds=2, **kw))
    resumed = run_in_process(fed_job(tmp_path / "b", "r", rounds=4, **kw), resume=True)
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]
    assert [r["round"] for r in _rounds(resumed["run_dir"])] == [1, 2, 3, 4]
    # resuming a finished run changes nothing
    again = run_in_process(fed_job(tmp_path / "b", "r", rounds=4, **kw), resume=True)
    assert again["parameters_sha256"] == ref["parameters_sha256"]
    # non-vacuity: the server optimizer state matters (drop it -> different model)
    ck = Path(resumed["run_dir"]) / "checkpoints"
    run_in_process(fed_job(tmp_path / "c", "r", rounds=2, **kw))
    c2 = _step(tmp_path / "c" / "r", 2)
    state = read_rank_state(c2, 0)
    assert state["engine"]["server"]["aggregator"]  # FedYogi's moments are saved
    state["engine"]["server"]["aggregator"] = {}
    runtime = json.loads((c2 / "layout.json").read_text())["runtime"]
    fed_store(tmp_path / "c" / "r", rank=0, world=1, group=None, runtime=runtime).save(2, state)
    other = run_in_process(fed_job(tmp_path / "c", "r", rounds=4, **kw), resume=True)
    assert other["parameters_sha256"] != ref["parameters_sha256"]
    assert ck.is_dir()


def test_bycapability_selects_tagged_clients_and_errors_name_the_tags(tmp_path: Path) -> None:
    job = fed_job(tmp_path, "caps", K=4, rounds=1, sel={"method": "ByCapability", "required_tags": ["gpu", "eu"]},
                  client_tags={"client-0": ["gpu"], "client-3": ["gpu"], "client-2": ["cpu"]},
                  workers=[{"id": "w0", "tags": ["eu"]}])
    s = run_in_process(job)
    assert _rounds(s["run_dir"])[0]["clients_selected"] == 2
    bad = fed_job(tmp_path, "caps2", K=4, rounds=1, sel={"method": "ByCapability", "required_tags": ["tpu"]})
    with pytest.raises(ConfigError, match=r"required_tags.*\['tpu'\]"):
        run_in_process(bad)
    with inject_faults(fail_clients=[4]), pytest.raises(ConfigError, match="PARATRAIN_FAULTS.fail_clients"):
        run_in_process(fed_job(tmp_path, "caps3", K=4))


# ------------------------------------------------------------------ real processes


def test_killed_worker_restarts_and_ends_equal_to_uninterrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = dict(K=6, rounds=4, sel={"method": "Random", "fraction": 0.5}, compression=TOPK_EF,
              local_epochs=1, agg={"method": "FedAvgM", "server_momentum": 0.5})
    # Reference: the same job uninterrupted, in one process.
    ref = run_in_process(fed_job(tmp_path / "ref", "k", **kw))
    monkeypatch.setenv(FAULT_ENV, "1:2")  # rank 1 is SIGKILLed after round 2
    # Two worker processes through the elastic launcher; the agent restarts the group.
    out = run(fed_job(tmp_path / "kill", "k", num_workers=2, max_restarts=1, **kw))
    assert out["num_workers"] == 2 and len(out["workers"]) == 2
    assert all(w["client_updates"] > 0 for w in out["workers"])  # client c lives on rank c % 2
    # Two processes with a crash in between == one process uninterrupted, bit for bit.
    assert out["parameters_sha256"] == ref["parameters_sha256"]
    assert ((out["bytes_up_measured"], out["bytes_down_modelled"])
            == (ref["bytes_up_measured"], ref["bytes_down_modelled"]))
    # two processes: the model broadcast reached rank 1 once per round (4 rounds, counted at
    # the broadcast), and rank 0 received rank 1's update payloads point-to-point
    assert ref["wire_bytes_down_measured"] == 0
    assert out["wire_bytes_down_measured"] == 4 * DENSE_MODEL_BYTES
    assert 0 < out["wire_bytes_up_measured"] < out["bytes_up_measured"]
    assert out["provenance"]["bytes_down_modelled"] == "modelled"
    assert out["provenance"]["num_clients"] == "configured"
    a, b = _rounds(ref["run_dir"]), _rounds(out["run_dir"])
    assert [r["round"] for r in b] == [1, 2, 3, 4]
    assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
    # the restarted group trained only rounds 3-4, not all four again
    assert out["client_updates_this_run"] < ref["client_updates_this_run"]
    summary = json.loads((Path(out["run_dir"]) / "summary.json").read_text())
    assert summary["parameters_sha256"] == out["parameters_sha256"]


def test_memory_does_not_grow_with_num_clients(tmp_path: Path) -> None:
    """100 then 1,000 clients (10 per round) in the same two worker processes: the peak
    RSS after the 1,000-client run is within a few MB of the peak after the 100-client
    one (only the selected clients' work is alive; a worker keeps one model)."""
    jobs = [
        fed_job(tmp_path, f"mem{k}", K=k, rounds=2, sel={"method": "Random", "fraction": frac},
                local_epochs=1, num_workers=2).to_json_dict()
        for k, frac in ((10, 1.0), (100, 0.1), (1000, 0.01))
    ]
    # The first (10-client) job warms the processes up (imports, allocator, the plot).
    res = run_distributed(rank_main_sequence, 2, jobs, timeout_s=240)
    _, s100, s1000 = res[0]
    for s, k in ((s100, 100), (s1000, 1000)):
        assert s["num_clients"] == k and sum(w["clients_hosted"] for w in s["workers"]) == k
        assert s["client_updates_this_run"] == 20  # 10 clients per round, 2 rounds
    for w100, w1000 in zip(s100["workers"], s1000["workers"], strict=True):
        assert w1000["peak_rss_mb"] - w100["peak_rss_mb"] < 20.0, (w100, w1000)


def test_fedprox_mu_zero_is_fedavg_and_large_mu_holds_clients_near_global(tmp_path: Path) -> None:
    def moved(agg: dict, name: str) -> tuple[float, str]:
        s = run_in_process(fed_job(tmp_path, name, K=4, rounds=1, agg=agg, local_epochs=3, lr=0.3))
        ck = read_rank_state(_step(s["run_dir"], 1), 0)
        seed_everything(0)
        init = build_model(fed_job(tmp_path, "x").model, input_shape=(64,), num_classes=10).state_dict()
        dist = sum(float((ck["model"][k] - init[k]).pow(2).sum()) for k in init) ** 0.5
        return dist, s["parameters_sha256"]

    d_avg, h_avg = moved({"method": "FedAvg"}, "avg")
    d0, h0 = moved({"method": "FedProx", "mu": 0.0}, "prox0")
    d10, _ = moved({"method": "FedProx", "mu": 10.0}, "prox10")
    assert h0 == h_avg and d0 == d_avg
    assert d10 < 0.5 * d_avg, (d10, d_avg)
