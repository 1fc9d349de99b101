"""The trained model out: ``model.safetensors``, the whole ``state_dict()`` by the model's own
names whatever the strategy cut it into (tied parameters under each name); :func:`load_model`
reads it (an unfinished run: its newest checkpoint, with a warning). Safetensors: no pickle.
:func:`export_hf` (``paratrain export RUN --format hf``) writes what ``save_pretrained``
writes, for a run whose model is (or wraps one holding every parameter) a transformers
``PreTrainedModel``: those weights, loaded into the model rebuilt from job.json.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..files import write_atomic

MODEL_FILE = "model.safetensors"


def client_model_file(client: int) -> str:
    """A Federated client's own model (global parts + its personal parts), by index."""
    return f"model-client{client:04d}.safetensors"


def whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as CPU tensors (tied entries under every name)."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def tied_names(module: nn.Module) -> list[list[str]]:
    """Groups of ``state_dict`` names that are one tensor (tied weights), model order."""
    by_tensor: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if t.numel() == 0:
            continue
        by_tensor.setdefault((t.data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def complete_state(
    pieces: Iterable[Mapping[str, torch.Tensor]], names: list[str], ties: list[list[str]],
) -> dict[str, torch.Tensor]:
    """The whole state_dict in ``names`` order from ``pieces`` (each worker's part; the first
    wins), a tied name filled from its group; RuntimeError naming what no piece holds."""
    found: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for k, v in piece.items():
            found.setdefault(k, v.detach().cpu())
    for group in ties:
        held = next((found[n] for n in group if n in found), None)
        if held is not None:
            for n in group:
                found.setdefault(n, held)
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"the model's {', '.join(missing[:5])} is in no worker's part")
    return {n: found[n] for n in names}


def save_model(run_dir: str | Path, state: Mapping[str, torch.Tensor], *,
               name: str = MODEL_FILE) -> Path:
    """Write ``state`` to ``run_dir/name`` atomically (:func:`paratrain.files.write_atomic`)."""
    from safetensors.torch import save_file

    path = Path(run_dir) / name
    # safetensors refuses tensors sharing memory: each name gets its own contiguous copy
    flat = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    # safetensors sorts names; the metadata keeps the model's own order
    meta = {"format": "pt", "producer": "paratrain", "order": json.dumps(list(flat))}
    return write_atomic(path, lambda tmp: save_file(flat, str(tmp), metadata=meta))


def load_model(run_dir: str | Path, *, client: int | None = None) -> dict[str, torch.Tensor]:
    """The run's model as one state_dict (``client``: a Federated client's, personal parts too)."""
    run = Path(run_dir)
    name = MODEL_FILE if client is None else client_model_file(client)
    path = run / name
    if not path.is_file() and client is None and run.is_dir():
        state = _from_checkpoint(run)
        if state is not None:
            return state
    if not path.is_file():
        if not run.is_dir():
            why = "is not a folder"
        elif client is not None and (run / MODEL_FILE).is_file():
            why = f"has no model of client {client} (clients with personal parts only)"
        else:
            why = (f"holds no {MODEL_FILE}: the run has not finished "
                   "(continue it with `paratrain run JOB --resume`)")
        raise ConfigError([("run", f"{run} {why}")])
    return read_model(path)


def read_model(path: str | Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file :func:`save_model` wrote, in the model's ``state_dict`` order."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        order = json.loads(meta.get("order", "[]"))
    except ValueError:
        order = []
    if sorted(order) != sorted(state):
        return state
    return {k: state[k] for k in order}


def _from_checkpoint(run: Path) -> dict[str, torch.Tensor] | None:
    """An unfinished run's model: its newest complete checkpoint, with a warning naming it;
    None without one that holds a model (PopulationBased's holds the population)."""
    from ..files import newest_checkpoint
    from .stores import read_named_model

    found = newest_checkpoint(run)
    if found is None or not found.path.is_dir() or found.kind == "pbt":
        return None
    state = read_named_model(found.path)
    warnings.warn(f"{run} has not finished: its model at {found.where} (the newest complete "
                  f"checkpoint, {found.path})", RuntimeWarning, stacklevel=3)
    return {k: v.detach().cpu() for k, v in state.items()}


def export_model(run_dir: str | Path, out: str | Path, *, client: int | None = None) -> Path:
    """Write the run's model to ``out``: ``.safetensors`` or ``.pt`` (``torch.save``)."""
    out = Path(out)
    state = load_model(run_dir, client=client)
    if out.suffix not in (".safetensors", ".pt", ".pth"):
        raise ConfigError([("--out", f"{out}: the file name must end in .safetensors or .pt")])
    if out.parent and not out.parent.is_dir():
        raise ConfigError([("--out", f"{out.parent} is not a folder")])
    if out.suffix == ".safetensors":
        return save_model(out.parent, state, name=out.name)
    return write_atomic(out, lambda tmp: torch.save(state, tmp))


def export_hf(run_dir: str | Path, out: str | Path, *, client: int | None = None) -> Path:
    """Write the run's model (``client``: a Federated client's) to the folder ``out``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError([("--out", f"{out} is a file: --format hf writes a folder")])
    state = load_model(run_dir, client=client)  # first: an unfinished run says so
    model = _rebuilt(Path(run_dir))
    model.load_state_dict(state, strict=True)
    hf = _pretrained(model)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    return out


def _rebuilt(run: Path) -> nn.Module:
    """The run's model as its task builds it from the run's ``job.json`` (untrained)."""
    from ..config.job import load_job
    from ..task import job_model

    job_file = run / "job.json"
    if not job_file.is_file():
        raise ConfigError([("run", f"{run} holds no job.json: --format hf rebuilds the model "
                                   "from the job the run trained")])
    model: nn.Module = job_model(load_job(job_file), "rebuilding the run's model for --format hf failed")[3]
    return model


def _pretrained(model: nn.Module) -> Any:
    """``model`` or its submodule holding every parameter that is a ``PreTrainedModel``."""
    tf = sys.modules.get("transformers")  # built by transformers -> already imported
    if tf is not None:
        if isinstance(model, tf.PreTrainedModel):
            return model
        total = sum(p.numel() for p in model.parameters())
        inner = [m for m in model.modules() if isinstance(m, tf.PreTrainedModel)
                 and sum(p.numel() for p in m.parameters()) == total]
        if inner:
            return inner[0]
    raise ConfigError([("--format", f"hf writes a Hugging Face transformers model, and this run's "
                                    f"model is a {type(model).__name__}, not a transformers "
                                    "PreTrainedModel: export it without --format hf (one "
                                    "state_dict as .safetensors or .pt)")])
