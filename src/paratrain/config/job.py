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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._base import (
    ConfigError,
    Count,
    PositiveCount,
    describe_tags,
    format_validation_error,
    register_tags,
)
from .compression import CompressionStrategy
from .strategy import Local, TrainingStrategy
from .tensor_parallel import TensorParallelismConfig

__all__ = [
    "RunConfig", "ModelSpec", "PartitionSpec", "DataSpec", "TaskSpec", "OptimizerSpec", "TrainConfig",
    "WorkerSpec", "CommConfig", "FederatedOptions", "PopulationOptions", "UniformDim",
    "LogUniformDim", "IntDim", "ChoiceDim", "SearchDim", "JobConfig", "load_job",
    "parse_job_text", "job_schema",
]


class _Section(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=describe_tags
    )


class _OpenSection(BaseModel):
    """A section whose unknown keys are kwargs for a user's factory."""

    model_config = ConfigDict(
        frozen=True, extra="allow", use_attribute_docstrings=True, json_schema_extra=describe_tags
    )

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(_Section):
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
    checkpoint_every: Count = 0
    """Checkpoint every N optimizer steps (Local, DataParallel); 0 = once per epoch."""
    imports: list[str] = []
    """Modules or .py files (relative to the job file) imported before the run and in every worker,
    e.g. to register Custom coordinators or factories."""
    allow_oversubscribe: bool = False
    """A job may start at most 4 worker processes per CPU core (paratrain.preflight); true lifts
    that limit (e.g. processes that mostly wait on I/O or another machine)."""

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, v: str) -> str:
        """The run folder is ``output_dir/name``: ``name`` is one path component, so the
        folder can never lie outside ``output_dir``."""
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v:
            raise ValueError("must be one folder name inside run.output_dir (no '/', '\\', "
                             f"'..', not empty; got {v!r})")
        return v


def _name_or_factory(section: str, data: Any) -> Any:
    """A given ``factory`` means the default ``name`` is not set (TOML has no null)."""
    if isinstance(data, dict) and data.get("factory") is not None and "name" not in data:
        return {**data, "name": None}
    return data


def _one_of_name_factory(section: str, name: str | None, factory: str | None) -> None:
    if name is not None and factory is not None:
        raise ValueError(f"set exactly one of {section}.name or {section}.factory, not both "
                         f"(got name = {name!r}, factory = {factory!r})")
    if name is None and factory is None:
        raise ValueError(f"set one of {section}.name (a built-in) or {section}.factory "
                         "('module:function')")


class ModelSpec(_OpenSection):
    """A zoo ``name`` (default ``"mlp"``) or a user ``factory``; a factory replaces the
    default name."""

    name: str | None = "mlp"
    """A model of the zoo: ``mlp``, ``cnn``, ``transformer`` or ``gpt`` (the section's other keys
    are its arguments)."""
    factory: str | None = None
    """A user model instead of a zoo name: ``"module:function"`` returning an nn.Module (the
    section's other keys are its kwargs)."""

    @model_validator(mode="before")
    @classmethod
    def _factory_drops_default_name(cls, data: Any) -> Any:
        return _name_or_factory("model", data)

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSpec:
        _one_of_name_factory("model", self.name, self.factory)
        return self


class PartitionSpec(_Section):
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


class DataSpec(_OpenSection):
    """A built-in dataset ``name`` (default ``"digits"``) or a user ``factory``; a
    factory replaces the default name."""

    name: str | None = "digits"
    """A built-in dataset: ``digits``, ``diabetes`` (regression) or the ``shakespeare`` corpus."""
    factory: str | None = None
    """A user dataset instead of a built-in name: ``"module:function"`` (the section's other keys
    are its kwargs)."""
    test_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    """Fraction of the examples held out as the test set, in (0, 1)."""
    partition: PartitionSpec = PartitionSpec()
    """The federated clients' split of the training set: iid, shards, dirichlet or speaker."""

    @model_validator(mode="before")
    @classmethod
    def _factory_drops_default_name(cls, data: Any) -> Any:
        return _name_or_factory("data", data)

    @model_validator(mode="after")
    def _exactly_one(self) -> DataSpec:
        _one_of_name_factory("data", self.name, self.factory)
        return self


class TaskSpec(_OpenSection):
    """What is trained (``paratrain.task``): a built-in task ``name`` (default
    ``"classification"``) or a user ``factory`` (``"module:function"`` returning a
    :class:`paratrain.Task`; the section's extra keys are its kwargs). A factory replaces
    the default name; built-in tasks take no extra keys."""

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

    @model_validator(mode="before")
    @classmethod
    def _factory_drops_default_name(cls, data: Any) -> Any:
        return _name_or_factory("task", data)

    @model_validator(mode="after")
    def _exactly_one(self) -> TaskSpec:
        _one_of_name_factory("task", self.name, self.factory)
        if self.factory is None and self.model_extra:
            key = sorted(self.model_extra)[0]
            raise ValueError(f"unknown key task.{key}: built-in tasks take name, block_size, "
                             "stride (extra keys are kwargs for a task.factory only)")
        return self


class OptimizerSpec(_OpenSection):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    """The optimizer: ``sgd``, ``adam`` or ``adamw`` (the table's other keys, e.g. momentum or
    weight_decay, are its arguments)."""
    lr: Annotated[float, Field(gt=0.0)] = 0.1
    """Learning rate (the peak one under a ``train.lr_schedule``)."""
    weight_decay: Annotated[float, Field(ge=0.0)] | None = None
    """L2 penalty (``sgd``, ``adam``) or decoupled weight decay (``adamw``), passed to the torch
    optimizer; None = the optimizer's default (0 for sgd/adam, 0.01 for adamw)."""


class TrainConfig(_Section):
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
    ``cosine`` (half a cosine down to 0) or ``linear`` (a straight line down to 0), as a torch
    ``LambdaLR`` stepped once per optimizer step. Under Federated it runs over *rounds*: every
    client trains round ``r`` at ``lr * f(r)`` with ``T = strategy.rounds`` (constant within the
    round); its position is part of the server checkpoint."""
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


class WorkerSpec(_Section):
    id: str
    """The worker's id (unique), e.g. the target of a ModelParallel partition ``{WorkerId = ...}``.
    """
    tags: list[str] = []
    """Capabilities of the worker (e.g. ``gpu``), matched by ``{Tag = ...}`` targets and
    ByCapability client selection."""


class CommConfig(_Section):
    bucket_size_mb: Annotated[float, Field(gt=0.0)] = 25.0
    """AllReduce gradient bucket size in MiB (as torch DDP's bucket_cap_mb)."""
    timeout_s: Annotated[float, Field(gt=0.0)] = 300.0
    """Timeout in seconds of the process group's collectives, store and rendezvous."""
    gossip_step: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Decentralized with compression (CHOCO-gossip): consensus step size gamma in (0, 1]; None =
    1.0 without compression, 0.5 with it."""


class FederatedOptions(_Section):
    local_epochs: PositiveCount = 1
    """Epochs each selected client trains on its data per round."""
    batch_size: PositiveCount | None = 10
    """Client batch size; None = the client's whole dataset as one batch (FedSGD when local_epochs =
    1)."""
    client_tags: dict[str, list[str]] = {}
    """Tags per client id (``"client-3" = ["gpu"]``); clients also inherit their worker's tags."""
    target_accuracy: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Stop once the global model reaches this test accuracy; None = run every round."""


class PopulationOptions(_Section):
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
    """Keep the member checkpoints of only the newest N generations; None = all."""

    @model_validator(mode="after")
    def _one_budget(self) -> PopulationOptions:
        if self.steps_per_generation is not None and self.epochs_per_generation is not None:
            raise ValueError("set steps_per_generation or epochs_per_generation, not both")
        return self


class UniformDim(_Section):
    type: Literal["uniform"] = "uniform"
    low: float
    """Lower bound of the range."""
    high: float
    """Upper bound of the range (greater than low)."""

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
    """Smallest integer drawn."""
    high: Annotated[int, Field(strict=True)]
    """Upper bound of the integers drawn (greater than low)."""

    @model_validator(mode="after")
    def _order(self) -> IntDim:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        return self


class ChoiceDim(_Section):
    type: Literal["choice"] = "choice"
    values: Annotated[list[Any], Field(min_length=1)]
    """The values to choose from (at least one)."""


SearchDim = Annotated[
    UniformDim | LogUniformDim | IntDim | ChoiceDim, Field(discriminator="type")
]
register_tags(["uniform", "log_uniform", "int", "choice"])


class JobConfig(_Section):
    run: RunConfig = RunConfig()
    """Run name, seed, output folder, restarts, device and backend."""
    model: ModelSpec = ModelSpec()
    """The model: a zoo name or a factory, with its arguments."""
    data: DataSpec = DataSpec()
    """The dataset: a built-in name or a factory, the test split and the federated partition."""
    train: TrainConfig = TrainConfig()
    """Epochs, batch size, optimizer, evaluation and step budget."""
    task: TaskSpec = TaskSpec()
    """What is trained: classification, regression, a language model, or a user task."""
    strategy: TrainingStrategy = Local()
    """How the training is spread: Local, DataParallel, ModelParallel, Federated, PopulationBased or
    Custom."""
    compression: CompressionStrategy | None = None
    """Compression of what replicas exchange (gradients, client updates); None = exact."""
    tensor_parallel: TensorParallelismConfig | None = None
    """Megatron-style tensor parallelism of the model's layers; None = off."""
    workers: list[WorkerSpec] = []
    """Worker ids and tags, by rank (default ``worker-<rank>``, no tags)."""
    comm: CommConfig = CommConfig()
    """Communication settings: gradient buckets, timeouts, gossip step."""
    federated: FederatedOptions = FederatedOptions()
    """Federated local training: epochs, batch size, client tags, target accuracy."""
    population: PopulationOptions = PopulationOptions()
    """PopulationBased budget per generation, the ranking metric and checkpoint retention."""
    search_space: dict[str, SearchDim] = {}
    """PopulationBased hyperparameters to search, by name (e.g. ``lr``), each a uniform,
    log_uniform, int or choice dimension."""

    @model_validator(mode="after")
    def _checks(self) -> JobConfig:
        ids = [w.id for w in self.workers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"workers: duplicate worker id(s) {dup}")
        # model/data: exactly one of name or factory is checked by ModelSpec/DataSpec
        return self

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# Hostile-input bounds (issue 13 item 6): a job file is small and shallow, so anything
# bigger or deeper is refused with one line before it can cost time or memory.
MAX_JOB_BYTES = 1 << 20  # 1 MiB
MAX_JOB_DEPTH = 64  # tables/arrays inside one another (a real job file needs < 10)


class _JobYamlError(yaml.YAMLError):
    """A YAML construct a job file may not use (aliases, absurd nesting)."""


class _JobYamlComposer(yaml.composer.Composer):
    """A YAML composer that refuses aliases (``*name``: the "billion laughs" bomb
    expands a few lines into 10^9 references) and nesting deeper than MAX_JOB_DEPTH,
    both while composing, before any Python object is built."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _JobYamlError(
                f"YAML aliases are not allowed in job files (*{event.anchor} at line "
                f"{event.start_mark.line + 1}); write the value out"
            )
        self._depth += 1
        try:
            if self._depth > MAX_JOB_DEPTH:
                mark = self.peek_event().start_mark
                raise _JobYamlError(f"nested deeper than {MAX_JOB_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


try:  # libyaml's event parser: about 5x faster than the pure-Python one on a 1 MiB file
    from yaml.cyaml import CParser as _CParser
except ImportError:  # pragma: no cover - PyYAML built without libyaml

    class _JobYamlLoader(_JobYamlComposer, yaml.SafeLoader):
        """``yaml.SafeLoader`` composed by :class:`_JobYamlComposer`."""

else:

    class _JobYamlLoader(  # type: ignore[no-redef]
        _JobYamlComposer, _CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver
    ):
        """``yaml.SafeLoader``'s constructor and resolver over libyaml's events,
        composed by :class:`_JobYamlComposer`."""

        def __init__(self, stream: str) -> None:
            _CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)


def _depth_problem(doc: Any) -> str | None:
    """A message when ``doc`` nests dicts/lists deeper than MAX_JOB_DEPTH (iterative:
    TOML dotted keys and Python callers can build deep documents without recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JOB_DEPTH:
            return f"document nested deeper than {MAX_JOB_DEPTH} levels"
        seen += 1
        if seen > 1_000_000:
            return "document has more than 1,000,000 values"
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)
    return None


def parse_job_text(text: str, fmt: str) -> dict[str, Any]:
    """Parse TOML/JSON/YAML text into a dict; raises ConfigError on syntax errors and on
    documents over MAX_JOB_BYTES, nested deeper than MAX_JOB_DEPTH or using YAML aliases."""
    if len(text) > MAX_JOB_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_JOB_BYTES:
        raise ConfigError([("<file>", f"job text is over the {MAX_JOB_BYTES // 1024} KiB limit "
                                      f"for job files ({len(text)} characters)")])
    try:
        if fmt == "toml":
            doc: Any = tomllib.loads(text)
        elif fmt == "json":
            doc = json.loads(text)
        elif fmt in ("yaml", "yml"):
            doc = yaml.load(text, Loader=_JobYamlLoader)  # noqa: S506 - a SafeLoader subclass
        else:
            raise ConfigError([("<file>", f"unknown job format {fmt!r}; valid: toml, json, yaml")])
    except yaml.MarkedYAMLError as e:  # "while <context>" / "<problem>" on separate lines
        what = "; ".join(str(x) for x in (e.context, e.problem) if x)
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ConfigError([("<file>", _first_line(f"cannot parse {fmt}: {what}{where}"))]) from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError([("<file>", _first_line(f"cannot parse {fmt}: {e}"))]) from None
    except RecursionError:
        raise ConfigError([("<file>", f"cannot parse {fmt}: document nested too deeply")]) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # e.g. bad numbers
        raise ConfigError([("<file>", _first_line(f"cannot parse {fmt}: {e}"))]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError([("<root>", f"a job file must be a table/mapping (got {type(doc).__name__})")])
    problem = _depth_problem(doc)
    if problem is not None:
        raise ConfigError([("<file>", problem)])
    return doc


def _first_line(msg: str, limit: int = 300) -> str:
    line = (msg.splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def load_job(source: str | Path | dict[str, Any]) -> JobConfig:
    """Load and validate a job from a path (.toml/.json/.yaml/.yml) or a dict.

    Files over MAX_JOB_BYTES are refused from their size (stat) before being read."""
    if isinstance(source, dict):
        doc = source
        problem = _depth_problem(doc)
        if problem is not None:
            raise ConfigError([("<root>", problem)])
    else:
        path = Path(source)
        fmt = path.suffix.lstrip(".").lower()
        try:
            size = path.stat().st_size
            if size > MAX_JOB_BYTES:
                raise ConfigError([("<file>", f"{path} is {size / 2**20:.1f} MiB; job files are "
                                              f"limited to {MAX_JOB_BYTES // 1024} KiB")])
            with path.open("rb") as f:  # read at most one byte past the limit (it may grow)
                raw = f.read(MAX_JOB_BYTES + 1)
            text = raw.decode("utf-8")
        except FileNotFoundError:
            raise ConfigError([("<file>", f"job file not found: {path}")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([("<file>", _first_line(f"cannot read {path}: {e}"))]) from None
        doc = parse_job_text(text, fmt)
    try:
        return JobConfig.model_validate(doc)
    except ValidationError as e:
        err = e
    except RecursionError:
        raise ConfigError([("<root>", "document nested too deeply")]) from None
    try:
        raised = format_validation_error(err)
    except RecursionError:
        raise ConfigError([("<root>", "document nested too deeply")]) from None
    raise raised from None


def job_schema() -> dict[str, Any]:
    return JobConfig.model_json_schema()
