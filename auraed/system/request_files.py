"""Files a request names: opened so that no path can make the daemon wait.

A kubelet names files on the host that auraed then opens: a Localhost seccomp profile, a
container's log (under a directory that a log collector's hostPath volume may also write), host
paths to mount. A FIFO there blocks ``open`` until someone opens its other end, a terminal or a
tape can do worse, and ``/dev/zero`` never ends. So such a file is opened with ``O_NONBLOCK``
(a FIFO's open returns at once), ``O_NOCTTY`` and ``O_CLOEXEC``, and must be a regular file:
checked on the path before it is opened (a device is never opened at all), and again on the
opened descriptor (the path may have been swapped in between). Links are followed, as containerd
follows them (the kubelet's seccomp directory is often a link farm managed by an operator).

What a regular file can still do is sit on a hung network or FUSE filesystem: callers run this
on a thread of their own with a deadline (auraed.system.tasks.OwnThreads), never on the event
loop's default pool that every other call shares.

Builtins only (``os``, ``stat`` which ``os`` imports anyway): the monitor opens its log with
:func:`open_regular` on its lean path (see auraed.system.monitor).
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

_SAFE_FLAGS = os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(OSError):
    """The path names something other than a regular file (a FIFO, a device, a directory...)."""

    def __init__(self, path: str | Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file")
        self.kind = kind


class FileTooLarge(OSError):
    """The file holds more than its reader takes."""

    def __init__(self, path: str | Path, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"{path} holds {size} bytes, more than the {limit} allowed")


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO")."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "a regular file" if stat.S_ISREG(mode) else "not a file"


def check_regular(path: str | Path) -> bool:
    """Whether a file is at ``path`` (links followed); NotRegularFile when it is not a regular
    one. Only a stat: nothing is opened."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(found.st_mode):
        raise NotRegularFile(path, kind_of(found.st_mode))
    return True


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file at ``path`` opened with ``flags`` (``O_CREAT`` makes a
    missing one, with ``mode``), never blocking in ``open``; NotRegularFile for anything else,
    the OSError of ``open`` otherwise (FileNotFoundError without ``O_CREAT``)."""
    check_regular(path)  # a device is refused before it is opened: opening one can act
    fd = os.open(path, flags | _SAFE_FLAGS, mode)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):  # swapped since the check
            raise NotRegularFile(path, kind_of(found.st_mode))
        # A regular file's reads and writes ignore O_NONBLOCK; clear it all the same, so that
        # whoever inherits the descriptor sees the flags it asked for.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The whole regular file at ``path``, at most ``max_bytes`` (FileTooLarge past it, known
    from its size before anything is read); see :func:`open_regular` for what is refused."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FileTooLarge(path, size, max_bytes)
        chunks = []
        total = 0
        while total <= max_bytes:  # it may grow while read: one byte past the limit tells
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise FileTooLarge(path, total, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)
