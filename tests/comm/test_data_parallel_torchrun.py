"""The same job file under ``torchrun -m paratrain.worker`` and as two "machines"
(``paratrain run --nnodes 2 --node-rank R --rdzv-endpoint``) on 127.0.0.1: both train
the same parameters (the replicas, shards and seed do not depend on the launcher)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.comm.rendezvous import launch_config
from paratrain.comm.testing import free_port
from paratrain.config import ConfigError, load_job

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

BIN = Path(sys.executable).parent

JOB = """
[run]
name = "{name}"
seed = 2
output_dir = "{out}"

[model]
name = "mlp"
hidden = [16]

[train]
epochs = 1
batch_size = 16
max_steps = 6

[strategy]
type = "DataParallel"
num_replicas = 2
aggregation = {{ method = "ParameterServer" }}
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
           and not k.startswith("PARATRAIN_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _summary(out: Path, name: str) -> dict[str, object]:
    data: dict[str, object] = json.loads((out / name / "summary.json").read_text())
    return data


def _docs_torchrun(job: Path, port: int) -> list[str]:
    """The torchrun line of docs/across-machines.md, as written, on one node with 2 processes."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "across-machines.md").read_text()
    match = re.search(r"^(torchrun [^`\n]*-m paratrain\.worker job\.toml)$", text, re.MULTILINE)
    assert match, "docs/across-machines.md lost its torchrun line"
    args = match.group(1).split()
    assert "--rdzv-backend=c10d" in args  # without it torchrun's static backend needs --node-rank
    subs = {"--nnodes=2": "--nnodes=1", "--nproc-per-node=4": "--nproc-per-node=2",
            "--rdzv-endpoint=HOST:PORT": f"--rdzv-endpoint=127.0.0.1:{port}", "job.toml": str(job)}
    assert set(subs) <= set(args), args
    return [str(BIN / "torchrun"), *(subs.get(a, a) for a in args[1:])]


def test_torchrun_and_two_node_launch_agree(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    (tmp_path / "b.toml").write_text(JOB.format(name="nodes", out=out))
    (tmp_path / "c.toml").write_text(JOB.format(name="readme", out=out))
    # Rendezvous ports below the ephemeral range (free_port): a port from bind(0), closed
    # and bound again seconds later by the node-0 process, could meanwhile go to any
    # socket of the launches started beside it (see comm.testing.free_port).
    port, readme_port = free_port(), free_port()
    assert port != readme_port
    # torchrun is the docs' line (c10d rendezvous, 2 processes on this one node): a second
    # torchrun launch (--standalone) ran the same ``-m paratrain.worker`` ranks again.
    commands = [
        *(
            [str(BIN / "paratrain"), "run", str(tmp_path / "b.toml"), "--quiet", "--nnodes", "2",
             "--node-rank", str(r), "--rdzv-endpoint", f"127.0.0.1:{port}"]
            for r in range(2)
        ),
        _docs_torchrun(tmp_path / "c.toml", readme_port),
    ]
    # All launches at once: they are independent jobs (different run folders).
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in commands
    ]
    try:
        logs = [p.communicate(timeout=420)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    b, c = _summary(out, "nodes"), _summary(out, "readme")
    assert b["num_replicas"] == c["num_replicas"] == 2
    assert b["steps"] == c["steps"] == 6
    assert b["parameters_sha256"] == c["parameters_sha256"]
    # 2 replicas: the server receives one gradient and sends one mean per step.
    for s in (b, c):
        assert s["server_bytes_per_step"] == 2 * 4 * s["num_parameters"]  # type: ignore[operator]


@pytest.mark.skipif(not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux only")
def test_free_port_is_never_an_ephemeral_port() -> None:
    """The kernel hands ephemeral ports to bind(0) and to every outgoing connection; a
    port picked there and bound later by another process can be taken in between."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), ports
    assert len(set(ports)) > 1  # OS randomness, not one fixed number


def test_launch_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    job = load_job({"run": {"name": "j", "max_restarts": 3}})
    cfg = launch_config(job, nprocs=4)
    assert (cfg.nproc_per_node, cfg.min_nodes, cfg.max_restarts, cfg.rdzv_backend) == (4, 1, 3, "c10d")
    # Port 0: the store binds a port the kernel picks (nothing can take it first).
    assert cfg.rdzv_endpoint == "127.0.0.1:0" and cfg.start_method == "forkserver"
    monkeypatch.setenv("PARATRAIN_NNODES", "2")
    monkeypatch.setenv("PARATRAIN_RDZV_ENDPOINT", "10.0.0.1:29500")
    cfg = launch_config(job, nprocs=4)
    assert (cfg.nproc_per_node, cfg.max_nodes, cfg.rdzv_backend) == (2, 2, "c10d")
    monkeypatch.setenv("PARATRAIN_NODE_RANK", "1")
    cfg = launch_config(job, nprocs=4)
    assert cfg.rdzv_backend == "static" and cfg.rdzv_configs["rank"] == 1
    with pytest.raises(ConfigError, match="cannot share evenly"):
        launch_config(job, nprocs=3)
    monkeypatch.setenv("PARATRAIN_NODE_RANK", "5")
    with pytest.raises(ConfigError, match="must be in") as info:
        launch_config(job, nprocs=4)
    assert info.value.problems[0][0] == "--node-rank"  # the flag, not the variable
    monkeypatch.delenv("PARATRAIN_RDZV_ENDPOINT")
    with pytest.raises(ConfigError, match="required with more than one node") as info:
        launch_config(job, nprocs=4)
    assert info.value.problems[0][0] == "--rdzv-endpoint"


def test_worker_module_rejects_a_world_size_that_does_not_match(tmp_path: Path) -> None:
    """Under torchrun with 1 process, a 2-replica job is a clear error (exit 2), not a hang."""
    (tmp_path / "a.toml").write_text(JOB.format(name="mismatch", out=tmp_path / "runs"))
    env = _env() | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "paratrain.worker", str(tmp_path / "a.toml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: strategy: this job needs 2 worker processes but torchrun started WORLD_SIZE=1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("flags", "line"), [
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "127.0.0.1:29500"],
     "error: --node-rank: must be in [0, 2) with --nnodes 2 (got 5)"),
    (["--nnodes", "2", "--node-rank", "0"],
     "error: --rdzv-endpoint: required with more than one node (HOST:PORT)"),
    (["--nnodes", "0"], "error: --nnodes: must be >= 1 (got 0)"),
    (["--nnodes", "2", "--rdzv-endpoint", "host-without-port"],
     "error: --rdzv-endpoint: expected HOST:PORT with a port in 1..65535 (got 'host-without-port')"),
])
def test_multi_node_flag_errors_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    flags: list[str], line: str,
) -> None:
    from paratrain.cli import main

    for var in ("PARATRAIN_NNODES", "PARATRAIN_NODE_RANK", "PARATRAIN_RDZV_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "a.toml").write_text(JOB.format(name="flags", out=tmp_path / "runs"))
    assert main(["run", str(tmp_path / "a.toml"), "--quiet", *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert "PARATRAIN_NNODES" not in os.environ  # refused before anything was set
    assert not (tmp_path / "runs").exists()


def test_version_flag_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    from paratrain.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"paratrain {version('paratrain')}"
