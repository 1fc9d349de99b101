"""A DataParallel replica's step (:class:`DataParallelEngine`; ZeRO's is
:class:`~paratrain.executors.shared.zero.ZeroEngine`) and how the replicas combine their work
after each backward pass.

* :class:`AllReduceAgg`: ``g <- (1/n) sum_r g_r`` through the one gradient sync
  (:class:`~paratrain.comm.grad_sync.GradSync`: bucketed, overlapped with backward; equal to
  torch DDP). Compressed, everyone computes ``(1/n) sum_r D(C(g_r))`` (Seide et al. 2014;
  Lin et al. 2018, "Deep Gradient Compression", with error feedback when configured).
* :class:`ParameterServerAgg`: rank 0 serves (Li et al. 2014): each worker sends its flat
  gradient (or ``C(g)``), the server averages and sends the dense mean back; the server
  moves ``2 (n-1) B`` bytes a step, a worker ``2 B``.
* :class:`DecentralizedAgg`: after the local step each replica gossips its parameters,
  ``x_i <- sum_j W_ij x_j`` (adapt-then-combine D-PSGD, Lian et al. 2017); compressed, it is
  CHOCO-gossip (Koloskova et al. 2019): public copies ``x_hat``, ``q_i = C(x_i - x_hat_i)``
  travels, ``x_hat_j += D(q_j)``, ``x_i += gamma sum_j W_ij (x_hat_j - x_hat_i)``.

Local subgraphs' parameters are left out of ``named``; unused parameters and buffers follow
DDP's rules (docs/data-parallel.md; :func:`~paratrain.comm.collectives.used_mask`).
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from ...comm import collectives as C
from ...comm import messages as M
from ...comm.context import WorkerContext
from ...comm.grad_sync import GradSync, drop_unused
from ...comm.groups import gossip_average, mixing_weights, neighbors
from ...training.loop import LocalEngine
from ...training.stepping import local_grad_sq_norm

_LEN = struct.Struct("<Q")


def pack_records(records: Sequence[bytes]) -> torch.Tensor:
    """Length-prefixed concatenation of wire records, as a uint8 tensor."""
    blob = b"".join(_LEN.pack(len(r)) + r for r in records)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)


def unpack_records(data: bytes, count: int) -> list[bytes]:
    """Inverse of :func:`pack_records`; exactly ``count`` records or a ValueError."""
    out: list[bytes] = []
    pos = 0
    for _ in range(count):
        if pos + _LEN.size > len(data):
            raise ValueError("truncated compressed payload (length header)")
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise ValueError(f"truncated compressed payload (record of {n} bytes)")
        out.append(bytes(data[pos : pos + n]))
        pos += n
    if pos != len(data):
        raise ValueError(f"{len(data) - pos} trailing bytes after {count} records")
    return out


class Aggregator:
    """Hooks around one optimizer step; ``counter`` tallies the bytes this rank sent,
    ``local`` names the parameters of Local subgraphs (never combined across replicas),
    ``buffers`` are broadcast from rank 0 before each step's first forward by ``sync``, the
    one gradient sync (which exchanges no gradients but :class:`AllReduceAgg`'s)."""

    def __init__(self, model: nn.Module, *, group: Any, counter: C.CommCounter, compressor: Any = None,
                 local: Collection[str] = (), buffers: Sequence[torch.Tensor] = ()) -> None:
        self.model, self.group, self.counter, self.compressor = model, group, counter, compressor
        self.buffers = list(buffers)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in local]
        self.n = C.world_size(group)
        self.rank = C.rank_of(group) if self.n > 1 else 0
        self.sync = GradSync((), group=group, buffers=self.buffers, counter=counter)

    def begin_backward(self, *, last: bool) -> None:
        """Before each backward of a step; ``last``: the step's last one (the others only
        accumulate into ``.grad``, under ``train.grad_accumulation``)."""
        self.sync.before_forward(last=last)

    def sync_gradients(self) -> None:
        """After the step's last backward, before the optimizer step."""
        self.sync.sync()

    def after_step(self) -> dict[str, float]:
        """After the optimizer step; returns per-step metrics."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {} if self.compressor is None else {"compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        self.sync.close()


def _decode(comp: Any, data: bytes, params: Sequence[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    from ...compression import CompressedTensor

    return [comp.decompress(CompressedTensor.from_bytes(rec, max_numel=p.numel(), expect_shape=tuple(p.shape),
                                                        expect_dtype=p.dtype)).to(p.device)
            for rec, (_, p) in zip(unpack_records(data, len(params)), params, strict=True)]


def _encode(comp: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Each named tensor compressed, as packed wire records."""
    return pack_records([comp.compress(name, t.detach().cpu()).to_bytes() for name, t in tensors])


class AllReduceAgg(Aggregator):
    def __init__(self, model: nn.Module, *, group: Any, counter: C.CommCounter,
                 bucket_bytes: int, compressor: Any = None, local: Collection[str] = (),
                 buffers: Sequence[torch.Tensor] = ()) -> None:
        super().__init__(model, group=group, counter=counter, compressor=compressor, local=local,
                         buffers=buffers)
        self.sync = GradSync(self.named, group=group, bucket_bytes=bucket_bytes, overlap=True,
                             compressor=compressor, buffers=self.buffers, counter=counter)


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


class ParameterServerAgg(Aggregator):
    server = 0
    server_bytes = 0  # bytes through the server (in + out), cumulative

    def sync_gradients(self) -> None:
        super().sync_gradients()  # the buffers' step closed
        if self.n == 1:
            return
        live = drop_unused(self.named, group=self.group, counter=self.counter)
        if not live:
            return
        flat = torch.cat([_grad_or_zeros(p).reshape(-1) for _, p in live])
        nbytes = flat.numel() * flat.element_size()
        if self.rank != self.server:
            if self.compressor is None:
                M.send_tensor(flat, dst=self.server, group=self.group, counter=self.counter)
            else:
                payload = _encode(self.compressor, [(n, _grad_or_zeros(p)) for n, p in live])
                M.send_bytes(payload, dst=self.server, group=self.group, counter=self.counter)
                self.compressor.step()
            mean = M.recv_tensor(flat.shape, dtype=flat.dtype, src=self.server, group=self.group,
                                 device=flat.device)
            _set_flat_grads(live, mean)
            return
        total = flat.clone()
        workers = range(1, self.n)
        if self.compressor is None:
            self.server_bytes += M.recv_sum_(total, srcs=workers, group=self.group)
        else:
            for r in workers:
                data = M.recv_bytes(src=r, group=self.group, max_bytes=64 * nbytes + 4096)
                self.server_bytes += len(data) + 8
                offs = 0
                for d in _decode(self.compressor, data, live):
                    total[offs : offs + d.numel()].add_(d.reshape(-1))
                    offs += d.numel()
            self.compressor.step()
        total.div_(self.n)
        M.send_to_many(total, dsts=workers, group=self.group, counter=self.counter)
        self.server_bytes += (self.n - 1) * nbytes
        _set_flat_grads(live, total)

    def state_dict(self) -> dict[str, Any]:
        return {"server_bytes": self.server_bytes, **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server_bytes = int(state.get("server_bytes", 0))
        super().load_state_dict(state)


def _set_flat_grads(params: Sequence[tuple[str, nn.Parameter]], flat: torch.Tensor) -> None:
    offset = 0
    for _, p in params:
        k = p.numel()
        p.grad = flat[offset : offset + k].view_as(p).clone()
        offset += k


class DecentralizedAgg(Aggregator):
    def __init__(self, model: nn.Module, *, group: Any, counter: C.CommCounter, topology: str,
                 compressor: Any = None, gamma: float | None = None,
                 local: Collection[str] = ()) -> None:
        super().__init__(model, group=group, counter=counter, compressor=compressor, local=local)
        self.topology = topology
        neighbors(topology, max(self.n, 1))  # validates the name
        self.gamma = gamma if gamma is not None else (1.0 if compressor is None else 0.5)
        self.x_hat: dict[int, list[torch.Tensor]] | None = None
        if compressor is not None and self.n > 1:
            # Built after the initial broadcast: every replica (and so every public copy)
            # starts at the same x_0.
            nb = neighbors(topology, self.n)[self.rank]
            self.x_hat = {j: [p.detach().clone() for _, p in self.named] for j in [self.rank, *nb]}

    def _choco(self) -> None:
        nb = neighbors(self.topology, self.n)[self.rank]
        w = mixing_weights(self.topology, self.n)[self.rank]
        params = [p for _, p in self.named]
        assert self.x_hat is not None
        mine = self.x_hat[self.rank]
        diffs = [(n, p.detach() - h) for (n, p), h in zip(self.named, mine, strict=True)]
        payload = _encode(self.compressor, diffs)
        self.compressor.step()
        limit = 64 * sum(p.numel() * p.element_size() for p in params) + 4096
        received = M.exchange_bytes(payload, peers=nb, group=self.group, max_bytes=limit)
        self.counter.add("gossip_send", len(nb) * (payload.numel() + 8))
        own = _decode(self.compressor, payload.numpy().tobytes(), self.named)
        for h, d in zip(mine, own, strict=True):
            h.add_(d)
        for j in nb:
            for h, d in zip(self.x_hat[j], _decode(self.compressor, received[j], self.named), strict=True):
                h.add_(d)
        with torch.no_grad():
            for i, p in enumerate(params):
                delta = torch.zeros_like(p)
                for j in nb:
                    delta.add_(self.x_hat[j][i] - mine[i], alpha=float(w[j]))
                p.add_(delta, alpha=self.gamma)

    def after_step(self) -> dict[str, float]:
        if self.n == 1:
            return {"consensus_distance": 0.0}
        params = [p for _, p in self.named]
        if self.compressor is None:
            with torch.no_grad():
                gossip_average(params, topology=self.topology, group=self.group, counter=self.counter)
        else:
            self._choco()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        # The consensus probe all-gathers every parameter: its traffic is counted with the
        # step's, under its own name, so comm_bytes_per_step holds it.
        probe = C.CommCounter()
        distance = C.consensus_distance(flat, group=self.group, counter=probe)
        self.counter.add("consensus_all_gather", probe.total_bytes)
        return {"consensus_distance": distance}

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.x_hat is not None:  # only with a compressor
            out["x_hat"] = {str(j): list(v) for j, v in self.x_hat.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "x_hat" in state:
            self.x_hat = {int(j): [t.clone() for t in v] for j, v in state["x_hat"].items()}


def build_aggregator(
    aggregation: Any, model: nn.Module, *, group: Any, counter: C.CommCounter,
    bucket_bytes: int, compressor: Any = None, gamma: float | None = None,
    local: Collection[str] = (), buffers: Sequence[torch.Tensor] = (),
) -> Aggregator:
    """The aggregator for a contract ``GradientAggregation`` (or its method name); ``local``
    and ``buffers`` as :class:`Aggregator`'s (Decentralized broadcasts no buffers)."""
    method = aggregation if isinstance(aggregation, str) else aggregation.method
    if method == "AllReduce":
        return AllReduceAgg(model, group=group, counter=counter, bucket_bytes=bucket_bytes,
                            compressor=compressor, local=local, buffers=buffers)
    if method == "ParameterServer":
        return ParameterServerAgg(model, group=group, counter=counter, compressor=compressor,
                                  local=local, buffers=buffers)
    if method == "Decentralized":
        return DecentralizedAgg(model, group=group, counter=counter, topology=aggregation.topology,
                                compressor=compressor, gamma=gamma, local=local)
    raise ValueError(f"unknown aggregation {method!r}; valid: AllReduce, ParameterServer, Decentralized")


class DataParallelEngine(LocalEngine):
    """A replica: the task's forward/backward on this rank's batch, then the aggregator
    combines (``sync``). Under ``grad_accumulation`` the bucketed AllReduce hooks stay
    quiet until the step's last backward (DDP's ``no_sync``), so one exchange per step."""

    def __init__(self, model: nn.Module, task: Any, test: Any, *, ctx: WorkerContext,
                 precision: str, agg: Aggregator, counter: C.CommCounter,
                 local: set[str] | None = None) -> None:
        super().__init__(model, task, test, device=ctx.device, precision=precision)
        self.ctx, self.agg, self.counter = ctx, agg, counter
        self.local = local or set()  # parameter names of Local subgraphs
        self.consensus: list[float] = []

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
        self.agg.begin_backward(last=last)
        return super().forward_backward(batch, weight=weight, last=last)

    def sync(self) -> None:
        self.agg.sync_gradients()

    def grad_sq_norm(self) -> float:
        """With Local subgraphs, ``||g_shared||^2 + mean_r ||g_local,r||^2`` (the same on every
        rank, so clipping keeps the shared parameters equal); else the base norm."""
        if not self.local:
            return super().grad_sq_norm()
        named = list(self.model.named_parameters())
        shared = float(local_grad_sq_norm(p for n, p in named if n not in self.local))
        return shared + self.mean_over_ranks(float(local_grad_sq_norm(p for n, p in named if n in self.local)))

    def after_step(self) -> dict[str, float]:
        extra = self.agg.after_step()
        if "consensus_distance" in extra:
            self.consensus.append(extra["consensus_distance"])
        return extra

    def evaluate(self) -> dict[str, float] | None:
        return super().evaluate() if self.ctx.is_main else None

    def mean_over_ranks(self, value: float) -> float:
        if self.ctx.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        C.all_reduce_(t, group=self.ctx.group)
        return float(t.item()) / self.ctx.world_size

    def log_extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {"comm_bytes": self.counter.total_bytes}
        if self.consensus:
            out["consensus_distance"] = self.consensus[-1]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"aggregator": self.agg.state_dict(), "comm": dict(self.counter.bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.agg.load_state_dict(state["aggregator"])
        for k, v in state["comm"].items():
            self.counter.bytes[k] = int(v)
