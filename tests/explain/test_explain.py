"""``paratrain graph JOB`` / ``validate --explain`` (paratrain.explain): nodes in
execution order with parameters, effective strategy and worker; subgraphs; the values that
cross workers named by the traced graph's nodes, with shapes. No processes are started."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig, load_job
from paratrain.executors import import_plugins
from paratrain.explain import _build, explain, explain_file, render
from paratrain.graph import trace

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
RESIDUAL = ROOT / "examples" / "model_parallel_residual.toml"
GPT_PIPELINE = ROOT / "examples" / "gpt_shakespeare_pipeline.toml"


FEDERATED = {"type": "Federated", "num_clients": 4, "rounds": 1, "aggregation": {"method": "FedAvg"},
             "client_selection": {"method": "Random", "fraction": 1.0}}


def _nodes(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in report["nodes"]}


def test_sequential_zoo_model_lists_its_nodes_in_order_with_parameters() -> None:
    job = load_job({"run": {"name": "seq"}, "model": {"name": "mlp", "hidden": [32, 16]},
                    "train": {"batch_size": 8}})
    report = explain(job)
    model, _ = _build(job)
    assert [r["node"] for r in report["nodes"]] == ["flatten", "fc0", "act0", "fc1", "act1", "head"]
    for r in report["nodes"]:
        want = sum(p.numel() for p in model.get_submodule(r["node"]).parameters())
        assert r["parameters"] == want
        assert r["strategy"] == "Local" and r["strategy_from"] == "strategy"
        assert "worker" not in r
    assert report["parameters"] == sum(p.numel() for p in model.parameters()) == 64 * 32 + 32 + 32 * 16 + 16 + 170
    assert _nodes(report)["fc1"]["output_shape"] == [8, 16]
    assert _nodes(report)["head"]["output_shape"] == [8, 10]
    assert "transfers" not in report and report["subgraphs"] == []
    text = render(report)
    assert "fc0" in text and "2,080" in text  # 64 x 32 + 32


def _run_parts(cut: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every top-level value of ``cut`` on input ``x`` (the parts run in order)."""
    env: dict[str, Any] = {cut.inputs[0]: x}
    for p in cut.parts:
        out = p.module(*(env[v] for v in p.inputs))
        outs = out if len(p.outputs) > 1 else (out,)
        env.update(zip(p.outputs, outs, strict=True))
    return env


def _traced_values(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            seen[n.name] = super().run_node(n)
            return seen[n.name]

    Record(gm).run(x)
    return seen


def _residual_job() -> JobConfig:
    job = load_job(RESIDUAL)
    import_plugins(list(job.run.imports), base=RESIDUAL.parent)
    return job


def test_residual_example_names_every_crossing_value_by_its_traced_node() -> None:
    job = _residual_job()
    report = explain(job)
    rows = _nodes(report)
    assert [r["worker"] for r in report["nodes"]] == ["worker-0"] * 6 + ["worker-1"] * 5 + ["worker-2"] * 4
    assert rows["blocks.1.fc1"]["worker"] == "worker-0" and rows["blocks.1.fc2"]["worker"] == "worker-1"
    assert rows["blocks.3.fc1"]["rank"] == 1 and rows["blocks.3.act"]["rank"] == 2
    assert [r["part"] for r in report["nodes"]] == [0] * 6 + [1] * 5 + [2] * 4
    # both cuts are inside a block: the block's own activation and the residual stream cross
    got = [(t["from"], t["to"], t["node"], t["shape"], t["bytes"]) for t in report["transfers"]]
    assert got == [("worker-0", "worker-1", "blocks_1_act", [32, 128], 32 * 128 * 4),
                   ("worker-0", "worker-1", "add", [32, 64], 32 * 64 * 4),
                   ("worker-1", "worker-2", "blocks_3_fc1", [32, 128], 32 * 128 * 4),
                   ("worker-1", "worker-2", "add_2", [32, 64], 32 * 64 * 4)]
    assert not any(t["node"].startswith(("getitem", "submod")) for t in report["transfers"])
    # the names are right: each crossing value equals its node's output in the traced graph
    from paratrain.comm.context import default_workers
    from paratrain.executors.model_parallel.validation import plan_for

    model, train = _build(job)
    plan = plan_for(job, model, default_workers(3, list(job.workers)))
    x = torch.stack([train[i][0] for i in range(3)])
    split = _run_parts(plan.cut, x)
    traced = _traced_values(trace(model), x)
    for t in report["transfers"]:
        assert torch.equal(split[t["value"]], traced[t["node"]]), t
    assert not torch.equal(traced["add"], traced["add_2"])  # a wrong mapping would fail
    # parameters per worker: every parameter exactly once
    sums = {w["worker"]: w["parameters"] for w in report["workers"]}
    by_rank = {0: 0, 1: 0, 2: 0}
    for name, module in model.named_modules():
        if name in plan.owner:
            by_rank[plan.owner[name]] += sum(p.numel() for p in module.parameters())
    assert sums == {"worker-0": by_rank[0], "worker-1": by_rank[1], "worker-2": by_rank[2]}
    assert sum(sums.values()) == report["parameters"]
    assert report["loss_worker"] == "worker-2"
    blocks = {g["subgraph"]: g for g in report["subgraphs"]}
    assert blocks["blocks.1"]["workers"] == ["worker-0", "worker-1"]
    assert blocks["blocks.2"]["workers"] == ["worker-1"]


def test_gpt_cut_mid_block_with_a_tied_head_on_another_worker() -> None:
    doc = load_job(GPT_PIPELINE).to_json_dict()
    doc["model"].update(tie_weights=True, n_layer=2)
    doc["train"]["batch_size"] = 4
    doc["strategy"]["communication"] = {"protocol": "Direct"}
    doc["strategy"]["partitions"] = [{"node_ids": ["block0.mlp", "block1", "ln_f", "head"],
                                      "target": {"WorkerId": "worker-1"}}]
    job = JobConfig.model_validate(doc)
    report = explain(job)
    rows = _nodes(report)
    assert rows["block0.attn.o"]["worker"] == "worker-0" and rows["block0.mlp.fc"]["worker"] == "worker-1"
    assert rows["head"]["worker"] == "worker-1" and rows["head"]["kind"] == "traced"
    assert list(rows).index("embed.tok") < list(rows).index("block0.ln1") < list(rows).index("head")
    by_node = {t["node"]: t for t in report["transfers"]}
    # the residual stream after attention (an add in block0's forward), and the tied weight
    add = next(t for t in report["transfers"] if t.get("in_module") == "block0" and t["op"] == "call_function")
    assert add["from"] == "worker-0" and add["to"] == "worker-1" and add["shape"] == [4, 64, 64]
    assert add["bytes"] == 4 * 64 * 64 * 4
    tied = next(t for t in report["transfers"] if t.get("attr"))
    assert tied["attr"] == "embed.tok.weight" and tied["from"] == "worker-0" and tied["to"] == "worker-1"
    model, _ = _build(job)
    assert tied["shape"] == list(model.get_submodule("embed.tok").weight.shape)
    names = {n.name for n in trace(model).graph.nodes}
    assert set(by_node) <= names  # every crossing value named by a node of the traced graph
    total = sum(p.numel() for p in model.parameters())  # the tie counted once
    assert sum(w["parameters"] for w in report["workers"]) == total == report["parameters"]
    text = render(report)
    assert "parameter embed.tok.weight" in text and "in block0.forward" in text


def test_federated_local_head_is_local_and_the_rest_federated() -> None:
    job = load_job({"run": {"name": "fedper"}, "model": {"name": "mlp", "hidden": [16]},
                    "strategy": FEDERATED,
                    "subgraphs": {"head": {"type": "Local"}}})
    report = explain(job)
    rows = _nodes(report)
    assert rows["head"]["strategy"] == "Local" and rows["head"]["strategy_from"] == "subgraphs.head"
    assert {r["strategy"] for n, r in rows.items() if n != "head"} == {"Federated"}
    assert report["subgraph_strategies"] == {"head": "Local"}
    assert "Local (subgraphs.head)" in render(report)


def test_a_subgraph_strategy_is_inherited_by_its_nodes() -> None:
    doc = load_job(GPT_PIPELINE).to_json_dict()
    doc["strategy"] = FEDERATED
    doc.pop("workers", None)
    doc["subgraphs"] = {"block1": {"type": "Local"}}
    report = explain(JobConfig.model_validate(doc), shapes=False)
    rows = _nodes(report)
    assert rows["block1.attn.q"]["strategy"] == "Local"
    assert rows["block1.attn.q"]["strategy_from"] == "subgraphs.block1"
    assert rows["block0.attn.q"]["strategy"] == "Federated"
    groups = {g["subgraph"]: g for g in report["subgraphs"]}
    assert groups["block1"]["own_strategy"] == "Local"
    assert "own_strategy" not in groups["block1.attn"] and groups["block1.attn"]["strategy"] == "Local"
    assert groups["block0"]["strategy"] == "Federated"


def test_cli_graph_prints_the_residual_graph_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["graph", str(RESIDUAL)]) == 0
    out = capsys.readouterr().out
    assert "nodes, in execution order:" in out and "blocks.1.fc2" in out
    assert "worker-0  worker-1  add (in ResidualMLP.forward)" in out
    assert main(["graph", str(RESIDUAL), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["node"] for t in doc["transfers"]] == ["blocks_1_act", "add", "blocks_3_fc1", "add_2"]
    assert main(["validate", "--explain", str(RESIDUAL)]) == 0
    out = capsys.readouterr().out
    assert f"{RESIDUAL}: ok" in out and "values crossing workers" in out


def test_cli_graph_bad_job_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nname = "x"\n[model]\nname = "mlp"\n[strategy]\ntype = "ModelParallel"\n'
                   'communication = { protocol = "Direct" }\n'
                   '[[strategy.partitions]]\nnode_ids = ["nope"]\ntarget = { WorkerId = "worker-1" }\n')
    assert main(["graph", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{bad}: strategy.partitions[0].node_ids: ")
    assert "'nope'" in err[0] and "Traceback" not in err[0]
    assert main(["graph", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


UNTRACEABLE = '''
    import math
    import torch
    from torch import nn

    class Gate(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, h):
            if h.sum() > 0:  # control flow on a tensor's value: fx cannot trace it
                return self.fc(h)
            return h

    class Net(nn.Module):
        def __init__(self, in_features, num_classes):
            super().__init__()
            self.stem = nn.Linear(in_features, 16)
            self.gate = Gate(16)
            self.head = nn.Linear(16, num_classes)

        def forward(self, x):
            return self.head(self.gate(self.stem(x.flatten(1))))

    def build(input_shape, num_classes):
        return Net(math.prod(input_shape), num_classes)
'''


def test_untraceable_model_names_the_module_and_how_to_mark_it_a_leaf(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gated_net.py").write_text(textwrap.dedent(UNTRACEABLE))
    job = tmp_path / "job.toml"
    body = ('[run]\nname = "gated"\nimports = ["gated_net.py"]\n[model]\nfactory = "gated_net:build"\n'
            '[strategy]\ntype = "ModelParallel"\ncommunication = { protocol = "Direct" }\n'
            '[[strategy.partitions]]\nnode_ids = ["head"]\n'
            'target = { WorkerId = "worker-1" }\n')
    job.write_text(body)
    assert main(["graph", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{job}: model: torch.fx cannot trace module 'gate'")
    assert "model.leaf_modules = ['gate']" in err[0]
    # marked a leaf, it is one node (its parameters included) and the graph prints
    job.write_text(body.replace('factory = "gated_net:build"\n',
                                'factory = "gated_net:build"\nleaf_modules = ["gate"]\n'))
    report = explain_file(job)
    assert [r["node"] for r in report["nodes"]] == ["stem", "gate", "head"]
    assert _nodes(report)["gate"]["parameters"] == 16 * 16 + 16
    assert [(t["from"], t["to"], t["node"]) for t in report["transfers"]] == [("worker-0", "worker-1", "gate")]


def test_explain_raises_config_error_for_a_bad_subgraph_key() -> None:
    job = load_job({"run": {"name": "k"}, "model": {"name": "mlp", "hidden": [8]},
                    "strategy": FEDERATED,
                    "subgraphs": {"haed": {"type": "Local"}}})
    with pytest.raises(ConfigError) as e:
        explain(job)
    assert e.value.problems[0][0] == "subgraphs.haed" and "head" in e.value.problems[0][1]


def test_replicated_stage_lists_its_replicas() -> None:
    path = ROOT / "examples" / "pipeline_replicated_stage.toml"
    report = explain_file(path)
    rows = _nodes(report)
    assert rows["back.stem"]["strategy"] == "DataParallel" and rows["back.stem"]["strategy_from"] == "subgraphs.back"
    assert rows["back.stem"]["replicas"] == ["worker-1", "worker-2"] and "replicas" not in rows["front.stem"]
    workers = {w["worker"]: w for w in report["workers"]}
    assert workers["worker-2"]["replica_of"] == "worker-1" and workers["worker-2"]["parts"] == [1]
    assert workers["worker-2"]["parameters"] == workers["worker-1"]["parameters"]
    assert "replica" not in workers["worker-0"]
    (into,) = report["transfers"]
    assert into["from"] == "worker-0" and into["to_replicas"] == ["worker-1", "worker-2"]
    assert "worker-0  worker-1 + worker-2" in render(report)
