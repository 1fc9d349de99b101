"""ModelParallel over any topology: parity of loss and gradients with the unpartitioned model.

Real gloo ranks (2 and 3). Models: a residual network whose skip connections cross the
cuts (one cut inside a block), two towers on two workers joined on a third, and the zoo
GPT cut mid-block with its tied head on another worker than the embedding. Each under
Direct, DataStore and Pipeline (GPipe and 1F1B), with fewer micro-batches than stages and
an uneven last micro-batch. Non-vacuity: zeroing one crossing value must break parity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from _workers_mp_graph import ResNet, TwoTower, reference, run_cases
from paratrain.comm.context import default_workers
from paratrain.comm.testing import run_distributed
from paratrain.config import ConfigError
from paratrain.config.strategy import Partition
from paratrain.executors.model_parallel.plan import build_plan

RTOL, ATOL = 1e-5, 1e-6


def _p(ids: list[str], w: int) -> dict[str, Any]:
    return {"node_ids": ids, "target": {"WorkerId": f"worker-{w}"}}


PLACEMENTS = {
    3: {
        # stem+block0 | block1 cut inside (LayerNorm, Linear on 1; Tanh, Linear on 2) | ...
        "resnet": [_p(["stem", "blocks.0", "blocks.1.0", "blocks.1.1"], 0),
                   _p(["blocks.1.2", "blocks.1.3", "blocks.2"], 1), _p(["head"], 2)],
        "towers": [_p(["left"], 0), _p(["right"], 1), _p(["join"], 2)],
        "gpt": [_p(["embed", "block0.ln1", "block0.attn"], 0), _p(["block0.mlp", "block1"], 1),
                _p(["ln_f", "head"], 2)],
    },
    2: {
        "resnet": [_p(["stem", "blocks.0", "blocks.1.0"], 0), _p(["blocks.1.1", "blocks.1.2",
                   "blocks.1.3", "blocks.2", "head"], 1)],
        "towers": [_p(["left"], 0), _p(["right", "join"], 1)],
        "gpt": [_p(["embed", "block0.attn"], 0), _p(["block0.mlp", "block1", "ln_f", "head"], 1)],
    },
}
PROTOCOLS = [
    ("Direct", {"protocol": "Direct"}, 7),
    ("DataStore", {"protocol": "DataStore"}, 7),
    ("GPipe-uneven", {"protocol": "Pipeline", "micro_batch_size": 3, "schedule": "GPipe"}, 7),
    ("1F1B-uneven", {"protocol": "Pipeline", "micro_batch_size": 3, "schedule": "1F1B"}, 7),
    # two micro-batches for three stages (fewer than stages), the last one smaller
    ("1F1B-few", {"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "1F1B"}, 3),
    ("GPipe-few", {"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "GPipe"}, 3),
]


def _cases(world: int, tmp: Path) -> list[dict[str, Any]]:
    cases = []
    for model, parts in PLACEMENTS[world].items():
        for name, comm, rows in PROTOCOLS:
            cases.append({"model": model, "partitions": parts, "communication": comm, "rows": rows,
                          "steps": 2 if name.startswith("1F1B") else 1, "label": f"{model}/{name}",
                          "datastore_dir": str(tmp)})
    return cases


def _merge(results: list[list[dict[str, Any]]], ci: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [r[ci]["loss"] for r in results if r[ci]["loss"] is not None]
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        for k, g in r[ci]["grads"].items():
            assert k not in grads, f"{k} trained on two ranks"
            grads[k] = torch.from_numpy(g)
    return losses, grads


def _matches(case: dict[str, Any], losses: list[float], grads: dict[str, torch.Tensor]) -> bool:
    ref_loss, ref = reference(case)
    return (len(losses) == 1 and abs(losses[0] - ref_loss) <= RTOL * abs(ref_loss)
            and sorted(grads) == sorted(ref)
            and all(torch.allclose(grads[k], g, rtol=RTOL, atol=ATOL) for k, g in ref.items()))


@pytest.mark.parametrize("world", [2, 3])
def test_any_topology_matches_the_unpartitioned_model(world: int, tmp_path: Path) -> None:
    cases = _cases(world, tmp_path)
    # non-vacuity: the same gpt pipeline with one crossing value replaced by zeros
    cases.append(dict(cases[-1], label="gpt/dropped", drop=0, datastore_dir=str(tmp_path)))
    results = run_distributed(run_cases, world, cases, timeout_s=240)
    for ci, case in enumerate(cases[:-1]):
        losses, grads = _merge(results, ci)
        ref_loss, ref = reference(case)
        assert len(losses) == 1, case["label"]
        assert losses[0] == pytest.approx(ref_loss, rel=RTOL), case["label"]
        assert sorted(grads) == sorted(ref), case["label"]
        for k, g in ref.items():
            torch.testing.assert_close(grads[k], g, rtol=RTOL, atol=ATOL, msg=f"{case['label']}: {k}")
        assert [r[ci]["parts"] for r in results] == [[r] for r in range(world)], case["label"]
        # the forward on the loss rank equals the model's output
        logits = [r[ci]["logits"] for r in results if r[ci]["logits"] is not None]
        assert len(logits) == 1
    dropped = len(cases) - 1
    assert results[0][dropped]["transfers"] >= world  # the cut really sends several values
    assert not _matches(cases[dropped], *_merge(results, dropped)), "dropping a crossing value went unnoticed"


def test_a_worker_may_own_parts_on_both_sides_of_another_for_direct(tmp_path: Path) -> None:
    """resnet: worker 0 runs stem and the head, worker 1 the blocks (A -> B -> A)."""
    case = {"model": "resnet", "rows": 5, "communication": {"protocol": "Direct"},
            "partitions": [_p(["blocks"], 1)], "label": "resnet/ABA", "datastore_dir": str(tmp_path)}
    ds = dict(case, communication={"protocol": "DataStore"}, label="resnet/ABA-datastore")
    results = run_distributed(run_cases, 2, [case, ds])
    for ci, c in enumerate((case, ds)):
        assert results[0][ci]["parts"] == [0, 2] and results[1][ci]["parts"] == [1]
        assert _matches(c, *_merge(results, ci)), c["label"]


def test_pipeline_refuses_a_cycle_between_workers_naming_the_nodes() -> None:
    parts = [Partition.model_validate(_p(["blocks"], 1))]
    with pytest.raises(ConfigError) as info:
        build_plan(ResNet(), parts, default_workers(2), contiguous=True)
    (path, msg), = info.value.problems
    assert path == "strategy.partitions"
    assert "worker 'worker-0' (rank 0) owns 2 separate runs: stem; head" in msg
    assert "blocks.2.3" in msg and "cycle between workers" in msg


def test_claims_are_module_paths_and_errors_name_them() -> None:
    w = default_workers(3)

    def problems(ids: list[list[str]]) -> list[tuple[str, str]]:
        with pytest.raises(ConfigError) as info:
            build_plan(TwoTower(), [Partition.model_validate(_p(i, r + 1)) for r, i in enumerate(ids)], w)
        return info.value.problems

    (p, m), = problems([["left.fc1.weight"]])
    assert p == "strategy.partitions[0].node_ids" and "'left.fc1.weight', which is not in this model" in m
    (p, m), = problems([["left"], ["left"]])
    assert "'left' is claimed by partitions 0 and 1" in m
    # a nested claim overrides its ancestor: left on worker 1 except left.fc2 on worker 2
    plan = build_plan(TwoTower(), [Partition.model_validate(_p(["left"], 1)),
                                   Partition.model_validate(_p(["left.fc2"], 2))], w)
    assert plan.owner["left.fc1"] == 1 and plan.owner["left.fc2"] == 2 and plan.owner["join"] == 0


def test_untraceable_module_names_the_module_and_how_to_mark_it_a_leaf() -> None:
    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else x  # control flow on a value

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Gate(), torch.nn.Linear(8, 2))
    parts = [Partition.model_validate(_p(["2"], 1))]
    with pytest.raises(ConfigError) as info:
        build_plan(model, parts, default_workers(2))
    (p, m), = info.value.problems
    assert p == "model" and "module '1' (Gate)" in m and "model.leaf_modules = ['1']" in m
    plan = build_plan(model, parts, default_workers(2), leaves=["1"])
    assert plan.nodes == ("0", "1", "2")


def test_tensors_inside_a_leaf_module_keep_the_models_names() -> None:
    """A leaf module with submodules of its own (``back.gate.fc``): every part's tensors map
    back to the model's state_dict names (was ``back_gate.fc.weight``)."""
    from test_mp_replica_sync import Net

    model = Net()
    plan = build_plan(model, [Partition.model_validate(_p(["back"], 1))], default_workers(2),
                      leaves=["back.gate", "back.track"])
    names = [p.original_name(k) for r in (0, 1) for p in plan.segments_of(r) for k in p.module.state_dict()]
    assert sorted(names) == sorted(model.state_dict())


def test_a_part_that_starts_before_a_part_it_reads_from(tmp_path: Path) -> None:
    """The left tower's residual add runs on the join's worker (its readers are there), so
    in graph order that worker's part begins before the right tower's part it reads from:
    the parts must still run in dependency order."""
    parts = [_p(["net.right"], 1), _p(["net.join"], 2)]
    cases = [{"model": "towers-flat", "rows": 5, "partitions": parts, "label": f"towers-flat/{n}",
              "communication": c, "datastore_dir": str(tmp_path)}
             for n, c in (("Direct", {"protocol": "Direct"}),
                          ("1F1B", {"protocol": "Pipeline", "micro_batch_size": 2, "schedule": "1F1B"}))]
    results = run_distributed(run_cases, 3, cases)
    for ci, case in enumerate(cases):
        assert [r[ci]["parts"] for r in results] == [[0], [1], [2]]
        assert _matches(case, *_merge(results, ci)), case["label"]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_replicated_stage_equals_the_unpartitioned_model(schedule: str, tmp_path: Path) -> None:
    """2 stages, the second ``DataParallel{num_replicas=2}`` (3 workers): its rows of each
    micro-batch split over two replicas (an uneven last micro-batch of 1 row leaves one
    replica idle), gradients summed among them."""
    comm = {"protocol": "Pipeline", "micro_batch_size": 3, "schedule": schedule}
    cases = [
        {"model": "resnet", "rows": 7, "communication": comm, "label": f"resnet/{schedule}",
         "partitions": [_p(["head"], 1)], "replicas": {"head": 2}, "datastore_dir": str(tmp_path)},
        # the gpt head reads the token embedding's weight from stage 0: both replicas get it
        {"model": "gpt", "rows": 7, "communication": comm, "label": f"gpt/{schedule}",
         "partitions": [_p(["head"], 1)], "replicas": {"head": 2}, "datastore_dir": str(tmp_path)},
    ]
    results = run_distributed(run_cases, 3, cases, timeout_s=240)
    for ci, case in enumerate(cases):
        assert [r[ci]["replica"] for r in results] == [0, 0, 1]
        assert _matches(case, *_merge(results, ci)), case["label"]


def test_random_dags_on_three_ranks_match_the_unpartitioned_model(tmp_path: Path) -> None:
    """Seeded random DAGs (add / mul / cat of earlier values) with random placements: Direct
    always, and 1F1B when the placement forms stages; loss and gradients as the model's."""
    import random

    from _workers_mp_graph import RandomDag

    rng = random.Random(7)
    cases: list[dict[str, Any]] = []
    while len(cases) < 8:
        spec = [(rng.randrange(50), rng.randrange(50), rng.choice(["add", "mul", "cat"]))
                for _ in range(rng.randint(2, 6))]
        names = ["stem", *(f"layers.{i}" for i in range(len(spec))), "head"]
        owner = {n: rng.randrange(3) for n in names}
        parts = [_p([n for n in names if owner[n] == r], r) for r in (1, 2) if r in owner.values()]
        if not parts:
            continue
        base = {"model": "dag", "spec": spec, "rows": 5, "partitions": parts, "datastore_dir": str(tmp_path)}
        cases.append({**base, "communication": {"protocol": "Direct"}, "label": f"dag{len(cases)}/Direct"})
        try:
            build_plan(RandomDag(spec), [Partition.model_validate(p) for p in parts],
                       default_workers(3), contiguous=True)
        except ConfigError:
            continue
        cases.append({**base, "communication": {"protocol": "Pipeline", "micro_batch_size": 2,
                                                "schedule": "1F1B"}, "label": f"dag{len(cases)}/1F1B"})
    results = run_distributed(run_cases, 3, cases, timeout_s=240)
    for ci, case in enumerate(cases):
        assert _matches(case, *_merge(results, ci)), case["label"]
    assert any(c["communication"]["protocol"] == "Pipeline" for c in cases)


def test_a_non_tensor_crossing_workers_is_refused_before_any_launch() -> None:
    """``h.size(1)`` made on worker 0 and read on worker 1: only tensors travel."""
    from torch.utils.data import TensorDataset

    from paratrain.executors.model_parallel.validation import check_crossing_values

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            n = h.size(1)  # traced before b: the product runs with b, on worker 1
            return self.b(h) * n

    model, w = Scaled(), default_workers(2)
    data = TensorDataset(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))
    plan = build_plan(model, [Partition.model_validate(_p(["b"], 1))], w)
    with pytest.raises(ConfigError) as info:
        check_crossing_values(plan, model, data, w)
    (path, msg), = info.value.problems
    assert path == "strategy.partitions" and "int (8)" in msg and "worker-0" in msg and "worker-1" in msg
    together = build_plan(model, [Partition.model_validate(_p(["a", "b"], 1))], w)
    check_crossing_values(together, model, data, w)  # both on worker 1: nothing non-tensor travels
