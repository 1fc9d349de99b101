"""ZeRO (``strategy.shard``; Rajbhandari et al. 2020): :class:`ZeroEngine`, a replica that
steps only its rows ``[r c, (r+1) c)`` of every parameter (:class:`~paratrain.comm.zero.FlatShard`).
Per parameter and fp32 Adam a rank holds ``4 + 4 + 8/N`` bytes at ``optimizer`` (ZeRO-1:
gradients all-reduced by :class:`~paratrain.comm.grad_sync.GradSync`, parameters all-gathered
after the step), ``4 + 12/N`` at ``gradients`` (ZeRO-2: each unit's gradients reduce-scattered
once its backward is done, :class:`_PostBackward` on its inputs being FSDP2's trigger) and
``16/N`` at ``parameters`` (ZeRO-3: a unit gathered before its forward and its backward, freed
after each by resizing its storage to zero, so the tensors autograd saved see the re-gathered
values: FSDP1's scheme); the units are ``shard_unit``'s modules (:func:`shard_plan` shows them
without a process group). The update equals unsharded AllReduce's: the optimizers are
element-wise, clipping takes the global norm ``sum_r ||g_shard,r||^2`` and a parameter no rank
used keeps ``grad = None``. Local layers, frozen and empty parameters stay whole; every rank
calls the same units in the same order (as under FSDP). The loop's ``model`` is
:class:`ShardView` (checkpoints resume on any world); ``net`` is the model computed with.

Why not torch's FSDP2: on gloo it sums the reduce-scattered gradients where it should average
(pytorch#162338), so on CPU it does not equal AllReduce; ours also keeps AllReduce's rules for
Local subgraphs, ties and unused parameters, and runs over a tensor-parallel mesh's dp column
and a ModelParallel replicated stage. tests/executors/shared/test_zero_vs_torch.py holds every
level to torch's DDP + ZeroRedundancyOptimizer bit for bit; benchmarks/zero.py times FSDP2.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ...comm import collectives as C
from ...comm.context import WorkerContext
from ...comm.grad_sync import GradSync
from ...comm.zero import FlatShard
from ...config import ConfigError
from ...config.job import JobConfig
from ...config.strategy import DataParallel
from ...task.steps import call_model
from ...task.steps import evaluate as evaluate_task
from ...training.loop import LocalEngine
from ...training.stepping import autocast, local_grad_sq_norm

LEVELS = {"optimizer": 1, "gradients": 2, "parameters": 3}


def check_shard(job: JobConfig, s: DataParallel) -> None:
    """ZeRO (``strategy.shard``) shards what AllReduce would all-reduce: uncompressed only."""
    if s.shard == "none":
        if s.shard_unit is not None:
            raise ConfigError([("strategy.shard_unit", "is the unit of shard = \"gradients\" or "
                                "\"parameters\" (this job does not shard)")])
        return
    if s.aggregation.method != "AllReduce":
        raise ConfigError([("strategy.shard", (
            f"shard = {s.shard!r} shards AllReduce's exchange; aggregation "
            f"{s.aggregation.method} has none (use AllReduce, or shard = \"none\")"))])
    if job.compression is not None and job.compression.method != "None":
        raise ConfigError([("strategy.shard", (
            f"shard = {s.shard!r} with [compression] {job.compression.method} is not supported: "
            "a compressed exchange all-reduces (or all-gathers) whole gradients and keeps whole "
            "error-feedback residuals per rank, which sharding would not shrink; drop one of them"))])
    if s.shard_unit is not None and s.shard == "optimizer":
        raise ConfigError([("strategy.shard_unit", (
            "is the unit of shard = \"gradients\" / \"parameters\" (reduce-scattered, and "
            "gathered, unit by unit); shard = \"optimizer\" all-reduces whole gradients"))])


def resolve_units(net: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The module paths gathered as units: those matching a glob of ``patterns`` or whose
    class name is one (None: each direct child); ConfigError for a pattern matching none."""
    if patterns is None:
        return [n for n, _ in net.named_children()]
    out: list[str] = []
    for pat in patterns:
        hits = [n for n, m in net.named_modules() if n and (fnmatch.fnmatchcase(n, pat)
                                                              or type(m).__name__ == pat)]
        if not hits:
            raise ConfigError([("strategy.shard_unit", (
                f"{pat!r} matches no module path or class name of the model (children: "
                f"{', '.join(n for n, _ in net.named_children())})"))])
        out += [h for h in hits if h not in out]
    return out


def assign_units(net: nn.Module, paths: Sequence[str], shared: Sequence[tuple[str, nn.Parameter]]
            ) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """Each shared parameter to the deepest unit holding it when the units holding it are
    nested; to the root (``""``, last) when none or several sibling units use it (a tie)."""
    holders: dict[int, list[str]] = {}
    for path in paths:
        for _, p in net.get_submodule(path).named_parameters(remove_duplicate=False):
            if path not in holders.setdefault(id(p), []):
                holders[id(p)].append(path)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {path: [] for path in paths}
    groups[""] = []
    for n, p in shared:
        hs = sorted(holders.get(id(p), []), key=len)
        nested = all(hs[-1] == h or hs[-1].startswith(h + ".") for h in hs)
        groups[hs[-1] if hs and nested else ""].append((n, p))
    return [(path, named) for path, named in groups.items() if named]


def shard_plan(net: nn.Module, *, level: str, units: Sequence[str] | None, local: set[str],
               world: int) -> dict[str, Any]:
    """What ``shard = level`` on ``world`` replicas shards, without processes (``paratrain
    graph`` / ``validate``): each unit's parameters and elements, the elements of one rank's
    shard (rank 0's, the largest), the parameters kept whole, and the bytes a rank holds
    for fp32 Adam by the ZeRO formula."""
    shared = [(n, p) for n, p in net.named_parameters() if p.requires_grad and n not in local]
    paths = resolve_units(net, units) if LEVELS[level] >= 2 else []
    out: dict[str, Any] = {"level": level, "zero_stage": LEVELS[level], "replicas": world, "units": []}
    for path, named in assign_units(net, paths, shared):
        flat = FlatShard([p.shape for _, p in named], world=world, rank=0)
        out["units"].append({"unit": path or "(root)", "parameters": [n for n, _ in named],
                             "elements": sum(p.numel() for _, p in named),
                             "elements_per_rank": flat.numel})
    out["whole"] = sorted(n for n, p in net.named_parameters() if n in local or not p.requires_grad)
    n_shared = sum(p.numel() for _, p in shared)
    per = {1: 8 + 8 / world, 2: 4 + 12 / world, 3: 16 / world}[LEVELS[level]]
    out["adam_fp32_bytes_per_rank"] = int(per * n_shared + 16 * sum(
        p.numel() for n, p in net.named_parameters() if n in local))
    return out


@dataclass(eq=False)
class Unit:
    """One gathered group: its parameters, their shard layout and this rank's shards."""

    path: str  # "" = the root unit
    named: list[tuple[str, nn.Parameter]]
    flat: FlatShard
    shard: torch.Tensor | None = None  # ZeRO-3: this rank's parameter rows (S elements)
    grad: torch.Tensor | None = None  # ZeRO-2/3: this rank's gradient rows, summed over micro-batches
    used: list[bool] = field(default_factory=list)
    pieces: list[nn.Parameter | None] = field(default_factory=list)
    gathered: bool = True
    reduced: bool = False  # reduce-scattered during this backward pass

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named]


class ShardView(nn.Module):
    """What the loop checkpoints and the optimizer steps: this rank's pieces of the
    sharded parameters, the local parameters and the other state, under mangled keys."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[str, str] = {}
        self.specs: dict[str, dict[str, Any]] = {}

    def add(self, name: str, t: torch.Tensor, *, spec: dict[str, Any] | None = None,
            param: bool = True) -> None:
        key = name.replace(".", "/")
        self.names[key] = name
        if spec is not None:
            self.specs[key] = spec
        if param:
            self.register_parameter(key, t if isinstance(t, nn.Parameter) else nn.Parameter(t))
        else:
            self.register_buffer(key, t.detach())


def shard_view(net: nn.Module, units: Sequence[Unit]) -> ShardView:
    """The :class:`ShardView` of ``net``: each unit's pieces (its ``pieces`` set here;
    ZeRO-1/2: rows of the whole parameter), a Local subgraph's parameters and the rest
    (buffers, frozen parameters) whole; a tied tensor once, under its first name."""
    view = ShardView()
    mine = {id(p): (u, i) for u in units for i, p in enumerate(u.params)}
    for u in units:
        u.pieces = [None] * len(u.named)
        u.used = [False] * len(u.named)
    seen: set[int] = set()
    for name, t in net.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue  # a tied name: the tensor is under its first name
        seen.add(id(t))
        if id(t) in mine:
            u, i = mine[id(t)]
            piece = u.flat.pieces[i]
            if piece.length:  # ZeRO-1/2: rows of the whole parameter (ZeRO-3 re-points them)
                u.pieces[i] = nn.Parameter(t.data[piece.start : piece.start + piece.length])
                view.add(name, u.pieces[i], spec=piece.spec)  # type: ignore[arg-type]
        elif isinstance(t, nn.Parameter) and t.requires_grad:
            view.add(name, t)  # a Local subgraph's parameter: this replica's own
        else:
            view.add(name, t, param=False)  # buffers, frozen parameters
    return view


def keep_own_rows(u: Unit, device: torch.device) -> None:
    """ZeRO-3: this rank's rows into ``u.shard`` (its pieces become views of it), then the
    whole parameters freed, each given its own storage first so that no other tensor's is."""
    u.shard = u.flat.pack_own(u.params, torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=device))
    for i, piece in enumerate(u.pieces):
        if piece is not None:
            piece.data = u.flat.view(u.shard, i)
    for p in u.params:
        p.data = p.data.clone()
    free_unit(u)


@torch.no_grad()
def gather_unit(u: Unit, *, group: Any, counter: Any = None) -> None:
    """ZeRO-3: every rank's rows all-gathered into the unit's whole parameters (their storage
    re-grown first; collective, a no-op where they are whole)."""
    if u.gathered or u.shard is None:
        return
    for p in u.params:
        p.data.untyped_storage().resize_(p.numel() * p.element_size())
    u.flat.gather(u.shard, [p.data for p in u.params], group=group, counter=counter)
    u.gathered = True


def free_unit(u: Unit) -> None:
    """ZeRO-3: the unit's whole parameters freed (storage resized to nothing, so tensors
    autograd saved see the values gathered again later); its rows stay in ``u.shard``."""
    if u.gathered and u.shard is not None:
        for p in u.params:
            p.data.untyped_storage().resize_(0)
        u.gathered = False


@torch.no_grad()
def gather_rows(units: Sequence[Unit], *, group: Any, counter: Any, device: torch.device) -> None:
    """ZeRO-1/2, after a step and a resume: every rank's rows all-gathered into the units'
    whole parameters (collective)."""
    for u in units:
        flat = u.flat.pack_own(u.params, torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=device))
        u.flat.gather(flat, [p.data for p in u.params], group=group, counter=counter)


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, *,
               grads: Iterable[torch.Tensor | None] = ()) -> dict[str, int]:
    """Bytes of ``params``, their gradients (and ``grads``) and ``optimizer``'s state
    tensors, each storage counted once (a ZeRO-1 piece's grad is a view of the whole)."""
    seen: set[int] = set()

    def size(ts: Iterable[Any]) -> int:
        total = 0
        for t in ts:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.nbytes() and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
        return total

    params = list(params)
    p_bytes = size(params)
    g_bytes = size([*(p.grad for p in params), *grads])
    s_bytes = size(v for st in optimizer.state.values() for v in st.values())
    return {"parameters": p_bytes, "gradients": g_bytes, "optimizer": s_bytes,
            "total": p_bytes + g_bytes + s_bytes}


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward has made
    their gradients (autograd runs a weight's AccumulateGrad as soon as it is ready, so the
    unit's used parameters hold their gradients by then): it calls ``fn``."""

    @staticmethod
    def forward(ctx: Any, fn: Any, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.fn = fn
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.fn()
        return (None, *grads)


class ZeroEngine(LocalEngine):
    """A DataParallel replica at ZeRO ``level`` (module doc); ``local``: Local-subgraph
    parameter names (never combined), ``buffers``: broadcast before each step's first forward."""

    def __init__(self, net: nn.Module, task: Any, test: Any, *, ctx: WorkerContext, precision: str,
                 level: str, units: Sequence[str] | None, local: set[str],
                 buffers: Sequence[torch.Tensor], counter: C.CommCounter, bucket_bytes: int) -> None:
        super().__init__(net, task, test, device=ctx.device, precision=precision)
        self.net, self.ctx, self.counter, self.level = net, ctx, counter, LEVELS[level]
        # an empty parameter has no rows to shard: it stays whole, like a Local layer's
        self.local = set(local) | {n for n, p in net.named_parameters() if p.numel() == 0}
        self.n, self.rank, self.group = ctx.world_size, ctx.rank, ctx.group
        shared = [(n, p) for n, p in net.named_parameters() if p.requires_grad and n not in self.local]
        flat0 = [n for n, p in shared if p.dim() == 0]
        if flat0:
            raise ConfigError([("strategy.shard", f"parameter {flat0[0]} is 0-dimensional: it has no "
                                "rows to shard; make it shape [1] or leave shard = \"none\"")])
        paths = resolve_units(net, units) if self.level >= 2 else []
        self.units: list[Unit] = []
        for path, named in assign_units(net, paths, shared):
            dtypes = {p.dtype for _, p in named}
            if len(dtypes) > 1:
                raise ConfigError([("strategy.shard_unit", f"unit {path or '(root)'} mixes parameter "
                                    f"dtypes {sorted(map(str, dtypes))}; make one unit per dtype")])
            self.units.append(Unit(path, named, FlatShard([p.shape for _, p in named],
                                                           world=self.n, rank=self.rank)))
        # ZeRO-1: the unsharded exchange; otherwise GradSync only broadcasts the buffers
        self.sync_ = GradSync(shared if self.level == 1 else [], group=self.group,
                              bucket_bytes=bucket_bytes, overlap=True, buffers=buffers, counter=counter)
        self.model = shard_view(net, self.units)
        self._new_step = True
        self.hooks: list[Any] = []
        if self.level == 3:
            for u in self.units:
                keep_own_rows(u, self.device)
        if self.level >= 2:
            self._install_hooks()

    def _install_hooks(self) -> None:
        for u in self.units:
            if not u.path:
                continue  # the root is gathered for the whole step (forward_backward)
            m = self.net.get_submodule(u.path)
            self.hooks.append(m.register_forward_pre_hook(
                lambda _m, a, k, u=u: self._before_forward(u, a, k), with_kwargs=True))
            self.hooks.append(m.register_forward_hook(lambda _m, _a, out, u=u: self._after_forward(u, out)))

    def _gather(self, u: Unit) -> None:
        gather_unit(u, group=self.group, counter=self.counter)

    def _after_forward(self, u: Unit, out: Any) -> None:
        if not self.net.training or not torch.is_grad_enabled():
            return  # evaluation: everything stays gathered (evaluate)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:  # the unit's backward starts when a gradient reaches one of its outputs
            # (the hook lives with this forward's graph; its handle need not be kept)
            torch.autograd.graph.register_multi_grad_hook(outs, lambda _g, u=u: self._gather(u),
                                                          mode="any")
        free_unit(u)

    def _before_forward(self, u: Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Gather the unit (ZeRO-3) and route its inputs through :class:`_PostBackward`, so
        the unit's gradients are reduce-scattered (and its parameters freed) as soon as its
        backward has produced the gradients of its inputs (torch FSDP2's trigger)."""
        self._gather(u)
        if not self.net.training or not torch.is_grad_enabled():
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if idx:  # a unit whose inputs need no gradient is reduced after the backward pass
            outs = _PostBackward.apply(lambda u=u: self._reduce_unit(u), *[flat[i] for i in idx])
            for i, t in zip(idx, outs, strict=True):
                flat[i] = t
        return tree_unflatten(flat, spec)

    def gather_all(self) -> None:
        """ZeRO-3: every parameter whole (collective; e.g. before evaluation or export)."""
        for u in self.units:
            self._gather(u)

    def free_all(self) -> None:
        for u in self.units:
            free_unit(u)

    def _begin_step(self) -> None:
        self._new_step = False
        for u in self.units:
            u.used = [False] * len(u.named)
            if u.grad is not None:
                u.grad.zero_()
            for p in u.params:
                p.grad = None
        for n, p in self.net.named_parameters():
            if n in self.local:
                p.grad = None

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
        if self._new_step:
            self._begin_step()
        self.sync_.before_forward(last=last)
        root = [u for u in self.units if not u.path]
        for u in root:
            self._gather(u)
        with autocast(self.precision, self.device):
            loss = self.task.loss(call_model(self.task, self.net, batch), batch)
        (loss * weight).backward() if weight != 1.0 else loss.backward()
        if self.level >= 2:
            # the units not reduced during the backward (the root, units whose inputs need no
            # gradient), in the units' order (the same on every rank)
            for u in self.units:
                if not u.reduced:
                    self._reduce_unit(u)
                u.reduced = False
        return float(loss.detach())

    def _reduce_unit(self, u: Unit) -> None:
        """The unit's gradient mean into this rank's gradient rows (summed over the step's
        micro-batches); the whole gradients dropped and (ZeRO-3) the parameters freed."""
        grads = [p.grad for p in u.params]
        u.used = [a or g is not None for a, g in zip(u.used, grads, strict=True)]
        part = torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=self.device)
        u.flat.reduce_scatter(grads, part, group=self.group, counter=self.counter)
        if u.grad is None:
            u.grad = part
        else:
            u.grad.add_(part)
        for p in u.params:
            p.grad = None
        free_unit(u)
        u.reduced = True

    def sync(self) -> None:
        """Point each piece's ``grad`` at this rank's rows of the mean gradient (None where
        no rank used the parameter this step)."""
        self._new_step = True
        if self.level == 1:
            self.sync_.sync()
            for u in self.units:
                for piece, fp, p in zip(u.pieces, u.flat.pieces, u.params, strict=True):
                    if piece is not None:
                        piece.grad = None if p.grad is None else p.grad.detach()[fp.start : fp.start + fp.length]
            return
        self.sync_.sync()  # closes GradSync's step (it only broadcast the buffers)
        flags = [f for u in self.units for f in u.used]
        used = iter(C.used_mask(flags, group=self.group, counter=self.counter) if flags else [])
        for u in self.units:
            for i, piece in enumerate(u.pieces):
                live = next(used)
                if piece is not None:
                    piece.grad = u.flat.view(u.grad, i) if live and u.grad is not None else None

    def grad_sq_norm(self) -> float:
        """``sum_r ||g_shard,r||^2 + mean_r ||g_local,r||^2``: the unsharded model's squared
        norm (Local layers as DataParallel's), the same on every rank, one all-reduce."""
        pieces = [p for u in self.units for p in u.pieces if p is not None]
        local = [p for n, p in self.net.named_parameters() if n in self.local]
        t = torch.stack([local_grad_sq_norm(pieces), local_grad_sq_norm(local) / self.n])
        C.all_reduce_(t, group=self.group, counter=self.counter)
        return float(t.sum())

    def after_step(self) -> dict[str, float]:
        """ZeRO-1/2: every rank's updated rows all-gathered into the whole parameters."""
        if self.level < 3:
            gather_rows(self.units, group=self.group, counter=self.counter, device=self.device)
        return {}

    def evaluate(self) -> dict[str, float] | None:
        self.gather_all()  # collective: every rank, before rank 0 evaluates
        try:
            if not self.ctx.is_main:
                return None
            with autocast(self.precision, self.device):
                return evaluate_task(self.net, self.task, self.test, device=self.device)
        finally:
            self.free_all()

    def mean_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        C.all_reduce_(t, group=self.group)
        return float(t.item()) / self.n

    def model_names(self) -> dict[str, str]:
        return dict(self.model.names)  # type: ignore[arg-type]

    def model_shards(self) -> dict[str, dict[str, Any]]:
        return dict(self.model.specs)  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        """What is sharded: the level, the units with their parameters (for summaries)."""
        return {"shard": {1: "optimizer", 2: "gradients", 3: "parameters"}[self.level],
                "units": {u.path or "(root)": [n for n, _ in u.named] for u in self.units},
                "local": sorted(self.local)}

    def held_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of the storages this rank holds now (each counted once), by kind:
        parameters (whole or shards), gradients (whole or shards), optimizer state."""
        return held_bytes([*self.net.parameters(), *(u.shard for u in self.units if u.shard is not None)],
                          optimizer, grads=[*(u.grad for u in self.units),
                                            *(p.grad for p in self.model.parameters())])

    def log_extras(self) -> dict[str, Any]:
        return {"comm_bytes": self.counter.total_bytes}

    def state_dict(self) -> dict[str, Any]:
        return {"comm": dict(self.counter.bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After a resume loaded this rank's pieces: ZeRO-1/2 gather the whole parameters."""
        for k, v in (state or {}).get("comm", {}).items():
            self.counter.bytes[k] = int(v)
        if self.level < 3:
            gather_rows(self.units, group=self.group, counter=self.counter, device=self.device)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.sync_.close()

