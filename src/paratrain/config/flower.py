"""``[federated.flower]``: the Federated strategy on Flower's Deployment Runtime (a SuperLink
and one SuperNode per site). Read only when ``[federated] runtime = "flower"``; the app
itself is :mod:`paratrain.executors.federated.flower`."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ._base import PositiveCount, describe_tags

__all__ = ["FlowerOptions", "RUNTIMES"]

RUNTIMES = ("local", "flower")


class FlowerOptions(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, json_schema_extra=describe_tags
    )

    round_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 600.0
    """Seconds the server waits for the replies of a round's SuperNodes; the clients of a
    node that has not answered by then are recorded as failed and the round goes on with
    the others."""
    min_nodes: PositiveCount = 1
    """SuperNodes that must be connected before each round starts (the server waits up to
    node_timeout for them, then stops with an error)."""
    node_timeout: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 300.0
    """Seconds the server waits for min_nodes SuperNodes before a round."""
