"""ZeRO (``strategy.shard``) with the rest of DataParallel, 2 gloo ranks, each level against
unsharded AllReduce (rtol 1e-6): the zoo GPT (tied head: the root unit; ``shard_unit =
["Block"]``) with gradient clipping by the global norm, accumulation and bf16 autocast;
the unused-parameter rule (a layer never called, one called on rank 0 only, one called by
the data) and a unit holding only an empty parameter; a ``[subgraphs]`` Local head that
stays whole and each rank's own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _workers_dp_zero import GPT, zero_cases
from paratrain.comm.testing import run_distributed

pytestmark = [pytest.mark.timeout(300)]

GPT_EXTRA: dict[str, Any] = {**GPT, "train": {"grad_clip_norm": 0.1, "grad_accumulation": 2,
                                              "precision": "bf16", "batch_size": 4}}
UNUSED: dict[str, Any] = {"model": {"factory": "test_dp_unused_params:make_net", "data_branch": True,
                                    "empty_param": True},
                          "train": {"max_steps": 5}}
LOCAL: dict[str, Any] = {"subgraphs": {"head": {"type": "Local"}}, "train": {"grad_clip_norm": 0.05}}
UNITS = {"gpt": ["Block"], "unused": ["fc1", "head", "marker"], "local": None}
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "gpt": ("adamw", GPT_EXTRA, ("none", "gradients", "parameters")),
    "unused": ("sgd", UNUSED, ("none", "optimizer", "parameters")),
    "local": ("sgd", LOCAL, ("none", "parameters")),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cases = []
    for name, (opt, extra, levels) in CASES.items():
        for lvl in levels:
            more = dict(extra)
            if lvl == "parameters" and UNITS[name] is not None:
                more["strategy_extra"] = {"shard_unit": UNITS[name]}
            cases.append((f"{name}-{lvl}", lvl, opt, more))
    return run_distributed(zero_cases, 2, str(tmp_path_factory.mktemp("zerof")), cases, timeout_s=250)


def _t(x: list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_each_level_equals_unsharded_allreduce(runs: list[dict[str, Any]], name: str) -> None:
    levels = CASES[name][2]
    for r in runs:
        ref = _t(r[f"{name}-none"]["params"])
        for lvl in levels[1:]:
            torch.testing.assert_close(_t(r[f"{name}-{lvl}"]["params"]), ref, rtol=1e-6, atol=1e-8)


def test_what_is_sharded_is_reported(runs: list[dict[str, Any]]) -> None:
    gpt = runs[0]["gpt-parameters"]["summary"]
    # the tied embedding / head weight is used by two units: the root holds it
    assert "0.tok.weight" in gpt["units"]["(root)"] or any("tok.weight" in n for n in gpt["units"]["(root)"])
    assert any(k.endswith(("0", "1")) for k in gpt["units"] if k != "(root)")
    local = runs[0]["local-parameters"]["summary"]
    assert local["local"] == ["head.bias", "head.weight"]
    assert all(not n.startswith("head.") for names in local["units"].values() for n in names)


def test_the_local_head_is_each_ranks_own(runs: list[dict[str, Any]]) -> None:
    a, b = (_t(r["local-parameters"]["params"]) for r in runs)
    assert (a - b).abs().max() > 1e-4  # non-vacuity: the Local head differs between ranks
