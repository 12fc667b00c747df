"""Single files written onto this machine by RPC: ContainerService.CopyFile, the Kata agent's
copy_file, for files a container mounts (resolv.conf, hosts, a secret) where no share is set up.

Every file lands below one directory (``<state dir>/files``). The path a caller names is split
into components, none of them ``..``; each parent is opened from the directory's fd with
O_NOFOLLOW (made 0755 if missing), so a symlink a container planted in a bind-mounted part of
the tree can never send a write elsewhere. The content goes to a new temporary file beside the
target, is flushed, and is renamed over it: a reader sees the old file or the new one whole,
never a part, and a call cut short leaves only its temporary file's removal to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
from pathlib import Path

from auraed.containers.errors import ContainerError
from auraed.errors import ErrorKind

DEFAULT_MODE = 0o644
DIRECTORY_MODE = 0o755
MAX_PATH = 4096
MAX_DEPTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_PREFIX = ".copy-"


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """Where and how a copied file is written (validated from the request)."""

    parts: tuple[str, ...]
    mode: int = DEFAULT_MODE
    uid: int | None = None
    gid: int | None = None


def file_spec(path: str, mode: int, uid: int | None, gid: int | None) -> FileSpec:
    """The request's path and mode as a FileSpec; INVALID_ARGUMENT naming what is wrong."""
    if not path or len(path) > MAX_PATH or "\0" in path or path.startswith("/"):
        raise ContainerError.invalid("path", "must be a relative path below the files directory")
    parts = tuple(part for part in path.split("/") if part not in ("", "."))
    if not parts or ".." in parts or len(parts) > MAX_DEPTH:
        raise ContainerError.invalid(
            "path", f"{path!r} must name a file below the files directory, without '..'"
        )
    if parts[-1].startswith(_TEMP_PREFIX):
        raise ContainerError.invalid("path", f"names starting with {_TEMP_PREFIX!r} are the writer's own")
    if mode & ~0o7777:
        raise ContainerError.invalid("mode", "must be permission bits (at most 0o7777)")
    for value, field in ((uid, "uid"), (gid, "gid")):
        if value is not None and not 0 <= value < 2**32 - 1:
            raise ContainerError.invalid(field, "is out of range")
    return FileSpec(parts, mode or DEFAULT_MODE, uid, gid)


def file_error(exc: OSError, path: Path) -> ContainerError:
    """An OSError writing a copied file as the error vocabulary has it: a full disk is
    RESOURCE_EXHAUSTED, the rest INTERNAL, the path named."""
    kind = ErrorKind.RESOURCE_EXHAUSTED if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ErrorKind.INTERNAL
    return ContainerError(kind, f"writing {path}: {exc.strerror or exc}")


class PendingFile:
    """A copied file being written: ``write`` its chunks, then ``commit`` (or ``abort``)."""

    def __init__(self, root: Path, spec: FileSpec, limit: int) -> None:
        self.path = root.joinpath(*spec.parts)
        self.size = 0
        self._limit = limit
        self._name = spec.parts[-1]
        self._temp = f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
        self._dir = _open_parents(root, spec.parts[:-1])
        try:
            self._fd = os.open(
                self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                dir_fd=self._dir,
            )  # fmt: skip
            try:
                if spec.uid is not None or spec.gid is not None:
                    os.fchown(
                        self._fd, -1 if spec.uid is None else spec.uid, -1 if spec.gid is None else spec.gid
                    )
                os.fchmod(self._fd, spec.mode)  # after fchown, which clears set-id bits
            except BaseException:
                os.close(self._fd)
                os.unlink(self._temp, dir_fd=self._dir)
                raise
        except BaseException:
            os.close(self._dir)
            raise

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self._limit:
            raise ContainerError.invalid("data", f"the file is larger than the limit of {self._limit} bytes")
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self.size += len(data)

    def commit(self) -> None:
        """Flush the file and put it in place of any file of that name, atomically."""
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        try:
            os.rename(self._temp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except IsADirectoryError:
            raise ContainerError.invalid("path", f"{self.path} is a directory") from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Remove the temporary file (if still there) and let go of the directory."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dir >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temp, dir_fd=self._dir)
            os.close(self._dir)
            self._dir = -1


def _open_parents(root: Path, parts: tuple[str, ...]) -> int:
    """An fd of the directory ``root/parts``, made where missing, every step without following
    a symlink; INVALID_ARGUMENT when a component is a symlink or not a directory."""
    root.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the daemon's own directory is trusted
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, DIRECTORY_MODE, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a symlink, or a file
                    raise ContainerError.invalid("path", f"{part!r} is not a directory") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


class CopiedFiles:
    """The files directory and its size limit: where CopyFile writes."""

    def __init__(self, root: Path, limit_bytes: int) -> None:
        self.root = root
        self.limit_bytes = limit_bytes

    def open(self, spec: FileSpec) -> PendingFile:
        try:
            return PendingFile(self.root, spec, self.limit_bytes)
        except OSError as exc:
            raise file_error(exc, self.root.joinpath(*spec.parts)) from None
