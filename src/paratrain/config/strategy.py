"""TrainingStrategy and every type it references, in the JSON shapes of DESIGN §3.

``TrainingStrategy`` is internally tagged by ``"type"``; GradientAggregation,
FederatedAggregation, ClientSelection, ExploitStrategy and ExploreStrategy by
``"method"``; CommunicationProtocol by ``"protocol"``; RemoteTarget is externally
tagged (``{"WorkerId": "w0"}`` / ``{"Tag": "gpu"}``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, JsonValue, TypeAdapter, model_validator

from ._base import (
    Contract,
    Count,
    Fraction,
    PositiveCount,
    load_document,
    register_tags,
)

__all__ = [
    "AllReduce", "ParameterServer", "Decentralized", "GradientAggregation",
    "WorkerIdTarget", "TagTarget", "RemoteTarget", "Partition",
    "DataStore", "Direct", "Pipeline", "CommunicationProtocol",
    "FedAvg", "FedProx", "FedYogi", "FedAdam", "FedAdagrad", "FedAvgM", "FedMedian",
    "FedTrimmedAvg", "Krum", "FederatedAggregation",
    "AllClients", "RandomClients", "ByCapability", "ClientSelection",
    "Truncation", "Binary", "ExploitStrategy", "Perturbation", "Resample",
    "ExploreStrategy",
    "Local", "DataParallel", "ModelParallel", "Federated", "PopulationBased", "Custom",
    "TrainingStrategy", "load_strategy", "dump_strategy", "strategy_schema",
    "DECENTRALIZED_TOPOLOGIES",
]

PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Decay = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]

# ---------------------------------------------------------------- GradientAggregation

DECENTRALIZED_TOPOLOGIES = ("ring", "torus", "complete")


class AllReduce(Contract):
    method: Literal["AllReduce"] = "AllReduce"


class ParameterServer(Contract):
    method: Literal["ParameterServer"] = "ParameterServer"


class Decentralized(Contract):
    method: Literal["Decentralized"] = "Decentralized"
    topology: str

    @model_validator(mode="after")
    def _known_topology(self) -> Decentralized:
        if self.topology not in DECENTRALIZED_TOPOLOGIES:
            raise ValueError(
                f"unknown topology {self.topology!r}; valid: {', '.join(DECENTRALIZED_TOPOLOGIES)}"
            )
        return self


GradientAggregation = Annotated[
    AllReduce | ParameterServer | Decentralized, Field(discriminator="method")
]

# ---------------------------------------------------------------------- RemoteTarget


class WorkerIdTarget(Contract):
    """``{"WorkerId": "<id>"}``: exactly the worker with this id."""

    WorkerId: str


class TagTarget(Contract):
    """``{"Tag": "<tag>"}``: the first worker (by rank) carrying this tag."""

    Tag: str


def _target_tag(v: Any) -> str | None:
    if isinstance(v, dict):
        keys = [k for k in ("WorkerId", "Tag") if k in v]
        if len(keys) == 1:
            return keys[0]
        return None
    if isinstance(v, WorkerIdTarget):
        return "WorkerId"
    if isinstance(v, TagTarget):
        return "Tag"
    return None


RemoteTarget = WorkerIdTarget | TagTarget


class Partition(Contract):
    node_ids: list[str]
    target: RemoteTarget

    @model_validator(mode="before")
    @classmethod
    def _one_target(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target" in data:
            t = data["target"]
            if isinstance(t, dict) and _target_tag(t) is None:
                raise ValueError(
                    f"target must be exactly one of {{'WorkerId': ...}} or {{'Tag': ...}} (got {t!r})"
                )
        return data


# ------------------------------------------------------------- CommunicationProtocol


class DataStore(Contract):
    protocol: Literal["DataStore"] = "DataStore"
    # Extension: directory shared by the stages; None = <run dir>/datastore.
    path: str | None = None
    _extensions: ClassVar[frozenset[str]] = frozenset({"path"})


class Direct(Contract):
    protocol: Literal["Direct"] = "Direct"


class Pipeline(Contract):
    protocol: Literal["Pipeline"] = "Pipeline"
    micro_batch_size: PositiveCount
    # Extension: pipeline schedule.
    schedule: Literal["1F1B", "GPipe"] = "1F1B"
    _extensions: ClassVar[frozenset[str]] = frozenset({"schedule"})


CommunicationProtocol = Annotated[DataStore | Direct | Pipeline, Field(discriminator="protocol")]

# -------------------------------------------------------------- FederatedAggregation


class FedAvg(Contract):
    method: Literal["FedAvg"] = "FedAvg"


class FedProx(Contract):
    method: Literal["FedProx"] = "FedProx"
    mu: NonNegFloat


class _ServerOpt(Contract):
    """Adaptive server optimizers of Reddi et al. 2021 (Adaptive Federated Optimization)."""

    # Extension: server learning rate (Flower's ``eta``).
    eta: PosFloat = 0.01
    _extensions: ClassVar[frozenset[str]] = frozenset({"eta"})


class FedYogi(_ServerOpt):
    method: Literal["FedYogi"] = "FedYogi"
    beta1: Decay
    beta2: Decay
    tau: PosFloat


class FedAdam(_ServerOpt):
    method: Literal["FedAdam"] = "FedAdam"
    beta1: Decay = 0.9
    beta2: Decay = 0.99
    tau: PosFloat = 1e-3


class FedAdagrad(_ServerOpt):
    method: Literal["FedAdagrad"] = "FedAdagrad"
    tau: PosFloat = 1e-9
    eta: PosFloat = 0.1


class FedAvgM(Contract):
    method: Literal["FedAvgM"] = "FedAvgM"
    server_momentum: Decay = 0.9
    server_lr: PosFloat = 1.0


class FedMedian(Contract):
    method: Literal["FedMedian"] = "FedMedian"


class FedTrimmedAvg(Contract):
    method: Literal["FedTrimmedAvg"] = "FedTrimmedAvg"
    beta: Annotated[float, Field(ge=0.0, lt=0.5, allow_inf_nan=False)] = 0.2


class Krum(Contract):
    """Krum (``to_keep = 0``) / Multi-Krum. With ``n`` clients per round the aggregator
    uses ``min(num_malicious, n - 3)`` and keeps ``min(to_keep, n)``; values outside that
    range are reported (with the effective ones) by ``paratrain validate``."""

    method: Literal["Krum"] = "Krum"
    num_malicious: Count = 0
    to_keep: Count = 0


FederatedAggregation = Annotated[
    FedAvg | FedProx | FedYogi | FedAdam | FedAdagrad | FedAvgM | FedMedian | FedTrimmedAvg | Krum,
    Field(discriminator="method"),
]

# ------------------------------------------------------------------- ClientSelection


class AllClients(Contract):
    method: Literal["All"] = "All"


class RandomClients(Contract):
    method: Literal["Random"] = "Random"
    fraction: Fraction


class ByCapability(Contract):
    method: Literal["ByCapability"] = "ByCapability"
    required_tags: list[str]


ClientSelection = Annotated[
    AllClients | RandomClients | ByCapability, Field(discriminator="method")
]

# ------------------------------------------------------------------ Exploit / Explore


class Truncation(Contract):
    method: Literal["Truncation"] = "Truncation"
    fraction: Fraction


class Binary(Contract):
    method: Literal["Binary"] = "Binary"
    # The 0.6 form ``{"method":"Binary"}`` has no threshold; it means 0.0.
    threshold: NonNegFloat = 0.0
    _extensions: ClassVar[frozenset[str]] = frozenset({"threshold"})


ExploitStrategy = Annotated[Truncation | Binary, Field(discriminator="method")]


class Perturbation(Contract):
    method: Literal["Perturbation"] = "Perturbation"
    factor: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]


class Resample(Contract):
    method: Literal["Resample"] = "Resample"


ExploreStrategy = Annotated[Perturbation | Resample, Field(discriminator="method")]

# ------------------------------------------------------------------ TrainingStrategy


class Local(Contract):
    """All nodes run in this process (the default)."""

    type: Literal["Local"] = "Local"


class DataParallel(Contract):
    """``num_replicas`` processes, one data shard each; gradients combined per step."""

    type: Literal["DataParallel"] = "DataParallel"
    num_replicas: PositiveCount
    aggregation: GradientAggregation


class ModelParallel(Contract):
    """Nodes placed on workers by partition; activations move by ``communication``."""

    type: Literal["ModelParallel"] = "ModelParallel"
    partitions: list[Partition]
    communication: CommunicationProtocol


class Federated(Contract):
    type: Literal["Federated"] = "Federated"
    num_clients: PositiveCount
    rounds: PositiveCount
    aggregation: FederatedAggregation
    client_selection: ClientSelection


class PopulationBased(Contract):
    type: Literal["PopulationBased"] = "PopulationBased"
    population_size: PositiveCount
    generations: PositiveCount
    exploit: ExploitStrategy
    explore: ExploreStrategy


class Custom(Contract):
    """A registered coordinator ``fn(job, config[, *, resume])``: it receives the whole
    job, so every other section is its to use."""

    type: Literal["Custom"] = "Custom"
    coordinator: str
    config: JsonValue


TrainingStrategy = Annotated[
    Local | DataParallel | ModelParallel | Federated | PopulationBased | Custom,
    Field(discriminator="type"),
]

register_tags(
    [
        "Local", "DataParallel", "ModelParallel", "Federated", "PopulationBased", "Custom",
        "AllReduce", "ParameterServer", "Decentralized", "DataStore", "Direct", "Pipeline",
        "FedAvg", "FedProx", "FedYogi", "FedAdam", "FedAdagrad", "FedAvgM", "FedMedian",
        "FedTrimmedAvg", "Krum", "All", "Random", "ByCapability", "Truncation", "Binary",
        "Perturbation", "Resample", "WorkerIdTarget", "TagTarget",
    ]
)

_ADAPTER: TypeAdapter[Any] = TypeAdapter(TrainingStrategy)


def load_strategy(doc: str | bytes | dict[str, Any] | Contract) -> Any:
    """Validate a TrainingStrategy from JSON text or a dict; raises ConfigError."""
    if isinstance(doc, Contract):
        return doc
    return load_document(_ADAPTER.validate_python, doc)


def dump_strategy(strategy: Any) -> dict[str, Any]:
    """The JSON-compatible dict of a TrainingStrategy (extensions only when set)."""
    out: dict[str, Any] = _ADAPTER.dump_python(strategy, mode="json")
    return out


def strategy_schema() -> dict[str, Any]:
    schema: dict[str, Any] = _ADAPTER.json_schema()
    return schema
