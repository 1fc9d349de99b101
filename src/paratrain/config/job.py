"""JobConfig: one validated job file (TOML, JSON or YAML), DESIGN §5.

Job sections reject unknown keys (a misspelled option should not be silently ignored);
``[model]``, ``[data]`` and ``[train.optimizer]`` pass extra keys through as kwargs.
The embedded ``[strategy]``, ``[compression]`` and ``[tensor_parallel]`` tables are the
contract shapes and follow its serde-like rules.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ._base import ConfigError, Count, PositiveCount, format_validation_error, register_tags
from .compression import CompressionStrategy
from .strategy import Local, TrainingStrategy
from .tensor_parallel import TensorParallelismConfig

__all__ = [
    "RunConfig", "ModelSpec", "PartitionSpec", "DataSpec", "OptimizerSpec", "TrainConfig",
    "WorkerSpec", "CommConfig", "FederatedOptions", "PopulationOptions", "UniformDim",
    "LogUniformDim", "IntDim", "ChoiceDim", "SearchDim", "JobConfig", "load_job",
    "parse_job_text", "job_schema",
]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _OpenSection(BaseModel):
    """A section whose unknown keys are kwargs for a user's factory."""

    model_config = ConfigDict(frozen=True, extra="allow")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(_Section):
    name: str = "run"
    seed: Count = 0
    output_dir: str = "runs"
    max_restarts: Count = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Worker processes for strategies whose process count is free (Federated, PBT).
    num_workers: PositiveCount | None = None
    # Checkpoint every N optimizer steps (Local/DataParallel); 0 = once per epoch.
    checkpoint_every: Count = 0
    # Modules or .py files (relative to the job file) imported before the run, e.g. to
    # register Custom coordinators or factories.
    imports: list[str] = []


class ModelSpec(_OpenSection):
    name: str | None = "mlp"
    factory: str | None = None


class PartitionSpec(_Section):
    """How federated clients split the training set."""

    method: Literal["iid", "shards", "dirichlet"] = "iid"
    shards_per_client: PositiveCount = 2
    alpha: Annotated[float, Field(gt=0.0)] = 0.5
    min_size: Count = 10


class DataSpec(_OpenSection):
    name: str | None = "digits"
    factory: str | None = None
    test_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    partition: PartitionSpec = PartitionSpec()


class OptimizerSpec(_OpenSection):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: Annotated[float, Field(gt=0.0)] = 0.1


class TrainConfig(_Section):
    epochs: Count = 10
    batch_size: PositiveCount = 32
    optimizer: OptimizerSpec = OptimizerSpec()
    # Evaluate every N optimizer steps; 0 = at the end of every epoch.
    eval_every: Count = 0
    # Stop after this many optimizer steps (None = run all epochs).
    max_steps: PositiveCount | None = None


class WorkerSpec(_Section):
    id: str
    tags: list[str] = []


class CommConfig(_Section):
    bucket_size_mb: Annotated[float, Field(gt=0.0)] = 25.0
    timeout_s: Annotated[float, Field(gt=0.0)] = 300.0
    # Decentralized with compression (CHOCO-gossip) consensus step size gamma in (0, 1];
    # None = 1.0 without compression, 0.5 with it.
    gossip_step: Annotated[float, Field(gt=0.0, le=1.0)] | None = None


class FederatedOptions(_Section):
    local_epochs: PositiveCount = 1
    # None = full client dataset as one batch (FedSGD when local_epochs = 1).
    batch_size: PositiveCount | None = 10
    # Tags per client id (``"client-3" = ["gpu"]``); clients also inherit their worker's tags.
    client_tags: dict[str, list[str]] = {}
    # Client indices whose local training raises (fault injection for tests and demos).
    fail_clients: list[int] = []
    # Extensions (federated helper). Clients whose update is multiplied by
    # ``byzantine_scale`` (robust-aggregation studies, e.g. -10 = "sign-flipped x10").
    byzantine_clients: list[int] = []
    byzantine_scale: float = -10.0
    # Clients that send an update with a wrong shape (the server must reject it).
    corrupt_clients: list[int] = []
    # Stop once the global model reaches this test accuracy (None = run every round).
    target_accuracy: Annotated[float, Field(gt=0.0, le=1.0)] | None = None


class PopulationOptions(_Section):
    steps_per_generation: PositiveCount | None = None
    epochs_per_generation: PositiveCount | None = None
    metric: str = "accuracy"
    mode: Literal["max", "min"] = "max"
    # False = random search: the same population and budget without exploit/explore.
    evolve: bool = True
    # Member indices whose training raises (fault injection for tests and demos).
    fail_members: list[Annotated[int, Field(ge=0, strict=True)]] = []
    # Keep the member checkpoints of only the newest N generations (None = all).
    keep_generations: PositiveCount | None = None

    @model_validator(mode="after")
    def _one_budget(self) -> PopulationOptions:
        if self.steps_per_generation is not None and self.epochs_per_generation is not None:
            raise ValueError("set steps_per_generation or epochs_per_generation, not both")
        return self


class UniformDim(_Section):
    type: Literal["uniform"] = "uniform"
    low: float
    high: float

    @model_validator(mode="after")
    def _order(self) -> UniformDim:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        return self


class LogUniformDim(UniformDim):
    type: Literal["log_uniform"] = "log_uniform"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _positive(self) -> LogUniformDim:
        if self.low <= 0:
            raise ValueError(f"log_uniform needs low > 0 (got {self.low})")
        return self


class IntDim(_Section):
    type: Literal["int"] = "int"
    low: Annotated[int, Field(strict=True)]
    high: Annotated[int, Field(strict=True)]

    @model_validator(mode="after")
    def _order(self) -> IntDim:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        return self


class ChoiceDim(_Section):
    type: Literal["choice"] = "choice"
    values: Annotated[list[Any], Field(min_length=1)]


SearchDim = Annotated[
    UniformDim | LogUniformDim | IntDim | ChoiceDim, Field(discriminator="type")
]
register_tags(["uniform", "log_uniform", "int", "choice"])


class JobConfig(_Section):
    run: RunConfig = RunConfig()
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainConfig = TrainConfig()
    strategy: TrainingStrategy = Local()
    compression: CompressionStrategy | None = None
    tensor_parallel: TensorParallelismConfig | None = None
    workers: list[WorkerSpec] = []
    comm: CommConfig = CommConfig()
    federated: FederatedOptions = FederatedOptions()
    population: PopulationOptions = PopulationOptions()
    search_space: dict[str, SearchDim] = {}

    @model_validator(mode="after")
    def _checks(self) -> JobConfig:
        ids = [w.id for w in self.workers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"workers: duplicate worker id(s) {dup}")
        if (self.model.name is None) == (self.model.factory is None):
            raise ValueError("model: set exactly one of name or factory")
        if (self.data.name is None) == (self.data.factory is None):
            raise ValueError("data: set exactly one of name or factory")
        return self

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_job_text(text: str, fmt: str) -> dict[str, Any]:
    """Parse TOML/JSON/YAML text into a dict; raises ConfigError on syntax errors."""
    try:
        if fmt == "toml":
            return tomllib.loads(text)
        if fmt == "json":
            doc = json.loads(text)
        elif fmt in ("yaml", "yml"):
            doc = yaml.safe_load(text)
        else:
            raise ConfigError([("<file>", f"unknown job format {fmt!r}; valid: toml, json, yaml")])
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError([("<file>", f"cannot parse {fmt}: {e}".splitlines()[0])]) from None
    except (RecursionError, ValueError) as e:  # e.g. absurd nesting, bad numbers
        raise ConfigError([("<file>", f"cannot parse {fmt}: {e}".splitlines()[0])]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError([("<root>", f"a job file must be a table/mapping (got {type(doc).__name__})")])
    return doc


def load_job(source: str | Path | dict[str, Any]) -> JobConfig:
    """Load and validate a job from a path (.toml/.json/.yaml/.yml) or a dict."""
    if isinstance(source, dict):
        doc = source
    else:
        path = Path(source)
        fmt = path.suffix.lstrip(".").lower()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError([("<file>", f"job file not found: {path}")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([("<file>", f"cannot read {path}: {e}")]) from None
        doc = parse_job_text(text, fmt)
    try:
        return JobConfig.model_validate(doc)
    except ValidationError as e:
        raise format_validation_error(e) from None
    except RecursionError:
        raise ConfigError([("<root>", "document nested too deeply")]) from None


def job_schema() -> dict[str, Any]:
    return JobConfig.model_json_schema()
