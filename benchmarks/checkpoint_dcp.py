"""Checkpoint benchmark: paratrain's checkpoint stores (``training/stores.py``, written
through ``comm/dcp.py``) against torch.distributed.checkpoint's own ``dcp.save`` /
``dcp.load`` and plain ``torch.save`` / ``torch.load``, in the same run, as ratios.

* ``same_layout``: one process saving and then resuming a model of LAYERS square Linear
  layers (H x H, fp32) with its Adam state. paratrain: ``LocalStore.save`` /
  ``LocalStore.load`` (DCP write into a temp folder, fsync, rename; DCP read of the keys
  it wrote and its position). torch DCP: ``dcp.save`` / ``dcp.load`` of the model and
  optimizer state dicts (``FileSystemWriter``, fsynced) into a folder. torch.save: one
  fsynced file renamed into place, read with ``torch.load(weights_only=True)``. Medians
  over REPEATS rounds, the order of the three rotating each round; ratios are paratrain's
  median over the peer's.
* ``reshard``: the same state saved by 4 processes each holding a quarter of every
  tensor's rows (as ZeRO-3 or a 4-way tensor-parallel split hold it), resumed by process 0
  of 2, which keeps the first half of each tensor's rows. Measured: that process's peak
  resident memory (VmHWM) over its resident memory before it reads, in a fresh process per
  reader. paratrain: ``comm.dcp.load`` of its half from the DCP chunks that hold it (the
  read ``RankStore`` makes on another layout). torch DCP: ``dcp.load`` of the same folder
  into whole tensors (a plain tensor target; the half is kept). torch.save: the 4 per-process
  files loaded and joined, the half kept.

Prints one JSON object (every figure measured here). ``--quick`` for a smaller model,
``--smoke`` for the tiniest one (every code path, a few seconds; its reshard readers share one
fresh process, one after another).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, provenance  # noqa: E402

OLD_WORLD, NEW_WORLD = 4, 2
KINDS = ("paratrain", "torch_dcp", "torch_save")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _whole(h: int, layers: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {f"{i}.weight": {"param": torch.randn(h, h, generator=g), "exp_avg": torch.randn(h, h, generator=g),
                            "exp_avg_sq": torch.rand(h, h, generator=g)} for i in range(layers)}


def _torch_save(path: Path, state: Any) -> None:
    """``torch.save`` into a temp file, fsync, rename (a crash leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- reshard: 4 writers, process 0 of 2 reads its half -----------------------------------

def _write(root: Path, h: int, layers: int) -> None:
    """The 4-process checkpoint: one DCP folder of row chunks (paratrain's layout, which
    torch DCP reads too) and 4 per-process ``torch.save`` files."""
    from paratrain.comm import dcp

    whole = _whole(h, layers)
    rows = h // OLD_WORLD
    pieces: list[Any] = []
    (root / "save").mkdir()
    for r in range(OLD_WORLD):
        cut = {n: {k: v[r * rows:(r + 1) * rows].clone() for k, v in t.items()} for n, t in whole.items()}
        mine: dict[str, torch.Tensor] = {}
        for n, c in cut.items():
            box = dcp.Box((h, h), (r * rows, 0))
            for fqn, t in ((f"model/{n}", c["param"]), (f"optim/{n}/exp_avg", c["exp_avg"]),
                           (f"optim/{n}/exp_avg_sq", c["exp_avg_sq"])):
                pieces.append((fqn, t, box))
                mine[fqn] = t
        _torch_save(root / "save" / f"rank{r}.pt", mine)
    (root / "dcp").mkdir()
    dcp.save(root / "dcp", pieces, blobs={}, group=None, world=1)


def _read_paratrain(root: Path, h: int) -> int:
    from paratrain.comm import dcp

    md = dcp.read_metadata(root / "dcp")
    targets = {k: dcp.Target(torch.empty(h // NEW_WORLD, h), dcp.Box((h, h), (0, 0)), (k,))
               for k in md.state_dict_metadata}
    dcp.load(root / "dcp", targets, group=None, world=1)
    return len(targets)


def _read_torch_dcp(root: Path, h: int) -> int:
    import torch.distributed.checkpoint as tdcp

    md = tdcp.FileSystemReader(str(root / "dcp")).read_metadata()
    state = {k: torch.empty(h, h) for k in md.state_dict_metadata}
    tdcp.load(state, storage_reader=tdcp.FileSystemReader(str(root / "dcp")), no_dist=True)
    half = {k: v[: h // NEW_WORLD].clone() for k, v in state.items()}
    del state
    return len(half)


def _read_torch_save(root: Path, h: int) -> int:
    files = [torch.load(root / "save" / f"rank{r}.pt", weights_only=True) for r in range(OLD_WORLD)]
    merged = {k: torch.cat([f[k] for f in files]) for k in files[0]}
    del files
    half = {k: v[: h // NEW_WORLD].clone() for k, v in merged.items()}
    del merged
    return len(half)


def _child(kinds: str, root: Path, h: int) -> None:
    """Read the checkpoint as each of ``kinds`` (comma-separated; one unless ``--smoke``), in
    turn, printing one JSON line each: the peak resident memory of the read over the
    resident memory before it (between reads the peak is reset to the current value)."""
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as _tdcp  # noqa: F401 - imports are not the read's memory

    import paratrain.comm.dcp  # noqa: F401

    for i, kind in enumerate(kinds.split(",")):
        if i:  # Linux: "5" resets VmHWM to VmRSS
            Path("/proc/self/clear_refs").write_text("5")
        start = _rss_kb("VmRSS")
        n = {"paratrain": _read_paratrain, "torch_dcp": _read_torch_dcp, "torch_save": _read_torch_save}[kind](root, h)
        assert n > 0
        print(json.dumps({"kind": kind, "peak_over_start_mb": round((_rss_kb("VmHWM") - start) / 1024, 2)}),
              flush=True)


def _peaks(root: Path, h: int, readers: int, one_process: bool = False) -> dict[str, list[float]]:
    """Every reader a fresh process; run side by side (memory, not time, is measured).
    ``one_process`` (``--smoke``): one fresh process reads as every kind in turn (the
    readers' code paths, one interpreter's start-up instead of three; a later reader's
    figure then counts memory its predecessors freed to the allocator but not the OS)."""
    groups = [",".join(KINDS)] if one_process else list(KINDS)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", kinds, str(root), str(h)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(readers) for kinds in groups]
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"reader {p.args[3]} failed ({p.returncode}): {stderr[-2000:]}")
        for line in stdout.strip().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[row["kind"]].append(float(row["peak_over_start_mb"]))
    assert all(out.values()), out
    return out


# -- same layout: one process saves and resumes the whole state ---------------------------

def _model(h: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(h, h, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, h)).sum().backward()
    opt.step()  # Adam's state exists
    return model, opt


def _loop_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The loop state ``run_loop`` hands a store."""
    names = [n for n, _ in model.named_parameters()]
    return {"model": model.state_dict(), "names": list(model.state_dict()), "param_names": names,
            "optimizer": opt.state_dict(), "scheduler": {}, "rng": None, "step": 1, "epoch": 0,
            "batch": 1, "losses": [], "loader": {}, "optimizer_type": "Adam",
            "layout": {"strategy": "Local"}, "engine": {}}


def _save_load(kind: str, d: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[float, float, Any]:
    import torch.distributed.checkpoint as tdcp

    from paratrain.training.stores import LocalStore

    t0 = time.perf_counter()
    if kind == "paratrain":
        LocalStore(d / "checkpoints").save(1, _loop_state(model, opt))
    elif kind == "torch_dcp":
        tdcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                  storage_writer=tdcp.FileSystemWriter(str(d / "dcp"), sync_files=True), no_dist=True)
    else:
        d.mkdir()
        _torch_save(d / "ckpt.pt", {"model": model.state_dict(), "optim": opt.state_dict()})
    t1 = time.perf_counter()
    if kind == "paratrain":
        found = LocalStore(d / "checkpoints").load()
        assert found is not None
        got = found[1]["model"]
    elif kind == "torch_dcp":
        state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()},
                 "optim": opt.state_dict()}  # DCP loads in place into a template
        tdcp.load(state, storage_reader=tdcp.FileSystemReader(str(d / "dcp")), no_dist=True)
        got = state["model"]
    else:
        got = torch.load(d / "ckpt.pt", weights_only=True)["model"]
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, got


def _same_layout(h: int, layers: int, repeats: int) -> dict[str, Any]:
    import warnings

    model, opt = _model(h, layers)
    first = model.state_dict()["0.weight"]
    times: dict[str, list[float]] = {f"{k}_{w}": [] for k in KINDS for w in ("save", "load")}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        for i in range(repeats + 1):  # round 0 warms up (imports, first writes)
            for kind in KINDS[i % 3:] + KINDS[:i % 3]:
                s, ld, got = _save_load(kind, Path(tmp) / f"{kind}{i}", model, opt)
                assert torch.equal(got["0.weight"], first), kind
                if i > 0:
                    times[f"{kind}_save"].append(s)
                    times[f"{kind}_load"].append(ld)
    med = {k: median(v) for k, v in times.items()}
    out: dict[str, Any] = {f"{k}_median_s": round(v, 4) for k, v in med.items()}
    for peer in ("torch_dcp", "torch_save"):
        for w in ("save", "load"):
            out[f"{w}_ratio_paratrain_over_{peer}"] = round(med[f"paratrain_{w}"] / med[f"{peer}_{w}"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="hidden 1024, 3 repeats")
    ap.add_argument("--smoke", action="store_true", help="hidden 64, 1 repeat, the 3 readers in one process: "
                    "every code path")
    ap.add_argument("--child", nargs=3, metavar=("KINDS", "ROOT", "H"))
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], Path(args.child[1]), int(args.child[2]))
        return
    torch.set_num_threads(1)
    h, layers, repeats, readers = ((64, 2, 1, 1) if args.smoke else (1024, 4, 3, 2) if args.quick
                                   else (2048, 4, 5, 2))
    whole_mb = layers * 3 * h * h * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, h, layers)
        peaks = _peaks(root, h, readers, one_process=args.smoke)
    best = {k: min(v) for k, v in peaks.items()}
    reshard: dict[str, Any] = {"whole_state_mb": round(whole_mb, 2),
                               **{f"{k}_peak_over_start_mb": v for k, v in best.items()}}
    for peer in ("torch_dcp", "torch_save"):
        reshard[f"peak_ratio_paratrain_over_{peer}"] = round(best["paratrain"] / max(best[peer], 0.01), 3)
    results: dict[str, Any] = {
        "config": {"hidden": h, "layers": layers, "old_processes": OLD_WORLD, "new_processes": NEW_WORLD,
                   "repeats": repeats, "readers_per_kind": readers},
        "reshard": reshard,
        "same_layout": _same_layout(h, layers, repeats),
    }
    results["provenance"] = provenance(results, configured=["whole_state_mb"])
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
