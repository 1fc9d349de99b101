"""Graph nodes, dotted subgraph names and strategy inheritance."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from paratrain.config import ConfigError, Local, load_strategy
from paratrain.graph import Graph, get_node, nodes, subgraphs

DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
FED = {"type": "Federated", "num_clients": 4, "rounds": 1, "aggregation": {"method": "FedAvg"},
       "client_selection": {"method": "All"}}


def _model() -> nn.Sequential:
    inner = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), deep=nn.Sequential(OrderedDict(act=nn.ReLU()))))
    return nn.Sequential(OrderedDict(embed=nn.Linear(2, 4), block=inner, head=nn.Linear(4, 2)))


def test_nodes_are_flattened_with_dotted_names() -> None:
    m = _model()
    assert nodes(m) == ["embed", "block.fc", "block.deep.act", "head"]
    assert subgraphs(m) == ["block", "block.deep"]
    assert isinstance(get_node(m, "block.deep.act"), nn.ReLU)
    with pytest.raises(KeyError, match="nope"):
        get_node(m, "nope")


def test_non_sequential_is_rejected() -> None:
    with pytest.raises(TypeError, match="Sequential"):
        nodes(nn.Linear(2, 2))


def test_effective_strategy_inherits_and_overrides() -> None:
    g = Graph(_model())
    assert g.effective_strategy("block.fc") == Local()  # nothing set anywhere
    g.set_strategy("", DP)
    assert g.effective_strategy("block.deep.act") == load_strategy(DP)  # from the root
    g.set_strategy("block", FED)
    assert g.effective_strategy("block.deep.act") == load_strategy(FED)  # nearest ancestor
    assert g.effective_strategy("block.fc") == load_strategy(FED)
    assert g.effective_strategy("head") == load_strategy(DP)  # sibling still inherits the root
    g.set_strategy("block.deep.act", {"type": "Local"})
    assert g.effective_strategy("block.deep.act") == Local()  # own value wins
    assert g.strategy("block.fc") is None


def test_unknown_path_is_an_error_naming_it() -> None:
    g = Graph(_model())
    with pytest.raises(ConfigError, match="blok"):
        g.set_strategy("blok", DP)
    with pytest.raises(KeyError):
        g.effective_strategy("blok")


def test_graph_of_any_module_inherits_strategies_by_module_path() -> None:
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
            return self.a(x) * self.b(x)

    g = Graph(Two(), {"type": "Federated", "num_clients": 4, "rounds": 2,
                      "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}})
    g.set_strategy("a.norm", {"type": "Local"})
    assert g.nodes() == ["a.fc", "a.norm", "b.fc", "b.norm"]
    assert g.effective_strategy("a.norm").type == "Local"
    assert g.effective_strategy("a.fc").type == g.effective_strategy("b").type == "Federated"
    with pytest.raises(ConfigError, match="unknown node"):
        g.set_strategy("c", {"type": "Local"})
