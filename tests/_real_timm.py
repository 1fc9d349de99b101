"""timm 1.0.31 (and torchvision 0.29.1, which timm imports) from the folder ``make`` installs
them into, ``.venv/timm``: on no ``sys.path`` by default, because once torchvision is
importable transformers imports it, and PyPI's torchvision wheel cannot load its ``_C``
beside the CPU torch ("operator torchvision::nms does not exist"), which breaks
``import transformers.modeling_utils`` for the whole suite.

:func:`import_timm` is for a worker process only (a rank of ``run_distributed``): it
defines the two operators torchvision registers at import (``torchvision::nms`` and
``qnms``, the ones its Python code looks up) through ``torch.library``, then puts the folder
on that process's ``sys.path`` and imports timm. The test module asks :func:`timm_dir` and
skips when the folder is missing (``make test`` installs it)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# the torch.library.Library that defines the operators: they live as long as it does
_OPS: list[Any] = []


def timm_dir() -> Path | None:
    """``.venv/timm`` beside this interpreter (``sys.prefix``) or under the repository root,
    ``None`` if neither holds timm."""
    for venv in (Path(sys.prefix), Path(__file__).resolve().parents[1] / ".venv"):
        if (venv / "timm" / "timm").is_dir():
            return venv / "timm"
    return None


def import_timm() -> ModuleType:
    """timm, imported in this (worker) process from :func:`timm_dir`."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    folder = timm_dir()
    if folder is None:
        raise RuntimeError("timm is not installed in .venv/timm (make installs it)")
    import torch

    if "torchvision" not in sys.modules and not _OPS:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _OPS.append(lib)
    sys.path.insert(0, str(folder))
    import timm

    return timm
