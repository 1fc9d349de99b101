"""FederatedAggregation: how the Federated strategy's server combines the client updates, in
the JSON shapes of DESIGN §3, internally tagged by ``"method"``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from ._base import Contract, Count, NonNegFloat, PositiveCount

PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Decay = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]


class FedAvg(Contract):
    method: Literal["FedAvg"] = "FedAvg"


class FedProx(Contract):
    method: Literal["FedProx"] = "FedProx"
    mu: NonNegFloat
    """Weight of the proximal term (mu/2)||w - w_global||^2 added to each client's loss."""


class _ServerOpt(Contract):
    """Adaptive server optimizers of Reddi et al. 2021 (Adaptive Federated Optimization)."""

    eta: PosFloat = 0.01
    """Extension: server learning rate (Flower's ``eta``)."""
    _extensions: ClassVar[frozenset[str]] = frozenset({"eta"})


class FedYogi(_ServerOpt):
    method: Literal["FedYogi"] = "FedYogi"
    beta1: Decay
    """Decay of the server's first-moment (momentum) estimate, in [0, 1)."""
    beta2: Decay
    """Decay of the server's second-moment estimate, in [0, 1)."""
    tau: PosFloat
    """Adaptivity: added to the square root of the second moment (the epsilon)."""


class FedAdam(_ServerOpt):
    method: Literal["FedAdam"] = "FedAdam"
    beta1: Decay = 0.9
    """Decay of the server's first-moment (momentum) estimate, in [0, 1)."""
    beta2: Decay = 0.99
    """Decay of the server's second-moment estimate, in [0, 1)."""
    tau: PosFloat = 1e-3
    """Adaptivity: added to the square root of the second moment (the epsilon)."""


class FedAdagrad(_ServerOpt):
    method: Literal["FedAdagrad"] = "FedAdagrad"
    tau: PosFloat = 1e-9
    """Adaptivity: added to the square root of the accumulated squares (the epsilon)."""
    eta: PosFloat = 0.1
    """Server learning rate (Flower's ``eta``)."""


class FedAvgM(Contract):
    method: Literal["FedAvgM"] = "FedAvgM"
    server_momentum: Decay = 0.9
    """Momentum of the server's update, in [0, 1)."""
    server_lr: PosFloat = 1.0
    """Server learning rate applied to the averaged update."""


class FedMedian(Contract):
    method: Literal["FedMedian"] = "FedMedian"


class FedTrimmedAvg(Contract):
    method: Literal["FedTrimmedAvg"] = "FedTrimmedAvg"
    beta: Annotated[float, Field(ge=0.0, lt=0.5, allow_inf_nan=False)] = 0.2
    """Fraction of client values trimmed from each end before averaging, in [0, 0.5)."""


class Krum(Contract):
    """Krum (``to_keep = 0``) / Multi-Krum. With ``n`` clients per round the aggregator
    uses ``min(num_malicious, n - 3)`` and keeps ``min(to_keep, n)``; values outside that
    range are reported (with the effective ones) by ``paratrain validate``."""

    method: Literal["Krum"] = "Krum"
    num_malicious: Count = 0
    """Clients assumed Byzantine (f); the aggregator uses min(f, n - 3) for n clients per round."""
    to_keep: Count = 0
    """Multi-Krum: average the best m updates; 0 = Krum (the single best)."""


class SCAFFOLD(Contract):
    """Extension: SCAFFOLD (Karimireddy et al. 2020), control variates against client drift
    (option II). Each client adds ``c - c_i`` to its local gradients and updates its own
    ``c_i``; the server keeps ``c``. Needs plain SGD as the client optimizer."""

    method: Literal["SCAFFOLD"] = "SCAFFOLD"
    server_lr: PosFloat = 1.0
    """Global step size eta_g: x <- x + eta_g * (example-weighted mean of the client deltas)."""


class FedNova(Contract):
    """Extension: FedNova (Wang et al. 2020), normalised averaging: each client's delta is
    divided by its count of local steps (its momentum-adjusted norm ``a_i``) and the sum is
    rescaled by ``tau_eff = sum p_i a_i``. Needs SGD (with or without heavy-ball momentum)."""

    method: Literal["FedNova"] = "FedNova"


class FedBuff(Contract):
    """Extension: FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous
    Aggregation", AISTATS, Alg. 1): ``concurrency`` clients train at once, each from the
    server version current when it started; whenever ``buffer_size`` updates have arrived the
    server steps ``w <- w + eta * sum_k g(s_k) n_k D_k / sum_k n_k`` (``s_k`` the versions
    elapsed since client k's start) and a finished client's slot goes to the next client."""

    method: Literal["FedBuff"] = "FedBuff"
    buffer_size: PositiveCount
    """K: client updates per server step (at most concurrency)."""
    concurrency: PositiveCount
    """Clients training at once (at most the clients client_selection picks per draw)."""
    staleness: Literal["sqrt", "constant"] = "sqrt"
    """Staleness weight g(s): "sqrt" = 1/sqrt(1+s) (the paper's), "constant" = 1."""
    eta: PosFloat = 1.0
    """Server learning rate eta_g on the buffered step."""


FederatedAggregation = Annotated[
    FedAvg | FedProx | FedYogi | FedAdam | FedAdagrad | FedAvgM | FedMedian | FedTrimmedAvg | Krum
    | SCAFFOLD | FedNova | FedBuff,
    Field(discriminator="method"),
]
