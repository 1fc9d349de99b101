"""Worker functions for the comm/DataParallel multi-process tests (module-level, importable)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.context import WorkerContext
from paratrain.config.job import JobConfig


def launch_probe(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any]:
    """All-reduce the ranks and round-trip a value through the control-plane store."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.store.set(f"probe/{ctx.rank}", str(ctx.rank * 10))
    dist.barrier()
    peer = int(ctx.store.get(f"probe/{(ctx.rank + 1) % ctx.world_size}").decode())
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "sum": float(t.item()),
        "peer": peer,
        "resume": resume,
        "restart_count": ctx.restart_count,
        "worker_id": ctx.worker.id,
        "tags": list(ctx.worker.tags),
        "backend": ctx.backend,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def launch_fail(ctx: WorkerContext, job: JobConfig, resume: bool) -> None:
    if ctx.rank == 1:
        raise ValueError("boom from rank one: bad shard 42")
    dist.barrier()






# ------------------------------------------------------------------ DataParallel parity


def dp_job(tmp: str, name: str, world: int, aggregation: dict[str, Any], **extra: Any) -> JobConfig:
    """A tiny DataParallel job: MLP(64->16->10) on digits, 4 steps of 8 rows per replica."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 3, "output_dir": tmp, "checkpoint_every": 0},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 8, "max_steps": 4,
                  "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": world, "aggregation": aggregation},
    }
    for k, v in extra.items():
        doc[k] = v
    from paratrain.config import load_job

    return load_job(doc)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()


def ddp_reference(ctx: WorkerContext, job: JobConfig, *, sync: bool = True,
                  optimizer: Callable[[Any], torch.optim.Optimizer] | None = None) -> list[float]:
    """torch DistributedDataParallel on the same shards, same seed, same optimizer (or
    ``optimizer(ddp.parameters())``); with ``sync=False`` the same replicas without DDP: each
    trains its shard alone (the known-wrong variant the parity tests must tell apart)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.data import load_data
    from paratrain.executors.data_parallel.runner import shard_indices
    from paratrain.models import build_model
    from paratrain.training import build_optimizer, seed_everything

    seed_everything(job.run.seed)
    bundle = load_data(job.data, seed=job.run.seed)
    x, y = bundle.train.tensors
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    ddp = DDP(model) if sync else model
    params = ddp.parameters()
    opt = build_optimizer(params, job.train.optimizer) if optimizer is None else optimizer(params)
    idx = shard_indices(len(y), world=ctx.world_size, rank=ctx.rank, seed=job.run.seed, epoch=0)
    bs = job.train.batch_size
    for b in range(job.train.max_steps or 1):
        sel = idx[b * bs : (b + 1) * bs]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x[sel]), y[sel]).backward()
        opt.step()
    return _flat(model)


def dp_parity(ctx: WorkerContext, tmp: str, variants: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Train every variant on the same ranks; return each one's flat parameters."""
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {}
    for name, agg, *more in variants:
        if agg is None:  # torch's DDP, or independent replicas ("NoSync")
            ref = dp_job(tmp, name.lower(), ctx.world_size, {"method": "AllReduce"})
            flat = ddp_reference(ctx, ref, sync=name == "DDP")
            out[name] = flat if name == "DDP" else {"params": flat}
            continue
        extra: dict[str, Any] = more[0] if more else {}
        job = dp_job(tmp, f"{name}-{ctx.world_size}", ctx.world_size, agg, **extra)
        model, summary = train_replica(ctx, job, False, plot=False)
        out[name] = {"params": _flat(model), "summary": summary}
    return out


# ------------------------------------------------------------------ comm collectives


def comm_checks(ctx: WorkerContext) -> dict[str, Any]:
    """Exercise every collective on real ranks; the parent checks the values."""
    from paratrain.comm import buckets as B
    from paratrain.comm import collectives as C
    from paratrain.comm import messages as M

    r, n = ctx.rank, ctx.world_size
    g = torch.Generator().manual_seed(100 + r)
    out: dict[str, Any] = {}
    counter = C.CommCounter()

    # Bucketed all-reduce: mixed sizes/dtypes, tiny buckets (many collectives) vs one.
    ts = [torch.randn(7, generator=g), torch.randn(3, 5, generator=g), torch.randn(300, generator=g),
          torch.randn(2, generator=g).double(), torch.randn(11, generator=g)]
    out["inputs"] = [t.tolist() for t in ts]
    small = [t.clone() for t in ts]
    B.all_reduce_buckets(small, bucket_bytes=64, counter=counter)
    big = [t.clone() for t in ts]
    B.all_reduce_buckets(big, bucket_bytes=1 << 20)
    out["reduced_small"] = [t.tolist() for t in small]
    out["reduced_big"] = [t.tolist() for t in big]
    out["small_calls"] = counter.calls.get("all_reduce", 0)

    # Overlapped reducer on a real backward equals the bucketed mean of gradients.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reducer = B.GradReducer(list(model.parameters()), bucket_bytes=48)
    x = torch.randn(4, 6, generator=g)
    model(x).pow(2).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    reducer.finish()
    reducer.remove()
    B.all_reduce_buckets(local, bucket_bytes=1 << 20)
    out["reducer_ok"] = all(torch.allclose(p.grad, lg, rtol=1e-6, atol=1e-7)  # type: ignore[arg-type]
                            for p, lg in zip(model.parameters(), local, strict=True))

    # A parameter no rank used this step (unused head) still completes the step: its
    # bucket is reduced with zeros, the used parameters get the mean, and the unused ones
    # keep grad None (DDP's find_unused_parameters rule: the optimizer skips them).
    torch.manual_seed(1)
    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params = list(used.parameters()) + list(unused.parameters())
    red = B.GradReducer(params, bucket_bytes=16, first_bucket_bytes=None)
    used(torch.full((1, 3), float(r + 1))).sum().backward()
    red.finish()
    red.remove()
    out["unused_ok"] = (all(p.grad is not None for p in used.parameters())
                        and all(p.grad is None for p in unused.parameters()))
    out["used_grad"] = used.weight.grad.tolist()  # type: ignore[union-attr]

    # Variable-size all-gather (rank r sends r*3+1 bytes).
    payload = torch.arange(r * 3 + 1, dtype=torch.uint8) + r
    out["gathered"] = [p.tolist() for p in C.all_gather_variable(payload)]

    # reduce_scatter: native vs fallback, even and uneven chunks.
    flat = torch.arange(4 * n, dtype=torch.float32) * (r + 1)
    a, b = torch.empty(4), torch.empty(4)
    C.reduce_scatter(a, flat, fallback=False)
    C.reduce_scatter(b, flat, fallback=True)
    out["rs_native"], out["rs_fallback"] = a.tolist(), b.tolist()
    sizes = [k + 2 for k in range(n)]
    chunks = [torch.full((s,), float(r + 1 + i)) for i, s in enumerate(sizes)]
    c = torch.empty(sizes[r])
    C.reduce_scatter(c, chunks, average=True)
    out["rs_uneven"] = c.tolist()

    # all_gather_into_tensor: native vs fallback.
    inp = torch.tensor([float(r), float(r) + 0.5])
    o1, o2 = torch.empty(2 * n), torch.empty(2 * n)
    C.all_gather_into_tensor(o1, inp, fallback=False)
    C.all_gather_into_tensor(o2, inp, fallback=True)
    out["ag_native"], out["ag_fallback"] = o1.tolist(), o2.tolist()

    # Point to point: bytes ring and a tensor.
    dst, src = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        M.send_bytes(f"hello from {r}".encode(), dst=dst)
        got = M.recv_bytes(src=src)
    else:
        got = M.recv_bytes(src=src)
        M.send_bytes(f"hello from {r}".encode(), dst=dst)
    out["p2p"] = got.decode()
    # ...the same without a length header (the receiver knows it), and a neighbour exchange.
    msg = f"raw {r}".encode()
    if r % 2 == 0:
        M.send_bytes(msg, dst=dst, header=False)
        raw = M.recv_bytes(src=src, nbytes=len(f"raw {src}"))
    else:
        raw = M.recv_bytes(src=src, nbytes=len(f"raw {src}"))
        M.send_bytes(msg, dst=dst, header=False)
    out["p2p_raw"] = raw.decode()
    mine = torch.frombuffer(bytearray(b"x" * (r + 1)), dtype=torch.uint8)
    out["exchanged"] = {j: v.decode() for j, v in M.exchange_bytes(mine, peers=sorted({dst, src})).items()}
    # Which entries some rank flagged (one MAX all-reduce).
    out["used"] = C.used_mask([r == 0, r == 1, False])

    # Broadcast of parameters.
    bt = [torch.full((3,), float(r)), torch.full((2, 2), float(r) + 1)]
    B.broadcast_tensors(bt, src=0)
    out["bcast"] = [t.tolist() for t in bt]

    # Worker identities from the job's [[workers]] table.
    out["worker_id"] = ctx.worker.id
    return out
