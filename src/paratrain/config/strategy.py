"""TrainingStrategy and every type it references, in the JSON shapes of DESIGN §3: tagged by
``"type"``, the aggregations, selections and PBT steps by ``"method"``, CommunicationProtocol
by ``"protocol"``; RemoteTarget is externally tagged (``{"WorkerId": "w0"}`` / ``{"Tag": ...}``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, JsonValue, model_validator

from ._base import Codec, Contract, Fraction, NonNegFloat, PositiveCount
from .federated_aggregation import FederatedAggregation

DECENTRALIZED_TOPOLOGIES = ("ring", "torus", "complete")


class AllReduce(Contract):
    method: Literal["AllReduce"] = "AllReduce"


class ParameterServer(Contract):
    method: Literal["ParameterServer"] = "ParameterServer"


class Decentralized(Contract):
    method: Literal["Decentralized"] = "Decentralized"
    topology: str
    """Gossip neighbours: ``ring``, ``torus`` or ``complete``."""

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


class WorkerIdTarget(Contract):
    """``{"WorkerId": "<id>"}``: exactly the worker with this id."""

    WorkerId: str
    """Id of the worker (a ``[[workers]]`` id, or ``worker-<rank>``)."""


class TagTarget(Contract):
    """``{"Tag": "<tag>"}``: the first worker (by rank) carrying this tag."""

    Tag: str
    """A tag; the first worker (by rank) carrying it is the target."""


RemoteTarget = WorkerIdTarget | TagTarget


class Partition(Contract):
    node_ids: list[str]
    """Ids of the model graph's nodes placed on the target worker."""
    target: RemoteTarget
    """The worker they run on: ``{WorkerId = ...}`` or ``{Tag = ...}``."""

    @model_validator(mode="before")
    @classmethod
    def _one_target(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target" in data:
            t = data["target"]
            if isinstance(t, dict) and sum(k in t for k in ("WorkerId", "Tag")) != 1:
                raise ValueError(
                    f"target must be exactly one of {{'WorkerId': ...}} or {{'Tag': ...}} (got {t!r})"
                )
        return data


def _no_pipeline_fields(data: Any) -> Any:
    """``schedule`` / ``virtual_stages`` under Direct or DataStore: refused, not ignored."""
    if isinstance(data, dict):
        extra = [k for k in ("schedule", "virtual_stages") if k in data]
        if extra:
            raise ValueError(
                f"{' and '.join(extra)} {'is' if len(extra) == 1 else 'are'} for protocol = "
                f"\"Pipeline\" (micro-batches on a schedule); protocol "
                f"{data.get('protocol')!r} runs each batch once through the workers in order: "
                f"use protocol = \"Pipeline\" with a micro_batch_size, or drop {extra[0]}")
    return data


class DataStore(Contract):
    protocol: Literal["DataStore"] = "DataStore"
    path: str | None = None
    """Extension: directory shared by the stages; None = <run dir>/datastore."""
    _extensions: ClassVar[frozenset[str]] = frozenset({"path"})
    _pipeline_only = model_validator(mode="before")(staticmethod(_no_pipeline_fields))


class Direct(Contract):
    protocol: Literal["Direct"] = "Direct"
    _pipeline_only = model_validator(mode="before")(staticmethod(_no_pipeline_fields))


class Pipeline(Contract):
    protocol: Literal["Pipeline"] = "Pipeline"
    micro_batch_size: PositiveCount
    """Examples per micro-batch flowing through the pipeline."""
    schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "ZBH1"] = "1F1B"
    """Extension: pipeline schedule: ``1F1B`` (PipeDream-Flush), ``GPipe``,
    ``Interleaved1F1B`` (each worker runs ``virtual_stages`` non-adjacent chunks: the
    partitions give ``virtual_stages x workers`` parts, placed round-robin) or ``ZBH1``
    (zero-bubble H1: the backward split into input and weight gradients)."""
    virtual_stages: PositiveCount | None = None
    """Extension (``Interleaved1F1B`` only): chunks per worker; None = as the partitions place
    them (parts / workers). Given, the placement must make exactly that many."""
    _extensions: ClassVar[frozenset[str]] = frozenset({"schedule", "virtual_stages"})

    @model_validator(mode="after")
    def _virtual_needs_interleaved(self) -> Pipeline:
        if self.virtual_stages is not None and self.schedule != "Interleaved1F1B":
            raise ValueError(
                f"virtual_stages ({self.virtual_stages}) is for schedule = \"Interleaved1F1B\" "
                f"(each worker runs several chunks); schedule {self.schedule!r} runs one part per "
                f"worker: drop virtual_stages or set schedule = \"Interleaved1F1B\"")
        return self


CommunicationProtocol = Annotated[DataStore | Direct | Pipeline, Field(discriminator="protocol")]


class AllClients(Contract):
    method: Literal["All"] = "All"


class RandomClients(Contract):
    method: Literal["Random"] = "Random"
    fraction: Fraction
    """Fraction of the clients drawn each round, in (0, 1]."""


class ByCapability(Contract):
    method: Literal["ByCapability"] = "ByCapability"
    required_tags: list[str]
    """Clients selected each round are those whose tags include all of these."""


ClientSelection = Annotated[
    AllClients | RandomClients | ByCapability, Field(discriminator="method")
]


class Truncation(Contract):
    method: Literal["Truncation"] = "Truncation"
    fraction: Fraction
    """Rank by the metric; the bottom fraction (at least one member, at most half) copies members
    drawn from the top fraction."""


class Binary(Contract):
    method: Literal["Binary"] = "Binary"
    threshold: NonNegFloat = 0.0
    """Each member draws another and copies it when the other's score is higher by more than this
    (the 0.6 form without a threshold means 0.0)."""
    _extensions: ClassVar[frozenset[str]] = frozenset({"threshold"})


ExploitStrategy = Annotated[Truncation | Binary, Field(discriminator="method")]


class Perturbation(Contract):
    method: Literal["Perturbation"] = "Perturbation"
    factor: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]
    """Copied numeric hyperparameters are multiplied by a factor drawn from [1 - factor, 1 + factor)
    and clamped to their range; choices move to a neighbour. In [0, 1)."""


class Resample(Contract):
    method: Literal["Resample"] = "Resample"


ExploreStrategy = Annotated[Perturbation | Resample, Field(discriminator="method")]


class Local(Contract):
    """All nodes run in this process (the default)."""

    type: Literal["Local"] = "Local"


class DataParallel(Contract):
    """``num_replicas`` processes, one data shard each; gradients combined per step."""

    type: Literal["DataParallel"] = "DataParallel"
    num_replicas: PositiveCount
    """Processes, one model replica and one data shard each."""
    aggregation: GradientAggregation
    """How gradients are combined every step: AllReduce, ParameterServer or Decentralized."""
    broadcast_buffers: Annotated[bool, Field(strict=True)] = True
    """Extension (torch DDP's ``broadcast_buffers``): before each step's first forward the
    replicas' buffers (BatchNorm running statistics, ...) become the first replica's, so they
    stay one model; Decentralized replicas keep their own. false = each keeps its own."""
    shard: Literal["none", "optimizer", "gradients", "parameters"] = "none"
    """Extension (ZeRO, Rajbhandari et al. 2020; AllReduce only): what each replica keeps only
    its 1/N shard of. ``none``: nothing (DDP); ``optimizer`` (ZeRO-1): the optimizer state;
    ``gradients`` (ZeRO-2): also the gradients; ``parameters`` (ZeRO-3): also the parameters,
    all-gathered per ``shard_unit`` for its forward and backward. Parameters equal unsharded
    AllReduce's."""
    shard_unit: list[str] | None = None
    """Extension (``shard = "gradients"`` or ``"parameters"``): the modules reduce-scattered
    (and, for ``parameters``, gathered) as one unit, as torch FSDP2's ``fully_shard`` per
    block: module-path globs (``"blocks.*"``) or class names (``"Block"``); default: each direct
    child of the model. Parameters of no unit (or of several) form the root unit."""

    _extensions: ClassVar[frozenset[str]] = frozenset({"broadcast_buffers", "shard", "shard_unit"})


class ModelParallel(Contract):
    """Nodes placed on workers by partition; activations move by ``communication``."""

    type: Literal["ModelParallel"] = "ModelParallel"
    partitions: list[Partition]
    """Which graph nodes run on which worker."""
    communication: CommunicationProtocol
    """How activations move between stages: DataStore, Direct or Pipeline."""


class Federated(Contract):
    type: Literal["Federated"] = "Federated"
    num_clients: PositiveCount
    """Logical clients the training set is split into (spread over the worker processes)."""
    rounds: PositiveCount
    """Communication rounds: selected clients train locally, the server aggregates."""
    aggregation: FederatedAggregation
    """How the server combines client updates (FedAvg, FedProx, FedYogi, ...)."""
    client_selection: ClientSelection
    """Which clients train each round: All, Random or ByCapability."""


class PopulationBased(Contract):
    type: Literal["PopulationBased"] = "PopulationBased"
    population_size: PositiveCount
    """Members trained in parallel, each with its own hyperparameters."""
    generations: PositiveCount
    """Rounds of training followed by exploit and explore."""
    exploit: ExploitStrategy
    """How a weak member copies a strong one: Truncation or Binary."""
    explore: ExploreStrategy
    """How copied hyperparameters change: Perturbation or Resample."""


class Custom(Contract):
    """A registered coordinator ``fn(job, config[, *, resume])``: it receives the whole
    job, so every other section is its to use."""

    type: Literal["Custom"] = "Custom"
    coordinator: str
    """Name of a registered coordinator (``@register_coordinator``), e.g. from a ``run.imports``
    module."""
    config: JsonValue
    """Any JSON value, passed to the coordinator as a plain copy."""


TrainingStrategy = Annotated[
    Local | DataParallel | ModelParallel | Federated | PopulationBased | Custom,
    Field(discriminator="type"),
]

_CODEC = Codec(TrainingStrategy)
load_strategy = _CODEC.load  # a TrainingStrategy from JSON text or a dict
dump_strategy = _CODEC.dump
strategy_schema = _CODEC.schema
