"""What the server, every node and every local worker build from the job (model, data,
partitions, per-client splits, personal keys): the same function of ``(job, seed)`` on every
process, so both runtimes train the same clients identically. No Flower import here."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ....config import ConfigError
from ....config.job import JobConfig, load_job
from ....data.partition import client_datasets, partition_dataset
from ....models.state import unique_state_dict
from ....subgraphs import local_state_keys
from ....task import resolve_task
from ....training import seed_everything
from ..client import ClientHost
from ..drift import uses_control


@dataclass
class Side:
    """One process's view of the job (the server's with ``host=None``)."""

    job: JobConfig
    task: Any
    model: nn.Module
    train_set: Any
    test_set: Any
    partitions: list[Any]
    splits: list[Any]
    personal_keys: list[str]
    template: dict[str, Tensor]  # the server's model: every unique tensor but the personal ones
    host: ClientHost | None = None

    @property
    def per_client(self) -> bool:
        """Clients are scored on their own test splits (personal parts or evaluate_clients)."""
        return bool(self.personal_keys) or bool(self.job.federated.evaluate_clients)


def job_from_json(text: str) -> JobConfig:
    """The job the server sent (its ``to_json_dict``), validated again on this node."""
    return load_job(json.loads(text))


def stateful(job: JobConfig, personal_keys: list[str]) -> bool:
    """Clients carry state between rounds (personal parts, error-feedback residuals, SCAFFOLD's
    control variates)."""
    comp = job.compression is not None and getattr(job.compression, "method", "None") != "None"
    return bool(personal_keys) or uses_control(getattr(job.strategy, "aggregation", None)) or comp


def build_side(job: JobConfig, *, partition: int | None = None, num_partitions: int = 1,
               device: torch.device | None = None) -> Side:
    """Build the job's model and data; with ``partition`` also the :class:`ClientHost` of the
    clients ``c % num_partitions == partition``."""
    strat: Any = job.strategy
    if getattr(strat, "type", None) != "Federated":
        raise ConfigError([("strategy.type", f"the Flower app runs Federated jobs, not {getattr(strat, 'type', None)!r}")])
    dev = device or torch.device("cpu")
    seed = job.run.seed
    seed_everything(seed)
    task = resolve_task(job)
    train_set, test_set = task.datasets(seed)
    model = task.build_model(job.model, train_set)
    model.to(dev)
    personal_keys = list(local_state_keys(model, job))
    splits: list[Any] = []
    try:
        parts = partition_dataset(train_set, strat.num_clients, job.data.partition, seed=seed)
        if personal_keys or job.federated.evaluate_clients or job.data.partition.feature_shift > 0:
            train_set, test_set, splits = client_datasets(train_set, test_set, parts, job.data.partition,
                                                          seed=seed)
    except ValueError as e:
        raise ConfigError([("data.partition", str(e))]) from None
    template = {k: v.detach().cpu().clone() for k, v in unique_state_dict(model).items()
                if k not in personal_keys}
    host = None
    if partition is not None:
        host = ClientHost(job, rank=int(partition), world_size=int(num_partitions), model=model, task=task,
                          dataset=train_set, partitions=parts, device=dev, personal_keys=personal_keys)
    return Side(job, task, model, train_set, test_set, parts, splits, personal_keys, template, host)


def tensor_blob(obj: Any) -> bytes:
    """``torch.save`` bytes of a (nested) dict of tensors (node state, control variates)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_blob(data: bytes) -> Any:
    """The inverse of :func:`tensor_blob`; weights only (nothing else is unpickled)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
