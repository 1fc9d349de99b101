"""Clients: local training on a client's own data, hosted many-per-worker.

A worker process hosts the clients ``c`` with ``c % world_size == rank``. It keeps, per
hosted client, only the client's example indices and (with stateful compression) its
error-feedback residual; the *model* is one ``nn.Module`` per worker that is loaded
with the round's global weights before each client trains, so memory does not grow
with ``num_clients``.

Local training (McMahan et al. 2017, ClientUpdate): ``E = local_epochs`` passes over
the client's data in mini-batches of ``B = batch_size`` (``None`` = the whole client
dataset as one batch: with E = 1 this is FedSGD), a fresh optimizer from the job's
``[train.optimizer]`` each round, shuffled by a generator seeded by
``(seed, round, client)``. With FedProx the loss is
``CE + (μ/2)·‖w − w_global‖²`` (global weights detached). The client returns the
delta ``Δ = w_local − w_global``, optionally compressed (error feedback keeps
``e ← Δ + e − D(C(Δ + e))`` per client, here on the client).
"""

from __future__ import annotations

import hashlib
import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ...config.job import JobConfig
from ...training import build_optimizer
from ...training.faults import injected_faults
from .aggregation import proximal_term
from .wire import encode_update

__all__ = ["ClientResult", "ClientHost", "client_generator", "client_name", "local_train"]


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

    def status(self) -> dict[str, Any]:
        return {
            "client": self.client, "ok": self.ok, "n": self.num_examples, "loss": self.loss,
            "error": self.error, "headers": self.headers, "nbytes": len(self.payload),
        }


def local_train(
    model: nn.Module,
    global_state: Mapping[str, Tensor],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int | None,
    optimizer: Any,
    mu: float = 0.0,
    generator: torch.Generator,
) -> float:
    """Train ``model`` (already loaded with ``global_state``) in place; mean batch loss."""
    opt = build_optimizer(model.parameters(), optimizer)
    named = list(model.named_parameters())
    anchors = [global_state[name].detach() for name, _ in named] if mu > 0 else []
    n = len(y)
    bs = n if batch_size is None else min(batch_size, n)
    total, steps = 0.0, 0
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            if mu > 0:
                loss = loss + proximal_term([p for _, p in named], anchors, mu)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
    return total / max(steps, 1)


class ClientHost:
    """The clients one worker process hosts and the single model they share."""

    def __init__(
        self,
        job: JobConfig,
        *,
        rank: int,
        world_size: int,
        model: nn.Module,
        train_x: Tensor,
        train_y: Tensor,
        partitions: list[np.ndarray],
        device: torch.device | None = None,
    ) -> None:
        strat: Any = job.strategy
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.model = model
        self.device = device or torch.device("cpu")
        self.x, self.y = train_x, train_y
        self.hosted = [c for c in range(strat.num_clients) if c % world_size == rank]
        # Only indices per client: the data itself is shared and never copied up front.
        self.indices: dict[int, Tensor] = {
            c: torch.from_numpy(partitions[c].astype(np.int64)) for c in self.hosted
        }
        self.mu = float(getattr(strat.aggregation, "mu", 0.0) or 0.0)
        faults = injected_faults()  # test/demo hook, never in the job (training.faults)
        self.fail = set(faults.fail_clients)
        self.byzantine = set(faults.byzantine_clients)
        self.byzantine_scale = faults.byzantine_scale
        self.corrupt = set(faults.corrupt_clients)
        self.codec_state: dict[int, dict[str, Any]] = {}
        self.trained = 0

    # ------------------------------------------------------------------ training

    def hosts(self, client: int) -> bool:
        return client % self.world_size == self.rank

    def train_one(self, client: int, round_idx: int, global_state: Mapping[str, Tensor]) -> ClientResult:
        """Train ``client`` for one round from ``global_state``; never raises."""
        if not self.hosts(client):
            raise ValueError(f"{client_name(client)} is not hosted by rank {self.rank}")
        idx = self.indices[client]
        n = int(idx.numel())
        try:
            if client in self.fail:
                raise RuntimeError(f"injected failure in {client_name(client)} (PARATRAIN_FAULTS fail_clients)")
            if n == 0:
                raise RuntimeError(f"{client_name(client)} has no training examples")
            self._load(global_state)
            opts = self.job.federated
            loss = local_train(
                self.model, global_state, self.x[idx].to(self.device), self.y[idx].to(self.device),
                epochs=opts.local_epochs, batch_size=opts.batch_size,
                optimizer=self.job.train.optimizer, mu=self.mu,
                generator=client_generator(self.job.run.seed, round_idx, client),
            )
            if not math.isfinite(loss):
                raise FloatingPointError(f"{client_name(client)}: local loss is {loss}")
            local = self.model.state_dict()
            delta = {
                k: (local[k].detach().float() - g.detach().float()).cpu()
                for k, g in global_state.items()
            }
            if client in self.byzantine:
                delta = {k: v * self.byzantine_scale for k, v in delta.items()}
            if client in self.corrupt:
                first = next(iter(delta))
                delta[first] = delta[first].reshape(-1)[:-1].clone()
            comp = self._compressor(client, round_idx)
            headers, payload = encode_update(delta, compress=comp)
            if comp is not None:
                comp.commit()
            self.trained += 1
            return ClientResult(client, True, n, loss, None, headers, payload)
        except Exception as e:  # noqa: BLE001 - a failing client is recorded, not fatal
            tb = traceback.format_exception_only(type(e), e)[-1].strip()
            return ClientResult(client, False, n, None, tb)

    @torch.no_grad()
    def _load(self, global_state: Mapping[str, Tensor]) -> None:
        """Copy the global weights into the shared model (cheaper than load_state_dict)."""
        own = self.model.state_dict(keep_vars=True)
        if own.keys() != global_state.keys():
            self.model.load_state_dict(global_state)  # raises with the key differences
            return
        for k, t in own.items():
            t.data.copy_(global_state[k])

    # --------------------------------------------------------------- compression

    def _compressor(self, client: int, round_idx: int) -> Any:
        if self.job.compression is None or getattr(self.job.compression, "method", "None") == "None":
            return None
        from .compress import client_compress_fn

        return client_compress_fn(self, client, round_idx)

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Per-client codec state (error-feedback residuals), keyed ``client-<c>``."""
        return {"codec": {client_name(c): s for c, s in self.codec_state.items() if s}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.codec_state = {}
        for name, s in dict(state.get("codec", {})).items():
            c = int(str(name).removeprefix("client-"))
            if not self.hosts(c):
                raise ValueError(f"worker checkpoint of rank {self.rank} holds {name}, hosted elsewhere")
            self.codec_state[c] = s
