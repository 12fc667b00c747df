"""The content store: blobs by digest and unpacked layer snapshots, both written atomically.

Layout under the store root:
    blobs/sha256/<hex>        verified blobs, read-only
    snapshots/<hex>/          one unpacked layer (keyed by its diff_id), shared by every image
    ingest/                   partial downloads and unpacks; emptied at start

Nothing becomes visible under blobs/ or snapshots/ before it is complete and verified (temp +
rename), so a crash or kill mid-pull corrupts nothing, and a retry starts from what is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from auraed.errors import ErrorKind
from auraed.images.errors import ImageError

DIGEST_ALGORITHM = "sha256"
HEX_LENGTH = 64


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


class BlobWriter:
    """Writes one blob to the ingest area while hashing it; ``commit`` verifies and publishes it."""

    def __init__(self, store: ContentStore, digest: str, size: int | None) -> None:
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


class ContentStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs_dir = root / "blobs" / DIGEST_ALGORITHM
        self.snapshots_dir = root / "snapshots"
        self.ingest_dir = root / "ingest"
        for directory in (self.blobs_dir, self.snapshots_dir, self.ingest_dir):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Leftovers of an interrupted pull: never valid, always safe to drop.
        for leftover in self.ingest_dir.iterdir():
            remove_tree(leftover)

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
        except BaseException:
            writer.abort()
            raise
        return writer.commit()

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
        target = self.snapshot_path(diff_id)
        try:
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

    def collect(self, keep_blobs: set[str], keep_snapshots: set[str]) -> int:
        """Remove every blob and snapshot not kept; the bytes freed."""
        freed = 0
        for digest in list(self.blob_digests()):
            if digest not in keep_blobs:
                path = self.blob_path(digest)
                freed += path.stat().st_size
                path.unlink()
        for diff_id in list(self.snapshot_ids()):
            if diff_id not in keep_snapshots:
                freed += tree_size(self.snapshot_path(diff_id))
                remove_tree(self.snapshot_path(diff_id))
        return freed


def tree_size(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def remove_tree(path: Path) -> None:
    """rmtree that also copes with read-only dirs and files that unpacked layers contain."""

    def make_writable_and_retry(function: object, target: str, exc_info: object) -> None:
        del exc_info
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
        with contextlib.suppress(OSError):
            if callable(function):
                function(target)

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=make_writable_and_retry)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
