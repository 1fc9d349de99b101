"""Leaves kept whole in a graph captured by torch.export (paratrain.graph.trace.export_graph).

- a model fx cannot trace, with ``leaf_modules``: the leaf is one ``call_module`` node (its
  own operations are not in the graph), the graph computes the model's output and
  gradients, and the model's forward is restored afterwards;
- a leaf returning a tuple is a ConfigError naming it;
- a Hugging Face Llama sharded for 2-way tensor parallelism (rank 0's shard, no processes:
  only the capture is exercised): every parallel layer is a ``call_module`` node and no
  collective of theirs ran while tracing (their ``meta_forward`` gave the shapes).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.graph.trace import trace


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Net(nn.Module):
    """fx fails on the Python branch over a size (a proxy under fx)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(4, 6), inner, nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.shape[0] < 10_000:  # control flow on a size: fx cannot, export guards it
            h = h + 1
        g = self.gate(h)
        return self.b(g[0] if isinstance(g, tuple) else g)


def test_a_leaf_is_one_call_module_node_and_computes_the_same() -> None:
    torch.manual_seed(0)
    net = Net(Gate())
    x = torch.randn(5, 4)
    gm = trace(net, ["gate"], ((x,), {}))
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == ["gate"]
    assert not any((n.meta.get("nn_module_stack") or {}).get("L__self___gate_fc") for n in gm.graph.nodes)
    assert "forward" not in vars(net.gate)  # restored
    y = torch.randn(7, 4)
    (out,) = gm(y)  # an exported graph returns its output's leaves
    torch.testing.assert_close(out, net(y))
    out.sum().backward()
    g1 = net.gate.fc.weight.grad.clone()  # type: ignore[union-attr]
    net.zero_grad()
    net(y).sum().backward()
    torch.testing.assert_close(g1, net.gate.fc.weight.grad)


def test_a_leaf_returning_a_tuple_is_an_error_naming_it() -> None:
    net = Net(Pair())
    with pytest.raises(ConfigError, match="'gate'"):
        trace(net, ["gate"], ((torch.randn(2, 4),), {}))


def test_sharded_llama_layers_stay_whole_under_export() -> None:
    pytest.importorskip("transformers")
    from hf_factories import llama
    from paratrain.comm.tp.comm import TPComm
    from paratrain.comm.tp.groups import TPGroups
    from paratrain.config.tensor_parallel import TensorParallelismConfig
    from paratrain.tensor_parallel import TensorParallelModule
    from paratrain.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    comm = TPComm(None, [0, 1], rank=0, pattern="AllReduce")
    tpm = TensorParallelModule(llama(65), TensorParallelismConfig(tensor_parallel_size=2),
                               TPGroups(comm, None, 2, 1, 0))
    inner: nn.Module = tpm.module  # type: ignore[assignment]
    leaves = [n for n, m in inner.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(leaves) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    gm = trace(inner, leaves, ((torch.randint(0, 65, (4, 16)),), {}))
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_module"] == leaves
    q = gm.get_submodule("model.layers.0.self_attn.q_proj")
    assert q is inner.get_submodule("model.layers.0.self_attn.q_proj")
    assert q.weight.shape[0] == 16  # 4 heads of 8 -> 2 on this rank
