"""README.md and docs/*.md say only what holds: every relative link resolves (the file exists
inside the repository; a ``#anchor`` names a heading of the target by GitHub's slug rule),
every file of the repository they name (``examples/...``, ``tests/...``, ``benchmarks/...``,
``src/...``) exists, and every ``paratrain ...`` command they show parses as written, names job
files that ``paratrain validate`` accepts, and exports only runs the README's own commands
create. Nothing here trains (a few seconds in all)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from paratrain.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PARATRAIN = Path(sys.executable).parent / "paratrain"

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"^(\$ )?(\.venv/bin/)?paratrain\s")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# Placeholders the docs write in commands, and a value each stands for.
PLACEHOLDERS = {"R": "0", "HOST:PORT": "127.0.0.1:29500", "N": "2"}


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def _code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if FENCE.match(line):
            if current is None:
                current, info = [], line.strip().lstrip("`~").strip()
            else:
                blocks.append((info, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower-cased, every character
    but letters, digits, '-', '_' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, root: Path) -> list[str]:
    """One line per relative link of ``page`` that does not resolve inside ``root``."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for line in _prose_lines(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.name}: ({target})"
            if not dest.is_relative_to(root.resolve()):
                problems.append(f"{where}: outside the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest.read_text(encoding="utf-8"))):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


# ------------------------------------------------------------------------------- links


def test_every_relative_link_resolves() -> None:
    assert len(PAGES) > 5, PAGES  # the docs folder is there
    problems = [p for page in PAGES for p in broken_links(page, ROOT)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve()
              for t in LINK.findall(README.read_text(encoding="utf-8"))}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_link_checker_finds_broken_links(tmp_path: Path) -> None:
    """Non-vacuity: a missing file, a missing anchor and a link out of the repository are
    each reported; good links, a link inside code, and a URL are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Bee page\n\n## `[train]`: one loop\n\n## Same\n\n## Same\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# A\n\n[ok](b.md) [ok](b.md#bee-page) [ok](b.md#train-one-loop) [ok](b.md#same-1)\n"
        "[ok](#a) [url](https://example.com/x#y) `[code](nothing.md)`\n"
        "[gone](missing.md) [bad anchor](b.md#bees) [out](../../shared/DESIGN.md)\n"
        "```\n[in a fence](nothing.md)\n```\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 3, problems
    assert "(missing.md): no such file" in problems[0]
    assert "no heading with anchor #bees" in problems[1]
    assert "outside the repository" in problems[2]


def test_github_slug_rule() -> None:
    assert github_slug("The model as a graph: `paratrain graph`") == "the-model-as-a-graph-paratrain-graph"
    assert github_slug("`memory_optimization`") == "memory_optimization"
    assert github_slug("ZeRO: `shard`") == "zero-shard"
    assert github_slug("Pipeline x data parallel x tensor parallelism") == \
        "pipeline-x-data-parallel-x-tensor-parallelism"


# ------------------------------------------------------------------- files they name


def test_every_repository_file_named_exists() -> None:
    """``examples/...``, ``tests/...``, ``benchmarks/...`` and ``src/...`` paths, in prose or
    code; a ``*`` in a name is a glob that must match something."""
    pattern = re.compile(r"(?<![\w./-])((?:examples|tests|benchmarks|src)/[\w.*/-]*\w/?)")
    missing = []
    for page in PAGES:
        for name in set(pattern.findall(page.read_text(encoding="utf-8"))):
            found = list(ROOT.glob(name)) if "*" in name else [ROOT / name]
            if not found or not all(p.exists() for p in found):
                missing.append(f"{page.name}: {name}")
    assert not missing, "\n".join(sorted(missing))


# -------------------------------------------------------------------------- commands


def _commands(page: Path) -> list[list[str]]:
    """The ``paratrain`` command lines of a page's code blocks, as argument lists without the
    program (``.venv/bin/paratrain`` or a ``$`` prompt before it; a comment or ``>`` ends it)."""
    out = []
    for _, lines in _code_blocks(page.read_text(encoding="utf-8")):
        for line in lines:
            if COMMAND.match(line):
                args = shlex.split(line.removeprefix("$ "), comments=True)[1:]
                out.append(args[:args.index(">")] if ">" in args else args)
    return out


def _run_name(job: str) -> str:
    return str(tomllib.loads((ROOT / job).read_text(encoding="utf-8"))["run"]["name"])


ALL_COMMANDS = [(page.name, args) for page in PAGES for args in _commands(page)]


def test_the_readme_tour_shows_commands() -> None:
    verbs = {args[0] for name, args in ALL_COMMANDS if name == "README.md"}
    assert {"validate", "run", "graph", "export"} <= verbs, verbs


@pytest.mark.parametrize("page,args", ALL_COMMANDS, ids=[" ".join(a) for _, a in ALL_COMMANDS])
def test_each_command_parses_as_written(page: str, args: list[str]) -> None:
    try:
        build_parser().parse_args([PLACEHOLDERS.get(a, a) for a in args])
    except SystemExit as e:  # argparse's way of refusing
        pytest.fail(f"{page}: paratrain {' '.join(args)}: exit {e.code}")


def test_named_example_jobs_validate() -> None:
    """One ``paratrain validate`` over every example job a command names (placeholder job
    files such as ``job.toml`` are not examples)."""
    jobs = sorted({a for _, args in ALL_COMMANDS if args[0] in ("run", "validate", "graph")
                   for a in args[1:] if a.startswith("examples/")})
    assert "examples/local_digits.toml" in jobs, jobs
    proc = subprocess.run([str(PARATRAIN), "validate", *jobs], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _runs_made(page: str) -> set[str]:
    """``runs/<run.name>`` of every example job a page's ``paratrain run`` commands name."""
    return {f"runs/{_run_name(args[1])}" for name, args in ALL_COMMANDS
            if name == page and args[0] == "run" and args[1].startswith("examples/")}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_exports_read_runs_the_commands_create(page: Path) -> None:
    """``paratrain export runs/<name>`` and ``paratrain.load_model("runs/<name>")`` name the
    folder of a job the page (or the README) runs: ``runs/`` + that job's ``run.name``."""
    made = _runs_made(page.name) | _runs_made(README.name)
    read = [args[1] for name, args in ALL_COMMANDS if name == page.name and args[0] == "export"]
    read += re.findall(r"load_model\(\"([^\"]+)\"\)", page.read_text(encoding="utf-8"))
    if page == README:
        assert read, "the README shows no export"
    stray = [r for r in read if r.rstrip("/") not in made]
    assert not stray, f"{page.name}: read but never created by its commands: {stray} (created: {made})"


@pytest.mark.parametrize("sub", ["run", "validate", "graph", "export", "schema"])
def test_each_subcommand_answers_help(sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([sub, "--help"])
    assert e.value.code == 0 and f"usage: paratrain {sub}" in capsys.readouterr().out


def test_the_installed_command_answers_help() -> None:
    proc = subprocess.run([str(PARATRAIN), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: paratrain" in proc.stdout, proc.stderr
