"""ZeRO checkpoints (``strategy.shard``): each rank saves its row pieces under the model's
names with their shard specs, so a ZeRO-3 run on 4 gloo ranks resumes on 2 (ZeRO-3 again)
and on 1 (Local), equal to the same resumes of an unsharded run's checkpoint (rtol 1e-6);
a resume on the same world is bit-identical to the uninterrupted run; the exported
``model.safetensors`` is the one whole state_dict. Also the held bytes at N = 4 (16/N)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_dp_zero import zero_job, zero_resume
from paratrain.comm.testing import run_distributed

pytestmark = [pytest.mark.timeout(400), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from paratrain.executors import local
    from paratrain.training.export import load_model

    tmp = tmp_path_factory.mktemp("zeror")
    four = run_distributed(zero_resume, 4, str(tmp), [("z3", "parameters", 2, False),
                                                      ("ref", "none", 2, False)], timeout_s=250)
    for name in ("z3", "ref"):
        shutil.copytree(tmp / name, tmp / f"{name}-one")
    two = run_distributed(zero_resume, 2, str(tmp), [
        ("z3", "parameters", 4, True), ("ref", "none", 4, True),
        ("sw", "parameters", 2, False), ("sw", "parameters", 4, True), ("full", "parameters", 4, False),
    ], timeout_s=250)
    one: dict[str, Any] = {}
    for name in ("z3-one", "ref-one"):
        job = zero_job(str(tmp), name, 1, "none", steps=4, strategy={"type": "Local"})
        local.run(job, resume=True)
        one[name] = load_model(tmp / name)
    return {"tmp": tmp, "four": four, "two": two, "one": one}


def _t(x: list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_a_zero3_run_on_4_ranks_resumes_on_2_and_on_1(runs: dict[str, Any]) -> None:
    two = runs["two"]
    for r in two:
        torch.testing.assert_close(_t(r["z3:4"]["params"]), _t(r["ref:4"]["params"]), rtol=1e-6, atol=1e-8)
    # non-vacuity: the resumed steps moved the parameters
    four = runs["four"]
    assert (_t(two[0]["z3:4"]["params"]) - _t(four[0]["z3:2"]["params"])).abs().max() > 1e-4
    one = runs["one"]
    for k, v in one["ref-one"].items():
        torch.testing.assert_close(one["z3-one"][k], v, rtol=1e-6, atol=1e-8)


def test_a_same_world_resume_is_bit_identical(runs: dict[str, Any]) -> None:
    for r in runs["two"]:
        assert torch.equal(_t(r["sw:4"]["params"]), _t(r["full:4"]["params"]))


def test_the_export_is_one_whole_state_dict(runs: dict[str, Any]) -> None:
    from paratrain.training.export import load_model

    state = load_model(runs["tmp"] / "z3")
    flat = torch.cat([v.reshape(-1) for v in state.values()]).double()
    assert torch.equal(flat, _t(runs["two"][0]["z3:4"]["params"]))
    ref = load_model(runs["tmp"] / "ref")
    assert list(state) == list(ref) and all(state[k].shape == ref[k].shape for k in ref)


def test_held_bytes_at_four_ranks(runs: dict[str, Any]) -> None:
    for r in runs["four"]:
        s = r["z3:2"]["summary"]
        n = s["num_parameters"]
        assert abs(s["held_bytes"]["total"] - 16 / 4 * n) <= 0.1 * 16 / 4 * n
        assert s["held_bytes"]["parameters"] < 4 * n / 3  # non-vacuity: a quarter (+ padding rows)


def test_checkpoints_hold_pieces_with_row_specs(runs: dict[str, Any]) -> None:
    """The DCP checkpoint records each rank's rows as a chunk of the whole tensor."""
    from paratrain.comm.dcp import read_metadata
    from paratrain.training.stores import latest_folder, read_rank_state

    folder = latest_folder(Path(runs["tmp"]) / "full" / "checkpoints")
    assert folder is not None
    state = read_rank_state(folder, 1)
    specs = dict(zip(state["names"], state["shards"], strict=True))
    w = next(k for k in specs if k.endswith("weight"))
    assert specs[w]["offsets"][0] > 0  # rank 1's rows
    chunks = read_metadata(folder).state_dict_metadata[f"model/{w}"].chunks
    assert len(chunks) > 1 and sorted(c.offsets[0] for c in chunks)[0] == 0  # one per rank
