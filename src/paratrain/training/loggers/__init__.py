"""Experiment trackers beside ``metrics.jsonl`` (``run.loggers``): one fan-out
(:class:`Trackers`) and the TensorBoard, MLflow and W&B trackers. Curve keys
are ``train/<key>``, a PBT member's ``member_<m>/<key>``. A resumed run continues each
tracker run (ids in ``trackers.json``) and logs no step twice: TensorBoard purges after the
resume point; MLflow and W&B say the last step they hold and get only later ones.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ...files import write_json

STEP_KEYS = ("step", "round", "generation")  # a record's step, by strategy
_NOT_VALUES = frozenset({*STEP_KEYS, "kind", "member"})
STATE_FILE = "trackers.json"
EXPERIMENT = "paratrain"  # MLflow's experiment
_BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics) per call
_PARAM_CHARS = 6000  # MLflow's longest param value
PROJECT = "paratrain"  # W&B's project
_BLOCK = 32768  # the block size of W&B's offline log


class Tracker(Protocol):
    """One experiment tracker's run (TensorBoard, MLflow, W&B)."""

    def held_through(self) -> float | None:
        """The last step the tracker run holds from earlier sessions (None: it purges them itself)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def tracked_values(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """A metrics record's step and its numbers as a tracker names them (None: no step)."""
    key = next((k for k in STEP_KEYS if isinstance(record.get(k), int | float)), None)
    if key is None:
        return None
    prefix = "train/" if record.get("kind") == "train" else ""
    if "member" in record:
        prefix = f"member_{record['member']}/"
    out: dict[str, float] = {}
    for k, v in record.items():
        if k in _NOT_VALUES:
            continue
        name = k.removeprefix("train_") if prefix == "train/" else k
        # one level of a record's dicts (a PopulationBased member's hparams): <key>/<name>
        for sub, x in (v.items() if isinstance(v, dict) else [("", v)]):
            if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x)):
                out[prefix + name + (f"/{sub}" if sub else "")] = float(x)
    return int(record[key]), out


def flat_config(job: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """The job as ``section.field = value`` pairs (MLflow's params)."""
    for k, v in job.items():
        if isinstance(v, dict) and v:
            yield from flat_config(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", json.dumps(v) if not isinstance(v, str) else v


class TensorBoardTracker:
    """Scalars by step, the job as text; a resumed run's ``purge_step`` drops the events a
    killed run wrote after its checkpoint."""

    def __init__(self, run_dir: Path, job: dict[str, Any], resume_after: float | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_after is None else int(resume_after) + 1
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)
        if resume_after is None:
            self.writer.add_text("job", "```\n" + json.dumps(job, indent=2) + "\n```", global_step=0)

    def held_through(self) -> float | None:
        return None  # purge_step drops what a killed session wrote after the resume point

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a killed run keeps its curve up to the kill (purged on resume)

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run in the run folder's file store ``file:<run>/mlruns``, the job's fields
    its params; ``own`` (in ``trackers.json``) holds the id a resumed run continues."""

    def __init__(self, run_dir: Path, job: dict[str, Any], own: dict[str, Any]) -> None:
        # MLflow 3.x keeps the file store in maintenance mode behind this opt-out: it is the
        # store that needs nothing beyond mlflow-skinny and lives in the run folder
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(Path(run_dir) / "mlruns").resolve().as_uri())
        run_id = own.get("run_id")
        if run_id is None:
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(EXPERIMENT)
            run = self.client.create_run(exp_id, run_name=Path(run_dir).name)
            run_id = own["run_id"] = run.info.run_id
            params = [Param(k, v[:_PARAM_CHARS]) for k, v in flat_config(job)]
            for i in range(0, len(params), _BATCH):
                self.client.log_batch(run_id, params=params[i:i + _BATCH])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def held_through(self) -> float | None:
        """The last step of any metric the run holds (MLflow writes each point as it is logged)."""
        metrics = self.client.get_run(self.run_id).data.metrics
        steps = [m.step for key in metrics for m in self.client.get_metric_history(self.run_id, key)]
        return float(max(steps, default=-1))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf ``Record``s of an offline ``.wandb`` file (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of chunks with 7-byte headers: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (n == 0 and kind == 0) or pos + 7 + n > len(data):
            return
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf, no stubs
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def history_steps(path: Path) -> Iterator[int]:
    """The ``_step`` of every history row of an offline ``.wandb`` file."""
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            for item in rec.history.item:
                if (item.key or "/".join(item.nested_key)) == "_step":
                    yield int(json.loads(item.value_json))


class WandbTracker:
    """One offline W&B run (``wandb.init(mode="offline")`` files under ``<run>/wandb``: nothing
    goes over a network), named after the run; ``own`` (in ``trackers.json``) holds the id a
    resumed run continues."""

    def __init__(self, run_dir: Path, job: dict[str, Any], own: dict[str, Any]) -> None:
        os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        settings = wandb.Settings(silent=True, console="off", disable_git=True,
                                  x_disable_stats=True)
        self.run = wandb.init(project=PROJECT, dir=str(run_dir), mode="offline", id=own.get("id"),
                              resume="allow", name=Path(run_dir).name, config=job,
                              settings=settings, reinit="create_new")
        own["id"] = self.run.id  # W&B's own id for a fresh run
        self.root, self.session = Path(run_dir) / "wandb", Path(self.run.dir).parent

    def held_through(self) -> float | None:
        """The last step the run's earlier sessions' offline files hold."""
        files = self.root.glob(f"offline-run-*-{self.run.id}/run-{self.run.id}.wandb")
        return float(max((step for f in files if f.parent != self.session for step in history_steps(f)),
                         default=-1))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers of ``names`` for the run folder ``run_dir`` (``records``: its
    metrics.jsonl records), opened on the first record, closed by :meth:`close`;
    ``resume_after``: the run continues after that step of its tracker runs."""

    def __init__(self, run_dir: Path, names: list[str], records: Callable[[], list[dict[str, Any]]],
                 resume_after: float | None = None) -> None:
        self.run_dir, self.names, self.records = Path(run_dir), list(names), records
        self.resume_after = resume_after
        self._open: dict[str, Tracker] | None = None
        self._state: dict[str, Any] = {}
        self._floor: dict[str, float] = {}
        self._started = False

    def log(self, record: dict[str, Any]) -> None:
        got = tracked_values(record)
        if got is None or not got[1]:
            return
        step, values = got
        for name, tracker in self._trackers().items():
            if step > self._floor.get(name, -math.inf):
                tracker.log(step, values)

    def close(self) -> None:
        for tracker in (self._open or {}).values():
            tracker.close()
        self._open = None

    def _trackers(self) -> dict[str, Tracker]:
        if self._open is None:
            first = not self._started  # a later opening (after close) continues this session
            self._started = True
            if first:
                self._state = self._load_state()
            job = self._job()
            self._open = {name: self._start(name, job, self.resume_after if first else None)
                          for name in self.names}
            if first and self.resume_after is not None:
                self._catch_up(self.resume_after)
        return self._open

    def _catch_up(self, after: float) -> None:
        """A resumed session: a tracker run logs no step it holds again (``_floor``) and gets
        those up to the resume point it lacks from ``metrics.jsonl``."""
        records = None
        for name, tracker in (self._open or {}).items():
            held = tracker.held_through()
            if held is None:
                continue
            self._floor[name] = held
            if held < after:
                records = self.records() if records is None else records
                for rec in records:
                    got = tracked_values(rec)
                    if got is not None and got[1] and held < got[0] <= after:
                        tracker.log(*got)

    def _start(self, name: str, job: dict[str, Any], resume_after: float | None) -> Tracker:
        own = self._state.setdefault(name, {})
        if name == "tensorboard":
            return TensorBoardTracker(self.run_dir, job, resume_after)
        if name == "mlflow":
            tracker: Tracker = MLflowTracker(self.run_dir, job, own)
        else:
            tracker = WandbTracker(self.run_dir, job, own)
        self._save_state()  # the run id, before anything is logged to it
        return tracker

    def _job(self) -> dict[str, Any]:
        path = self.run_dir / "job.json"
        return dict(json.loads(path.read_text(encoding="utf-8"))) if path.exists() else {}

    def _load_state(self) -> dict[str, Any]:
        path = self.run_dir / STATE_FILE
        if self.resume_after is None or not path.exists():
            return {}
        return dict(json.loads(path.read_text(encoding="utf-8")))

    def _save_state(self) -> None:
        write_json(self.run_dir / STATE_FILE, self._state, indent=1)
