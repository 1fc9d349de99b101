"""Federated on Flower's Deployment Runtime, a SuperNode killed mid-round: that round completes
with the other node's clients once SuperLink answers the dead node's messages (the killed
node's clients are failures naming it), the node restarts with the same partition and its
clients take part again in the next round. A federation of its own (SuperLink and two
SuperNodes on 127.0.0.1), so that this file and test_federated_flower.py run side by side.
Two rounds: the node dies in round 1, while it runs round 1's ClientApp (a round before it,
all four clients answering, is every other Flower run's first round; each round is one
ClientApp process per node, each importing torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from test_federated_flower import APP, _job, _metrics, _wait, _write  # noqa: E402

from _flower_federation import LocalFederation  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture
def fed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    federation = LocalFederation(tmp_path_factory.mktemp("flwr_home"), 2)
    try:
        federation.start()
        yield federation
    finally:
        federation.close()


def test_supernode_killed_mid_round_then_rejoins(fed: LocalFederation, tmp_path: Path) -> None:
    # round_timeout: far above a round's time on a loaded 2-core machine (22 s alone, 162 s in
    # a loaded suite); round 1 ends when SuperLink answers the dead node's message (53 s).
    doc = _job(tmp_path / "runs", "fl_kill", {"method": "FedAvg"}, rounds=2, round_timeout=600.0)
    fed.run(APP, {"job": str(_write(tmp_path / "kill.json", doc))})
    run_dir = tmp_path / "runs" / "fl_kill"
    # mid-round: once node 1 runs a ClientApp for round 1 (it took the round's message, so the
    # restarted node, a new node id, gets none of round 1)
    _wait(lambda: bool(fed.clientapp_pids("node1")), "node 1's ClientApp for round 1 of fl_kill", fed)
    fed.kill("node1")
    fed.start_node(1)  # same partition, a new node id
    _wait(lambda: (run_dir / "summary.json").exists(), "fl_kill/summary.json", fed)
    rows = _metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["clients_ok"] == 2 and rows[0]["clients_failed"] == 2
    assert sorted(f["client"] for f in rows[0]["failures"]) == ["client-1", "client-3"]
    assert all("replied within round_timeout" in f["error"] for f in rows[0]["failures"])
    assert rows[1]["clients_ok"] == 4 and rows[1]["clients_failed"] == 0
