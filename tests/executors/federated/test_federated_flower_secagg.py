"""Secure aggregation on Flower's Deployment Runtime through Flower's own SecAgg+
(``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on the nodes), for real: a local
federation of three SuperNodes on 127.0.0.1 (one client per node), deployed as an organisation
would: TLS on the SuperLink's APIs (a local CA; the SuperNodes and ``flwr`` verify the server's
certificate) and CLI-managed node authentication (``--enable-supernode-auth``: only the three
registered public keys may join). A fourth SuperNode with a key nobody registered is started
beside them: the SuperLink refuses it, it exits, and the SecAgg+ stages count the three
registered nodes only.

One node drops out after masking (it exits on the unmask stage's message): its masked update is
in the sum, and its mask is reconstructed from the other two nodes' shares
(reconstruction_threshold 2), so the global model after the secure FedAvg round equals the local
path's plain FedAvg round to the fixed-point precision: each node's weighted mean update is
quantized with Flower's stochastic rounding to steps of ``2 * clipping_range /
quantization_range`` = 16 / 2**22 ~ 3.8e-6 (an error below one step per value and node), the
three nodes' errors add up in the sum, and the weights (examples / max_weight, max_weight = the
round's examples, summing to 1) are rounded to 2**-22: the bound is 3 steps = 1.14e-5, checked
with 5 % slack (measured: 9.2e-6 at most). The server's record of the round says SecAgg+ and
counts every client. (A round without a dropout runs the same first three stages and an unmask
stage with nothing to reconstruct: the dropout round covers it. Each stage's message starts a
ClientApp process on every node, about 4.5 CPU-s each: a second federation for it cost a
minute of the suite's CPU.) The plaintext Flower run's equality is bit for bit
(tests/executors/federated/test_federated_flower.py).
"""


from __future__ import annotations

import json
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_federated_flower import APP, _job, _local, _metrics, _write  # noqa: E402

from _flower_federation import LocalFederation  # noqa: E402
from _flower_pki import write_local_pki  # noqa: E402
from paratrain.training.faults import DROP_AT_ENV  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TOLERANCE = 3 * 16 / 2**22 * 1.05  # 3 nodes x one quantization step


def _secure_job(out: Path, name: str) -> dict[str, Any]:
    doc = _job(out, name, {"method": "FedAvg"}, rounds=1, round_timeout=300.0)
    doc["strategy"]["num_clients"] = 3
    doc["federated"]["flower"].update(min_nodes=3, secure_aggregation={"num_shares": 1.0,
                                                                       "reconstruction_threshold": 2})
    return doc


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("secagg")
    out = tmp / "runs"
    fed = LocalFederation(tmp / "home", 3, secure=True)  # TLS + node authentication
    try:
        fed.start(num_started=2)
        fed.start_node(2, env={DROP_AT_ENV: "unmask"})  # node 2 drops out after masking
        stranger = write_local_pki(tmp / "stranger", 1).node_keys[0]  # a key nobody registered
        intruder = fed.start_node(0, private_key=stranger, name="intruder")
        doc = _secure_job(out, "sa_one")
        fed.run(APP, {"job": str(_write(tmp / "one.json", doc))})
        local = _local(doc)  # meanwhile: the same round, plaintext, the local way
        deadline = time.monotonic() + 1200
        summary = out / doc["run"]["name"] / "summary.json"
        while not summary.exists():
            assert time.monotonic() < deadline, fed.logs()
            time.sleep(0.5)
        intruder_code = intruder.wait(timeout=60)
        return {"run_dir": out / doc["run"]["name"], "local": local, "tls": _tls_handshake(fed),
                "intruder": (intruder_code, (fed.home / "intruder.log").read_text(errors="replace"))}
    finally:
        fed.close()


def test_secure_sum_with_a_dropout_equals_the_plain_sum_to_fixed_point_precision(secure_run: dict[str, Any]) -> None:
    run_dir = secure_run["run_dir"]
    (rec,) = _metrics(run_dir)
    assert rec["secure_aggregation"] == "SecAgg+"
    assert rec["clients_ok"] == 3 and rec["clients_failed"] == 0
    # nodes answering setup, share keys, masked vectors, unmask: the dropout is after masking
    assert rec["secagg_nodes_per_stage"] == [3, 3, 3, 2]
    assert rec["wire_bytes_down_measured"] > 0 and rec["wire_bytes_up_measured"] > 0
    secure = load_file(str(run_dir / "model.safetensors"))
    plain = load_file(str(Path(secure_run["local"]["run_dir"]) / "model.safetensors"))
    assert list(secure) == list(plain)
    for k in plain:
        err = float((secure[k] - plain[k]).abs().max())
        assert err <= TOLERANCE, (k, err)
    assert not torch.equal(secure["head.weight"], _initial(run_dir)["head.weight"])  # the round moved it
    loss = json.loads((run_dir / "summary.json").read_text())["test_loss"]
    assert abs(loss - secure_run["local"]["test_loss"]) < 1e-4


def _tls_handshake(fed: LocalFederation) -> dict[str, Any]:
    """A TLS handshake with the SuperLink's port that verifies its certificate against the local CA
    (and the address 127.0.0.1 against the certificate's names)."""
    assert fed.pki is not None
    ctx = ssl.create_default_context(cafile=str(fed.pki.ca_cert))
    with socket.create_connection(("127.0.0.1", fed.port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return {"version": tls.version(), "cert": tls.getpeercert()}


def test_the_secure_federation_speaks_tls_and_admits_registered_nodes_only(secure_run: dict[str, Any]) -> None:
    tls = secure_run["tls"]
    assert tls["version"] in ("TLSv1.2", "TLSv1.3")
    assert ("IP Address", "127.0.0.1") in tls["cert"]["subjectAltName"]
    code, log = secure_run["intruder"]
    assert code != 0 and "Failed to activate SuperNode" in log, log[-2000:]
    # ... while the three registered nodes took part in the secure round's stages
    assert _metrics(secure_run["run_dir"])[0]["secagg_nodes_per_stage"][:3] == [3, 3, 3]
    config = (Path(secure_run["run_dir"]).parents[1] / "home" / "config.toml").read_text()
    assert "insecure" not in config and "root-certificates" in config


def _initial(run_dir: Path) -> dict[str, torch.Tensor]:
    from paratrain.config.job import load_job
    from paratrain.executors.federated.flower.side import build_side

    job = load_job(json.loads((run_dir / "job.json").read_text()))
    return build_side(job).template
