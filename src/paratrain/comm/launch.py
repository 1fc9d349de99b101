"""Start the worker processes of a job: torch's elastic launcher, or torchrun's environment.

``launch(job, nprocs=N)`` runs ``worker_entry`` in N processes through
:func:`torch.distributed.launcher.api.elastic_launch` (the engine inside ``torchrun``):
a c10d rendezvous on ``127.0.0.1`` at a free port, ``nproc_per_node=N``,
``max_restarts=job.run.max_restarts``, ``start_method="spawn"``. Every process joins
the default process group (gloo on CPU, NCCL on CUDA, or ``job.run.backend``), builds a
:class:`~paratrain.comm.context.WorkerContext` and calls the strategy's
``worker_main(ctx, job, resume)``. After a worker failure the elastic agent restarts the
whole group; ``TORCHELASTIC_RESTART_COUNT > 0`` makes every rank resume from its last
checkpoint.

Multi-node: ``PARATRAIN_NNODES``, ``PARATRAIN_NODE_RANK`` and ``PARATRAIN_RDZV_ENDPOINT``
(set by ``paratrain run --nnodes/--node-rank/--rdzv-endpoint``) configure the rendezvous
the way ``torchrun`` does: with a node rank the ``static`` backend (node rank fixed, the
endpoint is the master address), without one the ``c10d`` backend on the endpoint.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` already set) nothing is
launched: the entry runs in this process.

A worker's exception reaches the caller as :class:`WorkerError` carrying the root-cause
rank and message (a :class:`~paratrain.config.ConfigError` raised in a worker is
re-raised as a ``ConfigError`` with the same problems).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..config.job import JobConfig
from .testing import free_port

__all__ = [
    "WorkerError",
    "launch",
    "in_torchrun",
    "launch_config",
    "ENV_NNODES",
    "ENV_NODE_RANK",
    "ENV_RDZV_ENDPOINT",
]

ENV_NNODES = "PARATRAIN_NNODES"
ENV_NODE_RANK = "PARATRAIN_NODE_RANK"
ENV_RDZV_ENDPOINT = "PARATRAIN_RDZV_ENDPOINT"

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` and ``message`` name the root cause."""

    def __init__(self, rank: int, message: str, *, detail: str = "") -> None:
        self.rank = rank
        self.message = message
        self.detail = detail
        super().__init__(f"worker rank {rank} failed: {message}")


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
        raise ConfigError([(name, f"must be an integer (got {raw!r})")]) from None


def launch_config(job: JobConfig, *, nprocs: int) -> Any:
    """The :class:`LaunchConfig` for ``job`` on this node (reads the PARATRAIN_* env vars).

    ``nprocs`` is the whole job's process count; each of the ``PARATRAIN_NNODES`` nodes
    runs ``nprocs / nnodes`` of them.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    if nprocs < 1:
        raise ConfigError([("nprocs", f"need at least one worker process (got {nprocs})")])
    nnodes = _int_env(ENV_NNODES, 1) or 1
    node_rank = _int_env(ENV_NODE_RANK, None)
    endpoint = os.environ.get(ENV_RDZV_ENDPOINT, "")
    if nnodes < 1:
        raise ConfigError([(ENV_NNODES, f"must be >= 1 (got {nnodes})")])
    if nnodes > 1 and not endpoint:
        raise ConfigError([(ENV_RDZV_ENDPOINT, "required with more than one node (HOST:PORT)")])
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ConfigError([(ENV_NODE_RANK, f"must be in [0, {nnodes}) (got {node_rank})")])
    if nprocs % nnodes:
        raise ConfigError([(
            ENV_NNODES,
            f"the job needs {nprocs} worker processes, which {nnodes} nodes cannot share evenly",
        )])

    rdzv_configs: dict[str, Any] = {"timeout": int(job.comm.timeout_s)}
    local_addr: str | None = None
    if nnodes == 1 and not endpoint:
        endpoint = f"127.0.0.1:{free_port()}"
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
    run_id = os.environ.get("PARATRAIN_RUN_ID") or f"{job.run.name}-{uuid.uuid4().hex[:8]}"
    if nnodes > 1:
        # Every node must agree on the run id; derive it from the job, not a random value.
        run_id = os.environ.get("PARATRAIN_RUN_ID") or f"paratrain-{job.run.name}"
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs // nnodes,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=job.run.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(),
    )


_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset|DistBackendError|Broken pipe|"
    r"timed out|Signal \d+|SIGTERM|SignalException|To enable traceback",
    re.IGNORECASE,
)


def _message(data: Any) -> tuple[str, str, int]:
    """(message, traceback, timestamp) from an elastic error-file record."""
    msg = data.get("message", "") if isinstance(data, dict) else data
    tb = ""
    ts = int(data.get("timestamp", 0) or 0) if isinstance(data, dict) else 0
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        tb = str(extra.get("py_callstack", ""))
        ts = int(extra.get("timestamp", ts) or ts)
        msg = msg.get("message", "")
    return str(msg), tb, ts


def _root_cause(err: Any) -> tuple[int, str, str]:
    """(rank, message, traceback) of the failure most likely to be the cause.

    The agent reports the first process it saw exit, which is often a peer that died of
    "connection closed" after the real culprit; so every rank's error file of the failed
    attempt is read, and a failure that is not a secondary (transport/signal) error wins.
    """
    failures = dict(getattr(err, "failures", {}) or {})
    if not failures:
        return -1, str(err), ""
    candidates: list[tuple[int, int, int, str, str]] = []
    for rank, f in failures.items():
        msg, tb, ts = _message({"message": f.message, "timestamp": f.timestamp})
        candidates.append((1 if _SECONDARY.search(msg) else 0, ts, int(rank), msg, tb))
        error_file = getattr(f, "error_file", "")
        if error_file and os.path.isfile(error_file):
            # <log_dir>/attempt_k/<local_rank>/error.json: read the siblings too.
            attempt_dir = Path(error_file).parent.parent
            offset = int(rank) - int(f.local_rank)
            for other in attempt_dir.glob("*/error.json"):
                try:
                    local = int(other.parent.name)
                    data = json.loads(other.read_text())
                except (ValueError, OSError):
                    continue
                msg, tb, ts = _message(data)
                if msg:
                    candidates.append(
                        (1 if _SECONDARY.search(msg) else 0, ts, offset + local, msg, tb)
                    )
    _, _, rank, msg, tb = min(candidates, key=lambda c: (c[0], c[1], c[2]))
    return rank, msg, tb


def _reraise(err: Exception) -> None:
    rank, msg, tb = _root_cause(err)
    prefix = "ConfigError: "
    if msg.startswith(prefix):
        problems: list[tuple[str, str]] = []
        for line in msg[len(prefix):].splitlines():
            path, sep, text = line.partition(": ")
            problems.append((path, text) if sep else ("", line))
        raise ConfigError(problems) from err
    raise WorkerError(rank, msg, detail=tb) from err


def launch(
    job: JobConfig,
    *,
    nprocs: int,
    resume: bool = False,
    target: str | None = None,
    check_world_size: bool = True,
) -> Any:
    """Run ``job`` on ``nprocs`` worker processes in all; return global rank 0's result
    (``None`` on a node that does not host rank 0).

    ``target`` ("module:function") overrides the strategy's ``worker_main`` (tests, or an
    executor with several worker roles). Under torchrun the entry runs in this process and
    the returned value is this rank's result; ``check_world_size`` then requires
    ``WORLD_SIZE == nprocs`` (an error otherwise).
    """
    from .. import worker as _worker

    job_json = job.to_json_dict()
    if in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if check_world_size and world != nprocs:
            raise ConfigError(
                [
                    (
                        "strategy",
                        f"this job needs {nprocs} worker processes but torchrun started "
                        f"WORLD_SIZE={world}; set --nnodes x --nproc-per-node to {nprocs}",
                    )
                ]
            )
        return _worker.worker_entry(job_json, resume, target)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import elastic_launch

    own_port = not os.environ.get(ENV_RDZV_ENDPOINT)
    for attempt in range(3):
        config = launch_config(job, nprocs=nprocs)
        try:
            results = elastic_launch(config, _worker.worker_entry)(job_json, resume, target)
            break
        except ChildFailedError as e:
            _reraise(e)
            raise  # unreachable: _reraise always raises
        except RendezvousConnectionError:
            # The free port we picked was taken before the rendezvous store bound it
            # (another job on this machine): pick another one. Nothing has started yet.
            if not own_port or attempt == 2:
                raise
    if not results:
        return None
    return results.get(0)
