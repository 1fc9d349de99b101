"""A SuperNode's clients' state files (executors/federated/flower/node_state.py): what a
message with an empty Flower context reads back, and what each save keeps."""

from __future__ import annotations

from pathlib import Path

from paratrain.executors.federated.flower.node_state import NodeStateFiles


def _rounds(f: NodeStateFiles) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in f.dir.glob("round-*.bin"))


def test_load_is_the_newest_state_at_or_below_the_round(tmp_path: Path) -> None:
    f = NodeStateFiles(tmp_path, "job", "aa", 1, 2)
    assert f.load(5) is None
    f.save(2, b"two", keep_from=0)
    f.save(4, b"four", keep_from=0)  # not trained in round 2: no file for 3
    assert f.load(1) is None and f.load(2) == b"two" and f.load(3) == b"two"
    assert f.load(4) == f.load(9) == b"four"


def test_save_keeps_what_the_servers_checkpoints_may_need(tmp_path: Path) -> None:
    f = NodeStateFiles(tmp_path, "job", "aa", 0, 2)
    for k in range(1, 8):
        f.save(k, str(k).encode(), keep_from=k - 2)
    # the server keeps steps 5 and 6: a resume restarts at 5 at the earliest
    assert _rounds(f) == [5, 6, 7]
    f.save(8, b"8", keep_from=7)
    assert _rounds(f) == [7, 8]
    # the server resumed from step 6 (7's checkpoint damaged): the state entering 8 was
    # written by the abandoned timeline, and writing 7 again drops it
    f.save(7, b"seven", keep_from=6)
    assert _rounds(f) == [7] and f.load(8) == b"seven"
    assert not list(f.dir.glob(".round-*"))  # no temp file left


def test_a_new_lineage_of_the_same_job_removes_the_old_ones(tmp_path: Path) -> None:
    old = NodeStateFiles(tmp_path, "job", "old", 0, 2)
    old.save(1, b"old", keep_from=0)
    other = NodeStateFiles(tmp_path, "other-job", "x", 0, 2)
    other.save(1, b"other", keep_from=0)
    new = NodeStateFiles(tmp_path, "job", "new", 0, 2)
    assert new.load(5) is None  # never an older run's state
    new.save(1, b"new", keep_from=0)
    assert not old.dir.exists() and other.load(1) == b"other" and new.load(1) == b"new"


def test_odd_names_stay_inside_the_state_dir(tmp_path: Path) -> None:
    for job, lineage in (("../../etc", "../x"), ("..", "."), ("", "")):
        f = NodeStateFiles(tmp_path / "s", job, lineage, 0, 1)
        f.save(1, b"s", keep_from=0)
        assert (tmp_path / "s").resolve() in f.dir.resolve().parents and f.load(1) == b"s"


def test_a_killed_servers_late_save_changes_nothing(tmp_path: Path) -> None:
    """The server was killed while a node trained its round 3 and resumed (attempt 1); that
    message finishes after the resumed run saved the state entering round 5: it must not
    remove it (a later resume at 5 would read round 4's state)."""
    f = NodeStateFiles(tmp_path, "job", "aa", 0, 2)
    f.save(3, b"3", keep_from=0)
    f.save(4, b"4", keep_from=2, attempt=1)
    f.save(5, b"5", keep_from=2, attempt=1)
    f.save(4, b"old 4", keep_from=2, attempt=0)  # the killed server's message, late
    assert _rounds(f) == [3, 4, 5] and f.load(5) == b"5" and f.load(4) == b"4"
    f.save(4, b"again 4", keep_from=2, attempt=2)  # a second resume, at 4: its timeline wins
    assert _rounds(f) == [3, 4] and f.load(9) == b"again 4"
