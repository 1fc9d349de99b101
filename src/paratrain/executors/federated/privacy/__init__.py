"""Client-level differential privacy for the Federated strategy (``[federated.dp]``):
DP-FedAvg on the federated round (the maths and the privacy spent: :mod:`.mechanism`), the
server's and the clients' parts, the job's checks and ``validate``'s description.

Central mode (:meth:`ServerPrivacy.privatize`) releases, with ``w_k = min(n_k, c)`` (``c =
weight_cap``), ``D = (sum_k w_k clip(D_k, S) + N(0, (z_D S c)^2 I)) / (q W)``, ``W = sum_all
min(n_k, c)``, as the round's only update; with ``z = 0``, ``S = inf``, ``c >= max n_k`` and
every client selected this is FedAvg bit for bit. Local mode (:func:`client_privatize`): each
client sends ``clip(D_k, S) + N(0, (z S)^2 I)``, accounted at ``q = 1``.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..aggregation._common import linear_combination
from ..selection import num_random, select_clients
from .mechanism import (
    PrivacyAccountant,
    adaptive_clip,
    add_noise,
    clip_update,
    dp_generator,
    last_round_within,
    rdp_epsilon,
    update_noise_multiplier,
)

# server steps that take the round's mean update: the noised mean serves them
CENTRAL_AGGREGATIONS = ("FedAvg", "FedProx", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad")


def sample_rate(strategy: Any, mode: str = "central") -> float:
    """The expected fraction of clients per round: ``k / N`` for ``Random``, else 1 (the same
    clients every round; local mode: no amplification against the server)."""
    sel = strategy.client_selection
    if mode == "local" or getattr(sel, "method", None) != "Random":
        return 1.0
    n = int(strategy.num_clients)
    return num_random(float(sel.fraction), n) / n


class ServerPrivacy:
    """The server's DP state: the current clip, the accountant; ``privatize`` per round."""

    def __init__(self, spec: Any, *, seed: int, sample_rate: float, num_clients: int,
                 total_weight: float) -> None:
        self.spec = spec
        self.mode = str(spec.mode)
        self.seed = int(seed)
        self.q = float(sample_rate)
        self.z = float(spec.noise_multiplier)
        self.cap = int(spec.weight_cap)
        self.expected_weight = self.q * float(total_weight)  # q W
        self.expected_clients = self.q * int(num_clients)  # q N
        self.adaptive = spec.target_quantile is not None
        self.count_std = (float(spec.clipped_count_stddev) if spec.clipped_count_stddev is not None
                          else self.expected_clients / 20.0) if self.adaptive else None
        self.z_update = update_noise_multiplier(self.z, self.count_std)
        self.clip: float | None = None if spec.clip is None else float(spec.clip)
        self.accountant = PrivacyAccountant(spec.delta)
        self.target = spec.target_epsilon
        self.stop_note: str | None = None

    def privatize(self, round_idx: int, global_state: Mapping[str, Tensor],
                  updates: Sequence[Mapping[str, Tensor]], weights: Sequence[float],
                  ) -> tuple[list[dict[str, Tensor]], list[float], dict[str, Any]]:
        """Central: ``([D], [1.0], record)`` with ``D`` the noised mean above; local: the
        updates as they came (each already noised by its client)."""
        rec: dict[str, Any] = {"dp_clip": self.clip}
        if self.mode == "local":
            return [dict(u) for u in updates], list(weights), rec
        keys = [k for k, g in global_state.items() if g.is_floating_point()]
        clipped: list[dict[str, Tensor]] = []
        unclipped = 0
        for u in updates:
            c, norm = clip_update({k: u[k] for k in keys}, self.clip)
            clipped.append(c)
            # (a client's own clip of a fixed S may leave ||D|| a rounding above S)
            unclipped += int(self.clip is None or norm <= self.clip * (1 + 1e-6))
        w = [float(min(n, self.cap)) for n in weights]
        total = linear_combination(clipped, w)
        std = self.z_update * (self.clip or 0.0) * self.cap
        noised = add_noise(total, std, dp_generator(self.seed, round_idx))
        step: dict[str, Tensor] = {k: torch.zeros(g.shape, dtype=torch.float64)
                                   for k, g in global_state.items()}
        step.update({k: v / self.expected_weight for k, v in noised.items()})
        rec.update(dp_unclipped=unclipped, dp_noise_std=std / self.expected_weight)
        if self.adaptive and self.clip is not None:
            self.clip, frac = adaptive_clip(
                self.clip, unclipped, self.expected_clients, target_quantile=float(self.spec.target_quantile),
                learning_rate=float(self.spec.clip_learning_rate), count_stddev=float(self.count_std or 0.0),
                generator=dp_generator(self.seed, round_idx, salt="dpclip"))
            rec.update(dp_unclipped_fraction_noised=frac, dp_next_clip=self.clip)
        return [step], [1.0], rec

    def account(self, round_idx: int) -> dict[str, Any]:
        """Book round ``round_idx``; the record's ``epsilon``, ``delta`` (and ``dp_stop``)."""
        self.accountant.step(self.z, self.q)
        rec: dict[str, Any] = {"epsilon": self.accountant.epsilon(), "delta": self.accountant.delta}
        if not self.allows_next_round():
            rec["dp_stop"] = self.stop_note
        return rec

    def allows_next_round(self) -> bool:
        """False (``stop_note`` set and printed once) when one more round would pass ``target_epsilon``."""
        if self.target is None:
            return True
        nxt = self.accountant.epsilon_after(self.z, self.q)
        if nxt <= float(self.target):
            return True
        done = self.accountant.rounds
        if self.stop_note is None:
            self.stop_note = (
                f"differential privacy budget: stopping after round {done}, since round "
                f"{done + 1} would spend epsilon {nxt:.4g} > federated.dp.target_epsilon "
                f"{float(self.target):g} (delta {self.accountant.delta:g}; spent "
                f"{self.accountant.epsilon():.4g})")
            print(f"paratrain: {self.stop_note}", file=sys.stderr, flush=True)
        return False

    def summary(self) -> dict[str, Any]:
        eps = self.accountant.epsilon()
        out: dict[str, Any] = {
            "epsilon": eps if math.isfinite(eps) else None, "delta": self.accountant.delta,
            "dp_mode": self.mode, "dp_noise_multiplier": self.z, "dp_sample_rate": self.q,
            "dp_clip": self.clip, "dp_target_epsilon": self.target,
            "dp_accountant": "opacus RDPAccountant (sampled Gaussian, Poisson sampling assumed)",
        }
        if self.stop_note is not None:
            out["dp_stopped"] = self.stop_note
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "clip": -1.0 if self.clip is None else self.clip,
                "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        clip = float(state["clip"])
        self.clip = None if clip < 0 else clip
        self.accountant.load_state_dict(state["accountant"])


def build_server_privacy(job: Any, client_sizes: Sequence[int] | None = None,
                         client_tags: Mapping[int, Sequence[str]] | None = None) -> ServerPrivacy | None:
    """The job's :class:`ServerPrivacy` (None without ``[federated.dp]``); ``W`` sums ``min(n_k,
    weight_cap)`` over the clients that can take part (under ``ByCapability`` the set
    ``client_tags`` select). ``client_sizes`` are needed for ``weight_cap > 1``."""
    spec = job.federated.dp
    if spec is None:
        return None
    strat = job.strategy
    members = list(range(int(strat.num_clients)))
    if getattr(strat.client_selection, "method", None) == "ByCapability":
        members = select_clients(strat.client_selection, num_clients=len(members), round_idx=0,
                                 seed=job.run.seed, client_tags=client_tags)
    if int(spec.weight_cap) == 1:
        total = float(len(members))
    elif client_sizes is None:
        raise ValueError("federated.dp.weight_cap > 1 needs every client's example count")
    else:
        total = float(sum(min(int(client_sizes[c]), int(spec.weight_cap)) for c in members))
    return ServerPrivacy(spec, seed=job.run.seed, sample_rate=sample_rate(strat, spec.mode),
                         num_clients=len(members), total_weight=total)


def client_privatize(spec: Any, delta: Mapping[str, Tensor], *, seed: int, round_idx: int,
                     client: int, floating: Sequence[str]) -> dict[str, Tensor]:
    """What a client sends under ``spec``: local mode ``clip(D, S) + N(0, (z S)^2)`` from
    ``(seed, round, client)``; central mode with a fixed clip ``clip(D, S)``; adaptive
    central: ``D``. Keys not in ``floating`` (integer buffers) are sent as zeros."""
    out = {k: (v if k in floating else torch.zeros_like(v)) for k, v in delta.items()}
    private = {k: out[k] for k in floating}
    if spec.mode == "central" and spec.target_quantile is not None:
        return out
    clipped, _ = clip_update(private, spec.clip)
    if spec.mode == "local":
        std = float(spec.noise_multiplier) * float(spec.clip or 0.0)
        clipped = add_noise(clipped, std, dp_generator(seed, round_idx, client, salt="dplocal"))
    out.update(clipped)
    return out


# client parts that leave the client beside the update, outside the mechanism
UNPRIVATISED = {"SCAFFOLD": "its control-variate change dc_i", "FedNova": "its local step count tau_i"}


def dp_problems(job: Any) -> list[tuple[str, str]]:
    """Why this job's ``[federated.dp]`` cannot run (empty when it can)."""
    spec = job.federated.dp
    method = str(getattr(job.strategy.aggregation, "method", ""))
    if spec is None or method == "FedBuff":  # FedBuff refuses [federated.dp] (.buffered.fedbuff_problems)
        return []
    out: list[tuple[str, str]] = []
    if method in UNPRIVATISED:
        out.append(("strategy.aggregation.method", (
            f"{method} sends {UNPRIVATISED[method]} next to each update, which [federated.dp] "
            f"does not clip or noise; use {', '.join(CENTRAL_AGGREGATIONS)} (central or local "
            f"DP) or a robust aggregator with mode = \"local\"")))
    elif spec.mode == "central" and method not in CENTRAL_AGGREGATIONS:
        out.append(("federated.dp.mode", (
            f"central DP noises the sum of the clipped updates, but {method} needs the single "
            f"updates (a median, a trimmed mean or Krum's scores of noise-free updates would "
            f"each be a release of their own); use mode = \"local\" (every client noises its "
            f"own update) or one of {', '.join(CENTRAL_AGGREGATIONS)}")))
    if spec.target_quantile is not None:
        q = sample_rate(job.strategy, spec.mode)
        std = (spec.clipped_count_stddev if spec.clipped_count_stddev is not None
               else q * int(job.strategy.num_clients) / 20.0)
        try:
            update_noise_multiplier(float(spec.noise_multiplier), float(std))
        except ValueError as e:
            out.append(("federated.dp.clipped_count_stddev", str(e)))
    return out


def dp_lines(job: Any) -> list[str]:
    """What ``[federated.dp]`` puts in effect, for ``paratrain validate``."""
    spec = job.federated.dp
    if spec is None or getattr(job.strategy, "type", None) != "Federated" or dp_problems(job):
        return []
    strat = job.strategy
    q = sample_rate(strat, spec.mode)
    z = float(spec.noise_multiplier)
    clip = "inf (no clipping)" if spec.clip is None else f"{spec.clip:g}"
    if spec.target_quantile is not None:
        clip += (f", adaptive to the {spec.target_quantile:g} quantile (eta "
                 f"{spec.clip_learning_rate:g})")
    if spec.mode == "central":
        how = (f"central DP-FedAvg: the server clips each update to L2 {clip}, adds "
               f"N(0, ({z:g} x clip x {spec.weight_cap})^2) to the sum of min(n_k, "
               f"{spec.weight_cap})-weighted updates and divides by the expected total weight")
    else:
        how = (f"local DP: each client clips its update to L2 {clip} and adds "
               f"N(0, ({z:g} x clip)^2) before compressing")
    rounds = int(strat.rounds)
    eps = rdp_epsilon([(z, q, rounds)], float(spec.delta))
    lines = [f"differential privacy: {how}",
             f"differential privacy: accountant Opacus RDP, sample rate {q:g} per round, delta "
             f"{spec.delta:g}: epsilon {eps:.4g} after all {rounds} rounds"]
    if spec.target_epsilon is not None and eps > spec.target_epsilon:
        last = last_round_within(z, q, float(spec.delta), float(spec.target_epsilon), rounds)
        lines.append(f"differential privacy: target_epsilon {spec.target_epsilon:g} stops the "
                     f"run after round {last}")
    return lines
