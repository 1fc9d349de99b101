"""Issue 20 item 6: a real error of a tensor-parallel collective reaches the caller.

The tensor-parallel collectives used to catch any RuntimeError of the flat all-gather or
reduce-scatter, flip a process-wide flag to the list fallback and retry there: a wrong-shaped
call then "succeeded" on one rank (its slice of an all-reduce happened to fit) and failed with
an unrelated copy error on the other, and every later call of the process took the fallback.
Now whether a backend has the flat form is decided once by a known-good probe
(``comm/collectives.py``, for every caller), so the native error is raised on every rank and
the fast path stays in use. Two gloo ranks on 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed


def _attempt(fn: Any) -> str:
    try:
        fn()
    except RuntimeError as e:
        return f"raised: {e}"
    return "ok"


def wrong_shapes(ctx: WorkerContext) -> dict[str, Any]:
    from paratrain.comm import collectives as C

    group = ctx.group
    # reduce-scatter of 7 elements into 3 per rank (needs 6): a caller's bug
    bad_rs = _attempt(lambda: C.reduce_scatter_flat(torch.empty(3), torch.ones(7), group, False))
    # all-gather of 3 elements per rank into 8 (needs 6)
    bad_ag = _attempt(lambda: C.all_gather_flat(torch.empty(8), torch.ones(3), group, False))
    # the group still works, on the flat (native) path
    out = torch.empty(2)
    C.reduce_scatter_flat(out, torch.arange(4.0) + ctx.rank, group, False)
    gathered = torch.empty(4)
    C.all_gather_flat(gathered, torch.full((2,), float(ctx.rank)), group, False)
    backend = str(dist.get_backend(group))
    return {"bad_rs": bad_rs, "bad_ag": bad_ag, "rs": out.tolist(), "ag": gathered.tolist(),
            "flat": {op: C._FLAT.get((op, backend)) for op in ("all_gather", "reduce_scatter")}}


def test_a_wrong_shaped_collective_raises_on_every_rank_and_the_fast_path_stays() -> None:
    torch.manual_seed(0)
    results = run_distributed(wrong_shapes, 2, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["bad_rs"].startswith("raised: "), (rank, r["bad_rs"])
        assert r["bad_ag"].startswith("raised: "), (rank, r["bad_ag"])
        # the backend's own message, not a copy error of a fallback
        assert "copy" not in r["bad_rs"] and "size of tensor a" not in r["bad_rs"], r["bad_rs"]
        assert r["flat"] == {"all_gather": True, "reduce_scatter": True}, r["flat"]
        assert r["ag"] == [0.0, 0.0, 1.0, 1.0]
    # sum over ranks of arange(4) + rank = [1, 3, 5, 7]; rank r keeps chunk r
    assert results[0]["rs"] == [1.0, 3.0] and results[1]["rs"] == [5.0, 7.0]
