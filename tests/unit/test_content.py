"""The content store on real files: trees deeper than Python's recursion limit, entries that cannot
be removed (made immutable with chattr), and blob writes whose commit fails."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from auraed.images.content import (
    OPAQUE_XATTR,
    SHARED_MARKS,
    SHARED_OPAQUE_XATTR,
    LocalStore,
    remove_tree,
    tree_size,
)

DEPTH = sys.getrecursionlimit() + 100  # more than a recursive walk can go through


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_deep_tree(top: Path, depth: int = DEPTH) -> int:
    """``top`` with ``depth`` nested directories and a file at the bottom, built by fd (the path
    is far longer than PATH_MAX); the bytes of its files."""
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        file = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(file, b"bottom")
        os.close(file)
    finally:
        os.close(fd)
    return len(b"bottom")


@pytest.fixture
def make_immutable() -> Iterator[Callable[[Path], None]]:
    """chattr +i: not even root can remove the file then; undone after the test."""
    made: list[Path] = []

    def make(path: Path) -> None:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_deep_trees_are_measured_and_removed_without_following_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    tree = tmp_path / "tree"
    size = make_deep_tree(tree)
    (tree / "d" / "out").symlink_to(outside)
    (tree / "d" / "d" / "out-file").symlink_to(outside / "keep")
    assert tree_size(tree) == size + len(str(outside)) + len(str(outside / "keep"))
    assert remove_tree(tree)
    assert not tree.exists()
    assert (outside / "keep").read_bytes() == b"keep"


def test_the_store_starts_past_leftovers_it_cannot_remove(
    tmp_path: Path, make_immutable: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    ingest = LocalStore(tmp_path).ingest_dir
    make_deep_tree(ingest / "snapshot-deep")
    (ingest / "snapshot-stuck").mkdir()
    (ingest / "snapshot-stuck" / "f").write_bytes(b"f")
    make_immutable(ingest / "snapshot-stuck" / "f")
    (ingest / "blob-partial").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="auraed.images.content"):
        LocalStore(tmp_path)  # as the daemon does at every start
    assert [p.name for p in ingest.iterdir()] == ["snapshot-stuck"]
    assert "cannot remove" in caplog.text and "snapshot-stuck" in caplog.text


def test_collect_carries_on_past_what_it_cannot_remove(
    tmp_path: Path, make_immutable: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalStore(tmp_path)
    kept, stuck, freed = b"kept blob", b"stuck blob", b"freed blob"
    for data in (kept, stuck, freed):
        store.write_blob(sha256(data), data)
    make_immutable(store.blob_path(sha256(stuck)))
    keep_snapshot, deep, stuck_snapshot, plain = (f"sha256:{c * 64}" for c in "1234")
    store.snapshot_path(keep_snapshot).mkdir()
    deep_size = make_deep_tree(store.snapshot_path(deep))
    store.snapshot_path(stuck_snapshot).mkdir()
    (store.snapshot_path(stuck_snapshot) / "f").write_bytes(b"f")
    make_immutable(store.snapshot_path(stuck_snapshot) / "f")
    store.snapshot_path(plain).mkdir()
    (store.snapshot_path(plain) / "f").write_bytes(b"plain")
    with caplog.at_level(logging.WARNING, logger="auraed.images.content"):
        assert store.collect_blobs({sha256(kept)}) + store.collect_snapshots({keep_snapshot}) == len(
            freed
        ) + deep_size + len(b"plain")
    assert sorted(store.blob_digests()) == sorted([sha256(kept), sha256(stuck)])
    assert sorted(store.snapshot_ids()) == [keep_snapshot, stuck_snapshot]
    assert caplog.text.count("cannot remove") == 2


def test_a_blob_whose_commit_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    data = b"blob"
    (store.blob_path(sha256(data)) / "in-the-way").mkdir(parents=True)  # the rename onto it fails
    with pytest.raises(IsADirectoryError):
        store.write_blob(sha256(data), data)
    assert list(store.ingest_dir.iterdir()) == []


# A layer's worth of file data: far above the few MiB other processes keep dirty, far below the
# kernel's own writeback threshold (10 % of memory), so only a flush writes it out within a test.
LAYER_BYTES = 64 << 20
FLUSHED_AT_LEAST = LAYER_BYTES // 2


def _dirty_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Dirty: in /proc/meminfo")


def _unpacked_layer(store: LocalStore) -> Path:
    work = store.new_snapshot_dir()
    chunk = os.urandom(1 << 20)
    for index in range(LAYER_BYTES // len(chunk)):
        (work / f"file{index}").write_bytes(chunk)
    return work


@pytest.mark.parametrize("sync_fs", [True, False])
def test_a_snapshot_is_on_disk_before_it_is_published(tmp_path: Path, sync_fs: bool) -> None:
    """A published snapshot is trusted for good: with sync_fs its data is flushed before the
    rename, so no power loss can leave it with empty files. Measured by the kernel's dirty pages
    (on the disk the store is on, not a tmpfs)."""
    root = Path(tempfile.mkdtemp(prefix="aurae-sync-", dir="/var/tmp"))
    try:
        store = LocalStore(root, sync_fs=sync_fs)
        # Another process's sync (a test's, a build's) may write the layer back before it is
        # measured: that says nothing of the store, so the layer is written again, a few times.
        for _ in range(3):
            work = _unpacked_layer(store)
            before = _dirty_bytes()
            if before >= FLUSHED_AT_LEAST:
                break
            shutil.rmtree(work)
        assert before >= FLUSHED_AT_LEAST, "the layer's data should still be in the page cache"
        store.commit_snapshot(work, "sha256:" + "ab" * 32)
        flushed = before - _dirty_bytes()
        assert (flushed >= FLUSHED_AT_LEAST) is sync_fs, f"{flushed} bytes flushed"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_store_from_before_the_shared_mark_gets_it_once(tmp_path: Path) -> None:
    """Snapshots unpacked before virtio-fs guests read them carry only trusted.overlay.opaque:
    the store marks each opaque directory for them at its first start (and only then)."""
    root = tmp_path / "images"
    opaque = root / "snapshots" / ("a" * 64) / "etc" / "hidden"
    plain = root / "snapshots" / ("a" * 64) / "etc"
    opaque.mkdir(parents=True)
    os.setxattr(opaque, OPAQUE_XATTR, b"y")
    os.symlink("/", root / "snapshots" / ("a" * 64) / "escape")  # never followed
    LocalStore(root)
    assert os.getxattr(opaque, SHARED_OPAQUE_XATTR) == b"y"
    assert SHARED_OPAQUE_XATTR not in os.listxattr(plain)
    assert (root / SHARED_MARKS).exists()
    os.removexattr(opaque, SHARED_OPAQUE_XATTR)
    LocalStore(root)  # marked once: a later start walks nothing
    assert SHARED_OPAQUE_XATTR not in os.listxattr(opaque)
