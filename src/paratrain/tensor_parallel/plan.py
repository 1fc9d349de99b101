"""``[tensor_parallel.plan]``: module-path patterns -> styles, applied before the built-in rules.

A pattern matches the paths of ``model.named_modules()`` component by component (``*`` and
``?`` within one component, as torch's ``parallelize_module``); the first pattern in the
table's order that matches a module decides its style (its ``PlanEntry``): ``colwise`` / ``rowwise`` / ``packed_colwise`` make the parallel
layers of :mod:`.layers` and :mod:`.foreign_layers` of a plain ``nn.Linear`` or GPT-2 Conv1D,
``replicate`` keeps the module whole with nothing inside it sharded, ``sequence`` /
``prepare_input`` keep it, hooked to change the layout of its input or output
(:mod:`.sequence`), and walk on into its children. A module whose subtree a pattern reaches
is left to the plan by the block rules of :mod:`.foreign`. As in torch, a plan is the user's
statement of the layout, not proved equivalent; a pattern matching no module is a ConfigError.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.config import ConfigError
from paratrain.config.tensor_parallel import PlanEntry

from .foreign_layers import ColumnParallelConv1D, PackedColumnParallel, RowParallelConv1D, is_conv1d
from .layers import ColumnParallelLinear, RegionState, RowParallelLinear
from .rules import is_plain_linear, module_where
from .sequence import install

# styles that keep the module and walk on into its children
WALKED = ("sequence", "prepare_input")


def matches(pattern: str, path: str) -> bool:
    """``pattern`` matches module ``path`` component by component."""
    pa, ma = pattern.split("."), path.split(".") if path else []
    return len(pa) == len(ma) and all(fnmatchcase(m, p) for p, m in zip(pa, ma, strict=True))


def _reaches_below(pattern: str, path: str) -> bool:
    """Some module strictly below ``path`` could match ``pattern``."""
    pa, ma = pattern.split("."), path.split(".") if path else []
    return len(pa) > len(ma) and all(fnmatchcase(m, p) for p, m in zip(pa, ma, strict=False))


class Plan:
    """The plan of one conversion: which entry a path takes, and which patterns were used."""

    def __init__(self, entries: dict[str, PlanEntry], comm: TPComm, state: RegionState) -> None:
        self.entries = dict(entries)
        self.comm, self.state = comm, state
        self.used: set[str] = set()
        self.sequence_modules: list[nn.Module] = []  # their parameters' gradients are summed

    def __bool__(self) -> bool:
        return bool(self.entries)

    def entry_for(self, path: str) -> tuple[str, PlanEntry] | None:
        for pattern, entry in self.entries.items():
            if matches(pattern, path):
                self.used.add(pattern)
                return pattern, entry
        return None

    def reaches_below(self, path: str) -> bool:
        return any(_reaches_below(p, path) for p in self.entries)

    def apply(self, m: nn.Module, path: str, pattern: str, entry: PlanEntry) -> tuple[nn.Module, str]:
        """The module ``entry`` makes of ``m``, and a note of the style applied."""
        field = f'tensor_parallel.plan."{pattern}"'
        style = entry.style
        if style == "replicate":
            return m, "replicate"
        if style in WALKED:
            src = entry.input_layout if style == "sequence" else entry.input
            dst = "sequence" if style == "sequence" else entry.desired_input
            out = entry.output_layout if style == "sequence" else None
            install(m, path, style=style, src=src, dst=dst, out=out, comm=self.comm, state=self.state)
            if style == "sequence":
                self.sequence_modules.append(m)
                return m, "sequence" + (", input split here" if src == "replicate" else "") + (
                    ", output gathered" if out == "replicate" else "")
            return m, f"prepare_input ({src} -> {dst})"
        conv = is_conv1d(m)
        if not (conv or is_plain_linear(m)):
            raise ConfigError([(field, f"{module_where(path, m)}: {style} applies to a plain nn.Linear "
                                       "or Conv1D (forward not overridden, weight and bias only)")])
        kw: dict[str, Any] = {"comm": self.comm, "state": self.state}
        if style == "packed_colwise":
            assert entry.parts is not None
            try:
                return PackedColumnParallel(m, entry.parts, **kw), f"packed_colwise ({entry.parts} parts)"
            except ValueError as e:
                raise ConfigError([(field, f"{module_where(path, m)}: {e}")]) from None
        if style in ("colwise", "colwise_gather_output"):
            gather = entry.output_layout == "replicate"
            seq = entry.input_layout == "sequence"
            kw["mode"] = "seq" if seq else "copy"
            new = (ColumnParallelConv1D if conv else ColumnParallelLinear).from_dense(
                m, gather_output=gather, **kw)
            return new, "colwise" + (", input sequence-gathered" if seq else "") + (
                ", output replicated" if gather else "")
        split = entry.input_layout == "replicate"
        seq = entry.output_layout == "sequence"
        kw["mode"] = "seq" if seq else "reduce"
        row = (RowParallelConv1D if conv else RowParallelLinear).from_dense(
            m, input_is_parallel=not split, **kw)
        return row, "rowwise" + (", input split here" if split else "") + (
            ", output reduce-scattered to sequence shards" if seq else "")

    def check_used(self, model_paths: list[str]) -> None:
        """Every pattern matched some module (else a ConfigError naming the unused ones)."""
        unused = [p for p in self.entries if p not in self.used]
        if unused:
            sample = ", ".join(p for p in model_paths[:6] if p)
            raise ConfigError([(f'tensor_parallel.plan."{p}"',
                                f"matches no module of the model (paths look like: {sample}, ...; "
                                "`*` matches one path component)") for p in unused])
