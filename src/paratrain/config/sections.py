"""The sections of a job file, each a frozen pydantic model whose field docstrings are the
schema's descriptions. Unknown keys are refused, except in ``[model]``, ``[data]``, ``[task]``
and ``[train.optimizer]``, which pass them through as kwargs."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ._base import Count, OpenSection, PositiveCount, Section, parse_every, register_tags
from .flower import FlowerOptions
from .privacy import FederatedDP

# run.loggers: each name is also the module it imports and the paratrain extra that installs it
LOGGERS = ("tensorboard", "mlflow", "wandb")


class RunConfig(Section):
    name: str = "run"
    """The run's name: its folder is ``output_dir/name`` (one folder name, no '/')."""
    seed: Annotated[int, Field(ge=0, lt=2**32, strict=True)] = 0
    """Seed of every random generator (Python, NumPy, torch); below 2**32, as NumPy and scikit-learn
    take 32-bit seeds."""
    output_dir: str = "runs"
    """Folder that holds the run folders (relative paths are relative to the working directory)."""
    max_restarts: Count = 0
    """How many times the elastic agent restarts the worker processes after one fails; each restart
    resumes from the last complete checkpoint."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` (CUDA when available, one GPU per local rank), ``cpu`` or ``cuda``.
    """
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: ``auto`` (NCCL on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""
    num_workers: PositiveCount | None = None
    """Worker processes for strategies whose process count is free (Federated, PopulationBased);
    None = the strategy's default."""
    checkpoint_every: Count | str = 0
    """Checkpoint every N optimizer steps, or every span of wall time given as a string
    (``"90s"``, ``"10m"``, ``"1h"``); 0 = once per epoch. A run also checkpoints at its end
    and when SIGINT/SIGTERM stops it."""
    imports: list[str] = []
    """Modules or .py files (relative to the job file) imported before the run and in every worker,
    e.g. to register Custom coordinators or factories."""
    allow_oversubscribe: bool = False
    """A job may start at most 4 worker processes per CPU core (paratrain.preflight); true lifts
    that limit (e.g. processes that mostly wait on I/O or another machine)."""
    num_threads: PositiveCount | None = None
    """torch intra-op threads of each training process; None = ``OMP_NUM_THREADS`` when set,
    else the host's cores shared among its training processes. Set it for sums, and so
    parameters, that are bit-identical from machine to machine."""
    progress_every: Count | str = "30s"
    """Progress when stderr is not a terminal (CI, a notebook, a log file): a line every span
    of wall time (``"30s"``, ``"5m"``) or every N optimizer steps (rounds under Federated,
    generations under PopulationBased) with the position, loss, steps/s and ETA; ``0`` or
    ``"off"`` prints none (and no progress bar on a terminal either)."""
    log_every: Count = 0
    """The training curve: a record every N optimizer steps (``"kind": "train"`` in
    metrics.jsonl and the ``loggers``: mean loss, learning rate, steps/s, samples/s, step time,
    memory); 0 = about 100 over a run. Federated and PopulationBased log per round and per
    generation instead."""
    loggers: list[str] = []
    """Experiment trackers written beside metrics.jsonl by the process that logs it, each
    through its own library: ``"tensorboard"`` (``<run>/tensorboard``), ``"mlflow"`` (a
    local file store, ``<run>/mlruns``), ``"wandb"`` (offline, ``<run>/wandb``); nothing is
    sent over a network. Install their extras: ``pip install 'paratrain[tensorboard]'`` etc."""

    @field_validator("loggers")
    @classmethod
    def _known_installed_loggers(cls, v: list[str]) -> list[str]:
        """Each logger known, listed once, and its library installed (else the extra)."""
        for i, name in enumerate(v):
            if name not in LOGGERS:
                raise ValueError(f"unknown logger {name!r}; the loggers are "
                                 f"{', '.join(repr(n) for n in LOGGERS)}")
            if name in v[:i]:
                raise ValueError(f"logger {name!r} is listed twice")
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"logger {name!r} needs the {name} library, which is not "
                                 f"installed: pip install 'paratrain[{name}]'")
        return v

    @field_validator("checkpoint_every")
    @classmethod
    def _steps_or_duration(cls, v: int | str) -> int | str:
        parse_every(v)  # ValueError names the accepted forms
        return v

    @field_validator("progress_every")
    @classmethod
    def _steps_duration_or_off(cls, v: int | str) -> int | str:
        if v != "off":
            try:
                parse_every(v)
            except ValueError as e:
                raise ValueError(f"{e} (or 'off')") from None
        return v

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, v: str) -> str:
        """The run folder is ``output_dir/name``: ``name`` is one path component, so the
        folder can never lie outside ``output_dir``."""
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError("must be one folder name inside run.output_dir (no '/', '\\', "
                             f"'..', not empty; got {v!r})")
        return v


class _NameOrFactory(OpenSection):
    """A built-in ``name`` or a user ``factory``, exactly one; a given ``factory`` replaces
    the default name (TOML has no null)."""

    _section: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _factory_drops_default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("factory") is not None and "name" not in data:
            return {**data, "name": None}
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> Any:
        section, name, factory = self._section, self.__dict__["name"], self.__dict__["factory"]
        if name is not None and factory is not None:
            raise ValueError(f"set exactly one of {section}.name or {section}.factory, not both "
                             f"(got name = {name!r}, factory = {factory!r})")
        if name is None and factory is None:
            raise ValueError(f"set one of {section}.name (a built-in) or {section}.factory "
                             "('module:function')")
        return self


class ModelSpec(_NameOrFactory):
    """A zoo ``name`` (default ``"mlp"``) or a user ``factory``; a factory replaces the
    default name."""

    name: str | None = "mlp"
    """A model of the zoo: ``mlp``, ``cnn``, ``transformer`` or ``gpt`` (the section's other keys
    are its arguments)."""
    factory: str | None = None
    """A user model instead of a zoo name: ``"module:function"`` returning an nn.Module (the
    section's other keys are its kwargs)."""
    leaf_modules: list[str] = []
    """Module paths (``named_modules()`` names) torch.fx traces as one node instead of
    tracing into their forward: for a module whose forward fx cannot trace (control flow on
    a tensor's value). ModelParallel places a leaf whole."""

    _section: ClassVar[str] = "model"


class PartitionSpec(Section):
    """How federated clients split the training set."""

    method: Literal["iid", "shards", "dirichlet", "speaker"] = "iid"
    """How the training set is split into clients: ``iid``, ``shards`` (sorted by label, dealt in
    shards), ``dirichlet`` (label mix per client drawn from Dirichlet(alpha)) or ``speaker`` (one
    client per speaking role of a corpus with a speaker per example, e.g. shakespeare; LEAF's
    natural non-IID split)."""
    shards_per_client: PositiveCount = 2
    """``shards``: label-sorted shards each client receives."""
    alpha: Annotated[float, Field(gt=0.0)] = 0.5
    """``dirichlet``: concentration; smaller is more skewed (non-IID), larger approaches IID."""
    min_size: Count = 10
    """``dirichlet``: each client ends with at least this many examples (moved one at a time from
    the largest client); min_size x clients > examples is an error."""
    feature_shift: Annotated[float, Field(ge=0.0, le=5.0, allow_inf_nan=False)] = 0.0
    """Feature-shift non-IID (FedBN's setting): client c's inputs (training and test) become
    s_c * x + o_c with ln s_c and o_c drawn from U(-a, a), a = feature_shift; 0 = no shift."""


class DataSpec(_NameOrFactory):
    """A built-in dataset ``name`` (default ``"digits"``) or a user ``factory``; a
    factory replaces the default name."""

    name: str | None = "digits"
    """A built-in dataset: ``digits``, ``diabetes`` (regression), the ``shakespeare`` corpus or
    ``tokens`` (a flat binary file of token ids, paratrain.data.tokens; both for
    ``task.name = "language_model"``)."""
    factory: str | None = None
    """A user dataset instead of a built-in name: ``"module:function"`` (the section's other keys
    are its kwargs)."""
    test_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    """Fraction of the examples held out as the test set, in (0, 1)."""
    partition: PartitionSpec = PartitionSpec()
    """The federated clients' split of the training set: iid, shards, dirichlet or speaker."""
    num_workers: Annotated[int, Field(ge=0, le=64, strict=True)] = 0
    """Loader processes that gather the training batches (torch's DataLoader workers); 0 = in
    the training process. The order, and so the result for a deterministic dataset, is the
    same for every value: a worker reseeds torch, random and numpy per batch from (run.seed,
    epoch, batch, replica). Federated and PopulationBased gather their batches in process."""
    pin_memory: bool = False
    """Copy batches to the GPU through pinned (page-locked) memory; only with run.device on
    CUDA (ignored on CPU)."""
    prefetch_factor: Annotated[int, Field(ge=1, le=64, strict=True)] | None = None
    """Batches each loader worker prepares ahead; None = torch's 2. Needs num_workers > 0."""

    _section: ClassVar[str] = "data"

    @model_validator(mode="after")
    def _prefetch_needs_workers(self) -> DataSpec:
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("data.prefetch_factor needs data.num_workers > 0 (the training "
                             "process gathers its batches itself)")
        return self


class TaskSpec(_NameOrFactory):
    """What is trained: a built-in task ``name`` (default ``"classification"``) or a user
    ``factory``, which replaces the default name; built-in tasks take no extra keys."""

    name: Literal["classification", "regression", "language_model"] | None = "classification"
    """A built-in task: ``classification``, ``regression`` or ``language_model``."""
    factory: str | None = None
    """A user task instead of a built-in name: ``"module:function"`` returning a paratrain.Task (the
    section's other keys are its kwargs)."""
    block_size: PositiveCount = 128
    """``language_model``: tokens per example (the context length)."""
    stride: PositiveCount | None = None
    """``language_model``: offset between the starts of consecutive examples; None = block_size
    (non-overlapping windows)."""

    _section: ClassVar[str] = "task"

    @model_validator(mode="after")
    def _builtin_takes_no_kwargs(self) -> TaskSpec:
        if self.factory is None and self.model_extra:
            key = sorted(self.model_extra)[0]
            raise ValueError(f"unknown key task.{key}: built-in tasks take name, block_size, "
                             "stride (extra keys are kwargs for a task.factory only)")
        return self


class OptimizerSpec(OpenSection):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    """The optimizer: ``sgd``, ``adam`` or ``adamw`` (the table's other keys, e.g. momentum or
    weight_decay, are its arguments)."""
    lr: Annotated[float, Field(gt=0.0)] = 0.1
    """Learning rate (the peak one under a ``train.lr_schedule``)."""
    weight_decay: Annotated[float, Field(ge=0.0)] | None = None
    """L2 penalty (``sgd``, ``adam``) or decoupled weight decay (``adamw``), passed to the torch
    optimizer; None = the optimizer's default (0 for sgd/adam, 0.01 for adamw)."""


class TrainConfig(Section):
    epochs: Count = 10
    """Passes over the training set."""
    batch_size: PositiveCount = 32
    """Examples per optimizer step in each process (each DataParallel replica takes its own batch of
    this size)."""
    optimizer: OptimizerSpec = OptimizerSpec()
    """The optimizer and its arguments."""
    eval_every: Count = 0
    """Evaluate every N optimizer steps; 0 = at the end of every epoch."""
    max_steps: PositiveCount | None = None
    """Stop after this many optimizer steps; None = run all epochs."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """The learning rate over the run's optimizer steps (after ``warmup_steps``): ``constant``,
    ``cosine`` (half a cosine down to 0) or ``linear`` (a straight line down to 0). Under
    Federated it runs over rounds: every client trains round ``r`` at ``lr * f(r)`` with ``T =
    strategy.rounds``."""
    warmup_steps: Count = 0
    """Optimizer steps of linear warm-up from lr/warmup_steps up to lr, before the schedule (under
    Federated: rounds of warm-up)."""
    grad_clip_norm: Annotated[float, Field(gt=0.0)] | None = None
    """Clip the global L2 norm of the gradients to this (``torch.nn.utils.clip_grad_norm_``; under
    tensor or model parallelism the norm is over the whole model); None = no clipping."""
    grad_accumulation: PositiveCount = 1
    """Batches (of ``batch_size`` each) whose gradients are summed, weighted by their sizes, into
    one optimizer step: a step sees ``batch_size * grad_accumulation`` examples per process."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16`` runs forward and loss under ``torch.autocast(dtype=torch.bfloat16)`` (on CPU
    too); parameters, gradients and optimizer state stay fp32."""


class WorkerSpec(Section):
    id: str
    """The worker's id (unique), e.g. the target of a ModelParallel partition ``{WorkerId = ...}``.
    """
    tags: list[str] = []
    """Capabilities of the worker (e.g. ``gpu``), matched by ``{Tag = ...}`` targets and
    ByCapability client selection."""


class CommConfig(Section):
    bucket_size_mb: Annotated[float, Field(gt=0.0)] = 25.0
    """AllReduce gradient bucket size in MiB (as torch DDP's bucket_cap_mb)."""
    timeout_s: Annotated[float, Field(gt=0.0)] = 300.0
    """Timeout in seconds of the process group's collectives, store and rendezvous."""
    gossip_step: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Decentralized with compression (CHOCO-gossip): consensus step size gamma in (0, 1]; None =
    1.0 without compression, 0.5 with it."""


class FaultTolerance(Section):
    """Per-step fault tolerance of DataParallel on torchft (docs/data-parallel.md): the
    ``strategy.num_replicas`` processes form ``G = num_replicas / processes_per_group``
    replica groups; step ``k``'s gradient is averaged over the groups in its quorum ``Q_k``,
    ``g_k = (1/|Q_k|) sum_{h in Q_k} g_h``, ``g_h`` the mean of group ``h``'s processes. A
    group of several processes shards by ZeRO (``strategy.shard``) among its processes: its
    process ``i`` holds rows ``i`` of ``processes_per_group``, and averages them with process
    ``i`` of the other groups (HSDP). A group that dies (any of its processes) is restarted
    alone, whole, and each of its processes heals from the same process of a live group."""

    min_replicas: PositiveCount = 1
    """Replica groups a step needs: a quorum waits for at least this many (at most the
    ``strategy.num_replicas / processes_per_group`` groups), and a step with fewer is not
    committed."""
    quorum_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 60.0
    """How long a group waits for a quorum of ``min_replicas`` before the run fails."""
    join_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    """How long the Lighthouse paratrain starts waits for the other groups once the
    membership changed (``lighthouse = "start"`` only; another Lighthouse has its own)."""
    heartbeat_timeout_s: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 5.0
    """A group silent this long is dropped from the next quorum (``lighthouse = "start"``
    only)."""
    lighthouse: str = "start"
    """``"start"``: paratrain runs a torchft Lighthouse on 127.0.0.1 for the run and stops it
    at the end; else the ``host:port`` of a running one."""
    listen: str | None = None
    """``lighthouse = "start"`` only: the ``host:port`` of this machine the Lighthouse listens
    on, reached from the other hosts, whose jobs name it as their ``lighthouse`` (groups on
    several hosts); None: 127.0.0.1 and a free port (this host's groups only)."""
    groups: PositiveCount | None = None
    """Replica groups ``paratrain run`` starts (``0 .. groups - 1``; None = every one of the
    ``strategy.num_replicas / processes_per_group``); the others can join the running job later
    (``paratrain run job.toml --join-group G``)."""
    processes_per_group: PositiveCount = 1
    """Processes in each replica group (``strategy.num_replicas`` must be a multiple): 1 =
    one whole replica per group; more = the group shards among its processes by
    ``strategy.shard`` (ZeRO ``optimizer``, ``gradients`` or ``parameters``, required then),
    and the groups replicate each other (torchft's HSDP layout)."""
    replay: bool = False
    """Train the batches of the groups missing from a step again on the survivors, so that
    every step averages all ``num_replicas`` shards (as a run without the failure); false:
    torchft's semantics, a step averages the shards of the groups alive for it."""

    @field_validator("lighthouse", "listen")
    @classmethod
    def _start_or_address(cls, v: str | None, info: Any) -> str | None:
        host, sep, port = (v or "").rpartition(":")
        if v is not None and (v != "start" or info.field_name != "lighthouse") and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            start = '"start" or ' if info.field_name == "lighthouse" else ""
            raise ValueError(f"must be {start}a host:port address (got {v!r})")
        return v


class FederatedOptions(Section):
    local_epochs: PositiveCount = 1
    """Epochs each selected client trains on its data per round."""
    batch_size: PositiveCount | None = 10
    """Client batch size; None = the client's whole dataset as one batch (FedSGD when local_epochs =
    1)."""
    client_tags: dict[str, list[str]] = {}
    """Tags per client id (``"client-3" = ["gpu"]``); clients also inherit their worker's tags."""
    target_accuracy: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Stop once the global model reaches this test accuracy; None = run every round."""
    evaluate_clients: bool = False
    """Also score every client on its own test split (which follows its training partition):
    ``personal_test_<metric>`` is the mean over clients. Always on with Local subgraphs, whose
    clients are scored with their personal parts (FedPer / FedBN)."""
    dp: FederatedDP | None = None
    """Client-level differential privacy (DP-FedAvg): clip, noise, accounting; None = off."""
    runtime: Literal["local", "flower"] = "local"
    """Where the rounds run: ``local`` = worker processes of one torch.distributed job
    (``paratrain run``); ``flower`` = Flower's Deployment Runtime (a SuperLink and one
    SuperNode per site, started with ``flwr run``; ``paratrain run`` refuses it)."""
    flower: FlowerOptions | None = None
    """Timeouts and node counts of the Flower runtime (``runtime = "flower"`` only)."""

    @model_validator(mode="after")
    def _flower_only(self) -> FederatedOptions:
        if self.flower is not None and self.runtime != "flower":
            raise ValueError('[federated.flower] is read only with runtime = "flower" '
                             f"(runtime is {self.runtime!r})")
        return self


class PopulationOptions(Section):
    steps_per_generation: PositiveCount | None = None
    """Optimizer steps each member trains per generation (set this or epochs_per_generation)."""
    epochs_per_generation: PositiveCount | None = None
    """Epochs each member trains per generation (set this or steps_per_generation)."""
    metric: str | None = None
    """The metric members are ranked by: a metric of the task (e.g. ``accuracy``, ``loss``,
    ``mse``) or ``train_loss``; None = the task's fitness metric (classification
    ``accuracy``, regression ``mse``, language model ``loss``)."""
    mode: Literal["max", "min"] | None = None
    """Whether a larger (``max``) or smaller (``min``) metric is better; None = the task's
    fitness mode."""
    evolve: bool = True
    """False = random search: the same population and budget without exploit/explore."""
    keep_generations: PositiveCount | None = None
    """Keep the member files (gen-*/member-*.pt) of only the newest N generations; None = all. Resume
    never needs them: the checkpoint holds every member."""

    @model_validator(mode="after")
    def _one_budget(self) -> PopulationOptions:
        if self.steps_per_generation is not None and self.epochs_per_generation is not None:
            raise ValueError("set steps_per_generation or epochs_per_generation, not both")
        return self


# [search_space]: the hyperparameters PopulationBased (and random search) draws, one
# dimension per name, tagged by "type".
class _Range(Section):
    @model_validator(mode="after")
    def _order(self) -> Any:
        low, high = getattr(self, "low"), getattr(self, "high")  # noqa: B009 - the subclass's fields
        if not low < high:
            raise ValueError(f"low ({low}) must be < high ({high})")
        return self


class UniformDim(_Range):
    type: Literal["uniform"] = "uniform"
    low: float
    """Lower bound of the range."""
    high: float
    """Upper bound of the range (greater than low)."""


class LogUniformDim(UniformDim):
    type: Literal["log_uniform"] = "log_uniform"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _positive(self) -> LogUniformDim:
        if self.low <= 0:
            raise ValueError(f"log_uniform needs low > 0 (got {self.low})")
        return self


class IntDim(_Range):
    type: Literal["int"] = "int"
    low: Annotated[int, Field(strict=True)]
    """Smallest integer drawn."""
    high: Annotated[int, Field(strict=True)]
    """Upper bound of the integers drawn (greater than low)."""


class ChoiceDim(Section):
    type: Literal["choice"] = "choice"
    values: Annotated[list[Any], Field(min_length=1)]
    """The values to choose from (at least one)."""


SearchDim = Annotated[
    UniformDim | LogUniformDim | IntDim | ChoiceDim, Field(discriminator="type")
]
register_tags(["uniform", "log_uniform", "int", "choice"])
