"""``[subgraphs]`` keys as patterns (issue 21, item 7): globs over module paths
(``fnmatch``) and ``class:<Name>`` (the module's class or a base class), resolved over the
built model into the explicit tables they stand for. A FedBN run with one pattern line ends
bit-identical to the same run with one table per norm layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError, load_job
from paratrain.config.job import parse_job_text
from paratrain.config.strategy import Federated, Local
from paratrain.models.zoo import mlp
from paratrain.preflight import preflight
from paratrain.subgraphs import (
    check_pairings,
    check_paths,
    is_pattern,
    local_buffer_names,
    local_parameter_names,
    local_state_keys,
    resolve,
)

pytestmark = pytest.mark.timeout(240)

FED = {"type": "Federated", "num_clients": 4, "rounds": 2, "aggregation": {"method": "FedAvg"},
       "client_selection": {"method": "All"}}
LOCAL = {"type": "Local"}


class Block(nn.Module):
    """A torchvision BasicBlock's module layout (conv1/bn1/relu/conv2/bn2, downsample)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out)
        self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1), nn.BatchNorm2d(c_out))


class TinyResNet(nn.Module):
    """ResNet-18's naming (bn1, layer<i>.<j>.bn<k>, layer<i>.0.downsample.1) at toy size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
        self.layer1 = nn.Sequential(Block(4, 4), Block(4, 4))
        self.layer2 = nn.Sequential(Block(4, 8), Block(8, 8))
        self.fc = nn.Linear(8, 10)


RESNET_BNS = ["bn1"] + [f"layer{i}.{j}.{m}" for i in (1, 2) for j in (0, 1)
                        for m in ("bn1", "bn2", "downsample.1")]


def _job(subgraphs: dict[str, Any], strategy: dict[str, Any] | None = None) -> Any:
    return load_job({"run": {"name": "pat"}, "strategy": strategy or FED, "subgraphs": subgraphs,
                     "model": {"name": "mlp", "hidden": [16, 16], "norm": "batch"}})


def _problems(fn: Any, *args: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return e.value.problems


def test_fedbn_on_a_resnet_is_one_line() -> None:
    """``"class:BatchNorm2d" = { type = "Local" }`` under ``[subgraphs]`` (one TOML line)
    stands for the 13 tables of every BatchNorm2d path, downsample norms included; a glob
    and a base-class name select the same modules."""
    doc = parse_job_text('[strategy]\ntype = "Federated"\nnum_clients = 4\nrounds = 2\n'
                         'aggregation = { method = "FedAvg" }\nclient_selection = { method = "All" }\n'
                         '[subgraphs]\n"class:BatchNorm2d" = { type = "Local" }\n', "toml")
    job, model = load_job(doc), TinyResNet()
    res = resolve(model, job)
    assert sorted(res.table) == sorted(RESNET_BNS) and set(res.origin.values()) == {"class:BatchNorm2d"}
    assert all(s == Local() for s in res.table.values())
    explicit = _job({p: LOCAL for p in RESNET_BNS})
    want = local_state_keys(model, explicit)
    assert len(want) == 13 * 5 and local_state_keys(model, job) == want
    for keys in (["class:_BatchNorm"], ["class:BatchNorm*"], ["*bn*", "*downsample.1"]):
        assert local_state_keys(model, _job(dict.fromkeys(keys, LOCAL))) == want, keys
    # a glob's "*" crosses dots: "layer2*" is layer2 itself (its modules inherit, left out)
    assert resolve(model, _job({"layer2*": LOCAL})).table == {"layer2": Local()}


def test_an_exact_path_wins_and_disagreeing_patterns_are_refused() -> None:
    model = mlp(input_shape=(64,), num_classes=10, hidden=[16, 16], norm="batch")
    root = Federated.model_validate(FED)
    job = _job({"class:BatchNorm1d": LOCAL, "norm1": FED})  # every norm but norm1
    assert resolve(model, job).table == {"norm0": Local(), "norm1": root}
    assert local_parameter_names(model, job) == {"norm0.weight", "norm0.bias"}
    assert local_buffer_names(model, job) == {"norm0.running_mean", "norm0.running_var",
                                              "norm0.num_batches_tracked"}
    probs = _problems(check_paths, model, _job({"class:BatchNorm1d": LOCAL, "norm*": FED}))
    assert [p for p, _ in probs] == ["subgraphs.norm*"] * 2
    assert "'norm0' is matched by 'class:BatchNorm1d' too" in probs[0][1]
    assert "an exact path wins" in probs[0][1]
    # agreeing patterns are one entry
    assert resolve(model, _job({"class:BatchNorm1d": LOCAL, "norm*": LOCAL})).table == {
        "norm0": Local(), "norm1": Local()}


def test_a_pattern_matching_nothing_names_its_key() -> None:
    model = mlp(input_shape=(64,), num_classes=10, hidden=[16, 16], norm="batch")
    probs = _problems(check_paths, model, _job({"class:GroupNorm": LOCAL, "layer*.bn*": LOCAL}))
    assert [p for p, _ in probs] == ["subgraphs.class:GroupNorm", "subgraphs.layer*.bn*"]
    assert "BatchNorm1d" in probs[0][1] and "matches no module path" in probs[1][1]
    probs = _problems(check_paths, model, _job({"act*": LOCAL}))  # activations hold nothing
    assert [p for p, _ in probs] == ["subgraphs.act*"] and "no parameters or buffers" in probs[0][1]
    # through the run's pre-run checks, as `paratrain validate` prints it
    probs = _problems(preflight, _job({"class:GroupNorm": LOCAL}))
    assert [p for p, _ in probs] == ["subgraphs.class:GroupNorm"]


def test_pattern_syntax_and_modelparallel() -> None:
    assert is_pattern("class:BatchNorm2d") and is_pattern("layer*.bn?") and is_pattern("[ab].x")
    assert not is_pattern("encoder.norm")
    assert [p for p, _ in _problems(check_pairings, _job({"class:": LOCAL}))] == ["subgraphs.class:"]
    mp = {"type": "ModelParallel", "communication": {"protocol": "Direct"},
          "partitions": [{"node_ids": ["fc0"], "target": {"WorkerId": "worker-1"}}]}
    dp = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    probs = _problems(check_pairings, _job({"fc*": dp}, mp))
    assert [p for p, _ in probs] == ["subgraphs.fc*"] and "module path" in probs[0][1]
    # an unsupported pairing found only through the model names the key and the module: the
    # root's DataParallel again inside a Local layer1 (elsewhere the pattern is a no-op)
    probs = _problems(check_paths, TinyResNet(), _job({"layer1": LOCAL, "class:BatchNorm2d": dp}, dp))
    assert {p for p, _ in probs} == {"subgraphs.class:BatchNorm2d"} and len(probs) == 6
    assert "module 'layer1.0.bn1': DataParallel under Local (subgraph 'layer1')" in probs[0][1]


def _fedbn(name: str, subgraphs: dict[str, Any], out: str) -> dict[str, Any]:
    return {"run": {"name": name, "seed": 0, "output_dir": out, "num_workers": 2},
            "model": {"name": "mlp", "hidden": [16, 16], "norm": "batch"},
            "data": {"name": "digits", "partition": {"method": "iid", "feature_shift": 1.5}},
            "train": {"optimizer": {"name": "sgd", "lr": 0.05}},
            "federated": {"local_epochs": 1, "batch_size": 20, "evaluate_clients": True},
            "strategy": FED, "subgraphs": subgraphs}


def _sequence(ctx: Any, docs: list[dict[str, Any]]) -> list[Any]:
    from paratrain.executors.federated import worker_main

    torch.manual_seed(0)
    return [worker_main(ctx, load_job(d), False) for d in docs]


def test_a_fedbn_run_with_one_pattern_equals_the_explicit_tables(tmp_path: Any) -> None:
    """Two gloo workers, 4 clients, 2 rounds: ``"class:BatchNorm1d"`` and ``norm0`` +
    ``norm1`` tables keep the same personal keys and end with the same global and personal
    parameters, bit for bit, and the same per-client scores."""
    docs = [_fedbn("explicit", {"norm0": LOCAL, "norm1": LOCAL}, str(tmp_path)),
            _fedbn("pattern", {"class:BatchNorm1d": LOCAL}, str(tmp_path))]
    explicit, pattern = run_distributed(_sequence, 2, docs, timeout_s=200)[0]
    stats = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert explicit["personal_keys"] == [f"norm{i}.{k}" for i in (0, 1) for k in stats]
    assert pattern["personal_keys"] == explicit["personal_keys"]
    for key in ("parameters_sha256", "personal_sha256", "personal_test_accuracy"):
        assert pattern[key] == explicit[key], key
    assert pattern["local_subgraphs"] == explicit["local_subgraphs"] == ["norm0", "norm1"]


def test_graph_explain_names_the_pattern_each_module_took_its_strategy_from() -> None:
    from paratrain.explain import explain

    report = explain(_job({"class:BatchNorm1d": LOCAL}), shapes=False)
    got = {(n["module"], n["strategy"], n["strategy_from"]) for n in report["nodes"]}
    assert ("BatchNorm1d", "Local", "subgraphs.class:BatchNorm1d") in got
    assert ("Linear", "Federated", "strategy") in got
    assert all(s == "Local" for m, s, _ in got if m == "BatchNorm1d")
