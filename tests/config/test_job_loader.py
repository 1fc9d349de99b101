"""Job files: broken ones exit 2 with field paths; the loader and `paratrain validate`
never raise anything but a clean ConfigError, for random and mutated documents."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.config.job import load_job, parse_job_text

JOBS = Path(__file__).resolve().parents[1] / "jobs"
EXPECT = {
    "bad_tag.toml": ["strategy.type", "DataParalel", "DataParallel"],
    "zero_replicas.toml": ["strategy.num_replicas", "0"],
    "float_count.json": ["strategy.num_clients", "2.5"],
    "fraction.yaml": ["strategy.client_selection.fraction", "1.5"],
    "bits.toml": ["compression.base_strategy.bits", "40"],
    "missing_field.toml": ["strategy.aggregation", "missing"],
    "unknown_section_key.toml": ["train.epoch"],
    "bad_topology.toml": ["strategy.aggregation", "star", "ring"],
    "syntax.toml": ["<file>", "toml"],
    "not_mapping.yaml": ["<root>", "list"],
    "negative_seed.toml": ["run.seed", "-1"],
    "tp.json": ["tensor_parallel.tensor_parallel_size", "tensor_parallel.memory_optimization", "Huge"],
    "optimizer.toml": ["train.optimizer.name", "lbfgs"],
    "search_space.toml": ["search_space.lr", "low"],
    "pop_zero.toml": ["strategy.population_size", "0"],
    "tp_compression.toml": ["compression", "one replica"],
    "mp_placement.toml": ["strategy.partitions[0].node_ids", "fc9", "fc0",
                          "strategy.partitions[0].target.Tag", "gpu"],
}


def test_every_broken_file_has_an_expectation() -> None:
    """Listed here, or carrying a ``# expect: FIELD`` line that
    tests/config/test_validate_matches_run.py checks against both validate and run."""
    jobs = [p for p in (JOBS / "broken").iterdir() if p.is_file()]
    assert set(EXPECT) <= {p.name for p in jobs}
    for p in jobs:
        assert p.name in EXPECT or "# expect: " in p.read_text(), p.name


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_validate_broken_exits_2_with_field_paths(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = JOBS / "broken" / name
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line]
    assert lines and all(line.startswith(str(path)) for line in lines)
    for needle in EXPECT[name]:
        assert needle in err, (needle, err)


def test_validate_good_files_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    paths = sorted(str(p) for p in (JOBS / "good").iterdir())
    examples = sorted(str(p) for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))
    assert main(["validate", *paths, *examples]) == 0, capsys.readouterr().err


def test_validate_reports_all_problems_of_one_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(JOBS / "broken" / "tp.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 2


def test_missing_file_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "does/not/exist.toml"]) == 2
    assert "not found" in capsys.readouterr().err


def test_schema_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"run", "model", "data", "train", "strategy"} <= set(schema["properties"])


# ----------------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**9) | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
SECTION_KEYS = ["run", "model", "data", "train", "strategy", "compression", "tensor_parallel",
                "workers", "comm", "federated", "population", "search_space"]


def _seed_docs() -> list[dict]:
    docs = []
    for p in sorted((JOBS / "good").iterdir()):
        docs.append(parse_job_text(p.read_text(), p.suffix.lstrip(".")))
    return docs


@st.composite
def mutated_docs(draw: st.DrawFn) -> dict:
    doc = json.loads(json.dumps(draw(st.sampled_from(_seed_docs()))))
    for _ in range(draw(st.integers(1, 4))):
        # walk to a random dict inside the document and change one entry
        node = doc
        while True:
            children = [k for k, v in node.items() if isinstance(v, dict)]
            if not children or draw(st.booleans()):
                break
            node = node[draw(st.sampled_from(children))]
        keys = list(node) + draw(st.lists(st.sampled_from(SECTION_KEYS + ["type", "method", "k"]), max_size=1))
        if not keys:
            continue
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["replace", "delete", "wrap"]))
        if action == "delete":
            node.pop(key, None)
        elif action == "wrap":
            node[key] = [node.get(key)]
        else:
            node[key] = draw(json_values)
    return doc


def _only_clean_errors(doc: object) -> None:
    try:
        load_job(doc)  # type: ignore[arg-type]
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and m for p, m in e.problems)


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(SECTION_KEYS + ["junk"]), json_values, max_size=6))
def test_fuzz_random_documents(doc: dict) -> None:
    _only_clean_errors(doc)


@settings(max_examples=300)
@given(mutated_docs())
def test_fuzz_mutated_documents(doc: dict) -> None:
    _only_clean_errors(doc)


@settings(max_examples=150)
@given(data=st.binary(max_size=200), fmt=st.sampled_from(["toml", "json", "yaml"]))
def test_fuzz_raw_bytes_through_cli(data: bytes, fmt: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("fuzz") / f"job.{fmt}"
    path.write_bytes(data)
    assert main(["validate", "-q", str(path)]) in (0, 2)


@settings(max_examples=100)
@given(doc=mutated_docs(), fmt=st.sampled_from(["toml", "json", "yaml"]))
def test_fuzz_mutated_files_through_cli(doc: dict, fmt: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("fuzz") / f"job.{fmt}"
    if fmt == "json":
        text = json.dumps(doc)
    elif fmt == "yaml":
        text = yaml.safe_dump(doc)
    else:
        try:
            import tomli_w  # type: ignore[import-not-found]
        except ImportError:
            text = json.dumps(doc)  # TOML writer absent: garbage TOML is fine input too
        else:
            try:
                text = tomli_w.dumps(doc)
            except (TypeError, ValueError):  # e.g. null has no TOML form
                text = json.dumps(doc)
    path.write_text(text)
    assert main(["validate", "-q", str(path)]) in (0, 2)


def test_toml_is_real_toml() -> None:
    assert tomllib.loads((JOBS / "good" / "local.toml").read_text())["run"]["name"] == "good_local"
