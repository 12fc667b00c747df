"""CopyFile's writer on a real filesystem: validation, atomic replacement, symlinks, limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from auraed.containers.errors import ContainerError
from auraed.containers.files import CopiedFiles, file_spec
from auraed.errors import ErrorKind


def test_bad_paths_modes_and_ids_are_refused_by_name() -> None:
    for path in ("", "/etc/passwd", "a/../../b", "..", ".", "a/\0b", "x/.copy-123", "a" * 5000):
        with pytest.raises(ContainerError) as refused:
            file_spec(path, 0, None, None)
        assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and "path" in refused.value.message
    with pytest.raises(ContainerError, match="mode"):
        file_spec("f", 0o10000, None, None)
    with pytest.raises(ContainerError, match="uid"):
        file_spec("f", 0, 2**32 - 1, None)
    spec = file_spec("./pods//p1/resolv.conf", 0, None, None)
    assert (spec.parts, spec.mode) == (("pods", "p1", "resolv.conf"), 0o644)


def test_a_file_is_written_whole_then_replaces_the_old_one(tmp_path: Path) -> None:
    files = CopiedFiles(tmp_path / "files", 1024)
    first = files.open(file_spec("pods/p1/hosts", 0o600, None, None))
    first.write(b"127.0.0.1 localhost\n")
    assert not first.path.exists()  # nothing where readers look until it is whole
    first.commit()
    assert first.path.read_bytes() == b"127.0.0.1 localhost\n"
    assert first.path.stat().st_mode & 0o7777 == 0o600
    assert (tmp_path / "files" / "pods").stat().st_mode & 0o777 == 0o755
    second = files.open(file_spec("pods/p1/hosts", 0, None, None))
    second.write(b"new\n")
    assert first.path.read_bytes() == b"127.0.0.1 localhost\n"
    second.commit()
    assert first.path.read_bytes() == b"new\n"
    assert os.listdir(first.path.parent) == ["hosts"]  # no temporary file left


def test_an_aborted_or_oversized_file_leaves_nothing(tmp_path: Path) -> None:
    files = CopiedFiles(tmp_path, 8)
    pending = files.open(file_spec("big", 0, None, None))
    pending.write(b"12345678")
    with pytest.raises(ContainerError) as refused:
        pending.write(b"9")
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and "8 bytes" in refused.value.message
    pending.abort()
    pending.abort()  # idempotent
    assert os.listdir(tmp_path) == []


def test_a_symlink_in_the_path_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "files"
    root.mkdir()
    (root / "pods").symlink_to(outside)
    with pytest.raises(ContainerError) as refused:
        CopiedFiles(root, 1024).open(file_spec("pods/p1/x", 0, None, None))
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and "not a directory" in refused.value.message
    (root / "link").symlink_to(outside / "target")
    pending = CopiedFiles(root, 1024).open(file_spec("link", 0, None, None))
    pending.write(b"data")
    pending.commit()  # the symlink itself is replaced, its target never written
    assert not (outside / "target").exists() and os.listdir(outside) == []
    assert (root / "link").read_bytes() == b"data" and not (root / "link").is_symlink()


def test_a_directory_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("x")
    pending = CopiedFiles(tmp_path, 1024).open(file_spec("d", 0, None, None))
    with pytest.raises(ContainerError, match="is a directory"):
        pending.commit()
    assert sorted(os.listdir(tmp_path)) == ["d"]
