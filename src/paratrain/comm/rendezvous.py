"""Where the worker processes meet: torchrun detection and the rendezvous of a launch.

:func:`launch_config` builds torch's ``LaunchConfig`` for this node: on one node a c10d
rendezvous on ``127.0.0.1`` port 0 (the kernel picks the port as the store binds it, so no
other process can take it first). Across nodes, ``PARATRAIN_NNODES``, ``PARATRAIN_NODE_RANK``
and ``PARATRAIN_RDZV_ENDPOINT`` (``paratrain run --nnodes/--node-rank/--rdzv-endpoint``,
checked by :func:`check_nodes`, whose errors name the flags) configure it as ``torchrun``
does: with a node rank the ``static`` backend, without one ``c10d`` on the endpoint (this
machine's address from the route to it: :func:`paratrain.comm.hosts.rendezvous_host`).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from .hosts import rendezvous_host

ENV_NNODES = "PARATRAIN_NNODES"
ENV_NODE_RANK = "PARATRAIN_NODE_RANK"
ENV_RDZV_ENDPOINT = "PARATRAIN_RDZV_ENDPOINT"
# The command-line flag behind each variable: errors name what the user typed.
_FLAG = {ENV_NNODES: "--nnodes", ENV_NODE_RANK: "--node-rank", ENV_RDZV_ENDPOINT: "--rdzv-endpoint"}

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def in_torchrun() -> bool:
    """True when torchrun (or any launcher) already set RANK, WORLD_SIZE and MASTER_ADDR."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def _int_env(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError([(_FLAG[name], f"must be an integer (got {raw!r})")]) from None


def check_nodes(nnodes: int | None, node_rank: int | None, endpoint: str | None) -> None:
    """Check ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint``; a ConfigError names the flag."""
    n = 1 if nnodes is None else nnodes
    if n < 1:
        raise ConfigError([("--nnodes", f"must be >= 1 (got {n})")])
    if n > 1 and not endpoint:
        raise ConfigError([("--rdzv-endpoint", "required with more than one node (HOST:PORT)")])
    if node_rank is not None and not 0 <= node_rank < n:
        raise ConfigError([("--node-rank", f"must be in [0, {n}) with --nnodes {n} (got {node_rank})")])
    if endpoint:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError([("--rdzv-endpoint", f"expected HOST:PORT with a port in 1..65535 (got {endpoint!r})")])


def launch_config(job: JobConfig, *, nprocs: int) -> Any:
    """The :class:`LaunchConfig` for ``job`` on this node (from the PARATRAIN_* variables):
    each of the ``PARATRAIN_NNODES`` nodes runs ``nprocs / nnodes`` of the job's processes."""
    from torch.distributed.launcher.api import LaunchConfig

    if nprocs < 1:
        raise ConfigError([("nprocs", f"need at least one worker process (got {nprocs})")])
    nnodes = _int_env(ENV_NNODES, 1) or 1
    node_rank = _int_env(ENV_NODE_RANK, None)
    endpoint = os.environ.get(ENV_RDZV_ENDPOINT, "")
    check_nodes(nnodes, node_rank, endpoint)
    if nprocs % nnodes:
        raise ConfigError([(
            "--nnodes",
            f"the job needs {nprocs} worker processes, which {nnodes} nodes cannot share evenly",
        )])

    rdzv_configs: dict[str, Any] = {"timeout": int(job.comm.timeout_s)}
    local_addr: str | None = None
    if nnodes == 1 and not endpoint:
        # Port 0: the rendezvous store binds a port the kernel picks, atomically (what
        # torchrun --standalone does). A port picked beforehand (bind, close, bind
        # again) can be taken by any other socket in between.
        endpoint = "127.0.0.1:0"
        backend = "c10d"
        local_addr = "127.0.0.1"
        rdzv_configs["is_host"] = True
    elif node_rank is not None:
        # torchrun's --node-rank semantics: the static rendezvous fixes node ranks and
        # the endpoint is the master's address.
        backend = "static"
        rdzv_configs["rank"] = node_rank
    else:
        backend = "c10d"
        if nnodes > 1:
            host, _, port = endpoint.rpartition(":")
            local_addr, is_host = rendezvous_host(host, int(port))
            if is_host:
                rdzv_configs["is_host"] = True
    run_id = os.environ.get("PARATRAIN_RUN_ID") or f"{job.run.name}-{uuid.uuid4().hex[:8]}"
    if nnodes > 1:
        # Every node must agree on the run id; derive it from the job, not a random value.
        run_id = os.environ.get("PARATRAIN_RUN_ID") or f"paratrain-{job.run.name}"
    return LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nprocs // nnodes,
                        run_id=run_id, rdzv_backend=backend, rdzv_endpoint=endpoint,
                        rdzv_configs=rdzv_configs, max_restarts=job.run.max_restarts,
                        monitor_interval=0.1, start_method="forkserver", local_addr=local_addr)
