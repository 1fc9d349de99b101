"""paratrain.dispatch: which executor runs a job, and the process counts preflight reads
from its spec (a tensor-parallel job starts tp x dp processes)."""

from __future__ import annotations

import pytest

from paratrain.config import ConfigError, load_job
from paratrain.executors import TENSOR_PARALLEL, executor_name, spec_for
from paratrain.preflight import process_count


def test_tensor_parallel_jobs_dispatch_and_count_their_processes() -> None:
    dp = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    tp2 = {"tensor_parallel_size": 2}
    local_tp = load_job({"tensor_parallel": tp2})
    dp_tp = load_job({"strategy": dp, "tensor_parallel": tp2})
    assert executor_name(local_tp) == executor_name(dp_tp) == TENSOR_PARALLEL
    assert spec_for(local_tp).name == TENSOR_PARALLEL
    assert process_count(local_tp) == (2, "tensor_parallel.tensor_parallel_size")
    assert process_count(dp_tp) == (4, "tensor_parallel.tensor_parallel_size")
    plain = load_job({"strategy": dp})
    assert executor_name(plain) == "DataParallel" and process_count(plain) == (2, "strategy.num_replicas")
    assert process_count(load_job({})) == (1, "strategy.type")


def test_a_model_parallel_count_refuses_a_worker_id_beyond_the_implicit_workers() -> None:
    parts = [{"node_ids": ["fc0"], "target": {"WorkerId": "worker-1"}},
             {"node_ids": ["fc1"], "target": {"WorkerId": "worker-9"}}]
    mp = {"type": "ModelParallel", "communication": {"protocol": "Direct"}, "partitions": parts}
    with pytest.raises(ConfigError, match=r"no worker 'worker-9'.*worker-0..worker-2") as e:
        process_count(load_job({"model": {"name": "mlp", "hidden": [8, 8]}, "strategy": mp}))
    assert [p for p, _ in e.value.problems] == ["strategy.partitions[1].target.WorkerId"]
    named = load_job({"model": {"name": "mlp", "hidden": [8, 8]}, "strategy": mp, "run": {"num_workers": 10}})
    assert process_count(named) == (10, "run.num_workers")  # a declared world is the user's


# The workers' forkserver starts before the checks, preloading what the workers import ------

_PROBE = r"""
import json, multiprocessing.forkserver as fs, sys
from pathlib import Path
from paratrain.config import ConfigError, load_job
from paratrain.dispatch import execute
doc = json.loads(sys.argv[1])
try:
    execute(load_job(doc))
except ConfigError as e:
    print("refused:", e.problems[0][0], file=sys.stderr)
pid = getattr(getattr(fs, "_forkserver", None), "_forkserver_pid", None)
cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") if pid else ""
print(json.dumps({"server": pid is not None, "cmdline": cmd, "dynamo_here": "torch._dynamo" in sys.modules}))
"""


def _probe(tmp_path: object, strategy: dict[str, object]) -> dict[str, object]:
    import json
    import subprocess
    import sys

    doc = {"run": {"name": "warm", "output_dir": str(tmp_path)}, "strategy": strategy,
           "train": {"optimizer": {"name": "sgd", "lr": 0.1, "no_such_option": 1}}}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(doc)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: train.optimizer.no_such_option" in out.stderr  # the check still refuses
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_multiprocess_job_starts_the_warm_forkserver_before_its_checks(tmp_path: object) -> None:
    """A DataParallel job whose optimizer check fails: the forkserver was started before the
    check (its preload names the executor, torch's compiler and the data set's libraries),
    no run folder was touched, and the check itself imported no compiler in the launcher;
    a Local job starts no server."""
    from pathlib import Path

    dp = _probe(tmp_path, {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}})
    assert dp["server"] is True
    for name in ("paratrain.executors.data_parallel", "torch._dynamo", "paratrain.data.datasets"):
        assert name in str(dp["cmdline"])
    assert dp["dynamo_here"] is False
    assert not (Path(str(tmp_path)) / "warm").exists()
    local = _probe(tmp_path, {"type": "Local"})
    assert local["server"] is False and local["dynamo_here"] is False


def test_worker_preload_is_empty_in_process_and_under_torchrun(monkeypatch: object) -> None:
    import pytest

    from paratrain.executors import worker_preload

    assert worker_preload(load_job({})) == []
    assert worker_preload(load_job({"strategy": {"type": "Custom", "coordinator": "x", "config": {}}})) == []
    lm = load_job({"strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
                   "task": {"name": "language_model"}, "data": {"name": "shakespeare"}})
    assert worker_preload(lm)[:2] == ["paratrain.executors.entry", "paratrain.executors.data_parallel"]
    assert "paratrain.data.shakespeare" in worker_preload(lm) and "paratrain.data.datasets" not in worker_preload(lm)
    hf = load_job({**lm.model_dump(mode="json"), "model": {"name": "hf", "architecture": "llama"}})
    assert "transformers.modeling_utils" in worker_preload(hf)  # the ranks' 3-7 s import, once
    assert "transformers.modeling_utils" not in worker_preload(lm)
    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    assert worker_preload(lm) == []
