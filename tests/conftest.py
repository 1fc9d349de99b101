"""Test setup: tests/ on sys.path (worker functions for spawned ranks live here),
one torch thread per process (the CI machine has 2 cores), fixed hypothesis profile."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# tests/ mirrors src/ (tests/<package>/test_<module>.py); the shared worker modules live in
# tests/ itself. Every test folder goes on sys.path, so a test module named in a job file
# ("test_tp_task:tiny_lm_data") or imported by another folder's test resolves anywhere.
TEST_DIRS = [str(Path(__file__).parent),
             *sorted(str(d) for d in Path(__file__).parent.rglob("*") if d.is_dir() and any(d.glob("test_*.py")))]
sys.path[:0] = TEST_DIRS
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

settings.register_profile(
    "paratrain",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("paratrain")


# What the suite's ranks import, for the session's forkserver (see _warm_session_server).
_SESSION_PRELOAD = ["paratrain.executors.entry", "paratrain.executors.data_parallel",
                    "paratrain.executors.tensor_parallel", "paratrain.executors.model_parallel",
                    "paratrain.executors.federated", "paratrain.executors.population_based",
                    "paratrain.comm.dcp", "torch._dynamo", "paratrain.data.datasets", "sklearn.datasets",
                    "transformers.modeling_utils", "_forkserver_preload"]


def _server_pid() -> int | None:
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


def _warm_session_server() -> int | None:
    """Start this pytest process's workers' forkserver, preloading what the suite's ranks
    import: the executors, torch's compiler front end, scikit-learn's data sets and, where the
    ``hf`` extra is installed, transformers' model base (3-7 s of CPU in every rank otherwise;
    a launch's own preload hint comes too late once a server runs). A name that does not
    import is skipped by the server. Last, ``_forkserver_preload`` (this folder): matplotlib
    and the Shakespeare corpus (paratrain's own last preload then freezes the server's heap).
    Python 3.11's forkserver ignores the parent's ``sys.path``: it finds this folder through
    ``PYTHONPATH``, set while the server starts (a worker takes the parent's current
    environment and path, paratrain.comm.forkserver.ParentState). Returns the server's pid."""
    from paratrain.comm.forkserver import warm

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*TEST_DIRS, *([old] if old else [])])
    try:
        warm(_SESSION_PRELOAD)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return _server_pid()


_SESSION_SERVER: list[int | None] = [None]


@pytest.fixture(scope="session", autouse=True)
def _one_worker_server_for_the_session() -> None:
    _SESSION_SERVER[0] = _warm_session_server()


@pytest.fixture(autouse=True)
def _keep_the_session_server() -> Iterator[None]:
    """After a test that stopped the session's forkserver (the test of ``forkserver.stop``):
    end whatever server it left and start the session's again. A
    server started by a launch preloads only torch, and every rank this pytest process
    launched afterwards imported the rest itself: a full run measured 5.5 s of imports per
    rank, 114 ranks, after one such test."""
    yield
    if _SESSION_SERVER[0] is not None and _server_pid() != _SESSION_SERVER[0]:
        from paratrain.comm.forkserver import stop

        stop()
        _SESSION_SERVER[0] = _warm_session_server()


# Files whose tests hold one xdist worker for minutes (every benchmark's --smoke run; real Flower
# federations: a process per Message; the 18-case kill/resume matrix; two hosts; ...), longest
# first as a full `make test -n 3` measured them (issue 34). `make test` hands out whole files
# (--dist loadfile) in collection order: started last, they ran alone while the other workers
# idled. Started first (longest-first keeps the last file short), the rest runs beside them.
_LONG_FIRST = ("test_benchmarks_smoke.py", "test_federated_flower.py", "test_kill_resume_matrix.py",
               "test_federated_flower_secagg.py", "test_federated_flower_faults.py", "test_mp_hf_job.py", "test_two_hosts.py",
               "test_model_parallel_job.py", "test_api_fit.py", "test_federated_scaffold_procs.py",
               "test_training_reshard_tp.py", "test_mp_graph_job.py", "test_worker_errors.py",
               "test_federated_reshard.py", "test_mesh_pipeline_tp_hf.py", "test_resume_fallback.py",
               "test_fault_tolerance.py", "test_fault_tolerance_zero.py", "test_fault_tolerance_membership.py",
               "test_fault_tolerance_two_hosts.py",
               "test_fedbuff.py")


def pytest_configure(config: pytest.Config) -> None:
    # xdist 3.8's loadfile reorders files by test count (--loadscope-reorder is on by default),
    # which put the few-test long files above last: a clean-clone run ended with test_two_hosts.py
    # alone. Off, files go out in the order pytest_collection_modifyitems gives.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(_LONG_FIRST)))  # stable: the rest keeps its order
