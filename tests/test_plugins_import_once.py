"""`paratrain validate` imports a job's `run.imports` file once, like `import` does."""

from __future__ import annotations

from pathlib import Path

from paratrain import cli


def test_validate_runs_a_plugin_file_once(tmp_path: Path) -> None:
    counter = tmp_path / "count.txt"
    (tmp_path / "once_plugin.py").write_text(
        "from pathlib import Path\n"
        f"p = Path({str(counter)!r})\n"
        "p.write_text(str(int(p.read_text()) + 1) if p.exists() else '1')\n"
    )
    job = tmp_path / "job.toml"
    job.write_text('[run]\nname = "p"\nimports = ["once_plugin.py"]\n[train]\nepochs = 1\n')
    assert cli.main(["validate", "-q", str(job)]) == 0
    assert counter.read_text() == "1"
    assert cli.main(["validate", "-q", str(job)]) == 0  # same process, same file: not re-run
    assert counter.read_text() == "1"
