"""Workers forked from the torch-preloaded forkserver see what a spawned worker would: the
parent's environment, directory, import path and stdout/stderr *now*, not the server's from
when it started (paratrain.comm.forkserver)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.comm.testing import run_distributed


def report(ctx: Any) -> dict[str, Any]:
    print(f"hello from rank {ctx.rank}", flush=True)
    print(f"err from rank {ctx.rank}", file=sys.stderr, flush=True)
    import only_on_parent_path  # type: ignore[import-not-found]

    return {"env": os.environ.get("PARATRAIN_FS_PROBE"), "cwd": os.getcwd(),
            "mod": only_on_parent_path.VALUE, "rank_env": os.environ.get("RANK")}


def test_children_take_the_parents_current_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    run_distributed(_noop, 2)  # the server is running from here on
    (tmp_path / "only_on_parent_path.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PARATRAIN_FS_PROBE", "set-after-the-server-started")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    capfd.readouterr()
    out = run_distributed(report, 2)
    captured = capfd.readouterr()
    for r in out:
        assert r["env"] == "set-after-the-server-started"
        assert r["cwd"] == str(work) and r["mod"] == 42
    assert "hello from rank 0" in captured.out and "hello from rank 1" in captured.out
    assert "err from rank 1" in captured.err
    monkeypatch.delenv("PARATRAIN_FS_PROBE")
    assert all(r["env"] is None for r in run_distributed(report, 2))


def _noop(ctx: Any) -> int:
    return int(ctx.rank)
