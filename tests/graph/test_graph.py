"""Graph nodes: a model's traced modules in execution order, with dotted names, for nested
``nn.Sequential`` and any other ``nn.Module`` (what ModelParallel places and ``paratrain
graph`` lists). Strategies per module path are :mod:`paratrain.subgraphs`'s
(tests/config/test_subgraphs_config.py)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from paratrain.graph import trace


def _called(model: nn.Module) -> list[str]:
    return [str(n.target) for n in trace(model).graph.nodes if n.op == "call_module"]


def test_nested_sequentials_give_dotted_nodes_in_execution_order() -> None:
    inner = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), deep=nn.Sequential(OrderedDict(act=nn.ReLU()))))
    m = nn.Sequential(OrderedDict(embed=nn.Linear(2, 4), block=inner, head=nn.Linear(4, 2)))
    assert _called(m) == ["embed", "block.fc", "block.deep.act", "head"]


def test_any_module_gives_its_called_modules_in_execution_order() -> None:
    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.norm = nn.LayerNorm(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.fc(x)) + x

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Tower(), Tower()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(x) * self.a(x)  # b runs first: the order is the forward's

    assert _called(Two()) == ["b.fc", "b.norm", "a.fc", "a.norm"]
