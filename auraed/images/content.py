"""The content store: blobs by digest and unpacked layer snapshots, both written atomically.

Two interfaces, as containerd splits its content store from its snapshotter: :class:`ContentStore`
(blobs) and :class:`LayerSnapshots` (layers unpacked, by diff_id). :class:`LocalStore` is both, in
directories; a container's root filesystem is made over the snapshots by a snapshotter of the
containers subsystem (auraed.containers.rootfs).

Layout under the local store's root:
    blobs/sha256/<hex>        verified blobs, read-only
    snapshots/<hex>/          one unpacked layer (keyed by its diff_id), shared by every image
    ingest/                   partial downloads and unpacks; emptied at start
    shared-opaque             there once every snapshot's opaque directories carry the mark a
                              guest reads through virtiofsd (SHARED_OPAQUE_XATTR)

A snapshot is an overlayfs lower layer as the host's kernel reads it (whiteouts as 0:0 character
devices, opaque directories marked ``trusted.overlay.opaque``) and as a vm pod's guest reads it
through the pod's virtio-fs share: virtiofsd, which cannot read trusted.* xattrs (that takes
CAP_SYS_ADMIN, not given to it), maps a guest's ``trusted.X`` to the host's
``user.virtiofs.trusted.X`` (auraed.vms.qemu), so each opaque directory carries that too. A store
from before the second mark gets it once, at start.

Nothing becomes visible under blobs/ or snapshots/ before it is complete and verified (temp +
rename), so a crash or kill mid-pull corrupts nothing, and a retry starts from what is there.

Trees (snapshots, unpacks under way) are walked by ``_bottom_up``, one walk for removing and
measuring them: iterative and fd based, since a layer or a container can make them deeper than
Python's recursion limit, and removing them is what keeps the store working.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from auraed.errors import ErrorKind
from auraed.images.errors import ImageError

log = logging.getLogger(__name__)

OPAQUE_XATTR = "trusted.overlay.opaque"
SHARED_XATTR_PREFIX = "user.virtiofs."
"""Where a snapshot keeps the trusted.* xattrs a guest reads through virtiofsd: its mapping
(auraed.vms.qemu) turns a guest's ``trusted.X`` into the host's ``user.virtiofs.trusted.X``."""
SHARED_OPAQUE_XATTR = SHARED_XATTR_PREFIX + OPAQUE_XATTR
SHARED_MARKS = "shared-opaque"
_UNMARKABLE_ERRNOS = {errno.ENOTSUP, errno.EPERM}  # a filesystem without user.* xattrs
DIGEST_ALGORITHM = "sha256"
HEX_LENGTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def split_digest(digest: str) -> str:
    """The hex part of a sha256 digest; anything else is refused (digests name files)."""
    algorithm, _, hex_part = digest.partition(":")
    if (
        algorithm != DIGEST_ALGORITHM
        or len(hex_part) != HEX_LENGTH
        or not all(c in "0123456789abcdef" for c in hex_part)
    ):
        raise ImageError(ErrorKind.INVALID_ARGUMENT, f"{digest[:100]!r} is not a sha256 digest")
    return hex_part


class BlobIngest(Protocol):
    """One blob being written: ``commit`` verifies it (digest and size) and publishes it, ``abort``
    drops what was written."""

    @property
    def digest(self) -> str: ...

    def write(self, data: bytes) -> None: ...

    def commit(self) -> Path: ...

    def abort(self) -> None: ...


class ContentStore(Protocol):
    """Blobs by digest (sha256), each verified before it can be seen."""

    def blob_path(self, digest: str) -> Path:
        """Where the blob is (or would be) stored: a read-only file."""
        ...

    def has_blob(self, digest: str) -> bool: ...

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The digests not stored, each once, in order."""
        ...

    def writer(self, digest: str, size: int | None) -> BlobIngest: ...

    def write_blob(self, digest: str, data: bytes) -> Path: ...

    def read_blob(self, digest: str, limit: int) -> bytes:
        """The blob's bytes; one larger than ``limit`` is refused."""
        ...

    def blob_digests(self) -> Iterator[str]: ...

    def collect_blobs(self, keep: set[str]) -> int:
        """Remove every blob not kept; the bytes freed."""
        ...


class LayerSnapshots(Protocol):
    """Image layers unpacked, one directory each, keyed by the layer's diff_id and shared by every
    image that has it; published whole or not at all."""

    def snapshot_path(self, diff_id: str) -> Path: ...

    def has_snapshot(self, diff_id: str) -> bool: ...

    def new_snapshot_dir(self) -> Path:
        """An empty directory to unpack a layer into, for :meth:`commit_snapshot`."""
        ...

    def commit_snapshot(self, work_dir: Path, diff_id: str) -> Path:
        """Publish an unpacked layer as the snapshot of ``diff_id``."""
        ...

    def snapshot_ids(self) -> Iterator[str]: ...

    def collect_snapshots(self, keep: set[str]) -> int:
        """Remove every snapshot not kept; the bytes freed."""
        ...


class BlobWriter:
    """Writes one blob to the ingest area while hashing it; ``commit`` verifies and publishes it."""

    def __init__(self, store: LocalStore, digest: str, size: int | None) -> None:
        self._store = store
        self.digest = digest
        self.expected_size = size
        self._hash = hashlib.sha256()
        self.written = 0
        self._path = store.ingest_dir / f"blob-{split_digest(digest)[:16]}-{uuid.uuid4().hex[:8]}"
        self._file: BinaryIO = self._path.open("xb")

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.written += len(data)
        if self.expected_size is not None and self.written > self.expected_size:
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION,
                f"blob {self.digest} is larger than its declared {self.expected_size} bytes",
            )

    def commit(self) -> Path:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        actual = f"{DIGEST_ALGORITHM}:{self._hash.hexdigest()}"
        if actual != self.digest:
            self.abort()
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION, f"blob {self.digest} arrived as {actual}: refused"
            )
        if self.expected_size is not None and self.written != self.expected_size:
            self.abort()
            raise ImageError(
                ErrorKind.FAILED_PRECONDITION,
                f"blob {self.digest} is {self.written} bytes, not the declared {self.expected_size}",
            )
        target = self._store.blob_path(self.digest)
        self._path.chmod(0o444)
        os.replace(self._path, target)
        return target

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


def sync_filesystem(path: Path) -> None:
    """syncfs(2) on the filesystem holding ``path``."""
    from auraed.system.namespaces import syncfs  # here: only a pull that unpacks needs it

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        syncfs(fd)
    finally:
        os.close(fd)


class LocalStore:
    """Blobs and layer snapshots in directories under ``root`` (a ContentStore and LayerSnapshots)."""

    def __init__(self, root: Path, sync_fs: bool = True) -> None:
        self.root = root
        # Whether a snapshot is flushed to disk before it is published (commit_snapshot).
        self.sync_fs = sync_fs
        self.blobs_dir = root / "blobs" / DIGEST_ALGORITHM
        self.snapshots_dir = root / "snapshots"
        self.ingest_dir = root / "ingest"
        for directory in (self.blobs_dir, self.snapshots_dir, self.ingest_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Leftovers of an interrupted pull: never valid, always safe to drop. One that cannot be
        # removed is logged and left (remove_tree): it must not keep the daemon from starting.
        for leftover in self.ingest_dir.iterdir():
            remove_tree(leftover)
        if not (root / SHARED_MARKS).exists():
            mark_shared_snapshots(self.snapshots_dir)
            (root / SHARED_MARKS).touch()

    # -- blobs -----------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / split_digest(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [d for d in dict.fromkeys(digests) if not self.has_blob(d)]

    def writer(self, digest: str, size: int | None) -> BlobWriter:
        return BlobWriter(self, digest, size)

    def write_blob(self, digest: str, data: bytes) -> Path:
        writer = self.writer(digest, len(data))
        try:
            writer.write(data)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise

    def read_blob(self, digest: str, limit: int) -> bytes:
        path = self.blob_path(digest)
        if path.stat().st_size > limit:
            raise ImageError(ErrorKind.FAILED_PRECONDITION, f"blob {digest} is larger than {limit} bytes")
        return path.read_bytes()

    def blob_digests(self) -> Iterator[str]:
        for path in self.blobs_dir.iterdir():
            yield f"{DIGEST_ALGORITHM}:{path.name}"

    # -- snapshots -------------------------------------------------------------------------

    def snapshot_path(self, diff_id: str) -> Path:
        return self.snapshots_dir / split_digest(diff_id)

    def has_snapshot(self, diff_id: str) -> bool:
        return self.snapshot_path(diff_id).is_dir()

    def new_snapshot_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="snapshot-", dir=self.ingest_dir))

    def commit_snapshot(self, work_dir: Path, diff_id: str) -> Path:
        """Publish an unpacked layer as the snapshot of ``diff_id``.

        With ``sync_fs``, its filesystem is flushed first (one syncfs(2), not an fsync per file):
        a snapshot, once there, is trusted and never unpacked again, so one published with its
        data still in the page cache would after a power loss hold empty files for good.
        """
        target = self.snapshot_path(diff_id)
        try:
            if self.sync_fs:
                sync_filesystem(work_dir)
            os.rename(work_dir, target)
        except OSError:
            # Another pull unpacked the same layer first: keep theirs. Or ours cannot be placed:
            # nothing half-made stays behind either way.
            remove_tree(work_dir)
            if not target.is_dir():
                raise
        return target

    def snapshot_ids(self) -> Iterator[str]:
        for path in self.snapshots_dir.iterdir():
            yield f"{DIGEST_ALGORITHM}:{path.name}"

    # -- garbage collection ----------------------------------------------------------------
    # What cannot be removed is logged and left for the next collection: one stuck entry must
    # not stop the others.

    def collect_blobs(self, keep: set[str]) -> int:
        """Remove every blob not kept; the bytes freed."""
        return sum(
            _remove_blob(self.blob_path(digest)) for digest in list(self.blob_digests()) if digest not in keep
        )

    def collect_snapshots(self, keep: set[str]) -> int:
        """Remove every snapshot not kept; the bytes freed."""
        freed = 0
        for diff_id in list(self.snapshot_ids()):
            if diff_id not in keep:
                path = self.snapshot_path(diff_id)
                size = tree_size(path)
                if remove_tree(path):
                    freed += size
        return freed


def mark_shared_opaque(directory: int) -> bool:
    """The opaque directory open at ``directory`` marked as a guest reading it through virtiofsd
    sees the mark (SHARED_OPAQUE_XATTR); False when the filesystem has no user.* xattrs."""
    try:
        os.setxattr(directory, SHARED_OPAQUE_XATTR, b"y")
    except OSError as exc:
        if exc.errno not in _UNMARKABLE_ERRNOS:
            raise
        return False
    return True


def mark_shared_snapshots(snapshots_dir: Path) -> None:
    """Every opaque directory of every snapshot given SHARED_OPAQUE_XATTR (a store unpacked
    before the mark existed); walked by descriptor, following no symlink. What cannot be read or
    marked is logged: those guests then see what the directory hides."""
    unmarked = 0
    for snapshot in snapshots_dir.iterdir():
        try:
            for _, _, _, fd in os.fwalk(snapshot, follow_symlinks=False):
                with contextlib.suppress(OSError):
                    if os.getxattr(fd, OPAQUE_XATTR) and not mark_shared_opaque(fd):
                        unmarked += 1
        except OSError as exc:
            log.warning("cannot mark the opaque directories of snapshot %s: %s", snapshot.name, exc)
    if unmarked:
        log.warning(
            "%d opaque directories of layer snapshots cannot carry %s (no user.* xattrs here): "
            "vm pods' guests see what they hide",
            unmarked,
            SHARED_OPAQUE_XATTR,
        )


def _remove_blob(path: Path) -> int:
    """The bytes freed by removing the blob at ``path``; 0, logged, if it cannot be removed."""
    try:
        size = path.stat().st_size
        path.unlink()
    except OSError as exc:
        log.warning("cannot remove blob %s: %s", path, exc)
        return 0
    return size


def tree_size(root: Path) -> int:
    """The bytes of everything below ``root`` but directories; what cannot be read counts 0."""
    total = 0

    def count(dir_fd: int, name: str, is_dir: bool) -> None:
        nonlocal total
        if not is_dir:
            with contextlib.suppress(OSError):
                total += os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size

    with contextlib.suppress(OSError):
        fd = os.open(root, _DIR_FLAGS)
        try:
            _bottom_up(fd, count)
        finally:
            os.close(fd)
    return total


def remove_tree(path: Path) -> bool:
    """Remove ``path`` and everything below it, never following a symlink; whether it is gone.

    Best effort: what cannot be removed is logged and left (callers clean up after failures,
    or at start, and must not fail themselves because of it).
    """
    try:
        remove_at(path)
    except OSError as exc:
        if os.path.lexists(path):
            log.warning("cannot remove %s: %s", path, exc)
            return False
    return True


def remove_at(name: str | bytes | Path, dir_fd: int | None = None) -> None:
    """Remove ``name`` (relative to the directory ``dir_fd``), a directory with everything in it.

    Never follows a symlink, ``name`` itself included. Raises OSError, FileNotFoundError when
    there is nothing to remove.
    """
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(name, dir_fd=dir_fd)  # not a directory (a symlink to one is not)
        return
    try:
        _bottom_up(fd, _remove_entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _remove_entry(dir_fd: int, name: str, is_dir: bool) -> None:
    if is_dir:
        os.rmdir(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


_Visit = Callable[[int, str, bool], None]  # (fd of the directory, name in it, is a directory)


def _bottom_up(top: int, visit: _Visit) -> None:
    """Visit everything below the directory ``top``, a directory after everything in it, so
    that ``visit`` may remove what it is given.

    Never follows a symlink. Iterative, with one directory open however deep the tree is: the
    walk climbs back through "..", checked to be the directory it came down from, so a tree
    moved meanwhile stops the walk rather than sending it elsewhere.
    """
    fd = os.open(".", _DIR_FLAGS, dir_fd=top)  # our own: the walk moves it up and down
    # for each directory above fd: the name of the one below it on the way down to fd, its
    # subdirectories still to walk, and its identity to check on the way back up
    above: list[tuple[str, list[str], tuple[int, int]]] = []
    try:
        subdirs = _visit_all_but_subdirs(fd, visit)
        while subdirs or above:
            if subdirs:
                name = subdirs.pop()
                above.append((name, subdirs, _identity(fd)))
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
                subdirs = _visit_all_but_subdirs(fd, visit)
            else:
                name, subdirs, identity = above.pop()
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                if _identity(fd) != identity:
                    raise OSError(errno.ESTALE, "the tree moved while it was walked", name)
                visit(fd, name, True)
    finally:
        os.close(fd)


def _visit_all_but_subdirs(fd: int, visit: _Visit) -> list[str]:
    """Visit what the directory ``fd`` holds but directories; the names of those."""
    with os.scandir(fd) as scan:
        entries = list(scan)  # listed first: ``visit`` may remove entries
    subdirs = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            subdirs.append(entry.name)
        else:
            visit(fd, entry.name, False)
    return subdirs


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
