"""The serial console log of a VM: its tail, a follow stream, and waiting for a marker in it.

The VMM writes the guest's serial output to a file as it comes; these helpers read it while it
grows. Lines end at "\\n"; a trailing "\\r" (the guest's tty adds one) is dropped and undecodable
bytes are replaced. A line still being written is held back until its end arrives, or until the
VMM has ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

POLL_INTERVAL = 0.05
TAIL_CHUNK = 64 * 1024
MAX_LINE = 64 * 1024  # a guest writing without newlines is cut into lines this long
# What the Linux kernel prints as it powers off or reboots: the guest ended itself.
POWER_OFF_LINES = ("reboot: Power down", "reboot: Restarting system", "reboot: System halted")


def _decode(line: bytes) -> str:
    return line.rstrip(b"\r").decode(errors="replace")


def read_tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` complete or partial lines of the file; empty when it does not exist."""
    if lines <= 0:
        return []
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            start = size
            data = b""
            while start > 0 and data.count(b"\n") <= lines:
                start = max(0, start - TAIL_CHUNK)
                f.seek(start)
                data = f.read(size - start)
    except OSError:
        return []
    parts = data.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    if start > 0 and parts:
        parts.pop(0)  # probably cut in the middle
    return [_decode(p) for p in parts[-lines:]]


def powered_off(tail: list[str]) -> bool:
    """Whether the console's tail shows the kernel powering off or rebooting."""
    return any(marker in line for line in tail[-20:] for marker in POWER_OFF_LINES)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int, limit: int = 1024 * 1024) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes from ``offset``, and whether the file shrank below it (replaced)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < offset:
                return b"", True
            f.seek(offset)
            return f.read(limit), False
    except OSError:
        return b"", False


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
        for line in read_tail(path, tail):
            yield line
        # A partial last line was sent whole by read_tail; new bytes continue after it.
        offset = _size(path)
    pending = b""
    while True:
        ended = not alive()  # checked before reading: what the VMM wrote before it ended is read
        chunk, replaced = _read_from(path, offset)
        if replaced:  # a new boot replaced the file: start over
            offset, pending = 0, b""
            continue
        offset += len(chunk)
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
        chunk, _ = _read_from(path, offset)
        if chunk:
            offset += len(chunk)
            window = window[-len(needle) :] + chunk if needle else chunk
            if needle in window:
                return time.monotonic() - started
            continue
        if ended:
            raise VmEnded(marker)
        if time.monotonic() - started > timeout:
            raise MarkerTimeout(marker)
        await asyncio.sleep(poll_interval)
