"""GPU check: the CUDA / NCCL / bf16 paths of paratrain in one short run (< 5 minutes).

``scripts/gpu_check.sh`` runs this with the project's venv. It prints one JSON object.

Without a CUDA device it prints ``{"gpu": false, "reason": "no CUDA device", ...}`` and
exits 0: nothing here can be checked on a CPU-only machine, and saying so is the result.

With CUDA (``n`` = number of GPUs, ``w = min(n, 2)`` ranks, one GPU each, NCCL):

- ``dp_vs_ddp``: paratrain's DataParallel AllReduce step (``AllReduceAgg``, bucketed,
  overlapped) vs torch ``DistributedDataParallel`` on the same model and batches:
  parameter max abs difference after the steps (goal ~0) and the median step-time ratio
  (measured, same run, interleaved);
- ``compressed_exchange``: the same step with TopK 200 per tensor + error feedback through the
  compressed all-gather path on NCCL: payload bytes per step vs dense (measured) and that
  the loss falls;
- ``tensor_parallel``: with 2 GPUs, ``parallelize`` at tp = 2 over NCCL vs the dense
  model (output / input-gradient relative error); with 1 GPU, the same on a size-1 group
  (a sanity check of the CUDA path, no collective);
- ``pipeline``: a ModelParallel 1F1B job of a few steps on CUDA (2 stages; NCCL with
  2 GPUs, gloo with 1);
- ``bf16``: bf16 autocast forward/backward vs fp32 on the GPU, and tensor-parallel
  ``mixed_precision`` (bf16 compute, fp32 master weights) vs fp32.

Each check reports ``ok`` and its figures (or the error) and never stops the others; the
exit status is 0 when every check is ok, 1 otherwise. Every figure is measured.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

DEADLINE_S = 270.0  # the whole script stays under 5 minutes


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _batches(rank: int, steps: int, bs: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(bs, 64, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device))
            for _ in range(steps)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


# ----------------------------------------------------------------------------- ranks

def _rank_entry(rank: int, world: int, port: int, fn_name: str, q: Any) -> None:
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        try:
            q.put((rank, True, globals()[fn_name](rank, world)))
        finally:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported in the JSON
        q.put((rank, False, traceback.format_exc()[-2000:]))


def _spawn(fn_name: str, world: int, timeout_s: float) -> list[Any]:
    import multiprocessing as mp

    from paratrain.comm.testing import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, fn_name, q)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, val = q.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank}: {val}")
            out[rank] = val
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def dp_ranks(rank: int, world: int) -> dict[str, Any]:
    """paratrain AllReduce vs DDP, then the compressed exchange, on NCCL."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.comm import buckets as B
    from paratrain.comm import collectives as C
    from paratrain.compression import Compressor
    from paratrain.executors.data_parallel.aggregation import AllReduceAgg

    dev = torch.device("cuda", rank)
    batches = _batches(rank, 20, 64, dev)
    loss_fn = nn.functional.cross_entropy
    ours = _model_on(dev)
    agg = AllReduceAgg(ours, group=None, counter=C.CommCounter(), bucket_bytes=B.bucket_bytes_of(25.0))
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.05)
    ref = DDP(_model_on(dev), device_ids=[rank], bucket_cap_mb=25)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.05)

    def step_ours(x: torch.Tensor, y: torch.Tensor) -> None:
        opt_a.zero_grad(set_to_none=agg.zero_grad_set_to_none)
        loss_fn(ours(x), y).backward()
        agg.sync_gradients()
        opt_a.step()

    def step_ddp(x: torch.Tensor, y: torch.Tensor) -> None:
        opt_b.zero_grad(set_to_none=True)
        loss_fn(ref(x), y).backward()
        opt_b.step()

    t_ours: list[float] = []
    t_ddp: list[float] = []
    for i, (x, y) in enumerate(batches):
        pair = [(step_ours, t_ours), (step_ddp, t_ddp)]
        for fn, acc in (pair if i % 2 == 0 else pair[::-1]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x, y)
            torch.cuda.synchronize()
            acc.append(time.perf_counter() - t0)
    diff = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), ref.module.parameters(), strict=True))
    agg.close()
    res: dict[str, Any] = {
        "param_max_abs_diff_vs_ddp": diff,
        "step_time_ratio_vs_ddp": statistics.median(t_ours[3:]) / statistics.median(t_ddp[3:]),
    }
    # Compressed exchange: TopK 1% of each tensor with error feedback, over NCCL.
    model = _model_on(dev)
    counter = C.CommCounter()
    comp = Compressor({"method": "ErrorFeedback", "error_compensation": True,
                       "base_strategy": {"method": "TopK", "k": 200}})
    cagg = AllReduceAgg(model, group=None, counter=counter, bucket_bytes=0, compressor=comp)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batches[0]
    losses = []
    for _ in range(15):  # the same batch: the loss must fall
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        cagg.sync_gradients()
        opt.step()
        losses.append(float(loss))
    cagg.close()
    dense = 4 * sum(p.numel() for p in model.parameters())
    res["compressed_payload_fraction_of_dense"] = counter.total_bytes / 15 / dense
    res["compressed_loss_first_last"] = [losses[0], losses[-1]]
    return res


def _model_on(dev: torch.device) -> nn.Module:
    return _mlp(0).to(dev)


def tp_ranks(rank: int, world: int) -> dict[str, Any]:
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import TensorParallelismConfig
    from paratrain.tensor_parallel import parallelize

    dev = torch.device("cuda", rank)
    dense = _mlp(0).to(dev)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(dev)
    xr = x.clone().requires_grad_(True)
    ref = dense(xr)
    ref.square().mean().backward()
    tpm = parallelize(copy.deepcopy(dense), TensorParallelismConfig(tensor_parallel_size=world),
                      build_tp_groups(world))
    xt = x.clone().requires_grad_(True)
    out = tpm(xt)
    out.square().mean().backward()
    assert xt.grad is not None and xr.grad is not None
    st = tpm.statistics()
    return {"out_rel_err": _rel(out.detach(), ref.detach()), "xgrad_rel_err": _rel(xt.grad, xr.grad),
            "collectives": st["collectives"], "payload_bytes_measured": st["payload_bytes_measured"]}


# ----------------------------------------------------------------------------- checks

def check_dp(n_gpus: int) -> dict[str, Any]:
    world = min(n_gpus, 2)
    r = _spawn("dp_ranks", world, 150)[0]
    ok = (r["param_max_abs_diff_vs_ddp"] < 1e-4 and r["compressed_loss_first_last"][1]
          < r["compressed_loss_first_last"][0] and r["compressed_payload_fraction_of_dense"] < 0.1)
    return {"ok": ok, "ranks": world, **r}


def check_tp(n_gpus: int) -> dict[str, Any]:
    world = 2 if n_gpus >= 2 else 1
    if world == 2:
        r = _spawn("tp_ranks", 2, 120)[0]
    else:  # 1-rank sanity: the CUDA path of the layers, no collective
        r = tp_ranks(0, 1)
    return {"ok": r["out_rel_err"] < 1e-4 and r["xgrad_rel_err"] < 1e-4, "tensor_parallel_size": world,
            "mode": "2 ranks over NCCL" if world == 2 else "1-rank sanity (size-1 group)", **r}


def check_pipeline(n_gpus: int) -> dict[str, Any]:
    from paratrain.config.job import load_job
    from paratrain.executors import execute

    with tempfile.TemporaryDirectory() as tmp:
        job = load_job({
            "run": {"name": "gpu_check_pipeline", "seed": 0, "output_dir": tmp, "device": "cuda",
                    "backend": "nccl" if n_gpus >= 2 else "gloo"},
            "model": {"name": "mlp", "hidden": [128, 64]},
            "data": {"name": "digits"},
            "train": {"epochs": 1, "batch_size": 32, "max_steps": 6,
                      "optimizer": {"name": "sgd", "lr": 0.1}},
            "strategy": {"type": "ModelParallel",
                         "communication": {"protocol": "Pipeline", "micro_batch_size": 8,
                                           "schedule": "1F1B"},
                         "partitions": [{"node_ids": ["fc1", "act1", "head"],
                                         "target": {"WorkerId": "worker-1"}}]},
            "workers": [{"id": "worker-0"}, {"id": "worker-1"}],
        })
        s = execute(job)
    return {"ok": s.get("steps") == 6 and s.get("test_loss") is not None and s["test_loss"] == s["test_loss"],
            "backend": "nccl" if n_gpus >= 2 else "gloo", "steps": s.get("steps"),
            "test_accuracy": s.get("test_accuracy"),
            "bubble_fraction_measured": s.get("bubble_fraction_measured")}


def check_bf16(n_gpus: int) -> dict[str, Any]:
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.config import TensorParallelismConfig
    from paratrain.tensor_parallel import parallelize

    dev = torch.device("cuda", 0)
    model = _mlp(0).to(dev)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).to(dev)
    ref = model(x)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        y = model(x)
        y.float().square().mean().backward()
    res: dict[str, Any] = {"autocast_dtype": str(y.dtype), "autocast_out_rel_err": _rel(y.detach(), ref.detach()),
                           "bf16_supported": torch.cuda.is_bf16_supported()}
    tpm = parallelize(copy.deepcopy(model), TensorParallelismConfig(mixed_precision=True), build_tp_groups(1))
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        yt = tpm(x)
    yt.float().square().mean().backward()
    res["tp_mixed_precision_out_rel_err"] = _rel(yt.detach(), ref.detach())
    res["tp_master_weight_dtype"] = str(next(tpm.parameters()).dtype)
    res["ok"] = (res["autocast_dtype"] == "torch.bfloat16" and res["autocast_out_rel_err"] < 0.05
                 and res["tp_mixed_precision_out_rel_err"] < 0.05 and res["tp_master_weight_dtype"] == "torch.float32")
    return res


CHECKS: dict[str, Callable[[int], dict[str, Any]]] = {
    "dp_vs_ddp_and_compressed_exchange": check_dp, "tensor_parallel": check_tp,
    "pipeline": check_pipeline, "bf16": check_bf16,
}


def main() -> int:
    t0 = time.perf_counter()
    base: dict[str, Any] = {"torch": torch.__version__, "torch_cuda_build": torch.version.cuda}
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "reason": "no CUDA device", **base,
                          "checks": {}, "note": "nothing was run: every check here needs a GPU"}))
        return 0
    n = torch.cuda.device_count()
    out: dict[str, Any] = {"gpu": True, **base, "devices": [torch.cuda.get_device_name(i) for i in range(n)],
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "checks": {}}
    for name, fn in CHECKS.items():
        if time.perf_counter() - t0 > DEADLINE_S:
            out["checks"][name] = {"ok": False, "error": "skipped: the 5-minute budget ran out"}
            continue
        t1 = time.perf_counter()
        try:
            out["checks"][name] = fn(n)
        except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
            out["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]}
        out["checks"][name]["wall_s"] = round(time.perf_counter() - t1, 1)
    out["all_ok"] = all(c.get("ok") for c in out["checks"].values())
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1, default=str))
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
