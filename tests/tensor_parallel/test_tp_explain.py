"""``paratrain validate`` and ``paratrain graph`` say which modules tensor parallelism shards
and with which style (the executor's dry run, no processes); a plan's bad style or a pattern
that matches nothing is an exit-2 problem naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.cli import main

HF_JOB = """
[run]
name = "hf-tp"
output_dir = "{out}"

[task]
name = "language_model"
block_size = 16

[data]
factory = "hf_factories:tiny_text"

[model]
factory = "hf_factories:llama"

[tensor_parallel]
tensor_parallel_size = 2

[tensor_parallel.plan]
{plan}
"""

OWN_JOB = """
[run]
name = "own-tp"
output_dir = "{out}"

[model]
name = "mlp"

[tensor_parallel]
tensor_parallel_size = 2
"""


def _write(tmp_path: Path, text: str, **kw: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text.format(out=tmp_path / "runs", **kw))
    return str(path)


def test_validate_lists_the_sharded_hf_blocks_and_plan_entries(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    job = _write(tmp_path, HF_JOB, plan='"lm_head" = { style = "colwise", output = "replicate" }')
    assert main(["validate", job]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{job}: ok"
    assert (f"{job}: tensor parallel: model.layers.1.self_attn: LlamaAttention: q_proj/k_proj/v_proj "
            "colwise, o_proj rowwise: 4 heads -> 2, 2 kv heads -> 1 per rank") in out
    assert f"{job}: tensor parallel: model.layers.0.mlp: LlamaMLP: gate_proj/up_proj colwise, down_proj rowwise" in out
    assert f'{job}: tensor parallel: lm_head: colwise, output replicated (plan "lm_head")' in out


@pytest.mark.parametrize(("plan", "problem"), [
    ('"lm_head" = "colwize"', "tensor_parallel.plan.lm_head.style: unknown style 'colwize'"),
    ('"model.layers.*.mlp.fc9" = "rowwise"', 'tensor_parallel.plan."model.layers.*.mlp.fc9": matches no module'),
])
def test_plan_problems_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], plan: str,
                                    problem: str) -> None:
    pytest.importorskip("transformers")
    job = _write(tmp_path, HF_JOB, plan=plan)
    assert main(["validate", job]) == 2
    assert problem in capsys.readouterr().err


def test_graph_has_a_tensor_parallel_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _write(tmp_path, OWN_JOB)
    assert main(["graph", job]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel (size 2), modules sharded:" in out
    tail = out.split("modules sharded:")[1].split()
    assert tail[:6] == ["module", "sharding", "fc0", "colwise", "head", "rowwise"]
