"""Assertions shared by the HF tensor-parallel test modules (one suite result per rank)."""

from __future__ import annotations

from typing import Any

TOL = 1e-5  # rtol on the dense scale (max(1, |x|_max)), as the acceptance asks


def close(d: dict[str, Any], what: str) -> None:
    assert not d["missing"], (what, d["missing"])
    assert d["out"] < TOL, (what, d)
    assert d["grads"] < TOL, (what, d)


def check_suite(results: list[dict[str, Any]], *, full: bool = True, plan: bool = False) -> None:
    """Every rank: ours (no plan) == dense == torch's parallelize_module, the dense state
    of the shards == the dense model's, each rank holds less than the whole model."""
    for rank, res in enumerate(results):
        close(res["auto"], f"rank {rank}: ours vs dense")
        close(res["torch_vs_dense"], f"rank {rank}: torch vs dense")
        close(res["torch_vs_ours"], f"rank {rank}: torch vs ours")
        if full:
            close(res["auto_checkpointed"], f"rank {rank}: ours (checkpointed) vs dense")
        if plan:
            close(res["plan"], f"rank {rank}: ours with HF's plan vs dense")
            close(res["plan_vs_torch"], f"rank {rank}: ours with HF's plan vs torch")
        assert res["state"]["diff"] == 0.0, res["state"]
        assert res["shard_names"] == [], res["shard_names"]  # every checkpoint name is a dense name
        assert res["pieces"] == 0.0  # each shard is the piece of the dense tensor its spec names
        assert res["local_params"] < res["dense_params"]
