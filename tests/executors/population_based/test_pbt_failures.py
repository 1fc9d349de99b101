"""PopulationBased failures (executors/population_based/runner.py): a member that fails in
generation 0 has no state to continue from; under ``population.evolve = false`` every later
generation reports its first error (with the member), not a missing-file error that hides
it; rank 0 warns at the first failure and the summary lists it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_population import lineage, make_job

from paratrain.executors.population_based import runner as population
from paratrain.training.faults import FAULTS_ENV

pytestmark = pytest.mark.timeout(300)

FIRST = "RuntimeError: injected failure of member 1 (PARATRAIN_FAULTS fail_members)"


def test_a_member_failing_in_generation_0_reports_its_first_error_every_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"fail_members": [1]}))
    job = make_job(tmp_path, "rs", population={"steps_per_generation": 6, "evolve": False})
    with pytest.warns(RuntimeWarning, match=r"member 1 failed in generation 0: .*injected failure.*"
                                            r"evolve = false"):
        summary = population.run(job)
    gens = lineage(summary)["generations"]
    assert gens[0]["errors"][1] == FIRST
    for rec in gens[1:]:
        err = rec["errors"][1]
        assert "member 1" in err and f"generation 0: {FIRST}" in err, err
        assert "No such file" not in err
        assert rec["errors"][0] is None and rec["fitness"][0] is not None  # the others train on
    assert summary["first_failures"] == {"1": f"generation 0: {FIRST}"}
    assert summary["failures"] == len(gens)
