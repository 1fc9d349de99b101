"""The one loop's checkpoints are torch.distributed.checkpoint (DCP) folders keyed by the
model's own names (training/stores.py, comm/dcp.py):

- on disk a step is DCP's ``.metadata`` + ``__<rank>_0.distcp`` files, and
  ``torch.distributed.checkpoint.load`` reads a parameter by its name directly;
- a process reads only the slices it holds now (a rank of a 2-way split of a tensor saved
  as 4 pieces reads 2 of them);
- processes that hold one tensor with different values keep their own copies
  (``rank<r>/...``) and resume bit-identical; another layout takes process 0's, and the
  warning names them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import paratrain
from paratrain.comm import dcp
from paratrain.comm.context import WorkerContext
from paratrain.comm.testing import run_distributed
from paratrain.files import step_folders
from paratrain.training.reshard import ReshardWarning, param_names
from paratrain.training.stores import Held, LocalStore, RankStore

pytestmark = pytest.mark.timeout(120)


def test_a_checkpoint_is_a_dcp_folder_that_torch_reads_by_the_models_names(tmp_path: Path) -> None:
    doc = {"run": {"name": "r", "seed": 3, "output_dir": str(tmp_path), "checkpoint_every": 3},
           "model": {"name": "mlp", "hidden": [16]},
           "train": {"epochs": 1, "batch_size": 32, "max_steps": 6,
                     "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}}
    paratrain.fit(doc)
    folders = step_folders(tmp_path / "r" / "checkpoints")
    assert [p.name for p in folders] == ["step-000000003", "step-000000006"]
    assert sorted(p.name for p in folders[-1].iterdir()) == [".metadata", "__0_0.distcp", "layout.json"]
    model = paratrain.load_model(tmp_path / "r")  # the finished run's model: step 6's
    keys = torch_dcp.FileSystemReader(str(folders[-1])).read_metadata().state_dict_metadata
    assert {f"model/{n}" for n in model} <= set(keys)
    assert any(k.startswith("optim/") and k.endswith("/momentum_buffer") for k in keys)
    name = next(iter(model))
    got = {f"model/{name}": torch.empty_like(model[name])}
    torch_dcp.load(got, checkpoint_id=str(folders[-1]), no_dist=True)
    assert torch.equal(got[f"model/{name}"], model[name])


def test_a_process_reads_only_its_slices(tmp_path: Path) -> None:
    """A tensor saved as 4 row pieces (4 processes' chunks); rank 1 of a 2-way split
    reads rows 4..7: the 2 chunks that hold them, 16 of the 32 elements."""
    whole = torch.arange(32.0).reshape(8, 4)
    pieces = [("model/w", whole[2 * r: 2 * r + 2].clone(), dcp.Box((8, 4), (2 * r, 0))) for r in range(4)]
    dcp.save(tmp_path, pieces, blobs={}, group=None, world=1)
    md = dcp.read_metadata(tmp_path)
    assert [tuple(c.offsets) for c in md.state_dict_metadata["model/w"].chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    mine = dcp.Target(torch.zeros(4, 4), dcp.Box((8, 4), (4, 0)), ("model/w",))
    items = dcp.read_items("w", mine, md)
    assert sorted(tuple(i.storage_index.offset) for i in items) == [(4, 0), (6, 0)]
    assert sum(int(torch.Size(i.lengths).numel()) for i in items) == 16
    dcp.load(tmp_path, {"w": mine}, group=None, world=1)
    assert torch.equal(mine.tensor, whole[4:])


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s loop state: row ``rank`` of ``0.weight`` (a piece), ``0.bias``
    whole and equal on both ranks, ``1.weight`` whole and different per rank."""
    local = {"0.weight": model.state_dict()["0.weight"][rank: rank + 1].clone(),
             "0.bias": model.state_dict()["0.bias"], "1.weight": model.state_dict()["1.weight"] + rank}
    spec = {"shape": [2, 3], "slices": [[0, rank, 1]]}
    return {"model": local, "optimizer": {"state": {}, "param_groups": opt.state_dict()["param_groups"]},
            "scheduler": {}, "rng": None, "step": 5, "epoch": 0, "batch": 5, "losses": [], "loader": {},
            "optimizer_type": "SGD", "layout": {"strategy": "DataParallel", "replicas": 2},
            "names": list(local), "param_names": param_names(model, opt),
            "shards": [spec, None, None], "param_shards": [spec, None, None], "engine": {"k": rank}}


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _save_and_resume(ctx: WorkerContext, root: str) -> list[bool]:
    model, opt = _model()
    saved = _state(model, opt, ctx.rank)
    store = RankStore(root, "dp", rank=ctx.rank, world=2, group=ctx.group, layout={"replicas": 2},
                      layout_field="strategy.num_replicas", reshard=True)
    store.save(5, saved)
    found = RankStore(root, "dp", rank=ctx.rank, world=2, group=ctx.group, layout={"replicas": 2},
                      layout_field="strategy.num_replicas", reshard=True).load()
    assert found is not None
    got = found[1]
    return [torch.equal(got["model"][k], v) for k, v in saved["model"].items()] + [got["engine"] == {"k": ctx.rank}]


def test_different_values_stay_per_rank_and_another_layout_takes_process_0s(tmp_path: Path) -> None:
    assert run_distributed(_save_and_resume, 2, str(tmp_path), timeout_s=90) == [[True] * 4] * 2
    folder = step_folders(tmp_path / "checkpoints")[-1]
    keys = dcp.read_metadata(folder).state_dict_metadata
    assert {"model/0.weight", "model/0.bias", "rank0/model/1.weight", "rank1/model/1.weight"} <= set(keys)
    assert "model/1.weight" not in keys and "rank1/model/0.bias" not in keys
    assert len(keys["model/0.weight"].chunks) == 2  # one row from each rank

    model, opt = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = LocalStore(tmp_path / "checkpoints").load(Held(model, opt, None, None))
    assert found is not None
    notes = [str(w.message) for w in caught if issubclass(w.category, ReshardWarning)]
    assert len(notes) == 1 and "different values (1.weight" in notes[0] and "strategy's own state (k" in notes[0]
    want, _ = _model()
    assert torch.equal(found[1]["model"]["0.weight"], want.state_dict()["0.weight"])  # both rows
    assert torch.equal(found[1]["model"]["1.weight"], want.state_dict()["1.weight"])  # process 0's
