"""Clients: local training on a client's own data, hosted many-per-worker.

A worker hosts the clients ``c % world_size == rank`` (FedBuff's stateless clients: any
client, whichever rank is free), keeping per client only its example indices and state (codec residuals, personal parts, SCAFFOLD's ``c_i``); one shared model is
loaded with the round's global weights before each client trains, so memory does not grow
with ``num_clients``. ClientUpdate (McMahan et al. 2017) through the loop's
:class:`~paratrain.training.loop.Trainer`: ``local_epochs`` passes over the partition, each
in the order of a generator seeded by ``(seed, round, client)``, in mini-batches of
``federated.batch_size`` (``None``: the whole partition), under a fresh optimizer at ``lr *
f(round)``. The client returns ``D = w_local - w_global`` (the global keys only), optionally
compressed with error feedback ``e <- D + e - Dec(C(D + e))``.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import TensorDataset

from ...config import ConfigError
from ...config.job import JobConfig
from ...models.state import load_unique_state_dict, unique_state_dict
from ...task.steps import call_model, fetch_batch
from ...training import build_optimizer
from ...training.faults import injected_faults
from ...training.loop import LocalEngine, Trainer
from ...training.stepping import autocast
from .aggregation import fednova_norm, proximal_term, scaffold_client_control
from .drift import ClientControls, optimizer_momentum, pack_control, uses_control
from .personal import PersonalState, client_name
from .privacy import client_privatize
from .privacy.mechanism import dp_generator
from .wire import dense_headers, dense_payload, encode_update, flat_float32

#: test/benchmark fault injection, never in the job: ``CLIENT:FACTOR`` makes that client train
#: its update FACTOR times over (the same update, FACTOR times the work: a slow device)
SLOW_ENV = "PARATRAIN_FAULT_SLOW_CLIENT"


def slow_client() -> tuple[int, int] | None:
    """``(client, factor)`` from :data:`SLOW_ENV` (None when unset); a bad value names it."""
    text = os.environ.get(SLOW_ENV, "").strip()
    if not text:
        return None
    c, _, f = text.partition(":")
    if not (c.isdigit() and f.isdigit() and int(f) >= 1):
        raise ConfigError([(SLOW_ENV, f"expected CLIENT:FACTOR, two integers, FACTOR >= 1 (got {text!r})")])
    return int(c), int(f)


def client_generator(seed: int, round_idx: int, client: int,
                     generator: torch.Generator | None = None) -> torch.Generator:
    """The generator of a client's training order in a round (``generator`` reseeded)."""
    return dp_generator(seed, round_idx, client, salt="fed", generator=generator)


@dataclass
class ClientResult:
    """What one client sends back (status + encoded update)."""

    client: int
    ok: bool
    num_examples: int = 0
    loss: float | None = None
    error: str | None = None
    headers: list[dict[str, Any]] = field(default_factory=list)
    payload: bytes = b""
    info: dict[str, Any] = field(default_factory=dict)  # "steps"; FedNova: "norm"

    def status(self) -> dict[str, Any]:
        return {"client": self.client, "ok": self.ok, "n": self.num_examples, "loss": self.loss,
                "error": self.error, "headers": self.headers, "nbytes": len(self.payload), **self.info}


class ClientEngine(LocalEngine):
    """The base engine plus FedProx's proximal term ``(mu/2)*||w - w_global||^2`` (outside
    autocast, on the fp32 parameters), anchored at the round's global weights."""

    def __init__(self, model: nn.Module, task: Any, *, device: torch.device, precision: str = "fp32",
                 mu: float = 0.0) -> None:
        super().__init__(model, task, None, device=device, precision=precision)
        self.mu = float(mu)
        self.modules = list(model.modules())  # whose training flags a client's round checks
        self.params: list[nn.Parameter] = []
        self.anchors: list[Tensor] = []
        # SCAFFOLD: (parameter, c - c_i) added to its gradient once per optimizer step
        self.correction: list[tuple[nn.Parameter, Tensor]] = []

    def correct(self, correction: Mapping[str, Tensor] | None) -> None:
        """Add ``correction[name]`` to each named parameter's gradient at every step (None: off)."""
        self.correction = [] if correction is None else [
            (p, correction[n]) for n, p in self.model.named_parameters() if n in correction]

    def anchor(self, global_state: Mapping[str, Tensor]) -> None:
        # the global parameters only: a personal part (absent from global_state) is not pulled
        if self.mu <= 0:  # no proximal term: nothing to anchor
            self.params, self.anchors = [], []
            return
        named = [(n, p) for n, p in self.model.named_parameters() if n in global_state]
        self.params = [p for _, p in named]
        self.anchors = [global_state[name].detach() for name, _ in named]

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
        if self.precision == "fp32":  # autocast would do nothing
            loss = self.task.loss(call_model(self.task, self.model, batch), batch)
        else:
            with autocast(self.precision, self.device):
                loss = self.task.loss(call_model(self.task, self.model, batch), batch)
        if self.mu > 0:
            loss = loss + proximal_term(self.params, self.anchors, self.mu)
        (loss * weight).backward() if weight != 1.0 else loss.backward()
        if last:
            for p, corr in self.correction:
                if p.grad is None:
                    p.grad = corr.clone()
                else:
                    p.grad.add_(corr)
        return float(loss.detach())


class FreshOptimizer:
    """The job's ``[train.optimizer]`` over a host's shared model: :meth:`fresh` empties its
    state and restores every group's options at ``lr * lr_scale``, as a new optimizer would
    be, without building one per client and round."""

    def __init__(self, params: Any, spec: Any) -> None:
        self.optimizer = build_optimizer(params, spec)
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.plain = _PlainSGD(self.optimizer) if _PlainSGD.fits(self.optimizer) else None

    def fresh(self, lr_scale: float) -> Any:
        opt = self.optimizer
        opt.state.clear()
        for group, built in zip(opt.param_groups, self.groups, strict=True):
            group.update(built)
            group["lr"] = built["lr"] * lr_scale
        return self.plain if self.plain is not None else opt


class _PlainSGD:
    """A plain CPU ``torch.optim.SGD`` (no momentum, weight decay, Nesterov or maximize)
    stepped as torch does (``p.add_(p.grad, alpha=-lr)``, one ``_foreach_add_``: bit-identical)
    without ``Optimizer.step``'s wrapper, which costs more than a small model's arithmetic.
    A sparse gradient or a global optimizer hook takes torch's own step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.params = [[p for p in g["params"]] for g in optimizer.param_groups]
        # detached aliases: an in-place step through them needs no no_grad block
        self.data = [[p.detach() for p in ps] for ps in self.params]

    @staticmethod
    def fits(opt: torch.optim.Optimizer) -> bool:
        if type(opt) is not torch.optim.SGD:
            return False
        for g in opt.param_groups:
            if (not isinstance(g.get("lr"), float) or g.get("momentum", 0) != 0 or g.get("dampening", 0) != 0
                    or g.get("weight_decay", 0) != 0 or g.get("nesterov") or g.get("maximize")
                    or g.get("differentiable") or g.get("fused")):
                return False
            if any(p.device.type != "cpu" for p in g["params"]):
                return False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            self.optimizer.zero_grad(set_to_none=False)
            return
        for ps in self.params:
            for p in ps:
                p.grad = None

    def step(self) -> None:
        from torch.optim import optimizer as O

        if getattr(O, "_global_optimizer_pre_hooks", None) or getattr(O, "_global_optimizer_post_hooks", None):
            self.optimizer.step()
            return
        todo = []
        for g, ps, data in zip(self.param_groups, self.params, self.data, strict=True):
            grads = [p.grad for p in ps]
            if any(d is not None and d.is_sparse for d in grads):
                self.optimizer.step()
                return
            have = [(x, d) for x, d in zip(data, grads, strict=True) if d is not None]
            todo.append(([x for x, _ in have], [d for _, d in have], g["lr"]))
        for xs, ds, lr in todo:
            if xs:
                torch._foreach_add_(xs, ds, alpha=-lr)


class _ConstantLR:
    """A client's round's scheduler: :meth:`FreshOptimizer.fresh` set its constant rate."""

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


_GATHER_BYTES = 64 << 20  # a client's epoch gathered at once up to this size, else per batch


def row_bytes(dataset: Any, device: torch.device | None) -> int | None:
    """The bytes of one example of a ``TensorDataset`` already on ``device`` (else None)."""
    if not isinstance(dataset, TensorDataset) or not dataset.tensors:
        return None
    if any(device is not None and t.device != device for t in dataset.tensors):
        return None
    return sum(t[:1].numel() * t.element_size() for t in dataset.tensors)


def local_train(engine: ClientEngine, global_state: Mapping[str, Tensor], dataset: Any, indices: Tensor, *,
                train: Any, epochs: int, batch_size: int | None, lr_scale: float = 1.0, generator: torch.Generator,
                device: torch.device | None, optimizer: FreshOptimizer, example_bytes: int | None,
                ) -> tuple[float, int]:
    """Train ``engine.model`` (loaded with ``global_state``) in place on examples ``indices``
    of ``dataset``; returns (mean step loss, optimizer steps)."""
    model = engine.model
    trainer = Trainer(engine, optimizer.fresh(lr_scale), train, 0, scheduler=_ConstantLR())
    engine.anchor(global_state)
    n = int(indices.numel())
    bs = n if batch_size is None else min(batch_size, n)
    acc = int(train.grad_accumulation)
    starts = list(range(0, n, bs))
    total, steps = 0.0, 0
    collate = getattr(engine.task, "collate_fn", None)
    # a TensorDataset already on the device: the epoch's examples gathered once, its batches
    # slices of them (the same rows in the same order as fetch_batch's per-batch gathers)
    whole = example_bytes is not None and n * example_bytes <= _GATHER_BYTES
    if not all(m.training for m in engine.modules):  # train() sets every flag
        model.train()
    for _ in range(epochs):
        order = indices[torch.randperm(n, generator=generator)]
        if whole:
            rows = tuple(t[order] for t in dataset.tensors)
        for g in range(0, len(starts), acc):
            if whole:
                batches = [tuple(t[a : a + bs] for t in rows) for a in starts[g : g + acc]]
            else:
                batches = [fetch_batch(dataset, order[a : a + bs], device, collate=collate)
                           for a in starts[g : g + acc]]
            total += trainer.step(batches)
            steps += 1
    return total / max(steps, 1), steps


class _DenseDelta:
    """A dense float32 update ``local - global`` as the bytes :func:`encode_update` sends:
    with contiguous float32 CPU tensors (little-endian host) one ``cat`` into a kept buffer
    and one in-place subtraction per client (the same float32 differences)."""

    def __init__(self, global_state: Mapping[str, Tensor], slots: Mapping[str, Tensor]) -> None:
        self.keys = list(global_state)
        self.headers = dense_headers(global_state)
        self.before = flat_float32(list(global_state.values())).cpu()
        own = [slots[k].detach() for k in self.keys]
        self.views: list[Tensor] | None = None
        if own and sys.byteorder == "little" and all(
                t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in own):
            self.views = [t.view(-1) for t in own]
            self.buffer = torch.empty_like(self.before)
            self.array = self.buffer.numpy()

    def payload(self, local: Mapping[str, Tensor]) -> bytes:
        if self.views is None:
            return dense_payload(flat_float32([local[k] for k in self.keys]).cpu() - self.before)
        torch.cat(self.views, out=self.buffer)
        self.buffer.sub_(self.before)
        return self.array.tobytes()


class ClientHost:
    """The clients one worker process hosts and the single model they share."""

    def __init__(self, job: JobConfig, *, rank: int, world_size: int, model: nn.Module, task: Any,
                 dataset: Any, partitions: list[np.ndarray], device: torch.device | None = None,
                 personal_keys: Sequence[str] = ()) -> None:
        strat: Any = job.strategy
        self.job, self.rank, self.world_size, self.model = job, rank, world_size, model
        self.device = device or torch.device("cpu")
        self.dataset = dataset
        self.hosted = [c for c in range(strat.num_clients) if c % world_size == rank]
        self.method = str(getattr(strat.aggregation, "method", ""))
        # only indices per client: the data is shared, never copied up front; FedBuff's clients
        # are stateless and trained by whichever rank is free: every client's
        trains = range(strat.num_clients) if self.method == "FedBuff" else self.hosted
        self.indices = {c: torch.from_numpy(partitions[c].astype(np.int64)) for c in trains}
        self.engine = ClientEngine(model, task, device=self.device, precision=job.train.precision,
                                   mu=float(getattr(strat.aggregation, "mu", 0.0) or 0.0))
        self.faults = injected_faults()  # test/demo hook, never in the job (training.faults)
        self.slow = slow_client()  # likewise (SLOW_ENV)
        self.codec_state: dict[int, dict[str, Any]] = {}
        self.personal = PersonalState(model, personal_keys, self.hosted) if personal_keys else None
        self.controls = ClientControls() if uses_control(strat.aggregation) else None  # SCAFFOLD c_i
        self.trained = 0
        self.dp = job.federated.dp  # [federated.dp]: clip (and local noise) before compressing
        # the shared model's distinct tensors, read and written in place for every client (the
        # model keeps them while the host lives: loads are copies)
        self.slots = unique_state_dict(model, keep_vars=True)
        self.optimizer: FreshOptimizer | None = None  # built at the first client's training
        self.generator = torch.Generator()  # reseeded for every client (client_generator)
        self.example_bytes = row_bytes(dataset, self.device)
        self._global: tuple[list[tuple[Tensor, int]], _DenseDelta] | None = None
        self._dst = [t.detach() for t in self.slots.values()]  # aliases a load copies into

    def hosts(self, client: int) -> bool:
        return client % self.world_size == self.rank

    def train_one(self, client: int, round_idx: int, global_state: Mapping[str, Tensor],
                  lr_scale: float = 1.0, *, control: Mapping[str, Tensor] | None = None) -> ClientResult:
        """Train ``client`` for one round from ``global_state`` at ``lr * lr_scale``; never
        raises. ``control``: SCAFFOLD's server control variate ``c`` (required with it). A slow
        client (:data:`SLOW_ENV`) trains FACTOR times over (a stateless client: the same update)."""
        reps = self.slow[1] if self.slow is not None and self.slow[0] == client else 1
        for _ in range(reps):
            res = self._train_once(client, round_idx, global_state, lr_scale, control)
        self.trained -= reps - 1  # one update
        return res

    def _train_once(self, client: int, round_idx: int, global_state: Mapping[str, Tensor], lr_scale: float,
                    control: Mapping[str, Tensor] | None) -> ClientResult:
        if client not in self.indices:
            raise ValueError(f"{client_name(client)} is not hosted by rank {self.rank}")
        idx = self.indices[client]
        n = int(idx.numel())
        try:
            if client in self.faults.fail_clients:
                raise RuntimeError(f"injected failure in {client_name(client)} (PARATRAIN_FAULTS fail_clients)")
            if n == 0:
                raise RuntimeError(f"{client_name(client)} has no training examples")
            self._load({**global_state, **self.personal.of(client)} if self.personal else global_state)
            c_i = self._correct(client, control)
            opts = self.job.federated
            if self.optimizer is None:
                self.optimizer = FreshOptimizer(self.model.parameters(), self.job.train.optimizer)
            loss, steps = local_train(
                self.engine, global_state, self.dataset, idx, train=self.job.train, epochs=opts.local_epochs,
                batch_size=opts.batch_size, lr_scale=lr_scale, device=self.device, optimizer=self.optimizer,
                generator=client_generator(self.job.run.seed, round_idx, client, self.generator),
                example_bytes=self.example_bytes)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{client_name(client)}: local loss is {loss}")
            local = {k: t.detach() for k, t in self.slots.items()}
            comp = self._compressor(client)
            if (comp is None and self.dp is None and client not in self.faults.byzantine_clients
                    and client not in self.faults.corrupt_clients):
                # the same bytes and headers as encode_update, without a tensor per key
                dense = self._dense(global_state)
                headers, payload = [dict(h) for h in dense.headers], dense.payload(local)
            else:
                headers, payload = self._encode(client, round_idx, global_state, local, comp)
            info: dict[str, Any] = {"steps": steps}
            if self.method == "FedNova":
                info["norm"] = fednova_norm(steps, optimizer_momentum(self.job.train.optimizer))
            if c_i is not None and control is not None and self.controls is not None:
                new = scaffold_client_control(
                    c_i, {k: v.cpu() for k, v in control.items()},
                    {k: global_state[k].cpu() for k in control}, {k: local[k].cpu() for k in control},
                    steps=steps, lr=self.job.train.optimizer.lr * lr_scale)
                dc = {k: (new[k].double() - c_i[k].double()).float() for k in new}
                more_h, more_p = encode_update(pack_control(dc))
                headers, payload = headers + more_h, payload + more_p
            if comp is not None:  # its codec state (error-feedback residuals), checkpointed
                state = comp.codec.state_dict()
                if any(isinstance(t, Tensor) for t in tree_leaves(state)):
                    self.codec_state[client] = state
                else:
                    self.codec_state.pop(client, None)
            if c_i is not None and self.controls is not None:
                self.controls.keep(client, new)
            if self.personal is not None:
                self.personal.keep(client, self.model)
            self.trained += 1
            return ClientResult(client, True, n, loss, None, headers, payload, info)
        except Exception as e:  # noqa: BLE001 - a failing client is recorded, not fatal
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            return ClientResult(client, False, n, None, tb)
        finally:
            self.engine.correct(None)

    def _encode(self, client: int, round_idx: int, global_state: Mapping[str, Tensor],
                local: Mapping[str, Tensor], comp: Any) -> tuple[list[dict[str, Any]], bytes]:
        """The update ``local - global`` per tensor through DP, the fault hooks and the codec."""
        delta = {k: (local[k].float() - g.detach().float()).cpu() for k, g in global_state.items()}
        if self.dp is not None:  # DP-FedAvg's client part (.privacy)
            delta = client_privatize(self.dp, delta, seed=self.job.run.seed, round_idx=round_idx, client=client,
                                     floating=[k for k, g in global_state.items() if g.is_floating_point()])
        if client in self.faults.byzantine_clients:
            delta = {k: v * self.faults.byzantine_scale for k, v in delta.items()}
        if client in self.faults.corrupt_clients:
            first = next(iter(delta))
            delta[first] = delta[first].reshape(-1)[:-1].clone()
        return encode_update(delta, compress=None if comp is None else (
            lambda name, t: comp.compress(name, t, step=round_idx).to_bytes()))

    def _dense(self, global_state: Mapping[str, Tensor]) -> _DenseDelta:
        """The dense update's encoder, kept while the same unchanged tensors come back."""
        try:
            key = [(t, t._version) for t in global_state.values()]
        except RuntimeError:  # an inference tensor has no version counter: nothing is kept
            return _DenseDelta(global_state, self.slots)
        cached = self._global
        if (cached is None or len(cached[0]) != len(key)
                or not all(a is b and va == vb for (a, va), (b, vb) in zip(cached[0], key, strict=True))):
            cached = self._global = (key, _DenseDelta(global_state, self.slots))
        return cached[1]

    def _correct(self, client: int, control: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
        """SCAFFOLD: set the engine's gradient correction ``c - c_i``; returns ``c_i``."""
        if self.controls is None:
            return None
        if control is None:
            raise ValueError(f"{client_name(client)}: SCAFFOLD needs the server's control variate c")
        c_i = self.controls.get(client, control)
        self.engine.correct({k: (c.detach().cpu().double() - c_i[k].double()).to(
            device=self.device, dtype=c.dtype) for k, c in control.items()})
        return c_i

    def _load(self, global_state: Mapping[str, Tensor]) -> None:
        """Copy the global weights into the shared model in place (cheaper than loading)."""
        if global_state.keys() != self.slots.keys():
            load_unique_state_dict(self.model, global_state)  # the KeyError naming the differences
        # a tied weight is one entry; copy_ per tensor (one call on CPU)
        src = [global_state[name] for name in self.slots]
        if self.device.type == "cpu":
            torch._foreach_copy_(self._dst, src)
        else:
            for t, v in zip(self._dst, src, strict=True):
                t.copy_(v)

    def _compressor(self, client: int) -> Any:
        """The job's ``[compression]`` for ``client`` (None without one), seeded by (job seed,
        client) so that random codecs are reproducible, its codec state loaded."""
        if self.job.compression is None or getattr(self.job.compression, "method", "None") == "None":
            return None
        from ...compression import Compressor

        h = hashlib.blake2b(f"fedcomp|{self.job.run.seed}|{client}".encode(), digest_size=8).digest()
        comp = Compressor(self.job.compression, seed=int.from_bytes(h, "little") & ((1 << 62) - 1))
        if self.codec_state.get(client):
            comp.codec.load_state_dict(self.codec_state[client])
        return comp

    def state_dict(self) -> dict[str, Any]:
        """Per-client codec state, personal parts and control variates, keyed ``client-<c>``."""
        out: dict[str, Any] = {"codec": {client_name(c): s for c, s in self.codec_state.items() if s}}
        if self.personal is not None:
            out["personal"] = self.personal.state_dict()
        if self.controls is not None:
            out["control"] = self.controls.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.codec_state = {}
        for name, s in dict(state.get("codec", {})).items():
            c = int(str(name).removeprefix("client-"))
            if not self.hosts(c):
                raise ValueError(f"worker checkpoint of rank {self.rank} holds {name}, hosted elsewhere")
            self.codec_state[c] = s
        if self.personal is not None:
            self.personal.load_state_dict(dict(state.get("personal", {})), rank=self.rank)
        if self.controls is not None:
            self.controls.load_state_dict(dict(state.get("control", {})), self.hosts)
