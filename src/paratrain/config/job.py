"""JobConfig: one validated job file (TOML, JSON or YAML), DESIGN §5. The sections are
:mod:`.sections` (re-exported here); ``[strategy]``, ``[compression]`` and ``[tensor_parallel]``
are the contract shapes and follow its serde-like rules."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from ._base import ConfigError, Section, format_validation_error, one_line
from .compression import CompressionStrategy
from .sections import (  # re-exported: the sections are part of this module's API
    ChoiceDim,
    CommConfig,
    DataSpec,
    FaultTolerance,
    FederatedOptions,
    IntDim,
    LogUniformDim,
    ModelSpec,
    OptimizerSpec,
    PartitionSpec,
    PopulationOptions,
    RunConfig,
    SearchDim,
    TaskSpec,
    TrainConfig,
    UniformDim,
    WorkerSpec,
)
from .strategy import Local, TrainingStrategy
from .tensor_parallel import TensorParallelismConfig

__all__ = [
    "RunConfig", "ModelSpec", "PartitionSpec", "DataSpec", "TaskSpec", "OptimizerSpec", "TrainConfig",
    "WorkerSpec", "CommConfig", "FaultTolerance", "FederatedOptions", "PopulationOptions", "UniformDim",
    "LogUniformDim", "IntDim", "ChoiceDim", "SearchDim", "JobConfig", "load_job",
    "parse_job_text", "job_schema",
]


class JobConfig(Section):
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
    fault_tolerance: FaultTolerance | None = None
    """DataParallel (AllReduce, or ZeRO within groups of several processes) on torchft:
    replica groups that die are dropped from a step and heal from a live peer, the others go
    on; None = off."""
    federated: FederatedOptions = FederatedOptions()
    """Federated local training: epochs, batch size, client tags, target accuracy."""
    population: PopulationOptions = PopulationOptions()
    """PopulationBased budget per generation, the ranking metric and checkpoint retention."""
    search_space: dict[str, SearchDim] = {}
    """PopulationBased hyperparameters to search, by name (e.g. ``lr``), each a uniform,
    log_uniform, int or choice dimension."""
    subgraphs: dict[str, TrainingStrategy] = {}
    """Strategies on subgraphs of the model, keyed by module path (a name of
    ``model.named_modules()``, e.g. ``head`` or ``encoder.norm``), a glob over those paths
    (``"layer*.bn*"``) or a module class (``"class:BatchNorm2d"``), each a table of the
    ``[strategy]`` shape. A module's effective strategy is its own, else its nearest ancestor's,
    else ``[strategy]``'s (paratrain.subgraphs lists the supported pairings, e.g. Local under
    Federated: FedPer / FedBN)."""

    @model_validator(mode="after")
    def _checks(self) -> JobConfig:
        ids = [w.id for w in self.workers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"workers: duplicate worker id(s) {dup}")
        comp, s = self.compression, self.strategy
        if getattr(comp, "method", None) == "PowerSGD":
            agg = getattr(getattr(s, "aggregation", None), "method", None)
            if s.type == "Federated" or (s.type == "DataParallel" and agg != "AllReduce"):
                where = f"{s.type}'s {agg}" if s.type == "DataParallel" else "Federated"
                raise ValueError(f"compression.method: PowerSGD runs inside an all-reduce "
                                 f"(DataParallel with aggregation AllReduce); {where} exchanges "
                                 "per-replica payloads, use TopK, RandomK, Threshold or Quantization")
        # model/data: exactly one of name or factory is checked by ModelSpec/DataSpec
        problem = _fault_tolerance_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _fault_tolerance_problem(job: JobConfig) -> str | None:
    """``[fault_tolerance]`` runs replica groups that exchange a plain gradient mean:
    DataParallel AllReduce only, whole replicas or, with ``processes_per_group`` > 1, ZeRO
    shards within each group (``field: message``, or None)."""
    ft, s = job.fault_tolerance, job.strategy
    if ft is None:
        return None
    agg = getattr(getattr(s, "aggregation", None), "method", None)
    tp = job.tensor_parallel is not None and job.tensor_parallel.tensor_parallel_size > 1
    why = (f"strategy.type is {s.type}" if s.type != "DataParallel" else
           f"strategy.aggregation is {agg}" if agg != "AllReduce" else
           "[compression] is set" if job.compression is not None and job.compression.method != "None" else
           "[tensor_parallel] is set" if tp else "[subgraphs] is set" if job.subgraphs else None)
    if why is not None:
        return (f"fault_tolerance: runs DataParallel with aggregation AllReduce only (replicas "
                f"or ZeRO-sharded replica groups, uncompressed, no subgraphs or tensor parallelism); {why}")
    return _group_problem(ft, int(getattr(s, "num_replicas", 1)), str(getattr(s, "shard", "none")))


def _group_problem(ft: FaultTolerance, n: int, shard: str) -> str | None:
    """The replica groups: ``n / processes_per_group`` of them, sharded (ZeRO) exactly when
    they have several processes; ``min_replicas`` and ``groups`` count groups."""
    k = ft.processes_per_group
    if n % k:
        return (f"fault_tolerance.processes_per_group: strategy.num_replicas = {n} processes do not "
                f"split into replica groups of {k}: num_replicas must be a multiple of it")
    if k > 1 and shard == "none":
        return (f"fault_tolerance.processes_per_group: a replica group of {k} processes shards "
                "among them by ZeRO: set strategy.shard (\"optimizer\", \"gradients\" or "
                "\"parameters\"), or keep processes_per_group = 1 (one whole replica per group)")
    if k == 1 and shard != "none":
        return (f"fault_tolerance.processes_per_group: strategy.shard = {shard!r} (ZeRO) shards "
                "within a replica group, and a group of 1 process has no one to shard with: set "
                "processes_per_group >= 2 (a divisor of strategy.num_replicas)")
    if k > 1 and ft.replay:
        return ("fault_tolerance.replay: not supported with processes_per_group > 1 (a group "
                "replaying a missing group's batches would need that group's shard layout too)")
    groups = n // k
    if ft.min_replicas > groups:
        return (f"fault_tolerance.min_replicas: {ft.min_replicas} is more than the "
                f"{groups} replica group(s) of strategy.num_replicas / processes_per_group: "
                "no quorum could form")
    if ft.groups is not None and not ft.min_replicas <= ft.groups <= groups:
        return (f"fault_tolerance.groups: {ft.groups} groups started must be at least min_replicas = "
                f"{ft.min_replicas} and at most strategy.num_replicas / processes_per_group = {groups}")
    return None


# Hostile-input bounds (issue 13 item 6): a job file is small and shallow, so anything
# bigger or deeper is refused with one line before it can cost time or memory.
MAX_JOB_BYTES = 1 << 20  # 1 MiB
MAX_JOB_DEPTH = 64  # tables/arrays inside one another (a real job file needs < 10)


class _JobYamlError(yaml.YAMLError):  # type: ignore[misc]  # PyYAML ships no types
    """A YAML construct a job file may not use (aliases, absurd nesting)."""


class _JobYamlComposer(yaml.composer.Composer):  # type: ignore[misc]
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

    class _JobYamlLoader(_JobYamlComposer, yaml.SafeLoader):  # type: ignore[misc]
        """``yaml.SafeLoader`` composed by :class:`_JobYamlComposer`."""

else:

    class _JobYamlLoader(_JobYamlComposer, _CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):  # type: ignore[no-redef,misc]  # noqa: E501
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
        raise ConfigError([("<file>", one_line(f"cannot parse {fmt}: {what}{where}"))]) from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError([("<file>", one_line(f"cannot parse {fmt}: {e}"))]) from None
    except RecursionError:
        raise ConfigError([("<file>", f"cannot parse {fmt}: document nested too deeply")]) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # e.g. bad numbers
        raise ConfigError([("<file>", one_line(f"cannot parse {fmt}: {e}"))]) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError([("<root>", f"a job file must be a table/mapping (got {type(doc).__name__})")])
    problem = _depth_problem(doc)
    if problem is not None:
        raise ConfigError([("<file>", problem)])
    return doc


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
            raise ConfigError([("<file>", one_line(f"cannot read {path}: {e}"))]) from None
        doc = parse_job_text(text, fmt)
    try:
        try:
            return JobConfig.model_validate(doc)
        except ValidationError as e:
            raise format_validation_error(e) from None
    except RecursionError:
        raise ConfigError([("<root>", "document nested too deeply")]) from None


def job_schema() -> dict[str, Any]:
    return JobConfig.model_json_schema()
