"""The one loop's checkpoint as torch.distributed.checkpoint keys, by the model's own names:
``model/<name>`` (whole, or the pieces processes hold as DCP chunks), ``optim/<name>/<key>``
(cut like the parameter where it has its shape), ``rank<r>/...`` (process ``r``'s own copy:
values that differ, or no shared file system), ``meta/rank<r>`` (position, scheduler, RNG,
..., and what was saved) and ``engine/rank<r>`` (the strategy's own state). :func:`flatten`
writes, :func:`rebuild` reads back on the same layout (bit-identical),
:func:`reshard_targets` reads what a process of another layout holds now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.dcp_pieces import Box, Piece, Target
from .reshard import param_keys
from .summary import tensor_bytes


def meta_key(rank: int) -> str:
    return f"meta/rank{rank}"


def engine_key(rank: int) -> str:
    return f"engine/rank{rank}"


def box_of(spec: Mapping[str, Any] | None) -> Box | None:
    """The DCP chunk of a shard spec (slices on one dim compose, as ``narrow``s do)."""
    if spec is None:
        return None
    offsets = [0] * len(spec["shape"])
    for dim, start, _ in spec["slices"]:
        offsets[int(dim)] += int(start)
    return Box(tuple(int(x) for x in spec["shape"]), tuple(offsets))


def _box_list(box: Box | None) -> list[list[int]] | None:
    return None if box is None else [list(box.shape), list(box.offsets)]


def _box(doc: Any) -> Box | None:
    return None if doc is None else Box(tuple(doc[0]), tuple(doc[1]))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint description")
    return dt


def _piece_shape(spec: Mapping[str, Any]) -> tuple[int, ...]:
    shape = list(spec["shape"])
    for dim, _, length in spec["slices"]:
        shape[int(dim)] = int(length)
    return tuple(shape)


def flatten(state: Mapping[str, Any]) -> tuple[list[Piece], dict[str, Any], dict[str, Any]]:
    """``(pieces, meta, engine)`` of one process's loop state (the dict ``run_loop`` saves)."""
    keys = list(state["model"])
    names = state.get("names") or keys
    shards = state.get("shards") or [None] * len(keys)
    pieces: list[Piece] = []
    model_desc = []
    for k, n, spec in zip(keys, names, shards, strict=True):
        t = state["model"][k]
        box = box_of(spec)
        fqn = f"model/{n}" if (t.numel() > 0 or box is not None) else None
        if fqn is not None:
            pieces.append((fqn, t, box))
        model_desc.append([k, n, list(t.shape), str(t.dtype), fqn, _box_list(box)])
    opt = state.get("optimizer") or {"state": {}, "param_groups": []}  # none: Federated, PBT
    pnames = list(state.get("param_names") or [])
    pshards = state.get("param_shards") or [None] * len(pnames)
    optim_desc: dict[int, dict[str, Any]] = {}
    for i, st in opt["state"].items():
        n, spec = pnames[int(i)], pshards[int(i)]
        part = _piece_shape(spec) if spec is not None else None
        d: dict[str, Any] = {}
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                box = box_of(spec) if part is not None and tuple(v.shape) == part else None
                fqn = f"optim/{n}/{key}"
                pieces.append((fqn, v, box))
                d[key] = ["t", list(v.shape), str(v.dtype), fqn, _box_list(box)]
            else:
                d[key] = ["v", v]
        optim_desc[int(i)] = d
    # one key and chunk once: q, k and v of a fused tensor each carry Adam's ``step``
    unique: dict[tuple[str, tuple[int, ...] | None], Piece] = {}
    for fqn, t, box in pieces:
        unique.setdefault((fqn, box.offsets if box is not None else None), (fqn, t, box))
    pieces = list(unique.values())
    engine = dict(state.get("engine") or {})
    meta = {k: state.get(k) for k in ("step", "epoch", "batch", "scheduler", "rng", "losses",
                                       "curve", "loader", "optimizer_type", "layout")}
    meta.update(param_groups=opt["param_groups"], model=model_desc, optim=optim_desc,
                param_names=pnames, engine_keys=sorted(k for k, v in engine.items() if v))
    return pieces, meta, engine


def digests(pieces: Sequence[Piece]) -> dict[str, str]:
    """A digest of every whole tensor's bytes (pieces are each one process's own)."""
    return {fqn: hashlib.blake2b(tensor_bytes(t), digest_size=12).hexdigest()
            for fqn, t, box in pieces if box is None}


def privatize(pieces: list[Piece], meta: dict[str, Any], private: set[str] | None,
              rank: int) -> list[Piece]:
    """Move the keys in ``private`` (every key when None) under ``rank<r>/``."""
    def rename(fqn: str | None) -> str | None:
        return fqn if fqn is None or (private is not None and fqn not in private) else f"rank{rank}/{fqn}"

    for d in meta["model"]:
        d[4] = rename(d[4])
    for st in meta["optim"].values():
        for v in st.values():
            if v[0] == "t":
                v[3] = rename(v[3])
    return [(str(rename(f)), t, b) for f, t, b in pieces]


def rebuild(meta: Mapping[str, Any]) -> tuple[dict[str, Target], Any]:
    """Targets for exactly what a process wrote, and the function giving its loop state."""
    targets: dict[str, Target] = {}
    empties: dict[str, torch.Tensor] = {}
    for k, _, shape, dtype, fqn, box in meta["model"]:
        t = torch.empty(shape, dtype=_dtype(dtype))
        if fqn is None:
            empties[k] = t
        else:
            targets[f"m:{k}"] = Target(t, _box(box), (fqn,))
    for i, st in meta["optim"].items():
        for key, v in st.items():
            if v[0] == "t":
                targets[f"o:{i}:{key}"] = Target(torch.empty(v[1], dtype=_dtype(v[2])), _box(v[4]), (v[3],))

    def state() -> dict[str, Any]:
        model = {k: empties[k] if k in empties else targets[f"m:{k}"].tensor for k, *_ in meta["model"]}
        opt_state = {int(i): {key: targets[f"o:{i}:{key}"].tensor if v[0] == "t" else v[1]
                              for key, v in st.items()} for i, st in meta["optim"].items()}
        return {**{k: meta[k] for k in ("step", "epoch", "batch", "scheduler", "rng", "losses",
                                         "loader", "optimizer_type", "layout")},
                "curve": meta.get("curve"),  # absent from checkpoints written before it
                "model": model, "optimizer": {"state": opt_state, "param_groups": meta["param_groups"]},
                "names": [d[1] for d in meta["model"]], "param_names": meta["param_names"]}

    return targets, state


def unranked(fqn: str) -> str:
    """``rank<r>/model/x`` -> ``model/x``."""
    head, _, rest = fqn.partition("/")
    return rest if head.startswith("rank") and head[4:].isdigit() else fqn


def sources(kind: str, name: str, old_world: int) -> tuple[str, ...]:
    base = f"{kind}/{name}"
    return (base, *(f"rank{r}/{base}" for r in range(old_world)))


def reshard_targets(md: Any, metas: Sequence[Mapping[str, Any]], *, module: nn.Module,
                    optimizer: torch.optim.Optimizer, names: Mapping[str, str] | None,
                    shards: Mapping[str, Mapping[str, Any]] | None,
                    ) -> tuple[dict[str, Target], list[str], list[str], Any]:
    """What this process holds now, by model names, from a checkpoint of another layout
    (``md``: its DCP metadata; ``metas``: every old process's ``meta``): ``(targets,
    missing, wrong, build)``, ``build(groups)`` giving the state in this process's keys."""
    shards = shards or {}
    present = md.state_dict_metadata
    old_world = len(metas)
    current = module.state_dict()
    to_model = {k: (names.get(k, k) if names is not None else k) for k in current}
    targets: dict[str, Target] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for k, v in current.items():
        if v.numel() == 0 and k not in shards:
            continue  # an empty placeholder (a pipeline rank that owns no parameters)
        n, box = to_model[k], box_of(shards.get(k))
        srcs = [s for s in sources("model", n, old_world) if s in present]
        if not srcs:
            missing.append(n)
            continue
        whole = box.shape if box is not None else tuple(v.shape)
        if tuple(present[srcs[0]].size) != whole:
            wrong.append(f"{n}: checkpoint {tuple(present[srcs[0]].size)}, this job {whole}")
            continue
        targets[f"m:{k}"] = Target(torch.empty(v.shape, dtype=present[srcs[0]].properties.dtype), box,
                                   tuple(srcs))
    pkeys = param_keys(module, optimizer)
    values: dict[str, dict[str, Any]] = {}  # non-tensor optimizer state, by name
    for m in metas:
        for i, st in m["optim"].items():
            n = m["param_names"][int(i)]
            for key, v in st.items():
                if v[0] == "v":
                    values.setdefault(n, {}).setdefault(key, v[1])
    opt_keys: dict[int, list[str]] = {}
    for i, k in enumerate(pkeys):
        n, spec = to_model[k], shards.get(k)
        box = box_of(spec)
        prefix = f"optim/{n}/"
        stkeys = sorted({g[len(prefix):] for g in map(unranked, present)
                         if g.startswith(prefix) and "/" not in g[len(prefix):]})
        opt_keys[i] = stkeys
        for key in stkeys:
            osrcs = tuple(s for s in sources("optim", f"{n}/{key}", old_world) if s in present)
            size = tuple(present[osrcs[0]].size)
            sharded = box is not None and size == box.shape
            shape = tuple(module.get_parameter(k).shape) if sharded else size
            targets[f"o:{i}:{key}"] = Target(torch.empty(shape, dtype=present[osrcs[0]].properties.dtype),
                                             box if sharded else None, osrcs)

    def build(groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        model = {k: targets[f"m:{k}"].tensor if f"m:{k}" in targets else current[k] for k in current}
        state: dict[int, Any] = {}
        for i, k in enumerate(pkeys):
            st = {key: targets[f"o:{i}:{key}"].tensor for key in opt_keys[i]}
            st.update(values.get(to_model[k], {}))
            if st:
                state[i] = st
        out_groups, j = [], 0
        for saved, g in zip(groups, optimizer.param_groups, strict=True):
            out_groups.append({**{a: b for a, b in saved.items() if a != "params"},
                               "params": list(range(j, j + len(g["params"])))})
            j += len(g["params"])
        return {"model": model, "optimizer": {"state": state, "param_groups": out_groups}}

    return targets, missing, wrong, build
