"""paratrain's pipeline schedules against ``torch.distributed.pipelining`` (issue 34/35).

One 2-process gloo launch (CPU) runs every case: paratrain's schedule and torch's on the
same stages (the benchmark's token MLP cut into equal chunks, chunk ``k`` on rank
``k mod 2``; two chunks per rank for the interleaved schedules), from the same initial
weights, on the same batch split into the same ``m`` micro-batches, with the same mean
cross-entropy. Two steps per case; for each, the per-micro-batch losses, the step loss and
every parameter's gradient must be equal (rtol 1e-5, atol 1e-6), and both must equal the
unpartitioned model in one process. Each rank must have run exactly its paratrain
schedule's order. Pairs:

- ``1F1B`` vs ``Schedule1F1B``, ``GPipe`` vs ``ScheduleGPipe``;
- ``Interleaved1F1B`` (``virtual_stages = 2``) vs ``ScheduleInterleaved1F1B`` (2 stages per rank);
- ``ZBH1`` vs ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB1P;
  both split the backward into input and weight passes);
- paratrain has no interleaved zero-bubble schedule: torch's ``ScheduleInterleavedZeroBubble``
  with 2 stages per rank is compared with the nearest, our ``Interleaved1F1B`` on the same chunks.

Non-vacuity: per case, paratrain reruns the last batch with one token of one micro-batch
changed; the same comparison must then fail, on that micro-batch's loss (and only it) and on
the gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _workers_pipeline_torch import STEPS, batch, build, reference, run_cases
from paratrain.comm.testing import run_distributed
from paratrain.executors.model_parallel.schedule import schedule

RTOL, ATOL = 1e-5, 1e-6
P, ROWS = 2, 24

# (paratrain's schedule, torch's schedule class, chunks per rank)
PAIRS = [
    ("1F1B", "Schedule1F1B", 1),
    ("GPipe", "ScheduleGPipe", 1),
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
    ("ZBH1", "ScheduleInterleavedZeroBubble", 1),
    ("Interleaved1F1B", "ScheduleInterleavedZeroBubble", 2),
]
CASES = [{"ours": o, "torch": t, "v": v, "m": m, "rows": ROWS, "seed": 10 * n + m, "perturb": (n + m) % m}
         for n, (o, t, v) in enumerate(PAIRS) for m in (4, 6)]
IDS = [f"{c['ours']}-vs-{c['torch']}-v{c['v']}-m{c['m']}" for c in CASES]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    """Every case's results, per rank: ``[rank][case]``."""
    return run_distributed(run_cases, P, CASES, timeout_s=120)


def _merged(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The gradients of all ranks (each rank's parameters are its own)."""
    out: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        assert not set(grads) & set(out), "a parameter got a gradient on two ranks"
        out.update(grads)
    return out


def mismatches(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where two steps' per-micro-batch losses or gradients differ beyond the tolerances."""
    bad: list[str] = []
    if len(ours["losses"]) != len(theirs["losses"]):
        return [f"{len(ours['losses'])} micro-batch losses vs {len(theirs['losses'])}"]
    for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        if abs(a - b) > ATOL + RTOL * abs(b):
            bad.append(f"loss of micro-batch {i}: {a!r} vs {b!r}")
    if set(ours["grads"]) != set(theirs["grads"]):
        return [*bad, f"gradients of {sorted(ours['grads'])} vs {sorted(theirs['grads'])}"]
    for k in sorted(ours["grads"]):
        a, b = ours["grads"][k], theirs["grads"][k]
        if a.shape != b.shape or not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            bad.append(f"gradient of {k}: max |diff| {float((a - b).abs().max()):.3g}")
    return bad


def _step(rank_results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One library's step over the ranks: the loss rank's losses, all ranks' gradients."""
    last = rank_results[-1][key]
    return {"losses": last["losses"], "step_loss": last.get("step_loss"),
            "grads": _merged([r[key]["grads"] for r in rank_results])}


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_losses_and_gradients_equal_torch(results: list[list[dict[str, Any]]], index: int) -> None:
    case = CASES[index]
    per_rank = [r[index] for r in results]
    names = {k for k, _ in build(0).named_parameters()}
    v, m = case["v"], case["m"]
    for rank, res in enumerate(per_rank):
        assert res["parts"] == [rank + c * P for c in range(v)]
    for k in range(STEPS):
        steps = [res["steps"][k] for res in per_rank]
        for rank, st in enumerate(steps):  # paratrain ran the schedule it is named after
            assert [tuple(a) for a in st["ours"]["order"]] == schedule(case["ours"], rank, P, m, v)
        ours = _step([{"s": st["ours"]} for st in steps], "s")
        theirs = _step([{"s": st["torch"]} for st in steps], "s")
        assert set(ours["grads"]) == set(theirs["grads"]) == names
        assert len(theirs["losses"]) == m and steps[-1]["ours"]["micro_ids"] == list(range(m))
        assert mismatches(ours, theirs) == []
        # the step loss: paratrain's sum of n_i/B-weighted micro-batch means = torch's mean
        assert ours["step_loss"] == pytest.approx(sum(theirs["losses"]) / m, rel=RTOL, abs=ATOL)
        # and both are the unpartitioned model's
        x, y = batch(case["rows"], case["seed"] + k)
        ref_losses, ref_grads = reference(case["seed"], x, y, m)
        truth = {"losses": ref_losses, "grads": ref_grads}
        assert mismatches(ours, truth) == []
        assert mismatches(theirs, truth) == []


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_perturbed_micro_batch_is_caught(results: list[list[dict[str, Any]]], index: int) -> None:
    """One token of micro-batch ``perturb`` changed: the comparison fails there, and only
    there among the losses (the others are computed on the same rows, so still equal)."""
    case = CASES[index]
    per_rank = [r[index] for r in results]
    theirs = _step([res["steps"][-1] for res in per_rank], "torch")
    bad = mismatches(_step(per_rank, "perturbed"), theirs)
    loss_msgs = [b for b in bad if b.startswith("loss")]
    assert loss_msgs and all(b.startswith(f"loss of micro-batch {case['perturb']}:") for b in loss_msgs), bad
    assert any(b.startswith("gradient of embed.weight") for b in bad), bad
    assert any(b.startswith("gradient of head.") for b in bad), bad
