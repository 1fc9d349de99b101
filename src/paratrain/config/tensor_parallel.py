"""TensorParallelismConfig with its three enums and the Rust ``Default`` values (missing keys
take the defaults: the Rust form requires all keys; lenient on purpose). ``plan`` (an extension)
maps module-path patterns to styles in the vocabulary of torch's ``parallelize_module`` and HF's
``base_model_tp_plan`` (:class:`PlanEntry`, applied by :mod:`paratrain.tensor_parallel.plan`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ._base import Codec, Contract, Count, PositiveCount, Section

# style -> (input layout, output layout) it implies; HF's names are aliases with fixed layouts
PLAN_STYLES: dict[str, tuple[str | None, str | None]] = {
    "colwise": ("replicate", "shard"),
    "rowwise": ("shard", "replicate"),
    "colwise_gather_output": ("replicate", "replicate"),
    "rowwise_split_input": ("replicate", "replicate"),
    "packed_colwise": ("replicate", "shard"),
    "replicate": (None, None),
    "sequence": ("sequence", "sequence"),
    "prepare_input": (None, None),
}
_NOT_YET = {"sequence_parallel", "embedding_rowwise", "embedding_colwise", "packed_rowwise",
            "replicated_with_grad_allreduce", "local_colwise", "local_rowwise", "gather", "local"}
_LAYOUT = Literal["replicate", "shard", "sequence"]
# style -> (input layouts, output layouts) it accepts
_LAYOUTS_ALLOWED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "colwise": (("replicate", "sequence"), ("shard", "replicate")),
    "rowwise": (("shard", "replicate"), ("replicate", "sequence")),
    "packed_colwise": (("replicate",), ("shard",)),
    "sequence": (("sequence", "replicate"), ("sequence", "replicate")),
}


class PlanEntry(Section):
    """One ``[tensor_parallel.plan]`` entry: a style and the layouts around the module.

    ``"colwise"`` (torch's ``ColwiseParallel``): a Linear / Conv1D keeps a block of output
    features, its output sharded (``output = "shard"``) or all-gathered (``"replicate"``).
    ``"rowwise"`` (``RowwiseParallel``): a block of input features, partial outputs summed; its
    input already sharded (``input = "shard"``) or split first (``"replicate"``).
    ``"packed_colwise"``: ``parts`` equal packed outputs (``[q | k | v]``), each cut colwise.
    ``"replicate"``: kept whole, nothing inside it sharded. The layout ``"sequence"`` is an
    activation split along dim 1 of ``[B, S, ...]`` (Korthikanti et al. 2022): the style
    ``"sequence"`` (torch's ``SequenceParallel``) runs the module on sequence shards, its
    parameters' gradients summed over the ranks; ``colwise`` takes ``input = "sequence"`` and
    ``rowwise`` ``output = "sequence"`` (reduce-scattered). ``"prepare_input"`` (torch's
    ``PrepareModuleInput``): the module's first tensor argument goes from ``input`` to
    ``desired_input``; its children keep their own entries."""

    style: str
    """colwise, rowwise, colwise_gather_output, rowwise_split_input, packed_colwise, replicate,
    sequence or prepare_input."""
    input: _LAYOUT | None = None
    """The layout the module receives: replicate (every rank the whole tensor), shard (the last
    dim split, as a colwise layer leaves it) or sequence (dim 1 split)."""
    output: _LAYOUT | None = None
    """The layout the module leaves: replicate, shard (the last dim split) or sequence."""
    desired_input: Literal["replicate", "sequence"] | None = None
    """prepare_input only: the layout the module's first tensor argument is turned into."""
    parts: int | None = Field(default=None, ge=2)
    """packed_colwise only: how many equal parts are packed along the output features."""

    @field_validator("style")
    @classmethod
    def _known_style(cls, v: str) -> str:
        if v in _NOT_YET:
            raise ValueError(f"style {v!r} is not supported by paratrain's plan yet; supported: "
                             f"{', '.join(PLAN_STYLES)}")
        if v not in PLAN_STYLES:
            raise ValueError(f"unknown style {v!r}; one of {', '.join(PLAN_STYLES)}")
        return v

    @model_validator(mode="after")
    def _layouts(self) -> PlanEntry:
        want_in, want_out = PLAN_STYLES[self.style]
        if self.style == "replicate" and (self.input or self.output or self.parts):
            raise ValueError("replicate takes no input, output or parts")
        if self.desired_input is not None and self.style != "prepare_input":
            raise ValueError("desired_input applies to prepare_input only")
        if self.style == "prepare_input":
            pair = (self.input, self.desired_input)
            if pair not in (("replicate", "sequence"), ("sequence", "replicate")) or self.output or self.parts:
                raise ValueError("prepare_input takes input and desired_input, one \"replicate\" and the "
                                 "other \"sequence\" (e.g. input = \"sequence\", desired_input = "
                                 "\"replicate\" before an attention block)")
        if self.style in _LAYOUTS_ALLOWED:
            for side, got in (("input", self.input), ("output", self.output)):
                allowed = _LAYOUTS_ALLOWED[self.style][side == "output"]
                if got is not None and got not in allowed:
                    raise ValueError(f"{self.style} takes {side} = " + " or ".join(f'"{a}"' for a in allowed))
        if self.style in ("colwise_gather_output", "rowwise_split_input") and (
                (self.input or want_in) != want_in or (self.output or want_out) != want_out):
            raise ValueError(f"{self.style} has fixed layouts (input = {want_in!r}, output = {want_out!r})")
        if self.style == "packed_colwise":
            if self.parts is None:
                raise ValueError("packed_colwise needs parts (e.g. 3 for a packed q|k|v, 2 for gate|up)")
            if self.output == "replicate":
                raise ValueError("packed_colwise leaves its output sharded (output = \"shard\")")
        elif self.parts is not None:
            raise ValueError("parts applies to packed_colwise only")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Only the keys given (TOML has no null)."""
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @property
    def input_layout(self) -> str | None:
        return self.input or PLAN_STYLES[self.style][0]

    @property
    def output_layout(self) -> str | None:
        return self.output or PLAN_STYLES[self.style][1]


class TensorPartitioningStrategy(StrEnum):
    ColumnWise = "ColumnWise"
    RowWise = "RowWise"
    BatchWise = "BatchWise"
    SequenceWise = "SequenceWise"
    Dynamic = "Dynamic"
    BlockWise = "BlockWise"
    Custom = "Custom"


class TensorCommunicationPattern(StrEnum):
    AllReduce = "AllReduce"
    AllGather = "AllGather"
    ReduceScatter = "ReduceScatter"
    PointToPoint = "PointToPoint"
    Hierarchical = "Hierarchical"


class TensorMemoryOptimization(StrEnum):
    None_ = "None"
    Low = "Low"
    Medium = "Medium"
    High = "High"
    Extreme = "Extreme"


class TensorParallelismConfig(Contract):
    tensor_parallel_size: PositiveCount = 1
    """Ranks per tensor-parallel group (divides the process count; the rest is data parallelism); 1
    = off."""
    partitioning_strategy: TensorPartitioningStrategy = TensorPartitioningStrategy.ColumnWise
    """How layer pairs are split: ColumnWise, RowWise, BatchWise, SequenceWise, Dynamic, Custom, or
    BlockWise (with a square size, a 2-D grid of every weight)."""
    column_parallel: bool = True
    """Create column-parallel Linear layers (with row_parallel: column/row pairs)."""
    row_parallel: bool = True
    """Create row-parallel Linear layers (with column_parallel: column/row pairs)."""
    communication_pattern: TensorCommunicationPattern = TensorCommunicationPattern.AllReduce
    """The collective that carries the tensor-parallel reductions (ReduceScatter: the
    sequence-parallel layout)."""
    async_communication: bool = True
    """Overlap the column layer's input-gradient collective with the weight-gradient matmul;
    gradient buckets all in flight at once."""
    fusion_threshold_bytes: Count = 1048576
    """q/k/v share one input-gradient collective, and small gradient reductions are packed into flat
    buffers, up to this size; 0 = no fusion."""
    gradient_accumulation: bool = True
    """Synchronise gradients once per step over micro_batches (false = once per micro-batch)."""
    memory_optimization: TensorMemoryOptimization = TensorMemoryOptimization.Medium
    """Activation checkpointing: None, Low/Medium/High (every 4/2/1 blocks); Extreme also offloads
    saved tensors to host memory. Only local maths is recomputed (Low/Medium: only the cheap ops,
    the sharded matmuls' outputs are kept): the forward collectives' outputs are kept, so every
    level moves the bytes of None."""
    mixed_precision: bool = False
    """bf16 matmuls with fp32 master weights, gradients and reductions."""
    micro_batches: PositiveCount = 1
    """Extension (dumped only when set): micro-batches per optimizer step, the unit
    gradient_accumulation accumulates over."""
    plan: dict[str, PlanEntry] = Field(default_factory=dict)
    """Extension (dumped only when set): module-path patterns (a `*` matches one path
    component, as torch's parallelize_module) -> a style ("colwise", "rowwise", ...) or a table
    {style, input, output, parts}; applied before the built-in rules, which shard the rest."""

    _extensions: ClassVar[frozenset[str]] = frozenset({"micro_batches", "plan"})

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_strings(cls, v: Any) -> Any:
        """A bare style string is the table ``{style = "..."}``."""
        if isinstance(v, dict):
            return {k: {"style": e} if isinstance(e, str) else e for k, e in v.items()}
        return v


_CODEC = Codec(TensorParallelismConfig)
load_tensor_parallel = _CODEC.load  # a TensorParallelismConfig from JSON text or a dict
dump_tensor_parallel = _CODEC.dump  # the ten Rust keys, and the extensions that are set
