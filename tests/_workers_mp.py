"""Worker functions for the ModelParallel tests (run on real gloo ranks via run_distributed).

Each *case* is a plain dict (picklable): model name/kwargs, the partitions and the
communication protocol as contract JSON, batch rows, seed, and for DataStore a
directory. Running many cases in one spawn keeps the tests inside their time budget.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm.context import WorkerContext
from paratrain.config.job import DataSpec, ModelSpec
from paratrain.config.strategy import load_strategy
from paratrain.data import load_data
from paratrain.executors.model_parallel.plan import build_plan
from paratrain.executors.model_parallel.runtime import StageRuntime, segment_modules
from paratrain.models import build_model

__all__ = ["batch", "build", "run_cases", "reference"]


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``rows`` rows of the real digits training split."""
    bundle = load_data(DataSpec(), seed=seed)
    x, y = bundle.train.tensors
    return x[:rows].clone(), y[:rows].clone()


def build(case: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(case.get("seed", 0))
    spec = ModelSpec(name=case["model"], **case.get("model_kwargs", {}))
    return build_model(spec, input_shape=(64,), num_classes=10)


def reference(case: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the unpartitioned model (keys ``<node>/<param>``)."""
    model = build(case)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {}
    for k, p in model.named_parameters():
        assert p.grad is not None
        grads[k] = p.grad.detach().clone()
    return float(loss.detach()), grads


def _transport(ctx: WorkerContext, case: dict[str, Any], protocol: Any) -> Any:
    if protocol.protocol == "DataStore":
        from paratrain.comm.p2p import DataStoreTransport, open_session

        store = open_session(f"{case['datastore_dir']}/case{case['index']}", rank=ctx.rank,
                             control=ctx.store,
                             generation=case["index"], timeout_s=60)
        return DataStoreTransport(store, ctx.rank)
    from paratrain.comm.p2p import P2PTransport

    return P2PTransport(ctx.group)


def run_cases(ctx: WorkerContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run one train step per case on this rank; return loss, grads, order, stats.

    Tensors come back as numpy arrays: torch tensors in a multiprocessing queue travel
    as shared-memory handles that die with the exiting child.
    """
    results = []
    x_all, y_all = batch(max(c["rows"] for c in cases))
    for index, case in enumerate(cases):
        case = dict(case, index=index)
        strategy = load_strategy({"type": "ModelParallel", "partitions": case["partitions"],
                                  "communication": case["communication"]})
        proto = strategy.communication
        model = build(case)
        pipeline = proto.protocol == "Pipeline"
        plan = build_plan(model, strategy.partitions, ctx.workers, contiguous=pipeline)
        transport = _transport(ctx, case, proto)
        rt = StageRuntime(plan, ctx.rank, segment_modules(model, plan, ctx.rank), transport)
        x, y = x_all[: case["rows"]], y_all[: case["rows"]]
        for k in range(case.get("steps", 1) - 1):
            # Earlier steps on other batches: later steps post their receives ahead on
            # channels whose shapes are known by now, and must still be exact.
            xk, yk = batch(case["rows"], seed=100 + k)
            rt.train_step(xk, yk, step=index,
                          micro_batch_size=proto.micro_batch_size if pipeline else None,
                          schedule_name=proto.schedule if pipeline else None)
            for mod in rt.modules.values():
                mod.zero_grad(set_to_none=True)
        loss = rt.train_step(
            x, y, step=index,
            micro_batch_size=proto.micro_batch_size if pipeline else None,
            schedule_name=proto.schedule if pipeline else None,
        )
        out_x = rt.forward(x, step=index)
        grads = {}
        for part in plan.segments_of(ctx.rank):
            for k, p in part.module.named_parameters():
                assert p.grad is not None
                grads[part.original_name(k)] = p.grad.detach().numpy().copy()
        store_dir = None
        if proto.protocol == "DataStore":
            transport.close()
            store_dir = str(transport.store.root)
        results.append({
            "loss": loss, "grads": grads, "order": rt.stats.order,
            "trace": rt.stats.trace, "peak": rt.stats.peak_activation_bytes,
            "logits": None if out_x is None else out_x.numpy().copy(), "store_dir": store_dir,
            "segments": [s.index for s in plan.segments_of(ctx.rank)],
            "posted": getattr(transport, "posted_count", 0),
        })
    return results
