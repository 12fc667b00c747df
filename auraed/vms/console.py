"""The serial console log of a VM: its tail, a follow stream, and waiting for a marker in it.

The VMM writes the guest's serial output to a file as it comes; these helpers read it while it
grows. Lines end at "\\n"; a trailing "\\r" (the guest's tty adds one) is dropped and undecodable
bytes are replaced. A line still being written is held back until its end arrives, or until the
VMM has ended.

The log is kept to ``LOG_LIMIT`` bytes while the VMM runs (``keep_trimmed``): QEMU writes it at
its own file offset (not O_APPEND), so it cannot be truncated or rotated under it; instead the
head of the file is punched out (fallocate PUNCH_HOLE). The file keeps its apparent size, but
its disk use stays bounded, and the readers here skip the hole (SEEK_DATA). Tails are read from
the end of the file with one bounded read and lines longer than ``MAX_LINE`` are cut, so that a
guest printing one endless line costs neither the event loop nor the replies carrying tails.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.05
MAX_LINE = 64 * 1024  # a guest writing without newlines is cut into lines this long
# The most a tail reads, whatever number of lines is asked for (a log is LOG_LIMIT at most).
MAX_TAIL_BYTES = 8 * 1024 * 1024
# A tail this large is read in a worker thread, not on the event loop.
THREAD_TAIL_BYTES = 256 * 1024
# What a VM's console log keeps while its VMM runs: enough for a boot and a panic's backtrace,
# small enough for hundreds of VMs. (A candidate for a daemon setting, vm_console_log_limit.)
LOG_LIMIT = 4 * 1024 * 1024
TRIM_INTERVAL = 1.0  # seconds between checks of a running VM's log size
# What the Linux kernel prints as it powers off or reboots: the guest ended itself.
POWER_OFF_LINES = ("reboot: Power down", "reboot: Restarting system", "reboot: System halted")


def _decode(line: bytes) -> str:
    return line.rstrip(b"\r").decode(errors="replace")


def read_tail(path: Path, lines: int, max_line: int = MAX_LINE) -> list[str]:
    """The last ``lines`` complete or partial lines of the file, each cut to ``max_line`` bytes;
    empty when it does not exist.

    One read of at most ``lines * (max_line + 1)`` bytes (and ``MAX_TAIL_BYTES``) from the end,
    with the byte before it (to tell whether the window starts with a whole line).
    """
    if lines <= 0:
        return []
    window = min(lines * (max_line + 1), MAX_TAIL_BYTES)
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - window - 1)
            data_at = _data_start(f.fileno(), start)
            if data_at is None:
                return []
            f.seek(data_at)
            data = f.read(size - data_at)
    except OSError:
        return []
    if data_at > start:
        whole = False  # past a trimmed head (keep_trimmed), whose data starts within a line
    elif start > 0:
        whole, data = data[:1] == b"\n", data[1:]
    else:
        whole = True
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    if parts and not whole and len(parts[0]) < max_line:
        # The end of a line that began before the window: shown only when it is cut anyway.
        parts.pop(0)
    return [_decode(p[:max_line]) for p in parts[-lines:]]


async def read_tail_async(path: Path, lines: int, max_line: int = MAX_LINE) -> list[str]:
    """``read_tail`` for the event loop: a large tail is read in a worker thread."""
    if min(lines * (max_line + 1), MAX_TAIL_BYTES) > THREAD_TAIL_BYTES:
        return await asyncio.to_thread(read_tail, path, lines, max_line)
    return read_tail(path, lines, max_line)


def trim(path: Path, limit: int = LOG_LIMIT) -> int:
    """Punch out all but (about) the last ``limit`` bytes of the log; the bytes freed.

    Whole filesystem blocks only, so no byte that is kept reads as zero. 0 when there is nothing
    to trim, the file is gone, or its filesystem cannot punch holes (then it is left to grow).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        info = os.fstat(fd)
        end = info.st_size - limit
        end -= end % max(info.st_blksize, 1)
        start = _data_start(fd, 0)
        if start is None or end <= start:
            return 0
        from auraed.system.namespaces import punch_hole  # here: only hosts running VMs need it

        punch_hole(fd, start, end - start)
        return end - start
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        log.warning("cannot keep %s to %d bytes: its filesystem cannot punch holes", path, limit)
        return 0
    finally:
        os.close(fd)


def _data_start(fd: int, offset: int) -> int | None:
    """The first offset at or after ``offset`` holding data (past a punched hole); None at EOF."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        return offset  # a filesystem without SEEK_DATA: no holes to skip


async def keep_trimmed(path: Path, limit: int = LOG_LIMIT, interval: float = TRIM_INTERVAL) -> None:
    """Trim the log every ``interval`` seconds, until cancelled (when its VMM has ended)."""
    while True:
        await asyncio.sleep(interval)
        try:
            if _size(path) > limit:
                await asyncio.to_thread(trim, path, limit)
        except OSError as exc:
            log.warning("cannot trim %s: %s", path, exc)


def powered_off(tail: list[str]) -> bool:
    """Whether the console's tail shows the kernel powering off or rebooting."""
    return any(marker in line for line in tail[-20:] for marker in POWER_OFF_LINES)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int, limit: int = 1024 * 1024) -> tuple[bytes, int, bool]:
    """Up to ``limit`` bytes from ``offset`` or, when that was punched out, from the first data
    after it; that data's offset; whether the file shrank below ``offset`` (replaced)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < offset:
                return b"", offset, True
            start = _data_start(f.fileno(), offset)
            if start is None:
                return b"", offset, False
            f.seek(start)
            return f.read(limit), start, False
    except OSError:
        return b"", offset, False


async def follow(
    path: Path,
    *,
    tail: int | None,
    follow: bool,
    alive: Callable[[], bool],
    poll_interval: float = POLL_INTERVAL,
) -> AsyncIterator[str]:
    """Lines of the console: the last ``tail`` (all when None), then new ones while ``alive()``."""
    offset = 0
    if tail is not None:
        for line in await read_tail_async(path, tail):
            yield line
        # A partial last line was sent whole by read_tail; new bytes continue after it.
        offset = _size(path)
    pending = b""
    while True:
        ended = not alive()  # checked before reading: what the VMM wrote before it ended is read
        chunk, start, replaced = _read_from(path, offset)
        if replaced:  # a new boot replaced the file: start over
            offset, pending = 0, b""
            continue
        if start != offset:  # the log's head was trimmed away: what was pending is cut off
            pending = b""
        offset = start + len(chunk)
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            yield _decode(raw)
        while len(pending) > MAX_LINE:
            yield _decode(pending[:MAX_LINE])
            pending = pending[MAX_LINE:]
        if chunk:
            continue
        if not follow or ended:
            if pending:
                yield _decode(pending)
            return
        await asyncio.sleep(poll_interval)


class MarkerTimeout(Exception):
    pass


class VmEnded(Exception):
    pass


async def wait_for_marker(
    path: Path,
    marker: str,
    timeout: float,
    *,
    alive: Callable[[], bool],
    poll_interval: float = POLL_INTERVAL,
) -> float:
    """Seconds until ``marker`` appeared in the console (searched from the file's start).

    Raises MarkerTimeout when ``timeout`` passes, VmEnded when the VMM ends first.
    """
    needle = marker.encode()
    started = time.monotonic()
    offset = 0
    window = b""
    while True:
        ended = not alive()
        chunk, start, _ = _read_from(path, offset)
        if chunk:
            offset = start + len(chunk)
            window = window[-len(needle) :] + chunk if needle else chunk
            if needle in window:
                return time.monotonic() - started
            continue
        if ended:
            raise VmEnded(marker)
        if time.monotonic() - started > timeout:
            raise MarkerTimeout(marker)
        await asyncio.sleep(poll_interval)
