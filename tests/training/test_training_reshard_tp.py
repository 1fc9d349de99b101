"""Tensor-parallel checkpoints by the model's names, and resumes across executors.

Each TP rank saves, with every tensor, its dense model name and shard spec
(paratrain.tensor_parallel.shards), so paratrain.training.reshard assembles the shards
(a fused ``in_proj_weight`` from the q/k/v shards too) and cuts them again: a job with
``tensor_parallel_size = 2`` resumes as a Local run (``tensor_parallel_size = 1``) and the
other way round, a TP x DP job on another replica count or as DataParallel, and Local and
DataParallel resume each other's checkpoints (paratrain.files.newest_checkpoint finds the
newest complete one of any layout: a resume never silently starts fresh)."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paratrain
from _reshard import LAST_STDERR, fit_noting_reshards
from paratrain.comm.dcp import save as dcp_save
from paratrain.comm.tp.comm import TPComm
from paratrain.comm.tp.groups import TPGroups
from paratrain.config import ConfigError, TensorParallelismConfig
from paratrain.models.zoo import transformer
from paratrain.tensor_parallel import AttentionSpec, TensorParallelModule
from paratrain.tensor_parallel.shards import dense_names_and_shards
from paratrain.training.reshard import ReshardWarning, param_keys
from paratrain.training.stores import (
    Held,
    LocalStore,
    engine_key,
    flatten,
    latest_folder,
    meta_key,
    read_rank_state,
)

pytestmark = pytest.mark.timeout(600)


# -- in one process: the shard specs of a real conversion ---------------------------------

def _tp_rank(dense: nn.Module, rank: int, tp: int = 2) -> TensorParallelModule:
    """Rank ``rank``'s shard of ``dense`` (slicing needs no collective)."""
    comm = TPComm(None, list(range(tp)), rank=rank)
    cfg = TensorParallelismConfig.model_validate({"tensor_parallel_size": tp})
    return TensorParallelModule(copy.deepcopy(dense), cfg, TPGroups(comm, None, tp, 1, 0))


def _adam_state(module: nn.Module, names: dict[str, str] | None = None,
                shards: dict[str, Any] | None = None, seed: int = 0) -> tuple[torch.optim.Adam, dict[str, Any]]:
    """An Adam with moments, and the state the loop would checkpoint for ``module``."""
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    keys = list(module.state_dict())
    state: dict[str, Any] = {
        "model": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": {}, "rng": None,
        "step": 1, "epoch": 0, "batch": 1, "names": [(names or {}).get(k, k) for k in keys],
        "param_names": [(names or {}).get(k, k) for k in param_keys(module, opt)]}
    if shards:
        state["shards"] = [shards.get(k) for k in keys]
        state["param_shards"] = [shards.get(k) for k in param_keys(module, opt)]
    return opt, state


def _write(run_dir: Path, states: list[dict[str, Any]], **layout: Any) -> None:
    """``states`` (process order) as one DCP checkpoint of step 1, written by this process
    as the processes of another layout would (each key and chunk once)."""
    pieces, blobs, seen = [], {}, set()
    for r, st in enumerate(states):
        got, meta, engine = flatten(st)
        for fqn, t, box in got:
            if (fqn, box) not in seen:
                seen.add((fqn, box))
                pieces.append((fqn, t, box))
        blobs[meta_key(r)], blobs[engine_key(r)] = meta, engine
    folder = run_dir / "checkpoints" / "step-000000001"
    folder.mkdir(parents=True)
    dcp_save(folder, pieces, blobs=blobs, group=None, world=1)
    (folder / "layout.json").write_text(json.dumps({"kind": "tp", "step": 1, "world": len(states),
                                                    **layout}))


def _read(run_dir: Path, module: nn.Module, opt: torch.optim.Optimizer, names: Any = None,
          shards: Any = None) -> dict[str, Any]:
    """What a Local process (``module``, ``names``, ``shards``) reads of it."""
    with pytest.warns(ReshardWarning):
        found = LocalStore(run_dir / "checkpoints").load(Held(module, opt, names, shards))
    assert found is not None and found[1]["resharded"]
    return found[1]


def test_shards_of_a_fused_encoder_layer_round_trip(tmp_path: Path) -> None:
    """Dense -> 2 TP ranks -> dense through DCP checkpoints, model and Adam moments, bit
    for bit; the q shard of rank 1 is rows [E/2, E) of the fused in_proj_weight (and k's
    rows [E + E/2, 2E)): each rank reads those rows, the dense process all of them."""
    torch.manual_seed(0)
    dense = transformer((64,), 10, d_model=16, heads=2, layers=1)
    ranks = [_tp_rank(dense, r) for r in range(2)]
    names, shards = dense_names_and_shards(ranks[1], rank=1)
    assert names["module.block0.self_attn.q.weight"] == "block0.self_attn.in_proj_weight"
    assert shards["module.block0.self_attn.k.weight"] == {"shape": [48, 16], "slices": [[0, 24, 8]]}
    assert "module.embed.weight" not in shards  # a lone Linear stays whole (replicated)

    dense_opt, dense_state = _adam_state(dense)
    _write(tmp_path / "dense", [dense_state])
    local_states = []
    for r, tpm in enumerate(ranks):
        nm, sh = dense_names_and_shards(tpm, rank=r)
        opt = torch.optim.Adam(tpm.parameters(), lr=0.01)
        local = _read(tmp_path / "dense", tpm, opt, nm, sh)
        tpm.load_state_dict(local["model"])
        opt.load_state_dict(local["optimizer"])
        ref_q = dense.block0.self_attn.in_proj_weight[8 * r: 8 * (r + 1)]
        assert torch.equal(tpm.module.block0.self_attn.q.weight, ref_q)
        ref_m = dense_opt.state[dense.block0.self_attn.in_proj_weight]["exp_avg"][16 + 8 * r: 24 + 8 * r]
        assert torch.equal(opt.state[tpm.module.block0.self_attn.k.weight]["exp_avg"], ref_m)
        keys = list(tpm.state_dict())
        pk = param_keys(tpm, opt)
        local_states.append({
            "model": tpm.state_dict(), "optimizer": opt.state_dict(), "scheduler": {}, "rng": None,
            "step": 1, "epoch": 0, "batch": 1, "names": [nm[k] for k in keys],
            "param_names": [nm[k] for k in pk], "shards": [sh.get(k) for k in keys],
            "param_shards": [sh.get(k) for k in pk]})

    _write(tmp_path / "tp", local_states, tp=2)
    again = copy.deepcopy(dense)
    for p in again.parameters():
        torch.nn.init.zeros_(p)
    again_opt = torch.optim.Adam(again.parameters(), lr=0.01)
    back = _read(tmp_path / "tp", again, again_opt)
    assert set(back["model"]) == set(dense.state_dict())
    assert all(torch.equal(back["model"][k], v) for k, v in dense.state_dict().items())
    again_opt.load_state_dict(back["optimizer"])
    for (n, p), q in zip(dense.named_parameters(), again.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again_opt.state[q][key], dense_opt.state[p][key]), (n, key)


class _Attn(nn.Module):
    """Attention whose projections have their own names, opting in to head splitting."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Sequential(nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not run
        raise NotImplementedError

    def __paratrain_tp_attention__(self) -> AttentionSpec:
        return AttentionSpec(self.query, self.key, self.value, self.proj[0], self.heads)


def test_an_opted_in_attention_keeps_its_own_names() -> None:
    """Its q/k/v/o shards are saved (and exported) under the names the model gave them."""
    torch.manual_seed(0)
    dense = nn.Sequential(OrderedDict(attn=_Attn(8, 2)))
    tpm = _tp_rank(dense, 1)
    names, shards = dense_names_and_shards(tpm, rank=1)
    assert names["module.attn.k.weight"] == "attn.key.weight"
    assert names["module.attn.o.weight"] == "attn.proj.0.weight"
    assert shards["module.attn.k.weight"] == {"shape": [8, 8], "slices": [[0, 4, 4]]}
    assert set(tpm.to_dense_names({k.removeprefix("module."): v for k, v in tpm.state_dict().items()})) \
        == set(dense.state_dict())


def test_missing_shards_or_another_shape_are_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    tpm = _tp_rank(dense, 0)
    nm, sh = dense_names_and_shards(tpm, rank=0)
    _, half = _adam_state(tpm, nm, sh)
    _write(tmp_path / "half", [half], tp=2)  # rank 1's part is not there
    with pytest.raises(ConfigError) as e:
        LocalStore(tmp_path / "half" / "checkpoints").load(
            Held(dense, torch.optim.Adam(dense.parameters()), None, None))
    assert "0.weight" in str(e.value) and "16 of the 32 elements" in str(e.value)

    other = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))  # another hidden size
    _, state = _adam_state(other)
    _write(tmp_path / "other", [state])
    opt = torch.optim.Adam(tpm.parameters())
    with pytest.raises(ConfigError) as e:
        LocalStore(tmp_path / "other" / "checkpoints").load(Held(tpm, opt, nm, sh))
    assert "0.weight: checkpoint (6, 4), this job (8, 4)" in str(e.value)


# -- jobs ---------------------------------------------------------------------------------

REG = {"task": {"name": "regression"}, "data": {"name": "diabetes"},
       "model": {"name": "mlp", "hidden": [16, 8]}}
DIGITS = {"data": {"name": "digits"},
          "model": {"name": "transformer", "d_model": 16, "heads": 2, "layers": 1}}
DP2 = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}


def _doc(out: Path, steps: int, *, tp: int = 1, strategy: dict[str, Any] | None = None,
         base: dict[str, Any] = REG) -> dict[str, Any]:
    doc = {**base, "strategy": strategy or {"type": "Local"},
           "run": {"name": "r", "seed": 1, "output_dir": str(out), "checkpoint_every": 4},
           "train": {"epochs": 3, "batch_size": 8, "max_steps": steps,
                     "optimizer": {"name": "adam", "lr": 0.01}}}
    if tp > 1:
        doc["tensor_parallel"] = {"tensor_parallel_size": tp}
    return doc


_fit = fit_noting_reshards


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _moment(path: Path, name: str) -> torch.Tensor:
    """Adam's exp_avg of model parameter ``name`` in a Local checkpoint (a DCP folder)."""
    state = read_rank_state(path)
    return state["optimizer"]["state"][state["param_names"].index(name)]["exp_avg"]


@pytest.mark.slow
def test_tensor_parallel_resumes_as_local_and_back(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """TP 2 (fused q/k/v of an encoder layer) -> Local -> TP 2. Before this, the Local
    resume found no ckpt-*.pt and silently trained from the start."""
    saved, _ = _fit(_doc(tmp_path, 8, tp=2, base=DIGITS), capfd)
    run_dir = Path(saved["run_dir"])
    before = paratrain.load_model(run_dir)

    same, notes = _fit(_doc(tmp_path, 8, base=DIGITS), capfd, resume=True)  # zero steps left
    assert same["steps"] == 8 and _same(paratrain.load_model(run_dir), before)
    assert notes and "'tp': 2" in notes[0] and "'strategy': 'Local'" in notes[0]

    # 4 more steps as Local continue with the saved Adam moments: the moments in its
    # checkpoint at 12 are those of a Local run that never stopped (up to the TP sums'
    # rounding), not those of fresh moments
    more, _ = _fit(_doc(tmp_path, 12, base=DIGITS), capfd, resume=True)
    assert more["steps"] == 12
    ref_dir = tmp_path / "ref"
    _fit(_doc(ref_dir, 12, base=DIGITS), capfd)
    name = "block0.self_attn.in_proj_weight"
    got = _moment(run_dir / "checkpoints" / "step-000000012", name)
    want = _moment(ref_dir / "r" / "checkpoints" / "step-000000012", name)
    at8 = _moment(ref_dir / "r" / "checkpoints" / "step-000000008", name)
    assert float((got - want).abs().max()) < 1e-3 * float((want - at8).abs().max())
    after12 = paratrain.load_model(run_dir)
    assert _gap(after12, before) > 1e-3  # it trained on

    # and back: TP 2 from the Local checkpoint at 12, zero steps left, bit for bit
    back, notes = _fit(_doc(tmp_path, 12, tp=2, base=DIGITS), capfd, resume=True)
    assert back["steps"] == 12
    # what it resumed from is in the summary (the worker's warning is on its stderr as well)
    resumed = back["resumed_from"]
    assert {k: resumed[k] for k in ("checkpoint", "step", "resharded", "layout")} == {
        "checkpoint": "step-000000012", "step": 12, "resharded": True,
        "layout": {"strategy": "Local", "replicas": 1}}, LAST_STDERR[0][-4000:]
    assert resumed["onto"]["tp"] == 2 and "the random state of processes 1..1" in resumed["reset"][0]
    assert _same(paratrain.load_model(run_dir), after12)


@pytest.mark.slow
def test_local_and_data_parallel_resume_each_other(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    saved, _ = _fit(_doc(tmp_path, 8), capfd)
    run_dir = Path(saved["run_dir"])
    before = paratrain.load_model(run_dir)
    same, notes = _fit(_doc(tmp_path, 8, strategy=DP2), capfd, resume=True)
    assert same["steps"] == 8 and notes and _same(paratrain.load_model(run_dir), before)
    assert "random state of processes 1..1 (they did not exist: they take process 0's)" in notes[0]
    more, _ = _fit(_doc(tmp_path, 16, strategy=DP2), capfd, resume=True)
    assert more["steps"] == 16 and more["num_replicas"] == 2
    after = paratrain.load_model(run_dir)
    assert _gap(after, before) > 1e-3  # it trained on
    # the newest checkpoint is now DataParallel's (step 16), older Local files notwithstanding
    local, notes = _fit(_doc(tmp_path, 16), capfd, resume=True)
    assert local["steps"] == 16 and notes and "'replicas': 2" in notes[0]
    assert _same(paratrain.load_model(run_dir), after)


@pytest.mark.slow
def test_tp_by_dp_resumes_on_one_replica_and_as_data_parallel(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    saved, _ = _fit(_doc(tmp_path, 8, tp=2, strategy=DP2), capfd)
    run_dir = Path(saved["run_dir"])
    before = paratrain.load_model(run_dir)
    one, notes = _fit(_doc(tmp_path, 8, tp=2), capfd, resume=True)  # TP 2 x DP 1
    assert one["steps"] == 8 and notes and "'dp': 2" in notes[0]
    assert _same(paratrain.load_model(run_dir), before)
    dp, notes = _fit(_doc(tmp_path, 12, strategy=DP2), capfd, resume=True)  # TP 1 x DP 2
    assert dp["steps"] == 12 and notes and dp["num_replicas"] == 2
    assert _gap(paratrain.load_model(run_dir), before) > 1e-4


def test_a_checkpoint_only_another_strategy_resumes_is_refused(tmp_path: Path) -> None:
    """A run folder whose newest checkpoint is a PopulationBased population: a Local
    resume names it instead of starting fresh; so is an earlier version's population file."""
    ckpts = tmp_path / "r" / "checkpoints"
    folder = ckpts / "step-000000003"
    folder.mkdir(parents=True)
    (folder / "layout.json").write_text(json.dumps({"kind": "pbt", "step": 3, "world": 2,
                                                    "strategy": "PopulationBased"}))
    with pytest.raises(ConfigError) as e:
        paratrain.fit(_doc(tmp_path, 4), resume=True)
    assert "step-000000003" in str(e.value) and "generation 3" in str(e.value)
    assert "PopulationBased" in str(e.value) and "--overwrite" in str(e.value)
    (ckpts / "population-000004.pt").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        paratrain.fit(_doc(tmp_path, 4), resume=True)
    assert "population-000004.pt" in str(e.value) and "does not resume it" in str(e.value)


@pytest.mark.slow
def test_local_and_a_pipeline_resume_each_other(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pipe = {"type": "ModelParallel",
            "communication": {"protocol": "Pipeline", "micro_batch_size": 4, "schedule": "1F1B"},
            "partitions": [{"node_ids": ["fc1", "act1", "head"], "target": {"WorkerId": "worker-1"}}]}
    saved, _ = _fit(_doc(tmp_path, 8), capfd)
    run_dir = Path(saved["run_dir"])
    before = paratrain.load_model(run_dir)
    mp_doc = _doc(tmp_path, 8, strategy=pipe)
    mp_doc["run"]["num_workers"] = 2
    same, notes = _fit(mp_doc, capfd, resume=True)
    assert notes and "'strategy': 'Local'" in notes[0] and _same(paratrain.load_model(run_dir), before)
    mp_doc["train"]["max_steps"] = 12
    more, _ = _fit(mp_doc, capfd, resume=True)
    assert more["steps"] == 12
    after = paratrain.load_model(run_dir)
    local, notes = _fit(_doc(tmp_path, 12), capfd, resume=True)
    assert local["steps"] == 12 and notes and "'strategy': 'ModelParallel'" in notes[0]
    assert _same(paratrain.load_model(run_dir), after) and _gap(after, before) > 1e-3


@pytest.mark.slow
def test_a_two_d_grid_resumes_as_local_and_back(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """BlockWise on a 2 x 2 grid: each rank holds a block of every weight (two slices)."""
    grid = {"tensor_parallel_size": 4, "partitioning_strategy": "BlockWise"}
    doc = _doc(tmp_path, 8)
    doc["tensor_parallel"] = grid
    saved, _ = _fit(doc, capfd)
    run_dir = Path(saved["run_dir"])
    folder = latest_folder(run_dir / "checkpoints")
    assert folder is not None
    ckpt = read_rank_state(folder, 3)
    assert ckpt["shards"][ckpt["names"].index("fc1.weight")]["offsets"] == [4, 8]
    before = paratrain.load_model(run_dir)
    same, notes = _fit(_doc(tmp_path, 8), capfd, resume=True)
    assert notes and "'tp': 4" in notes[0] and _same(paratrain.load_model(run_dir), before)
    _fit(_doc(tmp_path, 12), capfd, resume=True)
    after = paratrain.load_model(run_dir)
    doc["train"]["max_steps"] = 12
    back, notes = _fit(doc, capfd, resume=True)
    assert back["steps"] == 12 and notes and _same(paratrain.load_model(run_dir), after)
