"""The contract: exact JSON round-trips, field-path rejections, schema export."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from paratrain.config import (
    ConfigError,
    compression_schema,
    dump_compression,
    dump_strategy,
    dump_tensor_parallel,
    job_schema,
    load_compression,
    load_strategy,
    load_tensor_parallel,
    strategy_schema,
)

# Every JSON document of DESIGN §3 and of the reference's §1.4 (seed shapes).
STRATEGY_EXAMPLES = [
    {"type": "Local"},
    {"type": "DataParallel", "num_replicas": 4, "aggregation": {"method": "AllReduce"}},
    {"type": "DataParallel", "num_replicas": 4, "aggregation": {"method": "ParameterServer"}},
    {"type": "DataParallel", "num_replicas": 4,
     "aggregation": {"method": "Decentralized", "topology": "ring"}},
    {"type": "ModelParallel",
     "partitions": [{"node_ids": ["embed", "block0"], "target": {"Tag": "gpu"}},
                    {"node_ids": ["block1", "head"], "target": {"WorkerId": "worker-1"}}],
     "communication": {"protocol": "Pipeline", "micro_batch_size": 4}},
    {"type": "ModelParallel",
     "partitions": [{"node_ids": ["embed", "backbone"], "target": {"Tag": "gpu-0"}},
                    {"node_ids": ["head_a"], "target": {"WorkerId": "ws://w1:8080"}}],
     "communication": {"protocol": "Pipeline", "micro_batch_size": 4}},
    {"type": "ModelParallel", "partitions": [{"node_ids": ["a"], "target": {"Tag": "x"}}],
     "communication": {"protocol": "Direct"}},
    {"type": "ModelParallel", "partitions": [{"node_ids": ["a"], "target": {"Tag": "x"}}],
     "communication": {"protocol": "DataStore"}},
    {"type": "Federated", "num_clients": 10, "rounds": 50,
     "aggregation": {"method": "FedProx", "mu": 0.01},
     "client_selection": {"method": "Random", "fraction": 0.3}},
    {"type": "Federated", "num_clients": 10, "rounds": 50, "aggregation": {"method": "FedAvg"},
     "client_selection": {"method": "All"}},
    {"type": "Federated", "num_clients": 10, "rounds": 50,
     "aggregation": {"method": "FedYogi", "beta1": 0.9, "beta2": 0.99, "tau": 0.001},
     "client_selection": {"method": "ByCapability", "required_tags": ["gpu"]}},
    {"type": "PopulationBased", "population_size": 8, "generations": 10,
     "exploit": {"method": "Truncation", "fraction": 0.25},
     "explore": {"method": "Perturbation", "factor": 0.2}},
    {"type": "PopulationBased", "population_size": 20, "generations": 50,
     "exploit": {"method": "Truncation", "fraction": 0.2},
     "explore": {"method": "Perturbation", "factor": 0.2}},
    {"type": "PopulationBased", "population_size": 8, "generations": 10,
     "exploit": {"method": "Binary", "threshold": 0.0}, "explore": {"method": "Resample"}},
    {"type": "PopulationBased", "population_size": 8, "generations": 10,
     "exploit": {"method": "Binary"}, "explore": {"method": "Resample"}},
    {"type": "Custom", "coordinator": "my_coordinator", "config": {"any": "json"}},
    {"type": "Custom", "coordinator": "my_coord", "config": [1, "two", None, {"x": 3.5}]},
]

COMPRESSION_EXAMPLES = [
    {"method": "None"},
    {"method": "TopK", "k": 1000},
    {"method": "RandomK", "k": 1000},
    {"method": "Threshold", "threshold": 0.001},
    {"method": "Quantization", "bits": 8},
    {"method": "Quantization", "bits": 2, "rounding": "deterministic"},  # extension field
    {"method": "ErrorFeedback", "base_strategy": {"method": "TopK", "k": 10},
     "error_compensation": True},
    {"method": "ClippedCompression", "base_strategy": {"method": "Quantization", "bits": 4},
     "clip_value": 1.0},
    {"method": "ErrorFeedback", "error_compensation": False, "base_strategy": {
        "method": "ClippedCompression", "clip_value": 0.5,
        "base_strategy": {"method": "TopK", "k": 3}}},
]

TP_FULL = {
    "tensor_parallel_size": 1, "partitioning_strategy": "ColumnWise", "column_parallel": True,
    "row_parallel": True, "communication_pattern": "AllReduce", "async_communication": True,
    "fusion_threshold_bytes": 1048576, "gradient_accumulation": True,
    "memory_optimization": "Medium", "mixed_precision": False,
}


@pytest.mark.parametrize("doc", STRATEGY_EXAMPLES, ids=lambda d: json.dumps(d)[:60])
def test_strategy_round_trip(doc: dict) -> None:
    assert dump_strategy(load_strategy(doc)) == doc
    # Also through JSON text, compared as text after canonical dumping.
    text = json.dumps(doc)
    assert json.dumps(dump_strategy(load_strategy(text))) == text


@pytest.mark.parametrize("doc", COMPRESSION_EXAMPLES, ids=lambda d: d["method"])
def test_compression_round_trip(doc: dict) -> None:
    assert dump_compression(load_compression(doc)) == doc


def test_tensor_parallel_defaults_and_round_trip() -> None:
    assert dump_tensor_parallel(load_tensor_parallel({})) == TP_FULL
    custom = dict(TP_FULL, tensor_parallel_size=4, partitioning_strategy="BlockWise",
                  communication_pattern="Hierarchical", memory_optimization="None")
    assert dump_tensor_parallel(load_tensor_parallel(custom)) == custom
    assert dump_tensor_parallel(load_tensor_parallel(json.dumps(custom))) == custom


def test_binary_without_threshold_means_zero() -> None:
    s = load_strategy(STRATEGY_EXAMPLES[-3])
    assert s.exploit.threshold == 0.0


def _err(loader, doc) -> str:
    with pytest.raises(ConfigError) as info:
        loader(doc)
    return str(info.value)


DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
FED = {"type": "Federated", "num_clients": 10, "rounds": 5, "aggregation": {"method": "FedAvg"},
       "client_selection": {"method": "All"}}
PBT = {"type": "PopulationBased", "population_size": 4, "generations": 2,
       "exploit": {"method": "Truncation", "fraction": 0.25},
       "explore": {"method": "Resample"}}


@pytest.mark.parametrize(
    ("doc", "needles"),
    [
        ({"type": "Lokal"}, ["type", "'Lokal'", "Local", "DataParallel", "Custom"]),
        ({}, ["type"]),
        (dict(DP, aggregation={"method": "AllReduse"}), ["aggregation.method", "AllReduse", "ParameterServer"]),
        (dict(DP, num_replicas=0), ["num_replicas", "0"]),
        (dict(DP, num_replicas=-3), ["num_replicas", "-3"]),
        (dict(DP, num_replicas=2.5), ["num_replicas", "2.5"]),
        (dict(DP, num_replicas="2"), ["num_replicas", "'2'"]),
        (dict(DP, num_replicas=True), ["num_replicas", "True"]),
        ({"type": "DataParallel", "aggregation": {"method": "AllReduce"}}, ["num_replicas", "missing"]),
        (dict(DP, aggregation={"method": "Decentralized", "topology": "star"}), ["aggregation", "star", "ring", "torus", "complete"]),
        (dict(FED, num_clients=0), ["num_clients", "0"]),
        (dict(FED, rounds=0), ["rounds", "0"]),
        (dict(FED, client_selection={"method": "Random", "fraction": 0.0}), ["client_selection.fraction", "0.0"]),
        (dict(FED, client_selection={"method": "Random", "fraction": 1.01}), ["client_selection.fraction", "1.01"]),
        (dict(FED, aggregation={"method": "FedYogi", "beta1": 0.9}), ["aggregation.beta2", "missing", "aggregation.tau"]),
        (dict(PBT, population_size=0), ["population_size", "0"]),
        (dict(PBT, generations=0), ["generations", "0"]),
        (dict(PBT, exploit={"method": "Tournament"}), ["exploit.method", "Tournament", "Truncation", "Binary"]),
        ({"type": "ModelParallel", "partitions": [{"node_ids": ["a"], "target": {"Host": "x"}}],
          "communication": {"protocol": "Direct"}}, ["partitions[0]", "WorkerId", "Tag"]),
        ({"type": "ModelParallel", "partitions": [], "communication": {"protocol": "Pipeline", "micro_batch_size": 0}},
         ["communication.micro_batch_size", "0"]),
        ({"type": "Custom", "config": {}}, ["coordinator", "missing"]),
    ],
)
def test_strategy_rejections_name_field_and_value(doc: dict, needles: list[str]) -> None:
    msg = _err(load_strategy, doc)
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize(
    ("doc", "needles"),
    [
        ({"method": "Quantization", "bits": 0}, ["bits", "0"]),
        ({"method": "Quantization", "bits": 33}, ["bits", "33"]),
        ({"method": "Quantization", "bits": 8.0}, ["bits", "8.0"]),
        ({"method": "Quantization", "bits": 8, "rounding": "nearest"}, ["rounding", "nearest"]),
        ({"method": "TopK", "k": -1}, ["k", "-1"]),
        ({"method": "TopK"}, ["k", "missing"]),
        ({"method": "Top-K", "k": 1}, ["method", "Top-K", "TopK", "RandomK"]),
        ({"method": "ErrorFeedback", "base_strategy": {"method": "Quantization", "bits": 64},
          "error_compensation": True}, ["base_strategy.bits", "64"]),
    ],
)
def test_compression_rejections(doc: dict, needles: list[str]) -> None:
    msg = _err(load_compression, doc)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_tensor_parallel_rejections() -> None:
    assert "tensor_parallel_size" in _err(load_tensor_parallel, {"tensor_parallel_size": 0})
    msg = _err(load_tensor_parallel, {"partitioning_strategy": "Diagonal"})
    assert "partitioning_strategy" in msg and "ColumnWise" in msg
    assert "not valid JSON" in _err(load_tensor_parallel, "{")


def test_unknown_keys_are_ignored_like_serde() -> None:
    s = load_strategy({"type": "Local", "extra": 1})
    assert dump_strategy(s) == {"type": "Local"}


def test_models_are_frozen() -> None:
    s = load_strategy(DP)
    with pytest.raises(ValidationError):
        s.num_replicas = 3  # type: ignore[misc]


def test_schemas_export() -> None:
    for schema in (strategy_schema(), compression_schema(), job_schema()):
        json.dumps(schema)
    assert "DataParallel" in json.dumps(strategy_schema())
    assert "tensor_parallel" in job_schema()["properties"]


# ------------------------------------------------------------ property: round-trips

counts = st.integers(min_value=1, max_value=10**6)
fractions = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)
floats = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
tags = st.text(min_size=1, max_size=8)

aggregations = st.one_of(
    st.just({"method": "AllReduce"}), st.just({"method": "ParameterServer"}),
    st.sampled_from(["ring", "torus", "complete"]).map(lambda t: {"method": "Decentralized", "topology": t}),
)
fed_aggs = st.one_of(
    st.just({"method": "FedAvg"}), floats.map(lambda m: {"method": "FedProx", "mu": m}),
    st.tuples(st.floats(0, 0.999), st.floats(0, 0.999), st.floats(1e-9, 1.0)).map(
        lambda t: {"method": "FedYogi", "beta1": t[0], "beta2": t[1], "tau": t[2]}),
)
selections = st.one_of(
    st.just({"method": "All"}), fractions.map(lambda f: {"method": "Random", "fraction": f}),
    st.lists(tags, max_size=3).map(lambda t: {"method": "ByCapability", "required_tags": t}),
)
targets = st.one_of(tags.map(lambda t: {"Tag": t}), tags.map(lambda t: {"WorkerId": t}))
protocols = st.one_of(
    st.just({"protocol": "Direct"}), st.just({"protocol": "DataStore"}),
    counts.map(lambda m: {"protocol": "Pipeline", "micro_batch_size": m}),
)
strategies_json = st.one_of(
    st.just({"type": "Local"}),
    st.tuples(counts, aggregations).map(
        lambda t: {"type": "DataParallel", "num_replicas": t[0], "aggregation": t[1]}),
    st.tuples(st.lists(st.tuples(st.lists(tags, min_size=1, max_size=3), targets), max_size=3), protocols).map(
        lambda t: {"type": "ModelParallel",
                   "partitions": [{"node_ids": n, "target": g} for n, g in t[0]], "communication": t[1]}),
    st.tuples(counts, counts, fed_aggs, selections).map(
        lambda t: {"type": "Federated", "num_clients": t[0], "rounds": t[1], "aggregation": t[2],
                   "client_selection": t[3]}),
    st.tuples(counts, counts, fractions, st.floats(0, 0.99)).map(
        lambda t: {"type": "PopulationBased", "population_size": t[0], "generations": t[1],
                   "exploit": {"method": "Truncation", "fraction": t[2]},
                   "explore": {"method": "Perturbation", "factor": t[3]}}),
)


@given(strategies_json)
def test_property_strategy_round_trip(doc: dict) -> None:
    assert dump_strategy(load_strategy(doc)) == doc


def _compression_docs(depth: int) -> st.SearchStrategy[dict]:
    leaf = st.one_of(
        st.just({"method": "None"}), st.integers(1, 10**6).map(lambda k: {"method": "TopK", "k": k}),
        st.integers(1, 10**6).map(lambda k: {"method": "RandomK", "k": k}),
        floats.map(lambda t: {"method": "Threshold", "threshold": t}),
        st.integers(1, 32).map(lambda b: {"method": "Quantization", "bits": b}),
        st.builds(lambda b, r: {"method": "Quantization", "bits": b, "rounding": r},
                  st.integers(1, 32), st.sampled_from(["stochastic", "deterministic"])),
    )
    if depth == 0:
        return leaf
    inner = _compression_docs(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(inner, st.booleans()).map(
            lambda t: {"method": "ErrorFeedback", "base_strategy": t[0], "error_compensation": t[1]}),
        st.tuples(inner, st.floats(1e-6, 1e6)).map(
            lambda t: {"method": "ClippedCompression", "base_strategy": t[0], "clip_value": t[1]}),
    )


@given(_compression_docs(3))
def test_property_compression_round_trip(doc: dict) -> None:
    assert dump_compression(load_compression(doc)) == doc
