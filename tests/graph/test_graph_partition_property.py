"""Property: for random DAG models and random placements, the cut's parts, run in their
index order (each reading only values already computed), reproduce the model's output
exactly; each value crossing ranks is a transfer from its producer's rank; and parts are in
a topological order. No processes: this checks the partitioner, test_mp_graph the runtime."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _workers_mp_graph import RandomDag
from paratrain.graph import trace
from paratrain.graph.partition import cut

specs = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.sampled_from(["add", "mul", "cat"])),
                 min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(specs, st.data())
def test_parts_in_order_reproduce_the_model(spec: list[tuple[int, int, str]], data: Any) -> None:
    torch.manual_seed(0)
    model = RandomDag(spec)
    names = ["stem", *(f"layers.{i}" for i in range(len(spec))), "head"]
    claims = {n: data.draw(st.integers(0, 2), label=n) for n in names}
    c = cut(trace(model), claims)
    x = torch.randn(5, 8)
    env: dict[str, Any] = {v: x for v in c.inputs}
    for a in c.attrs:
        env[a.name] = model.get_parameter(a.target)
    for i, p in enumerate(c.parts):
        assert p.index == i
        assert all(v in env for v in p.inputs), "a part reads a value no earlier part made"
        out = p.module(*[env[v] for v in p.inputs])
        env.update(zip(p.outputs, out if len(p.outputs) > 1 else (out,), strict=True))
    got = env[c.output_values[0]]
    assert torch.equal(got, model(x))
    for p in c.parts:
        for v in p.inputs:
            src = c.rank_of_value[v]
            if src is not None and src != p.rank:
                assert any(t.value == v and t.src == src and t.dst == p.rank for t in c.transfers)
    # a module's parameters live in exactly one part (its owner's)
    held = [k for p in c.parts for k, _ in p.module.named_parameters()]
    assert len(held) == len(set(held))
