"""PowerSGD benchmark: bytes, compress+decompress time and final loss against dense and
torch's fp16 / bf16 / PowerSGD DDP hooks, on the char GPT of
``examples/gpt_shakespeare_dp.toml`` (2 layers, 64 wide), shortened. Prints one JSON object.
``--quick``: 60 steps, 5 timing repeats; ``--smoke``: 4 steps, 1 repeat, 128 test blocks, one
job (rank 1) on one test play, run in this process (every code path).

Three parts:

* ``time`` (one gloo rank, one thread): every hook is called on the GPT's real gradients
  packed as one DDP bucket (a duck-typed ``GradBucket``: buffer, gradients, parameters,
  index, is_last), after warm-up (PowerSGD past its start step, warm Q allocated). The
  median call time minus the median of torch's plain ``allreduce_hook`` on the same bucket
  is the **compress+decompress time** (the world-1 collectives cost the same in both).
  Thread CPU time, interleaved repeats (robust to the shared machine's other processes).
* ``table`` (2 gloo ranks): the same training loop (``DistributedDataParallel``, AdamW
  lr 3e-3 wd 0.01 as the example, 16 blocks of 64 characters per rank per step, seeded
  shards) for each hook; final test loss on the first 1,024 test blocks (128 at ``--smoke``). ``bytes_per_step`` is
  what one rank puts into all-reduces per compressed step: measured from torch's own
  PowerSGD statistics (``total_numel_after_compression``) and from our ``CommCounter``
  (GradSync, the DataParallel exchange, checked against the formula ``r'(n+m)`` per matrix
  plus uncompressed tensors); fp16/bf16 are 2 bytes per value by construction.
* ``jobs``: the real ``paratrain run`` of the example (DataParallel, 2 replicas) with
  ``max_steps`` shortened, dense and with ``[compression] method = "PowerSGD"`` at rank 1, 2,
  4: the final test loss gap to dense.

``pays_below_gbit_s`` is **modelled**, not measured: a ring all-reduce of S bytes moves
2(W-1)/W * S per rank (= S at W = 2); compression saves ``(S_dense - S_c)/bw`` seconds and
costs its compress+decompress time t_c, so it pays when the link is slower than
``bw* = (S_dense - S_c) / t_c`` (latency ignored: PowerSGD issues 2 all-reduces per step
where dense issues 1; the times are this CPU's, a GPU computes them far faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance, warm_workers  # noqa: E402

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "gpt_shakespeare_dp.toml"
RANKS = (1, 2, 4)
TEST_ROWS = 1024  # the first 1,024 test blocks (64 characters each): the same for every run
VARIANTS = ["dense", "torch_fp16", "torch_bf16", *(f"torch_powersgd_r{r}" for r in RANKS),
            *(f"ours_powersgd_r{r}" for r in RANKS)]


def _gpt() -> tuple[Any, Any, Any, Any]:
    from paratrain.config.job import load_job
    from paratrain.task import resolve_task

    job = load_job(EXAMPLE)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    torch.manual_seed(job.run.seed)
    return job, task, train, test


class _Bucket:
    """What DDP hands a comm hook (``dist.GradBucket``'s methods the hooks call)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = params
        self._buf = torch.zeros(sum(p.numel() for p in params))
        self._grads, off = [], 0
        for p in params:
            self._grads.append(self._buf[off : off + p.numel()].view(p.shape))
            off += p.numel()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _hooks(model: torch.nn.Module, world_group: Any) -> dict[str, tuple[Any, Any]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph

    from paratrain.comm.ddp_hook import ddp_hook

    out: dict[str, tuple[Any, Any]] = {
        "dense": (world_group, dh.allreduce_hook),
        "torch_fp16": (world_group, dh.fp16_compress_hook),
        "torch_bf16": (world_group, dh.bf16_compress_hook),
    }
    for r in RANKS:
        out[f"torch_powersgd_r{r}"] = (ph.PowerSGDState(None, matrix_approximation_rank=r,
                                                        start_powerSGD_iter=2), ph.powerSGD_hook)
        out[f"ours_powersgd_r{r}"] = ddp_hook({"method": "PowerSGD", "rank": r, "start_step": 2},
                                              model=model)
    return out


def time_hooks(ctx: Any, repeats: int) -> dict[str, Any]:
    """Median thread-CPU ms per hook call on the GPT's gradients (one rank)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    job, task, train, _ = _gpt()
    model = task.build_model(job.model, train)
    x, y = torch.stack([train[i][0] for i in range(16)]), torch.stack([train[i][1] for i in range(16)])
    task.loss(model(x), (x, y)).backward()
    params = [p for p in model.parameters() if p.grad is not None][::-1]  # DDP's ready order
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    bucket = _Bucket(params)
    hooks = _hooks(model, dist.group.WORLD)
    times: dict[str, list[float]] = {k: [] for k in hooks}
    failed: dict[str, str] = {}
    for i in range(3 + repeats):  # 3 warm-up calls: past start_step=2, warm Q allocated
        for name, (state, hook) in hooks.items():
            if name in failed:
                continue
            bucket.buffer().copy_(grads)
            t0 = time.thread_time()
            try:
                hook(state, bucket).wait()
            except (TypeError, RuntimeError) as e:  # bf16 hook: CUDA/NCCL only
                failed[name] = str(e).splitlines()[0]
                continue
            if i >= 3:
                times[name].append(time.thread_time() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
    return {"numel": grads.numel(), "shapes": [list(p.shape) for p in params], "failed": failed,
            "call_ms": med, "compress_decompress_ms": {k: max(v - med["dense"], 0.0) for k, v in med.items()}}


def train_variant(ctx: Any, variant: str, steps: int, start: int, test_rows: int = TEST_ROWS) -> dict[str, Any]:
    """One training run of ``variant`` on 2 ranks (DDP); final test loss, bytes per step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.comm.collectives import CommCounter
    from paratrain.comm.grad_sync import GradSync
    from paratrain.compression import Compressor

    torch.set_num_threads(1)
    job, task, train, test = _gpt()
    model = task.build_model(job.model, train)
    counter = CommCounter()
    sync = None
    state: Any = None
    seed = 1 if variant.endswith("_seed1") else 0
    variant = variant.removesuffix("_seed1")
    if variant.startswith("ours_powersgd_r"):
        r = int(variant.rsplit("r", 1)[1])
        sync = GradSync(list(model.named_parameters()), group=ctx.group, counter=counter,
                        compressor=Compressor({"method": "PowerSGD", "rank": r, "start_step": start},
                                              seed=0))
        net: torch.nn.Module = model
    else:
        net = DDP(model)
        if variant == "torch_fp16":
            net.register_comm_hook(None, dh.fp16_compress_hook)
        elif variant == "torch_bf16":
            net.register_comm_hook(None, dh.bf16_compress_hook)
        elif variant.startswith("torch_powersgd_r"):
            state = ph.PowerSGDState(None, matrix_approximation_rank=int(variant.rsplit("r", 1)[1]),
                                     start_powerSGD_iter=start, random_seed=seed)
            net.register_comm_hook(state, ph.powerSGD_hook)
        elif variant.startswith("ourhook_powersgd_r"):  # our DDP hook: torch's buckets
            from paratrain.comm.ddp_hook import ddp_hook

            hs, hook = ddp_hook({"method": "PowerSGD", "rank": int(variant.rsplit("r", 1)[1]),
                                 "start_step": start}, model=net, seed=seed)
            net.register_comm_hook(hs, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    n, b = len(train), 16
    order = torch.randperm(n, generator=g)[: (n // 2) * 2][ctx.rank :: 2]
    before = 0
    for step in range(steps):
        idx = order[(step * b) % (len(order) - b) :][:b]
        x = torch.stack([train[int(i)][0] for i in idx])
        y = torch.stack([train[int(i)][1] for i in idx])
        opt.zero_grad()
        if sync is not None:
            sync.before_forward()
        task.loss(net(x), (x, y)).backward()
        if sync is not None:
            if step == steps - 1:
                before = counter.bytes.get("all_reduce", 0)
            sync.sync()
        opt.step()
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, test_rows, 128):
            rows = [test[j] for j in range(i, min(i + 128, test_rows))]
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            s = task.eval_batch(model(x), (x, y))
            nll, count = nll + s["nll_sum"], count + s["count"]
    numel = sum(p.numel() for p in model.parameters())
    if variant == "dense":
        per_step = 4 * numel
    elif variant in ("torch_fp16", "torch_bf16"):
        per_step = 2 * numel
    elif state is not None:  # torch's own count over the compressed steps
        per_step = 4 * state.total_numel_after_compression // max(steps - start, 1)
    else:
        per_step = counter.bytes.get("all_reduce", 0) - before
    return {"test_loss": nll / count, "bytes_per_step": per_step}


def train_variants(ctx: Any, variants: list[str], steps: int, start: int,
                   test_rows: int = TEST_ROWS) -> dict[str, Any]:
    """:func:`train_variant` for each of ``variants`` in turn, in the same 2 processes (the
    corpus is read and torch's DDP imports once); a variant that raises on every rank (a
    hook the backend lacks) is recorded as failed."""
    out: dict[str, Any] = {}
    for v in variants:
        try:
            out[v] = train_variant(ctx, v, steps, start, test_rows)
        except (TypeError, RuntimeError) as e:  # DDP refuses torch's bf16 hook without CUDA 11+ / NCCL 2.10+ or XCCL
            out[v] = {"failed": str(e).splitlines()[:1]}
    return out


def run_jobs(steps: int, start: int, folder: Path, ranks: tuple[int, ...] = RANKS,
             dense: bool = True, test_every: int = 8, in_process: bool = False) -> dict[str, Any]:
    """``paratrain run`` of the example, dense (unless ``dense`` is false) and PowerSGD at
    ``ranks`` (final test loss, and its gap to dense's); ``test_every``: the corpus's test
    plays (``[data] test_every``, the example's 8 by default); ``in_process`` (``--smoke``):
    the command run in this process (``paratrain.cli.main``), whose warm forkserver forks the
    workers, not as a new process importing torch and starting its own."""
    src = EXAMPLE.read_text()
    src = src.replace("max_steps = 1500", f"max_steps = {steps}").replace(
        "eval_every = 500", f"eval_every = {steps}").replace(
        'name = "shakespeare"', f'name = "shakespeare"\ntest_every = {test_every}')
    out: dict[str, Any] = {}
    exe = Path(sys.executable).parent / "paratrain"
    runs = [("dense", "")] if dense else []
    runs += [(f"powersgd_r{r}", f'\n[compression]\nmethod = "PowerSGD"\nrank = {r}\nstart_step = {start}\n')
             for r in ranks]
    for name, extra in runs:
        text = src.replace('name = "gpt_shakespeare_dp"', f'name = "psgd_{name}"\noutput_dir = "{folder}"')
        path = folder / f"{name}.toml"
        path.write_text(text + extra)
        t0 = time.perf_counter()
        if in_process:
            from paratrain.cli import main as cli

            code = cli(["run", str(path), "-q"])
            if code != 0:
                raise RuntimeError(f"paratrain run {path.name} returned {code}")
        else:
            proc = subprocess.run([str(exe), "run", str(path), "-q"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"paratrain run {path.name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        summary = json.loads((folder / f"psgd_{name}" / "summary.json").read_text())
        out[name] = {"test_loss": _test_loss(summary), "wall_s": time.perf_counter() - t0}
    for r in ranks if dense else ():
        out[f"powersgd_r{r}"]["gap_to_dense"] = out[f"powersgd_r{r}"]["test_loss"] - out["dense"]["test_loss"]
    return out


def _test_loss(summary: dict[str, Any]) -> float:
    for key in ("final_test", "test", "final"):
        block = summary.get(key)
        if isinstance(block, dict) and "loss" in block:
            return float(block["loss"])
    found = summary.get("test_loss", summary.get("final_test_loss"))
    if found is None:
        raise KeyError(f"no test loss in summary keys {sorted(summary)}")
    return float(found)


def main() -> None:
    from paratrain.comm.testing import run_distributed
    from paratrain.compression.powersgd import wire_numel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--smoke", action="store_true", help="4 steps, 1 repeat, 128 test blocks, the rank-1 job only on one test play: "
                    "every code path")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--no-jobs", action="store_true", help="skip the paratrain run jobs")
    ap.add_argument("--time-only", action="store_true", help="only the hook timings")
    ap.add_argument("--spread", action="store_true",
                    help="only: rank-1 losses of torch's hook at seeds 0 and 1 and of our DDP hook")
    a = ap.parse_args()
    steps = a.steps or (4 if a.smoke else 60 if a.quick else 200)
    start = max(2, steps // 10)  # torch's advice: about 10% of training before compressing
    repeats = 1 if a.smoke else 5 if a.quick else 15
    warm_workers("paratrain.data.shakespeare", "paratrain.task", "torch.distributed.algorithms.ddp_comm_hooks")
    if a.spread:
        spread = {v: run_distributed(train_variant, 2, v, steps, start, timeout_s=1200)[0]
                  for v in ("torch_powersgd_r1_seed1", "ourhook_powersgd_r1")}
        spread_out: dict[str, Any] = {"steps": steps, "start_step": start, "spread": spread}
        spread_out["provenance"] = provenance(spread_out, configured=("steps", "start_step"))
        print(json.dumps(spread_out, indent=1))
        return
    t = run_distributed(time_hooks, 1, repeats, timeout_s=600)[0]
    print(f"hooks timed: {t['call_ms']}", file=sys.stderr)
    if a.time_only:
        t["provenance"] = provenance(t, configured=("numel", "shapes"))
        print(json.dumps(t, indent=1))
        return
    runnable = [v for v in VARIANTS if v not in t["failed"]]
    trained = run_distributed(train_variants, 2, runnable, steps, start, 128 if a.smoke else TEST_ROWS,
                              timeout_s=1200)[0]
    table: dict[str, Any] = {v: {"failed": t["failed"][v]} if v in t["failed"] else trained[v] for v in VARIANTS}
    for v in runnable:
        print(f"{v}: {table[v]}", file=sys.stderr)
    dense_bytes = table["dense"]["bytes_per_step"]
    for v, row in table.items():
        if "failed" in row:
            continue
        row["compress_decompress_ms"] = t["compress_decompress_ms"][v]
        row["loss_gap_to_dense"] = row["test_loss"] - table["dense"]["test_loss"]
        saved = dense_bytes - row["bytes_per_step"]
        tc = row["compress_decompress_ms"] / 1e3
        row["pays_below_gbit_s_modelled"] = (saved * 8 / tc / 1e9) if (saved > 0 and tc > 0) else None
    formula = {f"r{r}": 4 * wire_numel([tuple(s) for s in t["shapes"]], r) for r in RANKS}
    for r in RANKS:
        table[f"ours_powersgd_r{r}"]["bytes_formula"] = formula[f"r{r}"]
    out: dict[str, Any] = {
        "benchmark": "powersgd", "steps": steps, "start_step": start, "world": 2,
        "params": t["numel"], "hook_call_ms_median": t["call_ms"], "table": table,
        "notes": "compress_decompress_ms: hook call minus plain allreduce_hook call (1 rank, "
                 "thread CPU time, median); pays_below_gbit_s_modelled: (dense - compressed "
                 "bytes) / compress+decompress time, ring all-reduce at W=2, latency ignored",
    }
    if not a.no_jobs:
        with tempfile.TemporaryDirectory() as d:
            # --smoke: one test play of 38 (the evaluations are most of a 4-step job)
            out["jobs"] = run_jobs(steps, start, Path(d), RANKS[:1] if a.smoke else RANKS, dense=not a.smoke,
                                   test_every=38 if a.smoke else 8, in_process=a.smoke)
    out["provenance"] = provenance(out, modelled=("bytes_formula",), configured=("steps", "start_step", "world", "params"))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
