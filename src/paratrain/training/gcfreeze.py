"""Keep the cyclic garbage collector's full passes off a training step's critical path.

A generation-2 collection walks the few hundred thousand objects alive after ``import
torch`` (90-100 ms on the 2-core CI machine), making one rank a straggler the others wait
for; ``gc.freeze()`` moves them into a generation collections skip (nothing leaks). The
``paratrain`` command's own process also pauses the collector until the run trains and
freezes everything before exit (issue 34: 0.56 s and 0.8-1 s of CPU for the GPT demo).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

_state = {"owned": False, "paused": False, "imported": False}
_watched: list[weakref.ref[Any]] = []


def freeze_startup_objects() -> int:
    """Collect once, then freeze everything alive; returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def first_imports() -> Iterator[None]:
    """Collections off while a process that Flower (or another host) started imports torch and
    the training code, then what the imports made frozen; only the first time in a process
    (a later freeze would keep the garbage of the messages between). A full pass during
    ``import torch`` walks every object imported so far: a ClientApp's first import of
    ``.node`` (torch, paratrain's training code), then the optimizer's ``torch._dynamo``, took
    2.71-2.80 CPU-s with the collector on and 2.48-2.53 with this (3 runs each)."""
    if _state["imported"] or not gc.isenabled():
        yield
        return
    _state["imported"] = True
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def own_process(*, pause: bool) -> None:
    """This process runs one job and exits; ``pause`` collections until :func:`resume_collections`."""
    _state["owned"] = True
    if pause and gc.isenabled():
        gc.disable()
        _state["paused"] = True


def watch_garbage(obj: Any) -> None:
    """``obj`` is garbage once its builder returns: a cycle holding it is collected before the freeze."""
    if _state["paused"]:
        try:
            _watched.append(weakref.ref(obj))
        except TypeError:  # not weakly referenceable: nothing to watch
            pass


def resume_collections() -> None:
    """End of the start-up pause: freeze what start-up built, then collect again."""
    if not _state["paused"]:
        return
    _state["paused"] = False
    if any(ref() is not None for ref in _watched):
        gc.collect()
    _watched.clear()
    gc.freeze()
    gc.enable()


def freeze_for_exit() -> None:
    """In a process :func:`own_process` claimed: freeze everything before the interpreter exits."""
    if _state["owned"]:
        gc.freeze()
