"""``[federated.flower]``: the Federated strategy on Flower's Deployment Runtime (a SuperLink
and one SuperNode per site). Read only when ``[federated] runtime = "flower"``; the app
itself is :mod:`paratrain.executors.federated.flower`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from ._base import PositiveCount, Section

# aggregations that act on the clients' weighted mean update alone (all SecAgg+ reveals)
SECURE_AGGREGATIONS = ("FedAvg", "FedProx", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad")


class SecureAggregation(Section):
    """Flower's SecAgg+ (``SecAggPlusWorkflow`` / ``secaggplus_mod``): the server sees only the
    sum of the nodes' masked, quantized updates."""

    num_shares: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    """Shares each node's secret is split into (one per neighbour): an integer > 2, or a
    fraction of the round's nodes (1.0: all of them)."""
    reconstruction_threshold: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.5
    """Shares needed to reconstruct a secret (an integer < num_shares, or a fraction of
    num_shares): a node dropping after masking is survived while this many neighbours answer."""
    clipping_range: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 8.0
    """Each weighted update value is clipped to [-clipping_range, clipping_range] before
    quantization."""
    quantization_range: Annotated[int, Field(gt=1)] = 2**22
    """Quantization levels over the clipping range: the precision is 2 * clipping_range /
    quantization_range per value and node."""
    modulus_range: Annotated[int, Field(gt=1, le=2**32)] = 2**32
    """Masks are drawn from [0, modulus_range): a power of 2 above quantization_range."""

    @model_validator(mode="after")
    def _ranges(self) -> SecureAggregation:
        if self.modulus_range & (self.modulus_range - 1) or self.modulus_range <= self.quantization_range:
            raise ValueError(f"modulus_range ({self.modulus_range}) must be a power of 2 above "
                             f"quantization_range ({self.quantization_range})")
        whole = float(self.num_shares).is_integer() and self.num_shares > 1
        if whole and self.num_shares <= 2:
            raise ValueError("num_shares as a count must be > 2 (or a fraction of the nodes, <= 1)")
        if not whole and self.num_shares > 1:
            raise ValueError(f"num_shares = {self.num_shares}: an integer > 2 or a fraction <= 1")
        t = self.reconstruction_threshold
        if float(t).is_integer() and t > 1:
            if whole and t >= self.num_shares:
                raise ValueError(f"reconstruction_threshold ({t:g}) must be below num_shares ({self.num_shares:g})")
        elif t > 1:
            raise ValueError(f"reconstruction_threshold = {t}: an integer or a fraction <= 1")
        return self


class FlowerOptions(Section):
    round_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 600.0
    """Seconds the server waits for the replies of a round's SuperNodes; the clients of a
    node that has not answered by then are recorded as failed and the round goes on with
    the others."""
    min_nodes: PositiveCount = 1
    """SuperNodes that must be connected before each round starts (the server waits up to
    node_timeout for them, then stops with an error)."""
    node_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 300.0
    """Seconds the server waits for min_nodes SuperNodes before a round."""
    secure_aggregation: SecureAggregation | None = None
    """Aggregate through Flower's SecAgg+ (the server sees only the sum); None = plaintext
    updates. Needs an aggregation that uses the mean update alone (FedAvg, FedProx, FedAvgM,
    FedAdam, FedYogi, FedAdagrad), no compression, and at least 2 nodes a round."""


def secure_problems(job: Any) -> list[tuple[str, str]]:
    """Why ``[federated.flower.secure_aggregation]`` cannot work with this job (field, reason):
    SecAgg+ reveals only the sum of the updates, so aggregators that need each update, and
    compressed or control-variate uplinks, are refused."""
    opts = job.federated.flower if job.federated.runtime == "flower" else None
    if opts is None or opts.secure_aggregation is None:
        return []
    field = "federated.flower.secure_aggregation"
    out: list[tuple[str, str]] = []
    method = str(getattr(job.strategy.aggregation, "method", ""))
    if method not in SECURE_AGGREGATIONS:
        out.append((field, (
            f"aggregation {method} needs each client's update, but secure aggregation reveals only "
            f"their sum; use one of {', '.join(SECURE_AGGREGATIONS)} or turn secure_aggregation off")))
    if job.compression is not None and getattr(job.compression, "method", "None") != "None":
        out.append((field, "compressed updates cannot be summed under SecAgg+ masks; remove [compression]"))
    dp = getattr(job.federated, "dp", None)
    if dp is not None and getattr(dp, "mode", "central") == "central":
        out.append((field, "[federated.dp] mode = \"central\" clips each update on the server, which secure "
                           "aggregation hides; use mode = \"local\""))
    if opts.min_nodes < 2:
        out.append(("federated.flower.min_nodes", "secure aggregation needs at least 2 SuperNodes a round"))
    return out
