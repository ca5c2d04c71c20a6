"""Atomic, versioned JSON files: concurrent and failing writes."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from profiler import jsonfile
from profiler.jsonfile import read_json, write_json

WRITES = 40


def _payload(writer: int, i: int) -> dict[str, object]:
    # Large enough that a write takes several system calls.
    return {"writer": writer, "i": i, "data": [writer] * 100_000}


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    write_json(path, "profile", {"a": 1})
    assert read_json(path, "profile") == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_concurrent_writers_leave_one_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer(n: int) -> None:
        start.wait()
        try:
            for i in range(WRITES):
                write_json(path, "plan", _payload(n, i))
        except BaseException as exc:  # collected: the test fails on any
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    data = read_json(path, "plan")
    assert data["i"] == WRITES - 1
    assert data == _payload(data["writer"], WRITES - 1)
    assert os.listdir(tmp_path) == ["plan.json"]


def test_failed_write_keeps_old_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "profile.json"
    write_json(path, "profile", {"old": True})

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonfile.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, "profile", {"old": False})
    assert read_json(path, "profile") == {"old": True}
    assert os.listdir(tmp_path) == ["profile.json"]


def test_unserializable_data_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_json(path, "profile", {"old": True})
    with pytest.raises(TypeError):
        write_json(path, "profile", {"bad": object()})
    assert read_json(path, "profile") == {"old": True}
    assert os.listdir(tmp_path) == ["profile.json"]


def test_another_writers_temporary_file_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    theirs = tmp_path / "profile.json.tmp"
    theirs.write_text("another writer's text")
    write_json(path, "profile", {"a": 1})
    assert theirs.read_text() == "another writer's text"
    assert read_json(path, "profile") == {"a": 1}


def test_written_file_has_the_umask_mode(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    old = os.umask(0o027)
    try:
        write_json(path, "profile", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_read_refuses_non_utf8_text(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(b'{"kind": "profile", "name": "\xff"}')
    with pytest.raises(ValueError, match="is not UTF-8 text; is it an autopipe profile"):
        read_json(path, "profile")


def test_read_refuses_other_kinds(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"kind": "plan"}))
    with pytest.raises(ValueError, match="not an autopipe profile file"):
        read_json(path, "profile")


def test_unwritable_place_names_the_target(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "profile.json"
    with pytest.raises(OSError) as caught:
        write_json(target, "profile", {"a": 1})
    assert str(caught.value).startswith(f"cannot write profile file {target}: ")
    assert ".tmp" not in str(caught.value)


def test_temporary_file_of_a_killed_write_is_swept(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    stale = tmp_path / ".plan.json.abc123.tmp"
    fresh = tmp_path / ".plan.json.def456.tmp"  # perhaps a concurrent writer's
    stale.write_text("{")
    fresh.write_text("{")
    old = stale.stat().st_mtime - 2 * jsonfile._STALE_SECONDS
    os.utime(stale, (old, old))
    write_json(target, "plan", {"a": 1})
    assert not stale.exists() and fresh.exists()
    assert read_json(target, "plan") == {"a": 1}
