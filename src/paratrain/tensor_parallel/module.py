"""``parallelize`` and :class:`TensorParallelModule`: a converted model and what a run does with it.

``parallelize`` shards a full, identically initialised copy of the model on every rank (the
weights are sliced from it, so the result computes the same function). ``partitioning_strategy``:
ColumnWise = column-then-row pairs (Megatron, one reduction per direction); RowWise =
row-then-column (split input, all-reduced row output, all-gathered column output); Dynamic = per
pair by the first weight's shape (column-first when out > in); SequenceWise = sequence parallel;
BatchWise = no weight sharding, each TP rank runs the whole model on its slice of the batch
(outputs all-gathered, gradients summed); BlockWise = 2-D when tp = g^2 (:mod:`.grid`), else
ColumnWise; Custom = column-first pairs split by ``register_custom_partitioner``'s function.
``communication_pattern``: AllReduce / PointToPoint / Hierarchical carry the Megatron f/g
reductions; AllGather gathers the column outputs for the row layer to re-split; ReduceScatter is
sequence parallelism between the first and last parallel child of the root Sequential (dim 1 of
``[B, S, E]``, dim 0 of ``[B, F]``), whose replicated parameters' gradients (as a plan's
``sequence`` modules') :meth:`TensorParallelModule.sync_gradients` sums over TP.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from paratrain.comm.grad_sync import GradSync
from paratrain.comm.tp.comm import CommStats, TPComm
from paratrain.comm.tp.groups import GridComms, TPGroups, build_grid, build_tp_groups
from paratrain.config import ConfigError, TensorParallelismConfig

from . import memory
from .autograd import gather_from_region, scatter_to_region
from .converter import Converter
from .grid import GridLinear, grid_steps
from .layers import (
    ColumnParallelLinear,
    ParallelEncoderLayer,
    ParallelSelfAttention,
    RegionState,
    RowParallelLinear,
)
from .partition import TensorParallelism, split_sizes
from .shards import pack_dense

_PARALLEL = (ColumnParallelLinear, RowParallelLinear, ParallelSelfAttention, ParallelEncoderLayer,
             GridLinear)


def _has_parallel(m: nn.Module) -> bool:
    return any(isinstance(x, _PARALLEL) for x in m.modules())


def param_bytes(params: Iterator[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def describe_layer(m: nn.Module) -> str | None:
    """One line for one of paratrain's parallel layers (None for anything else)."""
    if isinstance(m, ParallelSelfAttention):
        return f"attention heads split ({m.local_heads} per rank): q/k/v colwise, o rowwise"
    if isinstance(m, ParallelEncoderLayer):
        return "encoder layer: attention heads split, linear1 colwise, linear2 rowwise"
    if isinstance(m, GridLinear):
        return "2-D grid block (BlockWise)"
    if isinstance(m, ColumnParallelLinear):
        return "colwise" + (", output gathered" if m.gather_output else "") + (
            ", sequence parallel" if m.mode == "seq" else "")
    if isinstance(m, RowParallelLinear):
        return "rowwise" + ("" if m.input_is_parallel else ", input split here") + (
            ", sequence parallel" if m.mode == "seq" else "")
    return None


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds: not those registered ``persistent=False`` (HF's
    rotary ``inv_freq``, recomputed from the config)."""
    out = []
    for prefix, m in module.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


class TensorParallelModule(nn.Module):
    """A dense model turned tensor-parallel, with the behaviour every config field asks for."""

    def __init__(self, model: nn.Module, config: TensorParallelismConfig, groups: TPGroups, *,
                 compressor: Any = None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.config, self.groups = config, groups
        self.sharding: list[tuple[str, str]] = []  # (module path, what tensor parallelism did)
        self.comm: TPComm = groups.tp
        self.stats: CommStats = groups.tp.stats
        tp = config.tensor_parallel_size
        if tp != groups.tp_size:
            raise ConfigError([("tensor_parallel.tensor_parallel_size",
                                f"{tp} does not match the TP group size {groups.tp_size}")])
        self.pattern = config.communication_pattern.value
        strategy = config.partitioning_strategy.value
        self.batch_split = strategy == "BatchWise" and tp > 1
        self.seq = ((self.pattern == "ReduceScatter" or strategy == "SequenceWise") and tp > 1
                    and not self.batch_split)
        self.grid: GridComms | None = None
        if strategy == "BlockWise" and tp > 1 and math.isqrt(tp) ** 2 == tp:
            if self.seq:
                raise ConfigError([("tensor_parallel.communication_pattern",
                                    f"BlockWise with tensor_parallel_size {tp} is 2-D tensor "
                                    "parallelism, whose activations are blocked by batch and "
                                    "features; it does not combine with ReduceScatter (sequence "
                                    "parallel)")])
            self.grid = build_grid(groups.tp)  # collective: every rank builds every sub-group
        self.state = RegionState(compute_dtype=torch.bfloat16 if config.mixed_precision else None)
        self.dense_param_bytes = param_bytes(model.parameters())
        self.coordinator = TensorParallelism(config, self.comm.rank, self.comm.size)
        self._sequence_modules: list[nn.Module] = []
        self.module = self._convert(model, config, tp)
        for name, mod in self.module.named_modules():
            if isinstance(getattr(mod, "state", None), RegionState):
                mod.tp_path = name  # named in run-time layout errors (.plan)
        # whole-model calls (keyword arguments, non-tensor outputs) for models that are not
        # an nn.Sequential of tensor-to-tensor children
        self.free_form = not isinstance(self.module, nn.Sequential) and bool(self.sharding)
        self._plan()
        self._record_partitions()
        self._param_ptrs = {p.data_ptr() for p in self.module.parameters()}
        # True: a recomputed segment runs its forward collectives again instead of reading them
        # from its tape (the policy before the tape, kept to measure what the tape saves)
        self.recompute_collectives = False
        self.last_peak_activation_bytes: int | None = None
        # 2-D: the data-parallel gradient average (and buffer broadcast) over the DP group;
        # the compressor's residuals are keyed by this module's parameter names.
        self.grad_sync: GradSync | None = None
        if groups.dp is not None:
            self.grad_sync = GradSync(
                list(self.named_parameters()), group=groups.dp.group,
                bucket_bytes=config.fusion_threshold_bytes, compressor=compressor,
                buffers=list(self.module.buffers()) if broadcast_buffers else [])
        if not self.needs_sync and config.gradient_accumulation is False:
            warnings.warn("gradient_accumulation has no effect: this layout has no gradient "
                          "synchronisation (pure tensor parallel, no sequence parallel, 1 replica)",
                          stacklevel=2)

    def _convert(self, model: nn.Module, config: TensorParallelismConfig, tp: int) -> nn.Module:
        """The model with its recognised layers swapped for their parallel forms (none for
        BatchWise or one rank); refuses a layout with nothing to shard."""
        if tp > 1 and not self.batch_split:
            if not (config.column_parallel or config.row_parallel):
                raise ConfigError([("tensor_parallel", "tensor_parallel_size > 1 but column_parallel "
                                    "and row_parallel are both false: nothing to parallelize")])
            if self.seq and not (config.column_parallel and config.row_parallel):
                raise ConfigError([("tensor_parallel.communication_pattern",
                                    "ReduceScatter (sequence parallel) needs column_parallel and "
                                    "row_parallel both true")])
            paths = [n for n, _ in model.named_modules()]
            conv = Converter(config, self.comm, self.state, self.grid)
            model = conv.convert(model)
            conv.plan.check_used(paths)
            self.sharding = conv.notes
            self._sequence_modules = conv.plan.sequence_modules
            if conv.units == 0:
                raise ValueError("parallelize: no Linear pair or attention block found to shard "
                                 "(give the layout with a [tensor_parallel.plan] table)")
        elif config.plan and tp > 1:
            raise ConfigError([("tensor_parallel.plan", "BatchWise shards no weights: the plan would be "
                                                        "ignored")])
        return model

    def _record_partitions(self) -> None:
        """Tell the coordinator how each parallel linear's weight is split."""
        kinds = ((ColumnParallelLinear, "ColumnWise"), (RowParallelLinear, "RowWise"),
                 (GridLinear, "BlockWise"))
        for name, mod in self.module.named_modules():
            for cls, kind in kinds:
                if isinstance(mod, cls):
                    self.coordinator.partition_tensor(name + ".weight",
                                                      (mod.in_features, mod.out_features), kind)
                    break

    def _plan(self) -> None:
        """Blocks (checkpoint units), segments, and the sequence-parallel region."""
        m = self.module
        kids = list(m.children()) if isinstance(m, nn.Sequential) else [m]
        self._kids = kids
        starts = [0]
        # without parallel units (tp = 1, BatchWise) every child with parameters starts a block
        dense = not any(_has_parallel(c) for c in kids)
        for i, c in enumerate(kids):
            unit = (isinstance(c, ColumnParallelLinear | ParallelSelfAttention | ParallelEncoderLayer)
                    or (isinstance(c, RowParallelLinear) and not c.input_is_parallel)
                    or (not isinstance(c, _PARALLEL) and _has_parallel(c))
                    or (dense and next(c.parameters(), None) is not None))
            if unit and i > 0:
                starts.append(i)
        self.blocks = [list(range(a, b)) for a, b in zip(starts, starts[1:] + [len(kids)], strict=True)]
        k = memory.SEGMENT_BLOCKS[self.config.memory_optimization.value]
        self.segments = [[i for b in self.blocks[s: s + k] for i in b]
                         for s in range(0, len(self.blocks), k)] if k else []
        par = [i for i, c in enumerate(kids) if _has_parallel(c)]
        self.seq_region = (par[0], par[-1]) if (self.seq and par) else None
        if self.batch_split:
            self.seq_region = (0, len(kids) - 1)
        if self.seq and not isinstance(m, nn.Sequential):
            raise ConfigError([("tensor_parallel.communication_pattern",
                                "ReduceScatter (sequence parallel) needs an nn.Sequential model")])
        self._sp_params: list[nn.Parameter] = []
        # a plan's sequence modules see their shard's tokens only (.plan): their
        # replicated parameters' gradients are partial sums
        seen: set[int] = set()
        for sm in self._sequence_modules:
            for p in sm.parameters():
                if not hasattr(p, "tp_shard_dim") and id(p) not in seen:
                    seen.add(id(p))
                    self._sp_params.append(p)
        if self.seq_region is not None:
            a, b = self.seq_region
            for c in kids[a: b + 1]:
                self._sp_params += [p for p in c.parameters() if not hasattr(p, "tp_shard_dim")]

    @property
    def needs_sync(self) -> bool:
        return bool(self._sp_params) or self.groups.dp is not None

    def _run(self, idx: list[int], x: torch.Tensor) -> torch.Tensor:
        region = self.seq_region
        # a recomputed segment may start inside the region, its input already split
        self.state.in_sequence = bool(idx) and region is not None and region[0] < idx[0] <= region[1]
        for i in idx:
            if self.seq_region is not None and i == self.seq_region[0]:
                d = 1 if x.dim() >= 3 and not self.batch_split else 0
                self.state.seq_dim = d
                self.state.seq_sizes = split_sizes(x.shape[d], self.comm.size)
                self.state.in_sequence = True
                x = scatter_to_region(x, self.comm, d, self.state.seq_sizes)
            x = self._kids[i](x)
            if self.seq_region is not None and i == self.seq_region[1]:
                self.state.in_sequence = False
                x = gather_from_region(x, self.comm, self.state.seq_dim, self.state.seq_sizes)
        return x

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A tensor-to-tensor call of a model of paratrain's blocks runs the block plan; any
        other call (keyword arguments, HF's ``ModelOutput``...) runs the whole model, checkpointed
        as one segment (non-reentrant, so any output structure keeps its graph)."""
        if self.free_form or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return self._forward_call(args, kwargs)
        return self._forward_tensor(args[0])

    def _contexts(self, device_type: str) -> tuple[Any, Any]:
        """bf16 autocast per ``mixed_precision``; saved-tensor hooks for Extreme's offload or
        an active activation meter."""
        offload = self.config.memory_optimization.value == "Extreme"
        hooks = (memory.activation_hooks(offload=True, params=self._param_ptrs)
                 if offload or memory._ACTIVE else nullcontext())
        amp = (torch.autocast(device_type=device_type, dtype=torch.bfloat16)
               if self.config.mixed_precision else nullcontext())
        return amp, hooks

    def _forward_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.seq_region is not None:
            what = "BatchWise" if self.batch_split else "sequence parallelism (ReduceScatter)"
            raise ConfigError([("tensor_parallel", f"{what} splits one tensor input; this model is called "
                                                   "with keyword arguments or several inputs")])
        first = next((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), None)
        amp, hooks = self._contexts(first.device.type if first is not None else "cpu")
        def call(*a: Any, **k: Any) -> Any:
            self.state.in_sequence = False  # a plan's sequence region starts inside (.plan)
            return self.module(*a, **k)

        with amp, hooks:
            if self.segments and self.training and torch.is_grad_enabled():
                out = checkpoint(self._taped(call), *args, use_reentrant=False, **kwargs)
            else:
                out = call(*args, **kwargs)
        if self.config.mixed_precision:
            out = tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, out)
        return out

    def _forward_tensor(self, x: torch.Tensor) -> torch.Tensor:
        amp, hooks = self._contexts(x.device.type)
        self.state.in_sequence = False
        with amp, hooks:
            if not self.segments or not (self.training and torch.is_grad_enabled()):
                out = self._run(list(range(len(self._kids))), x)
            else:
                # reentrant checkpoint: a dummy input that requires grad keeps the segments'
                # outputs (and parameter gradients) in the graph even for data inputs.
                dummy = torch.ones(1, requires_grad=True, device=x.device)
                out = x
                for seg in self.segments:
                    trains = any(p.requires_grad for i in seg for p in self._kids[i].parameters())
                    if not trains and not out.requires_grad:
                        out = self._run(seg, out)  # nothing to recompute for (e.g. a flatten)
                    else:
                        out = checkpoint(self._taped(lambda x, _dummy, seg=seg: self._run(seg, x)),
                                         out, dummy, use_reentrant=True)
        return out.float() if self.config.mixed_precision and out.is_floating_point() else out

    def _taped(self, fn: Any) -> Any:
        """``fn`` (one checkpointed segment) with its own tape of collective outputs (offloaded
        to host under Extreme); ``recompute_collectives`` runs them again instead."""
        if self.recompute_collectives:
            return fn
        level = self.config.memory_optimization.value
        tape = memory.CollectiveTape(offload=level == "Extreme", keep_matmuls=level in memory.SELECTIVE,
                                     on_replay=self.stats.replayed_collective)

        def run(*args: Any, **kwargs: Any) -> Any:
            with tape.run():
                return fn(*args, **kwargs)
        return run

    @contextmanager
    def measure_activations(self) -> Iterator[memory.ActivationMeter]:
        """Meter the activation bytes saved for backward by forward+backward in the block."""
        offload = self.config.memory_optimization.value == "Extreme"
        with memory.measure(params=self._param_ptrs, offload=offload) as meter:
            yield meter
        self.last_peak_activation_bytes = meter.peak

    def sync_gradients(self) -> int:
        """Reduce gradients the layout needs; returns the number of collectives issued."""
        n = 0
        if self._sp_params:
            grads = [_grad(p) for p in self._sp_params]
            n += self.comm.all_reduce_coalesced_(grads)
        if self.grad_sync is not None:
            n += self.grad_sync.sync()
        return n

    def layout(self) -> list[tuple[str, str]]:
        """What tensor parallelism did to each module it touched, as ``(path, how)`` in model
        order (``paratrain validate`` / ``graph`` print it)."""
        if self.batch_split:
            return [("<root>", "BatchWise: the whole model on each rank's slice of the batch")]
        out = list(self.sharding)
        noted = [p for p, _ in out]
        for path, m in self.module.named_modules():
            if any(path == n or path.startswith(n + ".") for n in noted):
                continue
            how = describe_layer(m)
            if how is not None:
                out.append((path or "<root>", how))
                noted.append(path)
        return out

    def statistics(self) -> dict[str, Any]:
        """The run's communication counters and this rank's parameter memory."""
        snap = self.stats.snapshot()
        params = list(self.module.parameters())
        local = param_bytes(iter(params))
        sharded = param_bytes(p for p in params if hasattr(p, "tp_shard_dim") or grid_steps(p))
        replicated = local - sharded
        dense_sharded = self.dense_param_bytes - replicated
        tp = self.comm.size
        compute, communicate = snap["computation_time_s"], snap["communication_time_s"]
        snap.update({
            "tensor_parallel_size": tp,
            "communication_pattern": self.pattern,
            "param_bytes_local": local,
            "param_bytes_dense": self.dense_param_bytes,
            "param_bytes_replicated": replicated,
            "param_memory_fraction": local / self.dense_param_bytes if self.dense_param_bytes else 1.0,
            "param_memory_ideal_fraction": ((dense_sharded / tp + replicated) / self.dense_param_bytes
                                            if self.dense_param_bytes else 1.0),
            "memory_saving": 1 - local / self.dense_param_bytes if self.dense_param_bytes else 0.0,
            "total_partitions": self.coordinator.total_partitions,
            "local_partitions": self.coordinator.local_partitions,
            "peak_activation_bytes": self.last_peak_activation_bytes,
            # the Rust TensorParallelismStatistics names, with real values
            "communication_volume": snap["bytes_sent_modelled"],  # ring model, see CommStats
            "communication_time": communicate,
            "computation_time": compute,
            "efficiency_score": compute / (compute + communicate) if compute + communicate > 0 else 0.0,
            "memory_usage_per_device": {self.comm.global_rank: local},
        })
        if self.pattern == "Hierarchical":
            # the two-level layout the topology gave, e.g. "flat (1 host)" (comm/groups.py)
            snap["hierarchy"] = getattr(self.comm, "hierarchy", None) or "flat (1 rank)"
        return snap

    def to_dense_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename full (gathered) tensors to the dense model's keys (:func:`.shards.pack_dense`)."""
        return pack_dense(self.module, tensors)

    def gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gather per-parameter shards (e.g. gradients, keyed like ``module``'s parameters)
        into full tensors under the dense model's names (collective over TP)."""
        params = dict(self.module.named_parameters())
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            p = params.get(name)
            steps = grid_steps(p) if p is not None else None
            if steps is not None:
                for comm, dim, sizes in steps:
                    t = comm.all_gather(t.contiguous(), dim, sizes).wait()
            elif p is not None and hasattr(p, "tp_shard_dim") and self.comm.size > 1:
                t = self.comm.all_gather(t.contiguous(), p.tp_shard_dim, p.tp_sizes).wait()  # type: ignore[attr-defined]
            out[name] = t.detach().clone()
        return self.to_dense_names(out)

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict with the dense model's keys (collective)."""
        tensors = {n: p.detach() for n, p in self.module.named_parameters()}
        tensors.update({n: b.detach() for n, b in persistent_buffers(self.module)})
        return self.gather_full(tensors)


def _grad(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def parallelize(model: nn.Module, config: TensorParallelismConfig | dict[str, Any],
                group: TPGroups | TPComm | None = None, *, compressor: Any = None,
                broadcast_buffers: bool = True) -> TensorParallelModule:
    """Shard ``model`` (a full, identically initialised copy on every rank) per ``config``.
    ``group``: the :class:`TPGroups` of ``build_tp_groups``, a bare :class:`TPComm` (pure TP),
    or ``None`` to build the groups now (collective). With data-parallel replicas,
    ``compressor`` compresses their gradient average and ``broadcast_buffers`` (DDP's) makes
    their buffers the first replica's every step."""
    cfg = config if isinstance(config, TensorParallelismConfig) else TensorParallelismConfig.model_validate(config)
    if group is None:
        try:
            group = build_tp_groups(
                cfg.tensor_parallel_size, pattern=cfg.communication_pattern.value,
                async_op=cfg.async_communication, fusion_threshold_bytes=cfg.fusion_threshold_bytes)
        except ValueError as e:
            raise ConfigError([("tensor_parallel.tensor_parallel_size", str(e))]) from None
    if isinstance(group, TPComm):
        group = TPGroups(group, None, group.size, 1, 0)
    return TensorParallelModule(model, cfg, group, compressor=compressor,
                                broadcast_buffers=broadcast_buffers)
