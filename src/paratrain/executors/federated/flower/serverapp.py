"""paratrain's Flower ServerApp (``paratrain.executors.federated.flower.serverapp:app``):
``@app.main()`` loads the job named by the run config (``flwr run APP FEDERATION --run-config
'job="/path/job.toml"'``, with ``resume``, ``overwrite`` and ``workdir``), which must say
``[federated] runtime = "flower"``, and drives :func:`.serverloop.run_server` over the Grid.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ....config import ConfigError
from ....config.flower import FlowerOptions
from ....config.job import JobConfig, load_job
from . import protocol as P

app = ServerApp()


def load_flower_job(path: str, workdir: str = "") -> JobConfig:
    """The job file at ``path`` (the federated checks of ``paratrain validate``), with a
    relative ``run.output_dir`` anchored at ``workdir`` (default: the job file's folder)."""
    from ..checks import check_job

    job_path = Path(path).expanduser().resolve()
    job = load_job(job_path)
    if getattr(job.strategy, "type", None) != "Federated" or job.federated.runtime != "flower":
        raise ConfigError([("federated.runtime", (
            f"{job_path} does not say [federated] runtime = \"flower\" (a Federated job run on Flower's "
            "deployment runtime); run it with `paratrain run` instead"))])
    out = Path(job.run.output_dir)
    if not out.is_absolute():
        base = Path(workdir).expanduser().resolve() if workdir else job_path.parent
        doc = job.to_json_dict()
        doc["run"]["output_dir"] = str(base / out)
        job = load_job(doc)
    check_job(job, world_size=1)
    return job


@app.main()
def main(grid: Grid, context: Context) -> None:
    from ....training.gcfreeze import first_imports

    with first_imports():
        from .federation import Federation
        from .serverloop import run_server

    cfg = context.run_config
    if not str(cfg.get(P.RUN_JOB, "")):
        raise ConfigError([("run_config.job", "flwr run ... --run-config 'job=\"/path/to/job.toml\"'")])
    job = load_flower_job(str(cfg[P.RUN_JOB]), str(cfg.get(P.RUN_WORKDIR, "")))
    opts = job.federated.flower or FlowerOptions()
    nodes = Federation(grid, json.dumps(job.to_json_dict()), opts)
    summary = run_server(nodes, job, resume=bool(cfg.get(P.RUN_RESUME, False)),
                         overwrite=bool(cfg.get(P.RUN_OVERWRITE, False)))
    print(json.dumps({k: summary[k] for k in ("run_dir", "rounds", "parameters_sha256")}), flush=True)
