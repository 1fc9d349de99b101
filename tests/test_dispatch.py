"""paratrain.dispatch: which executor runs a job, and the process counts preflight reads
from its spec (a tensor-parallel job starts tp x dp processes)."""

from __future__ import annotations

from paratrain.config import load_job
from paratrain.dispatch import TENSOR_PARALLEL, executor_name, is_tensor_parallel, spec_for
from paratrain.preflight import process_count


def test_tensor_parallel_jobs_dispatch_and_count_their_processes() -> None:
    dp = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    tp2 = {"tensor_parallel_size": 2}
    local_tp = load_job({"tensor_parallel": tp2})
    dp_tp = load_job({"strategy": dp, "tensor_parallel": tp2})
    assert executor_name(local_tp) == executor_name(dp_tp) == TENSOR_PARALLEL
    assert spec_for(local_tp).name == TENSOR_PARALLEL
    assert is_tensor_parallel(local_tp) and is_tensor_parallel(dp_tp)
    assert process_count(local_tp) == (2, "tensor_parallel.tensor_parallel_size")
    assert process_count(dp_tp) == (4, "tensor_parallel.tensor_parallel_size")
    plain = load_job({"strategy": dp})
    assert not is_tensor_parallel(plain) and process_count(plain) == (2, "strategy.num_replicas")
    assert process_count(load_job({})) == (1, "strategy.type")
