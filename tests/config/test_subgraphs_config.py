"""The ``[subgraphs]`` table (issue 15, part 3): shape and JSON round-trip, inheritance by the
nearest ancestor, module paths checked against the built model, and the supported pairings."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.config.job import load_job, parse_job_text
from paratrain.config.strategy import DataParallel, Local
from paratrain.models.zoo import mlp
from paratrain.preflight import preflight
from paratrain.subgraphs import (
    check_pairings,
    check_paths,
    effective_strategy,
    local_parameter_names,
    local_paths,
    local_state_keys,
    nearest_ancestor,
)

FED = {"type": "Federated", "num_clients": 4, "rounds": 2, "aggregation": {"method": "FedAvg"},
       "client_selection": {"method": "All"}}
DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
MP = {"type": "ModelParallel", "partitions": [{"node_ids": ["fc0"], "target": {"WorkerId": "worker-1"}}],
      "communication": {"protocol": "Direct"}}

TOML = """
[run]
name = "sub"
[strategy]
type = "Federated"
num_clients = 4
rounds = 2
aggregation = { method = "FedAvg" }
client_selection = { method = "All" }
[subgraphs.head]
type = "Local"
[subgraphs."encoder.norm"]
type = "DataParallel"
num_replicas = 2
aggregation = { method = "Decentralized", topology = "ring" }
[subgraphs.pipe]
type = "ModelParallel"
partitions = [{ node_ids = ["a"], target = { Tag = "gpu" } }]
communication = { protocol = "Pipeline", micro_batch_size = 4 }
"""


def _job(strategy: dict[str, Any], subgraphs: dict[str, Any], **extra: Any) -> Any:
    return load_job({"run": {"name": "sub"}, "strategy": strategy, "subgraphs": subgraphs,
                     "model": {"name": "mlp", "hidden": [16, 8], **extra}})


def _problems(fn: Any, *args: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return e.value.problems


def test_round_trip_is_exact_and_keeps_the_strategy_shape() -> None:
    job = load_job(parse_job_text(TOML, "toml"))
    assert job.subgraphs["head"] == Local()
    assert isinstance(job.subgraphs["encoder.norm"], DataParallel)
    doc = json.loads(json.dumps(job.to_json_dict()))
    # each table dumps as the [strategy] contract shape: no unset extension (schedule) appears
    assert doc["subgraphs"] == {
        "head": {"type": "Local"},
        "encoder.norm": {"type": "DataParallel", "num_replicas": 2,
                         "aggregation": {"method": "Decentralized", "topology": "ring"}},
        "pipe": {"type": "ModelParallel",
                 "partitions": [{"node_ids": ["a"], "target": {"Tag": "gpu"}}],
                 "communication": {"protocol": "Pipeline", "micro_batch_size": 4}},
    }
    again = load_job(doc)
    assert again == job and again.to_json_dict() == doc
    assert load_job({}).subgraphs == {}


def test_a_malformed_table_names_its_key() -> None:
    probs = _problems(load_job, {"subgraphs": {"head": {"type": "Lcal"}}})
    assert probs[0][0] == "subgraphs.head.type"
    probs = _problems(load_job, {"subgraphs": {"head": {"type": "DataParallel", "num_replicas": 0,
                                                        "aggregation": {"method": "AllReduce"}}}})
    assert probs[0][0] == "subgraphs.head.num_replicas"


def test_effective_strategy_is_own_then_nearest_ancestor_then_root() -> None:
    subs = {"encoder": Local(), "encoder.layers.0": DataParallel.model_validate(DP)}
    root = load_job({"strategy": FED}).strategy
    assert effective_strategy("encoder", subs, root) == Local()
    assert effective_strategy("encoder.norm", subs, root) == Local()  # nearest ancestor
    assert effective_strategy("encoder.layers.0.fc", subs, root) == subs["encoder.layers.0"]
    assert effective_strategy("encoder.layers.1", subs, root) == Local()
    assert effective_strategy("encoderx", subs, root) == root  # not a dotted prefix
    assert effective_strategy("head", subs, root) == root
    assert effective_strategy("", subs, root) == root
    assert nearest_ancestor("encoder.layers.0.fc", subs) == "encoder.layers.0"
    assert nearest_ancestor("encoder", subs) is None


def test_supported_pairings_pass() -> None:
    check_pairings(_job(FED, {"head": {"type": "Local"}}))
    check_pairings(_job(DP, {"head": {"type": "Local"}}))
    check_pairings(_job(MP, {"fc1": DP}))
    check_pairings(_job(FED, {"fc0": FED}))  # equal to the root: a no-op
    check_pairings(_job(FED, {"fc0": {"type": "Local"}, "fc0.x": {"type": "Local"}}))  # no-op nested
    check_pairings(_job({"type": "Local"}, {"head": {"type": "Local"}}))


@pytest.mark.parametrize(("root", "subs", "key", "words"), [
    (FED, {"head": DP}, "head", "DataParallel under Federated"),
    (DP, {"head": FED}, "head", "Federated under DataParallel"),
    ({"type": "Local"}, {"head": DP}, "head", "DataParallel under Local"),
    (MP, {"head": {"type": "Local"}}, "head", "Local under ModelParallel"),
    (DP, {"head": {**DP, "num_replicas": 3}}, "head", "differs from its parent"),
    (FED, {"fc0": {"type": "Local"}, "fc0.x": FED}, "fc0.x", "Federated under Local (subgraph 'fc0')"),
    (FED, {"": {"type": "Local"}}, 'subgraphs.""', "[strategy]"),
    (FED, {"a..b": {"type": "Local"}}, "a..b", "not a module path"),
])
def test_an_unsupported_pairing_names_the_key_and_lists_the_pairings(
        root: dict[str, Any], subs: dict[str, Any], key: str, words: str) -> None:
    probs = _problems(check_pairings, _job(root, subs))
    field = key if key.startswith("subgraphs.") else f"subgraphs.{key}"
    assert [p for p, _ in probs] == [field]
    msg = probs[0][1]
    assert words in msg
    if "module path" not in msg and "[strategy]" not in words:
        assert "Federated + Local" in msg and "DataParallel + Local" in msg and "ModelParallel + DataParallel" in msg


def test_a_local_subgraph_under_tensor_parallelism_is_refused() -> None:
    job = load_job({"strategy": DP, "subgraphs": {"head": {"type": "Local"}},
                    "tensor_parallel": {"tensor_parallel_size": 2, "partitioning_strategy": "RowWise",
                                        "communication_pattern": "AllReduce",
                                        "memory_optimization": "None"}})
    probs = _problems(check_pairings, job)
    assert probs[0][0] == "subgraphs.head" and "tensor_parallel_size" in probs[0][1]


def test_paths_are_checked_against_the_model() -> None:
    model = mlp((64,), 10, hidden=[16, 8], norm="batch")
    check_paths(model, _job(FED, {"head": {"type": "Local"}, "norm0": {"type": "Local"}}))
    probs = _problems(check_paths, model, _job(FED, {"hed": {"type": "Local"}}))
    assert probs[0][0] == "subgraphs.hed" and "nearest: head" in probs[0][1]
    probs = _problems(check_paths, model, _job(FED, {"zzzzz": {"type": "Local"}}))
    assert "module paths: flatten, fc0, norm0" in probs[0][1]
    probs = _problems(check_paths, model, _job(FED, {"act0": {"type": "Local"}}))
    assert probs[0][0] == "subgraphs.act0" and "holds no parameters" in probs[0][1]


def test_local_state_keys_hold_parameters_and_buffers_of_the_local_subgraphs() -> None:
    model = mlp((64,), 10, hidden=[16, 8], norm="batch")
    job = _job(FED, {"norm0": {"type": "Local"}, "norm1": {"type": "Local"}})
    assert local_paths(job) == ["norm0", "norm1"]
    assert local_state_keys(model, job) == [
        f"norm{i}.{k}" for i in (0, 1)
        for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")]
    assert local_parameter_names(model, job) == {"norm0.weight", "norm0.bias", "norm1.weight", "norm1.bias"}
    # under a Local root nothing is kept apart
    assert local_state_keys(model, _job({"type": "Local"}, {"head": {"type": "Local"}})) == []


def test_a_tied_weight_cannot_be_half_local() -> None:
    torch.manual_seed(0)
    gpt = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 8, "block_size": 8}
    from paratrain.config.sections import ModelSpec
    from paratrain.models import build_model

    model = build_model(ModelSpec.model_validate(gpt), input_shape=(8,), num_classes=11)
    job = load_job({"strategy": FED, "subgraphs": {"head": {"type": "Local"}}, "model": gpt})
    probs = _problems(check_paths, model, job)
    assert probs[0][0] == "subgraphs.head" and "tied" in probs[0][1]
    both = load_job({"strategy": FED, "subgraphs": {"head": {"type": "Local"}, "embed": {"type": "Local"}},
                     "model": gpt})
    keys = local_state_keys(model, both)
    assert keys and all(k.startswith(("embed.", "head.")) for k in keys)


def test_validate_reports_bad_keys_and_pairings(tmp_path: Any, capsys: Any) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.split("[subgraphs.head]")[0]
                   + '[subgraphs.fc0]\ntype = "DataParallel"\nnum_replicas = 2\n'
                     'aggregation = { method = "AllReduce" }\n')
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert "subgraphs.fc0" in text and "supported pairings" in text
    ok = load_job({"run": {"name": "ok"}, "strategy": FED, "subgraphs": {"hed": {"type": "Local"}}})
    probs = _problems(preflight, ok)
    assert [p for p, _ in probs] == ["subgraphs.hed"] and "nearest: head" in probs[0][1]
    good = load_job({"run": {"name": "ok"}, "strategy": FED, "subgraphs": {"head": {"type": "Local"}}})
    preflight(good, warn=False)


def test_unknown_keys_in_a_subgraph_table_are_reported_as_ignored() -> None:
    from paratrain.dispatch import effective_settings

    job = load_job({"strategy": FED, "subgraphs": {"head": {"type": "Local", "colour": 1}}})
    fields = [i.field for i in effective_settings(job, probe=False).ignored]
    assert "subgraphs.head.colour" in fields


def test_fit_takes_the_mapping(tmp_path: Any) -> None:
    import paratrain

    with pytest.raises(ConfigError) as e:
        paratrain.fit(model="mlp", data="digits", run={"name": "f", "output_dir": str(tmp_path)},
                      subgraphs={"head": DataParallel.model_validate(DP)})
    assert e.value.problems[0][0] == "subgraphs.head"
    with pytest.raises(ConfigError) as e:  # an nn.Module instance is checked too
        paratrain.fit(model=mlp((64,), 10), data="digits", run={"name": "g", "output_dir": str(tmp_path)},
                      subgraphs={"haed": Local()})
    assert e.value.problems[0][0] == "subgraphs.haed"
    from paratrain.config.sections import DataSpec
    from paratrain.data import load_data

    bundle = load_data(DataSpec(), seed=0)
    with pytest.raises(ConfigError) as e:  # a data instance: the model is built by the run
        paratrain.fit(model="mlp", data=bundle, run={"name": "i", "output_dir": str(tmp_path)},
                      subgraphs={"haed": Local()})
    assert e.value.problems[0][0] == "subgraphs.haed"
    out = paratrain.fit(model="mlp", data="digits", train={"epochs": 1, "max_steps": 2},
                        run={"name": "h", "output_dir": str(tmp_path)}, subgraphs={"head": Local()})
    assert out["test_accuracy"] >= 0.0
