"""Clients: local training on a client's own data, hosted many-per-worker.

A worker process hosts the clients ``c`` with ``c % world_size == rank``. It keeps, per
hosted client, only the client's example indices and (with stateful compression) its
error-feedback residual; the *model* is one ``nn.Module`` per worker that is loaded
with the round's global weights before each client trains, so memory does not grow
with ``num_clients``.

Local training (McMahan et al. 2017, ClientUpdate) of the job's
:class:`~paratrain.task.Task`, through the one loop's :class:`~paratrain.training.loop.Trainer`
and a :class:`ClientEngine` (a ``LocalEngine``): ``E = local_epochs`` passes over the
client's examples (its partition of the task's training set, gathered with
``fetch_batch``), each in the order ``torch.randperm(n, generator)`` of a generator seeded
by ``(seed, round, client)`` and carried across the epochs, in mini-batches of
``B = federated.batch_size`` (``None`` = the client's whole dataset as one batch: with
E = 1 this is FedSGD). A client optimizer step takes ``train.grad_accumulation`` batches
of the epoch (fewer at its end), weighted by their sizes, clips to ``train.grad_clip_norm``,
runs forward and loss under ``train.precision``; a fresh optimizer from the job's
``[train.optimizer]`` (``weight_decay`` included) each round, at the round's learning rate
``lr * f(round)`` (``lr_scale``, from the server's round schedule:
:class:`~.server.RoundSchedule`). With FedProx the loss is
``task.loss + (mu/2)*||w - w_global||^2`` (global weights detached). The client returns the
delta ``D = w_local - w_global``, optionally compressed (error feedback keeps
``e <- D + e - Dec(C(D + e))`` per client, here on the client). With Local subgraphs
(FedPer / FedBN, :mod:`.personal`) the client loads ``(w_global, w_P^c)``, keeps its trained
personal part ``w_P^c`` and ``D`` covers the global keys only. SCAFFOLD and FedNova's
client parts (:mod:`.drift`): with SCAFFOLD the engine adds ``c - c_i`` to each step's
gradient, the client updates its ``c_i`` (option II) and appends ``dc_i`` to its uplink; every
status carries the client's local step count ``steps`` and, with FedNova, its normaliser ``norm``.
"""

from __future__ import annotations

import hashlib
import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ...config.job import JobConfig
from ...models.state import load_unique_state_dict, unique_state_dict
from ...task.steps import call_model, fetch_batch
from ...training import build_optimizer
from ...training.faults import injected_faults
from ...training.loop import LocalEngine, Trainer
from ...training.stepping import autocast
from .aggregation import fednova_norm, proximal_term, scaffold_client_control
from .drift import ClientControls, optimizer_momentum, pack_control, uses_control
from .personal import PersonalState
from .privacy import client_privatize
from .wire import encode_update

__all__ = ["ClientResult", "ClientHost", "ClientEngine", "client_generator", "client_name",
           "local_train"]


def client_name(c: int) -> str:
    return f"client-{c}"


def client_generator(seed: int, round_idx: int, client: int) -> torch.Generator:
    """A generator determined by ``(seed, round, client)`` (blake2b, stable everywhere)."""
    h = hashlib.blake2b(f"fed|{seed}|{round_idx}|{client}".encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return g


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
        return {
            "client": self.client, "ok": self.ok, "n": self.num_examples, "loss": self.loss,
            "error": self.error, "headers": self.headers, "nbytes": len(self.payload), **self.info,
        }


class ClientEngine(LocalEngine):
    """The base engine plus FedProx's proximal term ``(mu/2)*||w - w_global||^2`` (outside
    autocast, on the fp32 parameters), anchored at the round's global weights."""

    def __init__(self, model: nn.Module, task: Any, *, device: torch.device, precision: str = "fp32",
                 mu: float = 0.0) -> None:
        super().__init__(model, task, None, device=device, precision=precision)
        self.mu = float(mu)
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
        named = [(n, p) for n, p in self.model.named_parameters() if n in global_state]
        self.params = [p for _, p in named]
        self.anchors = [global_state[name].detach() for name, _ in named] if self.mu > 0 else []

    def forward_backward(self, batch: Any, *, weight: float, last: bool) -> float:
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


def local_train(
    engine: ClientEngine,
    global_state: Mapping[str, Tensor],
    dataset: Any,
    indices: Tensor,
    *,
    train: Any,
    epochs: int,
    batch_size: int | None,
    lr_scale: float = 1.0,
    generator: torch.Generator,
    device: torch.device | None = None,
) -> tuple[float, int]:
    """Train ``engine.model`` (already loaded with ``global_state``) in place on examples
    ``indices`` of ``dataset``; returns (mean step loss, optimizer steps). ``train`` is the
    job's ``[train]`` (optimizer, grad_accumulation, grad_clip_norm)."""
    model = engine.model
    opt = build_optimizer(model.parameters(), train.optimizer)
    # The round's learning rate, constant over the round's steps: lr * f(round).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: lr_scale)
    trainer = Trainer(engine, opt, train, 0, scheduler=sched)
    engine.anchor(global_state)
    n = int(indices.numel())
    bs = n if batch_size is None else min(batch_size, n)
    acc = int(train.grad_accumulation)
    starts = list(range(0, n, bs))
    total, steps = 0.0, 0
    collate = getattr(engine.task, "collate_fn", None)
    model.train()
    for _ in range(epochs):
        order = indices[torch.randperm(n, generator=generator)]
        for g in range(0, len(starts), acc):
            batches = [fetch_batch(dataset, order[a : a + bs], device, collate=collate)
                       for a in starts[g : g + acc]]
            total += trainer.step(batches)
            steps += 1
    return total / max(steps, 1), steps


class ClientHost:
    """The clients one worker process hosts and the single model they share."""

    def __init__(
        self,
        job: JobConfig,
        *,
        rank: int,
        world_size: int,
        model: nn.Module,
        task: Any,
        dataset: Any,
        partitions: list[np.ndarray],
        device: torch.device | None = None,
        personal_keys: Sequence[str] = (),
    ) -> None:
        strat: Any = job.strategy
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.model = model
        self.device = device or torch.device("cpu")
        self.task, self.dataset = task, dataset
        self.hosted = [c for c in range(strat.num_clients) if c % world_size == rank]
        # Only indices per client: the data itself is shared and never copied up front.
        self.indices: dict[int, Tensor] = {
            c: torch.from_numpy(partitions[c].astype(np.int64)) for c in self.hosted
        }
        self.mu = float(getattr(strat.aggregation, "mu", 0.0) or 0.0)
        self.engine = ClientEngine(model, task, device=self.device, precision=job.train.precision,
                                   mu=self.mu)
        faults = injected_faults()  # test/demo hook, never in the job (training.faults)
        self.fail = set(faults.fail_clients)
        self.byzantine = set(faults.byzantine_clients)
        self.byzantine_scale = faults.byzantine_scale
        self.corrupt = set(faults.corrupt_clients)
        self.codec_state: dict[int, dict[str, Any]] = {}
        # each hosted client's personal part (Local subgraphs), None without any
        self.personal = PersonalState(model, personal_keys, self.hosted) if personal_keys else None
        self.method = str(getattr(strat.aggregation, "method", ""))
        self.controls = ClientControls() if uses_control(strat.aggregation) else None  # SCAFFOLD c_i
        self.trained = 0
        self.dp = job.federated.dp  # [federated.dp]: clip (and local noise) before compressing

    # ------------------------------------------------------------------ training

    def hosts(self, client: int) -> bool:
        return client % self.world_size == self.rank

    def train_one(self, client: int, round_idx: int, global_state: Mapping[str, Tensor],
                  lr_scale: float = 1.0, *, control: Mapping[str, Tensor] | None = None) -> ClientResult:
        """Train ``client`` for one round from ``global_state`` at learning rate
        ``lr * lr_scale``; never raises. ``control``: SCAFFOLD's server control variate ``c``
        of this round (required with SCAFFOLD, ignored otherwise)."""
        if not self.hosts(client):
            raise ValueError(f"{client_name(client)} is not hosted by rank {self.rank}")
        idx = self.indices[client]
        n = int(idx.numel())
        try:
            if client in self.fail:
                raise RuntimeError(f"injected failure in {client_name(client)} (PARATRAIN_FAULTS fail_clients)")
            if n == 0:
                raise RuntimeError(f"{client_name(client)} has no training examples")
            self._load({**global_state, **self.personal.of(client)} if self.personal else global_state)
            c_i = self._correct(client, control)
            opts = self.job.federated
            loss, steps = local_train(
                self.engine, global_state, self.dataset, idx, train=self.job.train,
                epochs=opts.local_epochs, batch_size=opts.batch_size, lr_scale=lr_scale,
                generator=client_generator(self.job.run.seed, round_idx, client), device=self.device,
            )
            if not math.isfinite(loss):
                raise FloatingPointError(f"{client_name(client)}: local loss is {loss}")
            local = unique_state_dict(self.model)
            delta = {
                k: (local[k].detach().float() - g.detach().float()).cpu()
                for k, g in global_state.items()
            }
            if self.dp is not None:  # DP-FedAvg's client part (.privacy.dp)
                delta = client_privatize(self.dp, delta, seed=self.job.run.seed, round_idx=round_idx, client=client,
                                         floating=[k for k, g in global_state.items() if g.is_floating_point()])
            if client in self.byzantine:
                delta = {k: v * self.byzantine_scale for k, v in delta.items()}
            if client in self.corrupt:
                first = next(iter(delta))
                delta[first] = delta[first].reshape(-1)[:-1].clone()
            comp = self._compressor(client, round_idx)
            headers, payload = encode_update(delta, compress=comp)
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
            if comp is not None:
                comp.commit()
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

    @torch.no_grad()
    def _load(self, global_state: Mapping[str, Tensor]) -> None:
        """Copy the global weights into the shared model in place (cheaper than load_state_dict)."""
        load_unique_state_dict(self.model, global_state)  # a tied weight is one entry

    # --------------------------------------------------------------- compression

    def _compressor(self, client: int, round_idx: int) -> Any:
        if self.job.compression is None or getattr(self.job.compression, "method", "None") == "None":
            return None
        from .compress import ClientCompressor

        return ClientCompressor(self.job.compression, self.codec_state, seed=self.job.run.seed,
                                client=client, round_idx=round_idx)

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Per-client codec state (error-feedback residuals) and personal parts, keyed
        ``client-<c>``."""
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
