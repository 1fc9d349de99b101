"""`paratrain schema` describes every field: each property of every object in the job,
strategy and compression JSON Schemas has a non-empty ``description`` (the field's
attribute docstring; a discriminator tag says which variant it selects)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.config import compression_schema, job_schema, strategy_schema


def _undescribed(schema: dict[str, Any]) -> list[str]:
    """``Model.field`` for every property without a description, anywhere in ``schema``."""
    missing: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name, prop in props.items():
                    if not (isinstance(prop, dict) and str(prop.get("description", "")).strip()):
                        missing.append(f"{where}.{name}")
                    walk(prop, f"{where}.{name}")
            for key, value in node.items():
                if key == "$defs":
                    for name, sub in value.items():
                        walk(sub, name)
                elif key != "properties":
                    walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    walk(schema, "<root>")
    return sorted(set(missing))


@pytest.mark.parametrize("schema", [job_schema, strategy_schema, compression_schema],
                         ids=["job", "strategy", "compression"])
def test_every_property_has_a_description(schema: Any) -> None:
    doc = schema()
    assert doc.get("$defs"), "the walk must see the nested models"
    assert _undescribed(doc) == []


def test_the_walk_finds_a_missing_description() -> None:
    doc = {"properties": {"a": {"type": "string", "description": "A."}},
           "$defs": {"M": {"properties": {"b": {"type": "integer"}, "c": {"description": " "}}}}}
    assert _undescribed(doc) == ["M.b", "M.c"]


def test_schema_command_prints_the_descriptions() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "paratrain"), "schema"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    doc = json.loads(out)
    assert _undescribed(doc) == []
    run = doc["$defs"]["RunConfig"]["properties"]
    assert "restarts the worker processes" in run["max_restarts"]["description"]
    assert "selects TopK" in doc["$defs"]["TopK"]["properties"]["method"]["description"]
