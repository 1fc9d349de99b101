"""``paratrain graph JOB --out FILE`` (paratrain.graph.draw): the
model's nodes coloured by worker with the values crossing workers on the arrows, drawn by
matplotlib; without --out the command prints as before."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from paratrain import cli
from paratrain.explain import explain_file, render
from paratrain.graph.render import shape_text, value_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RESIDUAL = str(EXAMPLES / "model_parallel_residual.toml")  # 3 workers, residual adds crossing


def _texts(svg: Path) -> str:
    root = ET.parse(svg).getroot()  # valid XML, an <svg> document
    assert root.tag.endswith("svg")
    return "\n".join(t for el in root.iter() for t in el.itertext())


def test_svg_names_every_worker_and_the_crossing_values(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "graph.svg"
    assert cli.main(["graph", RESIDUAL, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    text = _texts(out)
    report = explain_file(RESIDUAL)
    assert len(report["workers"]) == 3 and report["transfers"]
    for w in report["workers"]:  # the legend
        assert f"{w['worker']} (rank {w['rank']}" in text
    for t in report["transfers"]:  # each crossing value on an arrow, as the table names it
        assert f"{value_text(t, report['model'])} {shape_text(t['shape'])}" in text
    assert "not on an arrow" not in text
    for n in report["nodes"]:
        assert n["node"] in text


def test_edges_follow_the_data_flow_with_joining_functions_as_nodes() -> None:
    edges = {(e["from"], e["to"]) for e in explain_file(RESIDUAL, edges=True)["edges"]}
    # the residual add joins the stem and the first block; no block feeds a later one directly
    assert {("stem", "add"), ("blocks.0.fc2", "add"), ("add", "blocks.1.fc1"),
            ("(input)", "stem"), ("head", "(output)")} <= edges
    assert ("stem", "blocks.1.fc1") not in edges and ("blocks.0.fc2", "norm") not in edges


def test_without_out_it_prints_as_before_and_a_single_worker_job_draws(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["graph", RESIDUAL]) == 0
    assert capsys.readouterr().out == render(explain_file(RESIDUAL)) + "\n"
    out = tmp_path / "local.png"
    assert cli.main(["graph", str(EXAMPLES / "local_digits.toml"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_suffix_matplotlib_cannot_write_names_out(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["graph", RESIDUAL, "--out", str(tmp_path / "g.dot")]) == 2
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "g.dot").exists()
