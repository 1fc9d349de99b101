"""Hostile job files are refused in bounded time and memory (issue 13 item 6).

Random bytes and random nested documents in TOML, JSON and YAML give a JobConfig or a
ConfigError and nothing else; 3000-deep nesting, a YAML alias bomb and a 10 MB file are
each refused with one short line, in well under 2 s and 50 MB.
"""

from __future__ import annotations

import json
import math
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.config.job import MAX_JOB_BYTES, MAX_JOB_DEPTH, JobConfig, load_job, parse_job_text

FORMATS = ["toml", "json", "yaml"]
SECTIONS = ["run", "model", "data", "train", "strategy", "compression", "tensor_parallel",
            "workers", "comm", "federated", "population", "search_space"]


def _outcome(fn: Callable[[], Any]) -> JobConfig | ConfigError:
    """JobConfig or ConfigError; anything else propagates and fails the test."""
    try:
        out = fn()
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and isinstance(m, str) and m
                                  for p, m in e.problems), e.problems
        return e
    assert isinstance(out, JobConfig)
    return out


def _bounded(fn: Callable[[], Any], *, seconds: float = 2.0, mib: float = 50.0) -> ConfigError:
    """Run ``fn`` expecting a ConfigError; assert its wall time and tracemalloc peak.

    A first, unmeasured call imports whatever the loader imports lazily: the bounds are on
    parsing the document, and an import under tracemalloc on a loaded machine took seconds."""
    with pytest.raises(ConfigError):
        fn()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as info:
            fn()
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert peak < mib * 2**20, f"peak {peak / 2**20:.1f} MiB"
    text = str(info.value)
    assert len(text) < 400 and "\n" not in text, text
    return info.value


# ------------------------------------------------------------------- writers


def _toml_key(k: str) -> str:
    return json.dumps(k)  # a TOML basic string is a valid (quoted) key


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def dump(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc)
    if fmt == "yaml":
        return yaml.safe_dump(doc)
    return "\n".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in doc.items()) + "\n"


# ----------------------------------------------------------------- strategies

scalars = (st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(max_size=8) | st.sampled_from(["Local", "DataParallel", "AllReduce", "mlp", "sgd"]))
keys = st.sampled_from(SECTIONS + ["type", "method", "name", "num_replicas", "lr", "seed"]) | st.text(max_size=6)
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(keys, inner, max_size=4), max_leaves=25)
documents = st.dictionaries(keys, trees, max_size=6)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=300), fmt=st.sampled_from(FORMATS))
def test_random_bytes_give_job_or_config_error(data: bytes, fmt: str) -> None:
    def parse() -> JobConfig:
        return load_job(parse_job_text(data.decode("utf-8", "replace"), fmt))

    _outcome(parse)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), fmt=st.sampled_from(FORMATS))
def test_random_bytes_in_files(data: bytes, fmt: str, tmp_path: Path) -> None:
    path = tmp_path / f"job.{fmt}"
    path.write_bytes(data)  # not necessarily UTF-8
    _outcome(lambda: load_job(path))


@settings(max_examples=200, deadline=None)
@given(doc=documents, fmt=st.sampled_from(FORMATS))
def test_random_nested_documents_in_every_format(doc: dict[str, Any], fmt: str) -> None:
    text = dump(doc, fmt)
    _outcome(lambda: load_job(parse_job_text(text, fmt)))


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 400), kind=st.sampled_from(["list", "dict"]), fmt=st.sampled_from(FORMATS))
def test_random_depths(depth: int, kind: str, fmt: str) -> None:
    """Below the limit the document reaches validation; above it, a clean <file> error."""
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    out = _outcome(lambda: load_job(parse_job_text(dump({"strategy": value}, fmt), fmt)))
    assert isinstance(out, ConfigError)
    # root table, ``depth`` wrappers, the scalar: depth + 2 levels
    assert (out.problems[0][0] == "<file>") == (depth + 2 > MAX_JOB_DEPTH), out


# ------------------------------------------------------------ explicit cases

DEEP = 3000


def _deep_texts() -> dict[str, str]:
    return {
        "toml-array": "a = " + "[" * DEEP + "]" * DEEP,
        "toml-inline": "a = " + "{b = " * DEEP + "1" + "}" * DEEP,
        "toml-header": "[" + ".".join(["a"] * DEEP) + "]\nx = 1\n",
        "toml-dotted": ".".join(["a"] * DEEP) + " = 1\n",
        "json-array": "[" * DEEP + "]" * DEEP,
        "json-object": '{"a": ' * DEEP + "1" + "}" * DEEP,
        "yaml-flow": "a: " + "[" * DEEP + "]" * DEEP,
        "yaml-blocklist": "- " * DEEP + "1\n",  # compact nested block sequences, one line
        # indentation grows with depth: 1000 levels keep the file under the size limit
        "yaml-blockmap": "".join(" " * i + "a:\n" for i in range(1000)) + " " * 1000 + "1\n",
    }


@pytest.mark.parametrize("case", sorted(_deep_texts()))
def test_3000_deep_is_a_clean_error(case: str, tmp_path: Path) -> None:
    text = _deep_texts()[case]
    fmt = case.split("-")[0]
    err = _bounded(lambda: parse_job_text(text, fmt))
    assert err.problems[0][0] == "<file>"
    assert "nest" in str(err) or "depth" in str(err), err
    path = tmp_path / f"deep.{fmt}"
    path.write_text(text)
    _bounded(lambda: load_job(path))


@pytest.mark.parametrize("fmt", FORMATS)
def test_3000_deep_through_the_cli(fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = {"toml": "a = " + "[" * DEEP + "]" * DEEP, "json": "[" * DEEP + "]" * DEEP,
            "yaml": "[" * DEEP + "]" * DEEP}[fmt]
    path = tmp_path / f"deep.{fmt}"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err
    assert err.count("\n") == 1 and err.startswith(f"{path}: <file>: "), err


def test_deep_python_dict_is_a_clean_error() -> None:
    doc: Any = 1
    for _ in range(DEEP):
        doc = {"a": doc}
    err = _bounded(lambda: load_job({"strategy": doc}))
    assert "nested deeper" in str(err)


def _billion_laughs() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_fast(tmp_path: Path) -> None:
    text = _billion_laughs()
    # Without the guard this expands to 9^9 strings (about a minute and the validator's
    # whole memory); with it, it never gets past composing the first alias.
    err = _bounded(lambda: parse_job_text(text, "yaml"), seconds=1.0, mib=5.0)
    assert "alias" in str(err).lower()
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    _bounded(lambda: load_job(path), seconds=1.0, mib=5.0)


def test_yaml_single_alias_is_refused_with_its_line() -> None:
    with pytest.raises(ConfigError, match=r"\*opt at line 3"):
        parse_job_text("train:\n  optimizer: &opt {name: sgd}\nother: *opt\n", "yaml")


def test_yaml_python_tags_are_refused() -> None:
    with pytest.raises(ConfigError, match="constructor"):
        parse_job_text("run: !!python/object/apply:os.system ['true']\n", "yaml")


@pytest.mark.parametrize("fmt", FORMATS)
def test_10_mb_file_gets_a_short_message_without_being_read(fmt: str, tmp_path: Path) -> None:
    path = tmp_path / f"huge.{fmt}"
    with path.open("wb") as f:  # sparse where the filesystem allows: size without content
        f.truncate(10 * 2**20)
    err = _bounded(lambda: load_job(path), mib=1.0)  # 1 MiB: the file is never read
    assert err.problems[0][0] == "<file>" and "10.0 MiB" in str(err) and "limit" in str(err)


def test_huge_text_is_refused_by_parse_job_text() -> None:
    err = _bounded(lambda: parse_job_text("a = 1\n" + "#" * (MAX_JOB_BYTES + 1), "toml"), mib=20.0)
    assert "limit" in str(err)


def test_huge_file_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.toml"
    path.write_text("# padding\n" * (2 * 2**20 // 10))
    assert main(["run", str(path), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "limit" in err, err


@pytest.mark.parametrize("fmt", FORMATS)
def test_file_just_under_the_limit_is_parsed_in_bounded_time(fmt: str, tmp_path: Path) -> None:
    """The largest accepted file: many unknown keys, all reported, no blow-up."""
    n = 2000
    pad = "x" * ((MAX_JOB_BYTES - 4096) // n - 30)
    doc = {"run": {"name": "big"}, "junk": {f"k{i}": pad for i in range(n)}}
    text = dump(doc, fmt)
    assert len(text.encode()) <= MAX_JOB_BYTES
    path = tmp_path / f"big.{fmt}"
    path.write_text(text)
    err = _bounded(lambda: load_job(path), seconds=20.0, mib=50.0)
    assert [p for p, _ in err.problems] == ["junk"]


def test_depth_limit_leaves_real_jobs_alone() -> None:
    """Every shipped example and good job nests far below the limit."""
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "examples").glob("*.toml")) + sorted((root / "tests" / "jobs" / "good").iterdir())
    assert files
    for p in files:
        assert isinstance(load_job(p), JobConfig), p
