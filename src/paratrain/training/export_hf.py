"""``paratrain export RUN --format hf --out DIR``: what ``save_pretrained`` writes, for a run
whose model is (or wraps one holding every parameter) a transformers ``PreTrainedModel``;
the weights :func:`.export.load_model`'s, loaded into the model rebuilt from job.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch import nn

from ..config import ConfigError
from .export import load_model


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
