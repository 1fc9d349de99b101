"""What a ZeRO replica holds (:mod:`.zero`): :class:`Unit`, one group of parameters gathered
together, and :class:`ShardView`, what the loop checkpoints and the optimizer steps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...comm.zero import FlatShard


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
    """ZeRO-3: this rank's rows into ``u.shard`` (its pieces become views of it) and every
    parameter given its own storage, so that :func:`free_unit` frees no other tensor's."""
    u.shard = u.flat.pack_own(u.params, torch.empty(u.flat.numel, dtype=u.params[0].dtype, device=device))
    for i, piece in enumerate(u.pieces):
        if piece is not None:
            piece.data = u.flat.view(u.shard, i)
    for p in u.params:
        p.data = p.data.clone()


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
