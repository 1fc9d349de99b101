"""``make bench``: every benchmark at its ``--quick`` size, one at a time, each result kept
with its provenance, then RESULTS.md generated from the results.

For each ``benchmarks/<name>.py`` (no leading underscore; ``--only`` / ``--skip`` pick), in
name order: ``python benchmarks/<name>.py --quick`` runs in the repository root; its
stdout must be one JSON object (the whole of it, or its last line). It is written to
``benchmarks/results/<name>.json`` as ``{"benchmark", "provenance", "result"}``, the
provenance being the command, its niceness, the date (UTC), the git commit (and which files
under ``src/`` or ``benchmarks/`` differed from it), the machine (CPU count and model,
platform, Python and torch versions), the 1/5/15-minute load average before and after the
run, its wall time and the benchmark's description (its docstring's first paragraph).
A benchmark that fails (exit status, no JSON object, over ``--timeout``) keeps its previous
results file; its stderr's tail is printed and the exit status is 1. Finally
``_results_md.py`` rewrites RESULTS.md from every results file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# this folder: sys.path[0] when run as a script, appended by the test
import _results_md
from _common import UNLABELLED, figures

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if not p.name.startswith("_"))


def run_captured(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``cmd`` run in the repository root, in a session of
    its own: past ``timeout`` seconds its whole process group is killed (the ranks, runs and
    spinner processes a benchmark starts too, not only the script) and RuntimeError says so."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"{' '.join(cmd[1:])}: over the {timeout:.0f} s timeout (its process group "
                           "was killed)") from None
    return proc.returncode, stdout, stderr


def parse_output(stdout: str) -> dict[str, Any]:
    """The one JSON object a benchmark prints: its whole stdout, else its last line."""
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        lines = [ln for ln in stdout.splitlines() if ln.strip()]
        if not lines:
            raise ValueError("printed nothing on stdout") from None
        doc = json.loads(lines[-1])
    if not isinstance(doc, dict):
        raise ValueError(f"printed a JSON {type(doc).__name__}, not an object")
    return doc


def description(path: Path) -> str:
    """The first paragraph of the file's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def dirty_paths() -> list[str]:
    """Tracked files under ``src/`` and ``benchmarks/`` that differ from the commit, but
    what ``make bench`` itself writes (RESULTS.md, results/)."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks")
    paths = [ln[3:] for ln in out.splitlines() if len(ln) > 3]
    return [p for p in paths if p != "benchmarks/RESULTS.md" and not p.startswith("benchmarks/results/")]


def machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or "unknown"
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch_version}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_one(name: str, size: str, timeout: float, mach: dict[str, Any]) -> dict[str, Any]:
    path = HERE / f"{name}.py"
    cmd = [sys.executable, str(path.relative_to(ROOT)), f"--{size}"]
    shown = " ".join(["python", *cmd[1:]])
    before = _load()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.perf_counter()
    returncode, stdout, stderr = run_captured(cmd, timeout)
    wall = time.perf_counter() - t0
    after = _load()
    if returncode != 0:
        raise RuntimeError(f"exit status {returncode}:\n{stderr[-3000:]}")
    result = parse_output(stdout)
    dirty = dirty_paths()
    return {"benchmark": name,
            "provenance": {"command": shown, "nice": os.nice(0), "date": date, "git_commit": _git("rev-parse", "HEAD").strip(),
                           "git_dirty": dirty, "machine": mach, "load_average_before": before,
                           "load_average_after": after, "wall_s": round(wall, 1),
                           "description": description(path)},
            "result": result}


def main() -> int:
    names = benchmark_names()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=names, metavar="NAME", help="run only these benchmarks")
    ap.add_argument("--skip", nargs="+", choices=names, default=[], metavar="NAME", help="do not run these")
    ap.add_argument("--size", choices=["quick", "smoke"], default="quick",
                    help="the size flag passed to each benchmark (smoke: a dry run of this script)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one benchmark may take")
    ap.add_argument("--results", type=Path, default=_results_md.RESULTS, help="where the JSON files go")
    args = ap.parse_args()
    chosen = [n for n in (args.only or names) if n not in args.skip]
    args.results.mkdir(parents=True, exist_ok=True)
    mach = machine()
    failed: list[str] = []
    t_all = time.perf_counter()
    for name in chosen:
        print(f"[bench] {name} --{args.size} (load {_load()[0]}) ...", flush=True)
        try:
            doc = run_one(name, args.size, args.timeout, mach)
        except (RuntimeError, ValueError) as e:
            print(f"[bench] {name} FAILED: {e}", flush=True)
            failed.append(name)
            continue
        unlabelled = [p for p, _, lab in figures(doc["result"]) if lab == UNLABELLED]
        if unlabelled:
            print(f"[bench] {name}: unlabelled figures {unlabelled[:8]}", flush=True)
        (args.results / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"[bench] {name} done in {doc['provenance']['wall_s']} s", flush=True)
    print(f"[bench] {len(chosen) - len(failed)} of {len(chosen)} ran in {time.perf_counter() - t_all:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if args.results == _results_md.RESULTS:
        _results_md.OUT.write_text(_results_md.render())
        print(f"[bench] wrote {_results_md.OUT}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
