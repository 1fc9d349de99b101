"""The ``[search_space]`` section: the hyperparameters PopulationBased (and random search)
draws, one dimension per name, tagged by ``"type"``: ``uniform``, ``log_uniform``, ``int``
or ``choice``. :class:`~paratrain.config.job.JobConfig` holds them as its ``search_space``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ._base import Section, register_tags


class _Range(Section):
    @model_validator(mode="after")
    def _order(self) -> Any:
        low, high = getattr(self, "low"), getattr(self, "high")  # noqa: B009 - the subclass's fields
        if not low < high:
            raise ValueError(f"low ({low}) must be < high ({high})")
        return self


class UniformDim(_Range):
    type: Literal["uniform"] = "uniform"
    low: float
    """Lower bound of the range."""
    high: float
    """Upper bound of the range (greater than low)."""


class LogUniformDim(UniformDim):
    type: Literal["log_uniform"] = "log_uniform"  # type: ignore[assignment]

    @model_validator(mode="after")
    def _positive(self) -> LogUniformDim:
        if self.low <= 0:
            raise ValueError(f"log_uniform needs low > 0 (got {self.low})")
        return self


class IntDim(_Range):
    type: Literal["int"] = "int"
    low: Annotated[int, Field(strict=True)]
    """Smallest integer drawn."""
    high: Annotated[int, Field(strict=True)]
    """Upper bound of the integers drawn (greater than low)."""


class ChoiceDim(Section):
    type: Literal["choice"] = "choice"
    values: Annotated[list[Any], Field(min_length=1)]
    """The values to choose from (at least one)."""


SearchDim = Annotated[
    UniformDim | LogUniformDim | IntDim | ChoiceDim, Field(discriminator="type")
]
register_tags(["uniform", "log_uniform", "int", "choice"])
