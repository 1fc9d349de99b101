"""Checkpoint format benchmark: the per-process ``torch.save`` files of earlier versions
(old) against the torch.distributed.checkpoint folders of ``training/stores.py`` (new).

* ``reshard_peak_rss_mb``: a model of LAYERS square Linear layers (H x H, fp32) with Adam
  state, saved by 4 processes each holding a quarter of every tensor's rows (as ZeRO-3 or
  a 4-way tensor-parallel split hold it), resumed on 2 processes. Measured: process 0's
  peak resident memory (VmHWM) over its resident memory before it reads, in a fresh
  process per format. Old: process 0 loads every old process's file, joins the pieces
  into whole tensors and serialises the merged state for its broadcast (what
  ``RankStore._load_resharded`` did at commit 5bf3918), then keeps its half. New: process
  0 reads its half of each tensor from the DCP chunks that hold it (``comm.dcp.load``, the
  read the store makes).
* ``same_layout_s``: one process saving and then resuming the whole model + Adam state on
  the same layout; median over REPEATS paired runs (order alternating) of the save and of
  the load, old (``checkpoint.save_checkpoint`` / ``load_checkpoint``: fsynced
  ``torch.save`` + ``os.replace``, ``torch.load(weights_only=True)``) vs new
  (``LocalStore.save`` / ``LocalStore.load``: DCP write into a temp folder, fsync, rename;
  DCP read of the process's own keys).

Prints one JSON object (every figure measured here). ``--quick`` for a smaller model.
"""

from __future__ import annotations

import argparse
import io
import json
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


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _whole(h: int, layers: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {f"{i}.weight": {"param": torch.randn(h, h, generator=g), "exp_avg": torch.randn(h, h, generator=g),
                            "exp_avg_sq": torch.rand(h, h, generator=g)} for i in range(layers)}


def _write(root: Path, h: int, layers: int) -> None:
    """Both formats of the same 4-process checkpoint."""
    from paratrain.comm import dcp
    from paratrain.training import checkpoint

    whole = _whole(h, layers)
    rows = h // OLD_WORLD
    pieces: list[Any] = []
    for r in range(OLD_WORLD):
        cut = {n: {k: v[r * rows:(r + 1) * rows].clone() for k, v in t.items()} for n, t in whole.items()}
        spec = {"shape": [h, h], "slices": [[0, r * rows, rows]]}
        names = list(cut)
        checkpoint.save_checkpoint(root / "old" / f"rank{r}.pt", {
            "model": {n: c["param"] for n, c in cut.items()}, "names": names, "param_names": names,
            "shards": [spec] * len(names), "param_shards": [spec] * len(names),
            "optimizer": {"state": {i: {"exp_avg": cut[n]["exp_avg"], "exp_avg_sq": cut[n]["exp_avg_sq"],
                                        "step": torch.tensor(1.0)} for i, n in enumerate(names)},
                          "param_groups": [{"lr": 0.001, "params": list(range(len(names)))}]},
            "step": 1})
        for n, c in cut.items():
            box = dcp.Box((h, h), (r * rows, 0))
            pieces += [(f"model/{n}", c["param"], box), (f"optim/{n}/exp_avg", c["exp_avg"], box),
                       (f"optim/{n}/exp_avg_sq", c["exp_avg_sq"], box)]
    (root / "new").mkdir()
    dcp.save(root / "new", pieces, blobs={}, group=None, world=1)


def _child_old(root: Path, h: int) -> None:
    """Process 0 of 2 resuming the old format: every file, merged whole, serialised."""
    from paratrain.training import checkpoint

    states = [checkpoint.load_checkpoint(root / "old" / f"rank{r}.pt") for r in range(OLD_WORLD)]
    first = states[0]
    merged: dict[str, torch.Tensor] = {}
    for i, n in enumerate(first["names"]):
        merged[f"model/{n}"] = torch.cat([s["model"][n] for s in states])
        for key in ("exp_avg", "exp_avg_sq"):
            merged[f"optim/{n}/{key}"] = torch.cat([s["optimizer"]["state"][i][key] for s in states])
    del states
    buf = io.BytesIO()
    torch.save(merged, buf)  # the blob process 0 broadcast
    blob = buf.getvalue()
    half = {k: v[: h // NEW_WORLD].clone() for k, v in torch.load(io.BytesIO(blob), weights_only=True).items()}
    assert len(half) == len(merged)


def _child_new(root: Path, h: int) -> None:
    """Process 0 of 2 resuming the DCP format: its rows of every tensor."""
    from paratrain.comm import dcp

    md = dcp.read_metadata(root / "new")
    targets = {k: dcp.Target(torch.empty(h // NEW_WORLD, h), dcp.Box((h, h), (0, 0)), (k,))
               for k in md.state_dict_metadata}
    dcp.load(root / "new", targets, group=None, world=1)


def _peak(kind: str, root: Path, h: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", kind, str(root), str(h)],
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_over_start_mb"])


def _loop_state(whole: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    names = list(whole)
    return {"model": {n: t["param"] for n, t in whole.items()}, "names": names, "param_names": names,
            "optimizer": {"state": {i: {"exp_avg": whole[n]["exp_avg"], "exp_avg_sq": whole[n]["exp_avg_sq"],
                                        "step": torch.tensor(1.0)} for i, n in enumerate(names)},
                          "param_groups": [{"lr": 0.001, "params": list(range(len(names)))}]},
            "scheduler": {}, "rng": None, "step": 1, "epoch": 0, "batch": 1, "losses": [], "loader": {},
            "optimizer_type": "Adam", "layout": {"strategy": "Local"}, "engine": {}}


def _same_layout(h: int, layers: int, repeats: int) -> dict[str, Any]:
    from paratrain.training import checkpoint
    from paratrain.training.stores import LocalStore

    state = _loop_state(_whole(h, layers))
    times: dict[str, list[float]] = {"old_save": [], "old_load": [], "new_save": [], "new_load": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for kind in (("old", "new") if i % 2 == 0 else ("new", "old")):
                d = Path(tmp) / f"{kind}{i}"
                t0 = time.perf_counter()
                if kind == "old":
                    checkpoint.save_checkpoint(checkpoint.checkpoint_path(d, 1), state)
                else:
                    LocalStore(d / "checkpoints").save(1, state)
                t1 = time.perf_counter()
                if kind == "old":
                    got = checkpoint.load_checkpoint(checkpoint.checkpoint_path(d, 1))
                else:
                    found = LocalStore(d / "checkpoints").load()
                    assert found is not None
                    got = found[1]
                t2 = time.perf_counter()
                assert torch.equal(got["model"]["0.weight"], state["model"]["0.weight"])
                times[f"{kind}_save"].append(t1 - t0)
                times[f"{kind}_load"].append(t2 - t1)
    med = {k: median(v) for k, v in times.items()}
    return {**{f"{k}_median_s": round(v, 4) for k, v in med.items()},
            "save_ratio_new_over_old": round(med["new_save"] / med["old_save"], 3),
            "load_ratio_new_over_old": round(med["new_load"] / med["old_load"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "ROOT", "H"))
    args = ap.parse_args()
    if args.child:
        kind, root, h = args.child[0], Path(args.child[1]), int(args.child[2])
        torch.set_num_threads(1)
        import paratrain.comm.dcp  # noqa: F401 - imports are not the read's memory
        import paratrain.training.checkpoint  # noqa: F401

        start = _rss_kb("VmRSS")
        (_child_old if kind == "old" else _child_new)(root, h)
        print(json.dumps({"peak_over_start_mb": round((_rss_kb("VmHWM") - start) / 1024, 1)}))
        return
    torch.set_num_threads(1)
    h, layers, repeats = (1024, 4, 3) if args.quick else (2048, 4, 5)
    whole_mb = layers * 3 * h * h * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, h, layers)
        peaks = {kind: [_peak(kind, root, h) for _ in range(2)] for kind in ("old", "new")}
    results: dict[str, Any] = {
        "config": {"hidden": h, "layers": layers, "old_processes": OLD_WORLD, "new_processes": NEW_WORLD,
                   "repeats": repeats},
        "reshard_peak_rss_mb": {
            "whole_state_mb": round(whole_mb, 1),
            "old_process0_peak_over_start_mb": min(peaks["old"]),
            "new_process0_peak_over_start_mb": min(peaks["new"]),
            "ratio_new_over_old": round(min(peaks["new"]) / min(peaks["old"]), 3)},
        "same_layout_s": _same_layout(h, layers, repeats),
    }
    results["provenance"] = provenance(results, configured=["whole_state_mb"])
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
